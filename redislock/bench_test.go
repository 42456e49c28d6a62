package redislock_test

import (
	"context"
	"testing"

	"github.com/dlock-dev/dlock"
	"github.com/dlock-dev/dlock/locktest"
	"github.com/dlock-dev/dlock/redislock"
)

// newBenchStore starts a Redis of its own and returns a constructor of
// backends over new clients of it (one per worker, as processes would).
func newBenchStore(b *testing.B) func(testing.TB) dlock.Backend {
	addr := startServer(b).addr()
	return func(tb testing.TB) dlock.Backend { return newBackend(tb, newClient(tb, addr), nil) }
}

// BenchmarkContended8 runs 8 workers on one key; BenchmarkSemaphore8 on a
// semaphore of 3; BenchmarkReadWrite8 on a key whose acquisitions are 90 %
// shared.
func BenchmarkContended8(b *testing.B) { locktest.BenchmarkContention(b, 8, newBenchStore(b)) }
func BenchmarkSemaphore8(b *testing.B) { locktest.BenchmarkSemaphore(b, 8, 3, newBenchStore(b)) }
func BenchmarkReadWrite8(b *testing.B) { locktest.BenchmarkReadWrite(b, 8, 0.9, newBenchStore(b)) }

// BenchmarkAcquireRelease takes and releases a free key through the
// Locker; BenchmarkRawScripts runs the same two scripts directly, its
// floor. Compare them with benchstat (docs/benchmarks.md).
func BenchmarkAcquireRelease(b *testing.B) {
	locktest.BenchmarkAcquireRelease(b, newBenchStore(b)(b))
}

func BenchmarkRawScripts(b *testing.B) {
	be := newBenchStore(b)(b).(*redislock.Backend)
	ctx := context.Background()
	req := dlock.Request{Key: "bench/raw/" + dlock.NewToken().String(), Token: dlock.NewToken(), TTL: dlock.DefaultTTL}
	b.ReportAllocs()
	for b.Loop() {
		if err := redislock.RawAcquireRelease(ctx, be, req); err != nil {
			b.Fatal(err)
		}
	}
}
