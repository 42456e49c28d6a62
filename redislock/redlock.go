package redislock

import (
	"context"
	"errors"
	"fmt"
	"slices"
	"sort"
	"sync"
	"time"

	"github.com/dlock-dev/dlock"
	"github.com/redis/go-redis/v9"
)

// DefaultDriftFactor is the share of the lease Redlock sets aside for clock
// drift between the servers and the client when RedlockOptions.DriftFactor is
// zero (the value of the Redlock description).
const DefaultDriftFactor = 0.01

// ErrNoQuorum means a Redlock operation could not get a majority of the
// servers to agree in time: too many were unreachable or answered too late.
// The outcome is unknown, as for any store error; it is never reported as
// dlock.ErrNotAcquired.
var ErrNoQuorum = errors.New("redislock: no quorum of Redlock servers")

// RedlockOptions configure a Redlock. The zero value (or nil) means all
// defaults.
type RedlockOptions struct {
	// Prefix is as Options.Prefix. The default is DefaultPrefix.
	Prefix string

	// DriftFactor is the share of the lease subtracted, with a fixed 2 ms,
	// from the time left after an acquisition or renewal: the allowance for
	// the servers' clocks running faster than the client's. A lease is valid
	// only if TTL − elapsed − (TTL × DriftFactor + 2 ms) > 0. It must be in
	// [0, 0.5). The default is DefaultDriftFactor.
	DriftFactor float64

	// NodeTimeout bounds each server's reply to one operation, so that an
	// unreachable server does not hold up the others (List is bounded by its
	// context only). Every operation waits for the slowest server up to this
	// bound, and go-redis's default retries take over a second to report a
	// refused connection, so a down server costs each operation the full
	// NodeTimeout. The default is a tenth of the lease, at most 1 s, and 1 s
	// for releases.
	NodeTimeout time.Duration
}

// Redlock is a dlock.Backend that runs the Redlock algorithm over N
// independent Redis servers (not replicas of each other, not one cluster): a
// lock is held when a majority granted it within its lease, less the time
// taken and a clock-drift allowance. A failed acquisition is undone on every
// server. It tolerates the failure of a minority of servers; when a majority
// cannot be reached, operations fail with an error matching ErrNoQuorum. It
// is safe for concurrent use.
//
// Fencing tokens are the largest of the per-server counters over the granting
// majority. When those counters differ (after contention or a server's
// outage), the lagging ones are raised to it, one more round trip, before the
// lock is reported held, so that any later majority, which shares a server
// with this one, counts past it. Tokens therefore increase only as long as no
// server loses its data: a server restarted without persistence (or failed
// over to a replica that missed writes) forgets both locks and counters, and
// then mutual exclusion and fencing can both fail. Restart a server only
// after the longest lease has passed, or run it with appendfsync always. Nor
// is the algorithm immune to process pauses and clock jumps: see Martin
// Kleppmann, "How to do distributed locking" (2016), and Salvatore
// Sanfilippo's reply, "Is Redlock safe?". The token is as good as the
// majority's counters, not a linearizable sequence from a consensus system;
// when correctness depends on the lock, have the guarded resource check the
// token, or use a consensus store (etcd, ZooKeeper).
//
// A Redlock has no MinReplicas: its servers are meant to have no replicas,
// and its safety rests on the majority, not on any one server's copies. A
// server that does have a replica and fails over to it counts, like a
// restart without persistence, as a server that lost its data.
//
// Release and ForceRelease publish on every server; AcquireWait subscribes
// on every reachable server and wakes on the first message.
//
// A Redlock changes no metadata (it is no dlock.MetadataSetter): a
// metadata change would be written server by server, and one that reached
// only some of them would leave the servers disagreeing on the value, with
// no majority to read a single answer from. It watches keys (Watch) but
// does not deliver every change of their holders (it is no
// dlock.HolderWatcher): each server numbers its own changes, and nothing
// orders those of different servers. Messages from several servers arrive
// in no order that tells when a grant reached a majority, so a term that
// was granted and released on every server could be applied server by
// server and never show a majority.
//
// A Redlock grants only exclusive acquisitions (it is no dlock.Sharer, so
// the Locker refuses the other modes before any I/O): a semaphore over
// majorities does not bound its holders, since three holders of a limit of
// two can each hold a different two of three servers without any server
// counting more than two.
type Redlock struct {
	nodes   []*Backend
	names   []string
	quorum  int
	drift   float64
	timeout time.Duration
}

