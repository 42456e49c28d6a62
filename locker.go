package dlock

import (
	"context"
	"errors"
	"fmt"
	"log/slog"
	"slices"
	"sync"
	"time"

	"github.com/dlock-dev/dlock/internal/ctxend"
)

// cleanupTimeout bounds the background releases the Locker makes to resolve
// acquisitions of unknown outcome and leases it gave up on.
const cleanupTimeout = 5 * time.Second

// A Locker acquires and renews locks on one Backend. It is safe for
// concurrent use. Create it with New and Close it when done: Close releases
// what it holds and stops its goroutines.
type Locker struct {
	b         Backend
	ttl       time.Duration
	margin    time.Duration
	lockDelay time.Duration
	log       *slog.Logger
	meta      string
	clock     Clock
	obs       Observer // nil: none

	// bg is cancelled by Close; background I/O (renewal, clean-up) uses it.
	bg       context.Context
	bgCancel context.CancelFunc
	wg       sync.WaitGroup

	mu       sync.Mutex
	closed   bool
	closing  chan struct{}       // closed by Close
	held     map[string]*lease   // exclusive leases this Locker holds, by key
	shares   map[string][]*lease // shared and limited leases this Locker holds, by key
	wakers   map[string]*waker   // local waiters of each key
	pending  map[string]*pending // store acquisitions under way with an owner, by key
	renewing bool                // the renewal goroutine is running
	kick     chan struct{}       // wakes the renewal goroutine
	// unresolved holds the acquisitions of unknown outcome whose tokens
	// the resolver goroutine releases (see resolve.go).
	unresolved  []*unresolved
	resolving   bool          // the resolver goroutine is running
	resolveKick chan struct{} // wakes the resolver goroutine
	wakeAt      time.Time     // when the renewal goroutine looks next
	linger      time.Duration // how long it stays while nothing is held
	batch       int           // leases per Extend call

	stopLoss func() // unregisters from a LossReporter backend
	// early holds losses reported for tokens not (yet) registered: a
	// session that died between the grant and register. Bounded.
	early map[Token]error
	// lossQ holds the losses for the Observer, told once mu is released
	// (emitLosses).
	lossQ []Loss
}

// New returns a Locker over b. The caller keeps ownership of whatever b wraps
// (a *sql.DB, a client): Close does not close it. opts may be nil.
func New(b Backend, opts *Options) *Locker {
	if opts == nil {
		opts = &Options{}
	}
	l := &Locker{
		b:           b,
		ttl:         opts.TTL,
		margin:      opts.Margin,
		lockDelay:   opts.LockDelay,
		log:         opts.Logger,
		meta:        opts.Metadata,
		clock:       opts.Clock,
		obs:         opts.Observer,
		closing:     make(chan struct{}),
		held:        make(map[string]*lease),
		shares:      make(map[string][]*lease),
		wakers:      make(map[string]*waker),
		pending:     make(map[string]*pending),
		kick:        make(chan struct{}, 1),
		resolveKick: make(chan struct{}, 1),
		batch:       extendBatch(b),
		linger:      renewLinger,
	}
	if l.ttl == 0 {
		l.ttl = DefaultTTL
	}
	if l.log == nil {
		l.log = slog.New(slog.DiscardHandler)
	}
	if l.clock == nil {
		l.clock = systemClock{}
	}
	if l.meta == "" {
		l.meta = defaultMetadata()
	}
	l.bg, l.bgCancel = context.WithCancel(context.Background())
	if lr, ok := b.(LossReporter); ok {
		l.stopLoss = lr.OnLoss(l.reportedLoss)
	}
	return l
}

// maxEarlyLosses bounds the losses kept for tokens not yet registered
// (most are other Lockers' tokens, on a backend they share).
const maxEarlyLosses = 1024

// reportedLoss ends the lease of key held with token, which the backend
// reports the store no longer holds.
func (l *Locker) reportedLoss(key string, token Token, cause error) {
	defer l.emitLosses()
	l.mu.Lock()
	defer l.mu.Unlock()
	err := fmt.Errorf("%w: %q: %w", ErrLockLost, key, cause)
	ls := l.leaseLocked(key, token)
	if ls == nil {
		if l.early == nil || len(l.early) >= maxEarlyLosses {
			l.early = make(map[Token]error)
		}
		l.early[token] = err
		return
	}
	if !ls.ended {
		l.loseLocked(ls, LossSession, err, false)
	}
}

