// Package etcdlock is a dlock.Backend on etcd v3 (go.etcd.io/etcd/client/v3).
// It grants every mode (dlock.Sharer): exclusive, shared and limited.
//
// Each acquisition (and each waiting acquisition) is an entry key under the
// lock's directory, attached to an etcd lease of its own:
//
//	<prefix><escaped key>/<lease id in hex>  →  {"token":…, "owner":…, "metadata":…, "acquired_us":…, "mode":…, "limit":…, "ttl_s":…}
//
// (The name carries the lease the entry was created with; an Extend to
// another TTL, for dlock.WithMinHold, moves the entry to a new lease.)
//
// The entries form a queue in create-revision order, which makes waiting
// FIFO across modes. An exclusive entry holds the lock when it is first; a
// shared entry when only shared entries are ahead of it; a limited entry
// when fewer than its limit entries are ahead of it. This is the recipe of
// etcd's own concurrency package for the exclusive lock, and of Curator's
// InterProcessReadWriteLock and InterProcessSemaphoreV2 for the others, with
// the leases renewed by the dlock.Locker (one KeepAliveOnce per lease in
// Extend) instead of a session goroutine, so that the Locker's
// monotonic-clock deadline and loss notification work as on every other
// backend.
//
//	cli, err := clientv3.New(clientv3.Config{Endpoints: []string{"localhost:2379"}})
//	b, err := etcdlock.New(cli, nil)
//	locker := dlock.New(b, nil)
//	// at the end: locker.Close(ctx), b.Close(), cli.Close()
//
// # Modes
//
// A key is either a reader-writer lock (exclusive and shared entries) or a
// semaphore (limited entries, all with one limit). An acquisition that
// finds an entry of the other kind, or with another limit, ahead of its own
// fails with dlock.ErrModeMismatch; an entry it wrote is deleted before it
// returns (an entry created first never sees a later one: the later one
// gives way).
//
// Writers are not starved: a queued exclusive entry keeps the shared ones
// behind it waiting. An exclusive acquisition that finds the key held
// shared also writes the key's writer mark (<prefix><escaped key>%writer,
// with a lease of 2 s, which etcd revokes within 2.5 s: dlock.WriterMark at
// most, unless the cluster's minimum lease is longer); while it exists no
// shared entry is created, so readers that come between the writer's first
// attempt and its queued entry do not overtake it. An exclusive grant
// deletes the mark.
//
// Every decision is made on a consistent view: an acquisition that cannot
// wait writes its entry in a transaction that compares what it read (the
// queue was empty, for an exclusive one; no writer mark, for a shared one)
// and reads the queue again at the entry's own revision; a waiting entry
// decides from the entries ahead of it, which only ever leave (new ones
// queue behind it), so an entry once granted stays granted while it exists.
//
// Reading the holders of a shared or limited key costs more than reading
// one entry: Extend, Release and List of a holder that is not the head
// entry read the key's whole queue.
//
// # Leases and time
//
// Expiry is decided by the etcd leader's clock alone; the Backend never sends
// a time. etcd leases have whole-second TTLs: a dlock TTL d becomes a lease
// of ceil(d) seconds, and etcd raises a lease below its minimum (1.5 election
// timeouts rounded up to a second: 2 s with etcd's default 1 s election
// timeout, so dlock.MinTTL gets 2 s there). The leader revokes expired leases
// every 500 ms, and a new leader restarts every lease's TTL (plus an election
// timeout) when it takes over. The lease in etcd therefore lasts at least as
// long as the Locker assumes, never less: the Locker, which counts from the
// moment it sent the request and gives up a margin early, always reports a
// loss before etcd frees the key. The other side of it: a crashed holder's
// lock is free again only max(ceil(TTL), minimum lease) to that plus 0.5 s
// after its last renewal, and later still if the leader changed meanwhile.
// LockInfo.AcquiredAt is the client's clock at the acquisition (etcd keeps
// no time); ExpiresAt is known to the second only.
//
// # Fencing
//
// The fence is the holder entry's create revision, in every mode: etcd's
// revision counter, which strictly increases over the life of the cluster's
// data (it survives restarts, leader changes and compaction). Tokens are
// therefore not 1, 2, 3 for one key but jump by the writes made to other
// keys; they strictly increase per key, which is what fencing needs. Since
// an entry ahead of another always gets its turn no later than that other
// one, holders get their fences in the order of their grants: a writer's
// fence is larger than every reader's before it, and smaller than every
// reader's after it. (A parked shared or limited entry whose turn came
// while parked is therefore not taken over: entries behind it may have
// been granted with larger fences in the meantime.) Not covered: a cluster
// restored from a backup goes back to the backup's revision and would hand
// out tokens again (etcdutl snapshot restore --bump-revision, in etcd 3.5
// and later, prevents it), and a cluster created anew without its data
// starts again at 1.
//
// # Guarded writes
//
// Backend.HeldCmp returns a clientv3.Cmp to add to the caller's own etcd
// transaction: it holds only while the holder's entry exists, so the
// transaction commits only while the lock is held, checked by etcd as it
// applies it. For data in etcd guarded by a lock of another store,
// FencedTxn checks the lock's fence against a record of the newest fence
// (FencePrefix + the resource) in the same transaction. See
// docs/fencing-stores.md.
//
// # Waiting
//
// A waiting acquisition (dlock.Waiter) creates its entry and watches only
// the entries ahead of it that keep it waiting: an exclusive entry the one
// just before it, a shared entry the nearest exclusive entry ahead of it, so
// a release wakes only waiters that may now hold the lock (no thundering
// herd) and the lock is handed over in arrival order. A limited entry with k
// entries ahead of it and a limit of n watches them and looks again only
// once k−n+1 of them have left, so each release makes one limited waiter
// read (their watches all receive the deletions). A waiter whose context
// ends deletes its entry at once (against an unreachable member it returns
// after one request's timeout and the deletion goes on in the background;
// Backend.Close waits for it). One AcquireWait call waits at most a third of
// the TTL (the Locker counts the lease from the call's start); it then
// leaves its entry queued for the Locker's next call, which renews it and
// keeps the place in the queue. An entry whose turn comes before the next
// call takes it over is removed at once (each parked entry keeps a watch for
// it), so that a waiter that gave up between two calls never holds the key
// up: the next waiter gets it, and a late call queues anew. A waiter that
// crashes holds up the queue, when its turn comes, until its entry's lease
// expires, as a crashed holder does. An acquisition that cannot wait
// (TryAcquire) never queues and never barges: an exclusive one creates its
// entry only if the directory is empty, in one transaction, and a shared or
// limited one keeps its entry only if it holds the lock at once; each fails
// while entries that would keep it out hold or wait.
//
// # Watching and metadata
//
// The Backend is a dlock.Watcher: a watch is an etcd watch on the key's
// directory, which reports every grant, release, metadata change and
// expiry (etcd revokes expired leases itself), and is closed when etcd
// ends it (no leader, a compacted revision). It is a dlock.MetadataSetter:
// the holder's entry is rewritten in place, keeping its lease and fence.
//
// # Failures
//
// Every request the Backend makes can be repeated safely, and it is repeated
// (for up to a few seconds) when etcd reports a transient error (a member
// gone, no leader, a leader change) or gives no answer within
// Options.RequestTimeout (a leader that died with the request in flight).
// With several endpoints in the client, killing one member of a three-member
// cluster, the leader included, therefore costs a short pause (an election),
// not an error or a lost lock, provided the TTL leaves room for it (a few
// seconds). A holder cut off from the quorum cannot renew: the Locker
// reports the loss (Lock.Done closes) before the lease expires in the
// cluster, after which another client takes the lock with a larger fencing
// token. Data loss in etcd (a cluster recreated without its data) loses
// every lock.
//
// # Connections
//
// The Backend uses the caller's *clientv3.Client (one gRPC connection that
// multiplexes everything) and never closes it. Each waiting acquisition
// holds one watch on it. Renewal costs one KeepAliveOnce per lease (after
// one read per 64 leases): etcd has no call renewing many leases at once.
//
// After an outage (a restarted member, a cut connection) the client redials
// with gRPC's default backoff: 1 s, then 1.6 times longer at each failed
// attempt, up to 2 minutes. Until it is connected again its waiters see
// nothing and its holders cannot renew, so a lock can sit free for seconds
// with a waiter in line, or be lost although etcd is back. For locks, give
// the client a short reconnection backoff (the fault harness uses this):
//
//	clientv3.Config{Endpoints: …, DialOptions: []grpc.DialOption{
//		grpc.WithConnectParams(grpc.ConnectParams{MinConnectTimeout: time.Second,
//			Backoff: backoff.Config{BaseDelay: 50 * time.Millisecond, Multiplier: 1.6, Jitter: 0.2, MaxDelay: 250 * time.Millisecond}}),
//	}}
package etcdlock

