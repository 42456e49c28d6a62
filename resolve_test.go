package dlock

import (
	"context"
	"errors"
	"runtime"
	"sync"
	"sync/atomic"
	"testing"
	"time"
)

// cutBackend answers every acquisition with an error once the caller's
// context has ended, as a store call cut by its caller does; its releases
// find nothing. It counts the releases.
type cutBackend struct {
	okBackend
	releases atomic.Int64
}

func (b *cutBackend) Acquire(ctx context.Context, req Request) (Result, error) {
	<-ctx.Done()
	return Result{}, errors.New("connection reset")
}

func (b *cutBackend) Release(ctx context.Context, key string, token Token) error {
	b.releases.Add(1)
	return ErrNotHeld
}

// Acquisitions cut short by their callers are resolved by one goroutine,
// not one each for a whole TTL, and Close ends their resolution promptly.
func TestCutAcquisitionsResolveWithoutAGoroutineEach(t *testing.T) {
	b := &cutBackend{}
	l := New(b, &Options{TTL: 30 * time.Second})
	before := runtime.NumGoroutine()
	var wg sync.WaitGroup
	for i := range 200 {
		wg.Go(func() {
			ctx, cancel := context.WithTimeout(context.Background(), time.Duration(i%5)*time.Millisecond)
			defer cancel()
			if _, err := l.TryAcquire(ctx, "k"); err == nil {
				t.Error("acquired")
			}
		})
	}
	wg.Wait()
	// The store calls' goroutines end as their calls do; the resolution
	// goes on (for the 30 s TTL).
	n := 0
	for end := time.Now().Add(2 * time.Second); time.Now().Before(end); time.Sleep(20 * time.Millisecond) {
		if n = runtime.NumGoroutine() - before; n <= 20 {
			break
		}
	}
	if n > 20 {
		t.Errorf("rule: cut acquisitions cost no goroutine each while they are resolved; %d goroutines added for 200", n)
	}
	// Each is looked at again with a growing backoff: 50 ms, 100 ms, ...
	r0 := b.releases.Load()
	time.Sleep(time.Second)
	if n := b.releases.Load() - r0; n > 200*4 {
		t.Errorf("%d releases in a second for 200 cut acquisitions, want at most 4 each", n)
	}
	start := time.Now()
	ctx, cancel := context.WithTimeout(context.Background(), 5*time.Second)
	defer cancel()
	if err := l.Close(ctx); err != nil {
		t.Errorf("Close: %v", err)
	}
	if d := time.Since(start); d > 2*time.Second {
		t.Errorf("Close took %s with 200 acquisitions being resolved", d.Round(time.Millisecond))
	}
	if n := runtime.NumGoroutine() - before; n > 5 {
		t.Errorf("%d goroutines left after Close", n)
	}
}
