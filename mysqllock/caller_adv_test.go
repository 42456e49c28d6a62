package mysqllock_test

import (
	"context"
	"fmt"
	"sync"
	"testing"
	"time"

	"github.com/dlock-dev/dlock"
	"github.com/dlock-dev/dlock/locktest"
	"github.com/dlock-dev/dlock/mysqllock"
)

// TestTimeoutInsideDoIsKept: a timeout that fn sets on Do's context for
// its own work (an HTTP call, a query) ends that work when it passes, even
// when it is longer than the lease's safe deadline at the moment it is set.
func TestTimeoutInsideDoIsKept(t *testing.T) {
	b := newBackend(t, "")
	l := locktest.NewLocker(t, b)
	k := locktest.UniqueKey(t.Name())
	ctx, cancel := context.WithTimeout(context.Background(), 30*time.Second)
	defer cancel()
	const ttl, own = 3 * time.Second, 4 * time.Second
	err := l.Do(ctx, k, func(ctx context.Context) error {
		wctx, wcancel := context.WithTimeout(ctx, own)
		defer wcancel()
		select {
		case <-wctx.Done():
			return nil
		case <-time.After(4 * own):
			d, _ := wctx.Deadline()
			return fmt.Errorf("a %s timeout set inside Do did not end its context after %s; its Deadline now says %s from now",
				own, 4*own, time.Until(d).Round(time.Millisecond))
		}
	}, dlock.WithTTL(ttl))
	if err != nil {
		t.Fatal(err)
	}
}

// TestLockContextDeadlineIsStable: context.Context's contract says that
// successive calls to Deadline return the same results, renewals or not.
func TestLockContextDeadlineIsStable(t *testing.T) {
	b := newBackend(t, "")
	l := locktest.NewLocker(t, b)
	k := locktest.UniqueKey(t.Name())
	ctx, cancel := context.WithTimeout(context.Background(), 30*time.Second)
	defer cancel()
	lk, err := l.TryAcquire(ctx, k, dlock.WithTTL(3*time.Second))
	if err != nil {
		t.Fatal(err)
	}
	defer lk.Release(context.Background())
	lctx, lcancel := lk.Context(context.Background())
	defer lcancel()
	d1, _ := lctx.Deadline()
	time.Sleep(2 * time.Second) // past one renewal (TTL/3)
	if lk.Err() != nil {
		t.Fatal(lk.Err())
	}
	d2, _ := lctx.Deadline()
	if !d1.Equal(d2) {
		t.Errorf("Lock.Context's Deadline changed from %s to %s: successive calls must return the same result", d1.Format(time.StampMilli), d2.Format(time.StampMilli))
	}
}

// jumpClock is the system clock plus an offset that a test moves forward:
// a process pause as the Locker sees it, before its timers have run.
type jumpClock struct {
	mu  sync.Mutex
	off time.Duration
}

func (c *jumpClock) Now() time.Time {
	c.mu.Lock()
	defer c.mu.Unlock()
	return time.Now().Add(c.off)
}

func (c *jumpClock) jump(d time.Duration) {
	c.mu.Lock()
	c.off += d
	c.mu.Unlock()
}

func (c *jumpClock) AfterFunc(d time.Duration, f func()) dlock.Timer {
	return time.AfterFunc(d, f)
}

// TestReentrantAcquireAfterPauseIsNotAcquired: after a pause past the
// lease's safe deadline, the first call reports the loss. A reentrant
// Acquire is such a call: it must not hand out the lost lease as held, only
// a new one.
func TestReentrantAcquireAfterPauseIsNotAcquired(t *testing.T) {
	clk := &jumpClock{}
	l := dlock.New(newBackend(t, ""), &dlock.Options{Clock: clk})
	t.Cleanup(func() { l.Close(context.Background()) })
	k := locktest.UniqueKey(t.Name())
	ctx, cancel := context.WithTimeout(context.Background(), 10*time.Second)
	defer cancel()
	first, err := l.TryAcquire(ctx, k, dlock.WithTTL(2*time.Second), dlock.WithOwner("job"))
	if err != nil {
		t.Fatal(err)
	}
	clk.jump(5 * time.Second) // paused past the 2 s lease
	second, err := l.TryAcquire(ctx, k, dlock.WithTTL(2*time.Second), dlock.WithOwner("job"))
	if first.Err() == nil {
		t.Errorf("the handle from before the pause still says held")
	}
	// Either the store still holds the lost lease (not acquired), or the
	// Locker released it meanwhile and this is a new lease: never the old.
	if err == nil {
		if second.Fence() <= first.Fence() {
			t.Errorf("reentrant TryAcquire after a pause past the lease returned the lost lease (fence %d, first %d)", second.Fence(), first.Fence())
		}
		second.Release(context.Background())
	}
	first.Release(context.Background())
}

// TestAutocommitOffPoolIsRefusedOrSafe: the pool is the application's, and
// some applications turn autocommit off in their DSN (autocommit=0) or in
// the server's init_connect. The lease strategy must then either refuse
// the pool with a clear error or still commit its grants: an uncommitted
// grant is a false "acquired" that a rollback (the pool closing the
// connection at its ConnMaxLifetime) undoes, so that another client takes
// the key while the holder's Err is nil, and fences repeat.
func TestAutocommitOffPoolIsRefusedOrSafe(t *testing.T) {
	newBackend(t, "") // migrated
	ctx, cancel := context.WithTimeout(context.Background(), 30*time.Second)
	defer cancel()
	other := locktest.NewLocker(t, newBackend(t, ""))
	k := locktest.UniqueKey(t.Name())
	lk0, err := other.TryAcquire(ctx, k)
	if err != nil {
		t.Fatal(err)
	}
	lk0.Release(ctx)

	db := open(t, "autocommit=0")
	db.SetConnMaxLifetime(time.Second) // an ordinary pool setting
	b, err := mysqllock.New(db, &mysqllock.Options{Table: testTable, NoDoorbell: true})
	if err != nil {
		t.Logf("refused: %v", err)
		return
	}
	l := locktest.NewLocker(t, b)
	lk, err := l.TryAcquire(ctx, k, dlock.WithTTL(9*time.Second))
	if err != nil {
		t.Logf("refused: %v", err)
		return
	}
	for ctx.Err() == nil {
		tctx, tcancel := context.WithTimeout(ctx, 500*time.Millisecond)
		olk, err := other.TryAcquire(tctx, k, dlock.WithTTL(time.Second))
		tcancel()
		if err == nil {
			if herr := lk.Err(); herr == nil {
				t.Errorf("rule: one holder per key; another client took %q (fence %d) while the autocommit=0 holder's Err is nil (fence %d, earlier fence %d)",
					k, olk.Fence(), lk.Fence(), lk0.Fence())
			}
			if olk.Fence() <= lk.Fence() {
				t.Errorf("rule: fences increase; %d after %d", olk.Fence(), lk.Fence())
			}
			olk.Release(ctx)
			return
		}
		time.Sleep(50 * time.Millisecond)
	}
	t.Fatal("the key was never free")
}
