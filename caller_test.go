package dlock

import (
	"context"
	"errors"
	"fmt"
	"strings"
	"sync"
	"sync/atomic"
	"testing"
	"time"
)

// manualClock is a Clock whose time moves only when told, and whose timers
// never fire by themselves: the state of a process that was paused and has
// just resumed, before its timer goroutines have run.
type manualClock struct {
	mu  sync.Mutex
	now time.Time
}

func (c *manualClock) Now() time.Time {
	c.mu.Lock()
	defer c.mu.Unlock()
	return c.now
}

func (c *manualClock) advance(d time.Duration) {
	c.mu.Lock()
	c.now = c.now.Add(d)
	c.mu.Unlock()
}

type stuckTimer struct{}

func (stuckTimer) Stop() bool                 { return true }
func (stuckTimer) Reset(d time.Duration) bool { return true }

func (c *manualClock) AfterFunc(d time.Duration, f func()) Timer { return stuckTimer{} }

// TestErrAfterPause: once the lease's safe deadline has passed by the
// Locker's clock, Err, Done and the lock's context report the loss, even if
// no timer has run since.
func TestErrAfterPause(t *testing.T) {
	clock := &manualClock{now: time.Unix(1000, 0)}
	l := New(okBackend{}, &Options{TTL: 10 * time.Second, Clock: clock})
	defer l.Close(context.Background())
	lk, err := l.TryAcquire(context.Background(), "k")
	if err != nil {
		t.Fatal(err)
	}
	ctx, cancel := lk.Context(context.Background())
	defer cancel()
	if lk.Err() != nil || ctx.Err() != nil {
		t.Fatalf("lost before the pause: %v, %v", lk.Err(), ctx.Err())
	}
	clock.advance(11 * time.Second) // the process was stopped past the TTL
	if err := ctx.Err(); err == nil {
		t.Error("rule: after a pause past the lease, the lock's context reports the loss; ctx.Err() is nil")
	}
	if err := lk.Err(); !errors.Is(err, ErrLockLost) {
		t.Errorf("rule: after a pause past the lease, Err reports the loss; got %v", err)
	}
	select {
	case <-lk.Done():
	default:
		t.Error("Done still open after Err reported the loss")
	}
	if err := lk.Release(context.Background()); !errors.Is(err, ErrNotHeld) || !errors.Is(err, ErrLockLost) {
		t.Errorf("Release after the pause: got %v, want ErrNotHeld and ErrLockLost", err)
	}
}

// recordingBackend grants every acquisition and records releases; a release
// whose context has ended fails, as a store call would.
type recordingBackend struct {
	okBackend
	mu       sync.Mutex
	released map[Token]bool
}

func (b *recordingBackend) Release(ctx context.Context, key string, token Token) error {
	if err := ctx.Err(); err != nil {
		return err
	}
	b.mu.Lock()
	defer b.mu.Unlock()
	if b.released == nil {
		b.released = make(map[Token]bool)
	}
	b.released[token] = true
	return nil
}

func (b *recordingBackend) count() int {
	b.mu.Lock()
	defer b.mu.Unlock()
	return len(b.released)
}

// TestDoReleasesWhenFnPanics: a panic in fn, recovered by the caller (as
// net/http does), still releases the lock.
func TestDoReleasesWhenFnPanics(t *testing.T) {
	b := &recordingBackend{}
	l := New(b, nil)
	defer l.Close(context.Background())
	func() {
		defer func() {
			if r := recover(); r != "boom" {
				t.Errorf("recovered %v, want the fn's panic", r)
			}
		}()
		_ = l.Do(context.Background(), "k", func(context.Context) error { panic("boom") })
	}()
	if b.count() != 1 {
		t.Error("rule: Do releases the lock when fn panics; it was not released")
	}
	l.mu.Lock()
	n := len(l.held)
	l.mu.Unlock()
	if n != 0 {
		t.Error("rule: Do releases the lock when fn panics; the Locker still renews it")
	}
}

// gatedBackend's Acquire grants the key only when the test opens its gate.
type gatedBackend struct {
	recordingBackend
	entered chan struct{}
	gate    chan struct{}
}

func (b *gatedBackend) Acquire(ctx context.Context, req Request) (Result, error) {
	close(b.entered)
	<-b.gate
	return Result{Acquired: true, Fence: 1}, nil
}

// tryLater runs TryAcquire(key) with a context that cannot end, on a
// goroutine of its own, and sends its error.
func tryLater(l *Locker, key string) <-chan error {
	res := make(chan error, 1)
	go func() {
		_, err := l.TryAcquire(context.Background(), key)
		res <- err
	}()
	return res
}

