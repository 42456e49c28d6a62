package ctxend

import (
	"context"
	"errors"
	"testing"
	"time"
)

func TestErr(t *testing.T) {
	if err := Err(context.Background()); err != nil {
		t.Fatalf("live context: %v", err)
	}
	live, cancel := context.WithTimeout(context.Background(), time.Hour)
	defer cancel()
	if err := Err(live); err != nil {
		t.Fatalf("context with a distant deadline: %v", err)
	}
	cancelled, cancel2 := context.WithCancel(context.Background())
	cancel2()
	if err := Err(cancelled); !errors.Is(err, context.Canceled) {
		t.Fatalf("cancelled context: %v, want context.Canceled", err)
	}
	// A deadline in the past whose timer cannot have fired: WithDeadline
	// cancels at once for a past deadline, so build one by hand.
	passed := deadlineOnly{Context: context.Background(), d: time.Now().Add(-time.Millisecond)}
	if err := Err(passed); !errors.Is(err, context.DeadlineExceeded) {
		t.Fatalf("passed deadline, timer not fired: %v, want context.DeadlineExceeded", err)
	}
}

// deadlineOnly reports a deadline but never ends by itself, as a context
// whose timer has not fired yet.
type deadlineOnly struct {
	context.Context
	d time.Time
}

func (c deadlineOnly) Deadline() (time.Time, bool) { return c.d, true }
