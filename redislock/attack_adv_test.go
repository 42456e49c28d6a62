package redislock_test

import (
	"context"
	"os"
	"sync"
	"testing"
	"time"

	"github.com/dlock-dev/dlock"
	"github.com/dlock-dev/dlock/locktest"
	"github.com/redis/go-redis/v9"
)

// advAddr is the running Redis the attacks use.
func advAddr() string {
	if v := os.Getenv("DLOCK_REDIS_ADDR"); v != "" {
		return v
	}
	return "127.0.0.1:6379"
}

func TestAdvConcurrentFirstLimitsNeverCoexist(t *testing.T) {
	bs := make([]dlock.Backend, 6)
	for i := range bs {
		bs[i] = newBackend(t, newClient(t, advAddr()), nil)
	}
	locktest.LimitsAgreeUnderRace(t, bs)
}

func TestAdvWriterGivesUp(t *testing.T) {
	nb := func() dlock.Backend { return newBackend(t, newClient(t, advAddr()), nil) }
	locktest.WriterThatGivesUp(t, nb(), nb(), nb())
}

func TestAdvCrashedReader(t *testing.T) {
	nb := func() dlock.Backend { return newBackend(t, newClient(t, advAddr()), nil) }
	locktest.CrashedReader(t, nb(), nb())
}

// The root's local-writer starvation on a real store: readers and a writer
// of one process share a Locker (and so a Backend and a client).
func TestAdvLocalWriterStarvedOnRedis(t *testing.T) {
	ctx := context.Background()
	l := dlock.New(newBackend(t, newClient(t, advAddr()), nil), &dlock.Options{TTL: 5 * time.Second})
	defer l.Close(ctx)
	k := locktest.UniqueKey("adv-local-writer")
	rctx, rcancel := context.WithTimeout(ctx, 20*time.Second)
	defer rcancel()
	stop := make(chan struct{})
	var wg sync.WaitGroup
	for i := range 4 { // independent readers, staggered: one always holds
		wg.Go(func() {
			time.Sleep(time.Duration(i) * 20 * time.Millisecond)
			for {
				select {
				case <-stop:
					return
				default:
				}
				r, err := l.Acquire(rctx, k, dlock.Shared())
				if err != nil {
					return
				}
				time.Sleep(80 * time.Millisecond)
				_ = r.Release(ctx)
			}
		})
	}
	time.Sleep(100 * time.Millisecond)
	wctx, cancel := context.WithTimeout(ctx, 2*dlock.WriterMark)
	defer cancel()
	w, err := l.Acquire(wctx, k)
	if err == nil {
		_ = w.Release(ctx)
	}
	close(stop)
	wg.Wait()
	if err != nil {
		t.Fatalf("writer starved by its own process's readers for %s: %v", 2*dlock.WriterMark, err)
	}
}

// Tiny pools: go-redis PoolSize 1.
func TestAdvBusyMixTinyPools(t *testing.T) {
	mk := func() dlock.Backend {
		c := redis.NewClient(&redis.Options{Addr: advAddr(), PoolSize: 1})
		t.Cleanup(func() { c.Close() })
		return newBackend(t, c, nil)
	}
	locktest.BusyMix(t, mk(), mk(), true)
}

func TestAdvWriterWaitsLong(t *testing.T) {
	nb := func() dlock.Backend { return newBackend(t, newClient(t, advAddr()), nil) }
	locktest.WriterWaitsLong(t, nb(), nb(), nb())
}

func TestAdvWriterWokenByLastReader(t *testing.T) {
	nb := func() dlock.Backend { return newBackend(t, newClient(t, advAddr()), nil) }
	locktest.WriterWokenByLastReader(t, nb(), nb(), 300*time.Millisecond)
}
