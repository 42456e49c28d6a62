package zklock

import (
	"context"
	"errors"
	"fmt"
	"slices"
	"strings"
	"sync"
	"time"

	"github.com/dlock-dev/dlock"
	"github.com/go-zookeeper/zk"
)

// Extend implements dlock.Backend. Each lease is renewed by a conditional
// setData of its node (one round trip; the leases of a call are sent
// concurrently on the one connection). A node that is gone (released by
// force, deleted as abandoned, or removed with an expired session) is
// dlock.ErrNotHeld, and so is a renewal that lands a TTL or more after the
// previous write by the leader's clock: the node is then deleted, never
// revived.
func (b *Backend) Extend(ctx context.Context, leases []dlock.Lease) ([]error, error) {
	errs, err := run(ctx, func() ([]error, error) {
		errs := make([]error, len(leases))
		sem := make(chan struct{}, 32)
		var wg sync.WaitGroup
		for i, l := range leases {
			sem <- struct{}{}
			wg.Go(func() {
				defer func() { <-sem }()
				errs[i] = b.extend(l)
			})
		}
		wg.Wait()
		return errs, nil
	}, nil)
	if err != nil {
		return nil, fmt.Errorf("zklock: extend: %w", err)
	}
	return errs, nil
}

func (b *Backend) extend(l dlock.Lease) error {
	n := b.heldNode(l.Key, l.Token)
	if n == nil {
		var err error
		if n, err = b.findHolder(l.Key, l.Token, l.TTL); err != nil || n == nil {
			return errOr(err, dlock.ErrNotHeld)
		}
		b.hold(l.Token, n)
	}
	b.mu.Lock()
	path, data, version, mtime, ttl := n.path, n.data, n.version, n.mtime, n.ttl
	b.mu.Unlock()
	for try := 0; ; try++ {
		st, err := b.c.Set(path, data, version)
		if errors.Is(err, zk.ErrBadVersion) && try == 0 {
			// An earlier renewal may have been applied although its reply
			// was lost: catch up if the node is still ours and was renewed
			// in time.
			d, st0, gerr := b.c.Get(path)
			// The node's data is rewritten as read: SetMetadata may have
			// changed it since.
			if gerr == nil && decode(d).Token == l.Token.String() && !late(st0.Mtime, mtime, ttl) {
				data, version, mtime = d, st0.Version, st0.Mtime
				continue
			}
		}
		if notHeld(err) {
			b.forget(l.Token, n)
			return dlock.ErrNotHeld
		}
		if err != nil {
			return fmt.Errorf("zklock: extend %q: %w", l.Key, err)
		}
		if late(st.Mtime, mtime, ttl) {
			// The lease had run out before this write: give the node up.
			_ = b.deleteHolder(b.dir(l.Key), name(path), st.Version, kindExpired, n.fence, decode(data))
			b.forget(l.Token, n)
			return fmt.Errorf("%w: lease ended %d ms before the renewal", dlock.ErrNotHeld, st.Mtime-mtime-ttl.Milliseconds())
		}
		b.mu.Lock()
		if st.Version > n.version { // a SetMetadata's reply may come first
			n.version, n.mtime = st.Version, st.Mtime
		}
		b.mu.Unlock()
		return nil
	}
}

func errOr(err, alt error) error {
	if err != nil {
		return err
	}
	return alt
}

// findHolder returns the node of key that carries token if the rules grant
// it even with every node ahead counted live (a lease this Backend did not
// record), or nil.
func (b *Backend) findHolder(key string, token dlock.Token, ttl time.Duration) (*node, error) {
	dir := b.dir(key)
	q, err := b.queue(dir)
	if err != nil {
		return nil, err
	}
	v := b.newView(dir, q, frozen)
	j, err := v.find(token)
	if err != nil || j < 0 {
		return nil, err
	}
	s := v.seen[j]
	if s.r.Mark {
		return nil, nil
	}
	if vd, err := v.judge(j, true); err != nil || !vd.granted {
		return nil, err
	}
	return &node{key: key, path: dir + "/" + q[j].name, data: s.data, version: s.st.Version, mtime: s.st.Mtime, ttl: ttl, fence: s.st.Czxid}, nil
}

