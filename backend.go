package dlock

import (
	"context"
	"crypto/rand"
	"encoding/hex"
	"fmt"
	mrand "math/rand/v2"
	"sync"
	"time"
)

// This file is the implementer's side of dlock: the Backend contract, its
// optional capabilities, the limits every backend accepts, and helpers
// meant for backends.

// Backend is the interface a lock store implements. Users do not call it:
// they hand it to New and use the Locker. The Locker owns everything that must
// behave the same on every store (validation, owner tokens, reentrancy,
// renewal, loss notification, waiting); a Backend only performs the atomic
// operations below.
//
// Contract:
//
//   - All methods are safe for concurrent use and honour ctx.
//   - Time is the store's: a lease granted with TTL d expires d after the
//     store applied the acquisition (or the last extension), by the store's
//     clock. A Backend never sends the client's wall-clock time.
//   - Acquire takes req.Key for req.Token if the key is free or its lease has
//     expired, and reports Acquired=false (with what it knows of the holder)
//     otherwise. A key held by another token is never taken before its lease
//     expires. On success Fence is a number strictly greater than every Fence
//     ever returned for that key, across releases, expiries and restarts.
//   - Extend renews each lease for its TTL if it is still held by its token and
//     has not expired, and reports ErrNotHeld in that lease's slot otherwise.
//     An expired lease is never revived. A non-nil second result means the
//     outcome of the whole call is unknown.
//   - Release frees the key if it is held by token, and returns ErrNotHeld
//     (changing nothing) if it is not.
//   - When a call returns an error other than ErrNotHeld, the Locker treats
//     its outcome as unknown and resolves it (for Acquire, by releasing the
//     token it sent).
//
// # Implementing a Backend
//
// Keep the Backend small and atomic: validation, owner tokens, reentrancy,
// renewal scheduling, safe deadlines and waiting policy belong to the
// Locker. Run the conformance suite (package locktest) against the real
// store from the backend's tests; it is the definition of done. Statements
// on a connection or session that holds other locks must never be bounded
// by one caller's context: honour the caller's deadline outside the
// statement and keep the session. Report a lost session's leases through
// LossReporter. Use Join for errors that combine several.
//
// Optional capabilities are separate interfaces found by type assertion:
// Lister, ForceReleaser, Waiter, DirectWaiter, LossReporter, Sharer, Watcher,
// HolderWatcher, MetadataSetter, SessionBound, LockDelayer, TTLExtender,
// HoldKeeper, BatchExtender.
type Backend interface {
	Acquire(ctx context.Context, req Request) (Result, error)
	Extend(ctx context.Context, leases []Lease) ([]error, error)
	Release(ctx context.Context, key string, token Token) error
}

// Lister is implemented by backends that can list current holders.
type Lister interface {
	// List returns the unexpired locks whose key starts with prefix, ordered
	// by key.
	List(ctx context.Context, prefix string) ([]LockInfo, error)
}

// WaiterLister is implemented by backends whose store records the
// acquisitions waiting for a key (a queue entry, a statement blocked in the
// server), so that an operator can tell who waits. A store that cannot tell
// does not implement it, and a backend that wraps another, or that cannot
// tell as it is configured, returns ErrUnsupported: an empty list always
// means that nobody waits in the store.
type WaiterLister interface {
	// ListWaiters returns the acquisitions waiting in the store for a key
	// that starts with prefix, ordered by key, then in the order they will
	// be served where the store has one (else by arrival). A waiter shows
	// from the moment the store records its wait until it takes the key or
	// gives up. Acquisitions that wait by retrying after a backoff (on a
	// backend that is not a Waiter, or a wait the backend does not record)
	// are not in the store and do not show.
	ListWaiters(ctx context.Context, prefix string) ([]WaiterInfo, error)
}

// WaiterInfo describes an acquisition waiting for a key. Fields the store
// does not record are zero.
type WaiterInfo struct {
	Key      string
	Owner    string // explicit owner identity ("" if none was given)
	Token    Token  // the waiter's random owner token
	Metadata string
	Mode     Mode // the mode it asks for
	Limit    int  // the key's holder limit it asks for, for ModeLimited
	// Since is when the store recorded the wait (the current statement's
	// start, for a statement blocked in the server), converted to the
	// local clock.
	Since time.Time
	// Client is the store's own name for the waiting client (a server
	// connection id and address) where the store records no token.
	Client string
}

