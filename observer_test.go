package dlock_test

import (
	"context"
	"errors"
	"fmt"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/dlock-dev/dlock"
	"github.com/dlock-dev/dlock/memlock"
)

// event is one call an Observer received.
type event struct {
	method string
	ctx    context.Context
	e      any
}

// ctxMark is the context key of the value recorder's Started methods add.
type ctxMark struct{}

// recorder is an Observer that keeps every call. Each call first runs
// during (when set), which takes the Locker's mutex: a call made under it
// would deadlock.
type recorder struct {
	mu     sync.Mutex
	events []event
	grew   chan struct{} // closed and replaced at each event
	during func()
}

func newRecorder() *recorder { return &recorder{grew: make(chan struct{})} }

func (r *recorder) add(method string, ctx context.Context, e any) {
	if r.during != nil {
		r.during()
	}
	r.mu.Lock()
	defer r.mu.Unlock()
	r.events = append(r.events, event{method, ctx, e})
	close(r.grew)
	r.grew = make(chan struct{})
}

func (r *recorder) AcquireStarted(ctx context.Context, e dlock.AcquireStart) context.Context {
	ctx = context.WithValue(ctx, ctxMark{}, "acquire "+e.Key)
	r.add("AcquireStarted", ctx, e)
	return ctx
}

func (r *recorder) AcquireEnded(ctx context.Context, e dlock.AcquireEnd) {
	r.add("AcquireEnded", ctx, e)
}

func (r *recorder) ReleaseStarted(ctx context.Context, e dlock.ReleaseStart) context.Context {
	ctx = context.WithValue(ctx, ctxMark{}, "release "+e.Key)
	r.add("ReleaseStarted", ctx, e)
	return ctx
}

func (r *recorder) ReleaseEnded(ctx context.Context, e dlock.ReleaseEnd) {
	r.add("ReleaseEnded", ctx, e)
}

func (r *recorder) Renewed(e dlock.Renewal) { r.add("Renewed", nil, e) }

func (r *recorder) Lost(e dlock.Loss) { r.add("Lost", nil, e) }

// take returns the events received so far and forgets them.
func (r *recorder) take() []event {
	r.mu.Lock()
	defer r.mu.Unlock()
	evs := r.events
	r.events = nil
	return evs
}

// waitFor waits (10 s at most) for an event of method and returns it.
func (r *recorder) waitFor(t *testing.T, method string) event {
	t.Helper()
	timeout := time.After(10 * time.Second)
	for {
		r.mu.Lock()
		for _, ev := range r.events {
			if ev.method == method {
				r.mu.Unlock()
				return ev
			}
		}
		grew := r.grew
		r.mu.Unlock()
		select {
		case <-grew:
		case <-timeout:
			t.Fatalf("no %s event within 10 s; got %v", method, r.take())
		}
	}
}

// only returns the single event of evs, failing unless it is method's.
func only[E any](t *testing.T, evs []event, method string) (context.Context, E) {
	t.Helper()
	var got []event
	for _, ev := range evs {
		if ev.method == method {
			got = append(got, ev)
		}
	}
	if len(got) != 1 {
		t.Fatalf("%d %s events, want 1: %v", len(got), method, evs)
	}
	return got[0].ctx, got[0].e.(E)
}

// observed returns a Locker over b that reports to a new recorder. Once
// the returned function has been given a Lock, each of the recorder's calls
// takes the Locker's mutex (through the Lock's Deadline), and the test
// fails if that does not return while the call runs: the call was made
// under the mutex.
func observed(t *testing.T, b dlock.Backend, opts dlock.Options) (*dlock.Locker, *recorder, func(*dlock.Lock)) {
	r := newRecorder()
	var mu sync.Mutex
	var lk *dlock.Lock
	var underMutex atomic.Bool
	r.during = func() {
		mu.Lock()
		k := lk
		mu.Unlock()
		if k == nil {
			return
		}
		done := make(chan struct{})
		go func() { k.Deadline(); close(done) }()
		select {
		case <-done:
		case <-time.After(5 * time.Second):
			underMutex.Store(true)
		}
	}
	opts.Observer = r
	l := dlock.New(b, &opts)
	t.Cleanup(func() {
		_ = l.Close(context.Background())
		if underMutex.Load() {
			t.Error("rule: Observer calls are made outside the Locker's mutex; one was made under it")
		}
	})
	return l, r, func(k *dlock.Lock) { mu.Lock(); lk = k; mu.Unlock() }
}

