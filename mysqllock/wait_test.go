package mysqllock_test

import (
	"context"
	"errors"
	"fmt"
	"sync"
	"testing"
	"time"

	"github.com/dlock-dev/dlock"
	"github.com/dlock-dev/dlock/locktest"
)

// TestSharedAndLimitedWaitersWokenByRelease: a limited waiter behind a
// limited holder, and a shared waiter behind a writer, get the key soon
// after the release that lets them in. Each waiter has waited long enough
// first for a polling waiter to sleep up to a second between looks, and
// the hand-over is measured several times, so that no poll passes by luck.
func TestSharedAndLimitedWaitersWokenByRelease(t *testing.T) {
	const reps, waited, within = 4, 2 * time.Second, 300 * time.Millisecond
	cases := []struct {
		name    string
		holders int // the release of the first lets the waiter in
		holder  dlock.AcquireOption
		want    dlock.AcquireOption
	}{
		{"limited to 1", 1, dlock.WithLimit(1), dlock.WithLimit(1)},
		{"limited to 3", 3, dlock.WithLimit(3), dlock.WithLimit(3)},
		{"shared behind a writer", 1, dlock.WithTTL(30 * time.Second), dlock.Shared()},
	}
	var wg sync.WaitGroup
	for _, c := range cases {
		wg.Add(1)
		go func() {
			defer wg.Done()
			ctx := t.Context()
			hl := locktest.NewLocker(t, newBackend(t, ""))
			wl := locktest.NewLocker(t, newBackend(t, ""))
			var worst time.Duration
			for range reps {
				key := locktest.UniqueKey("wake")
				var lks []*dlock.Lock
				for range c.holders {
					lk, err := hl.TryAcquire(ctx, key, c.holder, dlock.WithTTL(30*time.Second))
					if err != nil {
						t.Errorf("%s: %v", c.name, err)
						return
					}
					lks = append(lks, lk)
				}
				got := make(chan time.Time, 1)
				go func() {
					wctx, cancel := context.WithTimeout(ctx, 20*time.Second)
					defer cancel()
					lk, err := wl.Acquire(wctx, key, c.want, dlock.WithTTL(30*time.Second))
					at := time.Now()
					if err != nil {
						t.Errorf("%s: %v", c.name, err)
					} else {
						_ = lk.Release(context.Background())
					}
					got <- at
				}()
				time.Sleep(waited)
				released := time.Now()
				if err := lks[0].Release(ctx); err != nil {
					t.Errorf("%s: %v", c.name, err)
				}
				worst = max(worst, (<-got).Sub(released))
				for _, lk := range lks[1:] {
					_ = lk.Release(ctx)
				}
			}
			t.Logf("%s: worst hand-over after the release: %s", c.name, worst.Round(time.Millisecond))
			if worst > within {
				t.Errorf("%s: the waiter got the key %s after the release that let it in (want within %s: a release wakes it)",
					c.name, worst.Round(time.Millisecond), within)
			}
		}()
	}
	wg.Wait()
}

// TestWaitersOfMixedModesServedInArrivalOrder: readers and writers that
// queue behind a writer, one after the other, get the key in the order
// they came, whichever their mode: each release wakes the first in line,
// and a reader that gets in passes the turn to the next.
func TestWaitersOfMixedModesServedInArrivalOrder(t *testing.T) {
	ctx := t.Context()
	key := locktest.UniqueKey("arrival")
	hl := locktest.NewLocker(t, newBackend(t, ""))
	lk, err := hl.TryAcquire(ctx, key, dlock.WithTTL(30*time.Second))
	if err != nil {
		t.Fatal(err)
	}
	modes := []string{"reader", "writer", "reader", "writer", "reader"}
	var mu sync.Mutex
	var order []string
	var wg sync.WaitGroup
	for i, m := range modes {
		l := locktest.NewLocker(t, newBackend(t, ""))
		opts := []dlock.AcquireOption{dlock.WithTTL(30 * time.Second)}
		if m == "reader" {
			opts = append(opts, dlock.Shared())
		}
		name := fmt.Sprintf("%d:%s", i, m)
		wg.Add(1)
		go func() {
			defer wg.Done()
			wctx, cancel := context.WithTimeout(ctx, 30*time.Second)
			defer cancel()
			k, err := l.Acquire(wctx, key, opts...)
			if err != nil {
				t.Errorf("%s: %v", name, err)
				return
			}
			mu.Lock()
			order = append(order, name)
			mu.Unlock()
			time.Sleep(150 * time.Millisecond) // readers that came later must not join in
			_ = k.Release(context.Background())
		}()
		time.Sleep(300 * time.Millisecond) // the next one comes after this one waits
	}
	time.Sleep(1500 * time.Millisecond) // pollers would sleep up to a second now
	if err := lk.Release(ctx); err != nil {
		t.Fatal(err)
	}
	wg.Wait()
	for i, m := range modes {
		if want := fmt.Sprintf("%d:%s", i, m); i >= len(order) || order[i] != want {
			t.Fatalf("served in the order %v, want the order of arrival", order)
		}
	}
}

// TestNewcomerDefersToTheFirstInLine: when a limited holder leaves, the
// slot it frees goes to the waiter first in line, not to a client that
// asks at that moment without having queued.
func TestNewcomerDefersToTheFirstInLine(t *testing.T) {
	ctx := t.Context()
	hl := locktest.NewLocker(t, newBackend(t, ""))
	wl := locktest.NewLocker(t, newBackend(t, ""))
	nl := locktest.NewLocker(t, newBackend(t, ""))
	for range 3 {
		key := locktest.UniqueKey("newcomer")
		lk, err := hl.TryAcquire(ctx, key, dlock.WithLimit(1), dlock.WithTTL(30*time.Second))
		if err != nil {
			t.Fatal(err)
		}
		got := make(chan error, 1)
		go func() {
			wctx, cancel := context.WithTimeout(ctx, 20*time.Second)
			defer cancel()
			w, err := wl.Acquire(wctx, key, dlock.WithLimit(1), dlock.WithTTL(30*time.Second))
			if err == nil {
				time.Sleep(100 * time.Millisecond)
				err = w.Release(context.Background())
			}
			got <- err
		}()
		time.Sleep(500 * time.Millisecond) // the waiter is first in line
		if err := lk.Release(ctx); err != nil {
			t.Fatal(err)
		}
		if n, err := nl.TryAcquire(ctx, key, dlock.WithLimit(1)); err == nil {
			_ = n.Release(ctx)
			t.Fatal("a newcomer took the slot that a release freed for the waiter first in line")
		} else if !errors.Is(err, dlock.ErrNotAcquired) {
			t.Fatal(err)
		}
		if err := <-got; err != nil {
			t.Fatal(err)
		}
	}
}
