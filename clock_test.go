package dlock

import (
	"context"
	"errors"
	"sync/atomic"
	"testing"
	"time"
)

// fastClock runs at twice real time.
type fastClock struct{ base time.Time }

func (c fastClock) Now() time.Time { return c.base.Add(2 * time.Since(c.base)) }

func (c fastClock) AfterFunc(d time.Duration, f func()) Timer { return time.AfterFunc(d/2, f) }

// waitingBackend shows the key held once, then grants it from a store-side
// wait that lasts wait, reporting that the granting request was sent just
// before the wait ended.
type waitingBackend struct{ wait time.Duration }

func (b waitingBackend) Acquire(ctx context.Context, req Request) (Result, error) {
	return Result{Holder: LockInfo{Key: req.Key}, Remaining: time.Second}, nil
}

func (b waitingBackend) AcquireWait(ctx context.Context, req Request) (Result, error) {
	select {
	case <-time.After(b.wait):
	case <-ctx.Done():
		return Result{}, ctx.Err()
	}
	return Result{Acquired: true, Fence: 1, SentAfter: b.wait - 5*time.Millisecond}, nil
}

func (b waitingBackend) Extend(ctx context.Context, leases []Lease) ([]error, error) {
	return make([]error, len(leases)), nil
}

func (b waitingBackend) Release(ctx context.Context, key string, token Token) error { return nil }

// TestSentAfterOnAnotherClock: a grant after a store-side wait as long as
// the lease is timed from its sending. SentAfter is real time; with a
// Locker clock of another rate, converting the whole wait would misplace
// the sending by the wait times the rate error (here 1 s: the grant would
// look expired on arrival and be thrown away, again and again).
func TestSentAfterOnAnotherClock(t *testing.T) {
	l := New(waitingBackend{wait: time.Second}, &Options{TTL: time.Second, Clock: fastClock{time.Now()}})
	ctx, cancel := context.WithTimeout(context.Background(), 5*time.Second)
	defer cancel()
	defer l.Close(context.Background())
	lk, err := l.Acquire(ctx, "k")
	if err != nil {
		t.Fatalf("a grant after a wait as long as the lease, on a clock at twice real time: %v", err)
	}
	if err := lk.Err(); err != nil {
		t.Errorf("lost on arrival: %v", err)
	}
}

// lockWaitBackend grants every Acquire after a wait for the store's write
// lock that lasts wait, reporting that the granting statement was sent
// just after the wait: it is not a Waiter.
type lockWaitBackend struct{ waitingBackend }

func (b lockWaitBackend) Acquire(ctx context.Context, req Request) (Result, error) {
	return b.waitingBackend.AcquireWait(ctx, req)
}

// TestSentAfterOfAcquire: Acquire's SentAfter times the lease as
// AcquireWait's does, so a grant that waited longer than the lease for
// the store's write lock is held, on TryAcquire and on a blocking Acquire.
func TestSentAfterOfAcquire(t *testing.T) {
	l := New(lockWaitBackend{waitingBackend{wait: 1500 * time.Millisecond}}, &Options{TTL: time.Second})
	ctx, cancel := context.WithTimeout(context.Background(), 10*time.Second)
	defer cancel()
	defer l.Close(context.Background())
	for _, take := range []func(context.Context, string, ...AcquireOption) (*Lock, error){l.TryAcquire, l.Acquire} {
		lk, err := take(ctx, "k")
		if err != nil {
			t.Fatalf("a grant after a wait longer than the lease, sent after it: %v", err)
		}
		if err := lk.Err(); err != nil {
			t.Errorf("lost on arrival: %v", err)
		}
		if err := lk.Release(ctx); err != nil {
			t.Fatal(err)
		}
	}
}

// failingExtendBackend grants every acquisition and fails every renewal
// with a transient error, counting the renewals.
type failingExtendBackend struct {
	waitingBackend
	extends atomic.Int32
}

func (b *failingExtendBackend) Acquire(ctx context.Context, req Request) (Result, error) {
	return Result{Acquired: true, Fence: 1}, nil
}

func (b *failingExtendBackend) Extend(ctx context.Context, leases []Lease) ([]error, error) {
	b.extends.Add(1)
	return nil, errors.New("store unreachable")
}

