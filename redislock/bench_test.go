package redislock_test

import (
	"testing"

	"github.com/dlock-dev/dlock"
	"github.com/dlock-dev/dlock/locktest"
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