// TestCloseRacingAcquisition: an acquisition granted by the store while the
// Locker closes is released, not left to its TTL.
func TestCloseRacingAcquisition(t *testing.T) {
	b := &gatedBackend{entered: make(chan struct{}), gate: make(chan struct{})}
	l := New(b, nil)
	res := tryLater(l, "k")
	<-b.entered
	closed := make(chan struct{})
	go func() {
		l.Close(context.Background())
		close(closed)
	}()
	for !l.isClosed() {
		time.Sleep(time.Millisecond)
	}
	close(b.gate)
	if err := <-res; !errors.Is(err, ErrClosed) {
		t.Errorf("TryAcquire granted during Close: got %v, want ErrClosed", err)
	}
	<-closed
	if b.count() != 1 {
		t.Error("rule: a grant that lands while the Locker closes is released; the lease was left held by nobody")
	}
}

// outageBackend fails acquisitions when their context ends; its releases
// block until the test lets them go.
type outageBackend struct {
	okBackend
	releasing chan struct{}
	done      atomic.Bool
}

func (b *outageBackend) Acquire(ctx context.Context, req Request) (Result, error) {
	<-ctx.Done()
	return Result{}, ctx.Err()
}

func (b *outageBackend) Release(ctx context.Context, key string, token Token) error {
	select {
	case <-b.releasing:
	case <-ctx.Done():
	}
	b.done.Store(true)
	return ErrNotHeld
}

// TestAcquireReturnsAtItsDeadline: resolving an acquisition of unknown
// outcome does not hold the caller past its context.
func TestAcquireReturnsAtItsDeadline(t *testing.T) {
	b := &outageBackend{releasing: make(chan struct{})}
	l := New(b, nil)
	ctx, cancel := context.WithTimeout(context.Background(), 20*time.Millisecond)
	defer cancel()
	_, err := l.TryAcquire(ctx, "k")
	if b.done.Load() {
		t.Error("rule: Acquire returns when its context ends; it waited for the clean-up of its attempt")
	}
	if !errors.Is(err, context.DeadlineExceeded) || !errors.Is(err, ErrNotAcquired) {
		t.Errorf("got %v, want ErrNotAcquired and DeadlineExceeded", err)
	}
	close(b.releasing)
	l.Close(context.Background())
	if !b.done.Load() {
		t.Error("Close returned before the clean-up of an acquisition finished")
	}
}

// lateGrantBackend models a statement still in flight after its caller gave
// up: the grant lands in the store after the first clean-up found nothing.
type lateGrantBackend struct {
	okBackend
	mu       sync.Mutex
	landed   bool
	releases int
	freed    bool
}

func (b *lateGrantBackend) Acquire(ctx context.Context, req Request) (Result, error) {
	return Result{}, errors.New("connection reset")
}

func (b *lateGrantBackend) Release(ctx context.Context, key string, token Token) error {
	b.mu.Lock()
	defer b.mu.Unlock()
	b.releases++
	if !b.landed {
		b.landed = true // lands right after this release looked
		return ErrNotHeld
	}
	if b.freed {
		return ErrNotHeld
	}
	b.freed = true
	return nil
}

// TestResolveOutlivesALateGrant: a clean-up that found nothing looks again,
// so a grant that lands after it does not hold the key for its TTL.
func TestResolveOutlivesALateGrant(t *testing.T) {
	b := &lateGrantBackend{}
	l := New(b, &Options{TTL: 2 * time.Second})
	if _, err := l.TryAcquire(context.Background(), "k"); err == nil {
		t.Fatal("acquired")
	}
	deadline := time.Now().Add(5 * time.Second)
	for time.Now().Before(deadline) {
		b.mu.Lock()
		freed := b.freed
		b.mu.Unlock()
		if freed {
			break
		}
		time.Sleep(10 * time.Millisecond)
	}
	l.Close(context.Background())
	b.mu.Lock()
	defer b.mu.Unlock()
	if !b.freed {
		t.Errorf("rule: a grant landing after the first clean-up is released; %d releases, none found it", b.releases)
	}
}

