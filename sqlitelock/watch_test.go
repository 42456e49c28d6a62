package sqlitelock_test

import (
	"context"
	"fmt"
	"os"
	"slices"
	"strings"
	"testing"
	"time"

	"github.com/dlock-dev/dlock"
)

// holderWatcher is b as a dlock.HolderWatcher, or the end of t.
func holderWatcher(t *testing.T, b dlock.Backend) dlock.HolderWatcher {
	t.Helper()
	hw, ok := b.(dlock.HolderWatcher)
	if !ok {
		t.Fatal("rule: the Backend delivers every change of holders (dlock.HolderWatcher)")
	}
	return hw
}

// describe is holders as "fence:metadata" in order.
func describe(hs []dlock.LockInfo) string {
	var s []string
	for _, h := range hs {
		s = append(s, fmt.Sprintf("%d:%s", h.Fence, h.Metadata))
	}
	return "[" + strings.Join(s, " ") + "]"
}

// TestWatchHoldersEveryChange makes changes of every kind through another
// Backend on the same file (as another process would: no wake-up) without
// waiting for the watcher, which must report the holders after each, in
// order.
func TestWatchHoldersEveryChange(t *testing.T) {
	path := os.Getenv(envDB)
	w, b := open(t, path), open(t, path)
	ctx := context.Background()
	if err := b.Migrate(ctx); err != nil {
		t.Fatal(err)
	}
	hw := holderWatcher(t, w)
	k := testKey(t, "k")
	wctx, cancel := context.WithCancel(ctx)
	defer cancel()
	now, ch, err := hw.WatchHolders(wctx, k)
	if err != nil || len(now) != 0 {
		t.Fatalf("WatchHolders of a new key: %v %v", now, err)
	}
	ms := dlock.Backend(b).(dlock.MetadataSetter)
	x := request(k, dlock.ModeExclusive, 0)
	x.Metadata = "a"
	f1 := acquire(t, b, x).Fence
	if err := ms.SetMetadata(ctx, k, x.Token, "b"); err != nil {
		t.Fatal(err)
	}
	if err := b.Release(ctx, k, x.Token); err != nil {
		t.Fatal(err)
	}
	s1, s2 := request(k, dlock.ModeShared, 0), request(k, dlock.ModeShared, 0)
	f2, f3 := acquire(t, b, s1).Fence, acquire(t, b, s2).Fence
	if err := ms.SetMetadata(ctx, k, s2.Token, "c"); err != nil {
		t.Fatal(err)
	}
	if err := b.Release(ctx, k, s1.Token); err != nil {
		t.Fatal(err)
	}
	if err := dlock.Backend(b).(dlock.ForceReleaser).ForceRelease(ctx, k); err != nil {
		t.Fatal(err)
	}
	want := []string{
		fmt.Sprintf("[%d:a]", f1), fmt.Sprintf("[%d:b]", f1), "[]",
		fmt.Sprintf("[%d:]", f2), fmt.Sprintf("[%d: %d:]", f2, f3), fmt.Sprintf("[%d: %d:c]", f2, f3),
		fmt.Sprintf("[%d:c]", f3), "[]",
	}
	var got []string
	for len(got) < len(want) {
		select {
		case hs, ok := <-ch:
			if !ok {
				t.Fatalf("rule: the watch lasts; closed after %v", got)
			}
			got = append(got, describe(hs))
		case <-time.After(5 * time.Second):
			t.Fatalf("rule: every change is reported; saw %v, want %v", got, want)
		}
	}
	if !slices.Equal(got, want) {
		t.Errorf("rule: the holders after each change, in order; saw %v, want %v", got, want)
	}
}

// TestWatchHoldersPrunedPositionCloses lets a watcher fall behind by more
// changes than the journal keeps of a key: its channel must close (the
// caller then watches anew) rather than skip the changes it lost.
func TestWatchHoldersPrunedPositionCloses(t *testing.T) {
	path := os.Getenv(envDB)
	w, b := open(t, path), open(t, path)
	ctx := context.Background()
	if err := b.Migrate(ctx); err != nil {
		t.Fatal(err)
	}
	k := testKey(t, "k")
	wctx, cancel := context.WithCancel(ctx)
	defer cancel()
	_, ch, err := holderWatcher(t, w).WatchHolders(wctx, k)
	if err != nil {
		t.Fatal(err)
	}
	// The watcher reads the first grant and waits to hand it over while
	// the others come and go.
	const changes = 2 * 300
	for range changes / 2 {
		req := request(k, dlock.ModeExclusive, 0)
		acquire(t, b, req)
		if err := b.Release(ctx, k, req.Token); err != nil {
			t.Fatal(err)
		}
	}
	n := 0
	for {
		select {
		case _, ok := <-ch:
			if !ok {
				if n >= changes {
					t.Fatalf("closed after all %d changes", n)
				}
				return
			}
			n++
			if n == changes {
				t.Fatalf("rule: a watcher behind by more than the journal keeps is closed; it saw all %d changes", n)
			}
		case <-time.After(10 * time.Second):
			t.Fatalf("rule: a watcher whose position was pruned is closed; still open after %d receives", n)
		}
	}
}