import (
	"context"
	"encoding/hex"
	"encoding/json"
	"errors"
	"fmt"
	"math"
	"sort"
	"strconv"
	"strings"
	"sync"
	"time"

	"github.com/dlock-dev/dlock"
	"go.etcd.io/etcd/api/v3/mvccpb"
	"go.etcd.io/etcd/api/v3/v3rpc/rpctypes"
	clientv3 "go.etcd.io/etcd/client/v3"
	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/status"
)

// DefaultPrefix is the key prefix used when Options.Prefix is empty.
const DefaultPrefix = "dlock/"

// Client is what a Backend needs of an etcd client: keys, leases and
// watches. *clientv3.Client satisfies it, as do the wrappers of the
// clientv3/namespace package (combined in a struct). The caller owns the
// client: the Backend never closes it.
type Client interface {
	clientv3.KV
	clientv3.Lease
	clientv3.Watcher
}

// Options configure a Backend. The zero value (or nil) means all defaults.
type Options struct {
	// Prefix starts every etcd key the Backend writes. Everything under it
	// belongs to the Backend: a foreign key inside a lock's directory would
	// be taken for a holder or a waiter. The default is DefaultPrefix.
	Prefix string

	// RequestTimeout bounds each request to etcd. A request without an
	// answer by then is abandoned and sent again (every request the
	// Backend makes can be repeated safely). This gets past a leader that
	// died with the request in flight, which etcd itself answers only
	// after its request timeout (5 s plus two election timeouts): keep it
	// well below a third of the shortest TTL in use, so that a renewal can
	// be repeated before the lease's deadline. The default is
	// DefaultRequestTimeout.
	RequestTimeout time.Duration
}

