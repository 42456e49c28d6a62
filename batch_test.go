package dlock

import (
	"context"
	"strconv"
	"sync"
	"testing"
	"time"
)

// batchRecorder grants every acquisition and records the size of every
// renewal call; with limit > 0 it is a BatchExtender of that limit.
type batchRecorder struct {
	okBackend
	mu    sync.Mutex
	sizes []int
}

func (b *batchRecorder) Extend(ctx context.Context, leases []Lease) ([]error, error) {
	b.mu.Lock()
	b.sizes = append(b.sizes, len(leases))
	b.mu.Unlock()
	return make([]error, len(leases)), nil
}

// firstRound waits for renewal calls covering n leases and returns their sizes.
func (b *batchRecorder) firstRound(t *testing.T, n int) []int {
	t.Helper()
	deadline := time.Now().Add(10 * time.Second)
	for time.Now().Before(deadline) {
		b.mu.Lock()
		sum := 0
		var sizes []int
		for _, s := range b.sizes {
			if sum >= n {
				break
			}
			sum += s
			sizes = append(sizes, s)
		}
		b.mu.Unlock()
		if sum >= n {
			return sizes
		}
		time.Sleep(10 * time.Millisecond)
	}
	t.Fatalf("the held leases were not renewed within 10 s")
	return nil
}

type batchExtender struct {
	batchRecorder
	limit int
}

func (b *batchExtender) ExtendBatch() int { return b.limit }

// holdMany acquires n keys of one TTL on l, back to back.
func holdMany(t *testing.T, l *Locker, n int) {
	t.Helper()
	for i := range n {
		if _, err := l.TryAcquire(context.Background(), "k"+strconv.Itoa(i), WithTTL(3*time.Second)); err != nil {
			t.Fatal(err)
		}
	}
}

// TestRenewalBatches: leases due together are renewed in calls of at most
// 1,000 leases; a BatchExtender takes them in calls of up to its own limit.
func TestRenewalBatches(t *testing.T) {
	const n = 2500
	t.Run("default", func(t *testing.T) {
		b := &batchRecorder{}
		l := New(b, nil)
		defer l.Close(context.Background())
		holdMany(t, l, n)
		for _, s := range b.firstRound(t, n) {
			if s > 1000 {
				t.Errorf("a renewal call of %d leases, want at most 1,000", s)
			}
		}
	})
	t.Run("BatchExtender", func(t *testing.T) {
		b := &batchExtender{limit: 10000}
		l := New(b, nil)
		defer l.Close(context.Background())
		holdMany(t, l, n)
		if sizes := b.firstRound(t, n); len(sizes) != 1 {
			t.Errorf("leases due together renewed in calls of %v, want one call", sizes)
		}
	})
	t.Run("BatchExtender below the default", func(t *testing.T) {
		b := &batchExtender{limit: 100}
		l := New(b, nil)
		defer l.Close(context.Background())
		holdMany(t, l, 500)
		for _, s := range b.firstRound(t, 500) {
			if s > 100 {
				t.Errorf("a renewal call of %d leases, want at most the backend's 100", s)
			}
		}
	})
}

// slowExtender is a batchExtender whose renewal calls take took.
type slowExtender struct {
	batchExtender
	took time.Duration
}

func (b *slowExtender) Extend(ctx context.Context, leases []Lease) ([]error, error) {
	time.Sleep(b.took)
	return b.batchExtender.Extend(ctx, leases)
}

// TestRenewalsStayBatchedWhenAcquisitionsAreSpread: leases taken one after
// the other over longer than the renewal window are renewed in a few calls
// a period, from the first period on, not in calls that split further at
// every look.
func TestRenewalsStayBatchedWhenAcquisitionsAreSpread(t *testing.T) {
	const (
		n   = 200
		ttl = 3 * time.Second // renewed every second, window half a second
	)
	b := &slowExtender{batchExtender: batchExtender{limit: 10000}, took: 20 * time.Millisecond}
	l := New(b, nil)
	defer l.Close(context.Background())
	for i := range n {
		if _, err := l.TryAcquire(context.Background(), "k"+strconv.Itoa(i), WithTTL(ttl)); err != nil {
			t.Fatal(err)
		}
		time.Sleep(ttl / 3 / n) // the acquisitions span a whole period
	}
	time.Sleep(ttl / 3) // the first renewals
	b.mu.Lock()
	before := len(b.sizes)
	b.mu.Unlock()
	time.Sleep(2 * ttl / 3) // two periods
	b.mu.Lock()
	calls := len(b.sizes) - before
	b.mu.Unlock()
	if calls > 6 {
		t.Errorf("%d renewal calls in two periods for %d leases taken over one period, want at most 6", calls, n)
	}
}
