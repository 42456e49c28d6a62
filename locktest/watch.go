package locktest

import (
	"context"
	"errors"
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
	deadline := time.After(notifyBound)
	for {
		select {
		case _, open := <-ch:
			if open {
				continue
			}
			return
		case <-deadline:
			t.Fatalf("rule: a watch's channel is closed when its context ends; open %s after", notifyBound)
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
