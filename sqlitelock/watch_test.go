package sqlitelock_test

import (
	"context"
	"os"
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
