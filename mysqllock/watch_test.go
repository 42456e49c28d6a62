package mysqllock_test

import (
	"context"
	"fmt"
	"slices"
	"strings"
	"testing"
	"time"

	"github.com/dlock-dev/dlock"
	"github.com/dlock-dev/dlock/locktest"
	"github.com/dlock-dev/dlock/mysqllock"
)

// describe is holders as "fence:metadata" in order.
func describe(hs []dlock.LockInfo) string {
	var s []string
	for _, h := range hs {
		s = append(s, fmt.Sprintf("%d:%s", h.Fence, h.Metadata))
	}
	return "[" + strings.Join(s, " ") + "]"
}

// TestWatchHoldersPrunedPositionCloses lets a watcher fall behind by more
// changes than the journal keeps of a key: its channel must close (the
// caller then watches anew) rather than skip the changes it lost.
func TestWatchHoldersPrunedPositionCloses(t *testing.T) {
	w, b := newBackend(t, ""), newBackend(t, "")
	ctx := t.Context()
	k := locktest.UniqueKey("pruned")
	wctx, cancel := context.WithCancel(ctx)
	defer cancel()
	_, ch, err := w.WatchHolders(wctx, k)
	if err != nil {
		t.Fatal(err)
	}
	// The watcher reads the first grant and waits to hand it over while
	// the others come and go.
	const changes = 2 * 300
	for range changes / 2 {
		req := request(k, dlock.ModeExclusive, 0, 10*time.Second)
		mustGrant(t, b, req)
		if err := b.Release(ctx, k, req.Token); err != nil {
			t.Fatal(err)
		}
	}
	n := 0
	for {
		select {
		case _, ok := <-ch:
			if !ok {
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

// TestWatchHoldersAfterTableRecreated drops a lock table whose key has
// journal entries and lets Migrate make it again: grants still work, and a
// watcher is told the new key's changes, none of the old entries that
// outlived the table.
func TestWatchHoldersAfterTableRecreated(t *testing.T) {
	db := open(t, "")
	ctx := t.Context()
	table := scoped(fmt.Sprintf("dlock_re%d", time.Now().UnixNano()%1e12))
	t.Cleanup(func() {
		for _, suffix := range []string{"", "_session", "_rows", "_claims", "_holders", "_journal", "_epoch", "_run"} {
			db.ExecContext(context.Background(), "DROP TABLE IF EXISTS "+table+suffix)
		}
	})
	newB := func() *mysqllock.Backend {
		b, err := mysqllock.New(db, &mysqllock.Options{Table: table})
		if err != nil {
			t.Fatal(err)
		}
		t.Cleanup(func() { b.Close() })
		if err := b.Migrate(ctx); err != nil {
			t.Fatal(err)
		}
		return b
	}
	cycle := func(b *mysqllock.Backend, meta string) uint64 {
		req := request("k", dlock.ModeExclusive, 0, 10*time.Second)
		req.Metadata = meta
		f := mustGrant(t, b, req)
		if err := b.Release(ctx, "k", req.Token); err != nil {
			t.Fatal(err)
		}
		return f
	}
	old := newB()
	for range 3 {
		cycle(old, "old")
	}
	if _, err := db.ExecContext(ctx, "DROP TABLE "+table+", "+table+"_holders"); err != nil {
		t.Fatal(err)
	}
	b := newB()
	wctx, cancel := context.WithCancel(ctx)
	defer cancel()
	_, ch, err := b.WatchHolders(wctx, "k")
	if err != nil {
		t.Fatal(err)
	}
	f := cycle(b, "new")
	want := []string{fmt.Sprintf("[%d:new]", f), "[]"}
	var got []string
	deadline := time.After(5 * time.Second)
	for len(got) < len(want) {
		select {
		case hs := <-ch:
			got = append(got, describe(hs))
		case <-deadline:
			t.Fatalf("rule: every change is reported; saw %v, want %v", got, want)
		}
	}
	select {
	case hs := <-ch:
		got = append(got, describe(hs))
	case <-time.After(300 * time.Millisecond): // several reads of the journal
	}
	if !slices.Equal(got, want) {
		t.Errorf("rule: a recreated table's watcher sees only its changes; saw %v, want %v", got, want)
	}
}
