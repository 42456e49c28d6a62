package torture

import (
	"context"
	"fmt"
	"sort"
	"sync"
	"time"
)

// A store whose server runs on a clock of its own (a MariaDB under
// libfaketime, Config.StoreDSN) stamps its history with that clock. The
// harness then samples it through the run, each reading bracketed by two
// Mono() readings, and the checker maps store instants to the monotonic
// clock by interpolating between the samples (storeClock.mono), instead of
// by this host's wall-minus-monotonic offset.

// storeSample is one reading of the store's clock (Unix µs) and the Mono()
// instant it stands for (the middle of the query's round trip).
type storeSample struct {
	us   int64
	mono int64
	rtt  int64
}

// storeSampleMaxRTT bounds the round trip of a usable sample: a reading
// delayed longer says little about when the server read its clock.
const storeSampleMaxRTT = int64(5 * time.Millisecond)

// storeClock is the samples of one run, in time order.
type storeClock struct {
	mu      sync.Mutex
	samples []storeSample
	dropped int // readings over storeSampleMaxRTT, or failed
}

// run samples read every interval until stop closes.
func (sc *storeClock) run(read func(ctx context.Context) (int64, error), interval time.Duration, stop <-chan struct{}) {
	t := time.NewTicker(interval)
	defer t.Stop()
	for {
		ctx, cancel := context.WithTimeout(context.Background(), time.Second)
		a := Mono()
		us, err := read(ctx)
		b := Mono()
		cancel()
		sc.mu.Lock()
		if err != nil || b-a > storeSampleMaxRTT {
			sc.dropped++
		} else {
			sc.samples = append(sc.samples, storeSample{us: us, mono: (a + b) / 2, rtt: b - a})
		}
		sc.mu.Unlock()
		select {
		case <-t.C:
		case <-stop:
			return
		}
	}
}

// mapping returns the samples for the checker, or an error when there are
// too few, or the store's clock went backwards between two of them.
func (sc *storeClock) mapping() (*clockMap, error) {
	sc.mu.Lock()
	s := append([]storeSample(nil), sc.samples...)
	dropped := sc.dropped
	sc.mu.Unlock()
	if len(s) < 2 {
		return nil, fmt.Errorf("%d samples of the store's clock (%d dropped): too few to map it", len(s), dropped)
	}
	for i := 1; i < len(s); i++ {
		if s[i].us <= s[i-1].us {
			return nil, fmt.Errorf("the store's clock went from %d to %d µs between two samples", s[i-1].us, s[i].us)
		}
	}
	m := &clockMap{samples: s, dropped: dropped}
	for _, x := range s {
		m.maxRTT = max(m.maxRTT, x.rtt)
	}
	return m, nil
}

// clockMap maps store instants to Mono() by the samples.
type clockMap struct {
	samples []storeSample
	dropped int
	maxRTT  int64
}

// errorNs bounds the error of a mapped instant: a sample stands for the
// middle of its round trip, and the server read its clock somewhere in it.
func (m *clockMap) errorNs() int64 { return m.maxRTT/2 + 1 }

// mono returns the Mono() instant of the store instant us: linear between
// the two samples around it, and beyond the first or last sample along the
// nearest pair's line.
func (m *clockMap) mono(us int64) int64 {
	s := m.samples
	i := sort.Search(len(s), func(i int) bool { return s[i].us >= us })
	i = min(max(i, 1), len(s)-1)
	a, b := s[i-1], s[i]
	return a.mono + int64(float64(us-a.us)*float64(b.mono-a.mono)/float64(b.us-a.us))
}

// String describes the store's clock against real time: its rate, and its
// offset from this host's wall clock at the first sample.
func (m *clockMap) String() string {
	a, b := m.samples[0], m.samples[len(m.samples)-1]
	rate := float64(b.us-a.us) * 1000 / float64(b.mono-a.mono)
	offset := time.Duration(a.us*1000 - (a.mono + wallMinusMono()))
	return fmt.Sprintf("store clock: rate %.4f × real time, %+.3f s from this host's at the start (%d samples, round trip ≤ %s, %d dropped)",
		rate, offset.Seconds(), len(m.samples), time.Duration(m.maxRTT).Round(10*time.Microsecond), m.dropped)
}