// Acquire waits until it holds key or ctx ends. Options: WithTTL, WithOwner,
// WithMetadata.
//
// Errors: ErrInvalidKey and ErrInvalidOption (before any I/O); an error
// matching both ErrNotAcquired and ctx.Err() when ctx ends first; ErrClosed;
// or the backend's error, wrapped, when the store cannot be reached (an
// outage is never reported as "not acquired"). When the store failed mid-way
// the outcome is resolved before returning: the attempted lease is released.
// A grant that arrives after its lease's safe deadline (a round trip longer
// than the TTL minus the margin) is released; Acquire then tries again
// (logged as a warning), and returns the error after three such grants in a
// row; TryAcquire returns it at once.
func (l *Locker) Acquire(ctx context.Context, key string, opts ...AcquireOption) (*Lock, error) {
	return l.acquire(ctx, key, opts, true)
}

// TryAcquire makes one attempt to take key without waiting. When the key is
// held by someone else the error is a *HeldError, which matches
// ErrNotAcquired. Other errors are as for Acquire.
func (l *Locker) TryAcquire(ctx context.Context, key string, opts ...AcquireOption) (*Lock, error) {
	return l.acquire(ctx, key, opts, false)
}

// Do acquires key (waiting as Acquire does), runs fn with a context that is
// cancelled when the lock is lost, and releases the lock. It returns fn's
// error; if the lock was lost while fn ran, the error also matches
// ErrLockLost, even when fn returned nil, because fn's work may have run
// without the lock. The release outlives ctx, by at most 5 s when the store
// is slow to answer; a release still unanswered then goes on in the
// background and Do returns its error.
func (l *Locker) Do(ctx context.Context, key string, fn func(ctx context.Context) error, opts ...AcquireOption) (err error) {
	k, err := l.Acquire(ctx, key, opts...)
	if err != nil {
		return err
	}
	fctx, cancel := k.Context(ctx)
	var ferr error
	// Deferred, so that a panic in fn, recovered by a caller (net/http
	// does), still releases the lock instead of leaving it renewed forever.
	defer func() {
		cancel()
		lost := k.Err()
		rctx, rcancel := context.WithTimeout(context.WithoutCancel(ctx), cleanupTimeout)
		rerr := k.Release(rctx)
		rcancel()
		switch {
		case lost != nil:
			err = Join(ferr, lost)
		case ferr != nil:
			err = ferr
		default:
			err = rerr
		}
	}()
	ferr = fn(fctx)
	return nil
}

// ForceRelease frees key whoever holds it: an administrative action for a
// lock whose holder is gone or stuck. The next acquisition gets a larger
// fence, so a stale holder is fenced out, and the holder learns of
// the loss at its next renewal. It returns ErrNotHeld if the key was not held
// and ErrUnsupported if the backend cannot do it. Like List, ListWaiters and
// ListKeys, it returns by ctx's end even when the store stops answering (the
// store may still act on it), and ErrClosed after Close.
func (l *Locker) ForceRelease(ctx context.Context, key string) error {
	if err := ValidateKey(key); err != nil {
		return err
	}
	fr, ok := l.b.(ForceReleaser)
	if !ok {
		return ErrUnsupported
	}
	_, err := storeCall(l, ctx, func() (struct{}, error) { return struct{}{}, fr.ForceRelease(ctx, key) })
	return err
}

// List returns the locks currently held on the backend whose key starts with
// prefix. It returns ErrUnsupported if the backend cannot list.
func (l *Locker) List(ctx context.Context, prefix string) ([]LockInfo, error) {
	ls, ok := l.b.(Lister)
	if !ok {
		return nil, ErrUnsupported
	}
	return storeCall(l, ctx, func() ([]LockInfo, error) { return ls.List(ctx, prefix) })
}

