package locktest

import (
	"context"
	"errors"
	"testing"
	"time"

	"github.com/dlock-dev/dlock"
)

// minHold checks WithMinHold: a release or a Close before the minimum hold
// has passed leaves the key held until it has (counted from before the
// acquisition was sent, since the store's grant came later), and no longer
// than a few seconds past it; a release after it frees the key at once.
// It holds for a lease (dlock.TTLExtender) and for a session lock whose
// store keeps the key in its row (dlock.HoldKeeper); other stores refuse
// it.
func (s *suite) minHold(t *testing.T) {
	const d = 1200 * time.Millisecond // past the TTL
	b := s.newBackend(t)
	_, extends := b.(dlock.TTLExtender)
	_, keeps := b.(dlock.HoldKeeper)
	if !extends && !keeps {
		l := lockerOver(t, s.newBackend(t))
		if _, err := l.TryAcquire(ctxT(t, 10*time.Second), key(t, "k"), dlock.WithMinHold(d)); !errors.Is(err, dlock.ErrUnsupported) {
			t.Errorf("rule: a store that is neither a TTLExtender nor a HoldKeeper refuses a minimum hold; got %v, want ErrUnsupported", err)
		}
		return
	}
	if sh, ok := b.(dlock.Sharer); ok && !extends && sh.SupportsMode(dlock.ModeShared) {
		l := lockerOver(t, s.newBackend(t))
		if _, err := l.TryAcquire(ctxT(t, 10*time.Second), key(t, "k"), dlock.Shared(), dlock.WithMinHold(d)); !errors.Is(err, dlock.ErrUnsupported) {
			t.Errorf("rule: a HoldKeeper keeps the minimum hold of exclusive locks only; a shared one: %v, want ErrUnsupported", err)
		}
	}
	other := lockerOver(t, s.newBackend(t))
	check := func(t *testing.T, let func(l *dlock.Locker, lk *dlock.Lock) error) {
		l := lockerOver(t, s.newBackend(t))
		k := key(t, "job")
		sent := time.Now()
		lk := mustAcquire(t, l, k, dlock.WithMinHold(d))
		if err := let(l, lk); err != nil {
			t.Fatalf("letting go within the minimum hold: %v", err)
		}
		mustBeHeld(t, other, k)
		next, err := other.Acquire(ctxT(t, d+10*time.Second), k, dlock.WithTTL(ttl))
		if err != nil {
			t.Fatalf("rule: a minimum hold ends; the key was not free %s after the acquisition: %v", d+10*time.Second, err)
		}
		if got := time.Since(sent); got < d {
			t.Errorf("rule: WithMinHold(%s) keeps the key at least that long; another client took it %s after the acquisition was sent", d, got)
		}
		if next.Fence() <= lk.Fence() {
			t.Errorf("rule: fences increase; %d after %d", next.Fence(), lk.Fence())
		}
		if err := next.Release(context.Background()); err != nil {
			t.Fatal(err)
		}
	}
	t.Run("Release", func(t *testing.T) {
		t.Parallel()
		check(t, func(_ *dlock.Locker, lk *dlock.Lock) error { return lk.Release(ctxT(t, 10*time.Second)) })
	})
	t.Run("Close", func(t *testing.T) {
		t.Parallel()
		check(t, func(l *dlock.Locker, _ *dlock.Lock) error { return l.Close(ctxT(t, 10*time.Second)) })
	})
	t.Run("ReleaseAfterIt", func(t *testing.T) {
		t.Parallel()
		l := lockerOver(t, s.newBackend(t))
		k := key(t, "done")
		lk := mustAcquire(t, l, k, dlock.WithMinHold(ttl/2))
		time.Sleep(ttl/2 + 100*time.Millisecond)
		if err := lk.Release(ctxT(t, 10*time.Second)); err != nil {
			t.Fatal(err)
		}
		mustBeFree(t, other, k)
	})
}

