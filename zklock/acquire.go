package zklock

import (
	"context"
	"errors"
	"fmt"
	"slices"
	"strings"
	"time"

	"github.com/dlock-dev/dlock"
	"github.com/go-zookeeper/zk"
)

// maxRounds bounds the loops that delete expired holders and look again.
const maxRounds = 8

// errVanished means a node the Backend had just written is gone: its
// session expired, or an administrator deleted it.
var errVanished = errors.New("zklock: queue node vanished (session expired or node deleted)")

// attempt is the result of one acquisition op: the node it holds, if any.
type attempt struct {
	res dlock.Result
	n   *node
}

// undoAttempt deletes the node of an acquisition whose caller gave up.
func (b *Backend) undoAttempt(token dlock.Token) func(attempt, error) {
	return func(a attempt, _ error) {
		if a.n != nil { // granted
			b.forget(token, a.n)
			_ = b.deleteHolder(b.dir(a.n.key), name(a.n.path), -1, kindReleased, a.n.fence, decode(a.n.data))
		}
	}
}

// Acquire implements dlock.Backend without queueing: it creates a queue node
// and keeps it only if the rules grant it (see "Modes"). Nodes whose lease
// has run out by the leader's clock are deleted on the way. It costs two
// round trips when the key is free (or held in a mode that admits the
// request) and four when it is held.
func (b *Backend) Acquire(ctx context.Context, req dlock.Request) (dlock.Result, error) {
	if err := b.checkRequest(req); err != nil {
		return dlock.Result{}, err
	}
	a, err := run(ctx, func() (attempt, error) { return b.tryAcquire(req) }, b.undoAttempt(req.Token))
	if err != nil {
		return dlock.Result{}, fmt.Errorf("zklock: acquire %q: %w", req.Key, err)
	}
	return a.res, nil
}

func (b *Backend) tryAcquire(req dlock.Request) (attempt, error) {
	n, fence, err := b.enqueue(req)
	if err != nil {
		return attempt{}, err
	}
	dir := b.dir(req.Key)
	for range maxRounds {
		v, vd, err := b.judgeNode(dir, n, n.mtime, false) // the leader's time of our create
		switch {
		case err != nil:
			return b.fail(n, err)
		case v == nil:
			return attempt{}, errVanished
		case vd.granted:
			b.hold(req.Token, n)
			return attempt{res: dlock.Result{Acquired: true, Fence: uint64(fence)}, n: n}, nil
		case len(vd.block) == 0: // only writer marks ahead: the grant deletes them
			if err := v.deleteMarks(vd.marks); err != nil {
				return b.fail(n, err)
			}
			continue
		}
		h := v.soonest(vd.block)
		s := v.seen[h]
		remaining := min(time.Duration(s.end-n.mtime)*time.Millisecond, time.Duration(s.r.TTL)*time.Millisecond)
		holder := v.holderInfo(req.Key, h)
		holder.ExpiresAt = time.Now().Add(remaining)
		res := dlock.Result{Holder: holder, Remaining: remaining}
		if req.Mode == dlock.ModeExclusive && v.q[h].mode == dlock.ModeShared && !b.remark(req) {
			return attempt{res: res}, b.mark(n, req, fence)
		}
		if err := b.c.Delete(n.path, -1); err != nil && !errors.Is(err, zk.ErrNoNode) {
			return attempt{}, err // the Locker's Release finds the node by its token
		}
		return attempt{res: res}, nil
	}
	b.deleteQuietly(n.path)
	return attempt{res: dlock.Result{Holder: dlock.LockInfo{Key: req.Key}}}, nil
}

// fail ends an acquisition whose node n is still queued with err, deleting
// the node (a mismatch has withdrawn it already).
func (b *Backend) fail(n *node, err error) (attempt, error) {
	if !errors.Is(err, dlock.ErrModeMismatch) {
		b.deleteQuietly(n.path)
	}
	return attempt{}, err
}

// judgeNode reads the queue of dir and judges n in it (see view.judge):
// forward for an attempt, and with watches for a waiter. Nodes dead by now
// (the leader's time) are deleted. A mismatch is an error, and n is then
// deleted; the view is nil if n is gone.
func (b *Backend) judgeNode(dir string, n *node, now int64, waiter bool) (*view, verdict, error) {
	q, err := b.queue(dir)
	if err != nil {
		return nil, verdict{}, err
	}
	i := indexOf(q, name(n.path))
	if i < 0 {
		return nil, verdict{}, nil
	}
	v := b.newView(dir, q, now)
	v.watch, v.prune = waiter, true
	vd, err := v.judge(i, !waiter)
	if err == nil && vd.mismatch >= 0 {
		err = b.withdraw(n, mismatchError(q[i], q[vd.mismatch]))
	}
	return v, vd, err
}