func TestObserverSeesAcquisitionsAndReleases(t *testing.T) {
	ctx := context.Background()
	b := memlock.New()
	l, r, watch := observed(t, b, dlock.Options{TTL: 10 * time.Second})

	lk, err := l.TryAcquire(ctx, "obs/a", dlock.Shared())
	if err != nil {
		t.Fatal(err)
	}
	watch(lk)
	evs := r.take()
	if len(evs) != 2 || evs[0].method != "AcquireStarted" || evs[1].method != "AcquireEnded" {
		t.Fatalf("rule: an acquisition is AcquireStarted then AcquireEnded; got %v", evs)
	}
	if s := evs[0].e.(dlock.AcquireStart); s != (dlock.AcquireStart{Key: "obs/a", Mode: dlock.ModeShared}) {
		t.Errorf("AcquireStart = %+v", s)
	}
	e := evs[1].e.(dlock.AcquireEnd)
	if e.Key != "obs/a" || e.Mode != dlock.ModeShared || e.Outcome != dlock.Acquired || e.Err != nil ||
		e.Fence != lk.Fence() || e.Fence == 0 || e.Reentrant || e.Waited < 0 {
		t.Errorf("AcquireEnd = %+v, want acquired with fence %d", e, lk.Fence())
	}
	if evs[1].ctx.Value(ctxMark{}) != "acquire obs/a" {
		t.Error("rule: AcquireEnded receives the context AcquireStarted returned")
	}

	// Another Locker holds obs/b: a conflict, then a wait given up.
	other := dlock.New(b, nil)
	defer other.Close(ctx)
	if _, err := other.TryAcquire(ctx, "obs/b"); err != nil {
		t.Fatal(err)
	}
	if _, err := l.TryAcquire(ctx, "obs/b"); !errors.Is(err, dlock.ErrNotAcquired) {
		t.Fatalf("TryAcquire of a held key: %v", err)
	}
	_, e = only[dlock.AcquireEnd](t, r.take(), "AcquireEnded")
	if e.Outcome != dlock.Conflict || e.Fence != 0 || !errors.Is(e.Err, dlock.ErrNotAcquired) || e.Mode != dlock.ModeExclusive {
		t.Errorf("TryAcquire of a held key: AcquireEnd = %+v, want conflict", e)
	}
	wctx, cancel := context.WithTimeout(ctx, 50*time.Millisecond)
	_, err = l.Acquire(wctx, "obs/b")
	cancel()
	if !errors.Is(err, context.DeadlineExceeded) {
		t.Fatalf("Acquire of a held key until a deadline: %v", err)
	}
	evs = r.take()
	if _, s := only[dlock.AcquireStart](t, evs, "AcquireStarted"); !s.Wait {
		t.Error("AcquireStart.Wait is false for Acquire")
	}
	if _, e = only[dlock.AcquireEnd](t, evs, "AcquireEnded"); e.Outcome != dlock.GaveUp || e.Waited <= 0 || !e.Wait {
		t.Errorf("Acquire whose context ended: AcquireEnd = %+v, want gave_up after a wait", e)
	}
	if _, err := l.TryAcquire(ctx, ""); !errors.Is(err, dlock.ErrInvalidKey) {
		t.Fatal(err)
	}
	if _, e = only[dlock.AcquireEnd](t, r.take(), "AcquireEnded"); e.Outcome != dlock.Failed || !errors.Is(e.Err, dlock.ErrInvalidKey) {
		t.Errorf("an invalid key: AcquireEnd = %+v, want error", e)
	}

	if err := lk.Release(ctx); err != nil {
		t.Fatal(err)
	}
	evs = r.take()
	if len(evs) != 2 || evs[0].method != "ReleaseStarted" || evs[1].method != "ReleaseEnded" {
		t.Fatalf("rule: a release is ReleaseStarted then ReleaseEnded; got %v", evs)
	}
	rs := evs[0].e.(dlock.ReleaseStart)
	re := evs[1].e.(dlock.ReleaseEnd)
	if rs.Key != "obs/a" || rs.Fence != lk.Fence() || rs.Mode != dlock.ModeShared || rs.Held <= 0 || rs.Closing {
		t.Errorf("ReleaseStart = %+v", rs)
	}
	if re.Key != rs.Key || re.Fence != rs.Fence || re.Held != rs.Held || re.Err != nil || re.Closing {
		t.Errorf("ReleaseEnd = %+v after ReleaseStart %+v", re, rs)
	}
	if evs[1].ctx.Value(ctxMark{}) != "release obs/a" {
		t.Error("rule: ReleaseEnded receives the context ReleaseStarted returned")
	}
	if err := lk.Release(ctx); !errors.Is(err, dlock.ErrNotHeld) {
		t.Fatal(err)
	}
	if evs := r.take(); len(evs) != 0 {
		t.Errorf("a release of a Lock already released: %v, want no event", evs)
	}
}

