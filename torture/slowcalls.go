package torture

import (
	"context"
	"time"

	"github.com/dlock-dev/dlock"
)

// timedBackend records every backend call slower than a threshold (a
// diagnostic: a slow call is what turns into a late or early loss).
type timedBackend struct {
	dlock.Backend
	rec  *recorder
	slow time.Duration
}

func (b *timedBackend) note(op, key string, t0 int64, err error) {
	if t := Mono(); time.Duration(t-t0) >= b.slow {
		b.rec.rec(Event{T: t, T0: t0, Ev: "slow", Op: op, K: key, Err: errString(err)})
	}
}

func (b *timedBackend) Acquire(ctx context.Context, req dlock.Request) (dlock.Result, error) {
	t0 := Mono()
	res, err := b.Backend.Acquire(ctx, req)
	b.note("acquire", req.Key, t0, err)
	return res, err
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
