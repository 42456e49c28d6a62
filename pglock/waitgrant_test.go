package pglock_test

import (
	"context"
	"testing"
	"time"

	"github.com/dlock-dev/dlock"
	"github.com/dlock-dev/dlock/locktest"
	"github.com/dlock-dev/dlock/pglock"
)

// TestAdvisoryWaitsShortAndLong: an exclusive waiter is granted the key
// when its holder releases it soon (the grant's reply comes within a fifth
// of the TTL, and the grant is timed from the wait's statement) and late
// (the grant is confirmed, and timed, by a statement after the reply);
// either way the grant keeps most of its lease, its fence is the key's
// next, and it is the key's only holder.
func TestAdvisoryWaitsShortAndLong(t *testing.T) {
	pool := open(t, "shortwait")
	const ttl = time.Second
	ctx, cancel := context.WithTimeout(t.Context(), 20*time.Second)
	defer cancel()
	holder := dlock.New(newAdvisory(t, pool), nil)
	defer holder.Close(context.Background())
	waiter := dlock.New(newAdvisory(t, pool), nil)
	defer waiter.Close(context.Background())
	key := "shortwait/" + dlock.NewToken().String()
	for _, hold := range []time.Duration{50 * time.Millisecond, 3 * ttl / 5} {
		lk, err := holder.Acquire(ctx, key, dlock.WithTTL(ttl))
		if err != nil {
			t.Fatal(err)
		}
		time.AfterFunc(hold, func() { lk.Release(context.Background()) })
		w, err := waiter.Acquire(ctx, key, dlock.WithTTL(ttl))
		if err != nil {
			t.Fatalf("held for %s: wait: %v", hold, err)
		}
		if left := time.Until(w.Deadline()); left < ttl/2 {
			t.Errorf("held for %s: %s left of the waiter's %s lease right after its grant", hold, left, ttl)
		}
		if w.Fence() <= lk.Fence() {
			t.Errorf("held for %s: the waiter's fence %d, its holder's %d", hold, w.Fence(), lk.Fence())
		}
		hs, err := waiter.List(ctx, key)
		if err != nil || len(hs) != 1 || hs[0].Fence != w.Fence() {
			t.Errorf("held for %s: holders %+v (%v); want the waiter alone", hold, hs, err)
		}
		if err := w.Release(ctx); err != nil {
			t.Fatal(err)
		}
	}
}

// TestAdvisoryWaitsAtOnceOnAKeyHeldLately: a blocking acquisition of a
// free key takes it on the main session, as a try does; one of a key that
// a try found held within the last second waits on a session of its own at
// once, with no try first, and takes it there when it is free; a second
// later the key is tried first again.
func TestAdvisoryWaitsAtOnceOnAKeyHeldLately(t *testing.T) {
	ctx := t.Context()
	a, other := newAdvisory(t, nil), newAdvisory(t, nil)
	req := func(key string) dlock.Request {
		return dlock.Request{Key: key, Token: dlock.NewToken(), TTL: 10 * time.Second, Mode: dlock.ModeExclusive}
	}
	cold, held := locktest.UniqueKey("advisory-direct"), locktest.UniqueKey("advisory-direct")
	cases := []struct {
		what   string
		key    string
		onMain bool
	}{
		{"a free key", cold, true},
		{"a free key held lately", held, false},
		{"the same key a second later", held, true},
	}
	for i, c := range cases {
		switch i {
		case 1:
			h := req(c.key)
			if res, err := other.Acquire(ctx, h); err != nil || !res.Acquired {
				t.Fatalf("other: %+v, %v", res, err)
			}
			if res, err := a.Acquire(ctx, req(c.key)); err != nil || res.Acquired {
				t.Fatalf("a try of a held key: %+v, %v", res, err)
			}
			if err := other.Release(ctx, c.key, h.Token); err != nil {
				t.Fatal(err)
			}
		case 2:
			time.Sleep(pglock.RefusalsLast)
		}
		r := req(c.key)
		res, err := a.AcquireWait(ctx, r)
		if err != nil || !res.Acquired || res.Fence == 0 {
			t.Fatalf("%s: %+v, %v", c.what, res, err)
		}
		if got := pglock.OnMainSession(a, r.Key, r.Token); got != c.onMain {
			t.Errorf("%s: on the main session: %v, want %v", c.what, got, c.onMain)
		}
		if err := a.Release(ctx, r.Key, r.Token); err != nil {
			t.Fatalf("%s: release: %v", c.what, err)
		}
	}
}
