package dlock_test

import (
	"context"
	"errors"
	"sync"
	"testing"
	"time"

	"github.com/dlock-dev/dlock"
	"github.com/dlock-dev/dlock/memlock"
)

// sessionStore is memlock dressed as a session-bound backend, whose renewals
// can be made to fail, and which records what the Locker asks of it.
type sessionStore struct {
	dlock.Backend
	mu        sync.Mutex
	failing   bool
	reqs      []dlock.Request
	released  []dlock.Token
	abandoned chan dlock.Token
}

func (s *sessionStore) SessionBound() {}

func (s *sessionStore) Acquire(ctx context.Context, req dlock.Request) (dlock.Result, error) {
	s.mu.Lock()
	s.reqs = append(s.reqs, req)
	s.mu.Unlock()
	return s.Backend.Acquire(ctx, req)
}

func (s *sessionStore) Extend(ctx context.Context, leases []dlock.Lease) ([]error, error) {
	s.mu.Lock()
	failing := s.failing
	s.mu.Unlock()
	if failing {
		return nil, errors.New("injected")
	}
	return s.Backend.Extend(ctx, leases)
}

func (s *sessionStore) Release(ctx context.Context, key string, token dlock.Token) error {
	s.mu.Lock()
	s.released = append(s.released, token)
	s.mu.Unlock()
	return s.Backend.Release(ctx, key, token)
}

// delayingStore is sessionStore that keeps lock-delays (dlock.LockDelayer).
type delayingStore struct{ *sessionStore }

func (s delayingStore) Abandon(ctx context.Context, key string, token dlock.Token) error {
	s.abandoned <- token
	return nil
}

func TestLockDelayOnSessionStores(t *testing.T) {
	ctx := context.Background()
	refusing := dlock.New(&sessionStore{Backend: memlock.New()}, nil)
	defer refusing.Close(ctx)
	if _, err := refusing.TryAcquire(ctx, "k", dlock.WithLockDelay(time.Second)); !errors.Is(err, dlock.ErrUnsupported) {
		t.Errorf("a session store that keeps no lock-delay: %v, want ErrUnsupported", err)
	}
	if lk, err := refusing.TryAcquire(ctx, "k"); err != nil {
		t.Errorf("without a lock-delay: %v", err)
	} else {
		_ = lk.Release(ctx)
	}

	s := &sessionStore{Backend: memlock.New(), abandoned: make(chan dlock.Token, 1)}
	l := dlock.New(delayingStore{s}, nil)
	defer l.Close(ctx)
	const ttl, d = 2 * time.Second, 5 * time.Second
	lk, err := l.TryAcquire(ctx, "k", dlock.WithTTL(ttl), dlock.WithLockDelay(d))
	if err != nil {
		t.Fatalf("a session store that keeps lock-delays: %v", err)
	}
	s.mu.Lock()
	req := s.reqs[len(s.reqs)-1]
	s.failing = true
	s.mu.Unlock()
	if req.LockDelay != d || req.TTL != ttl+d {
		t.Errorf("request: TTL %s, LockDelay %s; want %s, %s", req.TTL, req.LockDelay, ttl+d, d)
	}
	select {
	case tok := <-s.abandoned:
		if !errors.Is(lk.Err(), dlock.ErrLockLost) {
			t.Errorf("abandoned before the holder was told: Err %v", lk.Err())
		}
		if tok != req.Token {
			t.Errorf("abandoned %s, want the lost lease's %s", tok, req.Token)
		}
	case <-time.After(10 * ttl):
		t.Fatal("a lost lock with a lock-delay was not abandoned")
	}
	s.mu.Lock()
	defer s.mu.Unlock()
	for _, tok := range s.released {
		if tok == req.Token {
			t.Error("a lost lock with a lock-delay was released (its delay would be lost)")
		}
	}
}