// TestErrorsAreOneLine: errors are one line, for logs, and still match
// every sentinel they carry.
func TestErrorsAreOneLine(t *testing.T) {
	l := New(okBackend{}, nil)
	defer l.Close(context.Background())
	ctx, cancel := context.WithCancel(context.Background())
	cancel()
	_, err := l.Acquire(ctx, "k")
	if !errors.Is(err, ErrNotAcquired) || !errors.Is(err, context.Canceled) {
		t.Errorf("got %v, want ErrNotAcquired and context.Canceled", err)
	}
	j := Join(errors.New("a\nb"), nil, ErrLockLost)
	for _, err := range []error{err, j} {
		if strings.Contains(err.Error(), "\n") {
			t.Errorf("%q is more than one line", err)
		}
	}
	if !errors.Is(j, ErrLockLost) || Join(nil, nil) != nil {
		t.Error("Join lost an error or made one from nothing")
	}
}

// lossyBackend grants, and reports the grant's session lost before the
// grant reaches the Locker.
type lossyBackend struct {
	recordingBackend
	loss LossHandlers
}

func (b *lossyBackend) OnLoss(f func(string, Token, error)) func() { return b.loss.Add(f) }

func (b *lossyBackend) Acquire(ctx context.Context, req Request) (Result, error) {
	b.loss.Report(req.Key, req.Token, errors.New("session ended"))
	return Result{Acquired: true, Fence: 1}, nil
}

// TestLossReportedBeforeTheGrantArrives: a session reported lost between
// the grant and its registration yields no Lock.
func TestLossReportedBeforeTheGrantArrives(t *testing.T) {
	l := New(&lossyBackend{}, nil)
	defer l.Close(context.Background())
	lk, err := l.TryAcquire(context.Background(), "k")
	if err == nil {
		t.Fatalf("rule: a grant whose session was reported lost is not handed out; got a Lock (Err %v)", lk.Err())
	}
	var he *HeldError
	if errors.As(err, &he) || errors.Is(err, ErrNotAcquired) {
		t.Errorf("got %v, want an error that does not say someone holds the key", err)
	}
}

// slowGrantBackend grants after the Locker's clock passed the lease's safe
// deadline: a store that answers more slowly than the TTL allows.
type slowGrantBackend struct {
	recordingBackend
	clock *manualClock
}

func (b *slowGrantBackend) Acquire(ctx context.Context, req Request) (Result, error) {
	b.clock.advance(req.TTL)
	return Result{Acquired: true, Fence: 1}, nil
}

// TestGrantTooLateIsAnError: a grant confirmed after its safe deadline is
// released and reported as an error, never as "held by someone" (which a
// cron job reads as another copy running).
func TestGrantTooLateIsAnError(t *testing.T) {
	clock := &manualClock{now: time.Unix(1000, 0)}
	b := &slowGrantBackend{clock: clock}
	l := New(b, &Options{TTL: 10 * time.Second, Clock: clock})
	defer l.Close(context.Background())
	_, err := l.TryAcquire(context.Background(), "k")
	var he *HeldError
	if err == nil || errors.As(err, &he) || errors.Is(err, ErrNotAcquired) {
		t.Errorf("rule: a store too slow for the TTL is an error, not \"not acquired\"; got %v", err)
	}
}

// deafBackend is a store client that ignores contexts: each call blocks
// until answer is closed, then grants (Acquire) or succeeds.
type deafBackend struct {
	okBackend
	answer   chan struct{}
	mu       sync.Mutex
	granted  map[string]bool
	released map[string]bool
}

func (b *deafBackend) Acquire(_ context.Context, req Request) (Result, error) {
	<-b.answer
	b.mu.Lock()
	defer b.mu.Unlock()
	b.granted[req.Key] = true
	return Result{Acquired: true, Fence: 1}, nil
}

func (b *deafBackend) Release(_ context.Context, key string, _ Token) error {
	<-b.answer
	b.mu.Lock()
	defer b.mu.Unlock()
	b.released[key] = true
	return nil
}

func (b *deafBackend) List(context.Context, string) ([]LockInfo, error) {
	<-b.answer
	return nil, nil
}

func (b *deafBackend) ListWaiters(context.Context, string) ([]WaiterInfo, error) {
	<-b.answer
	return nil, nil
}

func (b *deafBackend) ListKeys(context.Context, string) ([]KeyInfo, error) {
	<-b.answer
	return nil, nil
}

func (b *deafBackend) ForceRelease(context.Context, string) error {
	<-b.answer
	return nil
}

