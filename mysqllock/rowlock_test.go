package mysqllock_test

import (
	"context"
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
}

// TestRowLockWaitUnderMaxStatementTime waits for a held key on sessions
// whose max_statement_time (MariaDB; set here for the test's sessions only,
// as a user's grants or a DSN would) is shorter than the wait: the wait must
// last until the release, not fail with error 1969 when the limit passes.
func TestRowLockWaitUnderMaxStatementTime(t *testing.T) {
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