func TestObserverReentrantAndClose(t *testing.T) {
	ctx := context.Background()
	l, r, _ := observed(t, memlock.New(), dlock.Options{TTL: 10 * time.Second})
	first, err := l.TryAcquire(ctx, "obs/r", dlock.WithOwner("o"))
	if err != nil {
		t.Fatal(err)
	}
	second, err := l.TryAcquire(ctx, "obs/r", dlock.WithOwner("o"))
	if err != nil {
		t.Fatal(err)
	}
	evs := r.take()
	if e := evs[1].e.(dlock.AcquireEnd); e.Reentrant {
		t.Errorf("first acquisition: %+v, want not reentrant", e)
	}
	if e := evs[3].e.(dlock.AcquireEnd); !e.Reentrant || e.Outcome != dlock.Acquired || e.Fence != first.Fence() {
		t.Errorf("second acquisition by the owner: %+v, want reentrant with the first's fence", e)
	}
	if err := first.Release(ctx); err != nil {
		t.Fatal(err)
	}
	if evs := r.take(); len(evs) != 0 {
		t.Errorf("rule: a release that leaves the lease held is no release event; got %v", evs)
	}
	_ = second
	if err := l.Close(ctx); err != nil {
		t.Fatal(err)
	}
	_, re := only[dlock.ReleaseEnd](t, r.take(), "ReleaseEnded")
	if re.Key != "obs/r" || !re.Closing || re.Err != nil {
		t.Errorf("Close: ReleaseEnd = %+v, want the lease let go by Close", re)
	}
}

func TestObserverSeesRenewals(t *testing.T) {
	l, r, watch := observed(t, memlock.New(), dlock.Options{TTL: dlock.MinTTL})
	lk, err := l.TryAcquire(context.Background(), "obs/renew")
	if err != nil {
		t.Fatal(err)
	}
	watch(lk)
	e := r.waitFor(t, "Renewed").e.(dlock.Renewal)
	if e.Key != "obs/renew" || e.Fence != lk.Fence() || e.Mode != dlock.ModeExclusive {
		t.Errorf("Renewal = %+v", e)
	}
	// The renewal is sent at TTL/3, before the safe deadline at
	// TTL − margin (margin TTL/10 + 100 ms).
	if max := dlock.MinTTL - dlock.MinTTL/10 - 100*time.Millisecond; e.Lead <= 0 || e.Lead > max {
		t.Errorf("Renewal.Lead = %s, want in (0, %s]", e.Lead, max)
	}
}