var (
	_ dlock.Backend       = (*Redlock)(nil)
	_ dlock.Lister        = (*Redlock)(nil)
	_ dlock.ForceReleaser = (*Redlock)(nil)
	_ dlock.Waiter        = (*Redlock)(nil)
)

// NewRedlock returns a Redlock over clients, one per independent server; use
// an odd number, at least three (five tolerates two failures). The caller
// owns the clients. It does no I/O. The error matches dlock.ErrInvalidOption
// for no or nil clients and out-of-range options.
func NewRedlock(clients []Client, opts *RedlockOptions) (*Redlock, error) {
	if opts == nil {
		opts = &RedlockOptions{}
	}
	if len(clients) == 0 {
		return nil, fmt.Errorf("%w: redislock: Redlock needs at least one client", dlock.ErrInvalidOption)
	}
	if opts.DriftFactor < 0 || opts.DriftFactor >= 0.5 {
		return nil, fmt.Errorf("%w: redislock: drift factor %v is outside [0, 0.5)", dlock.ErrInvalidOption, opts.DriftFactor)
	}
	if opts.NodeTimeout < 0 {
		return nil, fmt.Errorf("%w: redislock: negative node timeout %s", dlock.ErrInvalidOption, opts.NodeTimeout)
	}
	r := &Redlock{quorum: len(clients)/2 + 1, drift: opts.DriftFactor, timeout: opts.NodeTimeout}
	if r.drift == 0 {
		r.drift = DefaultDriftFactor
	}
	for i, c := range clients {
		// Counters are not floored at each server's clock: the servers'
		// clocks differ, so the floor would make the granting servers'
		// counters differ on every acquisition and cost a second round trip.
		b, err := newBackend(c, &Options{Prefix: opts.Prefix})
		if err != nil {
			return nil, err
		}
		r.nodes = append(r.nodes, b)
		name := fmt.Sprintf("server %d", i)
		if s, ok := c.(fmt.Stringer); ok {
			name = s.String()
		}
		r.names = append(r.names, name)
	}
	return r, nil
}

func (r *Redlock) driftFor(ttl time.Duration) time.Duration {
	return time.Duration(float64(ttl)*r.drift) + 2*time.Millisecond
}

// timeoutFor returns the per-server bound of an operation on leases of ttl
// (0 if unknown).
func (r *Redlock) timeoutFor(ttl time.Duration) time.Duration {
	switch {
	case r.timeout > 0:
		return r.timeout
	case ttl <= 0:
		return time.Second
	}
	return min(ttl/10, time.Second)
}

// each runs fn on every server at once, each call bounded by timeout (none
// if 0), and waits for them all.
func (r *Redlock) each(ctx context.Context, timeout time.Duration, fn func(ctx context.Context, i int, b *Backend)) {
	if timeout > 0 {
		var cancel context.CancelFunc
		ctx, cancel = context.WithTimeout(ctx, timeout)
		defer cancel()
	}
	var wg sync.WaitGroup
	for i, b := range r.nodes {
		wg.Go(func() { fn(ctx, i, b) })
	}
	wg.Wait()
}

// nodeErr names the server in err.
func (r *Redlock) nodeErr(i int, err error) error { return fmt.Errorf("%s: %w", r.names[i], err) }