// TestCallsReturnWhenTheStoreIgnoresTheirContext: a store that stops
// answering, behind a client that does not honour contexts, still lets
// every call return by its caller's deadline; a grant that arrives after
// its caller left is released, and Close returns by its own deadline.
func TestCallsReturnWhenTheStoreIgnoresTheirContext(t *testing.T) {
	b := &deafBackend{answer: make(chan struct{}), granted: map[string]bool{}, released: map[string]bool{}}
	l := New(b, nil)
	close(b.answer) // answer once, to hold a lock
	lk, err := l.TryAcquire(context.Background(), "held")
	if err != nil {
		t.Fatal(err)
	}
	b.answer = make(chan struct{}) // the store stops answering
	for name, call := range map[string]func(ctx context.Context) error{
		"TryAcquire": func(ctx context.Context) error { _, err := l.TryAcquire(ctx, "late"); return err },
		"Release":    func(ctx context.Context) error { return lk.Release(ctx) },
		"List":       func(ctx context.Context) error { _, err := l.List(ctx, ""); return err },
		"ListKeys":   func(ctx context.Context) error { _, err := l.ListKeys(ctx, ""); return err },
		"ListWaiters": func(ctx context.Context) error {
			_, err := l.ListWaiters(ctx, "")
			return err
		},
		"ForceRelease": func(ctx context.Context) error { return l.ForceRelease(ctx, "other") },
	} {
		ctx, cancel := context.WithTimeout(context.Background(), 20*time.Millisecond)
		done := make(chan error, 1)
		go func() { done <- call(ctx) }()
		select {
		case err := <-done:
			if !errors.Is(err, context.DeadlineExceeded) {
				t.Errorf("%s: %v, want the deadline's error", name, err)
			}
		case <-time.After(10 * time.Second):
			t.Fatalf("rule: a call returns when its context ends; %s is still waiting for the store", name)
		}
		cancel()
	}
	ctx, cancel := context.WithTimeout(context.Background(), 20*time.Millisecond)
	defer cancel()
	if err := l.Close(ctx); !errors.Is(err, context.DeadlineExceeded) {
		t.Errorf("Close on a silent store: %v, want the deadline's error", err)
	}
	close(b.answer) // the store answers again: the late grant lands
	deadline := time.Now().Add(10 * time.Second)
	for {
		b.mu.Lock()
		ok := b.granted["late"] && b.released["late"]
		b.mu.Unlock()
		if ok {
			break
		}
		if time.Now().After(deadline) {
			t.Fatal("a grant that landed after its caller left was not released")
		}
		time.Sleep(5 * time.Millisecond)
	}
}

// ctxBackend honours contexts: a call with an ended context fails.
type ctxBackend struct {
	okBackend
	mu       sync.Mutex
	released bool
}

// waitReleased fails the test with msg unless a release succeeds within
// 10 s.
func (b *ctxBackend) waitReleased(t *testing.T, msg string) {
	t.Helper()
	for deadline := time.Now().Add(10 * time.Second); ; time.Sleep(5 * time.Millisecond) {
		b.mu.Lock()
		ok := b.released
		b.mu.Unlock()
		if ok {
			return
		}
		if time.Now().After(deadline) {
			t.Fatal(msg)
		}
	}
}

func (b *ctxBackend) Release(ctx context.Context, key string, _ Token) error {
	if err := ctx.Err(); err != nil {
		return err
	}
	b.mu.Lock()
	defer b.mu.Unlock()
	b.released = true
	return nil
}

// TestReleaseOutlivesItsCallersDeadline: a Release whose context has ended
// (an HTTP handler's, after the response) returns the context's error, yet
// the key is released in the background instead of lingering for its TTL.
func TestReleaseOutlivesItsCallersDeadline(t *testing.T) {
	b := &ctxBackend{}
	l := New(b, nil)
	defer l.Close(context.Background())
	lk, err := l.TryAcquire(context.Background(), "k")
	if err != nil {
		t.Fatal(err)
	}
	ctx, cancel := context.WithCancel(context.Background())
	cancel()
	if err := lk.Release(ctx); !errors.Is(err, context.Canceled) {
		t.Fatalf("Release with an ended context: %v, want its error", err)
	}
	b.waitReleased(t, "rule: a release cut short by its caller's context goes on in the background; the key was never released")
}

