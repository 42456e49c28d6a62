package torture

import (
	"context"
	"errors"
	"fmt"
	"slices"
	"strings"
	"sync"
	"time"

	"github.com/dlock-dev/dlock"
)

// Client fault kinds: what applications do to a lock themselves. The workers
// inject them (not the harness), each on a share of their calls.
const (
	// ClientAcqDeadline: before a share of acquisitions, and half-way
	// through a share of holds (for another key, while holding), one
	// TryAcquire or Acquire whose context ends 0–5 ms in, or has ended:
	// half by a deadline, half cancelled (see callerDeadline).
	ClientAcqDeadline = "acqdeadline"
	// ClientRelDeadline: a share of releases whose context ends 0–2 ms in,
	// or has ended (a deadline or a cancellation). The lease then ends by its TTL if the
	// release did not reach the store.
	ClientRelDeadline = "reldeadline"
	// ClientSmallPool: the workers of odd slots open the store with a pool
	// of 1–3 connections (database/sql, pgxpool, go-redis; not etcd or
	// ZooKeeper, whose clients have no pool).
	ClientSmallPool = "smallpool"
	// ClientDoPanic: a share of holds run inside Locker.Do, whose fn panics
	// at the end of the hold; the worker recovers (as net/http does) and
	// then checks that its Locker let the key go.
	ClientDoPanic = "dopanic"
	// ClientObsPanic: the workers' Locker has an Observer (metrics code)
	// that panics on a share of the grants it is told of (the caller never
	// gets the Lock) and of the releases it is told of; the worker recovers
	// and checks, as for dopanic, that its Locker let the key go.
	ClientObsPanic = "obspanic"
)

// clientFaults lists every client fault kind.
var clientFaults = []string{ClientAcqDeadline, ClientRelDeadline, ClientSmallPool, ClientDoPanic, ClientObsPanic}

// Shares of the calls that get a client fault.
const (
	pAcqDeadline = 0.2
	pNested      = 0.3 // of holds: another key with a caller deadline while holding
	pRelDeadline = 0.2
	pDoPanic     = 0.1
	pObsPanic    = 0.05 // of acquisitions, and of releases
)

// obsPanicKey marks the context of a call whose Observer method panics.
type obsPanicKey struct{}

// panicking returns ctx marked for panicObserver.
func panicking(ctx context.Context) context.Context {
	return context.WithValue(ctx, obsPanicKey{}, true)
}

// obsPanic is the value panicObserver panics with.
type obsPanic struct{ fence uint64 }

// panicObserver panics in AcquireEnded (for a grant) and in ReleaseStarted
// when the call's context is marked (see panicking), as buggy metrics code
// would.
type panicObserver struct{ dlock.NopObserver }

func (panicObserver) AcquireEnded(ctx context.Context, e dlock.AcquireEnd) {
	if ctx.Value(obsPanicKey{}) != nil && e.Outcome == dlock.Acquired {
		panic(obsPanic{e.Fence})
	}
}

func (panicObserver) ReleaseStarted(ctx context.Context, e dlock.ReleaseStart) context.Context {
	if ctx.Value(obsPanicKey{}) != nil {
		panic(obsPanic{e.Fence})
	}
	return ctx
}

// recoverObsPanic runs f and returns the fence of panicObserver's panic in
// it, if any (0, false otherwise). Other panics go on.
func recoverObsPanic(f func()) (fence uint64, panicked bool) {
	defer func() {
		if p := recover(); p != nil {
			op, ok := p.(obsPanic)
			if !ok {
				panic(p)
			}
			fence, panicked = op.fence, true
		}
	}()
	f()
	return 0, false
}

// obsPanicGrant acquires key with an Observer that panics when told of the
// grant: the Lock never reaches the worker, which checks that its Locker
// let the key go (see letGoCheck).
func (l *lane) obsPanicGrant(ctx context.Context, key string) {
	w, ttl := l.w, l.w.cfg.TTL
	t0 := Mono()
	actx, cancel := context.WithTimeout(ctx, 10*ttl)
	var err error
	fence, panicked := recoverObsPanic(func() {
		var lk *dlock.Lock
		if lk, err = w.locker.Acquire(panicking(actx), key, dlock.WithTTL(ttl)); err == nil {
			lk.Release(context.Background()) // not reached: the Observer panics
		}
	})
	cancel()
	switch {
	case panicked:
		l.letGoCheck(ctx, key, fence, Mono(), ClientObsPanic)
	case ctx.Err() == nil:
		w.rec.rec(Event{T0: t0, Ev: "acqerr", K: key, Err: errString(err)})
		sleep(ctx, time.Duration(50+l.rng.IntN(100))*time.Millisecond)
	}
}