// A TTL, lock-delay or minimum hold above MaxTTL is refused: their sum,
// sent to the store as the lease, would wrap around to a lease that has
// already run out while the holder counts on its own sum.
func TestDurationsAboveMaxTTLAreRefused(t *testing.T) {
	ctx := context.Background()
	b := memlock.New()
	l := dlock.New(b, nil)
	defer l.Close(ctx)
	forever := time.Duration(1<<63 - 1)
	for _, opts := range [][]dlock.AcquireOption{
		{dlock.WithTTL(forever), dlock.WithLockDelay(time.Second)},
		{dlock.WithTTL(dlock.MaxTTL + 1)},
		{dlock.WithLockDelay(forever)},
		{dlock.WithMinHold(forever)},
	} {
		lk, err := l.TryAcquire(ctx, "k", opts...)
		if err == nil {
			lk.Release(ctx)
			t.Fatal("rule: durations above MaxTTL are refused; acquired")
		}
		if !errors.Is(err, dlock.ErrInvalidOption) {
			t.Fatalf("got %v, want ErrInvalidOption", err)
		}
	}
	// At MaxTTL with a lock-delay of MaxTTL the key stays held.
	lk, err := l.TryAcquire(ctx, "k", dlock.WithTTL(dlock.MaxTTL), dlock.WithLockDelay(dlock.MaxTTL))
	if err != nil {
		t.Fatal(err)
	}
	defer lk.Release(ctx)
	other := dlock.New(b, nil)
	defer other.Close(ctx)
	if o, err := other.TryAcquire(ctx, "k"); err == nil {
		o.Release(ctx)
		t.Error("rule: mutual exclusion; another Locker took a key held for MaxTTL with a lock-delay of MaxTTL")
	}
}

// A Release or Close cut short by its context still keeps the rest of a
// minimum hold: it goes on in the background, as a plain release does.
func TestMinHoldKeptWhenTheReleaseIsCutShort(t *testing.T) {
	for _, viaClose := range []bool{false, true} {
		name := "Release"
		if viaClose {
			name = "Close"
		}
		t.Run(name, func(t *testing.T) {
			ctx := context.Background()
			const ttl, hold = time.Second, 4 * time.Second
			b := memlock.New()
			l := dlock.New(b, &dlock.Options{TTL: ttl})
			defer l.Close(ctx)
			began := time.Now()
			lk, err := l.TryAcquire(ctx, "job", dlock.WithMinHold(hold))
			if err != nil {
				t.Fatal(err)
			}
			ended, cancel := context.WithCancel(ctx)
			cancel()
			if viaClose {
				l.Close(ended)
			} else {
				lk.Release(ended)
			}
			keptUntil(t, b, "job", began, hold-300*time.Millisecond, "after a "+name+" cut short by its context")
		})
	}
}

// heldRenewal is memlock whose first renewal (an extension by the TTL)
// waits at gate, once it has told entered.
type heldRenewal struct {
	*memlock.Backend
	ttl     time.Duration
	entered chan struct{}
	gate    chan struct{}
	once    sync.Once
}

func (b *heldRenewal) Extend(ctx context.Context, leases []dlock.Lease) ([]error, error) {
	if len(leases) == 1 && leases[0].TTL == b.ttl {
		b.once.Do(func() { close(b.entered) })
		<-b.gate
	}
	return b.Backend.Extend(ctx, leases)
}

// A renewal under way when the holder lets go does not reach the store
// after the extension that keeps the rest of the minimum hold: the key
// would come free a TTL later instead of at the hold's end.
func TestMinHoldSurvivesARenewalUnderWay(t *testing.T) {
	ctx := context.Background()
	const ttl, hold = 1500 * time.Millisecond, 6 * time.Second
	b := &heldRenewal{Backend: memlock.New(), ttl: ttl, entered: make(chan struct{}), gate: make(chan struct{})}
	l := dlock.New(b, &dlock.Options{TTL: ttl})
	defer l.Close(ctx)
	began := time.Now()
	lk, err := l.TryAcquire(ctx, "job", dlock.WithMinHold(hold))
	if err != nil {
		t.Fatal(err)
	}
	<-b.entered // the first renewal is on its way (at TTL/3)
	time.AfterFunc(100*time.Millisecond, func() { close(b.gate) })
	if err := lk.Release(ctx); err != nil {
		t.Fatal(err)
	}
	keptUntil(t, b.Backend, "job", began, hold-500*time.Millisecond, "after a release during a renewal")
}

// keptUntil checks, every 50 ms, that another Locker over b cannot take
// key until d after began (a minimum hold's end, less some slack).
func keptUntil(t *testing.T, b dlock.Backend, key string, began time.Time, d time.Duration, when string) {
	t.Helper()
	ctx := context.Background()
	other := dlock.New(b, nil)
	defer other.Close(ctx)
	for time.Since(began) < d {
		if k, err := other.TryAcquire(ctx, key); err == nil {
			k.Release(ctx)
			t.Fatalf("rule: WithMinHold keeps the key; %s another Locker took it %s after the grant",
				when, time.Since(began).Round(time.Millisecond))
		}
		time.Sleep(50 * time.Millisecond)
	}
}
