package mysqllock_test

import (
	"context"
	"database/sql"
	"testing"
	"time"

	"github.com/go-sql-driver/mysql"

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

// TestGetLockLateGrantReplyIsNotTrusted: the reply of a waiter's grant
// reaches the client only after the server ended the waiter's session for
// idleness (its wait_timeout is its TTL) and another client took the key.
// The Locker must not hand out that grant as held.
func TestGetLockLateGrantReplyIsNotTrusted(t *testing.T) {
	newBackend(t, "") // migrated
	ctx, cancel := context.WithTimeout(t.Context(), 30*time.Second)
	defer cancel()
	cfg, _ := mysql.ParseDSN(dsn())
	p := newDelayProxy(t, cfg.Addr)
	pdb, err := sql.Open("mysql", proxiedDSN(t, p.ln.Addr().String()))
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { pdb.Close() })
	wg, err := mysqllock.NewGetLock(pdb, &mysqllock.Options{Table: testTable})
	if err != nil {
		t.Fatal(err)
	}
	defer wg.Close()
	waiter := dlock.New(wg, &dlock.Options{TTL: time.Second})
	defer waiter.Close(context.Background())
	holder := newGetLock(t, "")
	key := "lategrant/" + dlock.NewToken().String()
	held := dlock.Request{Key: key, Token: dlock.NewToken(), TTL: time.Minute}
	if res, err := holder.Acquire(ctx, held); err != nil || !res.Acquired {
		t.Fatalf("acquire: %+v, %v", res, err)
	}
	type outcome struct {
		lock *dlock.Lock
		err  error
	}
	got := make(chan outcome, 1)
	go func() {
		l, err := waiter.Acquire(ctx, key)
		got <- outcome{l, err}
	}()
	waitForWaiter(t, ctx, waiter, key)
	// The grant's reply (its columns name @dlock_got) is held back for
	// longer than the waiter's session may stay idle.
	p.only.Store("@dlock_got")
	p.delay.Store(int64(4 * time.Second))
	if err := holder.Release(ctx, key, held.Token); err != nil {
		t.Fatal(err)
	}
	// The server ends the waiter's idle session after 1 s, and the key is
	// free again.
	other := newGetLock(t, "")
	took := dlock.Request{Key: key, Token: dlock.NewToken(), TTL: time.Minute}
	for {
		res, err := other.Acquire(ctx, took)
		if err != nil {
			t.Fatal(err)
		}
		if res.Acquired {
			break
		}
		if ctx.Err() != nil {
			t.Fatal("the waiter's idle session was never ended by the server")
		}
		time.Sleep(50 * time.Millisecond)
	}
	defer other.Release(context.Background(), key, took.Token)
	select {
	case o := <-got:
		if o.err == nil && o.lock.Err() == nil {
			t.Fatalf("Acquire returned the late grant (fence %d) as held while another client holds the key", o.lock.Fence())
		}
	case <-time.After(8 * time.Second):
		// Still waiting, behind the new holder: right.
	}
}
