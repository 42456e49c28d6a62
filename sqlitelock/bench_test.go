package sqlitelock_test

import (
	"context"
	"fmt"
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
	l := dlock.New(be, nil)
	defer l.Close(context.Background())
	ctx := context.Background()
	key := fmt.Sprintf("bench/%p", b)
	b.ReportAllocs()
	for b.Loop() {
		lk, err := l.TryAcquire(ctx, key)
		if err != nil {
			b.Fatal(err)
		}
		if err := lk.Release(ctx); err != nil {
			b.Fatal(err)
		}
	}
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