// DefaultRequestTimeout is the RequestTimeout used when Options leaves it
// zero.
const DefaultRequestTimeout = time.Second

// Backend is a dlock.Backend on one etcd cluster. It is safe for concurrent
// use.
type Backend struct {
	c       Client
	prefix  string
	timeout time.Duration // of one request

	mu      sync.Mutex
	parked  map[string][]*entry // waiting entries between two AcquireWait calls, by dlock key
	parkFor time.Duration       // how long a parked entry is kept for the next call
	closed  bool                // Close was called: clean-up runs in the caller
	done    chan struct{}       // closed by Close: ends the watches
	bg      sync.WaitGroup      // background revocations and watches; Add only under mu, before closed
}

var (
	_ dlock.Backend       = (*Backend)(nil)
	_ dlock.Lister        = (*Backend)(nil)
	_ dlock.ForceReleaser = (*Backend)(nil)
	_ dlock.Waiter        = (*Backend)(nil)
	_ dlock.Sharer        = (*Backend)(nil)
)

// New returns a Backend over c. It does no I/O. The error matches
// dlock.ErrInvalidOption for a nil client or a negative RequestTimeout.
func New(c Client, opts *Options) (*Backend, error) {
	if opts == nil {
		opts = &Options{}
	}
	if c == nil {
		return nil, fmt.Errorf("%w: etcdlock: nil client", dlock.ErrInvalidOption)
	}
	prefix := opts.Prefix
	if prefix == "" {
		prefix = DefaultPrefix
	}
	timeout := opts.RequestTimeout
	if timeout < 0 {
		return nil, fmt.Errorf("%w: etcdlock: negative request timeout %s", dlock.ErrInvalidOption, timeout)
	}
	if timeout == 0 {
		timeout = DefaultRequestTimeout
	}
	return &Backend{c: c, prefix: prefix, timeout: timeout, parked: make(map[string][]*entry), parkFor: parkTimeout, done: make(chan struct{})}, nil
}

// Escaping '/' keeps a key's directory from containing another key's; escaping
// '%' keeps the mapping one-to-one.
var (
	keyEscaper   = strings.NewReplacer("%", "%25", "/", "%2F")
	keyUnescaper = strings.NewReplacer("%2F", "/", "%25", "%")
)

// dir is the directory of key's entries, ending in '/'.
func (b *Backend) dir(key string) string { return b.prefix + keyEscaper.Replace(key) + "/" }

// name is the entry of key for lease id.
func (b *Backend) name(key string, id clientv3.LeaseID) string {
	return b.dir(key) + fmt.Sprintf("%016x", uint64(id))
}

// keyOf returns the dlock key of an entry's etcd key, and false for keys that
// are not entries.
func (b *Backend) keyOf(name string) (string, bool) { return EntryKey(b.prefix, name) }

// EntryKey returns the dlock key of an entry's etcd key under prefix (the
// Backend's Options.Prefix), and false for keys that are not entries. Tools
// that read the store's layout use it.
func EntryKey(prefix, name string) (string, bool) {
	rest, ok := strings.CutPrefix(name, prefix)
	if !ok {
		return "", false
	}
	esc, id, ok := strings.Cut(rest, "/")
	if !ok || esc == "" || len(id) != 16 {
		return "", false
	}
	if _, err := strconv.ParseUint(id, 16, 64); err != nil {
		return "", false
	}
	return keyUnescaper.Replace(esc), true
}

// record is the value of an entry.
type record struct {
	Token    string `json:"token"`
	Owner    string `json:"owner,omitempty"`
	Metadata string `json:"metadata,omitempty"`
	// Acquired is when the entry was written, by the client's clock, in
	// microseconds since the epoch (etcd keeps no time). For an entry that
	// waited it is when the last AcquireWait call took it over, at most a
	// third of the TTL before it got the lock.
	Acquired int64 `json:"acquired_us"`
	// Mode is "shared" or "limited"; empty for an exclusive entry.
	Mode string `json:"mode,omitempty"`
	// Limit is the key's holder limit of a limited entry.
	Limit int `json:"limit,omitempty"`
	// TTL is the lease TTL the entry was granted with, in whole seconds
	// (etcd may have raised it to its minimum); 0 in entries written by
	// older versions.
	TTL int64 `json:"ttl_s,omitempty"`
}

// mode returns the entry's mode. A mode this version does not know counts
// as exclusive: it keeps every other entry out.
func (r record) mode() dlock.Mode {
	switch r.Mode {
	case "shared":
		return dlock.ModeShared
	case "limited":
		return dlock.ModeLimited
	}
	return dlock.ModeExclusive
}

func encode(req dlock.Request) string {
	r := record{Token: req.Token.String(), Owner: req.Owner, Metadata: req.Metadata, Acquired: time.Now().UnixMicro(), TTL: ttlSeconds(req.TTL)}
	if req.Mode != dlock.ModeExclusive {
		r.Mode, r.Limit = req.Mode.String(), req.Limit
	}
	v, _ := json.Marshal(r)
	return string(v)
}

