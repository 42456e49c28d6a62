package redislock_test

import (
	"context"
	"strconv"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/dlock-dev/dlock"
)

// connectionsReceived is the server's count of accepted connections.
func connectionsReceived(t *testing.T, addr string) int {
	t.Helper()
	info, err := newClient(t, addr).Info(t.Context(), "stats").Result()
	if err != nil {
		t.Fatal(err)
	}
	for line := range strings.SplitSeq(info, "\r\n") {
		if v, ok := strings.CutPrefix(line, "total_connections_received:"); ok {
			n, err := strconv.Atoi(v)
			if err != nil {
				t.Fatal(err)
			}
			return n
		}
	}
	t.Fatal("no total_connections_received in INFO stats")
	return 0
}

// TestWaitsShareASubscription: waits of one Backend on one key, at once or
// one after the other, use one pub/sub connection, and every one of them is
// woken by a release.
func TestWaitsShareASubscription(t *testing.T) {
	addr := startServer(t).addr()
	ctx, cancel := context.WithTimeout(t.Context(), 20*time.Second)
	defer cancel()
	holder := dlock.New(newBackend(t, newClient(t, addr), nil), nil)
	defer holder.Close(context.Background())
	waiters := dlock.New(newBackend(t, newClient(t, addr), nil), nil)
	defer waiters.Close(context.Background())
	before := connectionsReceived(t, addr)
	const rounds, perRound = 10, 3
	for range rounds {
		lk, err := holder.Acquire(ctx, "k")
		if err != nil {
			t.Fatal(err)
		}
		var wg sync.WaitGroup
		got := make(chan *dlock.Lock, perRound)
		for range perRound {
			wg.Go(func() {
				w, err := waiters.Acquire(ctx, "k")
				if err != nil {
					t.Errorf("wait: %v", err)
					return
				}
				got <- w
			})
		}
		// The waits are in the store: the Locker waits for a release of
		// another owner of its own in the Locker.
		time.Sleep(100 * time.Millisecond)
		if err := lk.Release(ctx); err != nil {
			t.Fatal(err)
		}
		for range perRound {
			select {
			case w := <-got:
				if err := w.Release(ctx); err != nil {
					t.Fatal(err)
				}
			case <-ctx.Done():
				t.Fatal("a waiter was not woken")
			}
		}
		wg.Wait()
	}
	// The clients' pools open a few connections (the waits run at once);
	// a pub/sub connection per wait would be one per wait more.
	if n := connectionsReceived(t, addr) - before; n >= rounds*perRound/2 {
		t.Errorf("%d connections for %d waits of one Backend on one key; want them to share a subscription", n, rounds*perRound)
	}
}
