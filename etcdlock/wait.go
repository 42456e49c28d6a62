package etcdlock

import (
	"context"
	"errors"
	"fmt"
	"slices"
	"time"

	"github.com/dlock-dev/dlock"
	"go.etcd.io/etcd/api/v3/v3rpc/rpctypes"
	clientv3 "go.etcd.io/etcd/client/v3"
)

// The Locker measures a lease from the moment it called AcquireWait, and
// gives up on it a margin (less than half the TTL) before the TTL ends. One
// AcquireWait call therefore waits at most a third of the TTL; then it parks
// its entry, still queued, and returns Acquired=false. The Locker calls again
// at once (with a new token), and that call takes the parked entry over:
// renews its lease, writes the new token into it and keeps waiting in the
// same place in the queue. A parked entry nobody takes over within
// parkTimeout (the waiter gave up between two calls) is removed, and so is
// one that reaches the head of the queue while parked: the key would
// otherwise be held by nobody until then.
const parkTimeout = time.Second

// maxChecks bounds the predecessor checks of one AcquireWait call; each
// follows a deletion or a failed watch, so the bound is never reached in
// practice.
const maxChecks = 10_000

// entry is a waiting acquisition's key in a lock's directory.
type entry struct {
	key   string           // dlock key
	name  string           // etcd key
	lease clientv3.LeaseID // the entry's own lease
	secs  int64            // the lease's TTL in seconds
	rev   int64            // create revision: the place in the queue, and the fence
	timer *time.Timer      // removes the entry while parked; guarded by Backend.mu
	// unwatch ends the watch that removes the entry if it reaches the head
	// while parked; guarded by Backend.mu.
	unwatch context.CancelFunc
}

// AcquireWait implements dlock.Waiter. It queues an entry for req (or takes
// over the one an earlier call for the same key parked), then watches only
// the entry just before its own until it is deleted, and holds the lock when
// no older entry is left. It returns Acquired=false with a nil error when ctx
// ends (the entry is then deleted) or after a third of req.TTL (the entry
// stays queued for the next call).
func (b *Backend) AcquireWait(ctx context.Context, req dlock.Request) (dlock.Result, error) {
	began := time.Now()
	bound := time.NewTimer(req.TTL / 3)
	defer bound.Stop()
	// The call's requests get the same bound, plus one attempt's timeout:
	// against a slow member the retries around each request (up to ~5.5 s)
	// would otherwise hold the call, and its entry's place, far past it
	// (the fault harness saw calls of 5.5 and 8.5 s). A call cut short
	// returns Acquired=false like one whose bound fired.
	ictx, cancel := context.WithDeadline(ctx, began.Add(req.TTL/3+b.timeout))
	defer cancel()
	cut := func() bool { return ctx.Err() == nil && ictx.Err() != nil }
	e, err := b.enter(ictx, req)
	if err == nil && e == nil {
		err = errors.New("entry vanished while it was being written")
	}
	if err != nil {
		if ctx.Err() != nil || cut() {
			return dlock.Result{}, nil
		}
		return dlock.Result{}, fmt.Errorf("etcdlock: acquire %q: %w", req.Key, err)
	}
	held, err := b.wait(ictx, e, bound.C)
	if err != nil && cut() {
		b.park(e) // still queued (or gone: the next call finds out)
		return dlock.Result{}, nil
	}
	switch {
	case held:
		// Renew the entry's lease at the grant, so that the Locker can time
		// a whole lease from here instead of from the wait's start. If the
		// renewal fails the grant stands, timed from the start (always safe).
		res := dlock.Result{Acquired: true, Fence: uint64(e.rev)}
		sending := time.Now()
		if err := b.keepAlive(ctx, e.lease); err == nil {
			res.SentAfter = sending.Sub(began)
		}
		return res, nil
	case ctx.Err() != nil:
		// The waiter gave up: leave the queue at once, so that it does not
		// hold up the others when its turn comes.
		b.revokeLater(ctx, e.lease)
		return dlock.Result{}, nil
	case err != nil:
		b.revokeLater(ctx, e.lease)
		return dlock.Result{}, fmt.Errorf("etcdlock: acquire %q: wait: %w", req.Key, err)
	case e.rev == 0: // the entry is gone (its lease expired): queue anew
		return dlock.Result{}, nil
	default:
		b.park(e)
		return dlock.Result{}, nil
	}
}