// ListWaiters returns the acquisitions waiting in the store for a key that
// starts with prefix (see WaiterLister for which waits show). It returns
// ErrUnsupported if the store cannot tell who waits: an empty list means
// nobody waits.
func (l *Locker) ListWaiters(ctx context.Context, prefix string) ([]WaiterInfo, error) {
	wl, ok := l.b.(WaiterLister)
	if !ok {
		return nil, ErrUnsupported
	}
	return storeCall(l, ctx, func() ([]WaiterInfo, error) { return wl.ListWaiters(ctx, prefix) })
}

// ListKeys returns the keys starting with prefix that the store keeps a
// record of, held or free, each with its last fence and its holders or, when
// free, its last holder and when it was freed. It returns ErrUnsupported if
// the store forgets a key on release.
func (l *Locker) ListKeys(ctx context.Context, prefix string) ([]KeyInfo, error) {
	kl, ok := l.b.(KeyLister)
	if !ok {
		return nil, ErrUnsupported
	}
	return storeCall(l, ctx, func() ([]KeyInfo, error) { return kl.ListKeys(ctx, prefix) })
}

// Close releases every lock this Locker holds (their Done channels close and
// Err reports ErrClosed), makes later acquisitions fail with ErrClosed, and
// waits for the Locker's goroutines to stop, or for ctx to end: store calls
// still under way then end by themselves (when the store answers or their
// own bounds pass), and releases that ctx cut short go on in the background
// for a few seconds. It returns the release errors and ctx's, if any.
// Closing twice is a no-op.
func (l *Locker) Close(ctx context.Context) error {
	l.mu.Lock()
	if l.closed {
		l.mu.Unlock()
		return nil
	}
	l.closed = true
	close(l.closing)
	if l.stopLoss != nil {
		l.stopLoss()
	}
	leases := l.leasesLocked()
	for _, ls := range leases {
		l.endLocked(ls, ErrClosed)
	}
	l.mu.Unlock()

	var errs []error
	i := 0
	defer func() {
		if i < len(leases) { // the Observer panicked: let go of the rest
			for _, ls := range leases[i+1:] {
				l.goLetGo(ls)
			}
			l.bgCancel()
		}
	}()
	for ; i < len(leases); i++ {
		if err := l.closeLease(ctx, leases[i]); err != nil {
			errs = append(errs, err)
		}
	}
	l.bgCancel()
	waited := make(chan struct{})
	go func() {
		l.wg.Wait()
		close(waited)
	}()
	select {
	case <-waited:
	case <-ctx.Done():
		errs = append(errs, fmt.Errorf("dlock: close: store calls still under way end by themselves: %w", ctx.Err()))
	}
	return Join(errs...)
}

// closeLease lets go of ls for Close, and returns the error to report.
func (l *Locker) closeLease(ctx context.Context, ls *lease) (err error) {
	started := false
	defer func() {
		if !started { // the Observer panicked: let go all the same
			l.goLetGo(ls)
		}
	}()
	ctx, end := l.releaseStarted(ctx, ls, true)
	started = true
	defer func() { l.releaseEnded(ctx, end, err) }()
	keep := l.keepFor(ls)
	l.wg.Add(1)
	_, err = await(l, ctx, func() (struct{}, error) {
		return struct{}{}, l.letGo(ctx, ls, keep)
	}, func(_ struct{}, err error) {
		if err != nil && !errors.Is(err, ErrNotHeld) {
			l.goLetGo(ls) // this goroutine still counts: before any Wait ends
		}
	})
	switch {
	case errors.Is(err, errAbandoned):
		err = ctx.Err()
	case err != nil && !errors.Is(err, ErrNotHeld) && ctxend.Err(ctx) != nil:
		// Cut short by ctx: let go in the background all the same,
		// rather than leave the key to its TTL (or free it before the
		// end of its minimum hold).
		l.goLetGo(ls)
	}
	if err != nil {
		return fmt.Errorf("dlock: release %q: %w", ls.key, err)
	}
	return nil
}