// extendFunc is memlock whose Extend is f.
type extendFunc struct {
	*memlock.Backend
	f func(ctx context.Context, leases []dlock.Lease) ([]error, error)
}

func (b extendFunc) Extend(ctx context.Context, leases []dlock.Lease) ([]error, error) {
	return b.f(ctx, leases)
}

// sessionBackend is memlock that reports session losses.
type sessionBackend struct {
	*memlock.Backend
	loss dlock.LossHandlers
}

func (b *sessionBackend) OnLoss(f func(string, dlock.Token, error)) func() { return b.loss.Add(f) }

func TestObserverSeesLosses(t *testing.T) {
	store := memlock.New()
	session := &sessionBackend{Backend: memlock.New()}
	cases := []struct {
		cause   dlock.LossCause
		backend dlock.Backend
		lose    func(t *testing.T, key string)
	}{
		{dlock.LossNotHeld, store, func(t *testing.T, key string) {
			if err := store.ForceRelease(context.Background(), key); err != nil {
				t.Fatal(err)
			}
		}},
		{dlock.LossExpired, extendFunc{memlock.New(), func(ctx context.Context, _ []dlock.Lease) ([]error, error) {
			<-ctx.Done() // a store that never answers
			return nil, ctx.Err()
		}}, nil},
		{dlock.LossStoreError, extendFunc{memlock.New(), func(context.Context, []dlock.Lease) ([]error, error) {
			return nil, errors.New("store unreachable")
		}}, nil},
		{dlock.LossSession, session, func(t *testing.T, key string) {
			infos, err := session.List(context.Background(), key)
			if err != nil || len(infos) != 1 {
				t.Fatalf("List: %v, %v", infos, err)
			}
			session.loss.Report(key, infos[0].Token, errors.New("session ended"))
		}},
	}
	for _, c := range cases {
		t.Run(c.cause.String(), func(t *testing.T) {
			l, r, watch := observed(t, c.backend, dlock.Options{TTL: dlock.MinTTL})
			key := fmt.Sprintf("obs/lost/%s", c.cause)
			lk, err := l.TryAcquire(context.Background(), key)
			if err != nil {
				t.Fatal(err)
			}
			watch(lk)
			if c.lose != nil {
				c.lose(t, key)
			}
			e := r.waitFor(t, "Lost").e.(dlock.Loss)
			if e.Key != key || e.Fence != lk.Fence() || e.Cause != c.cause || e.Held <= 0 || !errors.Is(e.Err, dlock.ErrLockLost) {
				t.Errorf("Loss = %+v, want %s of %q fence %d", e, c.cause, key, lk.Fence())
			}
			if err := lk.Err(); err == nil || err.Error() != e.Err.Error() {
				t.Errorf("Loss.Err = %v, Lock.Err = %v: want the same", e.Err, err)
			}
			_ = lk.Release(context.Background())
			n := 0
			for _, ev := range r.take() {
				if ev.method == "Lost" {
					n++
				}
				if ev.method == "ReleaseStarted" {
					t.Errorf("a release after a loss: %v", ev)
				}
			}
			if n != 1 {
				t.Errorf("%d Lost events, want 1", n)
			}
		})
	}
}

// BenchmarkAcquireRelease shows what an Observer costs per acquisition and
// release on memlock: none (nil), a NopObserver, and the recorder.
func BenchmarkAcquireRelease(b *testing.B) {
	for _, c := range []struct {
		name string
		obs  dlock.Observer
	}{{"nil", nil}, {"nop", dlock.NopObserver{}}} {
		b.Run(c.name, func(b *testing.B) {
			ctx := context.Background()
			l := dlock.New(memlock.New(), &dlock.Options{TTL: time.Minute, Observer: c.obs})
			defer l.Close(ctx)
			b.ReportAllocs()
			for b.Loop() {
				lk, err := l.TryAcquire(ctx, "bench")
				if err != nil {
					b.Fatal(err)
				}
				if err := lk.Release(ctx); err != nil {
					b.Fatal(err)
				}
			}
		})
	}
}

