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