// KeyLister is implemented by backends whose store keeps a key's record
// after its release or expiry (a lease row), so that an operator can tell
// when a free key was last held, by whom, and with which fence. A store
// that forgets a key on release does not implement it, and a backend that
// wraps another returns ErrUnsupported when the wrapped one cannot.
type KeyLister interface {
	// ListKeys returns every key that starts with prefix of which the store
	// keeps a record, held or free, ordered by key.
	ListKeys(ctx context.Context, prefix string) ([]KeyInfo, error)
}

// KeyInfo describes a key the store keeps a record of.
type KeyInfo struct {
	Key string
	// Fence is the last fence granted for Key (0 if none was ever).
	Fence uint64
	// Holders are Key's unexpired holders, as Lister reports them; none when
	// Key is free.
	Holders []LockInfo
	// Last is the holder whose lease ended last, when Key is free and the
	// store remembers it: its Owner, Metadata, Fence, AcquiredAt and Mode
	// (Token and ExpiresAt may be zero). It is nil while Key is held.
	Last *LockInfo
	// FreedAt is when the last lease ended, by release or by expiry,
	// converted to the local clock; zero while Key is held or if the store
	// does not know.
	FreedAt time.Time
	// Expired reports that the last lease ran out (or its session ended)
	// rather than being released.
	Expired bool
}

// ForceReleaser is implemented by backends that can free a key whatever
// token holds it (for administrators). It returns ErrNotHeld if the key was
// not held.
type ForceReleaser interface {
	ForceRelease(ctx context.Context, key string) error
}

// Waiter is implemented by backends that can wait in the store for a held
// key to be released (a server-side blocking wait, a pub/sub wake-up), so
// that a waiter is handed the key at once instead of sleeping a backoff.
type Waiter interface {
	// AcquireWait is Acquire that, while the key is held, waits until it is
	// released or its lease expires, then takes it. It may return
	// Acquired=false with a nil error before that (when ctx ends, or after a
	// bound of its own choosing); the Locker then checks ctx and calls it
	// again. An error means the outcome is unknown, as for Acquire, except
	// ErrUnsupported: the backend cannot wait here (it took nothing) and the
	// Locker falls back to its backoff for this acquisition.
	AcquireWait(ctx context.Context, req Request) (Result, error)
}

// DirectWaiter is implemented by Waiters whose AcquireWait costs an
// acquisition of a free key no more than Acquire does (it attempts before
// it prepares a wait, or its preparation is already in place). When
// WaitsDirectly reports true, the Locker makes AcquireWait the first store
// call of a blocking acquisition instead of an Acquire followed by
// AcquireWait, unless WithOnWait needs the holder of a first refusal. A
// wrapper of another Backend reports what the wrapped one does.
type DirectWaiter interface {
	Waiter
	WaitsDirectly() bool
}

// Watcher is implemented by backends whose store can notify a change of a
// key's holders: an Election's observers are then woken by the store
// instead of looking again after a backoff.
type Watcher interface {
	// Watch starts watching key and returns a channel that receives after
	// every change of the key's holders that the store applies after Watch
	// returns: a grant, a release, a metadata change (MetadataSetter), and
	// an expiry or ended session where the store itself notices one (a
	// store that never notices expiries needs not report them: the caller
	// also looks again at the holder's ExpiresAt). The channel is buffered:
	// changes that come faster than they are read merge into one receive,
	// and a receive may come without a change. The channel is closed when
	// ctx ends or when the watch can no longer see every change (a broken
	// connection): the caller then lists the key again and watches anew.
	// Watch must not block longer than ctx allows. A backend that wraps
	// another may return ErrUnsupported when the wrapped one cannot watch:
	// the caller then looks again after a backoff.
	Watch(ctx context.Context, key string) (<-chan struct{}, error)
}

