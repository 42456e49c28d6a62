package mysqllock_test

import (
	"context"
	"strings"
	"testing"
	"time"

	"github.com/dlock-dev/dlock"
)

// TestListWaitersOfLongKeys checks that a waiter for a key whose named lock
// is a hash (a key too long to be a name) is listed under its key, on both
// strategies that wait in GET_LOCK.
func TestListWaitersOfLongKeys(t *testing.T) {
	needServer(t)
	for name, b := range map[string]func(t *testing.T) dlock.Backend{
		"lease":   func(t *testing.T) dlock.Backend { return newBackend(t, "") },
		"getlock": func(t *testing.T) dlock.Backend { return newGetLock(t, "") },
	} {
		t.Run(name, func(t *testing.T) {
			holder, waiter := dlock.New(b(t), nil), dlock.New(b(t), nil)
			defer holder.Close(context.Background())
			defer waiter.Close(context.Background())
			prefix := "waiters/" + dlock.NewToken().String() + "/"
			key := prefix + strings.Repeat("ü", 100)
			ctx, cancel := context.WithTimeout(context.Background(), 30*time.Second)
			defer cancel()
			if _, err := holder.TryAcquire(ctx, key, dlock.WithTTL(5*time.Second)); err != nil {
				t.Fatal(err)
			}
			wctx, giveUp := context.WithCancel(ctx)
			done := make(chan error, 1)
			go func() {
				_, err := waiter.Acquire(wctx, key, dlock.WithTTL(5*time.Second))
				done <- err
			}()
			var ws []dlock.WaiterInfo
			for ctx.Err() == nil {
				var err error
				if ws, err = holder.ListWaiters(ctx, prefix); err != nil {
					t.Fatal(err)
				}
				if len(ws) > 0 {
					break
				}
				time.Sleep(20 * time.Millisecond)
			}
			if len(ws) != 1 || ws[0].Key != key || !strings.HasPrefix(ws[0].Client, "connection ") {
				t.Errorf("ListWaiters(%q) = %+v, want the waiter for the long key, with its connection", prefix, ws)
			}
			giveUp()
			<-done
		})
	}
}
