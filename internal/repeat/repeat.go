// Package repeat repeats an action, with an interval that doubles, until
// told to stop: the interrupt of a statement whose caller left, which the
// server discards when it arrives before the statement starts.
package repeat

import "time"

// Until calls f, then again after first, then after twice as long each
// time up to most, until done is closed. It returns once done is closed,
// without calling f after it has seen that.
func Until(done <-chan struct{}, first, most time.Duration, f func()) {
	every := first
	t := time.NewTimer(every)
	defer t.Stop()
	for {
		select {
		case <-done:
			return
		default:
		}
		f()
		select {
		case <-done:
			return
		case <-t.C:
			every = min(2*every, most)
			t.Reset(every)
		}
	}
}
