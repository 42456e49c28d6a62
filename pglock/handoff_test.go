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

// sentSQL records the statements a pool sends.
type sentSQL struct {
	mu   sync.Mutex
	sent []string
}

func (s *sentSQL) TraceQueryStart(ctx context.Context, _ *pgx.Conn, d pgx.TraceQueryStartData) context.Context {
	s.mu.Lock()
	defer s.mu.Unlock()
	s.sent = append(s.sent, d.SQL)
	return ctx
}

func (s *sentSQL) TraceQueryEnd(context.Context, *pgx.Conn, pgx.TraceQueryEndData) {}

// count returns how many statements sent so far contain each of parts.
func (s *sentSQL) count(parts ...string) []int {
	s.mu.Lock()
	defer s.mu.Unlock()
	n := make([]int, len(parts))
	for _, q := range s.sent {
		for i, p := range parts {
			if strings.Contains(q, p) {
				n[i]++
			}
		}
	}
	return n
}

// TestLeaseWaiterJoinsBehindALiveHolder: a blocking acquisition of a key
// that an attempt found held lately joins the queue with the small join
// statement, not the acquisition statement, and is handed the key by the
// holder's release, with the next fence; on a key that is free by then
// the join takes nothing and the acquisition statement takes the key.
func TestLeaseWaiterJoinsBehindALiveHolder(t *testing.T) {
	ctx, cancel := context.WithTimeout(t.Context(), 30*time.Second)
	defer cancel()
	holder := newLease(t, open(t, ""))
	cfg := openConfig(t)
	trace := &sentSQL{}
	cfg.ConnConfig.Tracer = trace
	waiter := newLease(t, openWith(t, cfg))
	const join, acquire = "l.token <> $2", "acq AS ("
	req := func(key string) dlock.Request {
		return dlock.Request{Key: key, Token: dlock.NewToken(), TTL: 10 * time.Second, Mode: dlock.ModeExclusive}
	}
	key := locktest.UniqueKey("join")
	held := req(key)
	first, err := holder.Acquire(ctx, held)
	if err != nil || !first.Acquired {
		t.Fatalf("holder: %+v, %v", first, err)
	}
	if res, err := waiter.Acquire(ctx, req(key)); err != nil || res.Acquired {
		t.Fatalf("a try of the held key: %+v, %v", res, err)
	}
	before := trace.count(join, acquire)
	w := req(key)
	got := make(chan dlock.Result, 1)
	go func() {
		res, err := waiter.AcquireWait(ctx, w)
		if err != nil {
			t.Errorf("wait: %v", err)
		}
		got <- res
	}()
	for n := trace.count(join, acquire); n[0] == before[0] && n[1] == before[1] && ctx.Err() == nil; n = trace.count(join, acquire) {
		time.Sleep(5 * time.Millisecond)
	}
	time.Sleep(50 * time.Millisecond) // the statement's reply, and the wait begins
	if err := holder.Release(ctx, key, held.Token); err != nil {
		t.Fatal(err)
	}
	res := <-got
	if !res.Acquired || res.Fence != first.Fence+1 {
		t.Fatalf("the waiter got %+v, want the key with fence %d", res, first.Fence+1)
	}
	after := trace.count(join, acquire)
	if after[0] != before[0]+1 || after[1] != before[1] {
		t.Errorf("the wait sent %d join and %d acquisition statements, want 1 and 0", after[0]-before[0], after[1]-before[1])
	}
	if err := waiter.Release(ctx, key, w.Token); err != nil {
		t.Fatal(err)
	}

	// Refused lately, but free now: the join takes nothing, acquire does.
	free := req(key)
	if res, err := waiter.AcquireWait(ctx, free); err != nil || !res.Acquired || res.Fence != first.Fence+2 {
		t.Fatalf("a wait on the free key: %+v, %v; want the key with fence %d", res, err, first.Fence+2)
	}
	last := trace.count(join, acquire)
	if last[1] != after[1]+1 {
		t.Errorf("the wait on the free key sent %d acquisition statements, want 1", last[1]-after[1])
	}
}
