package pglock_test

import (
	"context"
	"fmt"
	"testing"

	"github.com/dlock-dev/dlock"
	"github.com/dlock-dev/dlock/locktest"
	"github.com/dlock-dev/dlock/pglock"
)

// strategies makes a fresh backend (on a pool of its own, as a process would
// have) of each strategy.
var strategies = []struct {
	name string
	new  func(testing.TB) dlock.Backend
}{
	{"lease", func(tb testing.TB) dlock.Backend { return newLease(tb, nil) }},
	{"advisory", func(tb testing.TB) dlock.Backend { return newAdvisory(tb, nil) }},
}

// BenchmarkLockerAcquireRelease measures an uncontended TryAcquire+Release
// through the Locker: two durable commits for the lease, and for the
// advisory strategy a lock with its fencing-row commit and an unlock.
func BenchmarkLockerAcquireRelease(b *testing.B) {
	for _, s := range strategies {
		b.Run(s.name, func(b *testing.B) { locktest.BenchmarkAcquireRelease(b, s.new(b)) })
	}
}

// BenchmarkContended8 runs 8 workers, each with its own Locker and pool (as
// 8 processes would), on one key, and reports true handoffs/s and the
// smallest worker's share (1 = fair).
func BenchmarkContended8(b *testing.B) {
	for _, s := range strategies {
		b.Run(s.name, func(b *testing.B) { locktest.BenchmarkContention(b, 8, s.new) })
	}
}

// BenchmarkRawSQL is the floor: the statements of each strategy without
// dlock: an upsert and an update for the lease; for the advisory strategy
// a try-lock, an upsert of the fencing row and an unlock on one connection.
func BenchmarkRawSQL(b *testing.B) {
	ctx := context.Background()
	table := `"` + testTable() + `"`
	b.Run("lease", func(b *testing.B) {
		pool := open(b, "")
		key := []byte(fmt.Sprintf("benchraw/%p", b))
		tok := dlock.NewToken()
		for b.Loop() {
			if _, err := pool.Exec(ctx, `INSERT INTO `+table+` (name, token, fence, acquired_at, expires_at)
VALUES ($1, $2, 1, clock_timestamp(), clock_timestamp() + interval '30 seconds')
ON CONFLICT (name) DO UPDATE SET token = EXCLUDED.token, fence = `+table+`.fence + 1, expires_at = EXCLUDED.expires_at`, key, tok[:]); err != nil {
				b.Fatal(err)
			}
			if _, err := pool.Exec(ctx, `UPDATE `+table+` SET expires_at = clock_timestamp() WHERE name = $1 AND token = $2`, key, tok[:]); err != nil {
				b.Fatal(err)
			}
		}
	})
	b.Run("advisory", func(b *testing.B) {
		pool := open(b, "")
		c, err := pool.Acquire(ctx)
		if err != nil {
			b.Fatal(err)
		}
		defer c.Release()
		key := fmt.Sprintf("benchraw/%p", b)
		k1, k2 := pglock.AdvisoryKeys(key)
		tok := dlock.NewToken()
		session := `"` + testTable() + `_session"`
		for b.Loop() {
			var ok bool
			if err := c.QueryRow(ctx, "SELECT pg_try_advisory_lock($1, $2)", k1, k2).Scan(&ok); err != nil || !ok {
				b.Fatal(ok, err)
			}
			if _, err := c.Exec(ctx, `INSERT INTO `+session+` (name, lock_id, token, fence, pid, acquired_at)
VALUES ($1, 0, $2, 1, pg_backend_pid(), clock_timestamp())
ON CONFLICT (name) DO UPDATE SET fence = `+session+`.fence + 1, token = EXCLUDED.token`, []byte(key), tok[:]); err != nil {
				b.Fatal(err)
			}
			if err := c.QueryRow(ctx, "SELECT pg_advisory_unlock($1, $2)", k1, k2).Scan(&ok); err != nil || !ok {
				b.Fatal(ok, err)
			}
		}
	})
}

// BenchmarkSemaphore8 runs 8 workers on a semaphore of 3 (lease only:
// advisory locks have no limited mode); BenchmarkReadWrite8 on a key whose
// acquisitions are 90 % shared.
func BenchmarkSemaphore8(b *testing.B) {
	locktest.BenchmarkSemaphore(b, 8, 3, strategies[0].new)
}

func BenchmarkReadWrite8(b *testing.B) {
	for _, s := range strategies {
		b.Run(s.name, func(b *testing.B) { locktest.BenchmarkReadWrite(b, 8, 0.9, s.new) })
	}
}