func (l *Locker) acquire(ctx context.Context, key string, opts []AcquireOption, wait bool) (*Lock, error) {
	cfg, err := l.config(key, opts)
	if l.obs == nil {
		if err != nil {
			return nil, err
		}
		k, _, err := l.acquireConfigured(ctx, key, cfg, wait)
		return k, err
	}
	ctx, start := l.acquireStarted(ctx, key, cfg, wait)
	var k *Lock
	reentrant := false
	if err == nil {
		k, reentrant, err = l.acquireConfigured(ctx, key, cfg, wait)
	}
	reported := false
	defer func() {
		if !reported && k != nil {
			// The Observer panicked: the caller never gets k.
			releaseUnreturned(ctx, k)
		}
	}()
	l.acquireEnded(ctx, key, cfg.mode(), wait, start, k, reentrant, err)
	reported = true
	return k, err
}

// releaseUnreturned releases k, a Lock that a panic (an Observer's) kept
// from its caller, bounded as a background release is.
func releaseUnreturned(ctx context.Context, k *Lock) {
	rctx, cancel := context.WithTimeout(context.WithoutCancel(ctx), cleanupTimeout)
	defer cancel()
	_ = k.Release(rctx)
}

// acquireConfigured is acquire once its options are checked. It also
// reports whether the Lock joined a lease this Locker held (WithOwner).
func (l *Locker) acquireConfigured(ctx context.Context, key string, cfg acquireConfig, wait bool) (*Lock, bool, error) {
	_, canWait := l.b.(Waiter)
	// Wait in the store: after a first attempt found the key held, or at
	// once on a DirectWaiter (whose wait makes that attempt itself).
	dw, direct := l.b.(DirectWaiter)
	inStore := wait && direct && cfg.onWait == nil && dw.WaitsDirectly()
	var bo Backoff
	tooLate := 0 // grants in a row that came after their safe deadline
	for {
		if err := ctx.Err(); err != nil {
			return nil, false, fmt.Errorf("%w: %w", ErrNotAcquired, err)
		}
		// A first attempt that only leads to a wait in the store need not
		// describe the holder (unless WithOnWait reads it).
		noHolder := wait && canWait && !inStore && cfg.onWait == nil
		k, out, err := l.attempt(ctx, key, cfg, wait, wait && inStore, noHolder)
		if errors.Is(err, errTooLate) {
			tooLate++
		} else {
			tooLate = 0
		}
		if wait && tooLate > 0 && tooLate < maxTooLate {
			// Released: nothing is held, and the caller waits. Look again
			// (each such grant took a round trip of most of the TTL); a TTL
			// too short for every round trip ends with the error.
			l.log.Warn("dlock: trying again after a grant that came too late", "ttl", cfg.ttl, "err", err)
			l.unwait(key, out.woken)
			continue
		}
		k, err, done := l.afterAttempt(ctx, k, out, err, cfg, wait, &canWait, &inStore, &bo)
		l.unwait(key, out.woken)
		if done {
			return k, out.reentrant, err
		}
	}
}

// maxTooLate is how many grants in a row a blocking acquisition takes that
// came after their lease's safe deadline before it returns the error.
const maxTooLate = 3

// afterAttempt is the waiting policy after one attempt: it returns the
// acquisition's result and done, or sleeps and returns !done to try again.
func (l *Locker) afterAttempt(ctx context.Context, k *Lock, out outcome, err error, cfg acquireConfig, wait bool, canWait, inStore *bool, bo *Backoff) (*Lock, error, bool) {
	switch {
	case wait && errors.Is(err, errLostEarly): // look again
		return nil, nil, false
	case errors.Is(err, ErrUnsupported) && *inStore: // the Waiter took nothing: back off instead
		*canWait, *inStore = false, false
		return nil, nil, false
	case err != nil || k != nil:
		return k, err, true
	case out.held == nil: // a wait in the store ended by its own bound
		return nil, nil, false
	case !wait:
		return nil, out.held, true
	}
	if cfg.onWait != nil && out.held.Holder.Key != "" {
		cfg.onWait(out.held.Holder)
	}
	d := time.Duration(-1) // held by this Locker: wait for its release
	switch {
	case out.local:
	case *canWait && !*inStore:
		*inStore = true // from now on wait in the store
		return nil, nil, false
	default:
		d = bo.Next(out.remaining)
	}
	if err := l.sleep(ctx, d, out.woken); err != nil {
		return nil, fmt.Errorf("%w: %w", out.held, err), true
	}
	return nil, nil, false
}

