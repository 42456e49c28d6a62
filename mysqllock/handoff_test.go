package mysqllock_test

import (
	"context"
	"database/sql"
	"errors"
	"strings"
	"testing"
	"time"

	"github.com/dlock-dev/dlock"
	"github.com/dlock-dev/dlock/locktest"
	"github.com/dlock-dev/dlock/mysqllock"
	"github.com/go-sql-driver/mysql"
)

// TestReleaseHandsTheLeaseToTheFirstWaiter: three waiters queue on a held
// key's doorbell; each release hands the lease to the first of them in its
// own transaction, so the key is held by that waiter, with the next fence,
// as soon as the release returns (without handoffs it is free then, until
// the woken waiter takes it), and the waiter's lease has most of its TTL.
func TestReleaseHandsTheLeaseToTheFirstWaiter(t *testing.T) {
	locktest.ReleaseHandsOff(t, func(int) *dlock.Locker { return locktest.NewLocker(t, newBackend(t, "")) },
		locktest.UniqueKey("handoff"))
}

// TestLeaseWithoutHandoffProcedures: on tables migrated by an earlier
// version (no queue table, no procedures), or whose queue table is gone,
// waits block on the doorbell and releases go on as without handoffs: the
// woken waiter takes the lease itself, with the next fence.
func TestLeaseWithoutHandoffProcedures(t *testing.T) {
	for name, drops := range map[string][]string{
		"no procedures":  {"DROP PROCEDURE `%s_wait5`", "DROP PROCEDURE `%s_hand5`", "DROP TABLE `%s_queue`"},
		"no queue table": {"DROP TABLE `%s_queue`"},
	} {
		t.Run(name, func(t *testing.T) {
			ctx, cancel := context.WithTimeout(context.Background(), 60*time.Second)
			defer cancel()
			db := open(t, "")
			table := "dlock_nohand_" + dlock.NewToken().String()[:8]
			freshSchema(t, db, table)
			for _, drop := range drops {
				if _, err := db.ExecContext(ctx, strings.ReplaceAll(drop, "%s", table)); err != nil {
					t.Fatal(err)
				}
			}
			be := newLease(t, "", &mysqllock.Options{Table: table})
			holder := locktest.NewLocker(t, be)
			waiter := locktest.NewLocker(t, newLease(t, "", &mysqllock.Options{Table: table}))
			key := locktest.UniqueKey("nohandoff")
			for round := range 3 {
				lk, err := holder.Acquire(ctx, key, dlock.WithTTL(30*time.Second))
				if err != nil {
					t.Fatal(err)
				}
				got := acquireLater(ctx, waiter, key)
				locktest.WaitQueued(t, holder, key, 1) // blocked on the doorbell, not polling
				if err := lk.Release(ctx); err != nil {
					t.Fatalf("round %d: release: %v", round, err)
				}
				wk, err := got()
				if err != nil {
					t.Fatalf("round %d: waiter: %v", round, err)
				}
				if wk.Fence() != lk.Fence()+1 {
					t.Errorf("round %d: waiter's fence %d after %d", round, wk.Fence(), lk.Fence())
				}
				if err := wk.Release(ctx); err != nil {
					t.Fatal(err)
				}
			}
		})
	}
}

// TestReleaseDelayedPastTheLeaseDoesNotRevive: a release whose statement
// waits for the key's row (another transaction holds it) until after the
// lease's end must not move that end later: the release ends the lease at
// the instant it checked it, not when it got the row.
func TestReleaseDelayedPastTheLeaseDoesNotRevive(t *testing.T) {
	ctx, cancel := context.WithTimeout(context.Background(), 30*time.Second)
	defer cancel()
	be := newBackend(t, "")
	db := open(t, "parseTime=true")
	key := locktest.UniqueKey("late-release")
	tok := dlock.NewToken()
	r, err := be.Acquire(ctx, dlock.Request{Key: key, Token: tok, TTL: time.Second})
	if err != nil || !r.Acquired {
		t.Fatal(r, err)
	}
	var end time.Time
	if err := db.QueryRowContext(ctx, "SELECT expires_at FROM "+testTable+" WHERE name = ?", key).Scan(&end); err != nil {
		t.Fatal(err)
	}
	tx, err := db.BeginTx(ctx, nil)
	if err != nil {
		t.Fatal(err)
	}
	defer tx.Rollback()
	var fence uint64
	if err := tx.QueryRowContext(ctx, "SELECT fence FROM "+testTable+" WHERE name = ? FOR UPDATE", key).Scan(&fence); err != nil {
		t.Fatal(err)
	}
	released := make(chan error, 1)
	go func() { released <- be.Release(ctx, key, tok) }()
	time.Sleep(1500 * time.Millisecond) // past the lease's end, the release waiting for the row
	if err := tx.Commit(); err != nil {
		t.Fatal(err)
	}
	<-released // released, or found expired: either is right
	var after time.Time
	if err := db.QueryRowContext(ctx, "SELECT expires_at FROM "+testTable+" WHERE name = ?", key).Scan(&after); err != nil {
		t.Fatal(err)
	}
	if after.After(end) {
		t.Errorf("the lease ended at %s; after a release that waited past it, the row says %s", end.Format(time.StampMicro), after.Format(time.StampMicro))
	}
}