// panicky is an Observer whose chosen methods panic, as a buggy metrics
// hook would; the caller recovers (net/http does).
type panicky struct {
	dlock.NopObserver
	onStart, onGrant, onRelease, onLost atomic.Bool
}

func (p *panicky) Lost(dlock.Loss) {
	if p.onLost.Load() {
		panic("observer bug")
	}
}

func (p *panicky) AcquireStarted(ctx context.Context, e dlock.AcquireStart) context.Context {
	if p.onStart.Load() {
		panic("observer bug")
	}
	return ctx
}

func (p *panicky) AcquireEnded(_ context.Context, e dlock.AcquireEnd) {
	if p.onGrant.Load() && e.Outcome == dlock.Acquired {
		panic("observer bug")
	}
}

func (p *panicky) ReleaseStarted(ctx context.Context, _ dlock.ReleaseStart) context.Context {
	if p.onRelease.Load() {
		panic("observer bug")
	}
	return ctx
}

// recovered runs f and reports whether it panicked.
func recovered(f func()) (panicked bool) {
	defer func() { panicked = recover() != nil }()
	f()
	return false
}

// TestObserverPanicsLeaveNothingHeld: an Observer method that panics,
// with the panic recovered by the caller, leaves no key held by nobody and
// no Close waiting for ever; the panic reaches the caller.
func TestObserverPanicsLeaveNothingHeld(t *testing.T) {
	ctx := context.Background()
	b := memlock.New()
	obs := &panicky{}
	l := dlock.New(b, &dlock.Options{TTL: time.Hour, Observer: obs})
	other := dlock.New(b, nil)
	defer other.Close(ctx)
	free := func(what, key string) {
		t.Helper()
		k, err := other.TryAcquire(ctx, key)
		if err != nil {
			t.Errorf("%s: %q is still held: %v", what, key, err)
			return
		}
		k.Release(ctx)
	}

	obs.onGrant.Store(true)
	if !recovered(func() { l.TryAcquire(ctx, "granted") }) {
		t.Fatal("the Observer's panic did not reach the caller")
	}
	free("a panic as the grant is reported", "granted")
	if !recovered(func() { l.AcquireAll(ctx, []string{"all1", "all2"}) }) {
		t.Fatal("the Observer's panic did not reach AcquireAll's caller")
	}
	free("a panic in AcquireAll", "all1")
	obs.onGrant.Store(false)

	k, err := l.TryAcquire(ctx, "released")
	if err != nil {
		t.Fatal(err)
	}
	obs.onRelease.Store(true)
	if !recovered(func() { k.Release(ctx) }) {
		t.Fatal("the Observer's panic did not reach Release's caller")
	}
	time.Sleep(100 * time.Millisecond) // the release goes on in the background
	free("a panic as the release starts", "released")
	obs.onRelease.Store(false)
	l2 := dlock.New(b, &dlock.Options{Observer: obs})
	k, err = l2.TryAcquire(ctx, "then closed")
	if err != nil {
		t.Fatal(err)
	}
	obs.onRelease.Store(true)
	recovered(func() { k.Release(ctx) })
	obs.onRelease.Store(false)
	closed2 := make(chan error, 1)
	go func() { closed2 <- l2.Close(ctx) }()
	select {
	case err := <-closed2:
		if err != nil {
			t.Errorf("Close after a release's Observer panicked: %v", err)
		}
	case <-time.After(10 * time.Second):
		t.Fatal("Close still waits 10 s after a release's Observer panicked")
	}

	obs.onRelease.Store(false)
	for _, key := range []string{"c1", "c2", "c3"} {
		if _, err := l.TryAcquire(ctx, key); err != nil {
			t.Fatal(err)
		}
	}
	obs.onRelease.Store(true)
	closed := make(chan struct{})
	go func() {
		defer close(closed)
		recovered(func() { l.Close(ctx) })
	}()
	select {
	case <-closed:
	case <-time.After(10 * time.Second):
		t.Fatal("Close still waits 10 s after an Observer's panic")
	}
	time.Sleep(100 * time.Millisecond)
	for _, key := range []string{"c1", "c2", "c3"} {
		free("a panic in Close", key)
	}
}