// TestRenewalRetriesBackOff: after a failed renewal the Locker retries
// with a backoff until the safe deadline, then reports the loss. The
// retries used to fall inside the "due soon" batching window (TTL/6) and
// were resent at once, hundreds of times per lease (the fault harness saw
// bursts of 8 in 3 ms).
func TestRenewalRetriesBackOff(t *testing.T) {
	b := &failingExtendBackend{}
	l := New(b, &Options{TTL: time.Second})
	defer l.Close(context.Background())
	lk, err := l.TryAcquire(context.Background(), "k")
	if err != nil {
		t.Fatal(err)
	}
	select {
	case <-lk.Done():
	case <-time.After(10 * time.Second):
		t.Fatal("a lease whose renewals all fail was never reported lost")
	}
	if !errors.Is(lk.Err(), ErrLockLost) {
		t.Errorf("Err() = %v, want ErrLockLost", lk.Err())
	}
	// Renewal at TTL/3, then retries whose waits shrink with the time left
	// (never below 10 ms) until the deadline at TTL − margin: about a dozen.
	if n := b.extends.Load(); n < 2 || n > 20 {
		t.Errorf("%d renewal attempts in one lease's life, want 2–20 (a retry, without a burst)", n)
	}
}

// okBackend grants every acquisition and confirms every renewal.
type okBackend struct{ waitingBackend }

func (okBackend) Acquire(ctx context.Context, req Request) (Result, error) {
	return Result{Acquired: true, Fence: 1}, nil
}

// TestDefaultLeaseSchedule: with no TTL anywhere a lease lasts DefaultTTL
// (30 s), is renewed TTL/3 after it was sent, and is reported lost at
// TTL − margin (margin TTL/10 + 100 ms) unless renewed.
func TestDefaultLeaseSchedule(t *testing.T) {
	l := New(okBackend{}, nil)
	defer l.Close(context.Background())
	if _, err := l.TryAcquire(context.Background(), "k"); err != nil {
		t.Fatal(err)
	}
	l.mu.Lock()
	ls := l.held["k"]
	ttl, renew, deadline := ls.ttl, ls.renewAt.Sub(ls.acquiredAt), ls.deadline.Sub(ls.acquiredAt)
	l.mu.Unlock()
	if ttl != 30*time.Second {
		t.Errorf("default TTL %s, want 30s", ttl)
	}
	if renew != 10*time.Second {
		t.Errorf("first renewal %s after sending, want TTL/3 = 10s", renew)
	}
	if d := deadline; d != 30*time.Second-3100*time.Millisecond {
		t.Errorf("safe deadline %s after sending, want TTL − margin = 26.9s", d)
	}
}

// hangingExtendBackend grants every acquisition; its renewals hang until
// their context ends, and record whether the lock had been reported lost by
// then (a session strategy's server frees the lock when that context ends).
type hangingExtendBackend struct {
	okBackend
	lk     atomic.Pointer[Lock]
	toldAt chan bool
}

func (b *hangingExtendBackend) Extend(ctx context.Context, leases []Lease) ([]error, error) {
	<-ctx.Done()
	told := false
	if lk := b.lk.Load(); lk != nil {
		select {
		case <-lk.Done():
			told = true
		default:
		}
	}
	select {
	case b.toldAt <- told:
	default:
	}
	return nil, ctx.Err()
}

// TestRenewalOutlivesTheDeadline: a renewal still running at the lease's
// safe deadline must not end before the holder is told (Done closed), since
// ending it may free a session lock in the server.
func TestRenewalOutlivesTheDeadline(t *testing.T) {
	for round := range 5 {
		b := &hangingExtendBackend{toldAt: make(chan bool, 1)}
		l := New(b, &Options{TTL: time.Second})
		lk, err := l.TryAcquire(context.Background(), "k")
		if err != nil {
			t.Fatal(err)
		}
		b.lk.Store(lk)
		select {
		case told := <-b.toldAt:
			if !told {
				t.Errorf("round %d: the renewal's context ended before the holder was told of the loss", round)
			}
		case <-time.After(10 * time.Second):
			t.Fatal("the hanging renewal never ended")
		}
		l.Close(context.Background())
	}
}

// shortGrantBackend grants every acquisition with part of its lease gone:
// SentAfter is negative.
type shortGrantBackend struct {
	waitingBackend
	gone time.Duration
}