// noQuorum builds the error for an operation a majority did not agree on.
func (r *Redlock) noQuorum(what string, errs []error) error {
	return fmt.Errorf("redislock: redlock: %s (quorum %d of %d): %w", what, r.quorum, len(r.nodes),
		dlock.Join(append([]error{ErrNoQuorum}, errs...)...))
}

// Acquire implements dlock.Backend: it tries every server at once and holds
// the lock if a majority granted it in time. Otherwise it releases what it
// took and reports Acquired=false when others hold the key on enough servers
// to deny a majority, and an error matching ErrNoQuorum when failed or slow
// servers left the outcome undecided.
func (r *Redlock) Acquire(ctx context.Context, req dlock.Request) (dlock.Result, error) {
	start := time.Now()
	n := len(r.nodes)
	res := make([]dlock.Result, n)
	errs := make([]error, n)
	r.each(ctx, r.timeoutFor(req.TTL), func(ctx context.Context, i int, b *Backend) {
		res[i], errs[i] = b.Acquire(ctx, req)
	})
	var fence uint64
	for i := range n {
		if errs[i] == nil && res[i].Acquired {
			fence = max(fence, res[i].Fence)
		}
	}
	won := r.count(res, errs)
	if won >= r.quorum {
		r.raiseFences(ctx, req, fence, res, errs)
		won = r.count(res, errs)
	}
	elapsed, drift := time.Since(start), r.driftFor(req.TTL)
	if won >= r.quorum && elapsed+drift < req.TTL {
		return dlock.Result{Acquired: true, Fence: fence}, nil
	}

	r.releaseAll(context.WithoutCancel(ctx), req.Key, &req.Token)
	held := 0
	var failures []error
	for i := range n {
		switch {
		case errs[i] != nil:
			failures = append(failures, r.nodeErr(i, errs[i]))
		case !res[i].Acquired:
			held++
		}
	}
	if won >= r.quorum {
		return dlock.Result{}, r.noQuorum(fmt.Sprintf("acquire %q: a majority granted it, but after %s of its %s lease (drift allowance %s)",
			req.Key, elapsed.Round(time.Millisecond), req.TTL, drift), failures)
	}
	if held > n-r.quorum {
		return heldResult(req.Key, res, errs), nil
	}
	return dlock.Result{}, r.noQuorum(fmt.Sprintf("acquire %q: %d servers granted it, %d are held by others, %d failed",
		req.Key, won, held, len(failures)), failures)
}

// count returns how many servers granted the lock.
func (r *Redlock) count(res []dlock.Result, errs []error) int {
	won := 0
	for i := range res {
		if errs[i] == nil && res[i].Acquired {
			won++
		}
	}
	return won
}

// raiseFences brings the granting servers' counters up to fence. A server
// where that fails no longer counts as granting.
func (r *Redlock) raiseFences(ctx context.Context, req dlock.Request, fence uint64, res []dlock.Result, errs []error) {
	r.each(ctx, r.timeoutFor(req.TTL), func(ctx context.Context, i int, b *Backend) {
		if errs[i] != nil || !res[i].Acquired || res[i].Fence == fence {
			return
		}
		ok, err := raiseFenceScript.Run(ctx, b.c, []string{b.lockKey(req.Key), b.fenceKey(req.Key)},
			req.Token.String(), fence).Int64()
		if err == nil && ok == 0 {
			err = errors.New("the lease expired before its fencing counter was raised")
		}
		if err != nil {
			errs[i] = fmt.Errorf("redislock: raise the fencing counter of %q: %w", req.Key, err)
		}
	})
}

