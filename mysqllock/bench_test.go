package mysqllock_test

import (
	"context"
	"database/sql"
	"fmt"
	"testing"
	"time"

	"github.com/dlock-dev/dlock"
	"github.com/dlock-dev/dlock/locktest"
	"github.com/dlock-dev/dlock/mysqllock"
)

// BenchmarkLockerAcquireRelease measures an uncontended TryAcquire+Release
// through the Locker (one durable upsert and one durable update).
func BenchmarkLockerAcquireRelease(b *testing.B) {
	for _, params := range []string{"", "interpolateParams=true"} {
		b.Run("dsn="+params, func(b *testing.B) { locktest.BenchmarkAcquireRelease(b, newBackend(b, params)) })
	}
}

// BenchmarkRawUpsertRelease is the floor: the same two statements without
// dlock (a plain upsert and an update), with interpolated parameters.
func BenchmarkRawUpsertRelease(b *testing.B) {
	newBackend(b, "") // migrated
	db := open(b, "interpolateParams=true")
	ctx := context.Background()
	key := fmt.Sprintf("benchraw/%p", b)
	tok := dlock.NewToken()
	for b.Loop() {
		if _, err := db.ExecContext(ctx, `INSERT INTO `+testTable+` (name, token, fence, acquired_at, expires_at)
VALUES (?, ?, 1, UTC_TIMESTAMP(6), UTC_TIMESTAMP(6) + INTERVAL 30 SECOND)
ON DUPLICATE KEY UPDATE token = VALUES(token), fence = fence + 1, expires_at = VALUES(expires_at)`, key, tok[:]); err != nil {
			b.Fatal(err)
		}
		if _, err := db.ExecContext(ctx, `UPDATE `+testTable+` SET expires_at = '1970-01-01' WHERE name = ? AND token = ?`, key, tok[:]); err != nil {
			b.Fatal(err)
		}
	}
}

// BenchmarkBackendAcquireRelease is the backend alone, without the Locker.
func BenchmarkBackendAcquireRelease(b *testing.B) {
	be := newBackend(b, "interpolateParams=true")
	ctx := context.Background()
	key := fmt.Sprintf("benchbe/%p", b)
	for b.Loop() {
		tok := dlock.NewToken()
		r, err := be.Acquire(ctx, dlock.Request{Key: key, Token: tok, TTL: dlock.DefaultTTL})
		if err != nil || !r.Acquired {
			b.Fatal(r, err)
		}
		if err := be.Release(ctx, key, tok); err != nil {
			b.Fatal(err)
		}
	}
}

// BenchmarkContended8 runs 8 workers, each with its own Locker and pool (as
// 8 processes would), on one key.
func BenchmarkContended8(b *testing.B) {
	locktest.BenchmarkContention(b, 8, func(tb testing.TB) dlock.Backend { return newBackend(tb, "interpolateParams=true") })
}

func BenchmarkGetLockContended8(b *testing.B) {
	locktest.BenchmarkContention(b, 8, func(tb testing.TB) dlock.Backend { return newGetLock(tb, "interpolateParams=true") })
}

func BenchmarkRowLockContended8(b *testing.B) {
	locktest.BenchmarkContention(b, 8, func(tb testing.TB) dlock.Backend { return newRowLock(tb, "interpolateParams=true") })
}

func BenchmarkGetLockAcquireRelease(b *testing.B) {
	locktest.BenchmarkAcquireRelease(b, newGetLock(b, "interpolateParams=true"))
}

func BenchmarkRowLockAcquireRelease(b *testing.B) {
	locktest.BenchmarkAcquireRelease(b, newRowLock(b, "interpolateParams=true"))
}

// BenchmarkRawRowLock is rowlock's floor, the statements of dlock-bench's
// "raw BEGIN + FOR UPDATE NOWAIT + fence upsert + COMMIT": a locking read in
// a transaction, the fence's upsert on another connection, the release's
// mark in the transaction and its COMMIT.
func BenchmarkRawRowLock(b *testing.B) {
	db, conn := rawConn(b)
	ctx := context.Background()
	key := fmt.Sprintf("benchraw/%p", b)
	tok := dlock.NewToken()
	if _, err := db.ExecContext(ctx, "INSERT IGNORE INTO "+testTable+"_rows (name) VALUES (?)", key); err != nil {
		b.Fatal(err)
	}
	for b.Loop() {
		tx, err := conn.BeginTx(ctx, nil)
		if err != nil {
			b.Fatal(err)
		}
		var name []byte
		if err := tx.QueryRowContext(ctx, "SELECT name FROM "+testTable+"_rows WHERE name = ? FOR UPDATE NOWAIT", key).Scan(&name); err != nil {
			b.Fatal(err)
		}
		if _, err := db.ExecContext(ctx, rawFenceUpsert, key, tok[:], ""); err != nil {
			b.Fatal(err)
		}
		if _, err := tx.ExecContext(ctx, "UPDATE "+testTable+"_session SET conn_id = 0 WHERE name = ? AND token = ?", key, tok[:]); err != nil {
			b.Fatal(err)
		}
		if err := tx.Commit(); err != nil {
			b.Fatal(err)
		}
	}
}