func decode(v []byte) record {
	var r record
	_ = json.Unmarshal(v, &r) // a foreign value reads as a record without token
	return r
}

// info describes the holder entry kv of key.
func info(key string, kv *mvccpb.KeyValue) dlock.LockInfo {
	r := decode(kv.Value)
	h := dlock.LockInfo{Key: key, Owner: r.Owner, Fence: uint64(kv.CreateRevision), Metadata: r.Metadata, Mode: r.mode()}
	if h.Mode == dlock.ModeLimited {
		h.Limit = r.Limit
	}
	if tok, err := hex.DecodeString(r.Token); err == nil && len(tok) == len(h.Token) {
		copy(h.Token[:], tok)
	}
	if r.Acquired > 0 {
		h.AcquiredAt = time.UnixMicro(r.Acquired)
	}
	return h
}

// ttlSeconds is the lease TTL for d: whole seconds, rounded up.
// maxLeaseTTL is etcd's largest lease TTL, in seconds (its lease package's
// MaxLeaseTTL): the server refuses longer ones.
const maxLeaseTTL = 9_000_000_000

func ttlSeconds(d time.Duration) int64 {
	return max(1, int64(math.Ceil(d.Seconds())))
}

// Operations are repeated after transient errors for about this long.
const (
	maxAttempts  = 8
	firstBackoff = 50 * time.Millisecond
	maxBackoff   = time.Second
)

// cleanupTimeout bounds the revocations the Backend makes on its own (of a
// waiter's entry when its wait ends, of a parked entry nobody took).
const cleanupTimeout = 5 * time.Second

// transient reports whether err says the request may not have reached a
// working cluster: the member is down or has no leader, or a leader change
// interrupted it. The Backend repeats only idempotent requests.
func transient(err error) bool {
	var u *unanswered
	if errors.As(err, &u) {
		return true
	}
	if err == nil || errors.Is(err, context.Canceled) || errors.Is(err, context.DeadlineExceeded) {
		return false
	}
	var ee rpctypes.EtcdError
	if errors.As(err, &ee) {
		return ee.Code() == codes.Unavailable
	}
	s, ok := status.FromError(err)
	return ok && (s.Code() == codes.Unavailable || s.Code() == codes.Internal)
}

// head returns the first-created entry of key's directory (the holder), or
// nil if the directory is empty, retrying transient failures.
func (b *Backend) head(ctx context.Context, key string) (*mvccpb.KeyValue, error) {
	var resp *clientv3.GetResponse
	err := b.retry(ctx, func(ctx context.Context) error {
		var err error
		resp, err = b.c.Get(ctx, b.dir(key), clientv3.WithFirstCreate()...)
		return err
	})
	if err != nil || len(resp.Kvs) == 0 {
		return nil, err
	}
	return resp.Kvs[0], nil
}

// retry runs op until it succeeds, fails with a non-transient error, ctx
// ends, or maxAttempts attempts were made. Each attempt has b.timeout: one
// that gets no answer in time is abandoned and repeated, so op must be
// idempotent.
func (b *Backend) retry(ctx context.Context, op func(ctx context.Context) error) error {
	wait := firstBackoff
	for attempt := 1; ; attempt++ {
		actx, cancel := context.WithTimeout(ctx, b.timeout)
		err := op(actx)
		cancel()
		if err != nil && ctx.Err() == nil && actx.Err() != nil {
			err = &unanswered{b.timeout, err}
		}
		if !transient(err) || attempt == maxAttempts {
			return err
		}
		t := time.NewTimer(wait)
		select {
		case <-t.C:
		case <-ctx.Done():
			t.Stop()
			return err
		}
		wait = min(2*wait, maxBackoff)
	}
}

// unanswered is the error of a request abandoned after the Backend's
// RequestTimeout.
type unanswered struct {
	timeout time.Duration
	err     error
}

func (u *unanswered) Error() string {
	return fmt.Sprintf("no answer within %s: %v", u.timeout, u.err)
}

func (u *unanswered) Unwrap() error { return u.err }

// grant creates a lease for ttl. A repeated Grant after a transient error may
// leave an unused lease behind; it expires on its own.
func (b *Backend) grant(ctx context.Context, ttl time.Duration) (clientv3.LeaseID, error) {
	if ttlSeconds(ttl) > maxLeaseTTL {
		return 0, fmt.Errorf("%w: etcdlock: ttl %s is above etcd's largest lease (%d s)", dlock.ErrInvalidOption, ttl, int64(maxLeaseTTL))
	}
	var id clientv3.LeaseID
	err := b.retry(ctx, func(ctx context.Context) error {
		resp, err := b.c.Grant(ctx, ttlSeconds(ttl))
		if err == nil {
			id = resp.ID
		}
		return err
	})
	return id, err
}

