package etcdlock

import (
	"context"
	"errors"
	"fmt"
	"slices"
	"sync"
	"time"

	"github.com/dlock-dev/dlock"
	"go.etcd.io/etcd/api/v3/mvccpb"
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
// one whose turn comes while parked: the key (or a slot of it) would
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
	mode  dlock.Mode       // of the request that queued it
	limit int              // for ModeLimited
	timer *time.Timer      // removes the entry while parked; guarded by Backend.mu
	// unwatch ends the watch that removes the entry if its turn comes while
	// parked; guarded by Backend.mu.
	unwatch context.CancelFunc
}

// AcquireWait implements dlock.Waiter. It queues an entry for req (or takes
// over the one an earlier call for the same key, mode and limit parked),
// then watches only the entries ahead of it that keep it waiting (see
// judge) until they are deleted, and holds the lock when none is left. A
// shared request does not queue while the key has a writer mark: it waits
// for the mark to go first. It returns Acquired=false with a nil error when
// ctx ends (the entry is then deleted) or after a third of req.TTL (the
// entry stays queued for the next call). An entry that finds one in another
// mode or with another limit ahead of it is deleted, and the call returns
// an error wrapping dlock.ErrModeMismatch.
func (b *Backend) AcquireWait(ctx context.Context, req dlock.Request) (dlock.Result, error) {
	if err := dlock.ValidateMode(req); err != nil {
		return dlock.Result{}, err
	}
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
	e, err := b.queueUp(ictx, req, bound.C)
	if e == nil && err == nil {
		return dlock.Result{}, nil // the bound fired, or ctx ended, at a writer mark
	}
	if err != nil {
		if ctx.Err() != nil || cut() {
			return dlock.Result{}, nil
		}
		return dlock.Result{}, fmt.Errorf("etcdlock: acquire %q: %w", req.Key, err)
	}
	held, marked, err := b.wait(ictx, e, bound.C)
	if errors.Is(err, dlock.ErrModeMismatch) {
		b.revokeLater(ctx, e.lease)
		return dlock.Result{}, err
	}
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
		var wg sync.WaitGroup
		if marked { // an exclusive grant clears the writer mark
			wg.Go(func() {
				_ = b.retry(ctx, func(ctx context.Context) error {
					_, err := b.c.Delete(ctx, b.mark(e.key))
					return err
				})
			})
		}
		sending := time.Now()
		if err := b.keepAlive(ctx, e.lease); err == nil {
			res.SentAfter = sending.Sub(began)
		}
		wg.Wait()
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

// queueUp returns req's entry in the queue (see enter). For a shared
// request that finds a writer mark it first waits until the mark is
// deleted; it returns nil and no error if bound fires or ctx ends first.
func (b *Backend) queueUp(ctx context.Context, req dlock.Request, bound <-chan time.Time) (*entry, error) {
	for range maxChecks {
		e, mark, err := b.enter(ctx, req)
		switch {
		case err != nil:
			return nil, err
		case e != nil:
			return e, nil
		case mark == nil:
			return nil, errors.New("entry vanished while it was being written")
		}
		gone, err := b.waitGone(ctx, b.dir(req.Key), []string{string(mark.Key)}, 1, mark.ModRevision, bound)
		if !gone || err != nil {
			return nil, err
		}
	}
	return nil, nil
}

// enter returns req's entry: a parked one taken over, or a new one at the
// end of the queue; or, for a shared request while the key has a writer
// mark, no entry and the mark. On error it has removed what it created.
func (b *Backend) enter(ctx context.Context, req dlock.Request) (*entry, *mvccpb.KeyValue, error) {
	secs := ttlSeconds(req.TTL)
	if e := b.unpark(req, secs); e != nil {
		ok, err := b.takeOver(ctx, e, req)
		if err != nil {
			b.revokeLater(ctx, e.lease)
			return nil, nil, err
		}
		if ok {
			return e, nil, nil
		}
	}
	id, err := b.grant(ctx, req.TTL)
	if err != nil {
		return nil, nil, fmt.Errorf("grant: %w", err)
	}
	e := &entry{key: req.Key, name: b.name(req.Key, id), lease: id, secs: secs, mode: req.Mode, limit: req.Limit}
	val := encode(req)
	cmps := []clientv3.Cmp{clientv3.Compare(clientv3.CreateRevision(e.name), "=", 0)}
	if req.Mode == dlock.ModeShared {
		cmps = append(cmps, clientv3.Compare(clientv3.CreateRevision(b.mark(req.Key)), "=", 0))
	}
	var mark *mvccpb.KeyValue
	err = b.retry(ctx, func(ctx context.Context) error {
		// Repeating it is safe: if an earlier attempt wrote the entry, this
		// one reads back its create revision.
		resp, err := b.c.Txn(ctx).
			If(cmps...).
			Then(clientv3.OpPut(e.name, val, clientv3.WithLease(id))).
			Else(clientv3.OpGet(e.name), clientv3.OpGet(b.mark(req.Key))).
			Commit()
		if err != nil {
			return err
		}
		if resp.Succeeded {
			e.rev = resp.Header.Revision
		} else if kvs := resp.Responses[0].GetResponseRange().GetKvs(); len(kvs) > 0 {
			e.rev = kvs[0].CreateRevision
		} else if kvs := resp.Responses[1].GetResponseRange().GetKvs(); len(kvs) > 0 {
			mark = kvs[0]
		}
		return nil
	})
	if err != nil || e.rev == 0 {
		b.revokeLater(ctx, id)
		if err != nil || mark == nil {
			return nil, nil, err
		}
		return nil, mark, nil
	}
	return e, nil, nil
}

// takeOver renews a parked entry's lease (so that it lasts the full TTL from
// now, as the Locker assumes) and writes req's token into it. It reports
// false if the entry no longer exists, or if a shared or limited entry
// already holds the lock: it is then revoked. Such an entry may hold it
// since before this call, when entries queued behind it may have got the
// lock too, with larger fences, and returned them; handing its smaller
// fence out now would break their order. (An exclusive entry that holds
// the lock keeps everyone behind it out, so it is taken over.)
func (b *Backend) takeOver(ctx context.Context, e *entry, req dlock.Request) (bool, error) {
	if err := b.keepAlive(ctx, e.lease); err != nil {
		if errors.Is(err, rpctypes.ErrLeaseNotFound) {
			return false, nil
		}
		return false, fmt.Errorf("renew waiting entry: %w", err)
	}
	val := encode(req)
	then := []clientv3.Op{clientv3.OpPut(e.name, val, clientv3.WithLease(e.lease))}
	if e.mode != dlock.ModeExclusive {
		then = append(then, b.ahead(e))
	}
	var ok, held bool
	err := b.retry(ctx, func(ctx context.Context) error {
		resp, err := b.c.Txn(ctx).
			If(clientv3.Compare(clientv3.CreateRevision(e.name), "=", e.rev)).
			Then(then...).
			Commit()
		if err == nil {
			ok = resp.Succeeded
			if ok && len(resp.Responses) > 1 {
				held = judge(items(resp.Responses[1].GetResponseRange().GetKvs()), e.mode, e.limit).granted
			}
		}
		return err
	})
	if err == nil && held {
		b.revokeLater(ctx, e.lease)
		return false, nil
	}
	return ok, err
}

// ahead returns the op reading every entry ahead of e, in queue order.
func (b *Backend) ahead(e *entry) clientv3.Op {
	return clientv3.OpGet(b.dir(e.key), clientv3.WithPrefix(), clientv3.WithMaxCreateRev(e.rev-1),
		clientv3.WithSort(clientv3.SortByCreateRevision, clientv3.SortAscend))
}

// wait waits until e holds the lock (true), bound fires or ctx ends
// (false). If e disappeared, it sets e.rev to 0 and returns false. An
// entry in another mode or with another limit ahead of e is an error
// wrapping dlock.ErrModeMismatch. The second result reports, for an
// exclusive entry that holds the lock, that the key had a writer mark.
func (b *Backend) wait(ctx context.Context, e *entry, bound <-chan time.Time) (bool, bool, error) {
	for range maxChecks {
		t, rev, marked, err := b.check(ctx, e)
		switch {
		case err != nil:
			return false, false, err
		case rev == 0:
			e.rev = 0
			return false, false, nil
		case t.conflict != nil:
			return false, false, mismatch(e.key, e.mode, e.limit, t.conflict)
		case t.granted:
			return true, marked, nil
		}
		names := make([]string, len(t.watch))
		for i, p := range t.watch {
			names[i] = string(p.kv.Key)
		}
		gone, err := b.waitGone(ctx, b.dir(e.key), names, t.need, rev, bound)
		if !gone || err != nil {
			return false, false, err
		}
	}
	return false, false, nil
}

// check reads the entries ahead of e that decide its turn, and returns the
// turn and the revision read, or 0 if e no longer exists. An exclusive
// entry reads only the head and the entry just before it (which it waits
// for: one key, not the whole queue) and whether the key has a writer mark.
func (b *Backend) check(ctx context.Context, e *entry) (t turn, rev int64, marked bool, err error) {
	var ops []clientv3.Op
	if e.mode == dlock.ModeExclusive {
		last := append(clientv3.WithLastCreate(), clientv3.WithMaxCreateRev(e.rev-1))
		ops = []clientv3.Op{b.first(e.key), clientv3.OpGet(b.dir(e.key), last...),
			clientv3.OpGet(b.mark(e.key), clientv3.WithCountOnly())}
	} else {
		ops = []clientv3.Op{b.ahead(e)}
	}
	var resp *clientv3.TxnResponse
	err = b.retry(ctx, func(ctx context.Context) error {
		var err error
		resp, err = b.c.Txn(ctx).
			If(clientv3.Compare(clientv3.CreateRevision(e.name), "=", e.rev)).
			Then(ops...).
			Commit()
		return err
	})
	if err != nil || !resp.Succeeded {
		return turn{}, 0, false, err
	}
	if e.mode != dlock.ModeExclusive {
		preds := items(resp.Responses[0].GetResponseRange().GetKvs())
		return judge(preds, e.mode, e.limit), resp.Header.Revision, false, nil
	}
	var preds []*mvccpb.KeyValue
	if last := resp.Responses[1].GetResponseRange().GetKvs(); len(last) > 0 {
		head := resp.Responses[0].GetResponseRange().GetKvs()[0] // the head is ahead of e, or e
		if head.CreateRevision < last[0].CreateRevision {
			preds = append(preds, head)
		}
		preds = append(preds, last[0])
	}
	marked = resp.Responses[2].GetResponseRange().GetCount() > 0
	return judge(items(preds), e.mode, e.limit), resp.Header.Revision, marked, nil
}

// waitGone waits until need of the entries names of dir, which existed at
// revision rev, are deleted (true), or bound fires, ctx ends or the Backend
// closes (false). It watches the one entry, or the directory for several.
// A watch that fails (the member lost its leader, the revision was
// compacted) also returns true, after a short pause, so that the caller
// looks again.
func (b *Backend) waitGone(ctx context.Context, dir string, names []string, need int, rev int64, bound <-chan time.Time) (bool, error) {
	// Without a leader the member would keep the watch open and silent.
	wctx, cancel := context.WithCancel(clientv3.WithRequireLeader(ctx))
	defer cancel()
	var wch clientv3.WatchChan
	if len(names) == 1 {
		wch = b.c.Watch(wctx, names[0], clientv3.WithRev(rev+1), clientv3.WithFilterPut())
	} else {
		wch = b.c.Watch(wctx, dir, clientv3.WithPrefix(), clientv3.WithRev(rev+1), clientv3.WithFilterPut())
	}
	waiting := make(map[string]bool, len(names))
	for _, n := range names {
		waiting[n] = true
	}
	failed := false
	for !failed { // each round consumes a watch response; bound ends it
		select {
		case wr, ok := <-wch:
			if !ok || wr.Err() != nil || wr.Canceled {
				failed = true
				continue
			}
			for _, ev := range wr.Events {
				if k := string(ev.Kv.Key); ev.Type == clientv3.EventTypeDelete && waiting[k] {
					delete(waiting, k)
					if need--; need <= 0 {
						return true, nil
					}
				}
			}
		case <-bound:
			return false, nil
		case <-ctx.Done():
			return false, nil
		case <-b.done: // Close: the wait ends as its bound would end it
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
	case <-b.done:
		return false, nil
	}
}

// park keeps e queued for the next AcquireWait call on its key. It removes
// e if no call takes it over within the park timeout, or at once if its
// turn comes before a call takes it over: a parked entry that holds the
// lock holds it for nobody. After Close it removes e at once.
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
		if held, _, _ := b.wait(ctx, &w, nil); held {
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

// unpark returns the oldest parked entry of req's key and mode (and limit)
// whose lease has secs seconds, or nil.
func (b *Backend) unpark(req dlock.Request, secs int64) *entry {
	b.mu.Lock()
	defer b.mu.Unlock()
	var oldest *entry
	for _, e := range b.parked[req.Key] {
		if e.secs == secs && e.mode == req.Mode && e.limit == req.Limit && (oldest == nil || e.rev < oldest.rev) {
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
