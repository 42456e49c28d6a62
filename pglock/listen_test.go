package pglock

import (
	"testing"
	"time"
)

// A release that names another waiter wakes this one its grace after that
// release, the last one: the key is kept for the named waiter until then. A
// wake-up timed from an earlier release came while the key was still kept,
// and the waiter, refused, slept another grace, behind a newcomer's look.
func TestDispatchTimesGraceFromTheLastRelease(t *testing.T) {
	const grace = time.Second
	l := newListener(nil, tables{channel: "ch", watch: "ch/watch"})
	first := [16]byte{1}
	_, stopFirst := l.subscribe("k", first, grace)
	defer stopFirst()
	other, stopOther := l.subscribe("k", [16]byte{2}, grace)
	defer stopOther()
	payload := "6b 01000000000000000000000000000000" // hex("k"), the first waiter's token
	l.dispatch(nil, "ch", payload)
	time.Sleep(grace / 10)
	last := time.Now()
	l.dispatch(nil, "ch", payload)
	select {
	case <-other:
		if woke := time.Since(last); woke < grace {
			t.Errorf("rule: the other waiters wake a grace after the last release naming another; woken %s after it (grace %s)", woke.Round(time.Millisecond), grace)
		}
	case <-time.After(5 * grace):
		t.Fatal("the other waiter was never woken")
	}
}
