package etcdlock

import (
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"slices"

	"github.com/dlock-dev/dlock"
	"go.etcd.io/etcd/api/v3/mvccpb"
	clientv3 "go.etcd.io/etcd/client/v3"
)

var (
	_ dlock.Watcher        = (*Backend)(nil)
	_ dlock.HolderWatcher  = (*Backend)(nil)
	_ dlock.MetadataSetter = (*Backend)(nil)
)

// errClosed is the error of a Watch after Close.
var errClosed = errors.New("backend closed")

// Watch implements dlock.Watcher with an etcd watch on key's directory,
// from the revision after a read of it: every change etcd applies after
// Watch returns has a larger revision, so none is missed. Every put and
// deletion of an entry is reported: a grant, a release, a metadata change,
// an expiry (etcd revokes expired leases itself), and also a waiter's entry
// coming or going. The client resumes the watch after a broken connection
// from the last revision it saw; the channel is closed when ctx ends, when
// Close is called, or when etcd ends the watch: the member lost its leader,
// or the revision to resume from was compacted.
func (b *Backend) Watch(ctx context.Context, key string) (<-chan struct{}, error) {
	var rev int64
	err := b.retry(ctx, func(ctx context.Context) error {
		resp, err := b.c.Get(ctx, b.dir(key), clientv3.WithPrefix(), clientv3.WithCountOnly())
		if err == nil {
			rev = resp.Header.Revision
		}
		return err
	})
	if err != nil {
		return nil, fmt.Errorf("etcdlock: watch %q: %w", key, err)
	}
	return b.watchFrom(ctx, key, rev+1)
}

// watchFrom watches key's directory from revision rev.
func (b *Backend) watchFrom(ctx context.Context, key string, rev int64) (<-chan struct{}, error) {
	b.mu.Lock()
	if b.closed {
		b.mu.Unlock()
		return nil, fmt.Errorf("etcdlock: watch %q: %w", key, errClosed)
	}
	b.bg.Add(1)
	b.mu.Unlock()
	// Without a leader the member would keep the watch open and silent.
	wctx, cancel := context.WithCancel(clientv3.WithRequireLeader(ctx))
	wch := b.c.Watch(wctx, b.dir(key), clientv3.WithPrefix(), clientv3.WithRev(rev))
	ch := make(chan struct{}, 1)
	go func() {
		defer b.bg.Done()
		defer close(ch)
		defer cancel()
		for {
			select {
			case wr, ok := <-wch:
				if !ok || wr.Canceled || wr.Err() != nil {
					return
				}
				if len(wr.Events) > 0 {
					select {
					case ch <- struct{}{}:
					default:
					}
				}
			case <-ctx.Done():
				return
			case <-b.done:
				return
			}
		}
	}()
	return ch, nil
}

// maxBehind is how many changes WatchHolders keeps for a reader that is
// behind before it ends the watch (closes its channel).
const maxBehind = 1024

// WatchHolders implements dlock.HolderWatcher: it reads key's entries and
// watches its directory from the revision after that read, applies each
// revision's puts and deletions to the entries in turn, and sends the
// holders after every revision that changed them (a waiter's entry coming
// or going changes nothing). etcd revokes expired leases itself, so an
// expiry is a deletion like a release, and ExpiresAt is left zero. The
// channel is closed as Watch's is, and when the reader falls more than
// 1024 changes behind.
func (b *Backend) WatchHolders(ctx context.Context, key string) ([]dlock.LockInfo, <-chan []dlock.LockInfo, error) {
	q, rev, err := b.queueAt(ctx, key)
	if err != nil {
		return nil, nil, fmt.Errorf("etcdlock: watch %q: %w", key, err)
	}
	entries := map[string]*mvccpb.KeyValue{}
	for _, it := range q {
		entries[string(it.kv.Key)] = it.kv
	}
	now := holdersOf(key, entries)
	b.mu.Lock()
	if b.closed {
		b.mu.Unlock()
		return nil, nil, fmt.Errorf("etcdlock: watch %q: %w", key, errClosed)
	}
	b.bg.Add(1)
	b.mu.Unlock()
	wctx, cancel := context.WithCancel(clientv3.WithRequireLeader(ctx))
	wch := b.c.Watch(wctx, b.dir(key), clientv3.WithPrefix(), clientv3.WithRev(rev+1))
	out := make(chan []dlock.LockInfo)
	// The goroutine has its own last: the caller reads now.
	go func(last []dlock.LockInfo) {
		defer b.bg.Done()
		defer close(out)
		defer cancel()
		var queue [][]dlock.LockInfo
		for {
			var send chan<- []dlock.LockInfo
			var next []dlock.LockInfo
			if len(queue) > 0 {
				send, next = out, queue[0]
			}
			select {
			case wr, ok := <-wch:
				if !ok || wr.Canceled || wr.Err() != nil {
					return
				}
				for i := 0; i < len(wr.Events); {
					rev := wr.Events[i].Kv.ModRevision
					for ; i < len(wr.Events) && wr.Events[i].Kv.ModRevision == rev; i++ {
						ev := wr.Events[i]
						if ev.Type == clientv3.EventTypeDelete {
							delete(entries, string(ev.Kv.Key))
						} else {
							entries[string(ev.Kv.Key)] = ev.Kv
						}
					}
					if hs := holdersOf(key, entries); !sameHolders(hs, last) {
						queue, last = append(queue, hs), hs
					}
				}
				if len(queue) > maxBehind {
					return
				}
			case send <- next:
				queue = queue[1:]
			case <-ctx.Done():
				return
			case <-b.done:
				return
			}
		}
	}(now)
	return now, out, nil
}

