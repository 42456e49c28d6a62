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
func (s *suite) minHold(t *testing.T) {
	const d = 1200 * time.Millisecond // past the TTL
	if _, ok := s.newBackend(t).(dlock.TTLExtender); !ok {
		l := lockerOver(t, s.newBackend(t))
		if _, err := l.TryAcquire(ctxT(t, 10*time.Second), key(t, "k"), dlock.WithMinHold(d)); !errors.Is(err, dlock.ErrUnsupported) {
			t.Errorf("rule: a store that is not a TTLExtender refuses a minimum hold; got %v, want ErrUnsupported", err)
		}
		return
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