// enter returns req's entry: a parked one taken over, or a new one at the end
// of the queue. On error it has removed what it created.
func (b *Backend) enter(ctx context.Context, req dlock.Request) (*entry, error) {
	secs := ttlSeconds(req.TTL)
	if e := b.unpark(req.Key, secs); e != nil {
		ok, err := b.takeOver(ctx, e, req)
		if err != nil {
			b.revokeLater(ctx, e.lease)
			return nil, err
		}
		if ok {
			return e, nil
		}
	}
	id, err := b.grant(ctx, req.TTL)
	if err != nil {
		return nil, fmt.Errorf("grant: %w", err)
	}
	e := &entry{key: req.Key, name: b.name(req.Key, id), lease: id, secs: secs}
	val := encode(req)
	err = b.retry(ctx, func(ctx context.Context) error {
		// Repeating it is safe: if an earlier attempt wrote the entry, this
		// one reads back its create revision.
		resp, err := b.c.Txn(ctx).
			If(clientv3.Compare(clientv3.CreateRevision(e.name), "=", 0)).
			Then(clientv3.OpPut(e.name, val, clientv3.WithLease(id))).
			Else(clientv3.OpGet(e.name)).
			Commit()
		if err != nil {
			return err
		}
		if resp.Succeeded {
			e.rev = resp.Header.Revision
		} else if kvs := resp.Responses[0].GetResponseRange().GetKvs(); len(kvs) > 0 {
			e.rev = kvs[0].CreateRevision
		}
		return nil
	})
	if err != nil || e.rev == 0 {
		b.revokeLater(ctx, id)
		return nil, err
	}
	return e, nil
}

// takeOver renews a parked entry's lease (so that it lasts the full TTL from
// now, as the Locker assumes) and writes req's token into it. It reports
// false if the entry no longer exists.
func (b *Backend) takeOver(ctx context.Context, e *entry, req dlock.Request) (bool, error) {
	if err := b.keepAlive(ctx, e.lease); err != nil {
		if errors.Is(err, rpctypes.ErrLeaseNotFound) {
			return false, nil
		}
		return false, fmt.Errorf("renew waiting entry: %w", err)
	}
	val := encode(req)
	var ok bool
	err := b.retry(ctx, func(ctx context.Context) error {
		resp, err := b.c.Txn(ctx).
			If(clientv3.Compare(clientv3.CreateRevision(e.name), "=", e.rev)).
			Then(clientv3.OpPut(e.name, val, clientv3.WithLease(e.lease))).
			Commit()
		if err == nil {
			ok = resp.Succeeded
		}
		return err
	})
	return ok, err
}

// wait waits until e is the oldest entry of its key (true), bound fires or
// ctx ends (false). If e disappeared, it sets e.rev to 0 and returns false.
func (b *Backend) wait(ctx context.Context, e *entry, bound <-chan time.Time) (bool, error) {
	dir := b.dir(e.key)
	prev := append(clientv3.WithLastCreate(), clientv3.WithMaxCreateRev(e.rev-1))
	for range maxChecks {
		var resp *clientv3.TxnResponse
		err := b.retry(ctx, func(ctx context.Context) error {
			var err error
			resp, err = b.c.Txn(ctx).
				If(clientv3.Compare(clientv3.CreateRevision(e.name), "=", e.rev)).
				Then(clientv3.OpGet(dir, prev...)).
				Commit()
			return err
		})
		if err != nil {
			return false, err
		}
		if !resp.Succeeded {
			e.rev = 0
			return false, nil
		}
		kvs := resp.Responses[0].GetResponseRange().GetKvs()
		if len(kvs) == 0 {
			return true, nil
		}
		deleted, err := b.waitDelete(ctx, string(kvs[0].Key), resp.Header.Revision, bound)
		if !deleted || err != nil {
			return false, err
		}
	}
	return false, nil
}

