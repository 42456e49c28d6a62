package redislock_test

import (
	"context"
	"strconv"
	"sync"
	"testing"
	"time"

	"github.com/dlock-dev/dlock"
	"github.com/redis/go-redis/v9"
)

// pipelineSizes is a go-redis hook that records how many script calls by
// digest each pipeline carries (a repeat with the script's body, after the
// server answered that it had not cached it, is not counted).
type pipelineSizes struct {
	mu    sync.Mutex
	sizes []int
}

func (*pipelineSizes) DialHook(next redis.DialHook) redis.DialHook          { return next }
func (*pipelineSizes) ProcessHook(next redis.ProcessHook) redis.ProcessHook { return next }

func (h *pipelineSizes) ProcessPipelineHook(next redis.ProcessPipelineHook) redis.ProcessPipelineHook {
	return func(ctx context.Context, cmds []redis.Cmder) error {
		n := 0
		for _, c := range cmds {
			if c.Name() == "evalsha" {
				n++
			}
		}
		if n > 0 {
			h.mu.Lock()
			h.sizes = append(h.sizes, n)
			h.mu.Unlock()
		}
		return next(ctx, cmds)
	}
}

func (h *pipelineSizes) peek() []int {
	h.mu.Lock()
	defer h.mu.Unlock()
	return h.sizes
}

func (h *pipelineSizes) take() []int {
	h.mu.Lock()
	defer h.mu.Unlock()
	s := h.sizes
	h.sizes = nil
	return s
}

// TestManyLocksRenewInOneRoundTrip: leases that fall due together are
// renewed in one pipeline (one script call per 1,000 leases), on one
// connection, not in calls of 1,000 leases side by side.
func TestManyLocksRenewInOneRoundTrip(t *testing.T) {
	const n, ttl = 2500, 9 * time.Second
	addr := serversFromEnv(t, envAddr, 1, false)[0]
	c := redis.NewClient(&redis.Options{Addr: addr, PoolSize: 8})
	t.Cleanup(func() { c.Close() })
	hook := &pipelineSizes{}
	c.AddHook(hook)
	l := dlock.New(newBackend(t, c, nil), nil)
	defer l.Close(context.Background())
	// Acquired within a second, they fall due within the window of TTL/6
	// that the Locker renews together.
	var wg sync.WaitGroup
	errs := make(chan error, 4)
	prefix := "many/" + t.Name() + "/" + strconv.FormatInt(time.Now().UnixNano(), 36) + "/"
	start := time.Now()
	for w := range 4 {
		wg.Go(func() {
			for i := w; i < n; i += 4 {
				if _, err := l.TryAcquire(ctxT(t, 10*time.Second), prefix+strconv.Itoa(i), dlock.WithTTL(ttl)); err != nil {
					errs <- err
					return
				}
			}
		})
	}
	wg.Wait()
	close(errs)
	if err := <-errs; err != nil {
		t.Fatal(err)
	}
	if took := time.Since(start); took > ttl/6 {
		t.Skipf("acquiring %d locks took %s, longer than the renewal window", n, took)
	}
	hook.take()
	// The first renewal falls due TTL/3 after the first acquisition.
	deadline := time.Now().Add(ttl)
	for len(hook.peek()) == 0 && time.Now().Before(deadline) {
		time.Sleep(10 * time.Millisecond)
	}
	time.Sleep(500 * time.Millisecond) // any calls of the same round
	sizes := hook.take()
	if len(sizes) != 1 || sizes[0] != 3 {
		t.Errorf("the first renewal of %d leases went in pipelines of %v commands, want one of 3 script calls", n, sizes)
	}
	if got := c.PoolStats().TotalConns; got > 4 {
		t.Errorf("%d connections open, want at most 4 (the renewal in one pipeline)", got)
	}
}