// HolderWatcher is implemented by backends whose store delivers every
// change of a key in the order it applied them, from a known point, so
// that the holders after each change can be told: an Election's observers
// then see every term, however short, and every value a leader published.
type HolderWatcher interface {
	// WatchHolders returns the holders of key now, as Lister.List reports
	// them, and a channel that receives the holders again after each later
	// change of them the store applies (a grant, a release, a metadata
	// change, an expiry the store notices), one receive per change, in the
	// store's order, none merged or left out. ExpiresAt may be zero where
	// the store reports ends itself. The channel is closed when ctx ends or
	// when the watch may have missed a change (a broken watch, a reader too
	// far behind): the caller then watches anew. WatchHolders must not
	// block longer than ctx allows. A backend that wraps another returns
	// ErrUnsupported when the wrapped one cannot do it.
	WatchHolders(ctx context.Context, key string) ([]LockInfo, <-chan []LockInfo, error)
}

// MetadataSetter is implemented by backends that can change the metadata of
// a held lease (what Lister shows and an Election's observers read as the
// leader's value).
type MetadataSetter interface {
	// SetMetadata replaces the metadata of key's lease held by token, if
	// that lease is still held and unexpired, and returns ErrNotHeld
	// (changing nothing) otherwise. metadata is validated by the caller
	// (at most MaxMetadataLen bytes of UTF-8 without NUL). A watch of key
	// (Watcher) sees the change. An error other than ErrNotHeld means the
	// outcome is unknown.
	SetMetadata(ctx context.Context, key string, token Token, metadata string) error
}

// TTLExtender is implemented by backends whose Extend sets a lease to the
// TTL it is given, longer or shorter than before, by the store's clock, and
// whose leases outlive the client's process. Only they can keep a minimum
// hold (WithMinHold) in a lease; a session lock keeps it in its key's row
// (HoldKeeper); elsewhere (a ZooKeeper node ends with its session and has
// no timer on the server's clock) the Locker refuses it with
// ErrUnsupported.
type TTLExtender interface {
	ExtendsToAnyTTL()
}

// BatchExtender is implemented by backends that set how many leases one
// Extend call may carry. The Locker renews the leases that fall due
// together in calls of at most ExtendBatch leases (1,000 when the backend
// is not a BatchExtender or reports less than 1); calls of one instant run
// side by side, each on a connection of its own. A backend that renews any
// number of leases in one round trip reports a large limit, so that many
// held locks are renewed on one connection; one with a bound on a
// request's size reports what fits.
type BatchExtender interface {
	ExtendBatch() int
}

// HoldKeeper is implemented by backends that keep a minimum hold
// (WithMinHold) themselves although they are not TTLExtenders: the
// SessionBound ones that record each grant in a row of its key, where a
// hold after the release is kept as a lock-delay is (LockDelayer). The
// Locker uses it for exclusive locks only.
type HoldKeeper interface {
	// ReleaseKeeping frees key's exclusive lock held by token, as Release
	// does, and keeps the key from every acquisition for keep from the
	// release, by the store's clock: an acquisition meanwhile is refused
	// as a lock-delay refuses it (Acquired=false, Remaining set, nothing
	// changed; AcquireWait waits it out). It returns ErrNotHeld if token
	// does not hold key, and ErrUnsupported for a lock of another mode or
	// from a wrapper whose backend is not a HoldKeeper (the Locker then
	// extends the lease to keep, as for a TTLExtender). After any other
	// error the lock is not left held: the key is then free at once.
	ReleaseKeeping(ctx context.Context, key string, token Token, keep time.Duration) error
}

// SessionBound is implemented by backends whose locks live in a server
// session and end with it (a named lock, a row lock in an open transaction,
// an advisory lock) rather than at a lease's expiry: the server frees them
// the moment it sees the session end, so a lease's TTL cannot keep a
// lock-delay (WithLockDelay) for them. Unless they keep it themselves
// (LockDelayer), the Locker refuses a lock-delay with ErrUnsupported.
type SessionBound interface {
	SessionBound()
}

