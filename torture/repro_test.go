package torture

import (
	"context"
	"database/sql"
	"errors"
	"os"
	"testing"
	"time"

	"github.com/dlock-dev/dlock"
	"github.com/dlock-dev/dlock/mysqllock"
)

// Minimal reproductions of what the harness found (see README.md,
// "Findings"). They run only with DLOCK_TORTURE_REPRO=1: one is a regression
// test of a fixed bug, one shows a documented limitation of the session
// strategies (it fails by design). The trigger bug's regression test lives
// in mysqllock (TestAuditTriggerOnTable).

func reproDB(t *testing.T) *sql.DB {
	t.Helper()
	if os.Getenv("DLOCK_TORTURE_REPRO") != "1" {
		t.Skip("reproduction of an open bug: set DLOCK_TORTURE_REPRO=1")
	}
	dsn, _ := testDSN(t)
	db, err := sql.Open("mysql", dsn)
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { db.Close() })
	return db
}

func reproLease(t *testing.T, db *sql.DB, table string) *mysqllock.Backend {
	t.Helper()
	ctx := context.Background()
	if _, err := db.ExecContext(ctx, "DROP TABLE IF EXISTS "+table+", "+table+"_session, "+table+"_rows, "+table+"_claims, "+table+"_holders, "+table+"_journal, "+table+"_epoch, "+table+"_run"); err != nil {
		t.Fatal(err)
	}
	b, err := mysqllock.New(db, &mysqllock.Options{Table: table})
	if err != nil {
		t.Fatal(err)
	}
	if err := b.Migrate(ctx); err != nil {
		t.Fatal(err)
	}
	closeBackend(t, b)
	return b
}

func closeBackend(t *testing.T, b any) {
	if c, ok := b.(interface{ Close() error }); ok {
		t.Cleanup(func() { _ = c.Close() })
	}
}

// With doorbells (mysqllock's working tree), a lease holder that stops
// renewing but whose process stays connected (a GC pause, SIGSTOP, a
// partition that drops packets) keeps its doorbell session: every later
// acquisition takes the expired lease, fails to take the doorbell, and hands
// the lease back. The key stays blocked until the holder's session ends
// (the server's wait_timeout, 8 hours by default), not for its TTL.
func TestReproDoorbellStalledHolderBlocksKey(t *testing.T) {
	db := reproDB(t)
	ctx := context.Background()
	reproLease(t, db, "torture_repro_bell")
	// The stalled holder: its own pool (so its own doorbell session), one
	// acquisition, never renewed.
	db1, err := sql.Open("mysql", os.Getenv("DLOCK_MYSQL_DSN")+"")
	if os.Getenv("DLOCK_MYSQL_DSN") == "" {
		db1, err = sql.Open("mysql", "root@tcp(127.0.0.1:3306)/test")
	}
	if err != nil {
		t.Fatal(err)
	}
	defer db1.Close()
	b1, err := mysqllock.New(db1, &mysqllock.Options{Table: "torture_repro_bell"})
	if err != nil {
		t.Fatal(err)
	}
	closeBackend(t, b1)
	res, err := b1.Acquire(ctx, dlock.Request{Key: "k", Token: dlock.NewToken(), TTL: time.Second})
	if err != nil || !res.Acquired {
		t.Fatalf("stalled holder's acquisition: %+v %v", res, err)
	}
	b2, err := mysqllock.New(db, &mysqllock.Options{Table: "torture_repro_bell"})
	if err != nil {
		t.Fatal(err)
	}
	closeBackend(t, b2)
	l := dlock.New(b2, nil)
	defer l.Close(ctx)
	actx, cancel := context.WithTimeout(ctx, 4*time.Second)
	defer cancel()
	start := time.Now()
	lk, err := l.Acquire(actx, "k", dlock.WithTTL(time.Second))
	if err != nil {
		t.Fatalf("the holder's 1s lease expired, yet Acquire failed after %s: %v", time.Since(start).Round(time.Millisecond), err)
	}
	t.Logf("taken over after %s", time.Since(start).Round(time.Millisecond))
	_ = lk.Release(ctx)
}

// The session strategies lose the lock the moment the server ends the
// holder's session (a cut connection, a proxy restart, KILL): another
// client can take it at once, while the holder's Lock reports it held until
// its next renewal. dlock's contract (lock.go: Done closes "before the
// store lets anyone else take it") does not hold for them.
func TestReproSessionLockTakenBeforeHolderIsTold(t *testing.T) {
	db := reproDB(t)
	ctx := context.Background()
	reproLease(t, db, "torture_repro_sess")
	for _, tc := range []struct {
		name string
		newB func(*sql.DB) (dlock.Backend, error)
	}{
		{"getlock", func(db *sql.DB) (dlock.Backend, error) {
			return mysqllock.NewGetLock(db, &mysqllock.Options{Table: "torture_repro_sess"})
		}},
		{"rowlock", func(db *sql.DB) (dlock.Backend, error) {
			return mysqllock.NewRowLock(db, &mysqllock.Options{Table: "torture_repro_sess"})
		}},
	} {
		t.Run(tc.name, func(t *testing.T) {
			key := "k-" + tc.name
			ba, err := tc.newB(db)
			if err != nil {
				t.Fatal(err)
			}
			closeBackend(t, ba)
			la := dlock.New(ba, nil)
			defer la.Close(ctx)
			lk, err := la.Acquire(ctx, key, dlock.WithTTL(3*time.Second))
			if err != nil {
				t.Fatal(err)
			}
			var conn int64
			if err := db.QueryRowContext(ctx, "SELECT conn_id FROM torture_repro_sess_session WHERE name = ?", key).Scan(&conn); err != nil {
				t.Fatal(err)
			}
			if _, err := db.ExecContext(ctx, "KILL CONNECTION ?", conn); err != nil {
				t.Fatal(err)
			}
			bb, err := tc.newB(db)
			if err != nil {
				t.Fatal(err)
			}
			closeBackend(t, bb)
			lb := dlock.New(bb, nil)
			defer lb.Close(ctx)
			var other *dlock.Lock
			for deadline := time.Now().Add(time.Second); time.Now().Before(deadline); time.Sleep(10 * time.Millisecond) {
				if other, err = lb.TryAcquire(ctx, key, dlock.WithTTL(3*time.Second)); err == nil {
					break
				}
			}
			if other == nil {
				t.Skipf("the other client could not take the key: %v", err)
			}
			defer other.Release(ctx)
			if lk.Err() == nil {
				t.Errorf("another client holds %q (fence %d) while the first holder's Lock (fence %d) still reports it held", key, other.Fence(), lk.Fence())
			}
			select {
			case <-lk.Done():
				t.Logf("the first holder was told %v", lk.Err())
			case <-time.After(3 * time.Second):
				t.Error("the first holder was never told")
			}
			if err := lk.Release(ctx); err != nil && !errors.Is(err, dlock.ErrNotHeld) {
				t.Log(err)
			}
		})
	}
}
