package mysqllock_test

import (
	"context"
	"strings"
	"testing"
	"time"

	"github.com/dlock-dev/dlock"
	"github.com/dlock-dev/dlock/locktest"
	"github.com/dlock-dev/dlock/mysqllock"
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
		"no procedures":  {"DROP PROCEDURE `%s_wait4`", "DROP PROCEDURE `%s_hand4`", "DROP TABLE `%s_queue`"},
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
				got := make(chan error, 1)
				var wk *dlock.Lock
				go func() {
					var err error
					wk, err = waiter.Acquire(ctx, key, dlock.WithTTL(30*time.Second))
					got <- err
				}()
				locktest.WaitQueued(t, holder, key, 1) // blocked on the doorbell, not polling
				if err := lk.Release(ctx); err != nil {
					t.Fatalf("round %d: release: %v", round, err)
				}
				if err := <-got; err != nil {
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
