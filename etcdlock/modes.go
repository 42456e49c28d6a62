package etcdlock

import (
	"context"
	"fmt"
	"slices"
	"sort"
	"strings"
	"sync"
	"time"

	"github.com/dlock-dev/dlock"
	"go.etcd.io/etcd/api/v3/mvccpb"
	clientv3 "go.etcd.io/etcd/client/v3"
)

// SupportsMode implements dlock.Sharer: every mode.
func (b *Backend) SupportsMode(m dlock.Mode) bool { return m <= dlock.ModeLimited }

// item is one entry of a lock's directory with its decoded value.
type item struct {
	kv  *mvccpb.KeyValue
	rec record
}

// items decodes kvs and orders them by create revision: queue order.
func items(kvs []*mvccpb.KeyValue) []item {
	q := make([]item, len(kvs))
	for i, kv := range kvs {
		q[i] = item{kv, decode(kv.Value)}
	}
	sort.Slice(q, func(i, j int) bool { return q[i].kv.CreateRevision < q[j].kv.CreateRevision })
	return q
}

// conflicts reports whether holders in modes m (limit n) and m2 (limit n2)
// cannot share a key: a limited holder shares it only with limited holders
// of the same limit.
func conflicts(m dlock.Mode, n int, m2 dlock.Mode, n2 int) bool {
	return (m == dlock.ModeLimited || m2 == dlock.ModeLimited) && (m != m2 || n != n2)
}

// turn is what the entries ahead of an entry (its predecessors, in queue
// order) mean for it.
type turn struct {
	granted  bool
	conflict *item   // a predecessor in a mode or with a limit that excludes the entry's
	watch    []*item // the predecessors that keep it waiting
	need     int     // how many of watch must go before it may hold the lock
}

// judge returns the turn of an entry in mode m (limit n) behind preds. An
// exclusive entry holds the lock when it is first; a shared one when no
// other than shared entries are ahead of it (so a queued exclusive entry
// keeps later shared ones waiting: writers are not starved); a limited one
// when fewer than n entries are ahead of it. Each is granted for good: the
// entries ahead of an entry only ever leave.
func judge(preds []item, m dlock.Mode, n int) turn {
	for i := range preds {
		p := &preds[i]
		if conflicts(m, n, p.rec.mode(), p.rec.Limit) {
			return turn{conflict: p}
		}
	}
	switch m {
	case dlock.ModeShared:
		for i := len(preds) - 1; i >= 0; i-- {
			if preds[i].rec.mode() != dlock.ModeShared {
				// The nearest writer ahead: those before it hold this
				// entry up only through it.
				return turn{watch: []*item{&preds[i]}, need: 1}
			}
		}
		return turn{granted: true}
	case dlock.ModeLimited:
		if len(preds) < n {
			return turn{granted: true}
		}
		t := turn{need: len(preds) - n + 1}
		for i := range preds {
			t.watch = append(t.watch, &preds[i])
		}
		return t
	}
	if len(preds) == 0 {
		return turn{granted: true}
	}
	return turn{watch: []*item{&preds[len(preds)-1]}, need: 1}
}

// Holding reports which of a key's entries hold the lock, given the
// entries' values in create-revision order (the queue): one exclusive
// entry at the head, the shared entries ahead of the first other one, or
// the first limit limited entries; an entry behind one of another mode or
// limit never holds. Tools that read the store's layout use it.
func Holding(values [][]byte) []bool {
	q := make([]item, len(values))
	for i, v := range values {
		q[i].rec = decode(v)
	}
	return holders(q)
}

// holders reports which entries of q hold the lock: in one pass, the same
// verdicts as judge's for each entry behind those ahead of it.
func holders(q []item) []bool {
	out := make([]bool, len(q))
	classes := map[int]int{} // entries seen, by limit (0: exclusive or shared)
	others := 0              // entries seen that are not shared
	for i, it := range q {
		m, n := it.rec.mode(), 0
		if m == dlock.ModeLimited {
			n = it.rec.Limit
		}
		if classes[n] == i { // no conflict ahead
			switch m {
			case dlock.ModeExclusive:
				out[i] = i == 0
			case dlock.ModeShared:
				out[i] = others == 0
			case dlock.ModeLimited:
				out[i] = i < n
			}
		}
		classes[n]++
		if m != dlock.ModeShared {
			others++
		}
	}
	return out
}

