package dlock

import (
	"context"
	"errors"
	"fmt"
	"time"

	"github.com/dlock-dev/dlock/internal/ctxend"
)

// A Lock is one acquisition of a key. Its methods are safe for concurrent use.
//
// Holding a *Lock does not guarantee holding the lock: Done closes and Err
// turns non-nil as soon as the lease is lost or cannot be confirmed. For
// leases (every backend's default strategy) that happens before the store
// lets anyone else take the key: the client gives up at its own deadline,
// which precedes the store's expiry. Session strategies (mysqllock's GetLock
// and RowLock, pglock's Advisory) lose their lock the instant the server
// ends the session (a cut connection, KILL, a proxy or server restart); the
// holder is told as soon as the client sees the session end (backends that
// implement LossReporter watch their sessions), at the latest at its next
// check, TTL/3 later, and a waiter may take the lock in between. In every
// case, pass Fence to the resource you guard so that it refuses a stale
// holder.
type Lock struct {
	l    *Locker
	ls   *lease
	done chan struct{}
	// Guarded by l.mu.
	err     error
	cancels map[*lockContext]context.CancelCauseFunc // of the live Lock.Context contexts
}

// lease is what a Locker holds for one key; reentrant Locks share it.
// All fields after the first group are guarded by Locker.mu.
type lease struct {
	key, owner, meta string
	token            Token
	fence            uint64
	mode             Mode
	limit            int
	ttl, margin      time.Duration
	acquiredAt       time.Time     // when the acquisition was sent
	grantRTT         time.Duration // from then to the grant's arrival
	minHold          time.Duration // WithMinHold
	delay            time.Duration // WithLockDelay: added to ttl in a lease store

	handles  map[*Lock]struct{} // live Locks
	ended    bool               // released, lost or closed
	renewAt  time.Time          // next renewal
	deadline time.Time          // considered lost at this instant unless renewed
	tries    uint               // failed renewals since the last success
	inflight bool               // a renewal is under way
	renewed  chan struct{}      // closed when that renewal has answered
	timer    Timer              // fires at deadline
}

// errTooLate is the error of a grant that the store confirmed after the
// lease's safe deadline: the store answered too slowly for the TTL, and the
// grant, released, is not a sign that anyone holds the key.
var errTooLate = errors.New("the store confirmed the grant after its lease's safe deadline (a round trip longer than the TTL minus the margin): nothing is held; use a longer TTL")

// errLostEarly is the error of a grant whose session the backend reported
// lost before the grant arrived.
var errLostEarly = errors.New("the store ended the grant's session before the grant arrived: nothing is held")

// Key returns the lock's key.
func (k *Lock) Key() string { return k.ls.key }

// Fence returns the fencing number: strictly greater than the fence of every
// earlier acquisition of the key, on any Locker. Reentrant acquisitions share
// it. Pass it to the resources you guard, and have them refuse a fence
// smaller than the largest they have seen.
func (k *Lock) Fence() uint64 { return k.ls.fence }

// Mode returns how the lock shares its key: ModeExclusive, or ModeShared
// (Shared), or ModeLimited (WithLimit).
func (k *Lock) Mode() Mode { return k.ls.mode }

// Owner returns the owner identity given with WithOwner, or "".
func (k *Lock) Owner() string { return k.ls.owner }

// Done returns a channel that is closed when this Lock is released, lost, or
// its Locker closed.
func (k *Lock) Done() <-chan struct{} { return k.done }

// Err returns nil while the lock is held; after Done closes it returns an
// error matching ErrLockLost if the lease was lost, ErrNotHeld after Release,
// or ErrClosed after the Locker closed. Err compares the clock with the
// lease's safe deadline itself, so it reports a lease whose deadline has
// passed even before the Locker's timer has run (after a process pause).
func (k *Lock) Err() error {
	defer k.l.emitLosses()
	k.l.mu.Lock()
	defer k.l.mu.Unlock()
	k.l.checkDeadlineLocked(k.ls)
	return k.err
}

// Deadline returns the instant (on this machine's clock) until which the lock
// is known to be held; renewal pushes it forward. After it passes without a
// renewal the lock is reported lost.
func (k *Lock) Deadline() time.Time {
	k.l.mu.Lock()
	defer k.l.mu.Unlock()
	return k.ls.deadline
}

// Context returns a context derived from parent that is cancelled, with
// context.Cause set to Err(), when this Lock is released or lost. Its Err
// checks the lease's safe deadline as Lock.Err does, so a process pause past
// the lease is reported by the first call after it. Its Deadline is parent's:
// the lease's end moves with every renewal, and a context's Deadline must
// not (a timeout derived from it would otherwise never fire); Lock.Deadline
// gives the lease's current safe deadline. Call cancel when done with it.
func (k *Lock) Context(parent context.Context) (context.Context, context.CancelFunc) {
	ctx, cancel := context.WithCancelCause(parent)
	c := &lockContext{Context: ctx, k: k}
	k.l.mu.Lock()
	if k.err != nil {
		cancel(k.err)
	} else {
		if k.cancels == nil {
			k.cancels = make(map[*lockContext]context.CancelCauseFunc)
		}
		k.cancels[c] = cancel
	}
	k.l.mu.Unlock()
	return c, func() {
		k.l.mu.Lock()
		delete(k.cancels, c)
		k.l.mu.Unlock()
		cancel(context.Canceled)
	}
}

// lockContext is the context of a Lock: a cancelCtx whose Err also
// consults the lease.
type lockContext struct {
	context.Context
	k *Lock
}