func BenchmarkLeaseNoDoorbellContended8(b *testing.B) {
	locktest.BenchmarkContention(b, 8, func(tb testing.TB) dlock.Backend {
		return newLease(tb, "interpolateParams=true", &mysqllock.Options{Table: testTable, NoDoorbell: true})
	})
}

// BenchmarkNaivePoll8 is the blog recipe for comparison: the lease without
// doorbells, TryAcquire and a fixed 100 ms sleep after each failure.
func BenchmarkNaivePoll8(b *testing.B) {
	locktest.BenchmarkPolling(b, 8, 100*time.Millisecond, func(tb testing.TB) dlock.Backend {
		return newLease(tb, "interpolateParams=true", &mysqllock.Options{Table: testTable, NoDoorbell: true})
	})
}

// BenchmarkSemaphore8 runs 8 workers on a semaphore of 3;
// BenchmarkReadWrite8 on a key whose acquisitions are 90 % shared.
func BenchmarkSemaphore8(b *testing.B) {
	locktest.BenchmarkSemaphore(b, 8, 3, func(tb testing.TB) dlock.Backend { return newBackend(tb, "interpolateParams=true") })
}

func BenchmarkReadWrite8(b *testing.B) {
	locktest.BenchmarkReadWrite(b, 8, 0.9, func(tb testing.TB) dlock.Backend { return newBackend(tb, "interpolateParams=true") })
}

// BenchmarkGaleraContended8 runs 8 workers on one key of a 3-node Galera
// cluster of its own, the workers' statements spread over the nodes: the
// lease without doorbells (waiters poll with the Locker's backoff), and
// with every worker's doorbells on the first node (Options.Connector).
func BenchmarkGaleraContended8(b *testing.B) {
	nodes := startGaleraCluster(b, 3)
	const table = "dlock_galera_bench"
	m, err := mysqllock.New(openDSN(b, nodes[0].dsn), &mysqllock.Options{Table: table, NoDoorbell: true})
	if err != nil {
		b.Fatal(err)
	}
	if err := m.Migrate(context.Background()); err != nil {
		b.Fatal(err)
	}
	for _, c := range galeraConfigs(b, table, nodes[0].dsn) {
		b.Run(c.name, func(b *testing.B) {
			next := 0
			locktest.BenchmarkContention(b, 8, func(tb testing.TB) dlock.Backend {
				node := nodes[next%len(nodes)]
				next++
				l, err := mysqllock.New(openDSN(tb, node.dsn+"?wsrep_sync_wait=15&interpolateParams=true"), &c.opts)
				if err != nil {
					tb.Fatal(err)
				}
				tb.Cleanup(func() { l.Close() })
				return l
			})
		})
	}
}

// BenchmarkRawGetLockFenceRelease is getlock's floor: GET_LOCK, a fence
// upsert into the session table and RELEASE_LOCK on one connection,
// without dlock (the dlock-bench floor of the same name).
func BenchmarkRawGetLockFenceRelease(b *testing.B) {
	_, conn := rawConn(b)
	ctx := context.Background()
	name := fmt.Sprintf("benchraw/%p", b)
	tok := dlock.NewToken()
	for b.Loop() {
		if _, err := conn.ExecContext(ctx, "DO GET_LOCK(?, 0)", name); err != nil {
			b.Fatal(err)
		}
		if _, err := conn.ExecContext(ctx, rawFenceUpsert, name, tok[:], name); err != nil {
			b.Fatal(err)
		}
		if _, err := conn.ExecContext(ctx, "DO RELEASE_LOCK(?)", name); err != nil {
			b.Fatal(err)
		}
	}
}

