package locktest

import (
	"cmp"
	"context"
	"errors"
	"fmt"
	"slices"
	"strings"
	"testing"
	"time"

	"github.com/dlock-dev/dlock"
)

// notifyBound is how long a watch may take to report a change: far longer
// than any store's notification, short enough that a watch that reports
// nothing fails the test in reasonable time.
const notifyBound = 10 * time.Second

// watch checks dlock.Watcher: a watch receives after a grant, a release
// and a metadata change made after it began, from another client, and its
// channel is closed when its context ends.
func (s *suite) watch(t *testing.T) {
	w, ok := s.newBackend(t).(dlock.Watcher)
	if !ok {
		t.Skip("backend does not implement dlock.Watcher")
	}
	b := s.newBackend(t)
	k := key(t, "watched")
	wctx, stop := context.WithCancel(ctxT(t, time.Minute))
	ch, err := w.Watch(wctx, k)
	if err != nil {
		t.Fatalf("Watch: %v", err)
	}
	// A change must be seen: wait for a receive, then let late duplicates
	// of that change arrive and drop them, so that the next step's receive
	// is its own.
	seen := func(what string) {
		t.Helper()
		select {
		case _, open := <-ch:
			if !open {
				t.Fatalf("rule: a watch lasts until its context ends; closed before %s was seen", what)
			}
		case <-time.After(notifyBound):
			t.Fatalf("rule: a watch reports every change; %s not seen within %s", what, notifyBound)
		}
		time.Sleep(200 * time.Millisecond)
		for {
			select {
			case <-ch:
				continue
			default:
			}
			break
		}
	}
	req := dlock.Request{Key: k, Token: dlock.NewToken(), TTL: 30 * time.Second, Metadata: "v1"}
	res, err := b.Acquire(ctxT(t, 10*time.Second), req)
	if err != nil || !res.Acquired {
		t.Fatalf("Acquire: %+v %v", res, err)
	}
	seen("a grant")
	if ms, ok := b.(dlock.MetadataSetter); ok {
		if err := ms.SetMetadata(ctxT(t, 10*time.Second), k, req.Token, "v2"); err != nil {
			t.Fatalf("SetMetadata: %v", err)
		}
		seen("a metadata change")
	}
	if err := b.Release(ctxT(t, 10*time.Second), k, req.Token); err != nil {
		t.Fatalf("Release: %v", err)
	}
	seen("a release")
	stop()
	closedWithin(t, ch, "a watch's channel is closed when its context ends")
}

// closedWithin drains ch until it is closed, failing after notifyBound.
func closedWithin[T any](t *testing.T, ch <-chan T, rule string) {
	t.Helper()
	deadline := time.After(notifyBound)
	for {
		select {
		case _, open := <-ch:
			if !open {
				return
			}
		case <-deadline:
			t.Fatalf("rule: %s; open %s after", rule, notifyBound)
		}
	}
}

// setMetadata checks dlock.MetadataSetter: only the holder's token changes
// the metadata, which the listing then shows; a wrong token or a released
// lease is ErrNotHeld and changes nothing.
func (s *suite) setMetadata(t *testing.T) {
	b := s.newBackend(t)
	ms, ok := b.(dlock.MetadataSetter)
	if !ok {
		t.Skip("backend does not implement dlock.MetadataSetter")
	}
	lister, _ := b.(dlock.Lister)
	k := key(t, "meta")
	req := dlock.Request{Key: k, Token: dlock.NewToken(), TTL: 30 * time.Second, Metadata: "v1"}
	res, err := b.Acquire(ctxT(t, 10*time.Second), req)
	if err != nil || !res.Acquired {
		t.Fatalf("Acquire: %+v %v", res, err)
	}
	listed := func() string {
		t.Helper()
		if lister == nil {
			return ""
		}
		got, err := lister.List(ctxT(t, 10*time.Second), k)
		if err != nil {
			t.Fatal(err)
		}
		for _, g := range got {
			if g.Key == k {
				return g.Metadata
			}
		}
		return "(not listed)"
	}
	if err := ms.SetMetadata(ctxT(t, 10*time.Second), k, req.Token, "v2"); err != nil {
		t.Fatalf("SetMetadata by the holder: %v", err)
	}
	if got := listed(); lister != nil && got != "v2" {
		t.Errorf("rule: SetMetadata changes what List shows; got %q, want v2", got)
	}
	if err := ms.SetMetadata(ctxT(t, 10*time.Second), k, dlock.NewToken(), "v3"); !errors.Is(err, dlock.ErrNotHeld) {
		t.Errorf("rule: only the holder's token sets metadata; another token got %v, want ErrNotHeld", err)
	}
	if got := listed(); lister != nil && got != "v2" {
		t.Errorf("rule: a refused SetMetadata changes nothing; List shows %q", got)
	}
	if err := b.Release(ctxT(t, 10*time.Second), k, req.Token); err != nil {
		t.Fatal(err)
	}
	if err := ms.SetMetadata(ctxT(t, 10*time.Second), k, req.Token, "v4"); !errors.Is(err, dlock.ErrNotHeld) {
		t.Errorf("rule: a released lease's metadata cannot be set; got %v, want ErrNotHeld", err)
	}
	// The fence and lease are the holder's: a new acquisition still works.
	req2 := dlock.Request{Key: k, Token: dlock.NewToken(), TTL: 30 * time.Second}
	res2, err := b.Acquire(ctxT(t, 10*time.Second), req2)
	if err != nil || !res2.Acquired || res2.Fence <= res.Fence {
		t.Fatalf("Acquire after SetMetadata and Release: %+v %v (fence before %d)", res2, err, res.Fence)
	}
	_ = b.Release(context.Background(), k, req2.Token)
}