// withdraw deletes n, which the rules refuse with err, and returns err; or
// the delete's error, if the node may have stayed (the Locker's Release
// finds it by its token).
func (b *Backend) withdraw(n *node, err error) error {
	if derr := b.c.Delete(n.path, -1); derr != nil && !errors.Is(derr, zk.ErrNoNode) {
		return derr
	}
	return err
}

// mark leaves n, the node of an exclusive attempt that found shared
// holders, as a writer mark: a node with a lease of dlock.WriterMark that
// keeps new shared requests out, that exclusive requests pass (and delete
// when granted), and that the next AcquireWait of the key for an exclusive
// request takes up (it is parked here for that long).
func (b *Backend) mark(n *node, req dlock.Request, fence int64) error {
	data := encodeMark(req)
	st, err := b.c.Set(n.path, data, n.version)
	switch {
	case notHeld(err): // deleted as abandoned meanwhile: nothing is left
		return nil
	case err != nil:
		return err // the Locker's Release finds the node by its token
	case late(st.Mtime, n.mtime, n.ttl):
		_ = b.c.Delete(n.path, st.Version)
		return nil
	}
	n.data, n.version, n.mtime, n.ttl = data, st.Version, st.Mtime, dlock.WriterMark
	b.parkMark(n, fence)
	return nil
}

// remark renews for req a writer mark of req.Key that this Backend left
// and parked (so that repeated attempts keep one mark each, not one per
// attempt); false if there is none.
func (b *Backend) remark(req dlock.Request) bool {
	b.mu.Lock()
	var p *parkedNode
	for _, x := range b.parked[req.Key] {
		if decode(x.n.data).Mark {
			p = x
		}
	}
	b.mu.Unlock()
	if p == nil || !b.unpark(p) {
		return false
	}
	data := encodeMark(req)
	st, err := b.c.Set(p.n.path, data, p.n.version)
	switch {
	case err != nil:
		if !notHeld(err) {
			b.deleteQuietly(p.n.path)
		}
		return false
	case late(st.Mtime, p.n.mtime, p.n.ttl):
		_ = b.c.Delete(p.n.path, st.Version)
		return false
	}
	p.n.data, p.n.version, p.n.mtime = data, st.Version, st.Mtime
	b.parkMark(p.n, p.fence)
	return true
}

// AcquireWait implements dlock.Waiter: see "Waiting" in the package doc. It
// returns Acquired=false and a nil error when ctx ends (the node is deleted)
// and after a third of the TTL (the node is parked for the next call).
func (b *Backend) AcquireWait(ctx context.Context, req dlock.Request) (dlock.Result, error) {
	if err := b.checkRequest(req); err != nil {
		return dlock.Result{}, err
	}
	began := time.Now()
	a, err := run(ctx, func() (attempt, error) { return b.wait(ctx, req, began) }, b.undoAttempt(req.Token))
	if err != nil {
		if ctx.Err() != nil {
			return dlock.Result{Holder: dlock.LockInfo{Key: req.Key}}, nil
		}
		return dlock.Result{}, fmt.Errorf("zklock: acquire %q: %w", req.Key, err)
	}
	return a.res, nil
}

