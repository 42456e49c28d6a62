package redislock_test

import (
	"context"
	"errors"
	"fmt"
	"os"
	"runtime"
	"strings"
	"testing"
	"time"

	"github.com/dlock-dev/dlock"
	"github.com/dlock-dev/dlock/locktest"
)

// heapAfterGC returns the live heap.
func heapAfterGC() uint64 {
	var m runtime.MemStats
	runtime.GC()
	runtime.GC()
	runtime.ReadMemStats(&m)
	return m.HeapAlloc
}

// TestTryAcquireOfKeysHeldElsewhereKeepsNothing: a worker that polls many
// distinct keys (job ids) with TryAcquire and skips those other workers
// hold must not keep anything per key it never held.
func TestTryAcquireOfKeysHeldElsewhereKeepsNothing(t *testing.T) {
	skipFinding(t, "a TryAcquire that finds a key held elsewhere leaves a wake-up channel for that key in the Locker forever")
	srv := startServer(t)
	holder := locktest.NewLocker(t, newBackend(t, srv.client(t), nil))
	poller := locktest.NewLocker(t, newBackend(t, srv.client(t), nil))
	ctx, cancel := context.WithTimeout(context.Background(), 60*time.Second)
	defer cancel()
	const n = 2000
	base := locktest.UniqueKey(t.Name())
	key := func(i int) string { return fmt.Sprintf("%s/job-%06d-%s", base, i, strings.Repeat("x", 100)) }
	for i := range 2 * n {
		if _, err := holder.TryAcquire(ctx, key(i), dlock.WithTTL(time.Minute)); err != nil {
			t.Fatal(err)
		}
	}
	probe := func(from int) {
		for i := from; i < from+n; i++ {
			if _, err := poller.TryAcquire(ctx, key(i)); !errors.Is(err, dlock.ErrNotAcquired) {
				t.Fatalf("TryAcquire of a key held elsewhere: %v", err)
			}
		}
	}
	probe(0) // warm up pools and caches on other keys
	before := heapAfterGC()
	probe(n)
	after := heapAfterGC()
	if grew := int64(after) - int64(before); grew > n*64 {
		t.Errorf("after failed TryAcquires of %d keys held elsewhere the poller's heap grew by %d bytes (%d per key)", n, grew, grew/n)
	}
}

// TestLockContextCancelFreesIt: a leader that holds one lock for days and
// derives a context from it for every job it runs (lk.Context(jobCtx), then
// cancel) must not keep every job's context alive until the lock ends.
func TestLockContextCancelFreesIt(t *testing.T) {
	skipFinding(t, "Lock.Context's cancel func does not drop the context from the Lock: each call is kept until the lock ends")
	l := locktest.NewLocker(t, newBackend(t, startServer(t).client(t), nil))
	ctx, cancel := context.WithTimeout(context.Background(), 30*time.Second)
	defer cancel()
	lk, err := l.TryAcquire(ctx, locktest.UniqueKey(t.Name()))
	if err != nil {
		t.Fatal(err)
	}
	defer lk.Release(context.Background())
	const jobs = 100_000
	before := heapAfterGC()
	for range jobs {
		jctx, jcancel := lk.Context(ctx)
		_ = jctx.Err()
		jcancel()
	}
	after := heapAfterGC()
	if grew := int64(after) - int64(before); grew > jobs*16 {
		t.Errorf("%d contexts derived from a held Lock and cancelled still use %d bytes (%d per job)", jobs, grew, grew/jobs)
	}
}

// skipFinding skips a test that reproduces an open finding, unless
// DLOCK_FINDINGS=1 asks to run it.
func skipFinding(t *testing.T, finding string) {
	t.Helper()
	if os.Getenv("DLOCK_FINDINGS") != "1" {
		t.Skip("finding: " + finding + " (DLOCK_FINDINGS=1 runs it)")
	}
}
