package main

import (
	"context"
	"errors"
	"fmt"
	"sync"
	"time"

	"github.com/dlock-dev/dlock"
)

// errNoAnswer means a store call got no answer within its bound.
var errNoAnswer = errors.New("no answer")

// guard wraps a Backend for the CLI. It bounds every store call that does
// not wait for a holder (a store that accepts connections and never answers
// would otherwise hang dlock: not every client library honours a context in
// every state), and it remembers how the acquisition attempts ended, so that
// a wait that ran out while the store was failing is reported as the failure
// it is, not as a conflict.
type guard struct {
	b       dlock.Backend
	timeout time.Duration

	mu       sync.Mutex
	answered bool  // an acquisition attempt found the key held
	lastErr  error // the last acquisition attempt's store error, if it failed
}

// guardWaiter is a guard over a Backend that is also a dlock.Waiter.
type guardWaiter struct{ *guard }

// The guard passes every optional interface of dlock through (answering
// ErrUnsupported, or false, where the store's Backend lacks it).
var (
	_ dlock.Lister         = (*guard)(nil)
	_ dlock.WaiterLister   = (*guard)(nil)
	_ dlock.KeyLister      = (*guard)(nil)
	_ dlock.ForceReleaser  = (*guard)(nil)
	_ dlock.LossReporter   = (*guard)(nil)
	_ dlock.Sharer         = (*guard)(nil)
	_ dlock.Watcher        = (*guard)(nil)
	_ dlock.MetadataSetter = (*guard)(nil)
	_ dlock.TTLExtender    = (*guard)(nil)
	_ dlock.LockDelayer    = (*guard)(nil)
	_ dlock.HoldKeeper     = (*guard)(nil)
	_ dlock.Waiter         = guardWaiter{}
	_ dlock.Sharer         = guardWaiter{}
)

// newGuard returns b wrapped, a dlock.Waiter if b is one.
func newGuard(b dlock.Backend, timeout time.Duration) (dlock.Backend, *guard) {
	g := &guard{b: b, timeout: timeout}
	if _, ok := b.(dlock.Waiter); ok {
		return guardWaiter{g}, g
	}
	return g, g
}

// bounded runs f with ctx bounded by g's timeout, and returns at the bound
// (or when ctx ends) even if f does not: f then goes on in the background,
// and its outcome is lost as a store error's would be.
func bounded[T any](g *guard, ctx context.Context, what string, f func(ctx context.Context) (T, error)) (T, error) {
	type result struct {
		v   T
		err error
	}
	cctx, cancel := context.WithTimeout(ctx, g.timeout)
	defer cancel() // also ends an abandoned f's call
	done := make(chan result, 1)
	go func() {
		v, err := f(cctx)
		done <- result{v, err}
	}()
	var r result
	select {
	case r = <-done:
	case <-cctx.Done():
		select {
		case r = <-done: // f returned as the bound came: its answer counts
		default:
			if err := ctx.Err(); err != nil {
				return r.v, err
			}
			return r.v, fmt.Errorf("%w to %s within %s (--timeout)", errNoAnswer, what, g.timeout)
		}
	}
	if r.err != nil && ctx.Err() == nil && errors.Is(r.err, context.DeadlineExceeded) {
		return r.v, fmt.Errorf("%w to %s within %s (--timeout): %w", errNoAnswer, what, g.timeout, r.err)
	}
	return r.v, r.err
}

// call is bounded for f without a value.
func (g *guard) call(ctx context.Context, what string, f func(ctx context.Context) error) error {
	_, err := bounded(g, ctx, what, func(ctx context.Context) (struct{}, error) { return struct{}{}, f(ctx) })
	return err
}

// note records how an acquisition attempt made under ctx ended.
func (g *guard) note(ctx context.Context, res dlock.Result, err error) {
	g.mu.Lock()
	defer g.mu.Unlock()
	switch {
	case err == nil:
		g.lastErr = nil
		if !res.Acquired {
			g.answered = true
		}
	case ctx.Err() != nil || deadlinePassed(ctx):
		// Cut short by the caller (whatever the error says: a wait the
		// server was told to end fails with the server's own error, and
		// a backend's timer for the deadline may fire before ctx's):
		// says nothing of the store.
	default:
		g.lastErr = err
	}
}