func (b *Backend) wait(ctx context.Context, req dlock.Request, began time.Time) (attempt, error) {
	chunk := time.NewTimer(req.TTL / 3)
	defer chunk.Stop()
	n, fence := b.adopt(req)
	if n == nil {
		var err error
		if n, fence, err = b.enqueue(req); err != nil {
			return attempt{}, err
		}
	}
	// The leader's clock, read at the local instant at.
	srvNow, at := n.mtime, time.Now()
	leaderNow := func() int64 { return srvNow + time.Since(at).Milliseconds() }
	dir := b.dir(req.Key)
	holder := dlock.LockInfo{Key: req.Key}
	lease := time.NewTimer(time.Hour)
	defer lease.Stop()
	for {
		if ctx.Err() != nil {
			b.deleteQuietly(n.path)
			return attempt{res: dlock.Result{Holder: holder}}, nil
		}
		// Judge from the nearest node back, watching what blocks: the
		// holder, or a node that waits ahead. Mind its lease as well as its
		// deletion: a waiter's node that its process no longer renews
		// (paused, partitioned, dead) would hold the queue up until its
		// session ended. Nodes whose lease has run out by the leader's
		// clock are deleted.
		v, vd, err := b.judgeNode(dir, n, srvNow, true)
		switch {
		case err != nil:
			return b.fail(n, err)
		case v == nil: // deleted by an administrator, or the session expired
			return attempt{res: dlock.Result{Holder: holder}}, nil
		case vd.granted:
			b.hold(req.Token, n)
			// Renew the lease at the grant, so that the Locker can time a
			// whole lease from here instead of from the wait's start. If the
			// renewal fails the grant stands, timed from the start (always
			// safe).
			res := dlock.Result{Acquired: true, Fence: uint64(fence)}
			sending := time.Now()
			switch err := b.extend(dlock.Lease{Key: req.Key, Token: req.Token, TTL: req.TTL}); {
			case err == nil:
				res.SentAfter = sending.Sub(began)
			case errors.Is(err, dlock.ErrNotHeld):
				// The node is gone, or its lease had run out before the
				// renewal (which then deleted it): nothing is held.
				return attempt{res: dlock.Result{Holder: holder}}, nil
			}
			return attempt{res: res, n: n}, nil
		case len(vd.block) == 0: // only writer marks ahead: the grant deletes them
			if err := v.deleteMarks(vd.marks); err != nil {
				return b.fail(n, err)
			}
			continue
		}
		h := v.soonest(vd.block)
		end := v.seen[h].end
		holder = v.holderInfo(req.Key, h)
		if end <= leaderNow() {
			// Read the leader's clock by rewriting our own node, which
			// also shows that our session is alive; then judge again.
			st, err := b.c.Set(n.path, n.data, n.version)
			if notHeld(err) {
				return attempt{res: dlock.Result{Holder: holder}}, nil
			}
			if err != nil {
				return b.fail(n, err)
			}
			n.version, n.mtime = st.Version, st.Mtime
			srvNow, at = st.Mtime, time.Now()
			if end <= srvNow {
				continue
			}
		}
		remaining := time.Duration(end-leaderNow()) * time.Millisecond
		holder.ExpiresAt = time.Now().Add(remaining)
		lease.Reset(remaining + time.Millisecond)
		woke, stop := v.wake(vd.block)
		select {
		case <-woke:
		case <-lease.C:
		case <-chunk.C:
			stop()
			b.parkWaiter(n, fence, srvNow, at)
			return attempt{res: dlock.Result{Holder: holder}}, nil
		case <-ctx.Done():
		}
		stop()
	}
}

// parkTimeout is how long a waiting node is parked for the next
// AcquireWait of its key. The Locker calls again at once, so a waiter that
// is still there comes back well within it; one whose caller left in
// between (its context ended) must not keep its place, ahead of later
// waiters, any longer.
const parkTimeout = time.Second

// parkedNode is a queued node kept between two AcquireWait calls.
type parkedNode struct {
	n       *node
	fence   int64
	timer   *time.Timer        // deletes the node unless a call takes it up
	unwatch context.CancelFunc // ends the watch of a waiting node, or nil
}

// parkMark keeps the writer mark n for the next AcquireWait of its key
// (or the next exclusive attempt that renews it), and deletes it when its
// lease ends if neither takes it up. A mark never holds the key, so it
// needs no watch.
func (b *Backend) parkMark(n *node, fence int64) {
	b.park(&parkedNode{n: n, fence: fence}, n.ttl)
}

// parkWaiter keeps the waiting node n queued for the next AcquireWait of
// its key. It deletes n if no call takes it up within the park timeout,
// or at once if n's turn comes first (see watchParked). The leader's clock
// read srvNow at the local instant at.
func (b *Backend) parkWaiter(n *node, fence int64, srvNow int64, at time.Time) {
	ctx, cancel := context.WithCancel(context.Background())
	p := &parkedNode{n: n, fence: fence, unwatch: cancel}
	b.mu.Lock()
	d := min(b.parkFor, n.ttl)
	b.mu.Unlock()
	b.park(p, d)
	go b.watchParked(ctx, p, srvNow, at)
}

// park records p and deletes its node after d unless a call takes it up.
func (b *Backend) park(p *parkedNode, d time.Duration) {
	b.mu.Lock()
	defer b.mu.Unlock()
	p.timer = time.AfterFunc(d, func() { b.drop(p) })
	b.parked[p.n.key] = append(b.parked[p.n.key], p)
}

