package etcdlock_test

import (
	"context"
	"testing"

	"github.com/dlock-dev/dlock"
	"github.com/dlock-dev/dlock/locktest"
)

// BenchmarkLockerAcquireRelease measures an uncontended TryAcquire+Release
// through the Locker against a single etcd member: a lease grant and a
// transaction to acquire, a read and a lease revocation to release.
func BenchmarkLockerAcquireRelease(b *testing.B) {
	locktest.BenchmarkAcquireRelease(b, newBackend(b, endpoints(b)))
}

// BenchmarkContended8 runs 8 workers, each with its own Locker and client
// (as 8 processes would), on one key. Waiters queue in etcd and each watches
// only its predecessor, so every acquisition is a handoff in arrival order.
func BenchmarkContended8(b *testing.B) {
	eps := endpoints(b)
	locktest.BenchmarkContention(b, 8, func(tb testing.TB) dlock.Backend { return newBackend(tb, eps) })
}

// BenchmarkRawPut is the unit of cost: one durable etcd write (a raft entry
// and a WAL fsync). An uncontended acquire+release is three writes (grant,
// transactional put, revoke) and two linearizable reads.
func BenchmarkRawPut(b *testing.B) {
	c := newClient(b, endpoints(b)...)
	ctx := context.Background()
	key := "benchraw/" + dlock.NewToken().String()
	for b.Loop() {
		if _, err := c.Put(ctx, key, "v"); err != nil {
			b.Fatal(err)
		}
	}
}

// BenchmarkSemaphore8 runs 8 workers on a semaphore of 3;
// BenchmarkReadWrite8 on a key whose acquisitions are 90 % shared.
func BenchmarkSemaphore8(b *testing.B) {
	eps := endpoints(b)
	locktest.BenchmarkSemaphore(b, 8, 3, func(tb testing.TB) dlock.Backend { return newBackend(tb, eps) })
}

func BenchmarkReadWrite8(b *testing.B) {
	eps := endpoints(b)
	locktest.BenchmarkReadWrite(b, 8, 0.9, func(tb testing.TB) dlock.Backend { return newBackend(tb, eps) })
}