func (b shortGrantBackend) Acquire(ctx context.Context, req Request) (Result, error) {
	return Result{Acquired: true, Fence: 1, SentAfter: -b.gone}, nil
}

// TestNegativeSentAfterShortensTheLease: a grant whose lease began before
// the call (a negative SentAfter) is trusted only for what is left of it.
func TestNegativeSentAfterShortensTheLease(t *testing.T) {
	const ttl, gone = time.Second, 600 * time.Millisecond
	l := New(shortGrantBackend{gone: gone}, &Options{TTL: ttl})
	defer l.Close(context.Background())
	began := time.Now()
	lk, err := l.TryAcquire(context.Background(), "k")
	if err != nil {
		t.Fatal(err)
	}
	if latest := began.Add(ttl - gone); lk.Deadline().After(latest) {
		t.Errorf("deadline %s after the call began; the lease ends at most %s after it",
			lk.Deadline().Sub(began), latest.Sub(began))
	}
}

// lateBackend grants every acquisition, the first late of them after a
// round trip of slow, longer than the lease's safe deadline; it counts
// them.
type lateBackend struct {
	waitingBackend
	calls *atomic.Int32
	slow  time.Duration
	late  int32
}

func (b lateBackend) Acquire(ctx context.Context, req Request) (Result, error) {
	n := b.calls.Add(1)
	if n <= b.late {
		time.Sleep(b.slow)
	}
	return Result{Acquired: true, Fence: uint64(n)}, nil
}

// TestTooLateGrantIsWaitedPast: a grant that arrives after its lease's
// safe deadline is released; TryAcquire reports it, and a blocking Acquire
// tries again within its context instead of failing, but not without end.
func TestTooLateGrantIsWaitedPast(t *testing.T) {
	const ttl = time.Second
	ctx, cancel := context.WithTimeout(context.Background(), 10*time.Second)
	defer cancel()
	for _, wait := range []bool{false, true} {
		l := New(lateBackend{calls: new(atomic.Int32), slow: ttl, late: 1}, &Options{TTL: ttl})
		lk, err := l.acquire(ctx, "k", nil, wait)
		switch {
		case !wait && !errors.Is(err, errTooLate):
			t.Errorf("TryAcquire of a grant past its safe deadline: %v, want errTooLate", err)
		case wait && err != nil:
			t.Errorf("Acquire after a grant past its safe deadline: %v", err)
		case wait && lk.Fence() != 2:
			t.Errorf("Acquire: fence %d, want the second grant's", lk.Fence())
		}
		l.Close(ctx)
	}
}

// TestTooLateGrantsEndTheWait: a blocking Acquire on a store whose every
// grant comes too late returns the error after maxTooLate of them, even
// with a context that never ends.
func TestTooLateGrantsEndTheWait(t *testing.T) {
	const ttl = time.Second
	b := lateBackend{calls: new(atomic.Int32), slow: ttl, late: maxTooLate + 1}
	l := New(b, &Options{TTL: ttl})
	defer l.Close(context.Background())
	_, err := l.Acquire(context.Background(), "k")
	if !errors.Is(err, errTooLate) {
		t.Errorf("Acquire on a store slower than the TTL: %v, want errTooLate", err)
	}
	if n := b.calls.Load(); n != maxTooLate {
		t.Errorf("%d grants taken, want %d", n, maxTooLate)
	}
}

// TestTooLateGrantLeavesNoWaker: a blocking Acquire that tried again after
// a grant came too late keeps nothing on the key's local wake-up entry.
func TestTooLateGrantLeavesNoWaker(t *testing.T) {
	l := New(lateBackend{calls: new(atomic.Int32), slow: time.Second, late: 1}, &Options{TTL: time.Second})
	defer l.Close(context.Background())
	lk, err := l.Acquire(context.Background(), "k")
	if err != nil {
		t.Fatal(err)
	}
	defer lk.Release(context.Background())
	l.mu.Lock()
	n := 0
	if w := l.wakers["k"]; w != nil {
		n = w.n
	}
	l.mu.Unlock()
	if n != 0 {
		t.Errorf("rule: a key looked at keeps nothing; %d waiters still counted on its wake-up entry after Acquire returned", n)
	}
}
