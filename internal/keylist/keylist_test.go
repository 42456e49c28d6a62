package keylist_test

import (
	"testing"
	"time"

	"github.com/dlock-dev/dlock"
	"github.com/dlock-dev/dlock/internal/keylist"
)

func TestMergeHolders(t *testing.T) {
	last := &dlock.LockInfo{Key: "b", Owner: "old", Fence: 3}
	keys := []dlock.KeyInfo{
		{Key: "a", Fence: 1},
		{Key: "b", Fence: 3, Last: last, FreedAt: time.Now(), Expired: true},
		{Key: "d", Fence: 9},
	}
	holders := []dlock.LockInfo{{Key: "b", Fence: 4}, {Key: "b", Fence: 5}, {Key: "c", Fence: 1}, {Key: "d", Fence: 9}}
	got := keylist.MergeHolders(keys, holders)
	if len(got) != 3 || len(got[0].Holders) != 0 || got[0].Fence != 1 {
		t.Fatalf("a key without holders changed: %+v", got)
	}
	if b := got[1]; len(b.Holders) != 2 || b.Last != nil || !b.FreedAt.IsZero() || b.Expired || b.Fence != 5 {
		t.Errorf("a key granted since its row was read: %+v, want two holders, no last holder, fence 5", b)
	}
	r := keylist.Row{Last: dlock.LockInfo{Key: "e", Owner: "x", Fence: 2}, LastKnown: true, Expired: true, Ended: -time.Second}
	if k := r.Info(time.Now()); k.Last == nil || k.Last.Owner != "x" || !k.Expired || k.FreedAt.After(time.Now().Add(-time.Second)) {
		t.Errorf("a free row: %+v", k)
	}
	r.Held = true
	if k := r.Info(time.Now()); k.Last != nil || !k.FreedAt.IsZero() || k.Expired || k.Fence != 2 {
		t.Errorf("a held row: %+v", k)
	}
	r.Held, r.LastKnown = false, false
	if k := r.Info(time.Now()); k.Last != nil || k.FreedAt.IsZero() {
		t.Errorf("a free row whose last holder is not known: %+v", k)
	}
	if d := got[2]; len(d.Holders) != 1 || d.Fence != 9 {
		t.Errorf("a held key: %+v", d)
	}
}

// TestRetryReadsATornListingAgain checks that a listing in which a key held
// by the rows' read has no holders is read again, at most three times.
func TestRetryReadsATornListingAgain(t *testing.T) {
	held := []bool{true, false}
	torn := []dlock.KeyInfo{{Key: "a", Fence: 2}, {Key: "b", Fence: 1}}
	whole := []dlock.KeyInfo{{Key: "a", Fence: 2, Holders: []dlock.LockInfo{{Key: "a", Fence: 2}}}, {Key: "b", Fence: 1}}
	if !keylist.Torn(held, torn) || keylist.Torn(held, whole) || keylist.Torn([]bool{false, false}, torn) {
		t.Fatalf("Torn: %v %v %v", keylist.Torn(held, torn), keylist.Torn(held, whole), keylist.Torn([]bool{false, false}, torn))
	}
	calls := 0
	got, err := keylist.Retry(func() ([]dlock.KeyInfo, bool, error) {
		calls++
		if calls == 1 {
			return torn, true, nil
		}
		return whole, false, nil
	})
	if err != nil || calls != 2 || len(got[0].Holders) != 1 {
		t.Errorf("Retry after one torn listing: %d calls, %+v, %v", calls, got, err)
	}
	calls = 0
	if _, err := keylist.Retry(func() ([]dlock.KeyInfo, bool, error) { calls++; return torn, true, nil }); err != nil || calls != 3 {
		t.Errorf("Retry of listings that stay torn: %d calls, %v; want 3", calls, err)
	}
}