func (c *lockContext) Err() error {
	if err := c.Context.Err(); err != nil {
		return err
	}
	if c.k.Err() != nil { // cancels c.Context with the loss as its cause
		return c.Context.Err()
	}
	return nil
}

// Release releases this acquisition. For reentrant acquisitions the key is
// freed when the last of them is released. It returns an error matching
// ErrNotHeld if the Lock was already released, lost or closed (then it
// changes nothing), or the backend's error if the store could not be reached
// (the lease then expires with its TTL). If ctx ends first, Release returns
// its error and the release goes on in the background for a few seconds,
// so that a caller's deadline does not keep the key for the rest of its TTL.
func (k *Lock) Release(ctx context.Context) (err error) {
	l, ls := k.l, k.ls
	defer l.emitLosses()
	l.mu.Lock()
	l.checkDeadlineLocked(ls)
	if k.err != nil {
		err := k.err
		l.mu.Unlock()
		if errors.Is(err, ErrNotHeld) {
			return err
		}
		return fmt.Errorf("%w: %w", ErrNotHeld, err)
	}
	k.endLocked(ErrNotHeld)
	delete(ls.handles, k)
	if len(ls.handles) > 0 {
		l.mu.Unlock()
		return nil
	}
	ls.ended = true
	ls.timer.Stop()
	l.dropLocked(ls)
	l.wg.Add(1) // under mu: before any Close can wait
	l.mu.Unlock()

	started := false
	defer func() {
		if !started { // the Observer panicked: let go all the same
			go l.letGoBounded(ls)
		}
	}()
	ctx, end := l.releaseStarted(ctx, ls, false)
	started = true
	defer func() { l.releaseEnded(ctx, end, err) }()
	wake := func() {
		l.mu.Lock()
		l.wakeLocked(ls.key)
		l.mu.Unlock()
	}
	keep := l.keepFor(ls)
	if ctx.Done() == nil { // nothing to return early for (see await)
		err = l.letGo(ctx, ls, keep)
		l.wg.Done()
	} else {
		_, err = await(l, ctx, func() (struct{}, error) {
			return struct{}{}, l.letGo(ctx, ls, keep)
		}, func(_ struct{}, err error) {
			if err != nil && !errors.Is(err, ErrNotHeld) {
				l.letGoLater(ls)
			}
			wake()
		})
	}
	wake()
	switch {
	case errors.Is(err, errAbandoned):
		err = ctx.Err()
	case err != nil && !errors.Is(err, ErrNotHeld) && ctxend.Err(ctx) != nil:
		l.letGoLater(ls)
	}
	if err != nil {
		return fmt.Errorf("dlock: release %q: %w", ls.key, err)
	}
	return nil
}

// keepFor is how long the store must still keep ls's key when it is let
// go now, for its minimum hold (WithMinHold), or 0 when nothing of it is
// left. The rest of the hold is counted from the acquisition's sending;
// the grant, which the store timed, came at most a round trip later, and
// the lease's margin covers a clock that runs slow.
func (l *Locker) keepFor(ls *lease) time.Duration {
	if ls.minHold <= 0 {
		return 0
	}
	left := ls.minHold - l.clock.Now().Sub(ls.acquiredAt)
	if left <= 0 {
		return 0
	}
	return max(left+ls.grantRTT+ls.margin, MinTTL)
}

// letGo ends ls in the store: a release, or, with keep left of its minimum
// hold, a release that keeps the key for keep (HoldKeeper) or a last
// extension of its lease to keep. When that extension fails
// the lease runs out by its TTL: never released early.
func (l *Locker) letGo(ctx context.Context, ls *lease, keep time.Duration) error {
	if keep == 0 {
		return l.b.Release(ctx, ls.key, ls.token)
	}
	// A renewal under way could reach the store after the last extension
	// and set the lease back to a whole TTL: wait for its answer first.
	l.mu.Lock()
	renewed := ls.renewed
	l.mu.Unlock()
	if renewed != nil {
		select {
		case <-renewed:
		case <-ctx.Done():
			return ctx.Err()
		}
		if keep = l.keepFor(ls); keep == 0 {
			return l.b.Release(ctx, ls.key, ls.token)
		}
	}
	if hk, ok := l.b.(HoldKeeper); ok {
		err := hk.ReleaseKeeping(ctx, ls.key, ls.token, keep)
		if !errors.Is(err, ErrUnsupported) {
			return err
		}
	}
	errs, err := l.b.Extend(ctx, []Lease{{Key: ls.key, Token: ls.token, TTL: keep}})
	if err == nil && len(errs) > 0 {
		err = errs[0]
	}
	return err
}

// endLocked closes the Lock with err.
func (k *Lock) endLocked(err error) {
	if k.err != nil {
		return
	}
	k.err = err
	close(k.done)
	for _, c := range k.cancels {
		c(err)
	}
	k.cancels = nil
}

func (ls *lease) info() LockInfo {
	return LockInfo{
		Key: ls.key, Owner: ls.owner, Token: ls.token, Fence: ls.fence,
		AcquiredAt: ls.acquiredAt, ExpiresAt: ls.deadline, Metadata: ls.meta,
		Mode: ls.mode, Limit: ls.limit,
	}
}

// describe names the lease's mode for errors: "exclusive", "shared" or
// "limited to n".
func (ls *lease) describe() string {
	return DescribeMode(ls.mode, ls.limit)
}

func (l *Locker) newHandleLocked(ls *lease) *Lock {
	k := &Lock{l: l, ls: ls, done: make(chan struct{})}
	ls.handles[k] = struct{}{}
	return k
}
