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
		if n, err = b.findHead(l.Key, l.Token, l.TTL); err != nil || n == nil {
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
			if gerr == nil && decode(d).Token == l.Token.String() && !late(st0.Mtime, mtime, ttl) {
				version, mtime = st0.Version, st0.Mtime
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
			_ = b.c.Delete(path, st.Version)
			b.forget(l.Token, n)
			return fmt.Errorf("%w: lease ended %d ms before the renewal", dlock.ErrNotHeld, st.Mtime-mtime-ttl.Milliseconds())
		}
		b.mu.Lock()
		n.version, n.mtime = st.Version, st.Mtime
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

// findHead returns the head node of key if it carries token (a lease this
// Backend did not record), or nil.
func (b *Backend) findHead(key string, token dlock.Token, ttl time.Duration) (*node, error) {
	dir := b.dir(key)
	q, err := b.queue(dir)
	if err != nil || len(q) == 0 {
		return nil, err
	}
	path := dir + "/" + q[0]
	data, st, err := b.c.Get(path)
	if errors.Is(err, zk.ErrNoNode) || err == nil && decode(data).Token != token.String() {
		return nil, nil
	}
	if err != nil {
		return nil, err
	}
	return &node{key: key, path: path, data: data, version: st.Version, mtime: st.Mtime, ttl: ttl}, nil
}

// Release implements dlock.Backend. A node this Backend holds is deleted in
// one transaction that also rewrites it, which tells whether its lease had
// already run out (then the result is dlock.ErrNotHeld, and the key was
// free anyway). A token this Backend does not know (an acquisition whose
// outcome was unknown, or another client's) is looked for in the key's
// queue, one read per node; its node is deleted, and the result is nil only
// if it was the head.
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
		res, err := b.c.Multi(
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
	tok := token.String()
	for i, nm := range q {
		data, st, err := b.c.Get(dir + "/" + nm)
		if errors.Is(err, zk.ErrNoNode) {
			continue
		}
		if err != nil {
			return err
		}
		if decode(data).Token != tok {
			continue
		}
		if err := b.c.Delete(dir+"/"+nm, st.Version); err != nil {
			if notHeld(err) {
				return dlock.ErrNotHeld
			}
			return err
		}
		if i == 0 {
			return nil
		}
		return dlock.ErrNotHeld
	}
	return dlock.ErrNotHeld
}

// ForceRelease implements dlock.ForceReleaser: it deletes the head of the
// key's queue, which hands the key to the next waiter. The old holder
// learns of the loss at its next renewal.
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
			err = b.c.Delete(dir+"/"+q[0], -1)
			if errors.Is(err, zk.ErrNoNode) {
				continue // released meanwhile: look again
			}
			return struct{}{}, err
		}
		return struct{}{}, dlock.ErrNotHeld
	}, nil)
	if err != nil && !errors.Is(err, dlock.ErrNotHeld) {
		return fmt.Errorf("zklock: force release %q: %w", key, err)
	}
	return err
}

// List implements dlock.Lister. It reads the children of the root, then the
// queue and head node of each matching key (concurrently), so it costs
// O(keys) round trips: it is for operators, not hot paths. ExpiresAt is the
// head's mtime plus its TTL, the leader's clock read as the local one; heads
// whose lease has run out by that reading are left out.
func (b *Backend) List(ctx context.Context, prefix string) ([]dlock.LockInfo, error) {
	out, err := run(ctx, func() ([]dlock.LockInfo, error) {
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
		infos := make([]*dlock.LockInfo, len(keys))
		errs := make([]error, len(keys))
		sem := make(chan struct{}, 16)
		var wg sync.WaitGroup
		for i, k := range keys {
			sem <- struct{}{}
			wg.Go(func() {
				defer func() { <-sem }()
				infos[i], errs[i] = b.headInfo(k)
			})
		}
		wg.Wait()
		if err := dlock.Join(errs...); err != nil {
			return nil, err
		}
		var out []dlock.LockInfo
		for _, h := range infos {
			if h != nil {
				out = append(out, *h)
			}
		}
		slices.SortFunc(out, func(x, y dlock.LockInfo) int { return strings.Compare(x.Key, y.Key) })
		return out, nil
	}, nil)
	if err != nil {
		return nil, fmt.Errorf("zklock: list: %w", err)
	}
	return out, nil
}

// headInfo describes key's holder, or returns nil if it has none.
func (b *Backend) headInfo(key string) (*dlock.LockInfo, error) {
	dir := b.dir(key)
	for range maxRounds {
		q, err := b.queue(dir)
		if err != nil || len(q) == 0 {
			return nil, err
		}
		data, st, err := b.c.Get(dir + "/" + q[0])
		if errors.Is(err, zk.ErrNoNode) {
			continue
		}
		if err != nil {
			return nil, err
		}
		r := decode(data)
		end := expiry(r, st)
		if end <= time.Now().UnixMilli() {
			return nil, nil
		}
		h := info(key, r, st)
		h.ExpiresAt = time.UnixMilli(end)
		return &h, nil
	}
	return nil, nil
}
