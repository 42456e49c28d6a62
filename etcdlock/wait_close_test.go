package etcdlock_test

import (
	"context"
	"testing"
	"time"

	"github.com/dlock-dev/dlock"
	"github.com/dlock-dev/dlock/locktest"
)

// Closing the Backend ends its waits in progress: one that went on would
// keep its entry queued after Close, and could be granted for nobody.
func TestCloseEndsWaitsInProgress(t *testing.T) {
	eps := endpoints(t)
	holder, b := newBackend(t, eps), newBackend(t, eps)
	key := locktest.UniqueKey("close-wait")
	ctx := context.Background()
	held := dlock.Request{Key: key, Token: dlock.NewToken(), TTL: 30 * time.Second}
	if res, err := holder.Acquire(ctx, held); err != nil || !res.Acquired {
		t.Fatalf("holder: %+v, %v", res, err)
	}
	defer holder.Release(ctx, key, held.Token)
	type outcome struct {
		res dlock.Result
		err error
	}
	got := make(chan outcome, 1)
	go func() {
		res, err := b.AcquireWait(ctx, dlock.Request{Key: key, Token: dlock.NewToken(), TTL: 30 * time.Second})
		got <- outcome{res, err}
	}()
	time.Sleep(500 * time.Millisecond) // in its wait
	b.Close()
	select {
	case o := <-got:
		if o.res.Acquired {
			t.Errorf("a wait ended by Close acquired: %+v", o.res)
		}
	case <-time.After(2 * time.Second):
		t.Fatal("rule: Close ends the waits in progress; one still waits 2 s later")
	}
}
