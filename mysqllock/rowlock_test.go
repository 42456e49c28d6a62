package mysqllock_test

import (
	"context"
	"errors"
	"fmt"
	"testing"
	"time"

	"github.com/dlock-dev/dlock"
	"github.com/dlock-dev/dlock/locktest"
	"github.com/dlock-dev/dlock/mysqllock"
	"github.com/go-sql-driver/mysql"
)

// TestRowLockFenceNeedsUnbrokenHold kills the locking session between the
// locking read and the fence's write, and lets another client take the key
// meanwhile. The rule: a fence is reported only if the row lock was held
// across its write, so the first acquisition must not be reported acquired
// (its fence, written after the second client's, would be the larger one
// while the second client holds the key).
func TestRowLockFenceNeedsUnbrokenHold(t *testing.T) {
	ctx := t.Context()
	first, second := newRowLock(t, ""), newRowLock(t, "")
	admin := open(t, "")
	key := locktest.UniqueKey("rowlock-fence-order")
	var got dlock.Result
	var gotErr error
	killed := false
	second1 := dlock.Request{Key: key, Token: dlock.NewToken(), TTL: 10 * time.Second}
	mysqllock.OnRowLocked(t, func(k string, id int64) {
		if k != key || killed { // only the first client's locking session
			return
		}
		killed = true
		if _, err := admin.ExecContext(ctx, fmt.Sprintf("KILL CONNECTION %d", id)); err != nil {
			gotErr = err
			return
		}
		wctx, cancel := context.WithTimeout(ctx, 20*time.Second)
		defer cancel()
		got, gotErr = second.AcquireWait(wctx, second1)
	})
	res, err := first.Acquire(ctx, dlock.Request{Key: key, Token: dlock.NewToken(), TTL: 10 * time.Second})
	if gotErr != nil || !got.Acquired {
		t.Fatalf("the second client did not take the key after the first one's session was killed: %+v, %v", got, gotErr)
	}
	defer second.Release(ctx, key, second1.Token)
	if err == nil && res.Acquired {
		t.Fatalf("a fence written after the locking session died was reported: first client acquired with fence %d, while the second client holds the key with fence %d", res.Fence, got.Fence)
	}
	// The failed acquisition left the holder's row as the holder wrote it.
	hs, err := second.List(ctx, key)
	if err != nil || len(hs) != 1 || hs[0].Token != second1.Token || hs[0].Fence != got.Fence {
		t.Fatalf("List after the failed acquisition: %+v, %v; want the holder (fence %d)", hs, err, got.Fence)
	}
}

// TestRowLockWaitUnderMaxStatementTime waits for a held key on sessions
// whose max_statement_time (MariaDB; set here for the test's sessions only,
// as a user's grants or a DSN would) is shorter than the wait: the wait must
// last until the release, not fail with error 1969 when the limit passes.
func TestRowLockWaitUnderMaxStatementTime(t *testing.T) {
	var limit float64
	if err := open(t, "").QueryRowContext(t.Context(), "SELECT @@max_statement_time").Scan(&limit); err != nil {
		t.Skipf("SKIPPING: the test server has no max_statement_time (MariaDB only): %v", err)
	}
	for name, params := range map[string]string{
		"prepared":     "max_statement_time=0.3",
		"interpolated": "max_statement_time=0.3&interpolateParams=true",
	} {
		t.Run(name, func(t *testing.T) { testWaitUnderMaxStatementTime(t, params) })
	}
}

func testWaitUnderMaxStatementTime(t *testing.T, params string) {
	ctx := t.Context()
	holder := newRowLock(t, "")
	waiter := newRowLock(t, params)
	key := locktest.UniqueKey("rowlock-max-statement-time")
	held := dlock.Request{Key: key, Token: dlock.NewToken(), TTL: 10 * time.Second}
	if res, err := holder.Acquire(ctx, held); err != nil || !res.Acquired {
		t.Fatalf("holder: %+v, %v", res, err)
	}
	type outcome struct {
		res dlock.Result
		err error
	}
	done := make(chan outcome, 1)
	req := dlock.Request{Key: key, Token: dlock.NewToken(), TTL: 10 * time.Second}
	go func() {
		wctx, cancel := context.WithTimeout(ctx, 30*time.Second)
		defer cancel()
		res, err := waiter.AcquireWait(wctx, req)
		done <- outcome{res, err}
	}()
	var o outcome
	select {
	case o = <-done: // the wait ended before the release
		holder.Release(ctx, key, held.Token)
	case <-time.After(1500 * time.Millisecond): // five times the limit
		if err := holder.Release(ctx, key, held.Token); err != nil {
			t.Fatal(err)
		}
		o = <-done
	}
	if o.err != nil || !o.res.Acquired {
		t.Fatalf("a wait longer than max_statement_time did not last until the release: %+v, %v", o.res, o.err)
	}
	if err := waiter.Release(ctx, key, req.Token); err != nil {
		t.Fatal(err)
	}
}

