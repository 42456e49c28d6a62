package locktest

import (
	"context"
	"errors"
	"testing"
	"time"

	"github.com/dlock-dev/dlock"
)

// waitersOf returns the waiters of k that wl lists under prefix.
func waitersOf(t *testing.T, wl dlock.WaiterLister, prefix, k string) []dlock.WaiterInfo {
	t.Helper()
	ws, err := wl.ListWaiters(ctxT(t, 10*time.Second), prefix)
	if err != nil {
		t.Fatalf("ListWaiters(%q): %v", prefix, err)
	}
	var out []dlock.WaiterInfo
	for _, w := range ws {
		if w.Key == k {
			out = append(out, w)
		}
	}
	return out
}

// untilWaiters polls wl until k has n waiters, for at most 15 s.
func untilWaiters(t *testing.T, wl dlock.WaiterLister, prefix, k string, n int, rule string) []dlock.WaiterInfo {
	t.Helper()
	deadline := time.Now().Add(15 * time.Second)
	for {
		ws := waitersOf(t, wl, prefix, k)
		if len(ws) == n {
			return ws
		}
		if time.Now().After(deadline) {
			t.Fatalf("rule: %s; ListWaiters shows %d waiters of %q (%+v), want %d", rule, len(ws), k, ws, n)
		}
		time.Sleep(20 * time.Millisecond)
	}
}

// listWaiters checks that an acquisition waiting for a held key shows in
// ListWaiters (with its owner, where the store records tokens) until it
// takes the key, and until it gives up.
func (s *suite) listWaiters(t *testing.T) {
	wl, ok := s.newBackend(t).(dlock.WaiterLister)
	if !ok {
		t.Skip("backend does not implement dlock.WaiterLister")
	}
	holder, _ := s.locker(t)
	waiter, _ := s.locker(t)
	base := key(t, "")
	k := base + "k"
	ws, err := wl.ListWaiters(ctxT(t, 10*time.Second), base)
	if errors.Is(err, dlock.ErrUnsupported) {
		t.Skipf("the backend cannot list waiters as configured: %v", err)
	}
	if err != nil || len(ws) != 0 {
		t.Fatalf("ListWaiters of keys nobody uses = %+v, %v; want none", ws, err)
	}
	lk := mustAcquire(t, holder, k, dlock.WithOwner("alice"))
	if ws := waitersOf(t, wl, base, k); len(ws) != 0 {
		t.Fatalf("rule: a holder is not a waiter; ListWaiters = %+v", ws)
	}
	got := make(chan error, 1)
	var wlk *dlock.Lock
	before := time.Now()
	go func() {
		var err error
		wlk, err = waiter.Acquire(ctxT(t, 60*time.Second), k, dlock.WithTTL(ttl), dlock.WithOwner("bob"), dlock.WithMetadata("job=waits"))
		got <- err
	}()
	w := untilWaiters(t, wl, base, k, 1, "an acquisition waiting for a held key shows")[0]
	if w.Client == "" && (w.Owner != "bob" || w.Metadata != "job=waits") {
		t.Errorf("waiter %+v: want owner bob, metadata job=waits (or the store's Client name)", w)
	}
	if !w.Since.IsZero() && (w.Since.Before(before.Add(-2*time.Second)) || w.Since.After(time.Now().Add(2*time.Second))) {
		t.Errorf("waiter's Since %v is not around when it began to wait (%v)", w.Since, before)
	}
	if ws, err := wl.ListWaiters(ctxT(t, 10*time.Second), key(t, "elsewhere")); err != nil || len(ws) != 0 {
		t.Errorf("ListWaiters of another prefix = %+v, %v; want none", ws, err)
	}
	if err := lk.Release(ctxT(t, 10*time.Second)); err != nil {
		t.Fatal(err)
	}
	if err := <-got; err != nil {
		t.Fatalf("waiter's Acquire: %v", err)
	}
	if ws := waitersOf(t, wl, base, k); len(ws) != 0 {
		t.Errorf("rule: a waiter that took the key no longer waits; ListWaiters = %+v", ws)
	}

	// A waiter that gives up leaves the list.
	gctx, giveUp := context.WithCancel(context.Background())
	defer giveUp()
	go func() {
		_, err := holder.Acquire(gctx, k, dlock.WithTTL(ttl), dlock.WithOwner("carol"))
		got <- err
	}()
	untilWaiters(t, wl, base, k, 1, "a second waiter shows")
	giveUp()
	if err := <-got; !errors.Is(err, dlock.ErrNotAcquired) {
		t.Errorf("Acquire given up: %v, want ErrNotAcquired", err)
	}
	untilWaiters(t, wl, base, k, 0, "a waiter that gave up leaves the list")
	if err := wlk.Release(ctxT(t, 10*time.Second)); err != nil {
		t.Fatal(err)
	}
}

