// Package redislock is a dlock.Backend on Redis (github.com/redis/go-redis/v9):
// a single server, a Sentinel-managed primary or a Redis Cluster, and, with
// NewRedlock, the Redlock algorithm over several independent servers.
//
// Each exclusive lock is a hash holding the owner token, owner, fence,
// metadata and acquisition time, whose expiry (PEXPIRE) is the lease, so
// leases are timed by Redis's clock. Acquisition, extension, release and
// forced release are Lua scripts that check the owner token atomically.
// Waiting acquisitions (dlock.Waiter) subscribe to a per-key channel
// instead of polling. Exclusive ones also queue in the store: an exclusive
// release hands the lock to the first of them in its own script and
// announces it on that channel, so a handoff costs the release alone and
// waits are served first come, first served; other releases publish there
// and wake every waiter.
//
// A Backend also watches keys (dlock.Watcher) and changes a held lease's
// metadata (dlock.MetadataSetter), for elections: grants, metadata changes
// and the releases that wake no waiter publish on a second per-key channel
// that only watches subscribe to, beside the release channel; each script
// publishes at most once. Each of those messages also carries the number of
// the change, counted per key, and the key's holders after it, so that a
// watch can follow every change in order (dlock.HolderWatcher, for
// observers that see every term). Expiries are not reported (Redis tells of
// them only through keyspace notifications, a server setting).
//
// A Backend grants every mode (dlock.Sharer): dlock.Shared (readers, whose
// writer is the exclusive acquisition) and dlock.WithLimit (a counting
// semaphore). A key's shared or limited holders are a sorted set of owner
// tokens scored by the end of each lease in milliseconds of the server's
// clock (TIME), beside a hash of their descriptions; both expire with their
// longest lease, and every script drops the holders whose lease has ended
// before it counts them. One script checks and changes all of a key's
// holders at once: an exclusive acquisition is refused while a live holder
// of any mode remains, and, when those are shared, leaves a writer mark
// lasting dlock.WriterMark that refuses new shared acquisitions (an
// exclusive grant deletes it; a waiting exclusive acquisition renews it by
// attempting again every dlock.WriterMark/3). The release of a limited
// holder, and of the last shared one, wakes the key's waiters. A Redlock
// grants only exclusive locks (see Redlock).
//
// A separate counter per key that never expires gives the fence of every
// mode, so tokens keep increasing across modes, releases and expiries. Each
// acquisition also raises the counter to at least the server's clock in
// microseconds (TIME), so tokens keep increasing after a restart without
// persistence, or a failover to a replica, that lost the counter: the new
// server's clock has moved on past the old tokens, unless it is behind the
// old server's by more than the outage lasted. Tokens are therefore large
// numbers (about 1.8e15), not 1, 2, 3.
//
//	rdb := redis.NewClient(&redis.Options{Addr: "localhost:6379"})
//	b, err := redislock.New(rdb, nil)
//	locker := dlock.New(b, nil)
//
// # Keys
//
// Key k uses the Redis key "dlock:{k}" (the exclusive lock hash; inspect it
// with HGETALL), "dlock:{k}:fence" (its counter), "dlock:{k}:changes" (the
// number of changes of its holders), "dlock:{k}:holders" and
// "dlock:{k}:info" (the shared or limited holders and their descriptions),
// "dlock:{k}:writer" (the writer mark), "dlock:{k}:queue" and
// "dlock:{k}:queued" (the exclusive waits and their descriptions),
// "dlock:{k}:racing" (the mark of waits outside the queue) and the
// channels "dlock:{k}:released" and "dlock:{k}:changed", where "dlock:" is
// Options.Prefix. The braces are a cluster hash tag: all of them live in
// one slot, which the scripts need on Redis Cluster. Braces and '%' inside
// k are escaped as %7B, %7D and %25.
//
// # Operations
//
// Counters are never deleted (deleting a fence counter could hand out a
// token again; deleting a change counter would hide changes from holder
// watches), so a store with unbounded distinct keys keeps two small strings
// per key ever locked. Run Redis with maxmemory-policy noeviction (the
// default): an evicted lock frees it early, an evicted counter can reset
// it. A queued wait trusts the handoff announced on its key's release
// channel: grant the right to publish on dlock's channels (the scripts
// publish as the calling user) only to dlock's clients, as the right to
// write its keys; a message published by anyone else could tell a wait
// that it holds a key it does not. Without persistence a restart frees
// every lock at once; with a replica, a failover can lose the newest
// acquisitions (replication is asynchronous), unless Options.MinReplicas
// makes each grant and extension wait for replicas to acknowledge it. Even
// then Redis is not strongly consistent: see docs/replication.md. Where
// that matters, use a consensus store, and pass the fence to the resources
// you guard. Every client of a key must run
// a version of this package that knows the modes: an older one sees no
// holder in a key held shared or limited. Likewise a watch sees the grants
// of clients whose version publishes them (the one that added Watch and
// later), and a holder watch (WatchHolders) ends at a change made by a
// client whose version does not number its changes.
//
// # Fenced writes
//
// Fenced and FencedSet write to Redis only with the newest fence of a
// resource, checked and applied in one script against the resource's
// fence record (FenceKey: "dlock:fence:" + the resource), so that a holder
// that lost its lock without knowing it cannot overwrite the writes of the
// holder after it. The fence may come from a lock on any backend. See
// docs/fencing-stores.md.
//
// Reentrancy (dlock.WithOwner) is counted by the dlock.Locker, per Locker; the
// scripts do not count it again, and a second acquisition with a different
// token is always refused.
//
// Redis 7.0 or later is recommended: releases and changes use sharded pub/sub
// (SPUBLISH), which stays on the key's shard in a cluster; on older servers
// the scripts, waiters and watches fall back to classic PUBLISH/SUBSCRIBE. *redis.Ring is not
// supported: it moves keys between shards when one is down, so two clients can
// disagree on where a lock lives.
package redislock

