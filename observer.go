package dlock

import (
	"context"
	"errors"
	"time"
)

// An Observer is told what a Locker's locks do: acquisitions, releases,
// renewals and losses, for metrics and traces (the dlockotel module
// implements one over OpenTelemetry). Set it with Options.Observer; a nil
// Observer costs nothing.
//
// Calls run on the goroutine doing the lock's work, outside the Locker's
// mutex, and that work waits for them: an Observer must return quickly and
// never block (record a number, start or end a span). Calls may come from
// several goroutines at once. A panic in a call made for a caller's method
// (an acquisition's, a release's, Close's) reaches that caller, and a lock
// the caller will not get, or was releasing, is let go all the same. Each
// event is a struct so that fields can be added; embed NopObserver to
// implement only some methods and keep compiling when methods are added.
//
// Durations are measured with the Locker's Clock. Keys are passed as they
// are: an Observer decides what to export (a key per metric series can
// make many series).
type Observer interface {
	// AcquireStarted is called when an acquisition (Acquire, TryAcquire, one
	// key of AcquireAll, Do) starts. The context it returns, derived from
	// ctx (a span in it, say), is the one the acquisition's store calls and
	// its AcquireEnded receive; return ctx to add nothing.
	AcquireStarted(ctx context.Context, e AcquireStart) context.Context
	// AcquireEnded is called once for each AcquireStarted, with the
	// context AcquireStarted returned.
	AcquireEnded(ctx context.Context, e AcquireEnd)
	// ReleaseStarted is called when a release of a lease starts: the last
	// Release of its Locks, or Close. Its result is as AcquireStarted's.
	ReleaseStarted(ctx context.Context, e ReleaseStart) context.Context
	// ReleaseEnded is called once for each ReleaseStarted, with the
	// context ReleaseStarted returned.
	ReleaseEnded(ctx context.Context, e ReleaseEnd)
	// Renewed is called when the store confirmed a lease's renewal in time.
	Renewed(e Renewal)
	// Lost is called when a lease is lost, once per lease, before or as its
	// Locks' Done channels close.
	Lost(e Loss)
}

// NopObserver is an Observer that does nothing. Embed it in an Observer
// that implements only some of the methods.
type NopObserver struct{}

// AcquireStarted returns ctx.
func (NopObserver) AcquireStarted(ctx context.Context, _ AcquireStart) context.Context { return ctx }

// AcquireEnded does nothing.
func (NopObserver) AcquireEnded(context.Context, AcquireEnd) {}

// ReleaseStarted returns ctx.
func (NopObserver) ReleaseStarted(ctx context.Context, _ ReleaseStart) context.Context { return ctx }

// ReleaseEnded does nothing.
func (NopObserver) ReleaseEnded(context.Context, ReleaseEnd) {}

// Renewed does nothing.
func (NopObserver) Renewed(Renewal) {}

// Lost does nothing.
func (NopObserver) Lost(Loss) {}

// AcquireStart describes an acquisition that starts.
type AcquireStart struct {
	Key   string
	Mode  Mode
	Limit int // WithLimit's n, for ModeLimited
	// Wait is true for an acquisition that waits for the key (Acquire),
	// false for a single attempt (TryAcquire).
	Wait bool
}

// AcquireEnd describes how an acquisition ended.
type AcquireEnd struct {
	Key     string
	Mode    Mode
	Wait    bool // as in AcquireStart
	Outcome AcquireOutcome
	// Err is the acquisition's error, nil when Outcome is Acquired.
	Err error
	// Waited is the time from the start of the acquisition to its end.
	Waited time.Duration
	// Fence is the Lock's fence when Outcome is Acquired, otherwise 0.
	Fence uint64
	// Reentrant is true for an acquisition that joined a lease this
	// Locker already held for the same owner (WithOwner): no new lease.
	Reentrant bool
}

// AcquireOutcome classifies how an acquisition ended.
type AcquireOutcome uint8

const (
	// Acquired: the lock is held.
	Acquired AcquireOutcome = iota
	// Conflict: TryAcquire found the key held by another (a *HeldError).
	Conflict
	// GaveUp: the caller's context ended before the key could be taken.
	GaveUp
	// Failed: any other error (the store, invalid input, ErrClosed,
	// ErrModeMismatch).
	Failed
)

// String returns "acquired", "conflict", "gave_up" or "error".
func (o AcquireOutcome) String() string {
	switch o {
	case Acquired:
		return "acquired"
	case Conflict:
		return "conflict"
	case GaveUp:
		return "gave_up"
	}
	return "error"
}

// acquireOutcome classifies an acquisition's error.
func acquireOutcome(err error) AcquireOutcome {
	switch {
	case err == nil:
		return Acquired
	case !errors.Is(err, ErrNotAcquired):
		return Failed
	case errors.Is(err, context.Canceled) || errors.Is(err, context.DeadlineExceeded):
		return GaveUp
	}
	return Conflict
}

