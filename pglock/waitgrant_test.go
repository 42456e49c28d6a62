package pglock_test

import (
	"context"
	"testing"
	"time"

	"github.com/dlock-dev/dlock"
)

// TestAdvisoryWaitsShortAndLong: an exclusive waiter is granted the key
// when its holder releases it soon (the grant's reply comes within a fifth
// of the TTL, and the grant is timed from the wait's statement) and late
// (the grant is confirmed, and timed, by a statement after the reply);
// either way the grant keeps most of its lease, its fence is the key's
// next, and it is the key's only holder.
func TestAdvisoryWaitsShortAndLong(t *testing.T) {
	pool := open(t, "shortwait")
	const ttl = time.Second
	ctx, cancel := context.WithTimeout(t.Context(), 20*time.Second)
	defer cancel()
	holder := dlock.New(newAdvisory(t, pool), nil)
	defer holder.Close(context.Background())
	waiter := dlock.New(newAdvisory(t, pool), nil)
	defer waiter.Close(context.Background())
	key := "shortwait/" + dlock.NewToken().String()
	for _, hold := range []time.Duration{50 * time.Millisecond, 3 * ttl / 5} {
		lk, err := holder.Acquire(ctx, key, dlock.WithTTL(ttl))
		if err != nil {
			t.Fatal(err)
		}
		time.AfterFunc(hold, func() { lk.Release(context.Background()) })
		w, err := waiter.Acquire(ctx, key, dlock.WithTTL(ttl))
		if err != nil {
			t.Fatalf("held for %s: wait: %v", hold, err)
		}
		if left := time.Until(w.Deadline()); left < ttl/2 {
			t.Errorf("held for %s: %s left of the waiter's %s lease right after its grant", hold, left, ttl)
		}
		if w.Fence() <= lk.Fence() {
			t.Errorf("held for %s: the waiter's fence %d, its holder's %d", hold, w.Fence(), lk.Fence())
		}
		hs, err := waiter.List(ctx, key)
		if err != nil || len(hs) != 1 || hs[0].Fence != w.Fence() {
			t.Errorf("held for %s: holders %+v (%v); want the waiter alone", hold, hs, err)
		}
		if err := w.Release(ctx); err != nil {
			t.Fatal(err)
		}
	}
}