// TestRowLockWaitCutErrors checks which server errors end a rowlock wait
// with "not acquired": a statement time limit (MariaDB's max_statement_time,
// MySQL's max_execution_time) that the wait could not lift.
func TestRowLockWaitCutErrors(t *testing.T) {
	for _, c := range []struct {
		err error
		cut bool
	}{
		{&mysql.MySQLError{Number: 1969, Message: "Query execution was interrupted (max_statement_time exceeded)"}, true},
		{&mysql.MySQLError{Number: 3024, Message: "Query execution was interrupted, maximum statement execution time exceeded"}, true},
		{fmt.Errorf("wrapped: %w", &mysql.MySQLError{Number: 1969}), true},
		{nil, false},
		{&mysql.MySQLError{Number: 1317, Message: "Query execution was interrupted"}, false},
		{mysql.ErrInvalidConn, false},
		{context.DeadlineExceeded, false},
	} {
		if got := mysqllock.WaitCut(c.err); got != c.cut {
			t.Errorf("waitCut(%v) = %v, want %v", c.err, got, c.cut)
		}
	}
}

// TestRowLockSmallPools runs rowlock over pools with small limits. Each held
// lock pins a connection and each grant needs another: a pool of 1 is
// refused (at NewRowLock, and at each call if the limit is lowered after),
// with a limit of n up to n−1 locks are held, an attempt beyond that fails
// at once instead of blocking until its deadline, a wait beyond it takes the
// key once a lock is released, and no session is kept out of the pool once
// its lock is released.
func TestRowLockSmallPools(t *testing.T) {
	ctx := t.Context()
	newBackend(t, "") // migrated
	db := open(t, "")
	db.SetMaxOpenConns(1)
	if _, err := mysqllock.NewRowLock(db, &mysqllock.Options{Table: testTable}); !errors.Is(err, dlock.ErrInvalidOption) {
		t.Fatalf("NewRowLock over a pool of 1: %v, want ErrInvalidOption", err)
	}
	db.SetMaxOpenConns(0)
	r, err := mysqllock.NewRowLock(db, &mysqllock.Options{Table: testTable})
	if err != nil {
		t.Fatal(err)
	}
	defer r.Close()
	db.SetMaxOpenConns(1)
	req := func() dlock.Request {
		return dlock.Request{Key: locktest.UniqueKey("rowlock-pool"), Token: dlock.NewToken(), TTL: 10 * time.Second}
	}
	bounded := func() (context.Context, context.CancelFunc) { return context.WithTimeout(ctx, 20*time.Second) }
	c, cancel := bounded()
	if _, err := r.Acquire(c, req()); !errors.Is(err, dlock.ErrInvalidOption) {
		t.Errorf("Acquire after the pool's limit was lowered to 1: %v, want ErrInvalidOption", err)
	}
	cancel()

	for _, n := range []int{2, 3} {
		db.SetMaxOpenConns(n)
		var held []dlock.Request
		for range n - 1 {
			q := req()
			c, cancel := bounded()
			res, err := r.Acquire(c, q)
			cancel()
			if err != nil || !res.Acquired {
				t.Fatalf("pool of %d: lock %d of %d: %+v, %v", n, len(held)+1, n-1, res, err)
			}
			held = append(held, q)
		}
		c, cancel := bounded()
		res, err := r.Acquire(c, req())
		cancel()
		if err == nil || errors.Is(err, context.DeadlineExceeded) {
			t.Errorf("pool of %d with %d locks held: an attempt at another key: %+v, %v; want an error at once", n, n-1, res, err)
		}
		// A wait for another key is served by the first release.
		waited := make(chan error, 1)
		w := req()
		go func() {
			c, cancel := bounded()
			defer cancel()
			res, err := r.AcquireWait(c, w)
			if err == nil && !res.Acquired {
				err = fmt.Errorf("not acquired: %+v", res)
			}
			waited <- err
		}()
		time.Sleep(100 * time.Millisecond) // the wait is waiting (else it takes the key at once)
		if err := r.Release(ctx, held[0].Key, held[0].Token); err != nil {
			t.Fatal(err)
		}
		if err := <-waited; err != nil {
			t.Fatalf("pool of %d: a wait for a connection: %v", n, err)
		}
		held = append(held[1:], w)
		for _, q := range held {
			if err := r.Release(ctx, q.Key, q.Token); err != nil {
				t.Fatal(err)
			}
		}
		if inUse := db.Stats().InUse; inUse != 0 {
			t.Errorf("pool of %d: %d connections still checked out with no lock held", n, inUse)
		}
	}
}
