package locktest

import (
	"context"
	"testing"
	"time"

	"github.com/dlock-dev/dlock"
)

// minHold checks WithMinHold: a release or a Close before the minimum hold
// has passed leaves the key held until it has (counted from before the
// acquisition was sent, since the store's grant came later), and no longer
// than a few seconds past it; a release after it frees the key at once.
func (s *suite) minHold(t *testing.T) {
	other, _ := s.locker(t)
	const d = 2 * time.Second
	check := func(t *testing.T, let func(l *dlock.Locker, lk *dlock.Lock) error) {
		l, _ := s.locker(t)
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
		check(t, func(_ *dlock.Locker, lk *dlock.Lock) error { return lk.Release(ctxT(t, 10*time.Second)) })
	})
	t.Run("Close", func(t *testing.T) {
		check(t, func(l *dlock.Locker, _ *dlock.Lock) error { return l.Close(ctxT(t, 10*time.Second)) })
	})
	t.Run("ReleaseAfterIt", func(t *testing.T) {
		l, _ := s.locker(t)
		k := key(t, "done")
		lk := mustAcquire(t, l, k, dlock.WithMinHold(ttl/2))
		time.Sleep(ttl/2 + 100*time.Millisecond)
		if err := lk.Release(ctxT(t, 10*time.Second)); err != nil {
			t.Fatal(err)
		}
		mustBeFree(t, other, k)
	})
}
