package torture

import (
	"context"
	"os"
	"os/exec"
	"path/filepath"
	"slices"
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

// checkFindings returns the settings that mysqllock's Check finds unsafe
// on the store of cfg (the cluster's primary).
func checkFindings(t *testing.T, cfg *Config) []string {
	t.Helper()
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
	if err != nil {
		t.Fatal(err)
	}
	var out []string
	for _, f := range fs {
		out = append(out, f.Setting)
	}
	return out
}

// runFailovers runs strategy on a new cluster of kind with a failover
// every interval, and returns the run's report after checking that every
// failover succeeded and at least one was made. Before the run, Check's
// findings on the primary must be want.
func runFailovers(t *testing.T, kind, strategy string, d, every time.Duration, want []string) *RunReport {
	t.Helper()
	dsn, _ := testDSN(t)
	var log testproc.SyncBuffer
	c := startMariaClusterT(t, kind, &log)
	cfg := Config{
		Duration: d, Workers: 4, Keys: 2, ModeKeys: true, TTL: time.Second, Seed: uint64(time.Now().UnixNano()),
		Faults: []string{FaultKill}, FaultEvery: 3 * time.Second, LongFrac: 0.3,
		Failover: c, FailoverEvery: every,
		MySQLDSN: dsn, Out: t.TempDir(), Tag: "cimariafo", Log: &log,
		Strategies: []string{strategy},
	}
	if got := c.Configure(&cfg); len(got) != 3 {
		t.Fatalf("strategies: %v", got)
	}
	if got := checkFindings(t, &cfg); !slices.Equal(got, want) {
		t.Errorf("Check on the primary of %s: %v, want %v", kind, got, want)
	}
	rep, err := Run(context.Background(), cfg)
	if err != nil {
		t.Fatalf("%v\n%s", err, log.String())
	}
	var md strings.Builder
	rep.Markdown(&md)
	t.Log("\n" + log.String())
	t.Log("\n" + md.String())
	if len(rep.Runs) != 1 {
		t.Fatalf("%d runs", len(rep.Runs))
	}
	r := rep.Runs[0]
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
	return r
}

// The semi-synchronous cluster fails over without losing a grant: a run of
// a session strategy (fences of the MEMORY session table) with failovers
// passes, and mysqllock's Check finds nothing unsafe on the primary.
func TestMariaDBSemiSyncFailover(t *testing.T) {
	if testing.Short() {
		t.Skip("-short: the run takes about 25 s")
	}
	r := runFailovers(t, "mariadb-semisync", "mysql-getlock", 15*time.Second, 6*time.Second, nil)
	if r.Verdict != "PASS" || r.ViolationCount != 0 {
		t.Errorf("%s: %s, %d violations: %v %v", r.Name, r.Verdict, r.ViolationCount,
			r.ViolationList[:min(5, len(r.ViolationList))], r.Problems)
	}
}

// The asynchronous cluster is the positive control: its replica misses the
// grants made while the link lagged, and the run finds the repeated fences.
func TestMariaDBAsyncFailoverDetected(t *testing.T) {
	if testing.Short() {
		t.Skip("-short: the run takes about 15 s")
	}
	r := runFailovers(t, "mariadb-async", "mysql-lease", 10*time.Second, 4*time.Second,
		[]string{"rpl_semi_sync_master_enabled"})
	if r.ViolationCount == 0 {
		t.Errorf("%s: %s: the failovers of an asynchronous replica lost no grant that the run noticed", r.Name, r.Verdict)
	}
}
