package dlock

import (
	"context"
	"errors"
	"testing"
	"time"
)

// TestRenewalOfALeaseDueBeforeTheNextLook: the renewal goroutine, looking
// next when an earlier lease (since released) was due, is woken for a
// lease that falls due before that.
func TestRenewalOfALeaseDueBeforeTheNextLook(t *testing.T) {
	b := &batchRecorder{}
	l := New(b, nil)
	defer l.Close(context.Background())
	ctx := context.Background()
	long, err := l.TryAcquire(ctx, "long", WithTTL(30*time.Second))
	if err != nil {
		t.Fatal(err)
	}
	for looked := false; !looked; time.Sleep(time.Millisecond) {
		l.mu.Lock()
		looked = !l.wakeAt.IsZero()
		l.mu.Unlock()
	}
	if err := long.Release(ctx); err != nil {
		t.Fatal(err)
	}
	short, err := l.TryAcquire(ctx, "short", WithTTL(time.Second))
	if err != nil {
		t.Fatal(err)
	}
	time.Sleep(1500 * time.Millisecond) // past the short lease's safe deadline
	if err := short.Err(); err != nil {
		t.Fatalf("a lease taken while the renewal goroutine slept until a released lease's renewal was lost: %v", err)
	}
	b.firstRound(t, 1)
}

// TestRenewalGoroutineLeaves: the renewal goroutine outlives the last
// lease by l.linger, then ends; a later acquisition starts it again.
func TestRenewalGoroutineLeaves(t *testing.T) {
	b := &batchRecorder{}
	l := New(b, nil)
	defer l.Close(context.Background())
	l.linger = 50 * time.Millisecond
	ctx := context.Background()
	renewing := func() bool {
		l.mu.Lock()
		defer l.mu.Unlock()
		return l.renewing
	}
	for range 2 {
		lk, err := l.TryAcquire(ctx, "k", WithTTL(time.Second))
		if err != nil {
			t.Fatal(err)
		}
		if !renewing() {
			t.Fatal("a lease is held and no renewal goroutine runs")
		}
		if err := lk.Release(ctx); err != nil {
			t.Fatal(err)
		}
		deadline := time.Now().Add(5 * time.Second)
		for renewing() && time.Now().Before(deadline) {
			time.Sleep(10 * time.Millisecond)
		}
		if renewing() {
			t.Fatal("the renewal goroutine still runs 5 s after the last release")
		}
	}
	lk, err := l.TryAcquire(ctx, "k", WithTTL(time.Second))
	if err != nil {
		t.Fatal(err)
	}
	time.Sleep(1500 * time.Millisecond)
	if err := lk.Err(); err != nil {
		t.Fatalf("a lease taken after the renewal goroutine ended was not renewed: %v", err)
	}
}

// blockingAcquire's Acquire returns only when its context ends.
type blockingAcquire struct {
	okBackend
	entered chan struct{}
}

func (b *blockingAcquire) Acquire(ctx context.Context, req Request) (Result, error) {
	close(b.entered)
	<-ctx.Done()
	return Result{}, ctx.Err()
}

// TestCloseEndsAnAcquisitionThatCannotBeCancelled: a TryAcquire whose
// context cannot end still returns ErrClosed when the Locker closes during
// its store call.
func TestCloseEndsAnAcquisitionThatCannotBeCancelled(t *testing.T) {
	b := &blockingAcquire{entered: make(chan struct{})}
	l := New(b, nil)
	res := tryLater(l, "k")
	<-b.entered
	if err := l.Close(context.Background()); err != nil {
		t.Fatal(err)
	}
	select {
	case err := <-res:
		if !errors.Is(err, ErrClosed) {
			t.Errorf("TryAcquire during Close: %v, want ErrClosed", err)
		}
	case <-time.After(5 * time.Second):
		t.Fatal("TryAcquire still waits for its store call 5 s after Close")
	}
}