// waitDelete watches the entry name, which existed at revision rev, until it
// is deleted (true), bound fires or ctx ends (false). A watch that fails (the
// member lost its leader, the revision was compacted) also returns true,
// after a short pause, so that the caller looks again.
func (b *Backend) waitDelete(ctx context.Context, name string, rev int64, bound <-chan time.Time) (bool, error) {
	// Without a leader the member would keep the watch open and silent.
	wctx, cancel := context.WithCancel(clientv3.WithRequireLeader(ctx))
	defer cancel()
	wch := b.c.Watch(wctx, name, clientv3.WithRev(rev+1), clientv3.WithFilterPut())
	failed := false
	for !failed { // each round consumes a watch response; bound ends it
		select {
		case wr, ok := <-wch:
			if !ok || wr.Err() != nil || wr.Canceled {
				failed = true
				continue
			}
			for _, ev := range wr.Events {
				if ev.Type == clientv3.EventTypeDelete {
					return true, nil
				}
			}
		case <-bound:
			return false, nil
		case <-ctx.Done():
			return false, nil
		}
	}
	pause := time.NewTimer(firstBackoff)
	defer pause.Stop()
	select {
	case <-pause.C:
		return true, nil
	case <-bound:
		return false, nil
	case <-ctx.Done():
		return false, nil
	}
}

// park keeps e queued for the next AcquireWait call on its key. It removes
// e if no call takes it over within the park timeout, or at once if e
// reaches the head of the queue before a call takes it over: a parked entry
// at the head would hold the key for nobody. After Close it removes e at
// once.
func (b *Backend) park(e *entry) {
	b.mu.Lock()
	if b.closed {
		b.mu.Unlock()
		b.revokeLater(context.Background(), e.lease)
		return
	}
	defer b.mu.Unlock()
	b.parked[e.key] = append(b.parked[e.key], e)
	e.timer = time.AfterFunc(b.parkFor, func() { b.drop(e) })
	ctx, cancel := context.WithCancel(context.Background())
	e.unwatch = cancel
	w := *e     // wait writes to the entry it is given
	b.bg.Add(1) // before Close can see e gone: Close waits for the watch
	go func() {
		defer b.bg.Done()
		if held, _ := b.wait(ctx, &w, nil); held {
			b.drop(e)
		}
	}()
}

// drop removes e if it is still parked, and revokes its lease.
func (b *Backend) drop(e *entry) {
	b.mu.Lock()
	found := b.removeParkedLocked(e)
	if found {
		e.timer.Stop()
		e.unwatch()
		b.bg.Add(1) // before Close can see it gone: Close waits for it
	}
	b.mu.Unlock()
	if found {
		defer b.bg.Done()
		b.revokeLater(context.Background(), e.lease)
	}
}

// unpark returns the oldest parked entry of key whose lease has secs
// seconds, or nil.
func (b *Backend) unpark(key string, secs int64) *entry {
	b.mu.Lock()
	defer b.mu.Unlock()
	var oldest *entry
	for _, e := range b.parked[key] {
		if e.secs == secs && (oldest == nil || e.rev < oldest.rev) {
			oldest = e
		}
	}
	if oldest != nil {
		b.removeParkedLocked(oldest)
		oldest.timer.Stop()
		oldest.unwatch()
	}
	return oldest
}

// removeParkedLocked removes e from the parked entries and reports whether
// it was there.
func (b *Backend) removeParkedLocked(e *entry) bool {
	es := b.parked[e.key]
	i := slices.Index(es, e)
	if i < 0 {
		return false
	}
	es = slices.Delete(es, i, i+1)
	if len(es) == 0 {
		delete(b.parked, e.key)
	} else {
		b.parked[e.key] = es
	}
	return true
}
