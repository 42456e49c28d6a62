package pglock_test

import (
	"bytes"
	"context"
	"fmt"
	"log/slog"
	"runtime"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/dlock-dev/dlock"
	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgxpool"
)

// queued waits until key has n waiters in l's listing.
func queued(t *testing.T, l *dlock.Locker, key string, n int) {
	t.Helper()
	for range 500 {
		ws, err := l.ListWaiters(context.Background(), key)
		if err != nil {
			t.Fatal(err)
		}
		if len(ws) >= n {
			return
		}
		time.Sleep(10 * time.Millisecond)
	}
	t.Fatalf("%q: fewer than %d waiters after 5s", key, n)
}

// TestReleaseHandsTheLeaseToTheFirstWaiter: an exclusive release grants the
// key to the first queued exclusive waiter in its own statement: when
// Release returns, the waiters hold the key in their order of arrival, each
// with the next fence, before any of them has run a statement.
func TestReleaseHandsTheLeaseToTheFirstWaiter(t *testing.T) {
	ctx, cancel := context.WithTimeout(context.Background(), 60*time.Second)
	defer cancel()
	pool := open(t, "handoff")
	holder := dlock.New(newLease(t, pool), nil)
	defer holder.Close(context.Background())
	key := "handoff/" + dlock.NewToken().String()
	lk, err := holder.TryAcquire(ctx, key, dlock.WithTTL(30*time.Second))
	if err != nil {
		t.Fatal(err)
	}
	type got struct {
		lk  *dlock.Lock
		err error
	}
	const n = 3
	results := make([]chan got, n)
	for i := range n {
		w := dlock.New(newLease(t, pool), nil)
		defer w.Close(context.Background())
		results[i] = make(chan got, 1)
		go func() {
			lk, err := w.Acquire(ctx, key, dlock.WithTTL(30*time.Second), dlock.WithOwner(fmt.Sprint("waiter-", i)))
			results[i] <- got{lk, err}
		}()
		queued(t, holder, key, i+1)
	}
	fence := lk.Fence()
	release := lk.Release
	for i := range n {
		if err := release(ctx); err != nil {
			t.Fatal(err)
		}
		fence++
		hs, err := holder.List(ctx, key)
		if err != nil {
			t.Fatal(err)
		}
		if len(hs) != 1 || hs[0].Owner != fmt.Sprint("waiter-", i) || hs[0].Fence != fence {
			t.Fatalf("release %d: holders right after it %+v; want waiter-%d with fence %d", i, hs, i, fence)
		}
		r := <-results[i]
		if r.err != nil {
			t.Fatalf("waiter-%d: %v", i, r.err)
		}
		if r.lk.Fence() != fence {
			t.Errorf("waiter-%d: fence %d, the store's %d", i, r.lk.Fence(), fence)
		}
		if left := time.Until(r.lk.Deadline()); left < 15*time.Second {
			t.Errorf("waiter-%d: %s left of a 30s lease right after its grant", i, left)
		}
		release = r.lk.Release
	}
	if err := release(ctx); err != nil {
		t.Fatal(err)
	}
	lk, err = holder.TryAcquire(ctx, key)
	if err != nil {
		t.Fatalf("the key after the last release: %v", err)
	}
	lk.Release(ctx)
}

// fromDial reports whether pglock's dial (the LISTEN connection, outside
// the pool) is on the stack.
func fromDial() bool {
	pc := make([]uintptr, 64)
	frames := runtime.CallersFrames(pc[:runtime.Callers(2, pc)])
	for {
		f, more := frames.Next()
		if strings.HasSuffix(f.Function, "pglock.dial") {
			return true
		}
		if !more {
			return false
		}
	}
}

// syncBuf is a log destination safe for concurrent writes.
type syncBuf struct {
	mu sync.Mutex
	b  bytes.Buffer
}

func (l *syncBuf) Write(p []byte) (int, error) {
	l.mu.Lock()
	defer l.mu.Unlock()
	return l.b.Write(p)
}

func (l *syncBuf) String() string {
	l.mu.Lock()
	defer l.mu.Unlock()
	return l.b.String()
}

// TestHandoffFoundLateIsRenewed: a waiter that finds the lease a release
// handed it late, with most of it gone (it heard no notification and
// looked at its timer; or its statement waited for a pool connection),
// renews it before its Locker gets it: the wait returns that grant (the
// handed fence, no other taken), with most of a TTL left, and the Locker
// does not throw it away as too late.
func TestHandoffFoundLateIsRenewed(t *testing.T) {
	for _, tc := range []struct {
		name       string
		ttl, delay time.Duration
		// hold: how long after the waiter queued the holder releases;
		// block: how long the waiter's only connection is taken then.
		hold, block time.Duration
		deaf        bool // the waiter's LISTEN hears no release
	}{
		{name: "deaf, lock-delay", ttl: 2 * time.Second, delay: 3 * time.Second, hold: time.Second, deaf: true},
		{name: "deaf", ttl: 3 * time.Second, hold: 2200 * time.Millisecond, deaf: true},
		{name: "pool wait", ttl: 2 * time.Second, block: 1100 * time.Millisecond},
	} {
		t.Run(tc.name, func(t *testing.T) {
			ctx, cancel := context.WithTimeout(context.Background(), 30*time.Second)
			defer cancel()
			holder := dlock.New(newLease(t, open(t, "handofflate")), nil)
			defer holder.Close(context.Background())
			key := "handofflate/" + dlock.NewToken().String()
			lk, err := holder.TryAcquire(ctx, key, dlock.WithTTL(30*time.Second))
			if err != nil {
				t.Fatal(err)
			}
			cfg := openConfig(t)
			if tc.deaf {
				cfg.BeforeConnect = func(_ context.Context, cc *pgx.ConnConfig) error {
					if fromDial() {
						cc.Database = "postgres" // LISTEN where no release notifies
					}
					return nil
				}
			}
			if tc.block > 0 {
				cfg.MaxConns = 1
			}
			wpool := openWith(t, cfg)
			var log syncBuf
			waiter := dlock.New(newLease(t, wpool), &dlock.Options{Logger: slog.New(slog.NewTextHandler(&log, nil))})
			defer waiter.Close(context.Background())
			type got struct {
				lk  *dlock.Lock
				err error
			}
			done := make(chan got, 1)
			go func() {
				lk, err := waiter.Acquire(ctx, key, dlock.WithTTL(tc.ttl), dlock.WithLockDelay(tc.delay))
				done <- got{lk, err}
			}()
			queued(t, holder, key, 1)
			time.Sleep(tc.hold)
			var c *pgxpool.Conn
			if tc.block > 0 {
				if c, err = wpool.Acquire(ctx); err != nil { // the application's own statement
					t.Fatal(err)
				}
			}
			if err := lk.Release(ctx); err != nil {
				t.Fatal(err)
			}
			if c != nil {
				time.Sleep(tc.block)
				c.Release()
			}
			r := <-done
			if r.err != nil {
				t.Fatalf("the wait: %v", r.err)
			}
			defer r.lk.Release(context.Background())
			if strings.Contains(log.String(), "too late") {
				t.Errorf("the Locker threw the handed lease away as too late:\n%s", log.String())
			}
			if r.lk.Fence() != lk.Fence()+1 {
				t.Errorf("fence %d; the handed lease's is %d", r.lk.Fence(), lk.Fence()+1)
			}
			if left := time.Until(r.lk.Deadline()); left < tc.ttl/2 {
				t.Errorf("%s left of a %s lease right after the grant", left, tc.ttl)
			}
		})
	}
}
