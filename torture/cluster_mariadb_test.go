package torture

import (
	"context"
	"database/sql"
	"os"
	"os/exec"
	"slices"
	"testing"
	"time"

	"github.com/dlock-dev/dlock/internal/testproc"
	"github.com/dlock-dev/dlock/mysqllock"
	_ "github.com/go-sql-driver/mysql"
)

// needMariaPrograms fails the test under CI=true, and skips it otherwise,
// without the MariaDB programs the clusters run.
func needMariaPrograms(t *testing.T) {
	t.Helper()
	for _, p := range []string{"mariadb-install-db", "mariadb-dump", "mariadb", "mariadb-binlog"} {
		if _, err := exec.LookPath(p); err != nil {
			testproc.Missing(t, p, "apt-get install mariadb-server mariadb-client", err)
		}
	}
	if _, err := os.Stat(mariadbd); err != nil {
		testproc.Missing(t, mariadbd, "apt-get install mariadb-server", err)
	}
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
// every interval and the kill fault, and returns the run's report (see
// runFailover). Before the run, Check's findings on the primary must be
// want.
func runFailovers(t *testing.T, kind, strategy string, d, every time.Duration, want []string) *RunReport {
	t.Helper()
	needMariaPrograms(t)
	return runFailover(t, kind, d, every, func(cfg *Config) {
		cfg.Strategies, cfg.ModeKeys = []string{strategy}, true
		cfg.Faults, cfg.FaultEvery = []string{FaultKill}, 3*time.Second
		if got := checkFindings(t, cfg); !slices.Equal(got, want) {
			t.Errorf("Check on the primary of %s: %v, want %v", kind, got, want)
		}
	})
}

// The semi-synchronous cluster fails over without losing a grant: a run of
// a session strategy (fences of the MEMORY session table) with failovers
// passes, and mysqllock's Check finds nothing unsafe on the primary.
func TestMariaDBSemiSyncFailover(t *testing.T) {
	if testing.Short() {
		t.Skip("-short: the run takes about 25 s")
	}
	t.Parallel()
	wantPass(t, runFailovers(t, "mariadb-semisync", "mysql-getlock", 15*time.Second, 6*time.Second, nil))
}

// The asynchronous cluster is the positive control: its replica misses the
// grants made while the link lagged, and the run finds the repeated fences.
// A grant lost shows only once its key is granted again on the new primary
// (after the old lease ends); three failovers leave time for that.
func TestMariaDBAsyncFailoverDetected(t *testing.T) {
	if testing.Short() {
		t.Skip("-short: the run takes about 25 s")
	}
	// Not parallel: on a loaded machine fewer grants fall in the lag
	// before each kill.
	r := runFailovers(t, "mariadb-async", "mysql-lease", 20*time.Second, 5*time.Second,
		[]string{"rpl_semi_sync_master_enabled"})
	if r.ViolationCount == 0 {
		t.Errorf("%s: %s: the failovers of an asynchronous replica lost no grant that the run noticed", r.Name, r.Verdict)
	}
}