// heldResult describes the holder found on the most servers, with the
// shortest remaining lease among them.
func heldResult(key string, res []dlock.Result, errs []error) dlock.Result {
	votes := map[dlock.Token]int{}
	best := -1
	for i := range res {
		if errs[i] != nil || res[i].Acquired {
			continue
		}
		tok := res[i].Holder.Token
		votes[tok]++
		if best < 0 || votes[tok] > votes[res[best].Holder.Token] {
			best = i
		}
	}
	out := dlock.Result{Holder: dlock.LockInfo{Key: key}}
	if best < 0 {
		return out
	}
	out.Holder = res[best].Holder
	for i := range res {
		if errs[i] == nil && !res[i].Acquired && res[i].Holder.Token == out.Holder.Token && res[i].Remaining > 0 &&
			(out.Remaining == 0 || res[i].Remaining < out.Remaining) {
			out.Remaining = res[i].Remaining
			out.Holder.ExpiresAt = res[i].Holder.ExpiresAt
		}
	}
	return out
}

// releaseAll runs release (or forced release, if token is nil) on every
// server and counts the servers that freed the key and those that failed.
func (r *Redlock) releaseAll(ctx context.Context, key string, token *dlock.Token) (freed int, failures []error) {
	errs := make([]error, len(r.nodes))
	r.each(ctx, r.timeoutFor(0), func(ctx context.Context, i int, b *Backend) {
		if token != nil {
			errs[i] = b.Release(ctx, key, *token)
		} else {
			errs[i] = b.ForceRelease(ctx, key)
		}
	})
	for i, err := range errs {
		switch {
		case err == nil:
			freed++
		case !errors.Is(err, dlock.ErrNotHeld):
			failures = append(failures, r.nodeErr(i, err))
		}
	}
	return freed, failures
}

// Release implements dlock.Backend. The key is freed when no majority can
// still hold it: it returns an error matching ErrNoQuorum if a majority of
// servers failed, dlock.ErrNotHeld if no server held it for token, and nil
// otherwise (servers that could not be reached let the lease expire).
func (r *Redlock) Release(ctx context.Context, key string, token dlock.Token) error {
	return r.free(ctx, "release", key, &token)
}

// ForceRelease implements dlock.ForceReleaser on every server, with the same
// results as Release.
func (r *Redlock) ForceRelease(ctx context.Context, key string) error {
	return r.free(ctx, "force release", key, nil)
}

func (r *Redlock) free(ctx context.Context, op, key string, token *dlock.Token) error {
	freed, failures := r.releaseAll(ctx, key, token)
	switch {
	case len(failures) >= r.quorum:
		return r.noQuorum(fmt.Sprintf("%s %q: %d servers failed", op, key, len(failures)), failures)
	case freed == 0:
		return dlock.ErrNotHeld
	}
	return nil
}

// Extend implements dlock.Backend: each server renews the whole batch in one
// pipeline, all servers at once. A lease is renewed if a majority renewed it
// within its lease less the drift allowance, and reported dlock.ErrNotHeld
// when too many servers no longer hold it for a majority to remain.
func (r *Redlock) Extend(ctx context.Context, leases []dlock.Lease) ([]error, error) {
	if len(leases) == 0 {
		return nil, nil
	}
	start := time.Now()
	minTTL := leases[0].TTL
	for _, l := range leases {
		minTTL = min(minTTL, l.TTL)
	}
	n := len(r.nodes)
	per := make([][]error, n)
	callErrs := make([]error, n)
	r.each(ctx, r.timeoutFor(minTTL), func(ctx context.Context, i int, b *Backend) {
		per[i], callErrs[i] = b.Extend(ctx, leases)
	})
	elapsed := time.Since(start)

	var down []error
	for i, err := range callErrs {
		if err != nil {
			down = append(down, r.nodeErr(i, err))
		}
	}
	if len(down) == n {
		return nil, r.noQuorum("extend: every server failed", down)
	}
	out := make([]error, len(leases))
	for j, l := range leases {
		ok, notHeld := 0, 0
		failures := slices.Clip(down) // appends must not share down's array
		for i := range n {
			switch {
			case callErrs[i] != nil:
			case per[i][j] == nil:
				ok++
			case errors.Is(per[i][j], dlock.ErrNotHeld):
				notHeld++
			default:
				failures = append(failures, r.nodeErr(i, per[i][j]))
			}
		}
		switch {
		case ok >= r.quorum && elapsed+r.driftFor(l.TTL) < l.TTL:
		case notHeld > n-r.quorum:
			out[j] = dlock.ErrNotHeld
		default:
			out[j] = r.noQuorum(fmt.Sprintf("extend %q: %d servers renewed it in %s, %d no longer hold it",
				l.Key, ok, elapsed.Round(time.Millisecond), notHeld), failures)
		}
	}
	return out, nil
}