// outcome is what an attempt that took nothing learnt.
type outcome struct {
	held      *HeldError    // the key is held by another; nil after a wait that ended by its own bound
	local     bool          // held by another owner of this Locker
	remaining time.Duration // the holder's remaining lease, 0 if unknown
	woken     chan struct{} // closed at the next local release of the key
	reentrant bool          // the Lock joined a lease of its owner
}

// attempt makes one attempt to take key: from this Locker's own leases (a
// reentrant acquisition, or a key another owner of this Locker holds), or
// with one store call (a wait in the store when inStore; a store call
// told not to describe a holder when noHolder). It returns the Lock, or
// what it learnt, or an error: the backend's, wrapped, once the
// outcome of the call has been resolved.
func (l *Locker) attempt(ctx context.Context, key string, cfg acquireConfig, wait, inStore, noHolder bool) (k *Lock, _ outcome, _ error) {
	defer func() {
		told := false
		defer func() {
			if !told && k != nil { // an Observer's Lost panicked: the caller never gets k
				releaseUnreturned(ctx, k)
			}
		}()
		l.emitLosses()
		told = true
	}()
	l.mu.Lock()
	if l.closed {
		l.mu.Unlock()
		return nil, outcome{}, ErrClosed
	}
	l.checkKeyLocked(key) // a lease lost to a pause is no longer held
	mode := cfg.mode()
	slot := pendingSlot(key, mode)
	if p := l.pending[slot]; p != nil && cfg.owner != "" && p.owner == cfg.owner && l.ownLocked(key, cfg) == nil {
		// The same owner is taking the key already: share its outcome
		// rather than race it in the store and wait for its own lock.
		l.mu.Unlock()
		select {
		case <-p.done:
		case <-ctx.Done():
			return nil, outcome{}, fmt.Errorf("%w: %w", ErrNotAcquired, ctx.Err())
		}
		return l.attempt(ctx, key, cfg, wait, inStore, noHolder)
	}
	var out outcome
	if wait {
		out.woken = l.wakerLocked(key)
	}
	if ls := l.ownLocked(key, cfg); ls != nil {
		if ls.mode != mode || ls.limit != cfg.limit {
			l.mu.Unlock()
			return nil, out, fmt.Errorf("dlock: acquire %q: %w: owner %q holds it %s", key, ErrModeMismatch, cfg.owner, ls.describe())
		}
		k := l.newHandleLocked(ls)
		l.mu.Unlock()
		out.reentrant = true
		return k, out, nil
	}
	if ls := l.mismatchLocked(key, mode, cfg.limit); ls != nil {
		l.mu.Unlock()
		return nil, out, fmt.Errorf("dlock: acquire %q: %w: this Locker holds it %s", key, ErrModeMismatch, ls.describe())
	}
	if ls := l.held[key]; ls != nil {
		// An exclusive lease of this Locker blocks every mode: wait for
		// its local release. Shared and limited leases of this Locker do
		// not stop the store from being asked: it counts them, and an
		// exclusive attempt there leaves the writer mark that keeps new
		// readers, local ones included, from starving it.
		out.held, out.local = &HeldError{Holder: ls.info()}, true
		l.mu.Unlock()
		return nil, out, nil
	}
	if cfg.owner != "" && l.pending[slot] == nil {
		p := &pending{owner: cfg.owner, done: make(chan struct{})}
		l.pending[slot] = p
		defer func() { // after the grant is registered, or not
			l.mu.Lock()
			delete(l.pending, slot)
			l.mu.Unlock()
			close(p.done)
		}()
	}
	// Close waits for this store call and what follows from it (a grant
	// that lands during Close is released, not left to its TTL).
	l.wg.Add(1)
	defer l.wg.Done()
	l.mu.Unlock()

	req := Request{Key: key, Token: NewToken(), Owner: cfg.owner, TTL: cfg.ttl + cfg.lockDelay, LockDelay: cfg.lockDelay, Metadata: *cfg.metadata, Mode: mode, Limit: cfg.limit, NoHolder: noHolder}
	sent, realSent := l.clock.Now(), time.Now()
	var res Result
	var err error
	cctx, stop := l.withClosing(ctx)
	if !inStore && ctx.Done() == nil {
		// The caller cannot stop waiting, so the call runs on its
		// goroutine; Close ends it through cctx, or, on a store client
		// that ignores contexts, the client's own bounds do.
		res, err = l.b.Acquire(cctx, req)
	} else {
		l.wg.Add(1)
		res, err = await(l, cctx, func() (Result, error) {
			if inStore {
				return l.b.(Waiter).AcquireWait(cctx, req)
			}
			return l.b.Acquire(cctx, req)
		}, func(res Result, err error) {
			// The caller left: nobody will hold what the call took.
			if res.Acquired || err != nil && !(inStore && errors.Is(err, ErrUnsupported)) {
				// A grant known to be nobody's goes ahead of the
				// acquisitions of unknown outcome already queued.
				l.resolve(req, res.Acquired)
			}
		})
	}
	stop()
	if err == nil && res.Acquired && res.SentAfter != 0 {
		// SentAfter is real time. Count back from now only what followed
		// the sending (about a round trip), so that a Clock running at
		// another rate errs over that alone, not over the whole wait.
		sent = l.clock.Now().Add(-max(time.Since(realSent)-res.SentAfter, 0))
	}
	switch {
	case errors.Is(err, errAbandoned):
		if cerr := ctxend.Err(ctx); cerr != nil {
			return nil, out, fmt.Errorf("%w: %w", ErrNotAcquired, cerr)
		}
		return nil, out, ErrClosed
	case inStore && errors.Is(err, ErrUnsupported):
		return nil, out, err
	case errors.Is(err, ErrModeMismatch): // refused: nothing was taken
		return nil, out, fmt.Errorf("dlock: acquire %q: %w", key, err)
	case err != nil:
		l.resolveLater(ctx, req)
		if cerr := ctxend.Err(ctx); cerr != nil {
			return nil, out, fmt.Errorf("%w: %w", ErrNotAcquired, cerr)
		}
		if l.isClosed() {
			return nil, out, ErrClosed
		}
		return nil, out, fmt.Errorf("dlock: acquire %q: %w", key, err)
	case inStore && !res.Acquired:
		if l.isClosed() {
			return nil, out, ErrClosed
		}
		if res.Holder.Key != "" && cfg.onWait != nil {
			cfg.onWait(res.Holder)
		}
		return nil, out, nil
	case res.Acquired:
		k, err := l.register(ctx, req, res.Fence, sent, cfg.minHold, cfg.lockDelay)
		if errors.Is(err, errTooLate) || errors.Is(err, errLostEarly) {
			// Not "held by someone": nobody may hold the key.
			err = fmt.Errorf("dlock: acquire %q: %w", key, err)
		}
		return k, out, err
	}
	res.Holder.Key = key
	out.held, out.remaining = &HeldError{Holder: res.Holder}, res.Remaining
	return nil, out, nil
}

