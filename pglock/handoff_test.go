package pglock_test

import (
	"bytes"
	"context"
	"log/slog"
	"runtime"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/dlock-dev/dlock"
	"github.com/dlock-dev/dlock/locktest"
	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgxpool"
)

// TestReleaseHandsTheLeaseToTheFirstWaiter: an exclusive release grants the
// key to the first queued exclusive waiter in its own statement: when
// Release returns, the waiters hold the key in their order of arrival, each
// with the next fence, before any of them has run a statement.
func TestReleaseHandsTheLeaseToTheFirstWaiter(t *testing.T) {
	pool := open(t, "handoff")
	locktest.ReleaseHandsOff(t, func(int) *dlock.Locker { return locktest.NewLocker(t, newLease(t, pool)) },
		"handoff/"+dlock.NewToken().String())
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
			locktest.WaitQueued(t, holder, key, 1)
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