// Release implements dlock.Backend. A node this Backend holds is deleted in
// one transaction that also rewrites it, which tells whether its lease had
// already run out (then the result is dlock.ErrNotHeld, and the key was
// free anyway). A token this Backend does not know (an acquisition whose
// outcome was unknown, or another client's) is looked for in the key's
// queue, one read per node; its node is deleted, and the result is nil only
// if the rules granted it.
func (b *Backend) Release(ctx context.Context, key string, token dlock.Token) error {
	_, err := run(ctx, func() (struct{}, error) { return struct{}{}, b.release(key, token) }, nil)
	if err != nil && !errors.Is(err, dlock.ErrNotHeld) {
		return fmt.Errorf("zklock: release %q: %w", key, err)
	}
	return err
}

func (b *Backend) release(key string, token dlock.Token) error {
	if n := b.heldNode(key, token); n != nil {
		b.mu.Lock()
		path, data, mtime, ttl := n.path, n.data, n.mtime, n.ttl
		b.mu.Unlock()
		res, err := b.journaled(b.dir(key), newEntry(kindReleased, name(path), n.fence, decode(data)),
			&zk.SetDataRequest{Path: path, Data: data, Version: -1},
			&zk.DeleteRequest{Path: path, Version: -1},
		)
		if err == nil || notHeld(err) {
			b.forget(token, n)
		}
		switch {
		case notHeld(err):
			return dlock.ErrNotHeld
		case err != nil:
			return err
		case len(res) > 0 && res[0].Stat != nil && late(res[0].Stat.Mtime, mtime, ttl):
			return fmt.Errorf("%w: the lease had expired", dlock.ErrNotHeld)
		}
		return nil
	}
	dir := b.dir(key)
	q, err := b.queue(dir)
	if err != nil {
		return err
	}
	v := b.newView(dir, q, frozen)
	j, err := v.find(token)
	if err != nil || j < 0 {
		return errOr(err, dlock.ErrNotHeld)
	}
	held, err := v.holds(j)
	if err != nil {
		return err
	}
	s := v.seen[j]
	del := func() error { return b.c.Delete(dir+"/"+q[j].name, s.st.Version) }
	if held {
		del = func() error { return b.deleteHolder(dir, q[j].name, s.st.Version, kindReleased, s.st.Czxid, s.r) }
	}
	if err := del(); err != nil {
		if notHeld(err) {
			return dlock.ErrNotHeld
		}
		return err
	}
	if !held {
		return dlock.ErrNotHeld
	}
	return nil
}

// ForceRelease implements dlock.ForceReleaser: it deletes every node of the
// key that holds it (for an exclusive hold, the head of the queue), which
// hands the key to the next waiters. The old holders learn of the loss at
// their next renewal.
func (b *Backend) ForceRelease(ctx context.Context, key string) error {
	_, err := run(ctx, func() (struct{}, error) {
		dir := b.dir(key)
		for range maxRounds {
			q, err := b.queue(dir)
			if err != nil {
				return struct{}{}, err
			}
			if len(q) == 0 {
				return struct{}{}, dlock.ErrNotHeld
			}
			v := b.newView(dir, q, frozen)
			deleted, raced := 0, false
			for j := range q {
				held, err := v.holds(j)
				if err != nil {
					return struct{}{}, err
				}
				if !held {
					continue
				}
				s := v.seen[j]
				switch err := b.deleteHolder(dir, q[j].name, -1, kindForced, s.st.Czxid, s.r); {
				case err == nil:
					deleted++
				case errors.Is(err, zk.ErrNoNode):
					raced = true
				default:
					return struct{}{}, err
				}
			}
			switch {
			case deleted > 0:
				return struct{}{}, nil
			case !raced:
				return struct{}{}, dlock.ErrNotHeld
			}
			// Released meanwhile: look again.
		}
		return struct{}{}, dlock.ErrNotHeld
	}, nil)
	if err != nil && !errors.Is(err, dlock.ErrNotHeld) {
		return fmt.Errorf("zklock: force release %q: %w", key, err)
	}
	return err
}