// deadlinePassed reports whether ctx's deadline has passed, even if its
// timer has not fired yet.
func deadlinePassed(ctx context.Context) bool {
	d, ok := ctx.Deadline()
	return ok && !time.Now().Before(d)
}

// failed returns why a wait that ended without the lock was not a conflict:
// the last attempt failed, or no attempt ever got the store's answer. It
// returns nil when the store said the key was held.
func (g *guard) failed() error {
	g.mu.Lock()
	defer g.mu.Unlock()
	switch {
	case g.lastErr != nil:
		return g.lastErr
	case !g.answered:
		return fmt.Errorf("%w from the store to any acquisition attempt", errNoAnswer)
	}
	return nil
}

func (g *guard) Acquire(ctx context.Context, req dlock.Request) (dlock.Result, error) {
	res, err := bounded(g, ctx, "an acquisition", func(ctx context.Context) (dlock.Result, error) {
		return g.b.Acquire(ctx, req)
	})
	g.note(ctx, res, err)
	return res, err
}

// AcquireWait is not bounded by the timeout: it waits for the holder. The
// attempt before it (Acquire) is, and a signal ends the wait.
func (g guardWaiter) AcquireWait(ctx context.Context, req dlock.Request) (dlock.Result, error) {
	res, err := g.b.(dlock.Waiter).AcquireWait(ctx, req)
	g.note(ctx, res, err)
	return res, err
}

func (g *guard) Extend(ctx context.Context, leases []dlock.Lease) ([]error, error) {
	type extended struct{ errs []error }
	r, err := bounded(g, ctx, "a renewal", func(ctx context.Context) (extended, error) {
		errs, err := g.b.Extend(ctx, leases)
		return extended{errs}, err
	})
	return r.errs, err
}

func (g *guard) Release(ctx context.Context, key string, token dlock.Token) error {
	return g.call(ctx, "a release", func(ctx context.Context) error { return g.b.Release(ctx, key, token) })
}

func (g *guard) List(ctx context.Context, prefix string) ([]dlock.LockInfo, error) {
	l, ok := g.b.(dlock.Lister)
	if !ok {
		return nil, dlock.ErrUnsupported
	}
	return bounded(g, ctx, "a listing", func(ctx context.Context) ([]dlock.LockInfo, error) {
		return l.List(ctx, prefix)
	})
}

// ListWaiters passes dlock.WaiterLister through, bounded as List.
func (g *guard) ListWaiters(ctx context.Context, prefix string) ([]dlock.WaiterInfo, error) {
	l, ok := g.b.(dlock.WaiterLister)
	if !ok {
		return nil, dlock.ErrUnsupported
	}
	return bounded(g, ctx, "a listing", func(ctx context.Context) ([]dlock.WaiterInfo, error) {
		return l.ListWaiters(ctx, prefix)
	})
}

// ListKeys passes dlock.KeyLister through, bounded as List.
func (g *guard) ListKeys(ctx context.Context, prefix string) ([]dlock.KeyInfo, error) {
	l, ok := g.b.(dlock.KeyLister)
	if !ok {
		return nil, dlock.ErrUnsupported
	}
	return bounded(g, ctx, "a listing", func(ctx context.Context) ([]dlock.KeyInfo, error) {
		return l.ListKeys(ctx, prefix)
	})
}

func (g *guard) ForceRelease(ctx context.Context, key string) error {
	f, ok := g.b.(dlock.ForceReleaser)
	if !ok {
		return dlock.ErrUnsupported
	}
	return g.call(ctx, "a release", func(ctx context.Context) error { return f.ForceRelease(ctx, key) })
}

// SupportsMode passes dlock.Sharer through: the Locker asks the guard, and
// a mode the store grants must not be refused because of the wrapper.
func (g *guard) SupportsMode(m dlock.Mode) bool {
	sh, ok := g.b.(dlock.Sharer)
	return ok && sh.SupportsMode(m)
}

