package pglock

import (
	"context"
	"errors"
	"time"

	"github.com/dlock-dev/dlock"
)

var (
	_ dlock.SessionBound = (*Advisory)(nil)
	_ dlock.LockDelayer  = (*Advisory)(nil)
)

// SessionBound implements dlock.SessionBound: an advisory lock ends with
// the server session that holds it. Advisory keeps a lock-delay in the
// key's record instead (dlock.LockDelayer).
func (a *Advisory) SessionBound() {}

// Abandon implements dlock.LockDelayer: pg_advisory_unlock without marking
// the grant released, so that the next grant keeps its lock-delay.
//
// The key's row in the "_session" table records the lock-delay of its last
// exclusive grant (delay_us) until a release clears it, in the statement
// that unlocks, before the unlock. The next grant's statement, once the
// server granted it the lock, writes its grant only if no delay is kept
// (delay_us is 0 and delay_until has passed). Otherwise the last grant
// ended without a release (its session ended, or it was abandoned) or a
// delay runs: the statement starts the delay (delay_until, by the server's
// clock, from no earlier than the lock's end), keeps the fence, unlocks,
// and the request is refused for what is left of it (AcquireWait waits
// it out first). The check is part of the grant's statement: a lock-delay
// of 0 costs nothing more. A lock-delay is kept for exclusive
// acquisitions only: a shared one with a lock-delay is ErrUnsupported. The
// row is unlogged: a crash of the server forgets the delays it kept (see
// Advisory), a clean restart keeps them.
func (a *Advisory) Abandon(ctx context.Context, key string, token dlock.Token) error {
	return a.end(ctx, key, token, false, 0)
}

var _ dlock.HoldKeeper = (*Advisory)(nil)

// ReleaseKeeping implements dlock.HoldKeeper for exclusive locks: the
// statement that unlocks first marks the grant released and keeps the key
// from every grant for keep from now, by the server's clock, in the key's
// row (delay_until, which the grant's statement checks as it does a
// lock-delay). A shared lock is ErrUnsupported. If the unlock may not have
// run, the lock is released plainly, so that it is not left held.
func (a *Advisory) ReleaseKeeping(ctx context.Context, key string, token dlock.Token, keep time.Duration) error {
	a.mu.Lock()
	shared := false
	for _, hs := range a.held {
		for _, h := range hs {
			if h.key == key && h.token == token && h.shared {
				shared = true
			}
		}
	}
	a.mu.Unlock()
	if shared {
		return dlock.ErrUnsupported
	}
	err := a.end(ctx, key, token, true, keep)
	if err != nil && !errors.Is(err, dlock.ErrNotHeld) && ctx.Err() == nil {
		rctx, cancel := context.WithTimeout(context.Background(), statementBound)
		defer cancel()
		_ = a.end(rctx, key, token, true, 0)
	}
	return err
}

// holderTTL is the TTL of req's holder: the store's lease less the
// lock-delay, which the Advisory keeps after the session ends rather than
// in its idle_session_timeout.
func holderTTL(req dlock.Request) time.Duration { return req.TTL - req.LockDelay }