// List implements dlock.Lister: every holder of every matching key, in
// every mode, ordered by key and then by queue order. It reads the children
// of the root, then the queue of each matching key and its nodes
// (concurrently across keys), so it costs O(nodes) round trips: it is for
// operators, not hot paths. ExpiresAt is a node's mtime plus its TTL, the
// leader's clock read as the local one; nodes whose lease has run out by
// that reading are left out.
func (b *Backend) List(ctx context.Context, prefix string) ([]dlock.LockInfo, error) {
	now := func(key string) ([]dlock.LockInfo, error) { return b.holdersAt(key, time.Now().UnixMilli()) }
	out, err := eachKey(ctx, b, prefix, now, func(h dlock.LockInfo) string { return h.Key })
	if err != nil {
		return nil, fmt.Errorf("zklock: list: %w", err)
	}
	return out, nil
}

var _ dlock.WaiterLister = (*Backend)(nil)

// ListWaiters implements dlock.WaiterLister: the live nodes that do not
// hold their key, in queue order (the order they will be served), with
// Since the time their current wait began. A waiter's node stays queued
// between two AcquireWait calls of one acquisition, so a Locker's waiter
// shows for its whole wait; writer marks, which an exclusive TryAcquire
// leaves, are not waiters. It costs what List costs.
func (b *Backend) ListWaiters(ctx context.Context, prefix string) ([]dlock.WaiterInfo, error) {
	out, err := eachKey(ctx, b, prefix, b.waiters, func(w dlock.WaiterInfo) string { return w.Key })
	if err != nil {
		return nil, fmt.Errorf("zklock: list waiters: %w", err)
	}
	return out, nil
}

// eachKey calls of for every key under the root that starts with prefix
// (16 at a time) and returns what they return, ordered by key (keyOf) and
// then as of returned them.
func eachKey[T any](ctx context.Context, b *Backend, prefix string, of func(key string) ([]T, error), keyOf func(T) string) ([]T, error) {
	return run(ctx, func() ([]T, error) {
		names, _, err := b.c.Children(b.root)
		if errors.Is(err, zk.ErrNoNode) {
			return nil, nil
		}
		if err != nil {
			return nil, err
		}
		want := keyEscape(prefix)
		if prefix == "" {
			want = "k"
		}
		var keys []string
		for _, nm := range names {
			if k, ok := keyUnescape(nm); ok && strings.HasPrefix(nm, want) && strings.HasPrefix(k, prefix) {
				keys = append(keys, k)
			}
		}
		found := make([][]T, len(keys))
		errs := make([]error, len(keys))
		sem := make(chan struct{}, 16)
		var wg sync.WaitGroup
		for i, k := range keys {
			sem <- struct{}{}
			wg.Go(func() {
				defer func() { <-sem }()
				found[i], errs[i] = of(k)
			})
		}
		wg.Wait()
		if err := dlock.Join(errs...); err != nil {
			return nil, err
		}
		var out []T
		for _, f := range found {
			out = append(out, f...)
		}
		slices.SortStableFunc(out, func(x, y T) int { return strings.Compare(keyOf(x), keyOf(y)) })
		return out, nil
	}, nil)
}

// waiters describes key's waiting nodes, in queue order.
func (b *Backend) waiters(key string) ([]dlock.WaiterInfo, error) {
	dir := b.dir(key)
	q, err := b.queue(dir)
	if err != nil {
		return nil, err
	}
	v := b.newView(dir, q, time.Now().UnixMilli())
	var out []dlock.WaiterInfo
	for j := range q {
		s, err := v.look(j)
		if err != nil {
			return nil, err
		}
		if s.dead || s.r.Mark {
			continue
		}
		held, err := v.holds(j)
		if err != nil {
			return nil, err
		}
		if !held {
			h := v.holderInfo(key, j)
			out = append(out, dlock.WaiterInfo{Key: key, Owner: h.Owner, Token: h.Token, Metadata: h.Metadata,
				Mode: h.Mode, Limit: h.Limit, Since: h.AcquiredAt})
		}
	}
	return out, nil
}

// holdersAt describes key's holders, in queue order, at the leader's time
// now (frozen: counting every node until it is deleted).
func (b *Backend) holdersAt(key string, now int64) ([]dlock.LockInfo, error) {
	dir := b.dir(key)
	q, err := b.queue(dir)
	if err != nil {
		return nil, err
	}
	v := b.newView(dir, q, now)
	var out []dlock.LockInfo
	for j := range q {
		held, err := v.holds(j)
		if err != nil {
			return nil, err
		}
		if held {
			h := v.holderInfo(key, j)
			h.ExpiresAt = time.UnixMilli(v.seen[j].end)
			out = append(out, h)
		}
	}
	return out, nil
}
