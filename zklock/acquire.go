package zklock

import (
	"context"
	"errors"
	"fmt"
	"slices"
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
		if a.n != nil {
			b.forget(token, a.n)
			b.deleteQuietly(a.n.path)
		}
	}
}

// Acquire implements dlock.Backend without queueing: it creates a queue node
// and keeps it only if it is the lowest. A holder whose lease has run out
// by the leader's clock is deleted first. It costs two round trips when the
// key is free and four when it is held.
func (b *Backend) Acquire(ctx context.Context, req dlock.Request) (dlock.Result, error) {
	if err := b.checkTTL(req.TTL); err != nil {
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
	now := n.mtime // the leader's time of our create
	fail := func(err error) (attempt, error) {
		b.deleteQuietly(n.path)
		return attempt{}, err
	}
	for range maxRounds {
		q, err := b.queue(dir)
		if err != nil {
			return fail(err)
		}
		switch i := slices.Index(q, name(n.path)); {
		case i < 0:
			return attempt{}, errVanished
		case i == 0:
			b.hold(req.Token, n)
			return attempt{res: dlock.Result{Acquired: true, Fence: uint64(fence)}, n: n}, nil
		}
		head := dir + "/" + q[0]
		data, st, err := b.c.Get(head)
		if errors.Is(err, zk.ErrNoNode) {
			continue
		}
		if err != nil {
			return fail(err)
		}
		r := decode(data)
		end := expiry(r, st)
		if end <= now { // abandoned: its lease ended before our create
			if err := b.c.Delete(head, st.Version); err != nil && !notHeld(err) {
				return fail(err)
			}
			continue
		}
		if err := b.c.Delete(n.path, -1); err != nil && !errors.Is(err, zk.ErrNoNode) {
			return attempt{}, err // the Locker's Release finds the node by its token
		}
		remaining := min(time.Duration(end-now)*time.Millisecond, time.Duration(r.TTL)*time.Millisecond)
		h := info(req.Key, r, st)
		h.ExpiresAt = time.Now().Add(remaining)
		return attempt{res: dlock.Result{Holder: h, Remaining: remaining}}, nil
	}
	b.deleteQuietly(n.path)
	return attempt{res: dlock.Result{Holder: dlock.LockInfo{Key: req.Key}}}, nil
}

// AcquireWait implements dlock.Waiter: see "Waiting" in the package doc. It
// returns Acquired=false and a nil error when ctx ends (the node is deleted)
// and after a third of the TTL (the node stays queued for the next call).
func (b *Backend) AcquireWait(ctx context.Context, req dlock.Request) (dlock.Result, error) {
	if err := b.checkTTL(req.TTL); err != nil {
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
	fail := func(err error) (attempt, error) {
		b.deleteQuietly(n.path)
		return attempt{}, err
	}
	dir := b.dir(req.Key)
	holder := dlock.LockInfo{Key: req.Key}
	lease := time.NewTimer(time.Hour)
	defer lease.Stop()
	for {
		if ctx.Err() != nil {
			b.deleteQuietly(n.path)
			return attempt{res: dlock.Result{Holder: holder}}, nil
		}
		q, err := b.queue(dir)
		if err != nil {
			return fail(err)
		}
		i := slices.Index(q, name(n.path))
		switch {
		case i < 0: // deleted by an administrator, or the session expired
			return attempt{res: dlock.Result{Holder: holder}}, nil
		case i == 0:
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
		}
		// Mind the predecessor's lease as well as its deletion: the
		// holder's, or a waiter's that its process no longer renews
		// (paused, partitioned, dead) and that would hold the queue up
		// until its session ended. Either node may go once its lease has
		// run out by the leader's clock.
		pred := dir + "/" + q[i-1]
		data, st, watch, err := b.c.GetW(pred)
		if errors.Is(err, zk.ErrNoNode) {
			continue
		}
		if err != nil {
			return fail(err)
		}
		r := decode(data)
		end := expiry(r, st)
		if i == 1 { // the predecessor holds the lock
			holder = info(req.Key, r, st)
		}
		if end <= leaderNow() {
			// Read the leader's clock by rewriting our own node, which
			// also shows that our session is alive.
			st2, err := b.c.Set(n.path, n.data, n.version)
			if notHeld(err) {
				return attempt{res: dlock.Result{Holder: holder}}, nil
			}
			if err != nil {
				return fail(err)
			}
			n.version, n.mtime = st2.Version, st2.Mtime
			srvNow, at = st2.Mtime, time.Now()
			if end <= srvNow {
				if err := b.c.Delete(pred, st.Version); err != nil && !notHeld(err) {
					return fail(err)
				}
				continue
			}
		}
		remaining := time.Duration(end-leaderNow()) * time.Millisecond
		if i == 1 {
			holder.ExpiresAt = time.Now().Add(remaining)
		}
		lease.Reset(remaining + time.Millisecond)
		select {
		case <-watch:
		case <-lease.C:
		case <-chunk.C:
			b.park(n, fence)
			return attempt{res: dlock.Result{Holder: holder}}, nil
		case <-ctx.Done():
		}
	}
}

// parkedNode is a queued node kept between two AcquireWait calls.
type parkedNode struct {
	n     *node
	fence int64
	timer *time.Timer
}

// park keeps n queued for the next AcquireWait of its key, and deletes it
// if no call takes it up within its TTL.
func (b *Backend) park(n *node, fence int64) {
	p := &parkedNode{n: n, fence: fence}
	b.mu.Lock()
	defer b.mu.Unlock()
	p.timer = time.AfterFunc(n.ttl, func() {
		if b.unpark(p) {
			b.deleteQuietly(n.path)
		}
	})
	b.parked[n.key] = append(b.parked[n.key], p)
}

// unpark removes p from the parked nodes; false if it was not there.
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
	return true
}

// adopt takes the oldest parked node of req.Key for req, rewriting it with
// req's token, TTL and metadata. It returns nil if there is none (or it is
// gone).
func (b *Backend) adopt(req dlock.Request) (*node, int64) {
	b.mu.Lock()
	list := b.parked[req.Key]
	if len(list) == 0 {
		b.mu.Unlock()
		return nil, 0
	}
	p := list[0]
	b.mu.Unlock()
	if !b.unpark(p) {
		return nil, 0
	}
	p.timer.Stop()
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
	return &node{key: req.Key, path: p.n.path, data: data, version: st.Version, mtime: st.Mtime, ttl: req.TTL}, st.Czxid
}