import (
	"context"
	_ "embed"
	"encoding/hex"
	"errors"
	"fmt"
	"sort"
	"strconv"
	"strings"
	"sync"
	"sync/atomic"
	"time"

	"github.com/dlock-dev/dlock"
	"github.com/redis/go-redis/v9"
)

// DefaultPrefix is the key prefix used when Options.Prefix is empty.
const DefaultPrefix = "dlock:"

// Client is what a Backend needs of a go-redis client: scripts, pipelines
// (to renew many leases in one round trip), SCAN (for List) and pub/sub (to
// wake waiters, which is why redis.Scripter alone is not enough).
// *redis.Client (also from redis.NewFailoverClient for Sentinel),
// *redis.ClusterClient and redis.UniversalClient satisfy it. The caller owns
// the client: the Backend never closes it.
type Client interface {
	redis.Scripter
	Pipeline() redis.Pipeliner
	Scan(ctx context.Context, cursor uint64, match string, count int64) *redis.ScanCmd
	Subscribe(ctx context.Context, channels ...string) *redis.PubSub
	SSubscribe(ctx context.Context, channels ...string) *redis.PubSub
}

// Options configure a Backend. The zero value (or nil) means all defaults.
type Options struct {
	// Prefix starts every Redis key and channel name the Backend uses, so
	// that several applications can share a server. It must not contain '{'
	// or '}', which would change the cluster hash tags. The default is
	// DefaultPrefix.
	Prefix string

	// MinReplicas is how many replicas must acknowledge each grant and
	// each extension before it counts. After the script, on the same
	// connection, the Backend sends WAIT MinReplicas with a timeout of a
	// quarter of the lease, cut to the caller's deadline: a grant that
	// fewer replicas acknowledge in time is released and reported as an
	// error matching ErrNotReplicated, and so is an extension (the lease
	// may still be held; the Locker retries it until its safe deadline).
	// WAIT makes a failover to an acknowledging replica keep the grant; it
	// does not make Redis strongly consistent (see docs/replication.md).
	// It needs a client of one server (*redis.Client, also Sentinel's
	// failover client), and must not be negative. The default, 0, waits
	// for no replica and costs no round trip.
	MinReplicas int
}

// Backend is a dlock.Backend on one Redis deployment (a server, a Sentinel
// group or a cluster). It is safe for concurrent use.
type Backend struct {
	c      Client
	prefix string
	// clockFloor keeps fencing counters at least the server's clock in µs.
	clockFloor bool
	// classicPubSub is set once the server refused SSUBSCRIBE (Redis < 7).
	classicPubSub atomic.Bool
	// oneNode is set for a client of one server (*redis.Client, also
	// Sentinel's): its renewals go in scripts of many keys each, which
	// Redis Cluster would refuse (the keys live in different slots).
	oneNode bool
	// minReplicas is Options.MinReplicas; server is the client then.
	minReplicas int
	server      *redis.Client
	// waits are the subscriptions of AcquireWait (see waitsubs.go).
	waits waitSubs
}

var (
	_ dlock.Backend        = (*Backend)(nil)
	_ dlock.Lister         = (*Backend)(nil)
	_ dlock.ForceReleaser  = (*Backend)(nil)
	_ dlock.Waiter         = (*Backend)(nil)
	_ dlock.DirectWaiter   = (*Backend)(nil)
	_ dlock.Sharer         = (*Backend)(nil)
	_ dlock.Watcher        = (*Backend)(nil)
	_ dlock.HolderWatcher  = (*Backend)(nil)
	_ dlock.MetadataSetter = (*Backend)(nil)
)