// LockDelayer is implemented by backends that keep a lock-delay
// (Request.LockDelay) themselves rather than in a lease's TTL: the
// SessionBound ones, whose server frees a lock when its session ends.
//
// Contract, in addition to Backend's:
//
//   - A lock granted with LockDelay d that ends without a release (its
//     session ended, or Abandon) keeps its key from every acquisition for
//     d, by the store's clock, from an instant no earlier than the end. A
//     release (Release) frees it at once.
//   - The session's own timeout (how long the server keeps a silent holder)
//     is the holder's TTL, Request.TTL − Request.LockDelay: the delay
//     follows the session's end rather than lengthen it.
//   - An acquisition refused by a lock-delay takes nothing, does not change
//     the fence, and reports Acquired=false with Remaining set to what is
//     left of the delay. AcquireWait waits for it (within ctx) before it
//     returns Acquired=false, so that the Locker's next call can succeed.
type LockDelayer interface {
	// Abandon ends key's lock held by token as a lock lost without a
	// release: the store frees it and keeps the key from others for the
	// grant's lock-delay, from now by the store's clock. The Locker calls
	// it when it reported a lease with a lock-delay lost while the store
	// may still hold it (its renewals were not confirmed in time). It
	// returns ErrNotHeld if token no longer holds key, and ErrUnsupported
	// from a wrapper whose backend is not a LockDelayer (the Locker then
	// leaves the lease to the store, as for any lease).
	Abandon(ctx context.Context, key string, token Token) error
}

// LossReporter is implemented by backends that can learn by themselves that
// the store no longer holds a lease for them, before its next Extend: a
// session strategy whose session ended (the server then freed every lock of
// that session at once). Reporting such a loss at once closes the window in
// which a holder would go on trusting a lock that another client may already
// hold.
type LossReporter interface {
	// OnLoss registers f and returns a function that unregisters it. The
	// backend calls f, from any goroutine and without holding locks that f
	// could need, once for each lease it knows it lost, with the reason.
	// f must not block. Reporting a token the caller does not hold, or
	// reporting one twice, is harmless.
	OnLoss(f func(key string, token Token, cause error)) (stop func())
}

// LossHandlers is a set of functions registered through LossReporter.OnLoss:
// a helper for backends. The zero value is ready to use; it is safe for
// concurrent use.
type LossHandlers struct {
	mu   sync.Mutex
	next int
	fs   map[int]func(key string, token Token, cause error)
}

// Add registers f and returns the function that removes it.
func (h *LossHandlers) Add(f func(key string, token Token, cause error)) (stop func()) {
	h.mu.Lock()
	defer h.mu.Unlock()
	if h.fs == nil {
		h.fs = make(map[int]func(string, Token, error))
	}
	id := h.next
	h.next++
	h.fs[id] = f
	return func() {
		h.mu.Lock()
		defer h.mu.Unlock()
		delete(h.fs, id)
	}
}

// Report calls every registered function with the lost lease.
func (h *LossHandlers) Report(key string, token Token, cause error) {
	h.mu.Lock()
	fs := make([]func(string, Token, error), 0, len(h.fs))
	for _, f := range h.fs {
		fs = append(fs, f)
	}
	h.mu.Unlock()
	for _, f := range fs {
		f(key, token, cause)
	}
}

// Request is one acquisition attempt handed to Backend.Acquire.
type Request struct {
	Key   string // validated: 1..MaxKeyLen bytes of UTF-8, no NUL
	Token Token  // random, unique to this acquisition
	Owner string // the explicit owner identity, or ""
	// TTL is the lease the store keeps, at least MinTTL: the holder's TTL
	// plus LockDelay, so that a store whose leases outlive their holder
	// keeps the lock-delay without knowing of it.
	TTL time.Duration
	// LockDelay is the acquisition's lock-delay (WithLockDelay), already
	// counted in TTL; 0 for none. Only a LockDelayer reads it: the Locker
	// sends a lock-delay to a SessionBound backend only if it is one.
	LockDelay time.Duration
	Metadata  string // at most MaxMetadataLen bytes
	// Mode is how the acquisition shares the key. The Locker sends a mode
	// other than ModeExclusive only to a backend whose Sharer says it grants it.
	Mode Mode
	// Limit is the key's holder limit for ModeLimited (1..MaxLimit), and 0
	// otherwise.
	Limit int
	// NoHolder tells Acquire that a refusal's Holder and Remaining go
	// unread: the Locker waits in the store next (Waiter.AcquireWait). A
	// backend may then leave them zero rather than spend a round trip on
	// them. It changes nothing else.
	NoHolder bool
}