// panicFreeBound is how long after a recovered panic in Do the worker waits
// for its Locker to let the key go before it records the lock as kept: the
// Locker's clean-up release bound (5 s) plus two TTLs (a release that failed
// leaves the lease to expire).
func panicFreeBound(ttl time.Duration) time.Duration { return 5*time.Second + 2*ttl }

// poolSize is the store pool of the worker in slot with the smallpool fault
// (0: the adapter's default): 1, 2, 3, 1, … for odd slots.
func poolSize(slot int) int {
	if slot%2 == 0 {
		return 0
	}
	return 1 + (slot/2)%3
}

// errDoPanic is the value the workers' Do functions panic with.
var errDoPanic = errors.New("torture: panic in Do")

// lastGrants remembers the fence of each key's last grant through a
// worker's backend: a function run by Locker.Do has no Lock to ask.
type lastGrants struct {
	mu sync.Mutex
	f  map[string]uint64
}

func (g *lastGrants) set(key string, fence uint64) {
	g.mu.Lock()
	defer g.mu.Unlock()
	if g.f == nil {
		g.f = map[string]uint64{}
	}
	g.f[key] = fence
}

func (g *lastGrants) last(key string) uint64 {
	g.mu.Lock()
	defer g.mu.Unlock()
	return g.f[key]
}

// clientFault reports whether the lane injects kind.
func (l *lane) clientFault(kind string) bool { return slices.Contains(l.w.cfg.ClientFaults, kind) }

// callerDeadline returns a context that ends up to maxMs ms from now, or
// (one time in four) has ended already, and that instant. Half of them
// have that deadline; the others have none and are cancelled then, as a
// request whose client went away: a store's own timeout, which a backend
// may derive from a deadline, cannot end a wait for them.
func (l *lane) callerDeadline(ctx context.Context, maxMs int) (context.Context, context.CancelFunc, time.Time) {
	d := -time.Millisecond
	if l.rng.IntN(4) > 0 {
		d = time.Duration(l.rng.Int64N(int64(maxMs)*int64(time.Millisecond) + 1))
	}
	dl := time.Now().Add(d)
	if l.rng.IntN(2) == 0 {
		c, cancel := context.WithCancel(ctx)
		t := time.AfterFunc(time.Until(dl), cancel)
		return c, func() { t.Stop(); cancel() }, dl
	}
	c, cancel := context.WithDeadline(ctx, dl)
	return c, cancel, dl
}

// monoOf converts a time.Time taken just now to Mono().
func monoOf(t time.Time) int64 { return Mono() - int64(time.Since(t)) }

// shortAcquire makes one TryAcquire or Acquire of key with a caller
// deadline of 1–5 ms (or passed). It returns the Lock if it got one, and
// the start of its acquisition event.
func (l *lane) shortAcquire(ctx context.Context, key string) (*dlock.Lock, Event) {
	t0 := Mono()
	actx, cancel, dl := l.callerDeadline(ctx, 5)
	defer cancel()
	dlMono := monoOf(dl)
	var lk *dlock.Lock
	var err error
	if l.rng.IntN(2) == 0 {
		lk, err = l.w.locker.TryAcquire(actx, key, l.acquireOptions(key)...)
	} else {
		lk, err = l.w.locker.Acquire(actx, key, l.acquireOptions(key)...)
	}
	if err != nil {
		l.w.rec.rec(Event{T0: t0, Ev: "acqerr", K: key, Cf: ClientAcqDeadline, Dl: dlMono, Err: err.Error()})
		return nil, Event{}
	}
	return lk, Event{T0: t0, T: Mono(), K: key, Cf: ClientAcqDeadline, Dl: dlMono}
}