var (
	//go:embed holders.lua
	holdersLua string
	//go:embed acquire.lua
	acquireLua string
	//go:embed acquireshared.lua
	acquireSharedLua string
	//go:embed extend.lua
	extendLua string
	//go:embed release.lua
	releaseLua string
	//go:embed forcerelease.lua
	forceReleaseLua string
	//go:embed info.lua
	infoLua string
	//go:embed raisefence.lua
	raiseFenceLua string

	// The scripts that see every holder of a key begin with holders.lua.
	acquireScript       = redis.NewScript(holdersLua + acquireLua)
	acquireSharedScript = redis.NewScript(holdersLua + acquireSharedLua)
	extendScript        = redis.NewScript(holdersLua + extendLua)
	releaseScript       = redis.NewScript(holdersLua + releaseLua)
	forceReleaseScript  = redis.NewScript(holdersLua + forceReleaseLua)
	infoScript          = redis.NewScript(holdersLua + infoLua)
	raiseFenceScript    = redis.NewScript(raiseFenceLua)
)

// New returns a Backend over c. It does no I/O. The error matches
// dlock.ErrInvalidOption for a nil client, a bad prefix, a negative
// MinReplicas, or a MinReplicas with a client of several servers.
func New(c Client, opts *Options) (*Backend, error) {
	b, err := newBackend(c, opts)
	if err != nil {
		return nil, err
	}
	b.clockFloor = true
	if opts != nil && opts.MinReplicas != 0 {
		if err := b.setMinReplicas(opts.MinReplicas); err != nil {
			return nil, err
		}
	}
	return b, nil
}

func newBackend(c Client, opts *Options) (*Backend, error) {
	if opts == nil {
		opts = &Options{}
	}
	if c == nil {
		return nil, fmt.Errorf("%w: redislock: nil client", dlock.ErrInvalidOption)
	}
	prefix, err := checkPrefix(opts.Prefix)
	if err != nil {
		return nil, err
	}
	_, oneNode := c.(*redis.Client)
	return &Backend{c: c, prefix: prefix, oneNode: oneNode}, nil
}

func checkPrefix(p string) (string, error) {
	if p == "" {
		return DefaultPrefix, nil
	}
	if strings.ContainsAny(p, "{}") {
		return "", fmt.Errorf("%w: redislock: prefix %q contains a brace", dlock.ErrInvalidOption, p)
	}
	return p, nil
}

// Escaping braces keeps each key's hash tag non-empty and whole; escaping
// '%' keeps the mapping one-to-one.
var (
	keyEscaper   = strings.NewReplacer("%", "%25", "{", "%7B", "}", "%7D")
	keyUnescaper = strings.NewReplacer("%25", "%", "%7B", "{", "%7D", "}")
)

// tagged is the hash-tagged part shared by a key's Redis names.
func (b *Backend) tagged(key string) string { return b.prefix + "{" + keyEscaper.Replace(key) + "}" }

// holdersSuffix ends the name of a key's shared and limited holders.
const holdersSuffix = ":holders"

func (b *Backend) lockKey(key string) string    { return b.tagged(key) }
func (b *Backend) fenceKey(key string) string   { return b.tagged(key) + ":fence" }
func (b *Backend) holdersKey(key string) string { return b.tagged(key) + holdersSuffix }
func (b *Backend) infoKey(key string) string    { return b.tagged(key) + ":info" }
func (b *Backend) writerKey(key string) string  { return b.tagged(key) + ":writer" }
func (b *Backend) changesKey(key string) string { return b.tagged(key) + ":changes" }
func (b *Backend) queueKey(key string) string   { return b.tagged(key) + ":queue" }
func (b *Backend) queuedKey(key string) string  { return b.tagged(key) + ":queued" }
func (b *Backend) racingKey(key string) string  { return b.tagged(key) + ":racing" }
func (b *Backend) channel(key string) string    { return b.tagged(key) + ":released" }

// watchChannel carries the changes of key's holders that wake no waiter
// (grants, metadata changes, a shared release that leaves other readers):
// watches subscribe to it and to channel(key).
func (b *Backend) watchChannel(key string) string { return b.tagged(key) + ":changed" }

// modeKeys are the names a script that sees every holder of key needs:
// the lock, the shared and limited holders and their descriptions.
func (b *Backend) modeKeys(key string) []string {
	return []string{b.lockKey(key), b.holdersKey(key), b.infoKey(key)}
}

// changeKeys are the names a script that changes key's holders needs:
// modeKeys and the key's change counter.
func (b *Backend) changeKeys(key string) []string {
	return append(b.modeKeys(key), b.changesKey(key))
}