// Mode is how an acquisition shares its key with other holders.
type Mode uint8

const (
	// ModeExclusive is one holder at a time: the default of every acquisition.
	ModeExclusive Mode = iota
	// ModeShared is any number of shared holders at once, never together with
	// an Exclusive holder: the read side of a reader-writer lock, whose
	// write side is the plain Exclusive acquisition of the same key.
	ModeShared
	// ModeLimited is at most Request.Limit holders at once: a counting
	// semaphore. Every holder of the key uses the same limit.
	ModeLimited
)

// String returns "exclusive", "shared" or "limited".
func (m Mode) String() string {
	switch m {
	case ModeExclusive:
		return "exclusive"
	case ModeShared:
		return "shared"
	case ModeLimited:
		return "limited"
	}
	return fmt.Sprintf("mode(%d)", uint8(m))
}

// ValidateMode reports whether req's Mode and Limit go together: a mode
// this package defines, a Limit of 1 to MaxLimit with ModeLimited, and 0
// with any other mode. The error wraps ErrInvalidOption. The Locker never
// sends anything else; backends call it before any I/O, as a guard.
func ValidateMode(req Request) error {
	switch {
	case req.Mode > ModeLimited:
		return fmt.Errorf("%w: unknown %s", ErrInvalidOption, req.Mode)
	case req.Mode == ModeLimited && (req.Limit < 1 || req.Limit > MaxLimit):
		return fmt.Errorf("%w: limit %d is outside 1..%d", ErrInvalidOption, req.Limit, MaxLimit)
	case req.Mode != ModeLimited && req.Limit != 0:
		return fmt.Errorf("%w: a limit (%d) with a %s request", ErrInvalidOption, req.Limit, req.Mode)
	}
	return nil
}

// DescribeMode names a mode for messages: "exclusive", "shared", or
// "limited to n" for ModeLimited with limit n.
func DescribeMode(m Mode, limit int) string {
	if m == ModeLimited {
		return fmt.Sprintf("limited to %d", limit)
	}
	return m.String()
}

// Sharer is implemented by backends that grant acquisitions in modes other
// than Exclusive. The Locker asks before any I/O and refuses a mode the
// backend does not grant with ErrUnsupported.
//
// Contract, in addition to Backend's:
//
//   - Every holder of a key, in any mode, has its own token, lease and
//     fence; fences are strictly increasing per key across all modes.
//   - An exclusive request is granted only when the key has no unexpired
//     holder of any mode. A shared request is granted when the key has no
//     unexpired exclusive holder and no exclusive acquisition waits for it:
//     an exclusive attempt that finds shared holders leaves a writer mark
//     lasting WriterMark (each attempt renews it; an exclusive grant clears
//     it) that refuses new shared requests, so that a stream of readers
//     cannot starve a writer, and a writer that gives up holds readers back
//     for at most WriterMark. A backend's AcquireWait keeps new shared
//     requests out while the writer waits in it (by renewing the mark, or
//     by the writer's own place in a queue).
//   - A limited request is granted when the key has fewer than Limit
//     unexpired holders. A limited request for a key held with another
//     limit or in another mode (and an exclusive or shared request for a
//     key held limited) changes nothing and returns an error wrapping
//     ErrModeMismatch.
//   - Extend and Release name one holder by its token, as for Exclusive.
type Sharer interface {
	SupportsMode(m Mode) bool
}