// withClosing returns ctx, also cancelled when the Locker closes.
func (l *Locker) withClosing(ctx context.Context) (context.Context, context.CancelFunc) {
	ctx, cancel := context.WithCancel(ctx)
	stop := context.AfterFunc(l.bg, cancel)
	return ctx, func() { stop(); cancel() }
}

func (l *Locker) isClosed() bool {
	l.mu.Lock()
	defer l.mu.Unlock()
	return l.closed
}

// sleep waits for d (forever if d < 0), a local release, ctx or Close.
func (l *Locker) sleep(ctx context.Context, d time.Duration, woken <-chan struct{}) error {
	var timeout <-chan time.Time
	if d >= 0 {
		t := time.NewTimer(d)
		defer t.Stop()
		timeout = t.C
	}
	select {
	case <-timeout:
	case <-woken:
	case <-ctx.Done():
		return ctx.Err()
	case <-l.closing:
		return ErrClosed
	}
	return nil
}

// pending is a store acquisition under way for an owner: others of the
// same owner wait for it (done) and then find the lock held, reentrantly.
type pending struct {
	owner string
	done  chan struct{}
}

// pendingSlot names an acquisition of key in mode in Locker.pending: the
// key itself for ModeExclusive (NUL never occurs in a key).
func pendingSlot(key string, mode Mode) string {
	if mode == ModeExclusive {
		return key
	}
	return fmt.Sprintf("%s\x00%d", key, mode)
}

