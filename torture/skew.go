package torture

import (
	"time"

	"github.com/dlock-dev/dlock"
)

// rateClock is a dlock.Clock that runs at rate times real time: 0.9 is a
// clock that loses 100 ms a second, 1.1 one that gains as much. A worker's
// Locker times its leases with it, which is how the harness injects client
// clock error into a Go process (libfaketime cannot reach Go binaries). Only
// the rate matters to dlock, which reads durations, never the offset.
type rateClock struct {
	rate float64
	base time.Time // real instant at which both clocks agreed
}

func newRateClock(rate float64) *rateClock { return &rateClock{rate: rate, base: time.Now()} }

// Now returns the skewed time.
func (c *rateClock) Now() time.Time {
	real := time.Since(c.base)
	return c.base.Add(time.Duration(float64(real) * c.rate))
}

// AfterFunc calls f once d has passed by this clock.
func (c *rateClock) AfterFunc(d time.Duration, f func()) dlock.Timer {
	return rateTimer{t: time.AfterFunc(c.real(d), f), c: c}
}

// real converts a duration by this clock to real time.
func (c *rateClock) real(d time.Duration) time.Duration {
	return time.Duration(float64(d) / c.rate)
}

type rateTimer struct {
	t *time.Timer
	c *rateClock
}

func (t rateTimer) Stop() bool                 { return t.t.Stop() }
func (t rateTimer) Reset(d time.Duration) bool { return t.t.Reset(t.c.real(d)) }

// workerRate returns the clock rate of the worker in slot under a skew of
// ±skew: even slots run slow, odd slots fast, so a run has both.
func workerRate(slot int, skew float64) float64 {
	if skew == 0 {
		return 1
	}
	if slot%2 == 0 {
		return 1 - skew
	}
	return 1 + skew
}