// offsetClock is the system clock moved forward by off: a process that
// was paused for off.
type offsetClock struct{ off atomic.Int64 }

func (c *offsetClock) Now() time.Time { return time.Now().Add(time.Duration(c.off.Load())) }

func (c *offsetClock) AfterFunc(d time.Duration, f func()) dlock.Timer {
	return time.AfterFunc(d, f)
}

// TestObserverPanicsInGroupsAndLossesLeaveNothingHeld: Observer panics
// while a group is let go (AcquireAll's clean-up, Group.Release), or while
// an acquisition reports the loss of the key's earlier lease, leave no key
// held by nobody.
func TestObserverPanicsInGroupsAndLossesLeaveNothingHeld(t *testing.T) {
	ctx := context.Background()
	b := memlock.New()
	obs := &panicky{}
	clock := &offsetClock{}
	l := dlock.New(b, &dlock.Options{TTL: time.Hour, Observer: obs, Clock: clock})
	defer l.Close(ctx)
	other := dlock.New(b, nil)
	defer other.Close(ctx)
	free := func(what string, keys ...string) {
		t.Helper()
		for _, key := range keys {
			// A release whose start panicked goes on in the background.
			k, err := other.TryAcquire(ctx, key)
			for deadline := time.Now().Add(5 * time.Second); err != nil && time.Now().Before(deadline); {
				time.Sleep(10 * time.Millisecond)
				k, err = other.TryAcquire(ctx, key)
			}
			if err != nil {
				t.Errorf("%s: %q is still held: %v", what, key, err)
				continue
			}
			k.Release(ctx)
		}
	}

	hd, err := other.TryAcquire(ctx, "d")
	if err != nil {
		t.Fatal(err)
	}
	obs.onRelease.Store(true)
	if !recovered(func() { l.TryAcquireAll(ctx, []string{"a", "b", "c", "d"}) }) {
		t.Fatal("the Observer's panic did not reach TryAcquireAll's caller")
	}
	obs.onRelease.Store(false)
	hd.Release(ctx)
	free("a panic in TryAcquireAll's clean-up", "a", "b", "c")

	g, err := l.AcquireAll(ctx, []string{"e", "f", "g"})
	if err != nil {
		t.Fatal(err)
	}
	obs.onRelease.Store(true)
	if !recovered(func() { g.Release(ctx) }) {
		t.Fatal("the Observer's panic did not reach Group.Release's caller")
	}
	obs.onRelease.Store(false)
	free("a panic in Group.Release", "e", "f", "g")

	if _, err := l.TryAcquire(ctx, "x"); err != nil {
		t.Fatal(err)
	}
	if err := other.ForceRelease(ctx, "x"); err != nil {
		t.Fatal(err)
	}
	clock.off.Store(int64(2 * time.Hour)) // paused past the lease: lost
	obs.onLost.Store(true)
	if !recovered(func() { l.TryAcquire(ctx, "x") }) {
		t.Fatal("the Observer's panic did not reach TryAcquire's caller")
	}
	obs.onLost.Store(false)
	clock.off.Store(0)
	free("a panic as the loss of the key's earlier lease is reported", "x")
}
