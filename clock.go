package dlock

import "time"

// Clock is the time source a Locker times leases with: the instant an
// acquisition or renewal was sent, the renewal schedule and the safe
// deadline (sent + TTL − margin) at which an unconfirmed lease is reported
// lost. Only durations between its readings matter, never its offset from
// other clocks. The default is the system's monotonic clock.
//
// A Clock other than the default is for tests and fault injection: the
// dlock fault harness runs Lockers whose clock runs slow or fast, to check
// that Options.Margin absorbs a given rate error and to show what happens
// beyond it. Backoff sleeps and context deadlines always use the system
// clock.
type Clock interface {
	// Now returns the current time.
	Now() time.Time
	// AfterFunc calls f in its own goroutine once d has passed by this
	// clock, and returns a Timer that can stop or reset it.
	AfterFunc(d time.Duration, f func()) Timer
}

// Timer is a pending call made by Clock.AfterFunc. *time.Timer implements
// it.
type Timer interface {
	// Stop prevents the call if it has not run yet, and reports whether it
	// did so.
	Stop() bool
	// Reset schedules the call d from now by the Timer's clock, and reports
	// whether it was pending.
	Reset(d time.Duration) bool
}

// systemClock is the default Clock.
type systemClock struct{}

func (systemClock) Now() time.Time { return time.Now() }

func (systemClock) AfterFunc(d time.Duration, f func()) Timer { return time.AfterFunc(d, f) }
