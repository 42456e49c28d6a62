package zklock_test

import (
	"testing"

	"github.com/dlock-dev/dlock"
	"github.com/dlock-dev/dlock/locktest"
)

// BenchmarkLockerAcquireRelease measures an uncontended TryAcquire+Release
// through the Locker: a create (with the directory touch) and a read of the
// queue, then a delete.
func BenchmarkLockerAcquireRelease(b *testing.B) {
	locktest.BenchmarkAcquireRelease(b, newBackend(b, newConn(b, sharedAddrs(b)...)))
}

// BenchmarkContended8 runs 8 workers, each with its own Locker and session
// (as 8 processes would), on one key.
func BenchmarkContended8(b *testing.B) {
	addrs := sharedAddrs(b)
	locktest.BenchmarkContention(b, 8, func(tb testing.TB) dlock.Backend { return newBackend(tb, newConn(tb, addrs...)) })
}

// BenchmarkSemaphore8 runs 8 workers on a semaphore of 3;
// BenchmarkReadWrite8 on a key whose acquisitions are 90 % shared.
func BenchmarkSemaphore8(b *testing.B) {
	addrs := sharedAddrs(b)
	locktest.BenchmarkSemaphore(b, 8, 3, func(tb testing.TB) dlock.Backend { return newBackend(tb, newConn(tb, addrs...)) })
}

func BenchmarkReadWrite8(b *testing.B) {
	addrs := sharedAddrs(b)
	locktest.BenchmarkReadWrite(b, 8, 0.9, func(tb testing.TB) dlock.Backend { return newBackend(tb, newConn(tb, addrs...)) })
}