// keyOf returns the dlock key of the Redis name of a lock or of its shared
// and limited holders, and false for other names (counters, foreign keys).
func (b *Backend) keyOf(name string) (string, bool) {
	inner, ok := strings.CutPrefix(name, b.prefix+"{")
	if !ok {
		return "", false
	}
	inner = strings.TrimSuffix(inner, holdersSuffix)
	inner, ok = strings.CutSuffix(inner, "}")
	if !ok || strings.ContainsAny(inner, "{}") {
		return "", false
	}
	return keyUnescaper.Replace(inner), true
}

func (b *Backend) floorArg() string {
	if b.clockFloor {
		return "1"
	}
	return "0"
}

// SupportsMode implements dlock.Sharer: a Backend grants every mode.
func (b *Backend) SupportsMode(m dlock.Mode) bool {
	switch m {
	case dlock.ModeExclusive, dlock.ModeShared, dlock.ModeLimited:
		return true
	}
	return false
}

// Acquire implements dlock.Backend and dlock.Sharer with one script call.
func (b *Backend) Acquire(ctx context.Context, req dlock.Request) (dlock.Result, error) {
	return b.acquireWith(ctx, req)
}

// acquireWith runs req's acquisition script with the arguments of a wait
// (extra) after the usual ones.
func (b *Backend) acquireWith(ctx context.Context, req dlock.Request, extra ...any) (dlock.Result, error) {
	script, args, err := b.acquireCall(req)
	if err != nil {
		return dlock.Result{}, err
	}
	args = append(args, extra...)
	if b.minReplicas > 0 {
		return b.acquireReplicated(ctx, req, script, args)
	}
	v, err := script.Run(ctx, b.c, b.acquireKeys(req.Key), args...).Slice()
	return acquireResult(req, v, err)
}

// acquireResult reads the reply of req's acquisition script.
func acquireResult(req dlock.Request, v []any, err error) (dlock.Result, error) {
	if err != nil {
		return dlock.Result{}, fmt.Errorf("redislock: acquire %q: %w", req.Key, err)
	}
	switch {
	case len(v) >= 2 && v[0] == int64(1):
		fence, ok := v[1].(int64)
		if !ok || fence <= 0 {
			return dlock.Result{}, fmt.Errorf("redislock: acquire %q: bad fence %v", req.Key, v[1])
		}
		return dlock.Result{Acquired: true, Fence: uint64(fence)}, nil
	case len(v) == 3 && v[0] == int64(2):
		mode, _ := v[1].(int64)
		limit, _ := v[2].(int64)
		return dlock.Result{}, fmt.Errorf("redislock: %q is held %s, asked %s: %w",
			req.Key, dlock.DescribeMode(dlock.Mode(mode), int(limit)), dlock.DescribeMode(req.Mode, req.Limit), dlock.ErrModeMismatch)
	case len(v) < 1 || v[0] != int64(0):
		return dlock.Result{}, fmt.Errorf("redislock: acquire %q: unexpected reply %v", req.Key, v)
	}
	h, remaining := parseHolder(req.Key, v[1:], time.Now())
	if len(v) == 2 {
		// Refused by a writer mark: no holder to describe, and
		// remaining is the mark's.
		h = dlock.LockInfo{Key: req.Key}
	}
	return dlock.Result{Holder: h, Remaining: remaining}, nil
}

// acquireKeys are the names the acquisition scripts need.
func (b *Backend) acquireKeys(key string) []string {
	return []string{b.lockKey(key), b.fenceKey(key), b.holdersKey(key), b.infoKey(key), b.writerKey(key), b.changesKey(key), b.queueKey(key), b.queuedKey(key), b.racingKey(key)}
}

// releaseKeys are the names the release script needs.
func (b *Backend) releaseKeys(key string) []string {
	return append(b.changeKeys(key), b.fenceKey(key), b.writerKey(key), b.queueKey(key), b.queuedKey(key), b.racingKey(key))
}

// acquireCall returns the script that takes req and its arguments, or an
// error matching dlock.ErrInvalidOption for a mode or limit out of range.
func (b *Backend) acquireCall(req dlock.Request) (*redis.Script, []any, error) {
	args := []any{req.Token.String(), req.TTL.Milliseconds(), req.Owner, req.Metadata, b.floorArg(), b.watchChannel(req.Key)}
	switch {
	case req.Mode == dlock.ModeExclusive:
		return acquireScript, append(args, dlock.WriterMark.Milliseconds()), nil
	case req.Mode == dlock.ModeShared:
		return acquireSharedScript, append(args, int(req.Mode), 0), nil
	case req.Mode == dlock.ModeLimited && req.Limit >= 1 && req.Limit <= dlock.MaxLimit:
		return acquireSharedScript, append(args, int(req.Mode), req.Limit), nil
	}
	return nil, nil, fmt.Errorf("%w: redislock: acquire %q: mode %s with limit %d", dlock.ErrInvalidOption, req.Key, req.Mode, req.Limit)
}