// watchParked deletes the node of p as soon as its turn comes while it is
// parked: it would hold the key (or a slot of it) for nobody, and a
// shared or limited one taken up afterwards would be granted under a
// fence smaller than those of nodes granted behind it meanwhile. So does
// a node of another class at the head, which the next call would withdraw,
// and which keeps the nodes of that class behind it waiting. It watches
// what blocks the node, as its waiter did, until ctx ends (the node is
// taken up or deleted); on an error it leaves the node to its park timer.
func (b *Backend) watchParked(ctx context.Context, p *parkedNode, srvNow int64, at time.Time) {
	dir := b.dir(p.n.key)
	lease := time.NewTimer(time.Hour)
	defer lease.Stop()
	for ctx.Err() == nil {
		q, err := b.queue(dir)
		if err != nil {
			return
		}
		i := indexOf(q, name(p.n.path))
		if i < 0 { // gone: the next call queues anew
			return
		}
		now := srvNow + time.Since(at).Milliseconds()
		v := b.newView(dir, q, now)
		v.watch = true
		vd, err := v.judge(i, false)
		if err != nil {
			return
		}
		if vd.granted || vd.mismatch >= 0 || len(vd.block) == 0 {
			b.drop(p)
			return
		}
		lease.Reset(time.Duration(v.seen[v.soonest(vd.block)].end-now)*time.Millisecond + time.Millisecond)
		woke, stop := v.wake(vd.block)
		select {
		case <-woke:
		case <-lease.C:
		case <-ctx.Done():
		}
		stop()
	}
}

// drop deletes the node of p if it is still parked.
func (b *Backend) drop(p *parkedNode) {
	if b.unpark(p) {
		b.deleteQuietly(p.n.path)
	}
}

// unpark removes p from the parked nodes and stops its timer and watch;
// false if it was not there. Whoever unparks p owns its node.
func (b *Backend) unpark(p *parkedNode) bool {
	b.mu.Lock()
	defer b.mu.Unlock()
	list := b.parked[p.n.key]
	i := slices.Index(list, p)
	if i < 0 {
		return false
	}
	list = slices.Delete(list, i, i+1)
	if len(list) == 0 {
		delete(b.parked, p.n.key)
	} else {
		b.parked[p.n.key] = list
	}
	p.timer.Stop()
	if p.unwatch != nil {
		p.unwatch()
	}
	return true
}

// adopt takes the oldest parked node of req.Key in req's mode (and limit)
// for req, rewriting it with req's token, TTL and metadata. It returns nil
// if there is none (or it is gone).
func (b *Backend) adopt(req dlock.Request) (*node, int64) {
	prefix := prefixOf(req.Mode, req.Limit)
	b.mu.Lock()
	i := slices.IndexFunc(b.parked[req.Key], func(p *parkedNode) bool { return strings.HasPrefix(name(p.n.path), prefix) })
	if i < 0 {
		b.mu.Unlock()
		return nil, 0
	}
	p := b.parked[req.Key][i]
	b.mu.Unlock()
	if !b.unpark(p) {
		return nil, 0
	}
	data := encode(req)
	st, err := b.c.Set(p.n.path, data, p.n.version)
	if err != nil {
		if !notHeld(err) {
			b.deleteQuietly(p.n.path)
		}
		return nil, 0
	}
	if late(st.Mtime, p.n.mtime, p.n.ttl) {
		// The node's lease had run out before this write. If it reached
		// the head meanwhile it held the key until then, unknown to anyone:
		// it must not hold it again under the same fence. Queue anew.
		_ = b.c.Delete(p.n.path, st.Version)
		return nil, 0
	}
	if req.Mode != dlock.ModeExclusive && b.turnCame(req.Key, p.n.path, st.Mtime) {
		// Its watch had no time to delete it: nodes behind it may have been
		// granted meanwhile, with larger fences. Queue anew.
		_ = b.c.Delete(p.n.path, st.Version)
		return nil, 0
	}
	return &node{key: req.Key, path: p.n.path, data: data, version: st.Version, mtime: st.Mtime, ttl: req.TTL, fence: st.Czxid}, st.Czxid
}

// turnCame reports whether the node at path of key holds the key by the
// rules at the leader's time now, or cannot tell (an error).
func (b *Backend) turnCame(key, path string, now int64) bool {
	dir := b.dir(key)
	q, err := b.queue(dir)
	if err != nil {
		return true
	}
	i := indexOf(q, name(path))
	if i < 0 {
		return true
	}
	vd, err := b.newView(dir, q, now).judge(i, true)
	return err != nil || vd.granted
}
