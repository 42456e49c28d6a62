package torture

import (
	"testing"
	"time"
)

func TestRateClock(t *testing.T) {
	// Bounds that hold however late the sleep and the timer are.
	c := newRateClock(0.5)
	r0 := time.Now()
	t0 := c.Now()
	time.Sleep(40 * time.Millisecond)
	t1 := c.Now()
	real := time.Since(r0)
	if d := t1.Sub(t0); d < 20*time.Millisecond || d > real/2 {
		t.Errorf("a half-rate clock advanced %s in %s (≥ 40 ms) of real time", d, real)
	}
	fired := make(chan time.Time, 1)
	start := time.Now()
	c.AfterFunc(10*time.Millisecond, func() { fired <- time.Now() })
	if real := (<-fired).Sub(start); real < 20*time.Millisecond {
		t.Errorf("10 ms by a half-rate clock passed in %s of real time, want ≥ 20 ms", real)
	}
	if workerRate(0, 0.1) != 0.9 || workerRate(1, 0.1) != 1.1 || workerRate(3, 0) != 1 {
		t.Error("workerRate")
	}
}