// lockDelay checks WithLockDelay: a lease lost without a release keeps the
// key from others for the delay past the TTL (counted from before the
// acquisition was sent: a lower bound of the store's grant), and the
// Locker does not release it behind the holder's back; a release frees the
// key at once. A backend whose locks end with their session keeps the delay
// itself (dlock.LockDelayer) or refuses it. Its lock ends when the holder's
// renewals fail (the Locker abandons it), not at TTL + lock-delay: the key
// then stays held for the lock-delay after the holder was told of the loss,
// which is the promise for both kinds (a lease's holder is told a margin
// before its TTL).
func (s *suite) lockDelay(t *testing.T) {
	const d = time.Second
	b := s.newBackend(t)
	_, session := b.(dlock.SessionBound)
	if _, keeps := b.(dlock.LockDelayer); session && !keeps {
		l := lockerOver(t, s.newBackend(t))
		if _, err := l.TryAcquire(ctxT(t, 10*time.Second), key(t, "k"), dlock.WithLockDelay(d)); !errors.Is(err, dlock.ErrUnsupported) {
			t.Errorf("rule: a session-bound store refuses a lock-delay; got %v, want ErrUnsupported", err)
		}
		return
	}
	l, f := s.locker(t)
	other, _ := s.locker(t)
	released := key(t, "released")
	lk := mustAcquire(t, l, released, dlock.WithLockDelay(d))
	if err := lk.Release(ctxT(t, 10*time.Second)); err != nil {
		t.Fatal(err)
	}
	mustBeFree(t, other, released)
	closing, _ := s.locker(t)
	mustAcquire(t, closing, released, dlock.WithLockDelay(d))
	if err := closing.Close(ctxT(t, 10*time.Second)); err != nil {
		t.Fatal(err)
	}
	mustBeFree(t, other, released) // Close releases: no lock-delay either

	lost := key(t, "lost")
	sent := time.Now()
	lk = mustAcquire(t, l, lost, dlock.WithLockDelay(d))
	f.failExtend.Store(true) // renewals fail; releases would still reach the store
	waitDone(t, lk, 2*ttl, "a lease that cannot be renewed is reported lost after its TTL, not its TTL plus the lock-delay")
	told := time.Now()
	if !errors.Is(lk.Err(), dlock.ErrLockLost) {
		t.Fatalf("Err: %v, want ErrLockLost", lk.Err())
	}
	mustBeHeld(t, other, lost)
	next, err := other.Acquire(ctxT(t, ttl+d+10*time.Second), lost, dlock.WithTTL(ttl))
	if err != nil {
		t.Fatalf("rule: a lock-delay ends; the key was not free: %v", err)
	}
	if got := time.Since(told); got < d {
		t.Errorf("rule: a lost lock keeps its key for the lock-delay (%s) after its holder is told; another client took it %s after", d, got)
	}
	if got := time.Since(sent); !session && got < ttl+d {
		t.Errorf("rule: a lost lease keeps the key for TTL + lock-delay (%s); another client took it %s after the acquisition was sent", ttl+d, got)
	}
	_ = next.Release(context.Background())
	if _, err := other.TryAcquire(ctxT(t, 10*time.Second), lost, dlock.WithLockDelay(-time.Second)); !errors.Is(err, dlock.ErrInvalidOption) {
		t.Errorf("a negative lock-delay: %v, want ErrInvalidOption", err)
	}
	if !s.inProcess {
		s.lockDelayKilled(t, other, session)
	}
	if session {
		s.lockDelayOfEndedSession(t)
	}
}

