package locktest

import (
	"context"
	"errors"
	"fmt"
	mrand "math/rand/v2"
	"slices"
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
	// Waits holds how long each acquisition took, from the call to the
	// grant, in no particular order.
	Waits []time.Duration
}

// WaitPercentile returns the p-th percentile (0..100) of Waits.
func (s ContentionStats) WaitPercentile(p float64) time.Duration {
	if len(s.Waits) == 0 {
		return 0
	}
	w := slices.Clone(s.Waits)
	slices.Sort(w)
	return w[min(len(w)-1, int(float64(len(w))*p/100))]
}

// HandoffsPerSec is Handoffs divided by Duration.
func (s ContentionStats) HandoffsPerSec() float64 { return float64(s.Handoffs) / s.Duration.Seconds() }

// AcquisitionsPerSec is Acquisitions divided by Duration.
func (s ContentionStats) AcquisitionsPerSec() float64 {
	return float64(s.Acquisitions) / s.Duration.Seconds()
}

// Contention configures Contend.
type Contention struct {
	Duration time.Duration // how long to run
	Hold     time.Duration // time in the critical section (0: release at once)
	// Poll, when set, makes workers use the naive recipe instead of the
	// Locker's waiting: TryAcquire, and sleep Poll after each failure.
	Poll time.Duration
	// Limit, when set, makes the key a semaphore: every acquisition uses
	// dlock.WithLimit(Limit), and at most Limit workers may be inside.
	Limit int
	// Readers, when set, is the share (0..1) of acquisitions that are
	// shared (dlock.Shared); the others are exclusive. Readers may be
	// inside together, a writer only alone.
	Readers float64
}

// occupancy is who is inside the critical section of Contend.
type occupancy struct{ exclusive, shared, limited int }

// enter records a worker entering in mode, or says which rule it breaks.
func (o *occupancy) enter(m dlock.Mode, limit int) error {
	switch m {
	case dlock.ModeShared:
		if o.exclusive > 0 {
			return errors.New("locktest: a reader inside with a writer")
		}
		o.shared++
	case dlock.ModeLimited:
		if o.limited >= limit {
			return fmt.Errorf("locktest: more than %d holders of a semaphore of %d inside", limit, limit)
		}
		o.limited++
	default:
		if o.exclusive+o.shared+o.limited > 0 {
			return errors.New("locktest: two workers inside at once")
		}
		o.exclusive++
	}
	return nil
}

func (o *occupancy) leave(m dlock.Mode) {
	switch m {
	case dlock.ModeShared:
		o.shared--
	case dlock.ModeLimited:
		o.limited--
	default:
		o.exclusive--
	}
}

