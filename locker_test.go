package dlock

import (
	"errors"
	"testing"
	"time"
)

func TestBackoff(t *testing.T) {
	var b Backoff
	for i := range 20 {
		d := b.Next(0)
		if d < minBackoff/2 || d > maxBackoff {
			t.Fatalf("step %d: %s outside [%s, %s]", i, d, minBackoff/2, maxBackoff)
		}
		if i > 12 && d < maxBackoff/2 {
			t.Errorf("step %d: %s, want capped near %s", i, d, maxBackoff)
		}
	}
	if d := b.Next(3 * time.Millisecond); d != 4*time.Millisecond {
		t.Errorf("with a 3ms remaining lease the waiter sleeps %s, want 4ms", d)
	}
}

func TestDefaultMargin(t *testing.T) {
	l := New(nil, nil)
	if m := l.marginFor(30 * time.Second); m != 3100*time.Millisecond {
		t.Errorf("margin for 30s: %s", m)
	}
	if _, err := New(nil, &Options{Margin: time.Second}).config("k", []AcquireOption{WithTTL(time.Second)}); err == nil {
		t.Error("a margin of half the TTL or more was accepted")
	}
	if _, err := New(nil, &Options{Margin: -5 * time.Second}).config("k", []AcquireOption{WithTTL(2 * time.Second)}); !errors.Is(err, ErrInvalidOption) {
		t.Errorf("a negative margin: %v, want ErrInvalidOption", err)
	}
}
