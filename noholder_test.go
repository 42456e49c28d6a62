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
			l := New(c.b.(Backend), nil)
			defer l.Close(context.Background())
			var err error
			if c.try {
				_, err = l.TryAcquire(ctx, "k", c.opts...)
			} else {
				_, err = l.Acquire(ctx, "k", c.opts...)
			}
			if c.try != (err != nil) {
				t.Fatalf("acquire: %v", err)
			}
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