// mismatch is the error of a request in mode m (limit n) refused because of
// the entry p of key.
func mismatch(key string, m dlock.Mode, n int, p *item) error {
	return fmt.Errorf("etcdlock: acquire %q: held %s, asked %s: %w",
		key, dlock.DescribeMode(p.rec.mode(), p.rec.Limit), dlock.DescribeMode(m, n), dlock.ErrModeMismatch)
}

// all returns the op reading every entry of key, in queue order.
func (b *Backend) all(key string) clientv3.Op {
	return clientv3.OpGet(b.dir(key), clientv3.WithPrefix(), clientv3.WithSort(clientv3.SortByCreateRevision, clientv3.SortAscend))
}

// queue returns the entries of key in queue order, retrying transient
// failures.
func (b *Backend) queue(ctx context.Context, key string) ([]item, error) {
	q, _, err := b.queueAt(ctx, key)
	return q, err
}

// queueAt is queue, with the revision it was read at.
func (b *Backend) queueAt(ctx context.Context, key string) ([]item, int64, error) {
	var resp *clientv3.TxnResponse
	err := b.retry(ctx, func(ctx context.Context) error {
		var err error
		resp, err = b.c.Txn(ctx).Then(b.all(key)).Commit()
		return err
	})
	if err != nil {
		return nil, 0, err
	}
	return items(resp.Responses[0].GetResponseRange().GetKvs()), resp.Header.Revision, nil
}

// The writer mark of a key: an exclusive acquisition that finds the key held
// shared writes it, and new shared entries are not created while it exists,
// so that a writer that found readers is not overtaken by later readers
// before its own entry is queued. The mark has a lease of its own, of
// markTTL: etcd revokes it up to half a second after that, so that a writer
// that gives up holds readers back for at most dlock.WriterMark. An
// exclusive grant deletes it.
const markTTL = dlock.WriterMark - time.Second

// mark is the name of key's writer mark: outside the key's directory, and
// never the name of an entry or another key's mark, since an escaped key
// contains "%" only as "%25" or "%2F".
func (b *Backend) mark(key string) string { return b.prefix + keyEscaper.Replace(key) + markSuffix }

const markSuffix = "%writer"

// MarkKey returns the dlock key whose writer mark is the etcd key name
// under prefix (the Backend's Options.Prefix), and false for keys that are
// not writer marks. A key is held back from new shared holders while its
// mark exists. Tools that read the store's layout use it.
func MarkKey(prefix, name string) (string, bool) {
	rest, ok := strings.CutPrefix(name, prefix)
	if !ok {
		return "", false
	}
	esc, ok := strings.CutSuffix(rest, markSuffix)
	if !ok || esc == "" || strings.Contains(esc, "/") {
		return "", false
	}
	return keyUnescaper.Replace(esc), true
}

// setMark writes key's writer mark, with a new lease. A mark that cannot be
// written only weakens writer preference for a moment, and etcd would fail
// the caller's next request as well: errors are ignored.
func (b *Backend) setMark(ctx context.Context, key string) {
	id, err := b.grant(ctx, markTTL)
	if err != nil {
		return
	}
	_ = b.retry(ctx, func(ctx context.Context) error {
		_, err := b.c.Put(ctx, b.mark(key), "", clientv3.WithLease(id))
		return err
	})
}

// heldExclusive is the Result of an exclusive acquisition of req.Key that
// found head at the head of the queue: ErrModeMismatch for a limited key;
// for a key held shared it also leaves the writer mark.
func (b *Backend) heldExclusive(ctx context.Context, req dlock.Request, head *mvccpb.KeyValue) (dlock.Result, error) {
	h := item{head, decode(head.Value)}
	if conflicts(req.Mode, req.Limit, h.rec.mode(), h.rec.Limit) {
		return dlock.Result{}, mismatch(req.Key, req.Mode, req.Limit, &h)
	}
	if h.rec.mode() != dlock.ModeShared {
		return b.held(ctx, req.Key, head), nil
	}
	var wg sync.WaitGroup
	wg.Go(func() { b.setMark(ctx, req.Key) })
	res := b.held(ctx, req.Key, head)
	wg.Wait()
	return res, nil
}

