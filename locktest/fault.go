package locktest

import (
	"context"
	"errors"
	"sync"
	"sync/atomic"
	"time"

	"github.com/dlock-dev/dlock"
)

// errInjected is the error the fault wrapper returns.
var errInjected = errors.New("locktest: injected store failure")

// faulty wraps a backend to count calls and inject failures.
type faulty struct {
	dlock.Backend

	acquires, extends, releases atomic.Int64
	maxBatch                    atomic.Int64

	failAcquireBefore atomic.Bool // fail without reaching the store
	failAcquireAfter  atomic.Bool // reach the store, then report failure (lost reply)
	failExtend        atomic.Bool
	failRelease       atomic.Bool

	mu     sync.Mutex
	tokens map[string]dlock.Token // last token sent per key
}

func newFaulty(b dlock.Backend) *faulty {
	return &faulty{Backend: b, tokens: make(map[string]dlock.Token)}
}

func (f *faulty) Acquire(ctx context.Context, req dlock.Request) (dlock.Result, error) {
	return f.attempt(req, func() (dlock.Result, error) { return f.Backend.Acquire(ctx, req) })
}

// attempt counts an acquisition attempt and injects its faults around do.
func (f *faulty) attempt(req dlock.Request, do func() (dlock.Result, error)) (dlock.Result, error) {
	f.acquires.Add(1)
	f.mu.Lock()
	f.tokens[req.Key] = req.Token
	f.mu.Unlock()
	if f.failAcquireBefore.Load() {
		return dlock.Result{}, errInjected
	}
	res, err := do()
	if err == nil && f.failAcquireAfter.Load() {
		return dlock.Result{}, errInjected
	}
	return res, err
}

func (f *faulty) Extend(ctx context.Context, leases []dlock.Lease) ([]error, error) {
	f.extends.Add(1)
	for {
		m := f.maxBatch.Load()
		if int64(len(leases)) <= m || f.maxBatch.CompareAndSwap(m, int64(len(leases))) {
			break
		}
	}
	if f.failExtend.Load() {
		return nil, errInjected
	}
	return f.Backend.Extend(ctx, leases)
}

func (f *faulty) Release(ctx context.Context, key string, token dlock.Token) error {
	f.releases.Add(1)
	if f.failRelease.Load() {
		return errInjected
	}
	return f.Backend.Release(ctx, key, token)
}

func (f *faulty) token(key string) dlock.Token {
	f.mu.Lock()
	defer f.mu.Unlock()
	return f.tokens[key]
}

func (f *faulty) List(ctx context.Context, prefix string) ([]dlock.LockInfo, error) {
	if l, ok := f.Backend.(dlock.Lister); ok {
		return l.List(ctx, prefix)
	}
	return nil, dlock.ErrUnsupported
}

func (f *faulty) ForceRelease(ctx context.Context, key string) error {
	if fr, ok := f.Backend.(dlock.ForceReleaser); ok {
		return fr.ForceRelease(ctx, key)
	}
	return dlock.ErrUnsupported
}

// faultyWaiter is faulty for a backend that is a dlock.Waiter: embedding
// hides AcquireWait, so it is passed through (with the same faults) here.
type faultyWaiter struct{ *faulty }

func (f faultyWaiter) AcquireWait(ctx context.Context, req dlock.Request) (dlock.Result, error) {
	return f.attempt(req, func() (dlock.Result, error) { return f.Backend.(dlock.Waiter).AcquireWait(ctx, req) })
}

// WaitsDirectly passes dlock.DirectWaiter through.
func (f faultyWaiter) WaitsDirectly() bool {
	dw, ok := f.Backend.(dlock.DirectWaiter)
	return ok && dw.WaitsDirectly()
}

// backend returns f as the Locker should see it: with AcquireWait if the
// wrapped backend has it.
func (f *faulty) backend() dlock.Backend {
	if _, ok := f.Backend.(dlock.Waiter); ok {
		return faultyWaiter{f}
	}
	return f
}

// SupportsMode passes dlock.Sharer through.
func (f *faulty) SupportsMode(m dlock.Mode) bool {
	sh, ok := f.Backend.(dlock.Sharer)
	return ok && sh.SupportsMode(m)
}

// Watch and SetMetadata pass dlock.Watcher and dlock.MetadataSetter
// through (ErrUnsupported where the wrapped backend lacks them).
func (f *faulty) Watch(ctx context.Context, key string) (<-chan struct{}, error) {
	w, ok := f.Backend.(dlock.Watcher)
	if !ok {
		return nil, dlock.ErrUnsupported
	}
	return w.Watch(ctx, key)
}

// WatchHolders passes dlock.HolderWatcher through.
func (f *faulty) WatchHolders(ctx context.Context, key string) ([]dlock.LockInfo, <-chan []dlock.LockInfo, error) {
	w, ok := f.Backend.(dlock.HolderWatcher)
	if !ok {
		return nil, nil, dlock.ErrUnsupported
	}
	return w.WatchHolders(ctx, key)
}

func (f *faulty) SetMetadata(ctx context.Context, key string, token dlock.Token, metadata string) error {
	m, ok := f.Backend.(dlock.MetadataSetter)
	if !ok {
		return dlock.ErrUnsupported
	}
	return m.SetMetadata(ctx, key, token, metadata)
}

// ReleaseKeeping passes dlock.HoldKeeper through (ErrUnsupported where
// the wrapped backend lacks it), counted and failed as a Release.
func (f *faulty) ReleaseKeeping(ctx context.Context, key string, token dlock.Token, keep time.Duration) error {
	h, ok := f.Backend.(dlock.HoldKeeper)
	if !ok {
		return dlock.ErrUnsupported
	}
	f.releases.Add(1)
	if f.failRelease.Load() {
		return errInjected
	}
	return h.ReleaseKeeping(ctx, key, token, keep)
}

// Abandon passes dlock.LockDelayer through (ErrUnsupported where the
// wrapped backend lacks it).
func (f *faulty) Abandon(ctx context.Context, key string, token dlock.Token) error {
	d, ok := f.Backend.(dlock.LockDelayer)
	if !ok {
		return dlock.ErrUnsupported
	}
	return d.Abandon(ctx, key, token)
}