// TestHandoffsStayInTheTablesDatabase: a doorbell Connector whose database is
// not db's (the same server, another schema with a lock table of the same
// name) must not make the lease strategy's waits and releases run the other
// schema's procedures: a waiter would then be handed the other table's
// lease and report the key acquired while its own table has it free, for
// any other client to take as well.
func TestHandoffsStayInTheTablesDatabase(t *testing.T) {
	ctx, cancel := context.WithTimeout(context.Background(), 60*time.Second)
	defer cancel()
	db := open(t, "")
	table := "dlock_xdb_" + dlock.NewToken().String()[:8]
	other := "dlock_other_" + dlock.NewToken().String()[:8]
	if _, err := db.ExecContext(ctx, "CREATE DATABASE `"+other+"`"); err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { db.ExecContext(context.Background(), "DROP DATABASE IF EXISTS `"+other+"`") })
	freshSchema(t, db, table)
	cfg, err := mysql.ParseDSN(dsn())
	if err != nil {
		t.Fatal(err)
	}
	cfg.DBName = other
	otherDB, err := sql.Open("mysql", cfg.FormatDSN())
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { otherDB.Close() })
	ob, err := mysqllock.New(otherDB, &mysqllock.Options{Table: table})
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { ob.Close() })
	if err := ob.Migrate(ctx); err != nil {
		t.Fatal(err)
	}
	bells, err := mysql.NewConnector(cfg) // the other schema's database
	if err != nil {
		t.Fatal(err)
	}
	misrouted := newLease(t, "", &mysqllock.Options{Table: table, Connector: bells})
	plain := newLease(t, "", &mysqllock.Options{Table: table, NoDoorbell: true})

	key := locktest.UniqueKey("xdb")
	elsewhere := locktest.NewLocker(t, ob)
	waiter := locktest.NewLocker(t, misrouted)
	lk, err := elsewhere.Acquire(ctx, key, dlock.WithTTL(30*time.Second)) // and the key's doorbell
	if err != nil {
		t.Fatal(err)
	}
	// A holder of the key in the waiter's own table, so that the waiter waits.
	hk, err := locktest.NewLocker(t, plain).Acquire(ctx, key, dlock.WithTTL(30*time.Second))
	if err != nil {
		t.Fatal(err)
	}
	got := acquireLater(ctx, waiter, key)
	locktest.WaitQueued(t, waiter, key, 1)
	if err := hk.Release(ctx); err != nil {
		t.Fatal(err)
	}
	if err := lk.Release(ctx); err != nil {
		t.Fatal(err)
	}
	wk, err := got()
	if err != nil {
		t.Fatal(err)
	}
	defer wk.Release(ctx)
	// The waiter holds the key in its own table: nobody else takes it there.
	if ok, err := locktest.NewLocker(t, plain).TryAcquire(ctx, key); err == nil {
		ok.Release(ctx)
		t.Fatalf("another client of the waiter's table took the key it holds (fence %d, waiter's %d)", ok.Fence(), wk.Fence())
	} else if !errors.Is(err, dlock.ErrNotAcquired) {
		t.Fatal(err)
	}
}

// acquireLater starts a blocking acquisition of key (TTL 30 s) on l and
// returns a function that waits for its outcome.
func acquireLater(ctx context.Context, l *dlock.Locker, key string) func() (*dlock.Lock, error) {
	type outcome struct {
		lk  *dlock.Lock
		err error
	}
	ch := make(chan outcome, 1)
	go func() {
		lk, err := l.Acquire(ctx, key, dlock.WithTTL(30*time.Second))
		ch <- outcome{lk, err}
	}()
	return func() (*dlock.Lock, error) {
		o := <-ch
		return o.lk, o.err
	}
}

// TestWokenWaiterPassesTheCommitBarrier: a woken waiter reads its grant only
// once the handoff's commit barrier is free (the handoff's commit flushed),
// and a release that cannot hold the barrier hands nothing over. Here
// another session holds the barrier: the release frees the lease without
// handing it, the woken waiter waits at the barrier, and once the barrier
// is free it takes the lease itself, with the next fence.
func TestWokenWaiterPassesTheCommitBarrier(t *testing.T) {
	ctx, cancel := context.WithTimeout(context.Background(), 60*time.Second)
	defer cancel()
	key := locktest.UniqueKey("barrier")
	holder := locktest.NewLocker(t, newBackend(t, ""))
	waiter := locktest.NewLocker(t, newBackend(t, ""))
	lk, err := holder.Acquire(ctx, key, dlock.WithTTL(30*time.Second))
	if err != nil {
		t.Fatal(err)
	}
	got := acquireLater(ctx, waiter, key)
	locktest.WaitQueued(t, holder, key, 1)

	conn, err := open(t, "").Conn(ctx)
	if err != nil {
		t.Fatal(err)
	}
	defer conn.Close()
	var took int
	if err := conn.QueryRowContext(ctx, "SELECT GET_LOCK(?, 5)", mysqllock.BarrierName(key)).Scan(&took); err != nil || took != 1 {
		t.Fatalf("barrier: %d %v", took, err)
	}
	if err := lk.Release(ctx); err != nil {
		t.Fatal(err)
	}
	waited := make(chan struct{})
	var wk *dlock.Lock
	var werr error
	go func() {
		defer close(waited)
		wk, werr = got()
	}()
	select {
	case <-waited:
		t.Fatalf("the waiter returned while the barrier was held: %v", werr)
	case <-time.After(500 * time.Millisecond):
	}
	if _, err := conn.ExecContext(ctx, "DO RELEASE_LOCK(?)", mysqllock.BarrierName(key)); err != nil {
		t.Fatal(err)
	}
	<-waited
	if werr != nil {
		t.Fatal(werr)
	}
	defer wk.Release(ctx)
	if wk.Fence() != lk.Fence()+1 {
		t.Errorf("waiter's fence %d after %d", wk.Fence(), lk.Fence())
	}
}
