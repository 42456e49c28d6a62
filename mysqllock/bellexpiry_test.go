package mysqllock_test

import (
	"context"
	"testing"
	"time"

	"github.com/dlock-dev/dlock"
	"github.com/dlock-dev/dlock/locktest"
)

// TestDoorbellRingsWhenALeaseRunsOutUnreleased: a lease that ends without
// a Release (a minimum hold kept by a last extension) rings its doorbell
// once it has run out: its waiter is woken about when the hold ends, and
// the key's later releases wake their waiters at once.
func TestDoorbellRingsWhenALeaseRunsOutUnreleased(t *testing.T) {
	ctx, cancel := context.WithTimeout(context.Background(), 60*time.Second)
	defer cancel()
	a := locktest.NewLocker(t, newBackend(t, ""))
	b := locktest.NewLocker(t, newBackend(t, ""))
	c := locktest.NewLocker(t, newBackend(t, ""))
	key := locktest.UniqueKey("bell-minhold")
	const ttl = 30 * time.Second
	// The hold is kept with its margin (10s/10 + 100ms): about 3.1 s.
	lk, err := a.Acquire(ctx, key, dlock.WithTTL(10*time.Second), dlock.WithMinHold(2*time.Second))
	if err != nil {
		t.Fatal(err)
	}
	acquired := time.Now()
	got := make(chan *dlock.Lock, 1)
	go func() {
		l, err := b.Acquire(ctx, key, dlock.WithTTL(ttl))
		if err != nil {
			t.Error(err)
		}
		got <- l
	}()
	locktest.WaitQueued(t, a, key, 1)
	if err := lk.Release(ctx); err != nil {
		t.Fatal(err)
	}
	held := <-got
	if held == nil {
		t.FailNow()
	}
	if d := time.Since(acquired); d > 5*time.Second {
		t.Errorf("the waiter got the key %s after the grant; the minimum hold, with its margin, ended at about 3.1 s", d.Round(time.Millisecond))
	}
	got2 := make(chan time.Time, 1)
	go func() {
		l, err := c.Acquire(ctx, key, dlock.WithTTL(ttl))
		got2 <- time.Now()
		if err == nil {
			l.Release(ctx)
		}
	}()
	locktest.WaitQueued(t, b, key, 1)
	released := time.Now()
	if err := held.Release(ctx); err != nil {
		t.Fatal(err)
	}
	if d := (<-got2).Sub(released); d > 2*time.Second {
		t.Errorf("a later release woke its waiter %s after it (a doorbell left held?)", d.Round(time.Millisecond))
	}
}