// holdersOf returns the holders among key's entries, in queue order.
func holdersOf(key string, entries map[string]*mvccpb.KeyValue) []dlock.LockInfo {
	kvs := make([]*mvccpb.KeyValue, 0, len(entries))
	for _, kv := range entries {
		kvs = append(kvs, kv)
	}
	q := items(kvs)
	var hs []dlock.LockInfo
	for i, held := range holders(q) {
		if held {
			hs = append(hs, info(key, q[i].kv))
		}
	}
	return hs
}

// sameHolders reports whether a and b are the same holders with the same
// metadata.
func sameHolders(a, b []dlock.LockInfo) bool {
	return slices.EqualFunc(a, b, func(x, y dlock.LockInfo) bool {
		return x.Token == y.Token && x.Fence == y.Fence && x.Metadata == y.Metadata
	})
}

// SetMetadata implements dlock.MetadataSetter. It finds the entry that
// carries token and holds the lock (the head entry is read first, the
// key's other entries only if the head carries another token), and
// rewrites its value with the new metadata in a transaction that checks
// the entry has not changed since it was read; the entry keeps its lease
// and create revision (its fence). An entry that only waits is not held:
// dlock.ErrNotHeld. As for Release, a lease past its TTL that the leader
// has not revoked yet (up to 500 ms) still counts as held.
func (b *Backend) SetMetadata(ctx context.Context, key string, token dlock.Token, metadata string) error {
	kv, err := b.holding(ctx, key, token.String())
	if err != nil {
		return fmt.Errorf("etcdlock: set metadata of %q: %w", key, err)
	}
	for range maxChecks {
		if kv == nil {
			return dlock.ErrNotHeld
		}
		r := decode(kv.Value)
		if r.Metadata == metadata {
			return nil
		}
		r.Metadata = metadata
		v, _ := json.Marshal(r)
		name := string(kv.Key)
		var resp *clientv3.TxnResponse
		err := b.retry(ctx, func(ctx context.Context) error {
			// Repeating it is safe: if an earlier attempt wrote the value,
			// this one reads it back.
			var err error
			resp, err = b.c.Txn(ctx).
				If(clientv3.Compare(clientv3.ModRevision(name), "=", kv.ModRevision)).
				Then(clientv3.OpPut(name, string(v), clientv3.WithIgnoreLease())).
				Else(clientv3.OpGet(name)).
				Commit()
			return err
		})
		if err != nil {
			return fmt.Errorf("etcdlock: set metadata of %q: %w", key, err)
		}
		if resp.Succeeded {
			return nil
		}
		// Changed since it was read: by this holder's own concurrent call,
		// or gone. The same entry with the same token still holds the
		// lock (an entry once granted stays granted while it exists).
		kv = nil
		if kvs := resp.Responses[0].GetResponseRange().GetKvs(); len(kvs) > 0 && decode(kvs[0].Value).Token == token.String() {
			kv = kvs[0]
		}
	}
	return fmt.Errorf("etcdlock: set metadata of %q: entry changes too often", key)
}

// holding returns the entry of key that carries token and holds the lock,
// or nil.
func (b *Backend) holding(ctx context.Context, key, token string) (*mvccpb.KeyValue, error) {
	h, err := b.head(ctx, key)
	if err != nil || h == nil {
		return nil, err
	}
	if decode(h.Value).Token == token {
		return h, nil // the head always holds the lock
	}
	q, err := b.queue(ctx, key)
	if err != nil {
		return nil, err
	}
	for i, held := range holders(q) {
		if held && q[i].rec.Token == token {
			return q[i].kv, nil
		}
	}
	return nil, nil
}
