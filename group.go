package dlock

import (
	"context"
	"errors"
	"fmt"
	"slices"
)

// A Group is the locks of one AcquireAll, held and released together. Its
// methods are safe for concurrent use.
//
// The group is held while every one of its locks is: the loss of any of them
// is the loss of the group (Done closes, Err reports it), and Release then
// frees the others.
type Group struct {
	locks []*Lock // in key order

	// ctx is cancelled, with the first lock's end as its cause, when any
	// lock of the group ends.
	ctx    context.Context
	cancel context.CancelCauseFunc
	stops  []context.CancelFunc // of the locks' contexts
}

// Locks returns the group's locks, ordered by key. Each carries its own
// Fence for the resource it guards.
func (g *Group) Locks() []*Lock { return slices.Clone(g.locks) }

// Lock returns the group's lock of key, or nil.
func (g *Group) Lock(key string) *Lock {
	i, ok := slices.BinarySearchFunc(g.locks, key, func(k *Lock, key string) int {
		switch {
		case k.Key() < key:
			return -1
		case k.Key() > key:
			return 1
		}
		return 0
	})
	if !ok {
		return nil
	}
	return g.locks[i]
}

// Done returns a channel that is closed when any lock of the group is
// released, lost or closed.
func (g *Group) Done() <-chan struct{} { return g.ctx.Done() }

// Err returns nil while every lock of the group is held, and otherwise the
// Err of the first lock found ended (checking each lock's safe deadline, as
// Lock.Err does).
func (g *Group) Err() error {
	for _, k := range g.locks {
		if err := k.Err(); err != nil {
			g.cancel(err)
			return err
		}
	}
	return nil
}

// Context returns a context derived from parent that is cancelled, with
// context.Cause set to the group's Err, when any lock of the group is
// released or lost. Its Err checks every lock as Err does. Call cancel when
// done with it.
func (g *Group) Context(parent context.Context) (context.Context, context.CancelFunc) {
	ctx, cancel := context.WithCancelCause(parent)
	stop := context.AfterFunc(g.ctx, func() { cancel(context.Cause(g.ctx)) })
	return &groupContext{Context: ctx, g: g}, func() {
		stop()
		cancel(context.Canceled)
	}
}

// Release releases every lock of the group, each as Lock.Release does, and
// returns their errors joined: a lock already lost adds its ErrNotHeld
// error, and the others are released all the same.
func (g *Group) Release(ctx context.Context) error {
	var errs []error
	defer func() {
		g.cancel(ErrNotHeld)
		for _, stop := range g.stops {
			stop()
		}
	}()
	releaseEach(g.locks, func(k *Lock) {
		if err := k.Release(ctx); err != nil {
			errs = append(errs, err)
		}
	})
	return Join(errs...)
}

// releaseEach calls release for every lock of locks, even when one call
// panics (an Observer's): the first panic goes on once every lock was let
// go.
func releaseEach(locks []*Lock, release func(*Lock)) {
	var p any
	for _, k := range locks {
		func() {
			defer func() {
				if r := recover(); r != nil && p == nil {
					p = r
				}
			}()
			release(k)
		}()
	}
	if p != nil {
		panic(p)
	}
}

// groupContext is a Group's context: its Err also consults the locks.
type groupContext struct {
	context.Context
	g *Group
}

func (c *groupContext) Err() error {
	if err := c.Context.Err(); err != nil {
		return err
	}
	if c.g.Err() != nil {
		<-c.Context.Done() // the AfterFunc on the group's end cancels it
		return c.Context.Err()
	}
	return nil
}

// AcquireAll waits until it holds every key of keys, or ctx ends, and
// returns them as one Group: all or none. Keys are taken one at a time in
// one global order (sorted), so two AcquireAll calls with overlapping keys
// never deadlock each other; when one key cannot be taken (ctx ends, an
// error) the keys already taken are released before AcquireAll returns.
// That clean-up outlives ctx, by at most 5 s when the store is slow to
// answer; a release still unanswered then goes on in the background.
// Duplicate keys count once. The options apply to every key (Shared and
// WithLimit included). At most MaxGroupKeys keys; an empty list, or an
// invalid key, is an error before any I/O.
//
// A key lost while a later one is awaited (its lease ran out, or it was
// forced free) is never returned in the Group: AcquireAll releases the keys
// taken and starts again.
//
// Errors are Acquire's, for the key that could not be taken.
func (l *Locker) AcquireAll(ctx context.Context, keys []string, opts ...AcquireOption) (*Group, error) {
	return l.acquireAll(ctx, keys, opts, true)
}

// TryAcquireAll makes one attempt at each key of keys, in AcquireAll's
// order, without waiting: it returns the Group, or a *HeldError for the
// first key found taken (the keys taken before it are released), or an
// error matching ErrLockLost if a key it took was lost before the last.
func (l *Locker) TryAcquireAll(ctx context.Context, keys []string, opts ...AcquireOption) (*Group, error) {
	return l.acquireAll(ctx, keys, opts, false)
}

func (l *Locker) acquireAll(ctx context.Context, keys []string, opts []AcquireOption, wait bool) (*Group, error) {
	keys = slices.Clone(keys)
	slices.Sort(keys)
	keys = slices.Compact(keys)
	switch {
	case len(keys) == 0:
		return nil, fmt.Errorf("%w: no keys", ErrInvalidKey)
	case len(keys) > MaxGroupKeys:
		return nil, fmt.Errorf("%w: %d keys, the limit is %d", ErrInvalidKey, len(keys), MaxGroupKeys)
	}
	for _, k := range keys {
		if _, err := l.config(k, opts); err != nil {
			return nil, err
		}
	}
	g := &Group{}
	g.ctx, g.cancel = context.WithCancelCause(context.Background())
	returned := false
	defer func() {
		if !returned { // an Observer panicked: the caller never gets g
			releaseEach(g.locks, func(k *Lock) { releaseUnreturned(ctx, k) })
		}
	}()
	for {
		err := l.takeAll(ctx, g, keys, opts, wait)
		if err == nil {
			break
		}
		// Undo what was taken, bounded as Release is; the caller's ctx may
		// have ended already.
		rctx, cancel := context.WithTimeout(context.WithoutCancel(ctx), cleanupTimeout)
		releaseEach(g.locks, func(k *Lock) { _ = k.Release(rctx) })
		cancel()
		g.locks = nil
		if !wait || !errors.Is(err, errKeyLost) || ctx.Err() != nil {
			returned = true
			return nil, err
		}
	}
	returned = true
	for _, k := range g.locks {
		kctx, stop := k.Context(context.Background())
		context.AfterFunc(kctx, func() { g.cancel(context.Cause(kctx)) })
		g.stops = append(g.stops, stop)
	}
	return g, nil
}

// errKeyLost marks a takeAll that lost a key it had taken while it took the
// later ones.
var errKeyLost = errors.New("dlock: a key of the group was lost while the others were taken")

// takeAll takes keys in order into g.locks. A key lost before the last is
// taken (its lease ran out while a later key was awaited, or it was forced
// free) fails it with an error matching errKeyLost and the loss: the Group
// would not hold every key.
func (l *Locker) takeAll(ctx context.Context, g *Group, keys []string, opts []AcquireOption, wait bool) error {
	for _, key := range keys {
		k, err := l.acquire(ctx, key, opts, wait)
		if err != nil {
			return err
		}
		g.locks = append(g.locks, k)
	}
	for _, k := range g.locks {
		if err := k.Err(); err != nil {
			return fmt.Errorf("%w: %w", errKeyLost, err)
		}
	}
	return nil
}
