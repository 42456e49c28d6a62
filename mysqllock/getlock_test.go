package mysqllock_test

import (
	"sync"
	"testing"
	"time"

	"github.com/dlock-dev/dlock"
	"github.com/dlock-dev/dlock/locktest"
	"github.com/dlock-dev/dlock/mysqllock"
)

// TestConcurrentReleasesParkTheSessionOnce: two releases of one lock at
// once (the Locker's clean-up racing the caller's own) give its session
// back once: a session parked twice would be handed to two acquisitions,
// which would then share its named locks.
func TestConcurrentReleasesParkTheSessionOnce(t *testing.T) {
	ctx := t.Context()
	g := newGetLock(t, "")
	for i := range 30 {
		req := dlock.Request{Key: locktest.UniqueKey("park-once"), Token: dlock.NewToken(), TTL: 10 * time.Second}
		res, err := g.AcquireWait(ctx, req) // on a session of its own
		if err != nil || !res.Acquired {
			t.Fatalf("round %d: %+v, %v", i, res, err)
		}
		var wg sync.WaitGroup
		for range 2 {
			wg.Add(1)
			go func() {
				defer wg.Done()
				_ = g.Release(ctx, req.Key, req.Token)
			}()
		}
		wg.Wait()
		if mysqllock.IdleSessionsTwice(g) {
			t.Fatalf("round %d: a session was parked twice after two releases of its one lock", i)
		}
	}
}
