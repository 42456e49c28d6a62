package mysqllock_test

import (
	"context"
	"math/rand/v2"
	"testing"
	"time"

	"github.com/dlock-dev/dlock"
	"github.com/dlock-dev/dlock/locktest"
)

// sessionBackends makes a fresh GetLock or RowLock on a pool of its own.
var sessionBackends = []struct {
	name string
	mk   func(t *testing.T) dlock.Backend
}{
	{"getlock", func(t *testing.T) dlock.Backend { return newGetLock(t, "") }},
	{"rowlock", func(t *testing.T) dlock.Backend { return newRowLock(t, "") }},
}

// holdElsewhere takes key with a Locker of its own over b,
// closed with the test.
func holdElsewhere(t *testing.T, b dlock.Backend, key string) *dlock.Lock {
	t.Helper()
	lk, err := locktest.NewLocker(t, b).TryAcquire(t.Context(), key, dlock.WithTTL(time.Minute))
	if err != nil {
		t.Fatal(err)
	}
	return lk
}

// A wait whose context ends in its first milliseconds, as its statement is
// sent, returns promptly: the server discards a KILL QUERY that arrives
// before the statement starts, so the wait ran to its 30 s bound.
func TestWaitEndedAsItStartsReturnsPromptly(t *testing.T) {
	for _, c := range sessionBackends {
		t.Run(c.name, func(t *testing.T) {
			key := locktest.UniqueKey("left-at-start")
			defer holdElsewhere(t, c.mk(t), key).Release(context.Background())
			w := c.mk(t).(dlock.Waiter)
			// A refused try: getlock's AcquireWait then waits at once.
			if res, err := c.mk(t).Acquire(t.Context(), dlock.Request{Key: key, Token: dlock.NewToken(), TTL: 10 * time.Second}); err != nil || res.Acquired {
				t.Fatalf("try: %+v, %v", res, err)
			}
			for i := range 300 {
				after := time.Duration(rand.IntN(3000)) * time.Microsecond
				ctx, cancel := context.WithCancel(t.Context())
				time.AfterFunc(after, cancel)
				start := time.Now()
				res, err := w.AcquireWait(ctx, dlock.Request{Key: key, Token: dlock.NewToken(), TTL: 10 * time.Second})
				took := time.Since(start)
				cancel()
				if res.Acquired {
					t.Fatalf("round %d: acquired a held key", i)
				}
				if took > after+2*time.Second {
					t.Fatalf("round %d: AcquireWait returned %s after its context ended %s into it (%v)", i, took.Round(time.Millisecond), after, err)
				}
			}
		})
	}
}

// Locker.Close as a blocking Acquire of a held key starts its wait returns
// promptly.
func TestLockerCloseAsAWaitStartsIsPrompt(t *testing.T) {
	for _, c := range sessionBackends {
		t.Run(c.name, func(t *testing.T) {
			key := locktest.UniqueKey("close-at-start")
			defer holdElsewhere(t, c.mk(t), key).Release(context.Background())
			b := c.mk(t)
			for i := range 200 {
				l := dlock.New(b, nil)
				got := make(chan error, 1)
				go func() {
					_, err := l.Acquire(context.Background(), key)
					got <- err
				}()
				time.Sleep(time.Duration(rand.IntN(3000)) * time.Microsecond)
				start := time.Now()
				cerr := l.Close(context.Background())
				took := time.Since(start)
				aerr := <-got
				if took > 2*time.Second {
					t.Fatalf("round %d: Locker.Close took %s during a wait (close: %v; acquire: %v)", i, took.Round(time.Millisecond), cerr, aerr)
				}
			}
		})
	}
}

// Closing the backend while a blocking Acquire waits does not wait for
// the wait to end.
func TestBackendCloseDuringAWaitIsPrompt(t *testing.T) {
	for _, c := range sessionBackends {
		t.Run(c.name, func(t *testing.T) {
			key := locktest.UniqueKey("backend-close")
			defer holdElsewhere(t, c.mk(t), key).Release(context.Background())
			b := c.mk(t)
			l := dlock.New(b, nil)
			defer l.Close(context.Background())
			waiting := make(chan struct{})
			go func() {
				defer close(waiting)
				ctx, cancel := context.WithTimeout(context.Background(), 3*time.Second)
				defer cancel()
				l.Acquire(ctx, key)
			}()
			time.Sleep(500 * time.Millisecond) // in its wait
			start := time.Now()
			b.(interface{ Close() error }).Close()
			if took := time.Since(start); took > 2*time.Second {
				t.Errorf("Close took %s while a blocking Acquire waited", took.Round(time.Millisecond))
			}
			<-waiting
		})
	}
}
