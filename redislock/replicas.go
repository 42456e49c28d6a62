package redislock

import (
	"context"
	"errors"
	"fmt"
	"time"

	"github.com/dlock-dev/dlock"
	"github.com/redis/go-redis/v9"
)

// ErrNotReplicated means fewer than Options.MinReplicas replicas
// acknowledged a grant or an extension in time. A grant reported with it
// does not count (the Backend released it); an extension reported with it
// may have renewed the lease on the primary alone.
var ErrNotReplicated = errors.New("redislock: not acknowledged by enough replicas")

// replicaWaitShare is the share of a lease that a WAIT for replicas may
// take: the rest is left to the holder and to the Locker's margin.
const replicaWaitShare = 4

// releaseTimeout bounds the release of a grant that was not replicated.
const releaseTimeout = 2 * time.Second

// MinReplicas returns Options.MinReplicas: how many replicas acknowledge
// each grant and extension before it counts.
func (b *Backend) MinReplicas() int { return b.minReplicas }

// setMinReplicas checks and sets Options.MinReplicas.
func (b *Backend) setMinReplicas(n int) error {
	if n < 0 {
		return fmt.Errorf("%w: redislock: negative MinReplicas %d", dlock.ErrInvalidOption, n)
	}
	server, ok := b.c.(*redis.Client)
	if !ok {
		// WAIT is per connection, and a cluster's keys live on several
		// primaries, each with its own replicas.
		return fmt.Errorf("%w: redislock: MinReplicas needs a client of one server (*redis.Client), not %T", dlock.ErrInvalidOption, b.c)
	}
	b.minReplicas, b.server = n, server
	return nil
}

// acquireReplicated runs req's acquisition script, then, if it granted the
// key, WAITs on the same connection for b.minReplicas replicas. A grant they
// do not acknowledge in time is released before returning.
func (b *Backend) acquireReplicated(ctx context.Context, req dlock.Request, script *redis.Script, args []any) (dlock.Result, error) {
	conn := b.server.Conn()
	v, err := script.Run(ctx, conn, b.acquireKeys(req.Key), args...).Slice()
	res, err := acquireResult(req, v, err)
	if err == nil && res.Acquired {
		err = b.awaitReplicas(ctx, conn, req.TTL)
	}
	conn.Close() // before the release: the pool may hold one connection
	if err == nil || !res.Acquired {
		return res, err
	}
	// The token is ours: free the key now rather than at the end of the
	// lease. If this fails too, the Locker resolves the grant.
	rctx, cancel := context.WithTimeout(context.WithoutCancel(ctx), releaseTimeout)
	rerr := b.Release(rctx, req.Key, req.Token)
	cancel()
	if rerr != nil && !errors.Is(rerr, dlock.ErrNotHeld) {
		return dlock.Result{}, fmt.Errorf("redislock: acquire %q: %w (and its release: %v)", req.Key, err, rerr)
	}
	return dlock.Result{}, fmt.Errorf("redislock: acquire %q: %w", req.Key, err)
}

// awaitReplicas WAITs on conn, which has just written, for b.minReplicas
// replicas to acknowledge its writes, for a quarter of ttl at most, cut to
// ctx's deadline. The error matches ErrNotReplicated when fewer did.
func (b *Backend) awaitReplicas(ctx context.Context, conn *redis.Conn, ttl time.Duration) error {
	timeout := ttl / replicaWaitShare
	if d, ok := ctx.Deadline(); ok {
		timeout = min(timeout, time.Until(d))
	}
	// WAIT's timeout is in whole milliseconds, and 0 would wait forever.
	timeout = max(timeout, time.Millisecond)
	n, err := conn.Wait(ctx, b.minReplicas, timeout).Result()
	if err != nil {
		return fmt.Errorf("wait for %d replicas: %w", b.minReplicas, err)
	}
	if n < int64(b.minReplicas) {
		return fmt.Errorf("%w: %d of %d acknowledged within %s", ErrNotReplicated, n, b.minReplicas, timeout)
	}
	return nil
}

// minTTL returns the shortest TTL among leases.
func minTTL(leases []dlock.Lease) time.Duration {
	d := leases[0].TTL
	for _, l := range leases[1:] {
		d = min(d, l.TTL)
	}
	return d
}
