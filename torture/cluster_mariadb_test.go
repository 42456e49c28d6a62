package torture

import (
	"context"
	"os"
	"os/exec"
	"path/filepath"
	"strings"
	"testing"
	"time"

	"database/sql"
	"github.com/dlock-dev/dlock/internal/testproc"
	"github.com/dlock-dev/dlock/mysqllock"
	_ "github.com/go-sql-driver/mysql"
)

// startMariaClusterT starts a cluster of kind under the test's directory.
// Without the MariaDB programs the test fails under CI=true and is skipped
// otherwise.
func startMariaClusterT(t *testing.T, kind string, log *testproc.SyncBuffer) Cluster {
	t.Helper()
	for _, p := range []string{"mariadb-install-db", "mariadb-dump", "mariadb", "mariadb-binlog"} {
		if _, err := exec.LookPath(p); err != nil {
			testproc.Missing(t, p, "apt-get install mariadb-server mariadb-client", err)
		}
	}
	if _, err := os.Stat(mariadbd); err != nil {
		testproc.Missing(t, mariadbd, "apt-get install mariadb-server", err)
	}
	ctx, cancel := context.WithTimeout(context.Background(), 2*time.Minute)
	defer cancel()
	c, err := StartCluster(ctx, kind, filepath.Join(t.TempDir(), "cluster"), log)
	if err != nil {
		t.Fatalf("%s: %v\n%s", kind, err, log.String())
	}
	t.Cleanup(func() {
		if err := c.Close(); err != nil {
			t.Errorf("close %s: %v", kind, err)
		}
	})
	return c
}

// The semi-synchronous cluster fails over without losing a grant: a run of
// one strategy with failovers passes, and mysqllock's Check finds nothing
// unsafe on its primary.
func TestMariaDBSemiSyncFailover(t *testing.T) {
	if testing.Short() {
		t.Skip("-short: the run takes about 30 s")
	}
	dsn, _ := testDSN(t)
	var log testproc.SyncBuffer
	c := startMariaClusterT(t, "mariadb-semisync", &log)
	cfg := Config{
		Duration: 15 * time.Second, Workers: 4, Keys: 2, TTL: time.Second, Seed: uint64(time.Now().UnixNano()),
		Faults: []string{FaultKill}, FaultEvery: 3 * time.Second, LongFrac: 0.3,
		Failover: c, FailoverEvery: 6 * time.Second,
		MySQLDSN: dsn, Out: t.TempDir(), Tag: "cimariafo", Log: &log,
		Strategies: []string{"mysql-getlock"},
	}
	if got := c.Configure(&cfg); len(got) != 3 {
		t.Fatalf("strategies: %v", got)
	}
	db, err := sql.Open("mysql", cfg.StoreDSN)
	if err != nil {
		t.Fatal(err)
	}
	defer db.Close()
	b, err := mysqllock.NewGetLock(db, &mysqllock.Options{Table: "check_locks"})
	if err != nil {
		t.Fatal(err)
	}
	fs, err := b.Check(context.Background())
	if err != nil || len(fs) != 0 {
		t.Errorf("Check on the semi-synchronous primary: %v %v", fs, err)
	}
	rep, err := Run(context.Background(), cfg)
	if err != nil {
		t.Fatalf("%v\n%s", err, log.String())
	}
	var md strings.Builder
	rep.Markdown(&md)
	for _, r := range rep.Runs {
		failovers := 0
		for _, f := range r.Faults {
			if f.Kind == FaultFailover {
				failovers = f.Injected - f.Errors
				if f.Errors > 0 {
					t.Errorf("%s: %d of %d failovers failed: %v", r.Name, f.Errors, f.Injected, r.Problems)
				}
			}
		}
		if failovers == 0 {
			t.Errorf("%s: no failover was done", r.Name)
		}
		if r.Verdict != "PASS" || r.ViolationCount != 0 {
			t.Errorf("%s: %s, %d violations: %v %v", r.Name, r.Verdict, r.ViolationCount,
				r.ViolationList[:min(5, len(r.ViolationList))], r.Problems)
		}
	}
	t.Log("\n" + log.String())
	t.Log("\n" + md.String())
}
