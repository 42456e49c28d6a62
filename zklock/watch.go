package zklock

import (
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"time"

	"github.com/dlock-dev/dlock"
	"github.com/go-zookeeper/zk"
)

var (
	_ dlock.Watcher        = (*Backend)(nil)
	_ dlock.MetadataSetter = (*Backend)(nil)
)

// Watch implements dlock.Watcher with two ZooKeeper watches on key's
// directory: a child watch, which fires when a node is created or deleted
// (a grant, a release, a waiter queueing or leaving, and the deletion of
// every node of an ended session), and a data watch, which fires when the
// directory is created, deleted or touched (SetMetadata touches it). Each
// fired watch is set again, then the change is reported: a change between
// the firing and the new watch is thus seen by whoever reads the key after
// the report. Expired leases are reported when a contender deletes their
// node; the caller also looks at ExpiresAt. The client sets the watches
// again itself after a reconnection within the session, and the server
// then fires those whose nodes changed meanwhile. The channel is closed
// when ctx ends, when the session ends (expired, or the Conn closed), or
// when a watch cannot be set again (the connection is down).
func (b *Backend) Watch(ctx context.Context, key string) (<-chan struct{}, error) {
	w := &dirWatch{b: b, dir: b.dir(key)}
	if _, err := run(ctx, func() (struct{}, error) { return struct{}{}, w.arm() }, nil); err != nil {
		return nil, fmt.Errorf("zklock: watch %q: %w", key, err)
	}
	ch := make(chan struct{}, 1)
	go func() {
		defer close(ch)
		for fired(ctx, &w.data, &w.children) {
			if _, err := run(ctx, func() (struct{}, error) { return struct{}{}, w.arm() }, nil); err != nil {
				return
			}
			select {
			case ch <- struct{}{}:
			default:
			}
		}
	}()
	return ch, nil
}

// fired waits until one of the one-shot watches *a and *b (nil while not
// set) fires, and clears it. It returns false when ctx ends first, and
// when the watch reports that it no longer watches (the session ended) or
// an error.
func fired(ctx context.Context, a, b *<-chan zk.Event) bool {
	var ev zk.Event
	var open bool
	select {
	case ev, open = <-*a:
		*a = nil
	case ev, open = <-*b:
		*b = nil
	case <-ctx.Done():
		return false
	}
	return open && ev.Type != zk.EventNotWatching && ev.Err == nil
}

// dirWatch is the pair of watches of Watch. Only its goroutine (or, at
// first, Watch) uses it.
type dirWatch struct {
	b        *Backend
	dir      string
	data     <-chan zk.Event // the directory's data or existence; nil once fired
	children <-chan zk.Event // its children; nil once fired or while it does not exist
}

// arm sets the watches that are not set: the data watch, and the child
// watch if the directory exists (if it does not, the data watch fires when
// it is created).
func (w *dirWatch) arm() error {
	if w.data == nil {
		_, _, ch, err := w.b.c.ExistsW(w.dir)
		if err != nil {
			return err
		}
		w.data = ch
	}
	if w.children == nil {
		_, _, ch, err := w.b.c.ChildrenW(w.dir)
		if err != nil && !errors.Is(err, zk.ErrNoNode) {
			return err
		}
		w.children = ch
	}
	return nil
}

// SetMetadata implements dlock.MetadataSetter. It rewrites the node that
// token holds with the new metadata, checking the node's version, in one
// transaction that also touches the key's directory, which wakes the
// watches (Watch). Like a renewal, the write moves the node's mtime, so it
// starts the lease again in the store (never for less than the Locker
// counts), and like a renewal it never revives a lease that had run out:
// the node is then deleted and the result is dlock.ErrNotHeld. A waiting
// node is not held: dlock.ErrNotHeld.
func (b *Backend) SetMetadata(ctx context.Context, key string, token dlock.Token, metadata string) error {
	_, err := run(ctx, func() (struct{}, error) { return struct{}{}, b.setMetadata(key, token, metadata) }, nil)
	if err != nil && !errors.Is(err, dlock.ErrNotHeld) {
		return fmt.Errorf("zklock: set metadata of %q: %w", key, err)
	}
	return err
}

func (b *Backend) setMetadata(key string, token dlock.Token, metadata string) error {
	n := b.heldNode(key, token)
	if n == nil {
		found, err := b.findHolder(key, token, 0)
		if err != nil || found == nil {
			return errOr(err, dlock.ErrNotHeld)
		}
		found.ttl = time.Duration(decode(found.data).TTL) * time.Millisecond
		n = found
	}
	b.mu.Lock()
	path, data, version, mtime, ttl := n.path, n.data, n.version, n.mtime, n.ttl
	b.mu.Unlock()
	for range maxRounds {
		r := decode(data)
		if r.Initial == nil {
			was := r.Metadata
			r.Initial = &was
		}
		r.Metadata = metadata
		nd, _ := json.Marshal(r)
		res, err := b.journaled(b.dir(key), newEntry(kindMetadata, name(path), n.fence, r),
			&zk.SetDataRequest{Path: path, Data: nd, Version: version},
			&zk.SetDataRequest{Path: b.dir(key), Data: nil, Version: -1},
		)
		if errors.Is(err, zk.ErrBadVersion) {
			// A renewal landed since the node was read (or an earlier
			// write's reply was lost): write over it if the node is still
			// the token's and was renewed in time.
			d, st, gerr := b.c.Get(path)
			if gerr == nil && decode(d).Token == token.String() && !late(st.Mtime, mtime, ttl) {
				data, version, mtime = d, st.Version, st.Mtime
				continue
			}
		}
		if notHeld(err) {
			b.forget(token, n)
			return dlock.ErrNotHeld
		}
		if err != nil {
			return err
		}
		if len(res) == 0 || res[0].Stat == nil {
			return fmt.Errorf("unexpected reply to set data: %+v", res)
		}
		st := res[0].Stat
		if late(st.Mtime, mtime, ttl) {
			// The lease had run out before this write: give the node up.
			_ = b.deleteHolder(b.dir(key), name(path), st.Version, kindExpired, n.fence, r)
			b.forget(token, n)
			return fmt.Errorf("%w: lease ended %d ms before the change", dlock.ErrNotHeld, st.Mtime-mtime-ttl.Milliseconds())
		}
		b.mu.Lock()
		if st.Version > n.version { // a renewal's reply may come after this one
			n.data, n.version, n.mtime = nd, st.Version, st.Mtime
		}
		b.mu.Unlock()
		return nil
	}
	return fmt.Errorf("node changes too often")
}