// ReleaseStart describes a lease whose release starts.
type ReleaseStart struct {
	Key   string
	Mode  Mode
	Fence uint64
	// Held is the time from the acquisition to this release.
	Held time.Duration
	// Closing is true for a release made by Locker.Close.
	Closing bool
}

// ReleaseEnd describes how a release ended.
type ReleaseEnd struct {
	Key     string
	Mode    Mode
	Fence   uint64
	Held    time.Duration // as in ReleaseStart
	Closing bool          // as in ReleaseStart
	// Err is the store's error, or the caller's context's, nil when the
	// store confirmed the release (or the minimum hold's last extension).
	Err error
}

// Renewal describes a renewal the store confirmed.
type Renewal struct {
	Key   string
	Mode  Mode
	Fence uint64
	// Lead is how long before the lease's safe deadline the confirmation
	// arrived: a lead near zero means the lease nearly ran out.
	Lead time.Duration
}

// Loss describes a lease that was lost.
type Loss struct {
	Key   string
	Mode  Mode
	Fence uint64
	Cause LossCause
	// Err is the error the Lock's Err reports (it matches ErrLockLost).
	Err error
	// Held is the time from the acquisition to the loss.
	Held time.Duration
}

// LossCause classifies why a lease was lost.
type LossCause uint8

const (
	// LossExpired: no renewal was confirmed by the lease's safe deadline
	// (a slow or silent store, or a paused process).
	LossExpired LossCause = iota
	// LossStoreError: renewals failed with errors until the safe deadline.
	LossStoreError
	// LossNotHeld: the store answered that it no longer holds the lease for
	// this Locker (it expired there, or was force-released and maybe taken).
	LossNotHeld
	// LossSession: the backend reported that the store session the lock
	// lived in ended (LossReporter).
	LossSession
)

// String returns "expired", "store_error", "not_held" or "session".
func (c LossCause) String() string {
	switch c {
	case LossExpired:
		return "expired"
	case LossStoreError:
		return "store_error"
	case LossNotHeld:
		return "not_held"
	}
	return "session"
}

// acquireStarted starts an acquisition's observation. It returns the
// Observer's context and the start instant.
func (l *Locker) acquireStarted(ctx context.Context, key string, cfg acquireConfig, wait bool) (context.Context, time.Time) {
	ctx = l.obs.AcquireStarted(ctx, AcquireStart{Key: key, Mode: cfg.mode(), Limit: cfg.limit, Wait: wait})
	return ctx, l.clock.Now()
}

// acquireEnded reports the end of an acquisition started at start.
func (l *Locker) acquireEnded(ctx context.Context, key string, mode Mode, wait bool, start time.Time, k *Lock, reentrant bool, err error) {
	e := AcquireEnd{Key: key, Mode: mode, Wait: wait, Outcome: acquireOutcome(err), Err: err, Waited: l.clock.Now().Sub(start)}
	if k != nil {
		e.Fence, e.Reentrant = k.ls.fence, reentrant
	}
	l.obs.AcquireEnded(ctx, e)
}

// releaseStarted starts a release's observation. It returns ctx and the
// event to end it with (zero when there is no Observer).
func (l *Locker) releaseStarted(ctx context.Context, ls *lease, closing bool) (context.Context, ReleaseEnd) {
	if l.obs == nil {
		return ctx, ReleaseEnd{}
	}
	s := ReleaseStart{Key: ls.key, Mode: ls.mode, Fence: ls.fence, Held: l.clock.Now().Sub(ls.acquiredAt), Closing: closing}
	ctx = l.obs.ReleaseStarted(ctx, s)
	return ctx, ReleaseEnd{Key: s.Key, Mode: s.Mode, Fence: s.Fence, Held: s.Held, Closing: closing}
}

// releaseEnded ends a release's observation with err.
func (l *Locker) releaseEnded(ctx context.Context, e ReleaseEnd, err error) {
	if l.obs == nil {
		return
	}
	e.Err = err
	l.obs.ReleaseEnded(ctx, e)
}

// queueLossLocked records the loss of ls for emitLosses.
func (l *Locker) queueLossLocked(ls *lease, cause LossCause, err error) {
	if l.obs == nil {
		return
	}
	l.lossQ = append(l.lossQ, Loss{Key: ls.key, Mode: ls.mode, Fence: ls.fence, Cause: cause, Err: err, Held: l.clock.Now().Sub(ls.acquiredAt)})
}

// emitLosses tells the Observer of the losses queued under the mutex. Every
// method that can lose a lease defers it before taking the mutex, so that
// it runs once the mutex is released.
func (l *Locker) emitLosses() {
	if l.obs == nil {
		return
	}
	l.mu.Lock()
	q := l.lossQ
	l.lossQ = nil
	l.mu.Unlock()
	for _, e := range q {
		l.obs.Lost(e)
	}
}