// doPanic holds key inside Locker.Do, whose fn works on the resource and
// then panics; the panic is recovered here. Then it checks that the Locker
// let the key go (letGoCheck).
func (l *lane) doPanic(ctx context.Context, key string) {
	w, ttl := l.w, l.w.cfg.TTL
	t0 := Mono()
	var fence uint64
	var panicAt int64
	acquired := false
	var watched chan struct{} // closed once fn's context ended and that was recorded
	actx, cancel := context.WithTimeout(ctx, 10*ttl)
	err := func() (err error) {
		defer func() {
			if p := recover(); p != nil {
				if p != errDoPanic {
					panic(p)
				}
				err = errDoPanic
			}
		}()
		return w.locker.Do(actx, key, func(fctx context.Context) error {
			acquired, fence = true, w.grants.last(key)
			plan := l.plan()
			w.rec.rec(Event{T0: t0, Ev: "acq", K: key, F: fence, Plan: int64(plan), Cf: ClientDoPanic})
			w.say("H %s %d %d", key, fence, plan.Milliseconds())
			// fctx ends when the Locker gives the lock up (the holder is told
			// of a loss) or when Do returns: record it as held does lk.Done,
			// or the checker takes the panic, which comes only at fn's next
			// check, for the notice.
			watched = make(chan struct{})
			go func() {
				defer close(watched)
				<-fctx.Done()
				cause := context.Cause(fctx)
				w.rec.rec(Event{T: Mono(), Ev: "done", K: key, F: fence, OK: errors.Is(cause, dlock.ErrLockLost), Err: errString(cause)})
			}()
			// fctx.Err, as an application asks: it also answers from
			// the lease's deadline when the Locker's timer has not run
			// yet (after a pause), which context.Cause alone does not.
			lost := func() error {
				if fctx.Err() != nil {
					return context.Cause(fctx)
				}
				return nil
			}
			l.hold(fctx, accessExclusive, key, fence, plan, lost)
			panicAt = Mono()
			panic(errDoPanic)
		}, dlock.WithTTL(ttl))
	}()
	cancel()
	if watched != nil {
		<-watched // Do cancelled fn's context before it returned
	}
	if !acquired {
		if ctx.Err() == nil {
			w.rec.rec(Event{T0: t0, Ev: "acqerr", K: key, Err: errString(err)})
			sleep(ctx, time.Duration(50+l.rng.IntN(100))*time.Millisecond)
		}
		return
	}
	if !errors.Is(err, errDoPanic) {
		// fn always panics: Do returned without running it to the end.
		w.rec.rec(Event{T0: t0, Ev: "rel", K: key, F: fence, Cf: ClientDoPanic, Err: fmt.Sprintf("Do returned %v without the panic", err)})
		w.say("E %s", key)
		return
	}
	// The application stopped using the lock at the panic.
	w.rec.rec(Event{T0: panicAt, T: panicAt, Ev: "rel", K: key, F: fence, Cf: ClientDoPanic, Err: errDoPanic.Error()})
	w.say("E %s", key)
	l.letGoCheck(ctx, key, fence, panicAt, ClientDoPanic)
}

// letGoCheck checks that the worker's Locker lets key go after a panic at
// panicAt (Mono) of fault cf cut the hold of fence short: TryAcquire of the
// key must stop reporting fence as the holder within panicFreeBound (a
// "dofree" event, with an error if it did not; the worker then restarts,
// since only its Locker's Close can end the kept lock).
func (l *lane) letGoCheck(ctx context.Context, key string, fence uint64, panicAt int64, cf string) {
	w, ttl := l.w, l.w.cfg.TTL
	// A verdict needs an answer: "held by this fence" (kept so far), or
	// anything else from the Locker (let go). Errors (the store out of
	// reach) say nothing; without an answer for three bounds, no verdict.
	bound := panicAt + int64(panicFreeBound(ttl))
	ours := false
	for ctx.Err() == nil && Mono() < bound+2*int64(panicFreeBound(ttl)) {
		pctx, pcancel := context.WithTimeout(ctx, ttl)
		lk, err := w.locker.TryAcquire(pctx, key, dlock.WithTTL(ttl))
		pcancel()
		var held *dlock.HeldError
		switch {
		case err == nil:
			w.rec.rec(Event{T0: panicAt, Ev: "dofree", K: key, F: fence, OK: true, Cf: cf})
			l.held(ctx, lk, Event{T0: Mono(), K: key}, false)
			return
		case errors.As(err, &held) && held.Holder.Fence != fence:
			w.rec.rec(Event{T0: panicAt, Ev: "dofree", K: key, F: fence, OK: true, Cf: cf})
			return
		case held != nil:
			ours = true
		default:
			ours = false
		}
		if ours && Mono() > bound {
			w.rec.rec(Event{T0: panicAt, Ev: "dofree", K: key, F: fence, Cf: cf, Err: "still held by this lease: " + err.Error()})
			// Nobody can release the kept lock but Close: restart the
			// worker, so that the key is not blocked for the rest of the run.
			w.restart()
			return
		}
		sleep(ctx, 50*time.Millisecond)
	}
}

// ParseClientFaults parses a comma list of client fault kinds ("all" for
// every one, "" or "none" for none).
func ParseClientFaults(s string) ([]string, error) {
	switch s {
	case "", "none":
		return nil, nil
	case "all":
		return slices.Clone(clientFaults), nil
	}
	var out []string
	for _, k := range strings.Split(s, ",") {
		if !slices.Contains(clientFaults, k) {
			return nil, fmt.Errorf("unknown client fault %q (have %s)", k, strings.Join(clientFaults, ","))
		}
		out = append(out, k)
	}
	return out, nil
}