// revoke revokes lease id, deleting its entry. It reports false if the lease
// did not exist (any more). A lease found missing after an attempt whose
// outcome was unknown counts as revoked by that attempt.
func (b *Backend) revoke(ctx context.Context, id clientv3.LeaseID) (bool, error) {
	unknown := false
	err := b.retry(ctx, func(ctx context.Context) error {
		_, err := b.c.Revoke(ctx, id)
		unknown = unknown || transient(err)
		return err
	})
	if errors.Is(err, rpctypes.ErrLeaseNotFound) {
		return unknown, nil
	}
	return err == nil, err
}

// revokeLater revokes id with a context of its own: the caller's may have
// ended, which is why the entry must go. It waits for the revocation at most
// one request's timeout: against an unreachable member the revocation runs
// on in the background for up to cleanupTimeout (Close waits for it), and
// the caller (a waiter that gave up, whose deadline has passed) returns. If
// it fails, the lease expires with its TTL.
func (b *Backend) revokeLater(ctx context.Context, id clientv3.LeaseID) {
	ctx, cancel := context.WithTimeout(context.WithoutCancel(ctx), cleanupTimeout)
	b.mu.Lock()
	if b.closed {
		b.mu.Unlock()
		defer cancel()
		_, _ = b.revoke(ctx, id)
		return
	}
	b.bg.Add(1)
	b.mu.Unlock()
	done := make(chan struct{})
	go func() {
		defer b.bg.Done()
		defer close(done)
		defer cancel()
		_, _ = b.revoke(ctx, id)
	}()
	t := time.NewTimer(b.timeout)
	defer t.Stop()
	select {
	case <-done:
	case <-t.C:
	}
}

// Close removes the queue entries that waiters parked between two
// AcquireWait calls, closes the channels of every Watch, and waits for the
// Backend's clean-up in the background to end (revocations of entries that
// waiters left, each bounded by 5 s), so that no goroutine of the Backend
// outlives it. It does not close the
// client, and does not release held locks (the Locker's Close does): close
// the Locker first, then the Backend, then the client. It always returns
// nil.
func (b *Backend) Close() error {
	b.mu.Lock()
	var parked []*entry
	for _, es := range b.parked {
		for _, e := range es {
			e.timer.Stop()
			e.unwatch()
			parked = append(parked, e)
		}
	}
	clear(b.parked)
	if !b.closed {
		close(b.done)
	}
	b.closed = true
	b.mu.Unlock()
	for _, e := range parked {
		b.revokeLater(context.Background(), e.lease)
	}
	b.bg.Wait()
	return nil
}

// keepAlive renews lease id once. KeepAliveOnce repeats failures to reach a
// member itself, but returns the server's own transient errors (a request
// timed out during an election): those are repeated here.
func (b *Backend) keepAlive(ctx context.Context, id clientv3.LeaseID) error {
	return b.retry(ctx, func(ctx context.Context) error {
		_, err := b.c.KeepAliveOnce(ctx, id)
		return err
	})
}

// remaining asks etcd for the remaining time of lease id and returns an
// upper bound of it (etcd reports whole seconds); 0 if unknown.
func (b *Backend) remaining(ctx context.Context, id clientv3.LeaseID) time.Duration {
	ctx, cancel := context.WithTimeout(ctx, b.timeout)
	defer cancel()
	resp, err := b.c.TimeToLive(ctx, id)
	if err != nil || resp.TTL < 0 { // -1: expired or revoked
		return 0
	}
	// etcd truncates the remaining time to whole seconds (0: under a
	// second), so the lease ends within TTL+1 s, and never later than its
	// granted TTL: an upper bound, which is what a waiter's backoff needs.
	return time.Duration(min(resp.TTL+1, max(resp.GrantedTTL, 1))) * time.Second
}

// first returns the op reading the oldest entry of key: the holder.
func (b *Backend) first(key string) clientv3.Op {
	return clientv3.OpGet(b.dir(key), clientv3.WithFirstCreate()...)
}