// lockDelayOfEndedSession checks a dlock.LockDelayer at the Backend: a
// session that ends while it holds a lock with a lock-delay (ended by
// ForceRelease) keeps the key from every acquisition for the delay from
// then, as a refusal with what is left of it that changes nothing (a
// second attempt finds no more left, and the next fence follows the
// holder's); a waiter is handed the key once the delay ends; a release
// frees the key at once; Abandon keeps the delay as a session's end does.
func (s *suite) lockDelayOfEndedSession(t *testing.T) {
	const d = 2 * time.Second
	type delayer interface {
		dlock.Waiter
		dlock.ForceReleaser
		dlock.LockDelayer
	}
	a, b, c := s.newBackend(t), s.newBackend(t), s.newBackend(t) // c: a does not know at once that its session ended
	bw, ok := b.(delayer)
	if !ok {
		t.Skip("the backend cannot end a holder's session (dlock.ForceReleaser) or wait (dlock.Waiter)")
	}
	ctx := ctxT(t, 30*time.Second)
	k := key(t, "ended")
	req := func(delay time.Duration) dlock.Request {
		return dlock.Request{Key: k, Token: dlock.NewToken(), TTL: ttl + delay, LockDelay: delay}
	}
	grant := func(b dlock.Backend, r dlock.Request) uint64 {
		t.Helper()
		res, err := b.Acquire(ctx, r)
		if err != nil || !res.Acquired {
			t.Fatalf("Acquire: %+v, %v; want a grant", res, err)
		}
		return res.Fence
	}
	if _, err := a.Acquire(ctx, dlock.Request{Key: k, Token: dlock.NewToken(), TTL: ttl, LockDelay: ttl}); !errors.Is(err, dlock.ErrInvalidOption) {
		t.Errorf("a lock-delay as long as the store's lease: %v; want ErrInvalidOption", err)
	}
	held := grant(a, req(d))
	if err := bw.ForceRelease(ctx, k); err != nil {
		t.Fatal(err)
	}
	ended := time.Now()
	// The server ends the session (and frees its lock) a moment after it
	// is told to: until then a refusal has no Remaining.
	var left time.Duration
	for try := 0; try < 2; {
		res, err := b.Acquire(ctx, req(0))
		switch {
		case err != nil:
			t.Fatal(err)
		case res.Acquired:
			t.Fatalf("rule: a lock-delay holds a key whose session ended; it was granted %s after", time.Since(ended))
		case res.Remaining == 0 && try == 0 && time.Since(ended) < d:
			time.Sleep(10 * time.Millisecond)
			continue
		case res.Remaining <= 0 || res.Remaining > d || try > 0 && res.Remaining > left:
			t.Fatalf("attempt %d: Remaining %s; want in (0, %s], no more than the %s before", try, res.Remaining, d, left)
		}
		left = res.Remaining
		try++
	}
	waiter := req(d)
	var res dlock.Result
	for !res.Acquired && ctx.Err() == nil {
		var err error
		if res, err = bw.AcquireWait(ctx, waiter); err != nil {
			t.Fatal(err)
		}
	}
	switch {
	case !res.Acquired:
		t.Fatal("rule: a lock-delay ends; a waiter was not handed the key")
	case time.Since(ended) < d:
		t.Errorf("rule: a lock-delay holds a key whose session ended; a waiter took it %s after, want %s", time.Since(ended), d)
	case res.Fence <= held:
		t.Errorf("fencing: %d after the ended holder's %d", res.Fence, held)
	}
	if err := b.Release(ctx, k, waiter.Token); err != nil {
		t.Fatal(err)
	}
	next := req(d)
	grant(c, next) // a release frees the key at once
	if err := c.(dlock.LockDelayer).Abandon(ctx, k, next.Token); err != nil {
		t.Fatal(err)
	}
	if res, err := b.Acquire(ctx, req(0)); err != nil || res.Acquired || res.Remaining <= 0 {
		t.Fatalf("rule: an abandoned lock keeps its lock-delay; an acquisition after Abandon: %+v, %v", res, err)
	}
	if err := c.Release(ctx, k, next.Token); !errors.Is(err, dlock.ErrNotHeld) {
		t.Errorf("Release after Abandon: %v; want ErrNotHeld", err)
	}
}

// killedDelay is the lock-delay of the "hold-delay" helper.
const killedDelay = 2 * time.Second

// lockDelayKilled checks the lock-delay of a holder whose process is
// killed: its session or connection ends with it, and the key stays held
// until TTL + lock-delay after the acquisition all the same (a lease), or
// for the lock-delay after the kill (a session lock, which the server frees
// when the session ends: the next acquirer finds that it ended without a
// release and keeps the key for the lock-delay from then).
func (s *suite) lockDelayKilled(t *testing.T, other *dlock.Locker, session bool) {
	k := key(t, "killed")
	sent := time.Now()
	held := s.spawnHolder(t, k, "hold-delay")
	held.kill(t)
	killed := time.Now()
	next, err := other.Acquire(ctxT(t, ttl+killedDelay+s.crashBound), k, dlock.WithTTL(ttl))
	if err != nil {
		t.Fatalf("rule: a killed holder's lock-delay ends; the key was not free: %v", err)
	}
	switch got := time.Since(sent); {
	case session && time.Since(killed) < killedDelay:
		t.Errorf("rule: a killed holder's session lock stays held for the lock-delay (%s) after the kill; another client took it %s after", killedDelay, time.Since(killed))
	case !session && got < ttl+killedDelay:
		t.Errorf("rule: a killed holder's key stays held for TTL + lock-delay (%s); another client took it %s after the acquisition was sent", ttl+killedDelay, got)
	}
	if next.Fence() <= held.fence {
		t.Errorf("fencing: %d after the killed holder's %d", next.Fence(), held.fence)
	}
	if err := next.Release(ctxT(t, 10*time.Second)); err != nil {
		t.Fatal(err)
	}
	mustBeFree(t, other, k) // the lock-delay was spent; a release frees at once
}
