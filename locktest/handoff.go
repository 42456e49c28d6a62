package locktest

import (
	"context"
	"fmt"
	"testing"
	"time"

	"github.com/dlock-dev/dlock"
)

// ReleaseHandsOff checks a store whose exclusive release hands the lock to
// the first queued waiter in the release itself: three waiters queue on a
// key that newLocker(0) holds, one after the other (each listed by the
// holder's ListWaiters before the next starts); after each Release returns, List
// on the holder's Locker shows the next waiter holding the key with the
// next fence, and that waiter's Acquire returns its lease with at least
// half of its 30 s TTL left. After the last release the key is free.
func ReleaseHandsOff(t *testing.T, newLocker func(i int) *dlock.Locker, key string) {
	t.Helper()
	ctx, cancel := context.WithTimeout(context.Background(), 60*time.Second)
	defer cancel()
	const ttl = 30 * time.Second
	holder := newLocker(0)
	lk, err := holder.TryAcquire(ctx, key, dlock.WithTTL(ttl))
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
		w := newLocker(i + 1)
		results[i] = make(chan got, 1)
		go func() {
			lk, err := w.Acquire(ctx, key, dlock.WithTTL(ttl), dlock.WithOwner(fmt.Sprint("waiter-", i)))
			results[i] <- got{lk, err}
		}()
		WaitQueued(t, holder, key, i+1)
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
		if left := time.Until(r.lk.Deadline()); left < ttl/2 {
			t.Errorf("waiter-%d: %s left of a %s lease right after its grant", i, left, ttl)
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

// WaitQueued waits until key has n waiters in l's ListWaiters, for up to
// 5 s, and fails the test after that.
func WaitQueued(t *testing.T, l *dlock.Locker, key string, n int) {
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
