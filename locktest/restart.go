package locktest

import (
	"context"
	"sync"
	"testing"
	"time"

	"github.com/dlock-dev/dlock"
)

// RestartWhileWaitersWait checks the store's restart, done by restart
// (which returns when the store serves again), while a holder holds a key
// and three clients wait for it: every waiter gets the key in turn once the
// holder releases it, and no two hold it at once while both Locks say held.
// A waiter's Acquire may fail while the store is down (an outage is an
// error); it is tried again.
func RestartWhileWaitersWait(t *testing.T, newBackend func(t *testing.T) dlock.Backend, restart func(t *testing.T)) {
	k := UniqueKey(t.Name())
	holder := NewLocker(t, newBackend(t))
	lk, err := holder.TryAcquire(ctxT(t, 10*time.Second), k, dlock.WithTTL(3*time.Second))
	if err != nil {
		t.Fatal(err)
	}
	var mu sync.Mutex
	var inside *dlock.Lock // the Lock currently in its critical section
	enter := func(who string, l *dlock.Lock) {
		mu.Lock()
		defer mu.Unlock()
		if inside != nil && inside.Err() == nil && l.Err() == nil {
			t.Errorf("%s holds %q while another Lock (fence %d) still says held; fence %d", who, k, inside.Fence(), l.Fence())
		}
		inside = l
	}
	leave := func(l *dlock.Lock) {
		mu.Lock()
		defer mu.Unlock()
		if inside == l {
			inside = nil
		}
	}
	enter("holder", lk)
	var wg sync.WaitGroup
	got := make(chan string, 3)
	for i := range 3 {
		w := NewLocker(t, newBackend(t))
		wg.Go(func() {
			ctx, cancel := context.WithTimeout(context.Background(), 40*time.Second)
			defer cancel()
			for {
				wl, err := w.Acquire(ctx, k, dlock.WithTTL(3*time.Second))
				if err != nil {
					if ctx.Err() != nil {
						t.Errorf("waiter %d never got %q: %v", i, k, err)
						return
					}
					t.Logf("waiter %d: %v (retrying)", i, err)
					time.Sleep(100 * time.Millisecond)
					continue
				}
				enter("waiter", wl)
				time.Sleep(200 * time.Millisecond)
				leave(wl)
				if err := wl.Release(context.Background()); err != nil {
					t.Logf("waiter %d release: %v", i, err)
				}
				got <- "ok"
				return
			}
		})
	}
	time.Sleep(time.Second) // the waiters wait
	restart(t)
	t.Logf("restarted; holder's Err: %v", lk.Err())
	time.Sleep(time.Second)
	leave(lk)
	if err := lk.Release(ctxT(t, 10*time.Second)); err != nil {
		t.Logf("holder release: %v", err)
	}
	wg.Wait()
	close(got)
	n := 0
	for range got {
		n++
	}
	if n != 3 {
		t.Errorf("%d of 3 waiters got the key", n)
	}
}