// keyOf returns the KeyInfo of k that kl lists under prefix, and whether
// there is one.
func keyOf(t *testing.T, kl dlock.KeyLister, prefix, k string) (dlock.KeyInfo, bool) {
	t.Helper()
	ks, err := kl.ListKeys(ctxT(t, 10*time.Second), prefix)
	if err != nil {
		t.Fatalf("ListKeys(%q): %v", prefix, err)
	}
	for _, ki := range ks {
		if ki.Key == k {
			return ki, true
		}
	}
	return dlock.KeyInfo{}, false
}

// listKeys checks that ListKeys shows a held key with its holder, and a
// freed one with its last holder, its last fence and when and how it was
// freed.
func (s *suite) listKeys(t *testing.T) {
	b := s.newBackend(t)
	kl, ok := b.(dlock.KeyLister)
	if !ok {
		t.Skip("backend does not implement dlock.KeyLister")
	}
	l, _ := s.locker(t)
	base := key(t, "")
	k := base + "nightly-report"
	if ks, err := kl.ListKeys(ctxT(t, 10*time.Second), base); err != nil || len(ks) != 0 {
		t.Fatalf("ListKeys of keys nobody used = %+v, %v; want none", ks, err)
	}
	lk := mustAcquire(t, l, k, dlock.WithOwner("alice"), dlock.WithMetadata("host=a"))
	ki, ok := keyOf(t, kl, base, k)
	switch {
	case !ok:
		t.Fatalf("rule: ListKeys shows a held key; %q is missing", k)
	case len(ki.Holders) != 1 || ki.Holders[0].Owner != "alice" || ki.Holders[0].Fence != lk.Fence():
		t.Errorf("held key %+v: want one holder alice with fence %d", ki, lk.Fence())
	case ki.Last != nil || !ki.FreedAt.IsZero() || ki.Fence != lk.Fence():
		t.Errorf("held key %+v: want no last holder, no FreedAt, fence %d", ki, lk.Fence())
	}
	beforeRelease := time.Now()
	if err := lk.Release(ctxT(t, 10*time.Second)); err != nil {
		t.Fatal(err)
	}
	ki, ok = keyOf(t, kl, base, k)
	switch {
	case !ok:
		t.Fatalf("rule: ListKeys shows a released key; %q is missing", k)
	case len(ki.Holders) != 0:
		t.Errorf("released key %+v has holders", ki)
	case ki.Fence != lk.Fence():
		t.Errorf("released key's Fence = %d, want the last fence %d", ki.Fence, lk.Fence())
	case ki.Last == nil || ki.Last.Owner != "alice" || ki.Last.Metadata != "host=a" || ki.Last.Fence != lk.Fence():
		t.Errorf("released key's Last = %+v, want owner alice, metadata host=a, fence %d", ki.Last, lk.Fence())
	case ki.Expired:
		t.Errorf("rule: a released key is not Expired; %+v", ki)
	case ki.FreedAt.Before(beforeRelease.Add(-2*time.Second)) || ki.FreedAt.After(time.Now().Add(2*time.Second)):
		t.Errorf("FreedAt %v is not when the key was released (%v)", ki.FreedAt, beforeRelease)
	}

	// A lease nobody renews expires: the key is free, and says so.
	e := base + "expires"
	res, err := b.Acquire(ctxT(t, 10*time.Second), dlock.Request{Key: e, Token: dlock.NewToken(), Owner: "carol", TTL: ttl, Metadata: "host=c"})
	if err != nil || !res.Acquired {
		t.Fatalf("Acquire(%q) = %+v, %v", e, res, err)
	}
	deadline := time.Now().Add(15 * time.Second)
	for {
		ki, ok = keyOf(t, kl, base, e)
		if ok && len(ki.Holders) == 0 {
			break
		}
		if time.Now().After(deadline) {
			t.Fatalf("rule: an expired lease leaves its key free; ListKeys = %+v (listed %v)", ki, ok)
		}
		time.Sleep(50 * time.Millisecond)
	}
	if !ki.Expired || ki.Last == nil || ki.Last.Owner != "carol" || ki.Last.Fence != res.Fence || ki.Fence != res.Fence {
		t.Errorf("expired key %+v (last %+v): want Expired, last holder carol with fence %d", ki, ki.Last, res.Fence)
	}
	if ks, err := kl.ListKeys(ctxT(t, 10*time.Second), key(t, "elsewhere")); err != nil || len(ks) != 0 {
		t.Errorf("ListKeys of another prefix = %+v, %v; want none", ks, err)
	}
}
