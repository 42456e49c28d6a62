package locktest

import (
	"context"
	"errors"
	"sync"
	"testing"
	"time"

	"github.com/dlock-dev/dlock"
)

// ContentionStats are the results of Contend.
type ContentionStats struct {
	Duration     time.Duration
	Acquisitions int     // critical sections entered
	Handoffs     int     // acquisitions by a different worker than the previous holder
	Shares       []int   // acquisitions per worker
	MinShare     float64 // smallest worker share relative to a fair share (1 = fair)
}

// HandoffsPerSec is Handoffs divided by Duration.
func (s ContentionStats) HandoffsPerSec() float64 { return float64(s.Handoffs) / s.Duration.Seconds() }

// AcquisitionsPerSec is Acquisitions divided by Duration.
func (s ContentionStats) AcquisitionsPerSec() float64 {
	return float64(s.Acquisitions) / s.Duration.Seconds()
}

// Contend runs one worker per Locker for d, each acquiring key (waiting),
// holding it for hold, releasing it and starting again at once, and counts
// acquisitions and true handoffs. Give each worker its own Locker over its
// own backend to model processes. It is for benchmarks: it asserts nothing
// but reports an error if a worker fails or two workers are inside at once.
func Contend(ctx context.Context, lockers []*dlock.Locker, key string, hold, d time.Duration, opts ...dlock.AcquireOption) (ContentionStats, error) {
	var mu sync.Mutex
	last, inside := -1, false
	st := ContentionStats{Shares: make([]int, len(lockers))}
	ctx, cancel := context.WithTimeout(ctx, d)
	defer cancel()
	errc := make(chan error, len(lockers))
	var wg sync.WaitGroup
	start := time.Now()
	for w, l := range lockers {
		wg.Add(1)
		go func() {
			defer wg.Done()
			for ctx.Err() == nil {
				lk, err := l.Acquire(ctx, key, opts...)
				if err != nil {
					if !errors.Is(err, dlock.ErrNotAcquired) || ctx.Err() == nil {
						errc <- err
					}
					return
				}
				mu.Lock()
				if inside {
					mu.Unlock()
					errc <- errors.New("locktest: two workers inside at once")
					return
				}
				inside = true
				st.Acquisitions++
				st.Shares[w]++
				if last != w && last != -1 {
					st.Handoffs++
				}
				last = w
				mu.Unlock()
				if hold > 0 {
					time.Sleep(hold)
				}
				mu.Lock()
				inside = false
				mu.Unlock()
				if err := lk.Release(context.Background()); err != nil {
					errc <- err
					return
				}
			}
		}()
	}
	wg.Wait()
	st.Duration = time.Since(start)
	close(errc)
	fair := float64(st.Acquisitions) / float64(len(lockers))
	st.MinShare = 1
	for _, n := range st.Shares {
		if fair > 0 && float64(n)/fair < st.MinShare {
			st.MinShare = float64(n) / fair
		}
	}
	return st, <-errc
}

// BenchmarkContention runs workers Lockers, each over its own backend from
// newBackend (as separate processes would be), contending for one key for
// 3 s per iteration, and reports true handoffs/s, acquisitions/s and the
// smallest worker share (1 = fair). opts apply to every acquisition.
func BenchmarkContention(b *testing.B, workers int, newBackend func(testing.TB) dlock.Backend, opts ...dlock.AcquireOption) {
	lockers := make([]*dlock.Locker, workers)
	for i := range lockers {
		lockers[i] = dlock.New(newBackend(b), nil)
		defer lockers[i].Close(context.Background())
	}
	key := "locktest/contention/" + dlock.NewToken().String()
	var st ContentionStats
	for b.Loop() {
		var err error
		st, err = Contend(context.Background(), lockers, key, 0, 3*time.Second, opts...)
		if err != nil {
			b.Fatal(err)
		}
	}
	b.ReportMetric(st.HandoffsPerSec(), "handoffs/s")
	b.ReportMetric(st.AcquisitionsPerSec(), "acq/s")
	b.ReportMetric(st.MinShare, "min-share")
}

// BenchmarkAcquireRelease measures an uncontended TryAcquire and Release of
// one key through a Locker over be.
func BenchmarkAcquireRelease(b *testing.B, be dlock.Backend) {
	l := dlock.New(be, nil)
	defer l.Close(context.Background())
	ctx := context.Background()
	key := "locktest/bench/" + dlock.NewToken().String()
	b.ReportAllocs()
	for b.Loop() {
		lk, err := l.TryAcquire(ctx, key)
		if err != nil {
			b.Fatal(err)
		}
		if err := lk.Release(ctx); err != nil {
			b.Fatal(err)
		}
	}
}
