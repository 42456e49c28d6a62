package mysqllock_test

import (
	"context"
	"errors"
	"testing"
	"time"

	"github.com/dlock-dev/dlock"
	"github.com/dlock-dev/dlock/locktest"
)

// sessionStrategy is what the lock-delay tests need of GetLock and RowLock.
type sessionStrategy interface {
	dlock.Backend
	dlock.Waiter
	dlock.ForceReleaser
	dlock.LockDelayer
}

// TestSessionLockDelay checks the session strategies' lock-delay at the
// Backend: a session that ends while it holds a lock with a lock-delay
// (KILL, through ForceRelease) keeps the key from every acquisition for the
// delay from then, as a refusal with what is left of it that changes
// nothing (a second attempt finds no more left, the next fence is the
// next number); a waiter is handed the key once it ends; a release frees
// the key at once; Abandon keeps the delay as a session's end does.
func TestSessionLockDelay(t *testing.T) {
	needServer(t)
	for name, newB := range map[string]func(t *testing.T) sessionStrategy{
		"getlock": func(t *testing.T) sessionStrategy { return newGetLock(t, "") },
		"rowlock": func(t *testing.T) sessionStrategy { return newRowLock(t, "") },
	} {
		t.Run(name, func(t *testing.T) {
			t.Parallel()
			const d, ttl = 2 * time.Second, 5 * time.Second
			ctx := t.Context()
			a, b := newB(t), newB(t)
			k := locktest.UniqueKey("lock-delay-" + name)
			req := func(delay time.Duration) dlock.Request {
				return dlock.Request{Key: k, Token: dlock.NewToken(), TTL: ttl + delay, LockDelay: delay}
			}
			if _, err := a.Acquire(ctx, dlock.Request{Key: k, Token: dlock.NewToken(), TTL: ttl, LockDelay: ttl}); !errors.Is(err, dlock.ErrInvalidOption) {
				t.Errorf("a lock-delay as long as the TTL: %v; want ErrInvalidOption", err)
			}
			first := req(d)
			held := mustGrant(t, a, first)
			if err := b.ForceRelease(ctx, k); err != nil { // kills a's session
				t.Fatal(err)
			}
			killed := time.Now()
			// The server ends the session (and frees its lock) a moment
			// after KILL: until then a refusal has no Remaining.
			var left time.Duration
			for try := 0; try < 2; {
				res, err := b.Acquire(ctx, req(0))
				switch {
				case err != nil:
					t.Fatal(err)
				case res.Acquired:
					t.Fatalf("the key was granted %s after its holder's session was killed; want a lock-delay of %s", time.Since(killed), d)
				case res.Remaining == 0 && try == 0 && time.Since(killed) < d:
					time.Sleep(10 * time.Millisecond)
					continue
				case res.Remaining <= 0 || res.Remaining > d || try > 0 && res.Remaining > left:
					t.Fatalf("attempt %d: Remaining %s; want in (0, %s], no more than the %s before", try, res.Remaining, d, left)
				}
				left = res.Remaining
				try++
			}
			waiter := req(d)
			wctx, cancel := context.WithTimeout(ctx, 10*d)
			defer cancel()
			var res dlock.Result
			for !res.Acquired && wctx.Err() == nil {
				var err error
				if res, err = b.AcquireWait(wctx, waiter); err != nil {
					t.Fatal(err)
				}
			}
			switch {
			case !res.Acquired:
				t.Fatalf("a waiter was not handed the key after its lock-delay")
			case time.Since(killed) < d:
				t.Errorf("a waiter took the key %s after its holder's session was killed; want the lock-delay of %s", time.Since(killed), d)
			case res.Fence <= held:
				t.Errorf("fence %d after the killed holder's %d", res.Fence, held)
			}
			if err := b.Release(ctx, k, waiter.Token); err != nil {
				t.Fatal(err)
			}
			c := newB(t) // a has not yet noticed that its session ended
			next := req(d)
			mustGrant(t, c, next) // a release frees the key at once
			if err := c.Abandon(ctx, k, next.Token); err != nil {
				t.Fatal(err)
			}
			if res, err := b.Acquire(ctx, req(0)); err != nil || res.Acquired || res.Remaining <= 0 {
				t.Fatalf("an acquisition after Abandon: %+v, %v; want refused for the lock-delay", res, err)
			}
			if err := c.Release(ctx, k, next.Token); !errors.Is(err, dlock.ErrNotHeld) {
				t.Errorf("Release after Abandon: %v; want ErrNotHeld", err)
			}
		})
	}
}