// Contend runs one worker per Locker, each acquiring key (waiting), holding
// it, releasing it and starting again at once, and counts acquisitions and
// true handoffs. Give each worker its own Locker over its own backend to
// model processes. It is for benchmarks: it asserts nothing but reports an
// error if a worker fails or two workers are inside at once.
func Contend(ctx context.Context, lockers []*dlock.Locker, key string, c Contention, opts ...dlock.AcquireOption) (ContentionStats, error) {
	hold, d := c.Hold, c.Duration
	var mu sync.Mutex
	last := -1
	var in occupancy
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
			rng := mrand.New(mrand.NewPCG(uint64(w), 1))
			for ctx.Err() == nil {
				mode, o := dlock.ModeExclusive, opts
				switch {
				case c.Limit > 0:
					mode, o = dlock.ModeLimited, append(slices.Clip(opts), dlock.WithLimit(c.Limit))
				case c.Readers > 0 && rng.Float64() < c.Readers:
					mode, o = dlock.ModeShared, append(slices.Clip(opts), dlock.Shared())
				}
				began := time.Now()
				lk, err := acquire(ctx, l, key, c.Poll, o)
				waited := time.Since(began)
				if err != nil {
					if !errors.Is(err, dlock.ErrNotAcquired) || !errors.Is(err, context.DeadlineExceeded) {
						errc <- err
					}
					return
				}
				mu.Lock()
				if err := in.enter(mode, c.Limit); err != nil {
					mu.Unlock()
					errc <- err
					return
				}
				st.Acquisitions++
				st.Shares[w]++
				st.Waits = append(st.Waits, waited)
				if last != w && last != -1 {
					st.Handoffs++
				}
				last = w
				mu.Unlock()
				if hold > 0 {
					time.Sleep(hold)
				}
				mu.Lock()
				in.leave(mode)
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

// acquire waits for key through the Locker, or by polling every poll.
func acquire(ctx context.Context, l *dlock.Locker, key string, poll time.Duration, opts []dlock.AcquireOption) (*dlock.Lock, error) {
	if poll == 0 {
		return l.Acquire(ctx, key, opts...)
	}
	for {
		lk, err := l.TryAcquire(ctx, key, opts...)
		if !errors.Is(err, dlock.ErrNotAcquired) {
			return lk, err
		}
		select {
		case <-time.After(poll):
		case <-ctx.Done():
			return nil, dlock.Join(err, ctx.Err())
		}
	}
}

// BenchmarkContention runs workers Lockers, each over its own backend from
// newBackend (as separate processes would be), contending for one key for
// 3 s per iteration, and reports true handoffs/s, acquisitions/s, the
// smallest worker share (1 = fair), and the 99th percentile and the longest
// of the acquisitions' waits. opts apply to every acquisition.
func BenchmarkContention(b *testing.B, workers int, newBackend func(testing.TB) dlock.Backend, opts ...dlock.AcquireOption) {
	benchmarkContention(b, workers, newBackend, Contention{Duration: 3 * time.Second}, opts...)
}

// BenchmarkPolling is BenchmarkContention for the naive recipe: TryAcquire
// and a fixed sleep of poll after each failure.
func BenchmarkPolling(b *testing.B, workers int, poll time.Duration, newBackend func(testing.TB) dlock.Backend) {
	benchmarkContention(b, workers, newBackend, Contention{Duration: 3 * time.Second, Poll: poll})
}

func benchmarkContention(b *testing.B, workers int, newBackend func(testing.TB) dlock.Backend, c Contention, opts ...dlock.AcquireOption) {
	lockers := make([]*dlock.Locker, workers)
	for i := range lockers {
		lockers[i] = dlock.New(newBackend(b), nil)
		defer lockers[i].Close(context.Background())
	}
	key := "locktest/contention/" + dlock.NewToken().String()
	var st ContentionStats
	for b.Loop() {
		var err error
		st, err = Contend(context.Background(), lockers, key, c, opts...)
		if err != nil {
			b.Fatal(err)
		}
	}
	b.ReportMetric(st.HandoffsPerSec(), "handoffs/s")
	b.ReportMetric(st.AcquisitionsPerSec(), "acq/s")
	b.ReportMetric(st.MinShare, "min-share")
	b.ReportMetric(float64(st.WaitPercentile(99))/1e6, "p99-wait-ms")
	b.ReportMetric(float64(st.WaitPercentile(100))/1e6, "max-wait-ms")
}

// BenchmarkSemaphore is BenchmarkContention on a semaphore of limit: every
// acquisition uses dlock.WithLimit(limit).
func BenchmarkSemaphore(b *testing.B, workers, limit int, newBackend func(testing.TB) dlock.Backend) {
	benchmarkContention(b, workers, newBackend, Contention{Duration: 3 * time.Second, Limit: limit})
}

// BenchmarkReadWrite is BenchmarkContention on a reader-writer key: a share
// readers (0..1) of the acquisitions are shared, the others exclusive.
func BenchmarkReadWrite(b *testing.B, workers int, readers float64, newBackend func(testing.TB) dlock.Backend) {
	benchmarkContention(b, workers, newBackend, Contention{Duration: 3 * time.Second, Readers: readers})
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