func (g *guard) OnLoss(f func(key string, token dlock.Token, cause error)) (stop func()) {
	if lr, ok := g.b.(dlock.LossReporter); ok {
		return lr.OnLoss(f)
	}
	return func() {}
}

// Watch passes dlock.Watcher through, unbounded: a watch lasts until its
// context ends.
func (g *guard) Watch(ctx context.Context, key string) (<-chan struct{}, error) {
	w, ok := g.b.(dlock.Watcher)
	if !ok {
		return nil, dlock.ErrUnsupported
	}
	return w.Watch(ctx, key)
}

// WatchHolders passes dlock.HolderWatcher through, unbounded as Watch.
func (g *guard) WatchHolders(ctx context.Context, key string) ([]dlock.LockInfo, <-chan []dlock.LockInfo, error) {
	w, ok := g.b.(dlock.HolderWatcher)
	if !ok {
		return nil, nil, dlock.ErrUnsupported
	}
	return w.WatchHolders(ctx, key)
}

// SetMetadata passes dlock.MetadataSetter through, bounded.
func (g *guard) SetMetadata(ctx context.Context, key string, token dlock.Token, metadata string) error {
	m, ok := g.b.(dlock.MetadataSetter)
	if !ok {
		return dlock.ErrUnsupported
	}
	_, err := bounded(g, ctx, "set metadata", func(ctx context.Context) (struct{}, error) {
		return struct{}{}, m.SetMetadata(ctx, key, token, metadata)
	})
	return err
}

// ExtendBatch passes dlock.BatchExtender through (0: the Locker's default).
func (g *guard) ExtendBatch() int {
	if be, ok := g.b.(dlock.BatchExtender); ok {
		return be.ExtendBatch()
	}
	return 0
}

// ExtendsToAnyTTL claims dlock.TTLExtender for every store: dlock run
// refuses --at-least itself where the store's Backend cannot keep it
// (keepsMinHold).
func (g *guard) ExtendsToAnyTTL() {}

// keepsMinHold reports whether the store's Backend keeps a minimum hold: in
// its leases (dlock.TTLExtender) or, for an exclusive lock, in the key's
// row (dlock.HoldKeeper).
func (g *guard) keepsMinHold(exclusive bool) bool {
	if _, ok := g.b.(dlock.TTLExtender); ok {
		return true
	}
	_, ok := g.b.(dlock.HoldKeeper)
	return ok && exclusive
}

// ReleaseKeeping passes dlock.HoldKeeper through (ErrUnsupported where the
// store's Backend lacks it: the Locker then extends the lease instead). It
// is bounded as a release is.
func (g *guard) ReleaseKeeping(ctx context.Context, key string, token dlock.Token, keep time.Duration) error {
	h, ok := g.b.(dlock.HoldKeeper)
	if !ok {
		return dlock.ErrUnsupported
	}
	return g.call(ctx, "release", func(ctx context.Context) error { return h.ReleaseKeeping(ctx, key, token, keep) })
}

// Abandon passes dlock.LockDelayer through (ErrUnsupported where the
// store's Backend lacks it: the Locker then leaves a lost lease to the
// store). It is bounded as a release is.
func (g *guard) Abandon(ctx context.Context, key string, token dlock.Token) error {
	d, ok := g.b.(dlock.LockDelayer)
	if !ok {
		return dlock.ErrUnsupported
	}
	return g.call(ctx, "abandon", func(ctx context.Context) error { return d.Abandon(ctx, key, token) })
}

// keepsLockDelay reports whether the store keeps a lock-delay: in a lease's
// TTL, or itself where its locks end with their session (dlock.SessionBound,
// which the guard does not pass through, and dlock.LockDelayer).
func (g *guard) keepsLockDelay() bool {
	if _, ok := g.b.(dlock.SessionBound); !ok {
		return true
	}
	_, ok := g.b.(dlock.LockDelayer)
	return ok
}
