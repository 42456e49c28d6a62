package pglock_test

import (
	"context"
	"math/rand/v2"
	"testing"
	"time"

	"github.com/dlock-dev/dlock"
	"github.com/dlock-dev/dlock/locktest"
	"github.com/dlock-dev/dlock/pglock"
)

// leaveWaits makes 300 blocking acquisitions of key, held by another
// Locker, each with a deadline of 0–8 ms, so that callers leave at every
// point of a wait: before its session's turn, as its statement is sent,
// while it waits in the server.
func leaveWaits(t *testing.T, l *dlock.Locker, key string) {
	t.Helper()
	r := rand.New(rand.NewPCG(1, 2))
	for range 300 {
		ctx, cancel := context.WithTimeout(context.Background(), time.Duration(r.IntN(8000))*time.Microsecond)
		lk, err := l.Acquire(ctx, key)
		cancel()
		if err == nil {
			lk.Release(context.Background())
			t.Fatal("acquired a key held by another Locker")
		}
	}
}

// holdElsewhere takes key with a Locker of its own, closed with the test.
func holdElsewhere(t *testing.T, key string) *dlock.Lock {
	t.Helper()
	holder := dlock.New(newAdvisory(t, nil), nil)
	t.Cleanup(func() { holder.Close(context.Background()) })
	lk, err := holder.TryAcquire(context.Background(), key, dlock.WithTTL(time.Minute))
	if err != nil {
		t.Fatal(err)
	}
	return lk
}

// eventually polls cond every 20 ms until it holds or d has passed.
func eventually(d time.Duration, cond func() bool) bool {
	for end := time.Now().Add(d); ; time.Sleep(20 * time.Millisecond) {
		if cond() {
			return true
		}
		if time.Now().After(end) {
			return false
		}
	}
}

// A wait whose caller left gives its server session back: parked for
// reuse (at most 4) or closed, never kept open holding nothing.
func TestAdvisoryWaitsLeftGiveTheirSessionsBack(t *testing.T) {
	ctx := context.Background()
	key := locktest.UniqueKey("left-sessions")
	hk := holdElsewhere(t, key)
	a := newAdvisory(t, nil)
	l := dlock.New(a, nil)
	defer l.Close(ctx)
	leaveWaits(t, l, key)
	if err := hk.Release(ctx); err != nil {
		t.Fatal(err)
	}
	var n, held int
	if !eventually(5*time.Second, func() bool {
		var counts []int
		counts, held = pglock.SessionCounts(a)
		n = len(counts)
		return n <= 5
	}) {
		t.Fatalf("%d server sessions open after every wait ended (%d holds on the books), want at most 5 (the main one and 4 parked)", n, held)
	}
}

// A wait whose caller left does not stay queued in the server: its cancel
// request is repeated until its statement ends, and a wait is not sent for
// a caller that left.
func TestAdvisoryWaitsLeftLeaveTheServersQueue(t *testing.T) {
	ctx := context.Background()
	key := locktest.UniqueKey("left-queue")
	defer holdElsewhere(t, key).Release(ctx)
	l := dlock.New(newAdvisory(t, nil), nil)
	defer l.Close(ctx)
	leaveWaits(t, l, key)
	k1, k2 := pglock.AdvisoryKeys(key)
	pool := open(t, "")
	var n int
	if !eventually(2*time.Second, func() bool {
		if err := pool.QueryRow(ctx, `SELECT count(*) FROM pg_locks WHERE locktype = 'advisory' AND NOT granted
  AND classid = $1::int4::oid AND objid = $2::int4::oid AND objsubid = 2`, k1, k2).Scan(&n); err != nil {
			t.Fatal(err)
		}
		return n == 0
	}) {
		t.Fatalf("%d waits still queued in the server 2 s after every caller left", n)
	}
}
