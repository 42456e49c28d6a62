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
	_, _, stopFirst := l.subscribe("k", first, grace)
	defer stopFirst()
	other, _, stopOther := l.subscribe("k", [16]byte{2}, grace)
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

// TestDispatchOfAHandoffWakesOnlyTheGrantee: a release whose record is a
// grant to the waiter it names wakes that waiter, which learns it was
// handed the key, and no other waiter, even after the grace period.
func TestDispatchOfAHandoffWakesOnlyTheGrantee(t *testing.T) {
	const grace = 50 * time.Millisecond
	l := newListener(nil, tables{channel: "ch", watch: "ch/watch"})
	first := [16]byte{1}
	wake, handed, stopFirst := l.subscribe("k", first, grace)
	defer stopFirst()
	other, otherHanded, stopOther := l.subscribe("k", [16]byte{2}, grace)
	defer stopOther()
	tok := "01000000000000000000000000000000"
	l.dispatch(nil, "ch", "6b "+tok+"/5 g -1 "+tok+" 3 1 2  ")
	select {
	case <-wake:
	case <-time.After(time.Second):
		t.Fatal("the grantee was not woken")
	}
	if !handed() || handed() {
		t.Error("handed() did not report the grant once")
	}
	select {
	case <-other:
		t.Error("a handoff woke another waiter")
	case <-time.After(3 * grace):
	}
	if otherHanded() {
		t.Error("another waiter was told it was handed the key")
	}
	l.dispatch(nil, "ch", "6b "+tok+"/6 r "+tok)
	<-wake
	if handed() {
		t.Error("a plain release reported a handoff")
	}
}