// acquireShared is Acquire for ModeShared and ModeLimited. It reads the
// key's entries and writer mark and, if a new entry at the end of the queue
// would hold the lock at once, grants a lease and writes the entry in a
// transaction that also reads the queue again; an entry that does not hold
// the lock there (an entry that conflicts or blocks was created meanwhile)
// is revoked. A shared entry is written only while the key has no writer
// mark (compared in the same transaction). Like an exclusive one, the
// acquisition never queues: it fails while entries that keep it out hold or
// wait.
func (b *Backend) acquireShared(ctx context.Context, req dlock.Request) (dlock.Result, error) {
	fail := func(err error) (dlock.Result, error) {
		return dlock.Result{}, fmt.Errorf("etcdlock: acquire %q: %w", req.Key, err)
	}
	mark := b.mark(req.Key)
	var resp *clientv3.TxnResponse
	err := b.retry(ctx, func(ctx context.Context) error {
		var err error
		resp, err = b.c.Txn(ctx).Then(b.all(req.Key), clientv3.OpGet(mark)).Commit()
		return err
	})
	if err != nil {
		return fail(err)
	}
	q := items(resp.Responses[0].GetResponseRange().GetKvs())
	marks := resp.Responses[1].GetResponseRange().GetKvs()
	if res, err, refused := b.refuse(ctx, req, q, marks); refused {
		return res, err
	}
	id, err := b.grant(ctx, req.TTL)
	if err != nil {
		return fail(fmt.Errorf("grant: %w", err))
	}
	name := b.name(req.Key, id)
	cmps := []clientv3.Cmp{clientv3.Compare(clientv3.CreateRevision(name), "=", 0)}
	if req.Mode == dlock.ModeShared {
		cmps = append(cmps, clientv3.Compare(clientv3.CreateRevision(mark), "=", 0))
	}
	val := encode(req)
	err = b.retry(ctx, func(ctx context.Context) error {
		// Repeating it is safe: if an earlier attempt wrote the entry, this
		// one finds it and reads the queue again.
		var err error
		resp, err = b.c.Txn(ctx).If(cmps...).
			Then(clientv3.OpPut(name, val, clientv3.WithLease(id)), b.all(req.Key)).
			Else(clientv3.OpGet(name), clientv3.OpGet(mark)).
			Commit()
		return err
	})
	if err != nil {
		return fail(err)
	}
	if resp.Succeeded {
		q = items(resp.Responses[1].GetResponseRange().GetKvs())
	} else if len(resp.Responses[0].GetResponseRange().GetKvs()) > 0 {
		if q, err = b.queue(ctx, req.Key); err != nil {
			return fail(err)
		}
	} else { // a writer left its mark since the first read
		var wg sync.WaitGroup
		wg.Go(func() { _, _ = b.revoke(ctx, id) }) // unused: it would expire anyway
		res, err, _ := b.refuse(ctx, req, q, resp.Responses[1].GetResponseRange().GetKvs())
		wg.Wait()
		return res, err
	}
	i := slices.IndexFunc(q, func(it item) bool { return string(it.kv.Key) == name })
	if i < 0 {
		return fail(fmt.Errorf("entry %s vanished after it was written", name))
	}
	t := judge(q[:i], req.Mode, req.Limit)
	if t.granted {
		return dlock.Result{Acquired: true, Fence: uint64(q[i].kv.CreateRevision)}, nil
	}
	// Overtaken since the first read: leave the queue, even if ctx ends
	// (the Locker does not resolve a refusal).
	var wg sync.WaitGroup
	wg.Go(func() { b.revokeLater(ctx, id) })
	var res dlock.Result
	if t.conflict != nil {
		err = mismatch(req.Key, req.Mode, req.Limit, t.conflict)
	} else {
		res = b.held(ctx, req.Key, q[0].kv)
	}
	wg.Wait()
	return res, err
}

// refuse returns the outcome of a shared or limited request that would
// queue at the end of q, given key's writer mark (marks holds it if it
// exists), and true if the request is refused: by an entry in another mode
// or with another limit (ErrModeMismatch), by entries that would keep it
// waiting, or by the mark.
func (b *Backend) refuse(ctx context.Context, req dlock.Request, q []item, marks []*mvccpb.KeyValue) (dlock.Result, error, bool) {
	t := judge(q, req.Mode, req.Limit)
	switch {
	case t.conflict != nil:
		return dlock.Result{}, mismatch(req.Key, req.Mode, req.Limit, t.conflict), true
	case !t.granted:
		return b.held(ctx, req.Key, q[0].kv), nil, true
	case req.Mode == dlock.ModeShared && len(marks) > 0:
		// A writer waits for the readers to leave: the holder that matters
		// is the writer, whom the mark does not name.
		return dlock.Result{Remaining: b.remaining(ctx, clientv3.LeaseID(marks[0].Lease))}, nil, true
	}
	return dlock.Result{}, nil, false
}