// Acquire implements dlock.Backend. For an exclusive request it reads the
// head of the key's queue and, if the queue is empty (no holder, no
// waiter), grants a lease and writes the entry in a transaction that checks
// again that the directory is empty (and deletes the writer mark: an
// exclusive grant clears it). A held key thus costs reads only (the
// holder's entry and its remaining lease), not writes: waiters call Acquire
// before they queue. A request that finds the key held shared also leaves
// the writer mark (two writes); one that finds it limited is refused with
// dlock.ErrModeMismatch. Shared and limited requests are described at
// acquireShared.
func (b *Backend) Acquire(ctx context.Context, req dlock.Request) (dlock.Result, error) {
	if err := dlock.ValidateMode(req); err != nil {
		return dlock.Result{}, err
	}
	if req.Mode != dlock.ModeExclusive {
		return b.acquireShared(ctx, req)
	}
	head, err := b.head(ctx, req.Key)
	if err != nil {
		return dlock.Result{}, fmt.Errorf("etcdlock: acquire %q: %w", req.Key, err)
	}
	if head != nil {
		return b.heldExclusive(ctx, req, head)
	}
	id, err := b.grant(ctx, req.TTL)
	if err != nil {
		return dlock.Result{}, fmt.Errorf("etcdlock: acquire %q: grant: %w", req.Key, err)
	}
	name, dir := b.name(req.Key, id), b.dir(req.Key)
	var resp *clientv3.TxnResponse
	err = b.retry(ctx, func(ctx context.Context) error {
		// Repeating it is safe: if an earlier attempt wrote the entry, this
		// one reads it back as the holder.
		var err error
		resp, err = b.c.Txn(ctx).
			If(clientv3.Compare(clientv3.CreateRevision(dir), "=", 0).WithPrefix()).
			Then(clientv3.OpPut(name, encode(req), clientv3.WithLease(id)), clientv3.OpDelete(b.mark(req.Key))).
			Else(b.first(req.Key)).
			Commit()
		return err
	})
	if err != nil {
		return dlock.Result{}, fmt.Errorf("etcdlock: acquire %q: %w", req.Key, err)
	}
	if resp.Succeeded {
		return dlock.Result{Acquired: true, Fence: uint64(resp.Header.Revision)}, nil
	}
	kvs := resp.Responses[0].GetResponseRange().GetKvs()
	if len(kvs) == 0 {
		return dlock.Result{}, fmt.Errorf("etcdlock: acquire %q: directory neither empty nor holding an entry", req.Key)
	}
	if string(kvs[0].Key) == name {
		return dlock.Result{Acquired: true, Fence: uint64(kvs[0].CreateRevision)}, nil
	}
	// Taken since the first read.
	var wg sync.WaitGroup
	wg.Go(func() { _, _ = b.revoke(ctx, id) }) // unused: it would expire anyway
	res, err := b.heldExclusive(ctx, req, kvs[0])
	wg.Wait()
	return res, err
}

// held is the Result of an acquisition of key that found holder, with the
// holder's remaining lease.
func (b *Backend) held(ctx context.Context, key string, holder *mvccpb.KeyValue) dlock.Result {
	res := dlock.Result{Holder: info(key, holder)}
	if holder.Lease != 0 {
		res.Remaining = b.remaining(ctx, clientv3.LeaseID(holder.Lease))
		if res.Remaining > 0 {
			res.Holder.ExpiresAt = time.Now().Add(res.Remaining)
		}
	}
	return res
}

// Extend implements dlock.Backend. It reads the head entry of every key in
// one transaction per 64 leases and, for the leases not found there (the
// shared and limited holders behind the first one), every entry of their
// keys the same way; then it renews the lease of each entry that carries
// its token and holds the lock with KeepAliveOnce, concurrently. A lease
// that etcd no longer has (expired, revoked, or released by another client)
// is dlock.ErrNotHeld; etcd never revives an expired lease.
func (b *Backend) Extend(ctx context.Context, leases []dlock.Lease) ([]error, error) {
	ids := make([]clientv3.LeaseID, len(leases)) // 0: not held
	kvs := make([]*mvccpb.KeyValue, len(leases)) // the holding entries
	var behind []int                             // leases whose key's head carries another token
	err := b.readEach(ctx, leases, nil, b.first, func(i int, found []*mvccpb.KeyValue) {
		switch {
		case len(found) == 0:
		case decode(found[0].Value).Token == leases[i].Token.String():
			ids[i], kvs[i] = clientv3.LeaseID(found[0].Lease), found[0]
		default:
			behind = append(behind, i)
		}
	})
	if err == nil && len(behind) > 0 {
		err = b.readEach(ctx, leases, behind, b.all, func(i int, found []*mvccpb.KeyValue) {
			q := items(found)
			held := holders(q)
			for j := range q {
				if q[j].rec.Token == leases[i].Token.String() && held[j] {
					ids[i], kvs[i] = clientv3.LeaseID(q[j].kv.Lease), q[j].kv
				}
			}
		})
	}
	if err != nil {
		return nil, fmt.Errorf("etcdlock: extend: %w", err)
	}
	errs := make([]error, len(leases))
	sem := make(chan struct{}, 32)
	var wg sync.WaitGroup
	for i, l := range leases {
		if ids[i] == 0 {
			errs[i] = dlock.ErrNotHeld
			continue
		}
		sem <- struct{}{}
		wg.Go(func() {
			defer func() { <-sem }()
			var err error
			if r := decode(kvs[i].Value); r.TTL > 0 && ttlSeconds(l.TTL) != r.TTL {
				err = b.moveLease(ctx, kvs[i], r, l.TTL)
			} else {
				err = b.keepAlive(ctx, ids[i])
			}
			switch {
			case errors.Is(err, rpctypes.ErrLeaseNotFound):
				errs[i] = dlock.ErrNotHeld
			case err != nil:
				errs[i] = fmt.Errorf("etcdlock: extend %q: %w", l.Key, err)
			}
		})
	}
	wg.Wait()
	return errs, nil
}

