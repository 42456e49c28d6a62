package pglock_test

import (
	"context"
	"fmt"
	"testing"
	"time"

	"github.com/dlock-dev/dlock"
)

// queued waits until key has n waiters in l's listing.
func queued(t *testing.T, l *dlock.Locker, key string, n int) {
	t.Helper()
	for range 500 {
		ws, err := l.ListWaiters(context.Background(), key)
		if err != nil {
			t.Fatal(err)
		}
		if len(ws) >= n {
			return
		}
		time.Sleep(10 * time.Millisecond)
	}
	t.Fatalf("%q: fewer than %d waiters after 5s", key, n)
}

// TestReleaseHandsTheLeaseToTheFirstWaiter: an exclusive release grants the
// key to the first queued exclusive waiter in its own statement: when
// Release returns, the waiters hold the key in their order of arrival, each
// with the next fence, before any of them has run a statement.
func TestReleaseHandsTheLeaseToTheFirstWaiter(t *testing.T) {
	ctx, cancel := context.WithTimeout(context.Background(), 60*time.Second)
	defer cancel()
	pool := open(t, "handoff")
	holder := dlock.New(newLease(t, pool), nil)
	defer holder.Close(context.Background())
	key := "handoff/" + dlock.NewToken().String()
	lk, err := holder.TryAcquire(ctx, key, dlock.WithTTL(30*time.Second))
	if err != nil {
		t.Fatal(err)
	}
	type got struct {
		lk  *dlock.Lock
		err error
	}
	const n = 3
	results := make([]chan got, n)
	for i := range n {
		w := dlock.New(newLease(t, pool), nil)
		defer w.Close(context.Background())
		results[i] = make(chan got, 1)
		go func() {
			lk, err := w.Acquire(ctx, key, dlock.WithTTL(30*time.Second), dlock.WithOwner(fmt.Sprint("waiter-", i)))
			results[i] <- got{lk, err}
		}()
		queued(t, holder, key, i+1)
	}
	fence := lk.Fence()
	release := lk.Release
	for i := range n {
		if err := release(ctx); err != nil {
			t.Fatal(err)
		}
		fence++
		hs, err := holder.List(ctx, key)
		if err != nil {
			t.Fatal(err)
		}
		if len(hs) != 1 || hs[0].Owner != fmt.Sprint("waiter-", i) || hs[0].Fence != fence {
			t.Fatalf("release %d: holders right after it %+v; want waiter-%d with fence %d", i, hs, i, fence)
		}
		r := <-results[i]
		if r.err != nil {
			t.Fatalf("waiter-%d: %v", i, r.err)
		}
		if r.lk.Fence() != fence {
			t.Errorf("waiter-%d: fence %d, the store's %d", i, r.lk.Fence(), fence)
		}
		if left := time.Until(r.lk.Deadline()); left < 15*time.Second {
			t.Errorf("waiter-%d: %s left of a 30s lease right after its grant", i, left)
		}
		release = r.lk.Release
	}
	if err := release(ctx); err != nil {
		t.Fatal(err)
	}
	lk, err = holder.TryAcquire(ctx, key)
	if err != nil {
		t.Fatalf("the key after the last release: %v", err)
	}
	lk.Release(ctx)
}
