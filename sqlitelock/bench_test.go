package sqlitelock_test

import (
	"context"
	"os"
	"testing"

	"github.com/dlock-dev/dlock"
	"github.com/dlock-dev/dlock/locktest"
)

// BenchmarkLockerAcquireRelease measures an uncontended TryAcquire+Release
// through the Locker on a WAL-mode file (synchronous=NORMAL).
func BenchmarkLockerAcquireRelease(b *testing.B) {
	be, err := openB(b)
	if err != nil {
		b.Fatal(err)
	}
	locktest.BenchmarkAcquireRelease(b, be)
}

func openB(b testing.TB) (dlock.Backend, error) {
	be := sqliteOpen(b, os.Getenv(envDB))
	return be, be.Migrate(context.Background())
}

// BenchmarkContended8 runs 8 workers, each with its own Locker and pool (as
// 8 processes would), on one key.
func BenchmarkContended8(b *testing.B) {
	locktest.BenchmarkContention(b, 8, mustOpenB)
}

func mustOpenB(tb testing.TB) dlock.Backend {
	be, err := openB(tb)
	if err != nil {
		tb.Fatal(err)
	}
	return be
}

// BenchmarkSemaphore8 runs 8 workers on a semaphore of 3;
// BenchmarkReadWrite8 on a key whose acquisitions are 90 % shared.
func BenchmarkSemaphore8(b *testing.B) { locktest.BenchmarkSemaphore(b, 8, 3, mustOpenB) }
func BenchmarkReadWrite8(b *testing.B) { locktest.BenchmarkReadWrite(b, 8, 0.9, mustOpenB) }