// parseHolder reads {pttl, token, owner, fence, metadata, acquired_us[,
// mode, limit]} as far as it can: the reply only informs the caller, so a
// malformed field is left zero rather than failing an acquisition whose
// outcome is known.
func parseHolder(key string, v []any, now time.Time) (dlock.LockInfo, time.Duration) {
	h := dlock.LockInfo{Key: key}
	str := func(i int) string {
		if i < len(v) {
			s, _ := v[i].(string)
			return s
		}
		return ""
	}
	var remaining time.Duration
	if len(v) > 0 {
		// PTTL rounds down: 0 is a lease with less than a millisecond
		// left, not an unknown one (-1: no expiry).
		if ms, ok := v[0].(int64); ok && ms >= 0 {
			remaining = max(time.Duration(ms)*time.Millisecond, time.Millisecond)
			h.ExpiresAt = now.Add(remaining)
		}
	}
	if tok, err := hex.DecodeString(str(1)); err == nil && len(tok) == len(h.Token) {
		copy(h.Token[:], tok)
	}
	h.Owner = str(2)
	h.Fence, _ = strconv.ParseUint(str(3), 10, 64)
	h.Metadata = str(4)
	if us, err := strconv.ParseInt(str(5), 10, 64); err == nil {
		h.AcquiredAt = time.UnixMicro(us)
	}
	if len(v) >= 8 {
		mode, _ := v[6].(int64)
		limit, _ := v[7].(int64)
		h.Mode, h.Limit = dlock.Mode(mode), int(limit)
	}
	return h, remaining
}

// extendChunk bounds the leases one extend script renews on a single
// server. A script runs atomically: 1,000 leases hold the server for well
// under a millisecond.
const extendChunk = 1000

// ExtendBatch implements dlock.BatchExtender: on a single server Extend
// renews up to 20,000 leases in one pipeline (one script call per
// extendChunk), one round trip on one connection; a Cluster or Ring
// client routes one call per lease and keeps the Locker's default.
func (b *Backend) ExtendBatch() int {
	if b.oneNode {
		return 20 * extendChunk
	}
	return 0
}

// Extend implements dlock.Backend, in one pipeline: on a single server
// (oneNode) one script call per 1,000 leases, on other clients (Redis
// Cluster, Ring) one call per lease, which the client routes by slot.
func (b *Backend) Extend(ctx context.Context, leases []dlock.Lease) ([]error, error) {
	per := 1
	if b.oneNode {
		per = extendChunk
	}
	span := func(j int) (lo, hi int) { return j * per, min((j+1)*per, len(leases)) }
	var on pipeliner = b.c
	var conn *redis.Conn
	if b.minReplicas > 0 {
		// WAIT counts the writes of its own connection.
		conn = b.server.Conn()
		defer conn.Close()
		on = conn
	}
	cmds := b.runEach(ctx, on, extendScript, (len(leases)+per-1)/per, func(j int) ([]string, []any) {
		lo, hi := span(j)
		keys, argv := make([]string, 0, 3*(hi-lo)), make([]any, 0, 2*(hi-lo))
		for _, l := range leases[lo:hi] {
			keys = append(keys, b.modeKeys(l.Key)...)
			argv = append(argv, l.Token.String(), l.TTL.Milliseconds())
		}
		return keys, argv
	})
	errs := make([]error, len(leases))
	failed, extended := 0, 0
	for j, c := range cmds {
		lo, hi := span(j)
		renewed, err := c.Int64Slice()
		if err == nil && len(renewed) != hi-lo {
			err = fmt.Errorf("script returned %d results for %d leases", len(renewed), hi-lo)
		}
		for i := lo; i < hi; i++ {
			switch {
			case err != nil:
				errs[i] = fmt.Errorf("redislock: extend %q: %w", leases[i].Key, err)
				failed++
			case renewed[i-lo] == 0:
				errs[i] = dlock.ErrNotHeld
			default:
				extended++
			}
		}
	}
	if conn != nil && extended > 0 {
		if err := b.awaitReplicas(ctx, conn, minTTL(leases)); err != nil {
			// Extended on the primary alone. Not ErrNotHeld: the lease may
			// still be held, and the Locker retries it.
			for i, e := range errs {
				if e == nil {
					errs[i] = fmt.Errorf("redislock: extend %q: %w", leases[i].Key, err)
					failed++
				}
			}
		}
	}
	if failed > 0 && failed == len(leases) {
		return nil, errs[0]
	}
	return errs, nil
}

// pipeliner is what runs a pipeline: the client, or one of its connections.
type pipeliner interface{ Pipeline() redis.Pipeliner }