// leaseLocked returns the lease of key held with token, or nil.
func (l *Locker) leaseLocked(key string, token Token) *lease {
	if ls := l.held[key]; ls != nil && ls.token == token {
		return ls
	}
	for _, ls := range l.shares[key] {
		if ls.token == token {
			return ls
		}
	}
	return nil
}

// eachLeaseLocked yields every lease this Locker holds, without copying
// them (the renewal loop looks at all of them on every turn).
func (l *Locker) eachLeaseLocked(yield func(*lease) bool) {
	for _, ls := range l.held {
		if !yield(ls) {
			return
		}
	}
	for _, lss := range l.shares {
		for _, ls := range lss {
			if !yield(ls) {
				return
			}
		}
	}
}

// leasesLocked returns every lease this Locker holds.
func (l *Locker) leasesLocked() []*lease { return slices.Collect(l.eachLeaseLocked) }

// holdsNothingLocked reports whether this Locker holds no lease.
func (l *Locker) holdsNothingLocked() bool { return len(l.held) == 0 && len(l.shares) == 0 }

// checkKeyLocked reports the loss of every lease of key whose safe deadline
// has passed.
func (l *Locker) checkKeyLocked(key string) {
	if ls := l.held[key]; ls != nil {
		l.checkDeadlineLocked(ls)
	}
	for _, ls := range slices.Clone(l.shares[key]) {
		l.checkDeadlineLocked(ls)
	}
}

// ownLocked returns the lease of key that cfg's owner holds, in any mode,
// or nil (always nil without an owner).
func (l *Locker) ownLocked(key string, cfg acquireConfig) *lease {
	if cfg.owner == "" {
		return nil
	}
	if ls := l.held[key]; ls != nil && ls.owner == cfg.owner {
		return ls
	}
	for _, ls := range l.shares[key] {
		if ls.owner == cfg.owner {
			return ls
		}
	}
	return nil
}

// mismatchLocked returns a lease of this Locker of key that an acquisition
// in mode with limit disagrees with (a limited lease with another limit, or
// limited against exclusive or shared, either way), or nil.
func (l *Locker) mismatchLocked(key string, mode Mode, limit int) *lease {
	clash := func(ls *lease) bool {
		return (ls.mode == ModeLimited || mode == ModeLimited) && (ls.mode != mode || ls.limit != limit)
	}
	if ls := l.held[key]; ls != nil && clash(ls) {
		return ls
	}
	for _, ls := range l.shares[key] {
		if clash(ls) {
			return ls
		}
	}
	return nil
}

// dropLocked forgets ls, if this Locker still holds it.
func (l *Locker) dropLocked(ls *lease) {
	if ls.mode == ModeExclusive {
		if l.held[ls.key] == ls {
			delete(l.held, ls.key)
		}
		return
	}
	lss := slices.DeleteFunc(l.shares[ls.key], func(o *lease) bool { return o == ls })
	if len(lss) == 0 {
		delete(l.shares, ls.key)
	} else {
		l.shares[ls.key] = lss
	}
}

// waker is the channel closed at the next local release of a key, with
// the number of waiters that hold it (the entry goes with the last one, so
// that keys looked at once leave nothing behind).
type waker struct {
	ch chan struct{}
	n  int
}

// wakerLocked returns the channel closed at the next local release of key,
// counting the caller as its waiter until unwait.
func (l *Locker) wakerLocked(key string) chan struct{} {
	w := l.wakers[key]
	if w == nil {
		w = &waker{ch: make(chan struct{})}
		l.wakers[key] = w
	}
	w.n++
	return w.ch
}

// unwait ends the caller's wait on ch, key's waker (nil: none).
func (l *Locker) unwait(key string, ch chan struct{}) {
	if ch == nil {
		return
	}
	l.mu.Lock()
	defer l.mu.Unlock()
	if w := l.wakers[key]; w != nil && w.ch == ch {
		if w.n--; w.n == 0 {
			delete(l.wakers, key)
		}
	}
}

