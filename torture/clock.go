package torture

import (
	"sort"
	"sync"
	"time"

	"golang.org/x/sys/unix"
)

// Mono returns CLOCK_MONOTONIC in nanoseconds. On Linux that clock is one
// system-wide clock, so readings from the harness and from every worker
// process can be compared directly.
func Mono() int64 {
	var ts unix.Timespec
	if err := unix.ClockGettime(unix.CLOCK_MONOTONIC, &ts); err != nil {
		panic("torture: clock_gettime(CLOCK_MONOTONIC): " + err.Error())
	}
	return ts.Nano()
}

// wallMinusMono reads CLOCK_REALTIME and CLOCK_MONOTONIC back to back and
// returns their difference in nanoseconds, taking the tightest of a few
// tries. The stores time leases by the wall clock (MariaDB's UTC_TIMESTAMP
// and SQLite's unixepoch both read CLOCK_REALTIME of this host), so this
// offset converts the stores' instants to the shared monotonic clock.
func wallMinusMono() int64 {
	best, bestSpan := int64(0), int64(1<<62)
	for range 5 {
		var a, w, b unix.Timespec
		_ = unix.ClockGettime(unix.CLOCK_MONOTONIC, &a)
		_ = unix.ClockGettime(unix.CLOCK_REALTIME, &w)
		_ = unix.ClockGettime(unix.CLOCK_MONOTONIC, &b)
		if span := b.Nano() - a.Nano(); span < bestSpan {
			best, bestSpan = w.Nano()-(a.Nano()+b.Nano())/2, span
		}
	}
	return best
}

// clockSampler records the wall-minus-monotonic offset through a run. Both
// clocks are slewed alike by NTP; only a step of the wall clock changes the
// offset, and a step makes every comparison between the stores' times and
// the workers' times inconclusive.
type clockSampler struct {
	mu      sync.Mutex
	samples []int64
}

func (c *clockSampler) sample() {
	o := wallMinusMono()
	c.mu.Lock()
	c.samples = append(c.samples, o)
	c.mu.Unlock()
}

func (c *clockSampler) run(stop <-chan struct{}) {
	t := time.NewTicker(time.Second)
	defer t.Stop()
	for {
		c.sample()
		select {
		case <-t.C:
		case <-stop:
			c.sample()
			return
		}
	}
}

// offset returns the median offset and the spread of the samples.
func (c *clockSampler) offset() (median, spread int64) {
	c.mu.Lock()
	s := append([]int64(nil), c.samples...)
	c.mu.Unlock()
	if len(s) == 0 {
		return wallMinusMono(), 0
	}
	sort.Slice(s, func(i, j int) bool { return s[i] < s[j] })
	return s[len(s)/2], s[len(s)-1] - s[0]
}