// runEach runs script s n times in one pipeline with the keys and arguments
// args(i) gives, by digest, then runs again with the script's body those the
// server had not cached (after a restart or SCRIPT FLUSH). A NOSCRIPT call
// did nothing, so repeating it is safe.
func (b *Backend) runEach(ctx context.Context, on pipeliner, s *redis.Script, n int, args func(i int) ([]string, []any)) []*redis.Cmd {
	cmds := make([]*redis.Cmd, n)
	if n == 0 {
		return cmds
	}
	pipe := on.Pipeline()
	for i := range n {
		keys, argv := args(i)
		cmds[i] = s.EvalSha(ctx, pipe, keys, argv...)
	}
	_, _ = pipe.Exec(ctx) // errors are read per command
	var again []int
	for i, c := range cmds {
		if redis.HasErrorPrefix(c.Err(), "NOSCRIPT") {
			again = append(again, i)
		}
	}
	if len(again) > 0 {
		pipe = on.Pipeline()
		for _, i := range again {
			keys, argv := args(i)
			cmds[i] = s.Eval(ctx, pipe, keys, argv...)
		}
		_, _ = pipe.Exec(ctx)
	}
	return cmds
}

// Release implements dlock.Backend. An exclusive release hands the lock to
// the first exclusive wait queued for the key (see AcquireWait) in the same
// script; otherwise it wakes the key's waiters when they may now be granted
// it: at an exclusive or limited release, and at the release of the last
// shared holder. A token that holds nothing but is queued leaves the queue
// (and ErrNotHeld is returned).
func (b *Backend) Release(ctx context.Context, key string, token dlock.Token) error {
	n, err := b.runRelease(ctx, key, token).Int64()
	if err != nil {
		return fmt.Errorf("redislock: release %q: %w", key, err)
	}
	if n == 0 {
		return dlock.ErrNotHeld
	}
	return nil
}

// runRelease runs the release script of token on key.
func (b *Backend) runRelease(ctx context.Context, key string, token dlock.Token) *redis.Cmd {
	return releaseScript.Run(ctx, b.c, b.releaseKeys(key), token.String(), b.channel(key), b.watchChannel(key), b.floorArg())
}

// ForceRelease implements dlock.ForceReleaser: it frees every holder of the
// key, in any mode, and wakes the key's waiters; the holders learn of the
// loss at their next renewal.
func (b *Backend) ForceRelease(ctx context.Context, key string) error {
	n, err := forceReleaseScript.Run(ctx, b.c, b.changeKeys(key), b.channel(key)).Int64()
	if err != nil {
		return fmt.Errorf("redislock: force release %q: %w", key, err)
	}
	if n == 0 {
		return dlock.ErrNotHeld
	}
	return nil
}

// List implements dlock.Lister: every holder of each key, in any mode,
// ordered by key, then fence. It SCANs the keyspace (every primary of a
// cluster) for the prefix, so it costs O(keys in the database), not O(locks);
// it is meant for operators, not hot paths. Locks taken or released while it
// runs may or may not be listed.
func (b *Backend) List(ctx context.Context, prefix string) ([]dlock.LockInfo, error) {
	names, err := b.scan(ctx, globEscape(b.prefix+"{"+keyEscaper.Replace(prefix))+"*")
	if err != nil {
		return nil, fmt.Errorf("redislock: list: %w", err)
	}
	seen := map[string]bool{}
	var keys []string
	for _, name := range names {
		if k, ok := b.keyOf(name); ok && strings.HasPrefix(k, prefix) && !seen[k] {
			seen[k] = true
			keys = append(keys, k)
		}
	}
	cmds := b.runEach(ctx, b.c, infoScript, len(keys), func(i int) ([]string, []any) {
		return b.modeKeys(keys[i]), nil
	})
	now := time.Now()
	var out []dlock.LockInfo
	for i, c := range cmds {
		hs, err := c.Slice()
		if err != nil {
			return nil, fmt.Errorf("redislock: list %q: %w", keys[i], err)
		}
		for _, v := range hs { // none if released since the scan
			v, ok := v.([]any)
			if !ok {
				return nil, fmt.Errorf("redislock: list %q: unexpected reply %v", keys[i], hs)
			}
			h, _ := parseHolder(keys[i], v, now)
			out = append(out, h)
		}
	}
	sort.Slice(out, func(i, j int) bool {
		if out[i].Key != out[j].Key {
			return out[i].Key < out[j].Key
		}
		return out[i].Fence < out[j].Fence
	})
	return out, nil
}

// scanner is the SCAN of one server.
type scanner interface {
	Scan(ctx context.Context, cursor uint64, match string, count int64) *redis.ScanCmd
}