// List implements dlock.Lister: the locks that a majority of servers list
// for the same token. It SCANs every server (see Backend.List), and fails
// with ErrNoQuorum when a majority cannot be listed. With some servers
// unreachable, a lock held on a bare majority may be missing from the list.
func (r *Redlock) List(ctx context.Context, prefix string) ([]dlock.LockInfo, error) {
	n := len(r.nodes)
	lists := make([][]dlock.LockInfo, n)
	errs := make([]error, n)
	r.each(ctx, 0, func(ctx context.Context, i int, b *Backend) {
		lists[i], errs[i] = b.List(ctx, prefix)
	})
	var failures []error
	for i, err := range errs {
		if err != nil {
			failures = append(failures, r.nodeErr(i, err))
		}
	}
	if n-len(failures) < r.quorum {
		return nil, r.noQuorum(fmt.Sprintf("list: %d servers failed", len(failures)), failures)
	}
	type holder struct {
		key string
		tok dlock.Token
	}
	votes := map[holder]int{}
	merged := map[holder]dlock.LockInfo{}
	for _, list := range lists {
		for _, info := range list {
			h := holder{info.Key, info.Token}
			votes[h]++
			m, seen := merged[h]
			if !seen {
				merged[h] = info
				continue
			}
			m.Fence = max(m.Fence, info.Fence)
			if info.ExpiresAt.Before(m.ExpiresAt) {
				m.ExpiresAt = info.ExpiresAt
			}
			if info.AcquiredAt.Before(m.AcquiredAt) {
				m.AcquiredAt = info.AcquiredAt
			}
			merged[h] = m
		}
	}
	var out []dlock.LockInfo
	for h, v := range votes {
		if v >= r.quorum {
			out = append(out, merged[h])
		}
	}
	sort.Slice(out, func(i, j int) bool { return out[i].Key < out[j].Key })
	return out, nil
}

// AcquireWait implements dlock.Waiter as Backend.AcquireWait does,
// subscribing on every server it can reach (an unreachable minority is
// tolerated; the holder's remaining lease bounds each wait anyway). When no
// server accepts the subscription it returns an error matching
// dlock.ErrUnsupported, having taken nothing.
func (r *Redlock) AcquireWait(ctx context.Context, req dlock.Request) (dlock.Result, error) {
	subs := make([]*redis.PubSub, len(r.nodes))
	errs := make([]error, len(r.nodes))
	r.each(ctx, r.timeoutFor(req.TTL), func(ctx context.Context, i int, b *Backend) {
		subs[i], errs[i] = b.subscribe(ctx, b.channel(req.Key))
	})
	wake := make(chan struct{}, 1)
	var wg sync.WaitGroup
	defer wg.Wait()
	var failures []error
	for i, ps := range subs {
		if ps == nil {
			failures = append(failures, r.nodeErr(i, errs[i]))
			continue
		}
		defer ps.Close()
		forward(&wg, ps, func(any) { poke(wake) })
	}
	switch {
	case ctx.Err() != nil:
		return dlock.Result{}, nil
	case len(failures) == len(r.nodes):
		return dlock.Result{}, fmt.Errorf("%w: redislock: redlock: no server accepted a subscription: %w",
			dlock.ErrUnsupported, dlock.Join(failures...))
	}
	return waitLoop(ctx, req, r.Acquire, wake)
}
