package mysqllock_test

import (
	"context"
	"fmt"
	"testing"
	"time"

	"github.com/dlock-dev/dlock"
	"github.com/dlock-dev/dlock/locktest"
	"github.com/dlock-dev/dlock/mysqllock"
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