// scan returns the distinct names matching pattern: on every primary of a
// cluster client, on the server otherwise.
func (b *Backend) scan(ctx context.Context, pattern string) ([]string, error) {
	seen := map[string]bool{}
	var mu sync.Mutex
	one := func(ctx context.Context, s scanner) error {
		var cursor uint64
		for {
			names, next, err := s.Scan(ctx, cursor, pattern, 1000).Result()
			if err != nil {
				return err
			}
			mu.Lock()
			for _, n := range names {
				seen[n] = true
			}
			mu.Unlock()
			if next == 0 {
				return nil
			}
			cursor = next
		}
	}
	type cluster interface {
		ForEachMaster(ctx context.Context, fn func(ctx context.Context, c *redis.Client) error) error
	}
	var err error
	if cc, ok := b.c.(cluster); ok {
		err = cc.ForEachMaster(ctx, func(ctx context.Context, c *redis.Client) error { return one(ctx, c) })
	} else {
		err = one(ctx, b.c)
	}
	if err != nil {
		return nil, err
	}
	out := make([]string, 0, len(seen))
	for n := range seen {
		out = append(out, n)
	}
	return out, nil
}

// globEscape quotes the characters SCAN MATCH treats specially.
func globEscape(s string) string {
	var sb strings.Builder
	for i := 0; i < len(s); i++ { // bytes: the special characters are ASCII
		switch s[i] {
		case '*', '?', '[', ']', '\\':
			sb.WriteByte('\\')
		}
		sb.WriteByte(s[i])
	}
	return sb.String()
}

// subscribeTimeout bounds the wait for a subscription's confirmation.
const subscribeTimeout = 5 * time.Second

// unknownLeaseWait bounds a wait for a holder whose lease Redis did not
// report (a lock key without expiry, written by something else).
const unknownLeaseWait = time.Second

// writerMarkRenewal bounds the wait of an exclusive request behind shared
// holders: it attempts again this often, renewing its writer mark well
// before the mark's dlock.WriterMark runs out.
const writerMarkRenewal = dlock.WriterMark / 3

// AcquireWait implements dlock.Waiter. It subscribes to the key's release
// channel before its first attempt, so that a release between an attempt and
// the wait is not missed. An exclusive request then waits in the key's
// queue: the release of the holder hands it the lock, first come first
// served, and tells it so on the channel (see queue.go); a shared or
// limited one attempts again on each release message. Both also attempt
// again at a resubscription after a reconnect (messages may have been
// lost) and when the holder's lease, as Redis reported it, runs out; an
// exclusive request behind shared holders also every dlock.WriterMark/3,
// which renews its writer mark. It returns Acquired=false and a nil error
// when ctx ends while the key is held (an exclusive wait first leaves the
// queue, in a call bounded by 5 s, and returns its error if that fails),
// and an error matching dlock.ErrUnsupported, having taken nothing, when it
// cannot subscribe (an ACL without channel rights, an unreachable server):
// the Locker then backs off instead.
//
// With MinReplicas, exclusive requests do not queue (a handoff would not
// wait for replicas): woken waiters race for the key, and a releaser that
// acquires again at once may win. A refused wait outside the queue (shared,
// limited, or with MinReplicas) marks the key as raced for until 2 s after
// the lease that refused it (a wait attempts again before, at the next
// release or that lease's end): exclusive releases then wake every wait
// instead of handing the key over, so that a stream of queued exclusive
// waits cannot starve it. A key released by the expiry of its lease, a
// forced release or a shared holder is also raced for.
//
// Waiting calls of the Backend on one key share one pub/sub connection,
// which is kept for a moment after the last one ends, for the next wait on
// the key. A call on a key without one attempts first, and subscribes only
// if the key is held; a call on a key with one attempts once it has joined
// it, so that a blocking acquisition of a contended key costs one script
// before its wait (see WaitsDirectly).
func (b *Backend) AcquireWait(ctx context.Context, req dlock.Request) (dlock.Result, error) {
	if !b.subscribed(b.channel(req.Key)) {
		// Attempt first, as a try: a free key costs no subscription.
		if res, err := b.Acquire(ctx, req); err != nil || res.Acquired {
			return res, err
		}
	}
	sub, w, err := b.join(ctx, b.channel(req.Key), req.Token)
	if err != nil {
		if ctx.Err() != nil {
			return dlock.Result{}, nil // nothing was attempted
		}
		return dlock.Result{}, fmt.Errorf("%w: redislock: subscribe to %q: %w", dlock.ErrUnsupported, b.channel(req.Key), err)
	}
	defer b.leave(sub, req.Token)
	if req.Mode == dlock.ModeExclusive && b.minReplicas == 0 {
		return b.queuedWait(ctx, req, w)
	}
	return waitLoop(ctx, req, b.acquireRacing, w.wake)
}

// racingMark is how long the racing mark that a refused wait outside the
// queue sets outlasts the lease that refused it (see mark in holders.lua):
// the wait attempts again at the next release or at that lease's end, well
// within it.
const racingMark = 2 * time.Second