// moveLease puts the holding entry kv, whose record is r, on a new lease of
// ttl (other than the one it was granted with: etcd renews a lease only to
// its granted TTL) and revokes its old lease. The entry keeps its key and create
// revision, so it keeps its place and fence. It returns ErrNotHeld (and
// revokes the new lease) if the entry is gone or carries another token; if
// the outcome of the move is unknown, the new lease is left to expire, with
// the entry on it or alone.
func (b *Backend) moveLease(ctx context.Context, kv *mvccpb.KeyValue, r record, ttl time.Duration) error {
	id, err := b.grant(ctx, ttl)
	if err != nil {
		return err
	}
	name, token := string(kv.Key), r.Token
	for range maxChecks {
		r.TTL = ttlSeconds(ttl)
		v, _ := json.Marshal(r)
		resp, err := b.c.Txn(ctx).
			If(clientv3.Compare(clientv3.ModRevision(name), "=", kv.ModRevision)).
			Then(clientv3.OpPut(name, string(v), clientv3.WithLease(id))).
			Else(clientv3.OpGet(name)).
			Commit()
		if err != nil {
			return err
		}
		if resp.Succeeded {
			// The old lease holds nothing now; left alone it would
			// expire anyway.
			_, _ = b.revoke(ctx, clientv3.LeaseID(kv.Lease))
			return nil
		}
		// Changed since it was read (a metadata change), or gone. The same
		// entry with the same token still holds the lock.
		kvs := resp.Responses[0].GetResponseRange().GetKvs()
		if len(kvs) == 0 || kvs[0].CreateRevision != kv.CreateRevision || decode(kvs[0].Value).Token != token {
			_, _ = b.revoke(ctx, id)
			return dlock.ErrNotHeld
		}
		kv, r = kvs[0], decode(kvs[0].Value)
	}
	_, _ = b.revoke(ctx, id)
	return fmt.Errorf("etcdlock: entry %s changes too often", name)
}

// readEach reads op(key) for the leases at the indexes in which (every
// lease if which is nil), in one transaction per 64, and calls found with
// each lease's index and the keys read.
func (b *Backend) readEach(ctx context.Context, leases []dlock.Lease, which []int, op func(key string) clientv3.Op, found func(i int, kvs []*mvccpb.KeyValue)) error {
	const perTxn = 64 // below etcd's default --max-txn-ops of 128
	if which == nil {
		which = make([]int, len(leases))
		for i := range which {
			which[i] = i
		}
	}
	for lo := 0; lo < len(which); lo += perTxn {
		chunk := which[lo:min(lo+perTxn, len(which))]
		ops := make([]clientv3.Op, 0, len(chunk))
		for _, i := range chunk {
			ops = append(ops, op(leases[i].Key))
		}
		var resp *clientv3.TxnResponse
		err := b.retry(ctx, func(ctx context.Context) error {
			var err error
			resp, err = b.c.Txn(ctx).Then(ops...).Commit()
			return err
		})
		if err != nil {
			return err
		}
		for j, r := range resp.Responses {
			found(chunk[j], r.GetResponseRange().GetKvs())
		}
	}
	return nil
}

// Release implements dlock.Backend: it revokes the lease of the entry that
// carries token if that entry holds the lock, which deletes the entry and
// wakes the waiters it kept waiting. If the entry only waits (an
// acquisition whose outcome was unknown), it is removed too, and the result
// is still dlock.ErrNotHeld. The head entry is read first; the key's other
// entries only if the head carries another token. A lease past its TTL
// that the leader has not revoked yet (up to 500 ms) still counts as held.
func (b *Backend) Release(ctx context.Context, key string, token dlock.Token) error {
	h, err := b.head(ctx, key)
	if err != nil {
		return fmt.Errorf("etcdlock: release %q: %w", key, err)
	}
	if h == nil {
		return dlock.ErrNotHeld
	}
	tok := token.String()
	if decode(h.Value).Token == tok {
		ok, err := b.remove(ctx, h)
		if err != nil {
			return fmt.Errorf("etcdlock: release %q: %w", key, err)
		}
		if !ok {
			return dlock.ErrNotHeld
		}
		return nil
	}
	q, err := b.queue(ctx, key)
	if err != nil {
		return fmt.Errorf("etcdlock: release %q: %w", key, err)
	}
	held := holders(q)
	released := false
	for i, it := range q {
		if it.rec.Token != tok {
			continue
		}
		ok, err := b.remove(ctx, it.kv)
		if err != nil {
			return fmt.Errorf("etcdlock: release %q: %w", key, err)
		}
		released = released || ok && held[i]
	}
	if !released {
		return dlock.ErrNotHeld
	}
	return nil
}

// remove deletes the entry kv: by revoking its lease (which deletes it with
// the lease), or, for a key without lease, by deleting it if it has not
// changed. It reports false if the entry was already gone.
func (b *Backend) remove(ctx context.Context, kv *mvccpb.KeyValue) (bool, error) {
	if kv.Lease != 0 {
		return b.revoke(ctx, clientv3.LeaseID(kv.Lease))
	}
	var resp *clientv3.TxnResponse
	err := b.retry(ctx, func(ctx context.Context) error {
		var err error
		resp, err = b.c.Txn(ctx).
			If(clientv3.Compare(clientv3.ModRevision(string(kv.Key)), "=", kv.ModRevision)).
			Then(clientv3.OpDelete(string(kv.Key))).
			Commit()
		return err
	})
	return err == nil && resp.Succeeded, err
}

