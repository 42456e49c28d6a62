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
