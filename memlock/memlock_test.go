package memlock_test

import (
	"testing"

	"github.com/dlock-dev/dlock"
	"github.com/dlock-dev/dlock/locktest"
	"github.com/dlock-dev/dlock/memlock"
	"go.uber.org/goleak"
)

func TestMain(m *testing.M) { goleak.VerifyTestMain(m) }

// shared is one in-memory store that every "client" in the suite talks to.
func TestConformance(t *testing.T) {
	store := memlock.New()
	locktest.Run(t, func(*testing.T) dlock.Backend { return store }, locktest.InProcess())
}

func newStore() func(testing.TB) dlock.Backend {
	store := memlock.New()
	return func(testing.TB) dlock.Backend { return store }
}

func BenchmarkContention(b *testing.B) { locktest.BenchmarkContention(b, 8, newStore()) }
func BenchmarkSemaphore(b *testing.B)  { locktest.BenchmarkSemaphore(b, 8, 3, newStore()) }
func BenchmarkReadWrite(b *testing.B)  { locktest.BenchmarkReadWrite(b, 8, 0.9, newStore()) }