// TestTimeoutUnderLockContextFires: a timeout derived from the lock's
// context fires when it is due, however often the lease is renewed (a
// context whose Deadline moved with renewal made derived timeouts that
// relied on it never fire).
func TestTimeoutUnderLockContextFires(t *testing.T) {
	l := New(okBackend{}, &Options{TTL: MinTTL})
	defer l.Close(context.Background())
	lk, err := l.TryAcquire(context.Background(), "k")
	if err != nil {
		t.Fatal(err)
	}
	ctx, cancel := lk.Context(context.Background())
	defer cancel()
	tctx, tcancel := context.WithTimeout(ctx, 3*MinTTL/2) // beyond the first safe deadline
	defer tcancel()
	select {
	case <-tctx.Done():
		if lk.Err() != nil {
			t.Fatalf("the lock was lost: %v", lk.Err())
		}
	case <-time.After(10 * MinTTL):
		t.Fatal("rule: a timeout under the lock's context fires; it did not, while the lease was renewed")
	}
}

// TestReentrantAcquireAfterPause: a reentrant acquisition after a pause
// past the lease's safe deadline does not hand out the lost lease; it
// reports the loss to the earlier handle and acquires anew.
func TestReentrantAcquireAfterPause(t *testing.T) {
	clock := &manualClock{now: time.Unix(1000, 0)}
	l := New(okBackend{}, &Options{TTL: 10 * time.Second, Clock: clock})
	defer l.Close(context.Background())
	first, err := l.TryAcquire(context.Background(), "k", WithOwner("job"))
	if err != nil {
		t.Fatal(err)
	}
	clock.advance(11 * time.Second) // stopped past the TTL
	again, err := l.TryAcquire(context.Background(), "k", WithOwner("job"))
	if err != nil {
		t.Fatal(err)
	}
	if !errors.Is(first.Err(), ErrLockLost) {
		t.Errorf("the handle from before the pause: Err %v, want ErrLockLost", first.Err())
	}
	if again.Err() != nil {
		t.Errorf("rule: a reentrant acquisition after a pause is a new, live lease; Err %v", again.Err())
	}
}

// TestCloseWithEndedContextStillReleases: Close with a context that has
// already ended (a shutdown budget spent) returns its error, yet releases
// the held keys in the background instead of leaving them to their TTL.
func TestCloseWithEndedContextStillReleases(t *testing.T) {
	b := &ctxBackend{}
	l := New(b, nil)
	if _, err := l.TryAcquire(context.Background(), "k"); err != nil {
		t.Fatal(err)
	}
	ctx, cancel := context.WithCancel(context.Background())
	cancel()
	if err := l.Close(ctx); !errors.Is(err, context.Canceled) {
		t.Errorf("Close with an ended context: %v, want its error", err)
	}
	b.waitReleased(t, "rule: Close with an ended context still releases what it held; the key was never released")
}

// heldBackend reports every key held by someone else, and cannot wait in
// the store.
type heldBackend struct{}

func (heldBackend) Acquire(ctx context.Context, req Request) (Result, error) {
	return Result{Holder: LockInfo{Key: req.Key}, Remaining: time.Second}, nil
}

func (heldBackend) Extend(ctx context.Context, leases []Lease) ([]error, error) {
	return make([]error, len(leases)), nil
}

func (heldBackend) Release(ctx context.Context, key string, token Token) error { return ErrNotHeld }

// TestLookingAtKeysKeepsNothing: a poller that tries many keys held
// elsewhere (job ids), and one that derives a context from a held lock for
// every job, keep nothing per key or per job.
func TestLookingAtKeysKeepsNothing(t *testing.T) {
	l := New(heldBackend{}, nil)
	defer l.Close(context.Background())
	for i := range 100 {
		if _, err := l.TryAcquire(context.Background(), fmt.Sprint("job-", i)); !errors.Is(err, ErrNotAcquired) {
			t.Fatal(err)
		}
	}
	ctx, cancel := context.WithTimeout(context.Background(), 20*time.Millisecond)
	defer cancel()
	if _, err := l.Acquire(ctx, "waited"); !errors.Is(err, context.DeadlineExceeded) {
		t.Fatal(err)
	}
	l.mu.Lock()
	n := len(l.wakers)
	l.mu.Unlock()
	if n != 0 {
		t.Errorf("rule: a key looked at keeps nothing; %d wake-up entries left after TryAcquire and Acquire of keys held elsewhere", n)
	}

	h := New(okBackend{}, nil)
	defer h.Close(context.Background())
	lk, err := h.TryAcquire(context.Background(), "leader")
	if err != nil {
		t.Fatal(err)
	}
	for range 100 {
		_, jcancel := lk.Context(context.Background())
		jcancel()
	}
	h.mu.Lock()
	n = len(lk.cancels)
	h.mu.Unlock()
	if n != 0 {
		t.Errorf("rule: a cancelled Lock.Context is dropped; %d kept", n)
	}
}