// ForceRelease implements dlock.ForceReleaser: it revokes the leases of
// every entry that holds the lock (one exclusive holder, or every shared or
// limited one), which hands the key to the waiters next in line. The old
// holders learn of the loss at their next renewal.
func (b *Backend) ForceRelease(ctx context.Context, key string) error {
	q, err := b.queue(ctx, key)
	if err != nil {
		return fmt.Errorf("etcdlock: force release %q: %w", key, err)
	}
	var mu sync.Mutex
	var errs []error
	released := false
	held := holders(q)
	sem := make(chan struct{}, 16)
	var wg sync.WaitGroup
	for i := range q {
		if !held[i] {
			continue
		}
		sem <- struct{}{}
		wg.Go(func() {
			defer func() { <-sem }()
			ok, err := b.remove(ctx, q[i].kv)
			mu.Lock()
			defer mu.Unlock()
			released = released || ok
			if err != nil {
				errs = append(errs, err)
			}
		})
	}
	wg.Wait()
	if len(errs) > 0 {
		return fmt.Errorf("etcdlock: force release %q: %w", key, dlock.Join(errs...))
	}
	if !released {
		return dlock.ErrNotHeld
	}
	return nil
}

// List implements dlock.Lister. It reads every entry under the prefix (in
// pages of 1,000), keeps those that hold their key (one exclusive holder,
// or every shared or limited one), ordered by key and fence, and asks for
// the remaining time of their leases (to the second: ExpiresAt is zero in a
// lease's last second). It costs one request per holder, for operators
// rather than hot paths.
func (b *Backend) List(ctx context.Context, prefix string) ([]dlock.LockInfo, error) {
	entries, err := b.entries(ctx, prefix)
	if err != nil {
		return nil, fmt.Errorf("etcdlock: list: %w", err)
	}
	type holder struct {
		info dlock.LockInfo
		id   clientv3.LeaseID
	}
	var hs []holder
	for k, kvs := range entries {
		q := items(kvs)
		for i, held := range holders(q) {
			if held {
				hs = append(hs, holder{info(k, q[i].kv), clientv3.LeaseID(q[i].kv.Lease)})
			}
		}
	}
	sort.Slice(hs, func(i, j int) bool {
		if hs[i].info.Key != hs[j].info.Key {
			return hs[i].info.Key < hs[j].info.Key
		}
		return hs[i].info.Fence < hs[j].info.Fence
	})
	out := make([]dlock.LockInfo, len(hs))
	sem := make(chan struct{}, 16)
	var wg sync.WaitGroup
	for i, h := range hs {
		out[i] = h.info
		if h.id == 0 {
			continue
		}
		sem <- struct{}{}
		wg.Go(func() {
			defer func() { <-sem }()
			if d := b.remaining(ctx, h.id); d > 0 {
				out[i].ExpiresAt = time.Now().Add(d)
			}
		})
	}
	wg.Wait()
	return out, nil
}

// entries reads every entry under the prefix whose key starts with prefix,
// in pages of 1,000, by key.
func (b *Backend) entries(ctx context.Context, prefix string) (map[string][]*mvccpb.KeyValue, error) {
	from := b.prefix + keyEscaper.Replace(prefix)
	end := clientv3.GetPrefixRangeEnd(from)
	entries := map[string][]*mvccpb.KeyValue{}
	for range 1_000_000 { // bounded: each page moves past 1,000 keys
		var resp *clientv3.GetResponse
		err := b.retry(ctx, func(ctx context.Context) error {
			var err error
			resp, err = b.c.Get(ctx, from, clientv3.WithRange(end), clientv3.WithLimit(1000))
			return err
		})
		if err != nil {
			return nil, err
		}
		for _, kv := range resp.Kvs {
			if k, ok := b.keyOf(string(kv.Key)); ok && strings.HasPrefix(k, prefix) {
				entries[k] = append(entries[k], kv)
			}
		}
		if !resp.More || len(resp.Kvs) == 0 {
			break
		}
		from = string(resp.Kvs[len(resp.Kvs)-1].Key) + "\x00"
	}
	return entries, nil
}

var _ dlock.WaiterLister = (*Backend)(nil)

// ListWaiters implements dlock.WaiterLister: the queue entries that do not
// hold their key, in queue order (the order they will be served), with
// Since the time the entry was written. An entry stays queued between two
// AcquireWait calls of one acquisition, so a Locker's waiter shows for its
// whole wait; a TryAcquire never queues.
func (b *Backend) ListWaiters(ctx context.Context, prefix string) ([]dlock.WaiterInfo, error) {
	entries, err := b.entries(ctx, prefix)
	if err != nil {
		return nil, fmt.Errorf("etcdlock: list waiters: %w", err)
	}
	keys := make([]string, 0, len(entries))
	for k := range entries {
		keys = append(keys, k)
	}
	sort.Strings(keys)
	var out []dlock.WaiterInfo
	for _, k := range keys {
		q := items(entries[k])
		for i, held := range holders(q) {
			if held {
				continue
			}
			h := info(k, q[i].kv)
			out = append(out, dlock.WaiterInfo{Key: k, Owner: h.Owner, Token: h.Token, Metadata: h.Metadata,
				Mode: h.Mode, Limit: h.Limit, Since: h.AcquiredAt})
		}
	}
	return out, nil
}