// Result is the outcome of Backend.Acquire.
type Result struct {
	// Acquired reports whether the lock is now held by the request's token.
	Acquired bool
	// Fence is the fence of the new lease, when Acquired.
	Fence uint64
	// Holder describes the current holder when not Acquired, as far as the
	// backend knows (zero fields when it could not tell).
	Holder LockInfo
	// Remaining is the holder's remaining lease by the store's clock when not
	// Acquired; 0 if unknown. Waiters never sleep longer than this.
	Remaining time.Duration
	// SentAfter may be set by Acquire or Waiter.AcquireWait when Acquired:
	// how long after the call began the backend sent the request whose
	// success started the lease (the acquisition statement after a wake-up
	// or after a wait for the store's write lock, or the statement that
	// recorded a grant made by a server-side wait; for a grant the store
	// made to a queued wait with no request of the waiter, such as a
	// release's handoff, a request of the wait that the store answered
	// before it made the grant). The Locker times the lease from then, so
	// that a long wait does not use up the lease before it starts. Never
	// report a later instant than that request's sending: the Locker would
	// trust the lease too long. In particular a session backend must not
	// time a lease from the arrival of a server-side wait's reply: a pause
	// or a partition can delay that reply without bound while the server
	// ends the session and grants the key again; it times the lease from a
	// statement sent after the reply that confirms the lock is still held.
	// 0 means the call's start, which is always safe. A negative value
	// times the lease from before the call began: a grant the store made
	// to a queued wait whose lease had less than the TTL left when the
	// wait's request was sent reports that request's sending minus the
	// part of the lease already gone.
	SentAfter time.Duration
}

// Lease names a held lease for Backend.Extend.
type Lease struct {
	Key   string
	Token Token
	TTL   time.Duration
}

// LockInfo describes a held lock.
type LockInfo struct {
	Key        string
	Owner      string // explicit owner identity ("" if none was given)
	Token      Token  // the holder's random owner token
	Fence      uint64 // fence of the holder's acquisition
	AcquiredAt time.Time
	ExpiresAt  time.Time // expiry of the current lease, converted to the local clock
	Metadata   string
	Mode       Mode // how the holder shares the key
	Limit      int  // the key's holder limit, for ModeLimited
}

// Token is the random 128-bit owner token of one acquisition. Only the holder
// of a token can extend or release the lease taken with it.
type Token [16]byte

// NewToken returns a token from crypto/rand.
func NewToken() Token {
	var t Token
	_, _ = rand.Read(t[:]) // crypto/rand.Read never fails (it aborts the program instead)
	return t
}

// String returns the token in hex.
func (t Token) String() string { return hex.EncodeToString(t[:]) }

// Limits and defaults.
const (
	// MaxKeyLen is the longest key, in bytes.
	MaxKeyLen = 255
	// MaxOwnerLen is the longest owner identity, in bytes.
	MaxOwnerLen = 255
	// MaxMetadataLen is the longest metadata string, in bytes.
	MaxMetadataLen = 1024
	// MinTTL is the shortest lease accepted. Shorter leases leave too little
	// time to renew over a real network.
	MinTTL = time.Second
	// MaxTTL is the longest lease, lock-delay and minimum hold accepted (100
	// years): their sums, which the Locker sends to the store, stay
	// within a time.Duration.
	MaxTTL = 100 * 365 * 24 * time.Hour
	// DefaultTTL is the lease used when neither Options.TTL nor WithTTL is set.
	DefaultTTL = 30 * time.Second
	// WriterMark is how long an exclusive attempt that found shared holders
	// keeps new shared requests out (see Sharer).
	WriterMark = 3 * time.Second
	// MaxLimit is the largest holder limit of a Limited key (WithLimit).
	MaxLimit = 1 << 16
	// MaxGroupKeys is the most keys one AcquireAll takes.
	MaxGroupKeys = 1000
)

// Backoff bounds for waiting on a key held by another process. A waiter sleeps
// a jittered, doubling delay between these bounds, never longer than the
// holder's remaining lease, and wakes at once when a Lock of the same Locker
// releases the key.
const (
	minBackoff = 5 * time.Millisecond
	maxBackoff = time.Second
)

// Backoff yields capped, jittered, doubling delays: the Locker's wait policy,
// exported for backends that wait on their own (see Waiter). The zero value
// is ready to use; it is not safe for concurrent use.
type Backoff struct{ n uint }

// Next returns the next delay: half of the current step plus a random part
// of the other half, the step doubling from 5 ms to 1 s; never longer than
// hint (plus 1 ms) when hint > 0, so that a waiter wakes when the holder's
// lease runs out.
func (b *Backoff) Next(hint time.Duration) time.Duration {
	d := min(minBackoff<<b.n, maxBackoff)
	if d < maxBackoff {
		b.n++
	}
	d = d/2 + mrand.N(d/2+1)
	if hint > 0 && hint+time.Millisecond < d {
		d = hint + time.Millisecond
	}
	return d
}
