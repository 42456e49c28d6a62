package torture

import (
	"context"
	"time"

	"github.com/dlock-dev/dlock"
)

// timedBackend records every backend call slower than a threshold (a
// diagnostic: a slow call is what turns into a late or early loss), every
// acquisition call that failed, with its request's token (the store may
// have granted it all the same, and the checker then knows whose grant
// nobody was told of), and each key's last grant in grants.
type timedBackend struct {
	dlock.Backend
	rec    *recorder
	slow   time.Duration
	grants *lastGrants
}

func (b *timedBackend) note(op, key string, t0 int64, err error) {
	b.noteTok(op, key, "", t0, err)
}

// noteTok is note for a call that sent a request with token tok.
func (b *timedBackend) noteTok(op, key, tok string, t0 int64, err error) {
	if t := Mono(); time.Duration(t-t0) >= b.slow {
		b.rec.rec(Event{T: t, T0: t0, Ev: "slow", Op: op, K: key, Err: errString(err), Tok: tok})
	}
}

func (b *timedBackend) Acquire(ctx context.Context, req dlock.Request) (dlock.Result, error) {
	t0 := Mono()
	res, err := b.Backend.Acquire(ctx, req)
	b.noteTok("acquire", req.Key, req.Token.String(), t0, err)
	b.failed("acquire", req, t0, err)
	b.granted(req, res, err)
	return res, err
}

// failed records an acquisition call that returned an error, with its
// request's token.
func (b *timedBackend) failed(op string, req dlock.Request, t0 int64, err error) {
	if err != nil {
		b.rec.rec(Event{T: Mono(), T0: t0, Ev: "acqfail", Op: op, K: req.Key, Err: errString(err), Tok: req.Token.String()})
	}
}

func (b *timedBackend) granted(req dlock.Request, res dlock.Result, err error) {
	if err == nil && res.Acquired && b.grants != nil {
		b.grants.set(req.Key, res.Fence)
	}
}

func (b *timedBackend) Extend(ctx context.Context, leases []dlock.Lease) ([]error, error) {
	t0 := Mono()
	errs, err := b.Backend.Extend(ctx, leases)
	key := ""
	if len(leases) > 0 {
		key = leases[0].Key
	}
	b.note("extend", key, t0, err)
	return errs, err
}

func (b *timedBackend) Release(ctx context.Context, key string, token dlock.Token) error {
	t0 := Mono()
	err := b.Backend.Release(ctx, key, token)
	b.note("release", key, t0, err)
	return err
}

// timedWaiter is a timedBackend whose backend is a dlock.Waiter: it passes
// AcquireWait through, so that the Locker waits in the store (doorbells,
// LISTEN/NOTIFY, pub/sub, watches) as it would on the bare backend.
// Embedding only dlock.Backend would hide the Waiter, and the Locker would
// poll. Waiting is what AcquireWait is for, so a call is noted ("wait") only
// when it lasts longer than the TTL: no backend waits that long in one call.
type timedWaiter struct {
	*timedBackend
	w dlock.Waiter
}

func (b timedWaiter) AcquireWait(ctx context.Context, req dlock.Request) (dlock.Result, error) {
	t0 := Mono()
	res, err := b.w.AcquireWait(ctx, req)
	b.failed("wait", req, t0, err)
	b.granted(req, res, err)
	if t := Mono(); time.Duration(t-t0) > req.TTL {
		b.rec.rec(Event{T: t, T0: t0, Ev: "slow", Op: "wait", K: req.Key, Err: errString(err), OK: res.Acquired, Tok: req.Token.String()})
	}
	return res, err
}

// WaitsDirectly passes dlock.DirectWaiter through.
func (b timedWaiter) WaitsDirectly() bool {
	dw, ok := b.w.(dlock.DirectWaiter)
	return ok && dw.WaitsDirectly()
}

// newTimedBackend wraps b, keeping its dlock.Waiter if it has one. grants
// may be nil.
func newTimedBackend(b dlock.Backend, rec *recorder, slow time.Duration, grants *lastGrants) dlock.Backend {
	tb := &timedBackend{Backend: b, rec: rec, slow: slow, grants: grants}
	if w, ok := b.(dlock.Waiter); ok {
		return timedWaiter{tb, w}
	}
	return tb
}
