package dlock_test

import (
	"context"
	"strconv"
	"sync/atomic"
	"testing"
	"time"

	"github.com/dlock-dev/dlock"
	"github.com/dlock-dev/dlock/memlock"
)

// TestRenewalCallsAreBounded: leases falling due faster than a slow store
// renews them are renewed by at most four Extend calls in flight, so that
// renewing them takes few of the store's connections, and none is lost.
func TestRenewalCallsAreBounded(t *testing.T) {
	mem := memlock.New()
	var inflight, most, calls atomic.Int64
	b := extendFunc{Backend: mem, f: func(ctx context.Context, leases []dlock.Lease) ([]error, error) {
		n := inflight.Add(1)
		defer inflight.Add(-1)
		for m := most.Load(); n > m && !most.CompareAndSwap(m, n); m = most.Load() {
		}
		calls.Add(1)
		time.Sleep(50 * time.Millisecond) // a store that answers in 50 ms
		return mem.Extend(ctx, leases)
	}}
	// Renewals start at TTL/3 (6 s) and take every lease due within TTL/6
	// (3 s): the leases taken in the first 3 s (thousands, five or more
	// batches of 1,000) fall due together.
	const ttl = 18 * time.Second
	l := dlock.New(b, &dlock.Options{TTL: ttl})
	defer l.Close(context.Background())
	ctx := context.Background()
	var locks []*dlock.Lock
	start := time.Now()
	for i := range 8000 {
		lk, err := l.TryAcquire(ctx, "k"+strconv.Itoa(i))
		if err != nil {
			t.Fatal(err)
		}
		locks = append(locks, lk)
	}
	time.Sleep(time.Until(start.Add(ttl/3 + time.Second)))
	if m := most.Load(); m > 4 || calls.Load() == 0 {
		t.Errorf("rule: a Locker has at most 4 renewal calls in flight; %d of %d calls were", m, calls.Load())
	}
	for _, lk := range locks {
		if err := lk.Err(); err != nil {
			t.Fatalf("%s: %v", lk.Key(), err)
		}
	}
}
