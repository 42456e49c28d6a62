package dlock

import (
	"context"
	"sync"
	"testing"
	"time"
)

// holderSeen records the NoHolder of every Acquire; the key shows held
// to the first one.
type holderSeen struct {
	mu       sync.Mutex
	noHolder []bool
}

func (b *holderSeen) Acquire(ctx context.Context, req Request) (Result, error) {
	b.mu.Lock()
	defer b.mu.Unlock()
	b.noHolder = append(b.noHolder, req.NoHolder)
	if len(b.noHolder) == 1 {
		return Result{Holder: LockInfo{Key: req.Key, Owner: "other"}, Remaining: time.Millisecond}, nil
	}
	return Result{Acquired: true, Fence: uint64(len(b.noHolder))}, nil
}

func (b *holderSeen) Extend(ctx context.Context, leases []Lease) ([]error, error) {
	return make([]error, len(leases)), nil
}

func (b *holderSeen) Release(ctx context.Context, key string, token Token) error { return nil }

func (b *holderSeen) seen() []bool {
	b.mu.Lock()
	defer b.mu.Unlock()
	return append([]bool(nil), b.noHolder...)
}

// waitingHolderSeen is holderSeen that waits in the store: its wait grants.
type waitingHolderSeen struct{ holderSeen }

func (b *waitingHolderSeen) AcquireWait(ctx context.Context, req Request) (Result, error) {
	return Result{Acquired: true, Fence: 100}, nil
}

// acquireOnce acquires "k" once through a Locker over b: a try, which the
// backends here refuse, or a blocking acquisition, which they grant.
func acquireOnce(ctx context.Context, t *testing.T, b Backend, try bool, opts []AcquireOption) {
	t.Helper()
	l := New(b, nil)
	defer l.Close(context.Background())
	var err error
	if try {
		_, err = l.TryAcquire(ctx, "k", opts...)
	} else {
		_, err = l.Acquire(ctx, "k", opts...)
	}
	if try != (err != nil) {
		t.Fatalf("acquire: %v", err)
	}
}

// TestNoHolderOnlyWhenTheRefusalGoesUnread: a backend is told it may skip
// describing the holder only on the first attempt of a blocking
// acquisition that waits in the store next and has no WithWaitFunc; every
// refusal whose holder somebody reads asks for it.
func TestNoHolderOnlyWhenTheRefusalGoesUnread(t *testing.T) {
	ctx, cancel := context.WithTimeout(context.Background(), 5*time.Second)
	defer cancel()
	cases := []struct {
		name  string
		b     interface{ seen() []bool }
		try   bool
		opts  []AcquireOption
		wants []bool
	}{
		{"blocking, waits in the store", &waitingHolderSeen{}, false, nil, []bool{true}},
		{"blocking with WithWaitFunc", &waitingHolderSeen{}, false, []AcquireOption{WithWaitFunc(func(LockInfo) {})}, []bool{false}},
		{"blocking, polls", &holderSeen{}, false, nil, []bool{false, false}},
		{"try", &waitingHolderSeen{}, true, nil, []bool{false}},
	}
	for _, c := range cases {
		t.Run(c.name, func(t *testing.T) {
			acquireOnce(ctx, t, c.b.(Backend), c.try, c.opts)
			got := c.b.seen()
			if len(got) != len(c.wants) {
				t.Fatalf("Acquire calls: NoHolder %v, want %v", got, c.wants)
			}
			for i := range got {
				if got[i] != c.wants[i] {
					t.Errorf("Acquire calls: NoHolder %v, want %v", got, c.wants)
					break
				}
			}
		})
	}
}

// directWaiter is waitingHolderSeen that waits directly when direct is
// set, and counts its waits.
type directWaiter struct {
	waitingHolderSeen
	direct bool
	waits  int
}

func (b *directWaiter) AcquireWait(ctx context.Context, req Request) (Result, error) {
	b.mu.Lock()
	b.waits++
	b.mu.Unlock()
	return b.waitingHolderSeen.AcquireWait(ctx, req)
}

func (b *directWaiter) WaitsDirectly() bool { return b.direct }

// TestDirectWaiterWaitsAtOnce: a blocking acquisition on a DirectWaiter
// that reports it waits directly makes AcquireWait its only store call;
// one with WithWaitFunc, a try, or a DirectWaiter that reports false
// attempt with Acquire first.
func TestDirectWaiterWaitsAtOnce(t *testing.T) {
	ctx, cancel := context.WithTimeout(context.Background(), 5*time.Second)
	defer cancel()
	cases := []struct {
		name     string
		direct   bool
		try      bool
		opts     []AcquireOption
		acquires int
		waits    int
	}{
		{"blocking", true, false, nil, 0, 1},
		{"blocking with WithWaitFunc", true, false, []AcquireOption{WithWaitFunc(func(LockInfo) {})}, 1, 1},
		{"try", true, true, nil, 1, 0},
		{"not direct", false, false, nil, 1, 1},
	}
	for _, c := range cases {
		t.Run(c.name, func(t *testing.T) {
			b := &directWaiter{direct: c.direct}
			acquireOnce(ctx, t, b, c.try, c.opts)
			if got := len(b.seen()); got != c.acquires || b.waits != c.waits {
				t.Errorf("%d Acquire and %d AcquireWait calls, want %d and %d", got, b.waits, c.acquires, c.waits)
			}
		})
	}
}
