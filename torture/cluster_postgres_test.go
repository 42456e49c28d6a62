package torture

import (
	"context"
	"io"
	"os"
	"os/exec"
	"strings"
	"testing"
	"time"

	"github.com/dlock-dev/dlock/internal/testproc"
	"github.com/jackc/pgx/v5/pgxpool"
)

// startTestPGCluster starts a cluster of the kind in a directory the
// postgres user can reach, closed when the test ends. Without PostgreSQL's
// programs the test fails under CI=true and is skipped otherwise.
func startTestPGCluster(t *testing.T, kind string, log io.Writer) Cluster {
	t.Helper()
	if _, err := exec.LookPath(pgBin("initdb")); err != nil {
		testproc.Missing(t, "PostgreSQL's initdb", "apt-get install postgresql-15, or set DLOCK_PG_BIN", err)
	}
	dir, err := os.MkdirTemp("", "torture-pg-")
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { os.RemoveAll(dir) })
	c, err := StartCluster(context.Background(), kind, dir, log)
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() {
		if err := c.Close(); err != nil {
			t.Error(err)
		}
	})
	return c
}

// A commit acknowledged before a failover is on the new primary in pg-sync,
// and the last ones are lost in pg-async (its standby misses the stream for
// pgLag before the kill): the cluster's own positive control.
func TestPGClusterCommits(t *testing.T) {
	testproc.Short(t, "PostgreSQL clusters of its own")
	for _, kind := range []string{"pg-sync", "pg-async"} {
		t.Run(kind, func(t *testing.T) {
			var log strings.Builder
			c := startTestPGCluster(t, kind, &log)
			var cfg Config
			c.Configure(&cfg)
			ctx := context.Background()
			pool, err := pgxpool.New(ctx, cfg.PGDSN)
			if err != nil {
				t.Fatal(err)
			}
			defer pool.Close()
			if _, err := pool.Exec(ctx, "CREATE TABLE acked (id bigint PRIMARY KEY)"); err != nil {
				t.Fatal(err)
			}
			// One writer commits row after row through the Front and keeps
			// the ids acknowledged, until the failover is over.
			stop := make(chan struct{})
			acked := make(chan []int64)
			go func() {
				var ids []int64
				for id := int64(1); ; id++ {
					select {
					case <-stop:
						acked <- ids
						return
					default:
					}
					wctx, cancel := context.WithTimeout(ctx, 5*time.Second)
					_, err := pool.Exec(wctx, "INSERT INTO acked VALUES ($1)", id)
					cancel()
					if err == nil {
						ids = append(ids, id)
					}
				}
			}()
			time.Sleep(200 * time.Millisecond)
			killed, ready, err := c.Failover(ctx, &log)
			close(stop)
			ids := <-acked
			if err != nil || killed == 0 || ready < killed {
				t.Fatalf("failover: killed %d ready %d: %v\n%s", killed, ready, err, log.String())
			}
			var missing int
			if err := pool.QueryRow(ctx, "SELECT count(*) FROM unnest($1::bigint[]) AS a(id) WHERE NOT EXISTS (SELECT FROM acked WHERE acked.id = a.id)",
				ids).Scan(&missing); err != nil {
				t.Fatal(err)
			}
			t.Logf("%s: %d commits acknowledged, %d of them lost; serving %s after the kill\n%s",
				kind, len(ids), missing, time.Duration(ready-killed), log.String())
			switch {
			case len(ids) == 0:
				t.Fatal("no commit was acknowledged")
			case kind == "pg-sync" && missing > 0:
				t.Errorf("%d acknowledged commits lost in a synchronous failover", missing)
			case kind == "pg-async" && missing == 0:
				t.Errorf("no acknowledged commit lost in an asynchronous failover: the standby did not lag")
			}
		})
	}
}

// TestFailoverPGSync runs pg-lease on a pg-sync cluster failed over every
// 6 s: with a synchronous standby a failover loses no grant, so the run
// passes. It needs the MariaDB of the resource (see testDSN).
func TestFailoverPGSync(t *testing.T) {
	testproc.Short(t, "a MariaDB server and PostgreSQL clusters of its own")
	dsn, _ := testDSN(t)
	var log strings.Builder
	c := startTestPGCluster(t, "pg-sync", &log)
	cfg := Config{
		Duration: 15 * time.Second, Workers: 4, Keys: 2, TTL: time.Second, Seed: uint64(time.Now().UnixNano()),
		Faults: []string{FaultKill, FaultStop}, FaultEvery: 2 * time.Second, LongFrac: 0.3,
		Failover: c, FailoverEvery: 6 * time.Second,
		MySQLDSN: dsn, Out: t.TempDir(), Tag: "pgsyncfo", Log: &log,
	}
	c.Configure(&cfg)
	cfg.Strategies = []string{pgLease.Name}
	rep, err := Run(context.Background(), cfg)
	if err != nil {
		t.Fatalf("%v\n%s", err, log.String())
	}
	var md strings.Builder
	rep.Markdown(&md)
	if len(rep.Runs) != 1 {
		t.Fatalf("%d runs, want 1\n%s", len(rep.Runs), md.String())
	}
	r := rep.Runs[0]
	if r.Failed || r.Verdict != "PASS" {
		t.Errorf("%s: %s: %s %v %v\n%s", r.Name, r.Verdict, summarizeViolations(r.Violations), r.Inconclusive, r.Problems,
			strings.Join(r.ViolationList[:min(5, len(r.ViolationList))], "\n"))
	}
	failovers := 0
	for _, f := range r.Faults {
		if f.Kind == FaultFailover {
			failovers = f.Injected - f.Errors
			if f.Errors > 0 {
				t.Errorf("%d of %d failovers failed", f.Errors, f.Injected)
			}
		}
	}
	if failovers == 0 {
		t.Error("no failover was done")
	}
	t.Log("\n" + log.String())
	t.Log("\n" + md.String())
}
