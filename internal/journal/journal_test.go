package journal_test

import (
	"context"
	"sync"
	"testing"
	"time"

	"github.com/dlock-dev/dlock"
	"github.com/dlock-dev/dlock/internal/journal"
)

// fake is a journal in memory.
type fake struct {
	mu      sync.Mutex
	entries []journal.Entry
}

func (f *fake) Position(context.Context, string) (uint64, error) { return 0, nil }

func (f *fake) List(context.Context, string) ([]dlock.LockInfo, error) { return nil, nil }

func (f *fake) Read(_ context.Context, _ string, after uint64, limit int) ([]journal.Entry, error) {
	f.mu.Lock()
	defer f.mu.Unlock()
	var out []journal.Entry
	for _, e := range f.entries {
		if e.Seq > after && len(out) < limit {
			out = append(out, e)
		}
	}
	return out, nil
}

func (f *fake) add(es ...journal.Entry) {
	f.mu.Lock()
	f.entries = append(f.entries, es...)
	f.mu.Unlock()
}

func holder(fence uint64, mode dlock.Mode, meta string) dlock.LockInfo {
	return dlock.LockInfo{Token: dlock.NewToken(), Fence: fence, Mode: mode, Metadata: meta}
}

// receive returns the next holders, or nil and false when ch closes.
func receive(t *testing.T, ch <-chan []dlock.LockInfo) ([]dlock.LockInfo, bool) {
	t.Helper()
	select {
	case hs, ok := <-ch:
		return hs, ok
	case <-time.After(5 * time.Second):
		t.Fatal("no receive within 5 s")
		return nil, false
	}
}

// TestEntriesApplyInOrder checks the holders after each kind of entry, and
// that an entry that changes nothing is not sent.
func TestEntriesApplyInOrder(t *testing.T) {
	x, s1, s2 := holder(1, dlock.ModeExclusive, "a"), holder(2, dlock.ModeShared, ""), holder(3, dlock.ModeShared, "")
	none := dlock.LockInfo{Fence: 1}
	f := &fake{}
	f.add(journal.Entry{Seq: 1, Kind: journal.Exclusive, Info: x},
		journal.Entry{Seq: 2, Kind: journal.Exclusive, Info: none},
		journal.Entry{Seq: 3, Kind: journal.Exclusive, Info: none}, // no change: not sent
		journal.Entry{Seq: 4, Kind: journal.Granted, Info: s1},
		journal.Entry{Seq: 5, Kind: journal.Granted, Info: s2},
		journal.Entry{Seq: 6, Kind: journal.Metadata, Info: dlock.LockInfo{Token: s1.Token, Metadata: "m"}},
		journal.Entry{Seq: 7, Kind: journal.Released, Info: dlock.LockInfo{Token: s2.Token}},
		journal.Entry{Seq: 8, Kind: journal.Exclusive, Info: x}) // a grant ends expired shares
	ctx, cancel := context.WithCancel(context.Background())
	defer cancel()
	_, ch, err := journal.Watch(ctx, f, "k", nil)
	if err != nil {
		t.Fatal(err)
	}
	for i, want := range [][]uint64{{1}, {}, {2}, {2, 3}, {2, 3}, {2}, {1}} {
		hs, ok := receive(t, ch)
		if !ok || len(hs) != len(want) {
			t.Fatalf("receive %d: %+v (open %v), want fences %v", i, hs, ok, want)
		}
		for j := range hs {
			if hs[j].Fence != want[j] || hs[j].Key != "k" {
				t.Errorf("receive %d: %+v, want fences %v of key k", i, hs, want)
			}
		}
		if i == 4 && hs[0].Metadata != "m" {
			t.Errorf("after a metadata entry: %+v", hs)
		}
	}
}

// TestGapCloses checks that a watch whose next entry is missing closes.
func TestGapCloses(t *testing.T) {
	f := &fake{}
	f.add(journal.Entry{Seq: 1, Kind: journal.Exclusive, Info: holder(1, dlock.ModeExclusive, "")},
		journal.Entry{Seq: 3, Kind: journal.Exclusive, Info: holder(2, dlock.ModeExclusive, "")})
	ctx, cancel := context.WithCancel(context.Background())
	defer cancel()
	_, ch, err := journal.Watch(ctx, f, "k", nil)
	if err != nil {
		t.Fatal(err)
	}
	if hs, ok := receive(t, ch); !ok || len(hs) != 1 || hs[0].Fence != 1 {
		t.Fatalf("first receive: %+v %v", hs, ok)
	}
	if hs, ok := receive(t, ch); ok {
		t.Fatalf("rule: a gap closes the watch; received %+v", hs)
	}
}