// wakeLocked wakes the local waiters of key.
func (l *Locker) wakeLocked(key string) {
	if w := l.wakers[key]; w != nil {
		close(w.ch)
		delete(l.wakers, key)
	}
}

// resolveLater releases the lease that an acquisition of unknown outcome may
// have taken, so that it does not linger until its TTL. The first attempt
// runs at once, bounded by ctx (the caller's, which the clean-up never
// outlives); if it cannot settle the outcome, the resolver goes on in the
// background (see resolve). Close waits for it.
func (l *Locker) resolveLater(ctx context.Context, req Request) {
	if ctx.Err() == nil {
		rctx, cancel := context.WithTimeout(ctx, cleanupTimeout)
		err := l.b.Release(rctx, req.Key, req.Token)
		cancel()
		if err == nil {
			l.log.Warn("dlock: released a lease taken by an acquisition that reported an error", "key", req.Key)
			return
		}
	}
	l.resolve(req, false)
}

// letGoLater lets ls go in the background (see letGoBounded), after its
// release or the last extension of its minimum hold was cut short by its
// caller's context. Close waits for it, unless it started while the Locker
// was closing.
func (l *Locker) letGoLater(ls *lease) {
	l.mu.Lock()
	closed := l.closed
	if !closed {
		l.wg.Add(1)
	}
	l.mu.Unlock()
	if closed {
		// Close may be waiting for l.wg already: this runs untracked,
		// bounded by cleanupTimeout like the others.
		go func() {
			ctx, cancel := context.WithTimeout(context.Background(), cleanupTimeout)
			defer cancel()
			_ = l.letGo(ctx, ls, l.keepFor(ls))
		}()
		return
	}
	go l.letGoBounded(ls)
}

// goLetGo lets ls go in the background (letGoBounded), counted by l.wg:
// Close's releases, made before its Wait.
func (l *Locker) goLetGo(ls *lease) {
	l.wg.Add(1)
	go l.letGoBounded(ls)
}

// letGoBounded lets ls go (see letGo: what is left of its minimum hold is
// kept, counted now), bounded by cleanupTimeout, and wakes the key's local
// waiters if it did. The caller has done l.wg.Add(1) for it.
func (l *Locker) letGoBounded(ls *lease) {
	defer l.wg.Done()
	ctx, cancel := context.WithTimeout(context.Background(), cleanupTimeout)
	defer cancel()
	if err := l.letGo(ctx, ls, l.keepFor(ls)); err == nil {
		l.mu.Lock()
		l.wakeLocked(ls.key)
		l.mu.Unlock()
	}
}

// errAbandoned is await's error for a call whose caller stopped waiting.
var errAbandoned = errors.New("dlock: store call abandoned")

// await runs call on a goroutine of its own and waits for it until ctx
// ends, so that the caller returns by its deadline even when the store (or
// a client that does not honour contexts) stops answering. (A caller whose
// own context cannot end, Done returning nil, makes a TryAcquire's or
// Release's call itself instead: the goroutine's hand-offs cost an
// uncontended Redis acquisition about a fifth of its time.) If ctx ends
// first it returns errAbandoned at once, and late runs with the call's
// outcome when the call returns, on that goroutine. The caller must have
// done l.wg.Add(1) for the goroutine (Close then waits for it, or for its
// own ctx).
func await[T any](l *Locker, ctx context.Context, call func() (T, error), late func(T, error)) (T, error) {
	type outcome struct {
		v   T
		err error
	}
	var mu sync.Mutex
	abandoned := false
	ch := make(chan outcome, 1)
	go func() {
		defer l.wg.Done()
		v, err := call()
		mu.Lock()
		if !abandoned {
			ch <- outcome{v, err}
			mu.Unlock()
			return
		}
		mu.Unlock()
		if late != nil {
			late(v, err)
		}
	}()
	select {
	case o := <-ch:
		return o.v, o.err
	case <-ctx.Done():
	}
	mu.Lock()
	defer mu.Unlock()
	select {
	case o := <-ch:
		return o.v, o.err
	default:
	}
	abandoned = true
	var zero T
	return zero, errAbandoned
}