// held is a grant a holder watch must report.
type held struct {
	dlock.Request
	fence uint64
}

// watchHolders checks dlock.HolderWatcher: the holders at the start, then
// the whole set of holders (key, token, fence, mode, metadata and a time of
// acquisition) after each change made by another client without
// waiting for the watcher (grants, metadata changes and releases, in every
// mode the backend grants, and a forced release), one receive per change,
// in order; no receive without a change; the channel closed when the
// context ends.
func (s *suite) watchHolders(t *testing.T) {
	hw, ok := s.newBackend(t).(dlock.HolderWatcher)
	if !ok {
		t.Skip("backend does not implement dlock.HolderWatcher")
	}
	b := s.newBackend(t)
	ms, _ := b.(dlock.MetadataSetter)
	sh, _ := b.(dlock.Sharer)
	fr, _ := b.(dlock.ForceReleaser)
	k := key(t, "holders")
	ctx := ctxT(t, 2*time.Minute)
	grant := func(mode dlock.Mode, metadata string) *held {
		t.Helper()
		h := &held{Request: dlock.Request{Key: k, Token: dlock.NewToken(), TTL: 30 * time.Second, Mode: mode, Metadata: metadata}}
		res, err := b.Acquire(ctx, h.Request)
		if err != nil || !res.Acquired {
			t.Fatalf("Acquire(%s): %+v %v", metadata, res, err)
		}
		h.fence = res.Fence
		return h
	}
	var want [][]held // the holders after each change, in fence order
	var steps []string
	after := func(step string, hs ...*held) {
		set := make([]held, 0, len(hs))
		for _, h := range hs {
			set = append(set, *h)
		}
		want, steps = append(want, set), append(steps, step)
	}
	check := func(step string, got []dlock.LockInfo, hs []held) {
		t.Helper()
		got = slices.Clone(got)
		slices.SortFunc(got, func(a, b dlock.LockInfo) int { return cmp.Compare(a.Fence, b.Fence) })
		ok := len(got) == len(hs)
		for i := 0; ok && i < len(got); i++ {
			ok = got[i].Key == k && got[i].Token == hs[i].Token && got[i].Fence == hs[i].fence &&
				got[i].Metadata == hs[i].Metadata && got[i].Mode == hs[i].Mode && !got[i].AcquiredAt.IsZero()
		}
		if !ok {
			t.Fatalf("rule: a holder watch reports the holders after every change; after %s got %s, want %s",
				step, describeHolders(got), describeHeld(hs))
		}
	}
	setMeta := func(h *held, v string, holders ...*held) {
		t.Helper()
		if ms == nil {
			return
		}
		if err := ms.SetMetadata(ctx, k, h.Token, v); err != nil {
			t.Fatalf("SetMetadata: %v", err)
		}
		h.Metadata = v
		after("a metadata change", holders...)
	}
	release := func(h *held, step string, left ...*held) {
		t.Helper()
		if err := b.Release(ctx, k, h.Token); err != nil {
			t.Fatalf("Release: %v", err)
		}
		after(step, left...)
	}

	first := grant(dlock.ModeExclusive, "first")
	wctx, stop := context.WithCancel(ctx)
	defer stop()
	now, ch, err := hw.WatchHolders(wctx, k)
	if err != nil {
		t.Fatalf("WatchHolders: %v", err)
	}
	check("the start", now, []held{*first})
	setMeta(first, "first'", first)
	release(first, "an exclusive release")
	x := grant(dlock.ModeExclusive, "x")
	after("an exclusive grant", x)
	release(x, "a release right after a grant")
	if sh != nil && sh.SupportsMode(dlock.ModeShared) {
		r1 := grant(dlock.ModeShared, "r1")
		after("a shared grant", r1)
		r2 := grant(dlock.ModeShared, "r2")
		after("a second shared grant", r1, r2)
		setMeta(r2, "r2'", r1, r2)
		release(r1, "a release that leaves a reader", r2)
		if fr != nil {
			if err := fr.ForceRelease(ctx, k); err != nil {
				t.Fatalf("ForceRelease: %v", err)
			}
			after("a forced release")
		} else {
			release(r2, "the last reader's release")
		}
	}
	for i, hs := range want {
		select {
		case got, open := <-ch:
			if !open {
				t.Fatalf("rule: a holder watch lasts while nothing is missed; closed before %s", steps[i])
			}
			check(steps[i], got, hs)
		case <-time.After(notifyBound):
			t.Fatalf("rule: a holder watch reports every change; %s not reported within %s", steps[i], notifyBound)
		}
	}
	select {
	case got, open := <-ch:
		if open {
			t.Fatalf("rule: one receive per change; an extra receive %s", describeHolders(got))
		}
	case <-time.After(200 * time.Millisecond):
	}
	stop()
	closedWithin(t, ch, "a holder watch's channel is closed when its context ends")
}

// describeHolders is holders as "fence:mode:metadata".
func describeHolders(hs []dlock.LockInfo) string {
	var s []string
	for _, h := range hs {
		s = append(s, fmt.Sprintf("%d:%v:%s", h.Fence, h.Mode, h.Metadata))
	}
	return "[" + strings.Join(s, " ") + "]"
}

// describeHeld is grants as describeHolders shows holders.
func describeHeld(hs []held) string {
	var s []string
	for _, h := range hs {
		s = append(s, fmt.Sprintf("%d:%v:%s", h.fence, h.Mode, h.Metadata))
	}
	return "[" + strings.Join(s, " ") + "]"
}