// rawFenceUpsert is the session strategies' floors' fence write: the key,
// the token and the named lock's name are its parameters.
var rawFenceUpsert = `INSERT INTO ` + testTable + `_session (name, token, owner, fence, conn_id, lock_name, acquired_at, metadata)
VALUES (?, ?, '', 1, CONNECTION_ID(), ?, UTC_TIMESTAMP(6), '')
ON DUPLICATE KEY UPDATE token = VALUES(token), fence = fence + 1, conn_id = VALUES(conn_id), acquired_at = VALUES(acquired_at)`

// rawConn migrates the test table and returns a pool with interpolated
// parameters and one of its connections, closed with the benchmark.
func rawConn(b *testing.B) (*sql.DB, *sql.Conn) {
	newBackend(b, "") // migrated
	db := open(b, "interpolateParams=true")
	conn, err := db.Conn(context.Background())
	if err != nil {
		b.Fatal(err)
	}
	b.Cleanup(func() { conn.Close() })
	return db, conn
}

// BenchmarkRawGrant8 measures what a fenced getlock grant may cost next to
// raw GET_LOCK: 8 connections take and release one named lock in turn,
// each acquisition as one statement, and reports grants/s. The variants
// add to GET_LOCK a fence from a cached sequence (MariaDB), then a read of
// the session strategies' run table (MEMORY), and the grant procedure as
// getlock calls it. MySQL, which has no sequences, runs the first and the
// last.
func BenchmarkRawGrant8(b *testing.B) {
	newGetLock(b, "") // migrated: the run table and the grant procedure
	db := open(b, "interpolateParams=true")
	ctx := context.Background()
	seq := testTable + "_benchseq"
	_, seqErr := db.ExecContext(ctx, "CREATE SEQUENCE IF NOT EXISTS "+seq+" CACHE 1000")
	variants := []struct {
		name, acquire, release string
		sequence               bool
	}{
		{"GET_LOCK", "SELECT GET_LOCK(?, 10)", "DO RELEASE_LOCK(?)", false},
		{"GET_LOCK+NEXTVAL", "SELECT IF(GET_LOCK(?, 10) = 1, NEXTVAL(" + seq + "), 0)", "DO RELEASE_LOCK(?)", true},
		{"GET_LOCK+NEXTVAL+run", "SELECT IF(GET_LOCK(?, 10) = 1, (SELECT epoch FROM " + testTable + "_run WHERE id = 1) << 40 | NEXTVAL(" + seq + "), 0)", "DO RELEASE_LOCK(?)", true},
		{"grant-procedure", "CALL " + mysqllock.GrantProc("`"+testTable+"`") + "(?, '10', 'benchgrant', X'00112233445566778899aabbccddeeff', '', CONNECTION_ID(), '', 0)", "DO RELEASE_LOCK(?)", false},
	}
	for _, v := range variants {
		b.Run(v.name, func(b *testing.B) {
			if v.sequence && seqErr != nil {
				b.Skipf("no sequences on this server: %v", seqErr)
			}
			name := fmt.Sprintf("benchgrant/%p", b)
			b.SetParallelism(4) // 8 connections on 2 CPUs
			b.RunParallel(func(pb *testing.PB) {
				c, err := db.Conn(ctx)
				if err != nil {
					b.Error(err)
					return
				}
				defer c.Close()
				for pb.Next() {
					if err := takeOnce(ctx, c, v.acquire, name); err != nil {
						b.Error(err)
						return
					}
					if _, err := c.ExecContext(ctx, v.release, name); err != nil {
						b.Error(err)
						return
					}
				}
			})
			b.ReportMetric(float64(b.N)/b.Elapsed().Seconds(), "grants/s")
		})
	}
}

// takeOnce runs an acquisition statement whose first column is 1 or a
// fence when granted, reading every row of every result (a CALL answers
// with a result and a status).
func takeOnce(ctx context.Context, c *sql.Conn, q, name string) error {
	rows, err := c.QueryContext(ctx, q, name)
	if err != nil {
		return err
	}
	cols, err := rows.Columns()
	if err != nil {
		rows.Close()
		return err
	}
	var got sql.NullInt64
	dst := []any{&got}
	for range cols[1:] {
		dst = append(dst, new(any))
	}
	for rows.Next() {
		if err := rows.Scan(dst...); err != nil {
			rows.Close()
			return err
		}
	}
	if err := rows.Close(); err != nil {
		return err
	}
	if got.Int64 == 0 {
		return fmt.Errorf("not granted: %v", got)
	}
	return nil
}
