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
	locktest.BenchmarkContention(b, 8, func(tb testing.TB) dlock.Backend {
		be, err := openB(tb)
		if err != nil {
			tb.Fatal(err)
		}
		return be
	})
}
