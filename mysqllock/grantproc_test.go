package mysqllock_test

import (
	"context"
	"testing"
	"time"

	"github.com/dlock-dev/dlock"
	"github.com/dlock-dev/dlock/mysqllock"
)

// getlockFences takes key with a try and then with a wait behind another
// holder, on a GetLock of table, and returns the three fences in order of
// grant.
func getlockFences(t *testing.T, table, key string) [3]uint64 {
	t.Helper()
	ctx, cancel := context.WithTimeout(t.Context(), 20*time.Second)
	defer cancel()
	db := open(t, "")
	var fences [3]uint64
	var ls [2]*dlock.Locker
	for i := range ls {
		g, err := mysqllock.NewGetLock(db, &mysqllock.Options{Table: table})
		if err != nil {
			t.Fatal(err)
		}
		defer g.Close()
		ls[i] = dlock.New(g, nil)
		defer ls[i].Close(context.Background())
	}
	first, err := ls[0].TryAcquire(ctx, key, dlock.WithOwner("first"))
	if err != nil {
		t.Fatalf("try on a free key: %v", err)
	}
	fences[0] = first.Fence()
	got := make(chan *dlock.Lock, 1)
	go func() {
		lk, err := ls[1].Acquire(ctx, key, dlock.WithOwner("waiter"))
		if err != nil {
			t.Errorf("wait: %v", err)
		}
		got <- lk
	}()
	waitForWaiter(t, ctx, ls[0], key)
	if err := first.Release(ctx); err != nil {
		t.Fatal(err)
	}
	waiter := <-got
	if waiter == nil {
		t.FailNow()
	}
	fences[1] = waiter.Fence()
	hs, err := ls[1].List(ctx, key)
	if err != nil || len(hs) != 1 || hs[0].Owner != "waiter" || hs[0].Fence != fences[1] {
		t.Errorf("List after the waiter's grant: %+v, %v; want the waiter with its fence %d", hs, err, fences[1])
	}
	if err := waiter.Release(ctx); err != nil {
		t.Fatal(err)
	}
	again, err := ls[0].TryAcquire(ctx, key)
	if err != nil {
		t.Fatalf("try after the releases: %v", err)
	}
	fences[2] = again.Fence()
	if err := again.Release(ctx); err != nil {
		t.Fatal(err)
	}
	return fences
}

// waitForWaiter returns once l lists a waiter for key: the wait runs in
// the server, named as ListWaiters reads it.
func waitForWaiter(t *testing.T, ctx context.Context, l *dlock.Locker, key string) {
	t.Helper()
	for ctx.Err() == nil {
		ws, err := l.ListWaiters(ctx, key)
		if err != nil {
			t.Fatal(err)
		}
		if len(ws) == 1 && ws[0].Key == key {
			return
		}
		time.Sleep(10 * time.Millisecond)
	}
	t.Fatalf("no waiter for %s listed", key)
}

// TestGetLockGrantProcedure: Migrate creates the grant procedure, running
// with the caller's privileges; grants made by it, on a try and after a
// wait, record the holder and give strictly increasing fences, and the
// wait is listed.
func TestGetLockGrantProcedure(t *testing.T) {
	db := open(t, "")
	table := "dlock_proc_" + dlock.NewToken().String()[:8]
	freshSchema(t, db, table)
	var security string
	err := db.QueryRowContext(t.Context(), `SELECT SECURITY_TYPE FROM information_schema.ROUTINES
WHERE ROUTINE_SCHEMA = DATABASE() AND ROUTINE_NAME = ?`, table+"_grant1").Scan(&security)
	if err != nil || security != "INVOKER" {
		t.Fatalf("the grant procedure after Migrate: security %q, %v; want INVOKER", security, err)
	}
	checkFences(t, getlockFences(t, table, "proc/"+table))
}

// TestGetLockWithoutGrantProcedure: on a server without the grant
// procedure (a table migrated by an older version, or a user without
// CREATE ROUTINE), GetLock grants with two statements, as correctly.
func TestGetLockWithoutGrantProcedure(t *testing.T) {
	db := open(t, "")
	table := "dlock_noproc_" + dlock.NewToken().String()[:8]
	freshSchema(t, db, table)
	if _, err := db.ExecContext(t.Context(), "DROP PROCEDURE `"+table+"_grant1`"); err != nil {
		t.Fatal(err)
	}
	checkFences(t, getlockFences(t, table, "noproc/"+table))
}

func checkFences(t *testing.T, f [3]uint64) {
	t.Helper()
	if !(0 < f[0] && f[0] < f[1] && f[1] < f[2]) {
		t.Errorf("fences %v in order of grant; want them strictly increasing", f)
	}
}