// acquireRacing is Acquire for a wait that does not queue: a refusal sets
// the key's racing mark, so that exclusive releases wake every wait instead
// of handing the key over, and the queued waits cannot starve this one.
func (b *Backend) acquireRacing(ctx context.Context, req dlock.Request) (dlock.Result, error) {
	if req.Mode == dlock.ModeExclusive {
		return b.acquireWith(ctx, req, 0, 0, racingMark.Milliseconds()) // no place in the queue
	}
	return b.acquireWith(ctx, req, racingMark.Milliseconds())
}

// WaitsDirectly implements dlock.DirectWaiter: AcquireWait attempts
// before it subscribes, or joins a subscription already confirmed.
func (b *Backend) WaitsDirectly() bool { return true }

// subscribe subscribes to chs (sharded pub/sub, or classic on servers that
// lack it) and waits for the server's confirmation.
func (b *Backend) subscribe(ctx context.Context, chs ...string) (*redis.PubSub, error) {
	if !b.classicPubSub.Load() {
		ps, err := confirm(ctx, b.c.SSubscribe(ctx, chs...), len(chs))
		if err == nil || !isUnknownCommand(err) {
			return ps, err
		}
		b.classicPubSub.Store(true)
	}
	return confirm(ctx, b.c.Subscribe(ctx, chs...), len(chs))
}

func isUnknownCommand(err error) bool {
	var re redis.Error
	return errors.As(err, &re) && strings.Contains(strings.ToLower(re.Error()), "unknown command")
}

// confirm waits for ps's n subscription replies (one per channel), and
// closes ps on failure.
func confirm(ctx context.Context, ps *redis.PubSub, n int) (*redis.PubSub, error) {
	ctx, cancel := context.WithTimeout(ctx, subscribeTimeout)
	defer cancel()
	// go-redis applies a context's deadline to the read, not its
	// cancellation: closing the connection ends the read at once.
	stop := context.AfterFunc(ctx, func() { ps.Close() })
	var err error
	for range n {
		var msg any
		if msg, err = ps.Receive(ctx); err != nil {
			break
		}
		if _, ok := msg.(*redis.Subscription); !ok {
			err = fmt.Errorf("redislock: unexpected reply %T to a subscription", msg)
			break
		}
	}
	if !stop() {
		if err == nil {
			err = ctx.Err()
		}
		return nil, err
	}
	if err != nil {
		ps.Close()
		return nil, err
	}
	return ps, nil
}

// forward calls deliver with every message and resubscription on ps,
// until ps is closed.
func forward(wg *sync.WaitGroup, ps *redis.PubSub, deliver func(msg any)) {
	// A resubscription (after go-redis reconnected) counts as a wake-up:
	// a release may have been published while the connection was down.
	ch := ps.ChannelWithSubscriptions(redis.WithChannelSendTimeout(time.Second))
	wg.Go(func() {
		for msg := range ch {
			deliver(msg)
		}
	})
}

// poke sends on wake without blocking: a wake-up already pending covers
// this one.
func poke(wake chan<- struct{}) {
	select {
	case wake <- struct{}{}:
	default:
	}
}

// retryAfter is when a wait attempts again without a wake-up after res
// refused req: when the holder's lease runs out, or to renew its writer
// mark.
func retryAfter(req dlock.Request, res dlock.Result) time.Duration {
	wait := res.Remaining
	if wait <= 0 {
		wait = unknownLeaseWait
	}
	if req.Mode == dlock.ModeExclusive && res.Holder.Mode == dlock.ModeShared {
		// Each attempt renews the writer mark that holds new shared
		// requests back; it lasts dlock.WriterMark.
		wait = min(wait, writerMarkRenewal)
	}
	// Redis expires the key on the first access after its lease; the
	// millisecond covers PTTL's rounding.
	return wait + time.Millisecond
}

// waitLoop attempts acquire until it succeeds, fails, or ctx ends, waiting
// between attempts for wake or for the holder's remaining lease.
func waitLoop(ctx context.Context, req dlock.Request, acquire func(context.Context, dlock.Request) (dlock.Result, error), wake <-chan struct{}) (dlock.Result, error) {
	t := time.NewTimer(time.Hour)
	defer t.Stop()
	began := time.Now()
	for {
		sending := time.Now()
		res, err := acquire(ctx, req)
		if err != nil || res.Acquired {
			// The lease starts with this attempt, not with the wait.
			res.SentAfter = sending.Sub(began)
			return res, err
		}
		t.Reset(retryAfter(req, res))
		select {
		case <-wake:
		case <-t.C:
		case <-ctx.Done():
			return dlock.Result{Holder: res.Holder}, nil
		}
	}
}
