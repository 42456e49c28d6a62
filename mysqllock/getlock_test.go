package mysqllock_test

import (
	"sync"
	"testing"
	"time"

	"github.com/dlock-dev/dlock"
	"github.com/dlock-dev/dlock/locktest"
	"github.com/dlock-dev/dlock/mysqllock"
)

// TestConcurrentReleasesParkTheSessionOnce: two releases of one lock at
// once (the Locker's clean-up racing the caller's own) give its session
// back once: a session parked twice would be handed to two acquisitions,
// which would then share its named locks.
func TestConcurrentReleasesParkTheSessionOnce(t *testing.T) {
	ctx := t.Context()
	g := newGetLock(t, "")
	for i := range 30 {
		req := dlock.Request{Key: locktest.UniqueKey("park-once"), Token: dlock.NewToken(), TTL: 10 * time.Second}
		res, err := mysqllock.AcquireOnOwnSession(ctx, g, req)
		if err != nil || !res.Acquired {
			t.Fatalf("round %d: %+v, %v", i, res, err)
		}
		var wg sync.WaitGroup
		for range 2 {
			wg.Add(1)
			go func() {
				defer wg.Done()
				_ = g.Release(ctx, req.Key, req.Token)
			}()
		}
		wg.Wait()
		if mysqllock.IdleSessionsTwice(g) {
			t.Fatalf("round %d: a session was parked twice after two releases of its one lock", i)
		}
	}
}

// TestGetLockWaitsAtOnceOnAKeyHeldLately: a blocking acquisition of a free
// key takes it on the shared session, as a try does; one of a key that a
// try found held within the last second waits on a session of its own at
// once, with no try first, and takes it there when it is free; a second
// later the key is tried first again.
func TestGetLockWaitsAtOnceOnAKeyHeldLately(t *testing.T) {
	ctx := t.Context()
	g, other := newGetLock(t, ""), newGetLock(t, "")
	req := func(key string) dlock.Request {
		return dlock.Request{Key: key, Token: dlock.NewToken(), TTL: 10 * time.Second}
	}
	take := func(what string, r dlock.Request, onMain bool) {
		t.Helper()
		res, err := g.AcquireWait(ctx, r)
		if err != nil || !res.Acquired || res.Fence == 0 {
			t.Fatalf("%s: %+v, %v", what, res, err)
		}
		if got := mysqllock.OnMainSession(g, r.Token); got != onMain {
			t.Errorf("%s: on the shared session: %v, want %v", what, got, onMain)
		}
		if err := g.Release(ctx, r.Key, r.Token); err != nil {
			t.Fatalf("%s: release: %v", what, err)
		}
	}
	// refuse has g's try refused while other holds key, which it then
	// releases.
	refuse := func(key string) {
		t.Helper()
		held := req(key)
		if res, err := other.Acquire(ctx, held); err != nil || !res.Acquired {
			t.Fatalf("other: %+v, %v", res, err)
		}
		if res, err := g.Acquire(ctx, req(key)); err != nil || res.Acquired {
			t.Fatalf("a try of a held key: %+v, %v", res, err)
		}
		if err := other.Release(ctx, key, held.Token); err != nil {
			t.Fatal(err)
		}
	}
	take("a free key", req(locktest.UniqueKey("cold")), true)
	key := locktest.UniqueKey("held-lately")
	refuse(key)
	take("a free key held lately", req(key), false)
	time.Sleep(mysqllock.HeldFor)
	take("the same key a second later", req(key), true)

	// In a pool with a limit a session of its own takes one of few
	// slots: a free key held lately is tried first there.
	db := open(t, "")
	db.SetMaxOpenConns(4)
	var err error
	if g, err = mysqllock.NewGetLock(db, &mysqllock.Options{Table: testTable}); err != nil {
		t.Fatal(err)
	}
	defer g.Close()
	refuse(key)
	take("a free key held lately, in a pool with a limit", req(key), true)
}
