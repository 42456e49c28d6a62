package torture

import (
	"context"
	"database/sql"
	"errors"
	"io"
	"os"
	"os/exec"
	"path/filepath"
	"slices"
	"strings"
	"testing"
	"time"

	"github.com/dlock-dev/dlock/internal/testproc"
	"github.com/jackc/pgx/v5/pgxpool"
)

func haveEtcd() error { _, err := exec.LookPath("etcd"); return err }

func haveZK() error { _, _, err := testproc.ZooKeeperCommand(); return err }

// startClusterT starts a cluster of kind for the test, its data in a
// directory every server's user can reach (PostgreSQL's runs as postgres),
// stopped and removed when the test ends. Its log goes to log.
func startClusterT(t *testing.T, kind string, log io.Writer) Cluster {
	t.Helper()
	dir, err := os.MkdirTemp("", "torture-"+kind+"-")
	if err == nil {
		err = os.Chmod(dir, 0o755)
	}
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { os.RemoveAll(dir) })
	ctx, cancel := context.WithTimeout(context.Background(), 3*time.Minute)
	defer cancel()
	c, err := StartCluster(ctx, kind, filepath.Join(dir, "cluster"), log)
	if err != nil {
		t.Fatalf("start %s: %v\n%s", kind, err, log)
	}
	t.Cleanup(func() {
		if err := c.Close(); err != nil {
			t.Errorf("close %s: %v", kind, err)
		}
	})
	return c
}

// runFailover runs the harness on a new cluster of kind for d with a
// failover every `every` (cfg's other settings changed by tweaks, which
// run after the cluster configured cfg; its first strategy unless they
// choose), and returns its report, failing the test on a setup error, a
// failed failover, or none at all.
func runFailover(t *testing.T, kind string, d, every time.Duration, tweaks ...func(*Config)) *RunReport {
	t.Helper()
	dsn, _ := testDSN(t)
	var log testproc.SyncBuffer
	c := startClusterT(t, kind, &log)
	tag := "fo" + strings.ReplaceAll(kind, "-", "")
	tag = tag[:min(len(tag), 16)] // tagRE
	cfg := Config{
		Duration: d, Workers: 4, Keys: 2, TTL: time.Second, Seed: uint64(time.Now().UnixNano()),
		FaultEvery: time.Hour, LongFrac: 0.3, Failover: c, FailoverEvery: every,
		MySQLDSN: dsn, Out: t.TempDir(), Tag: tag, Log: &log,
	}
	cfg.Strategies = c.Configure(&cfg)[:1]
	for _, f := range tweaks {
		f(&cfg)
	}
	rep, err := Run(context.Background(), cfg)
	if err != nil {
		t.Fatalf("%v\n%s", err, log.String())
	}
	var md strings.Builder
	rep.Markdown(&md)
	t.Log("\n" + log.String() + "\n" + md.String())
	if len(rep.Runs) != 1 {
		t.Fatalf("%d runs, want 1", len(rep.Runs))
	}
	r := rep.Runs[0]
	failovers := 0
	for _, f := range r.Faults {
		if f.Kind == FaultFailover {
			failovers = f.Injected - f.Errors
			if f.Errors > 0 {
				t.Errorf("%d of %d failovers failed: %v", f.Errors, f.Injected, r.Problems)
			}
		}
	}
	if failovers == 0 {
		t.Fatalf("%s: no failover was done", kind)
	}
	return r
}

// ackedTable is a table of ids on a cluster, written through its Front.
type ackedTable struct {
	insert  func(ctx context.Context, id int64) error
	missing func(ids []int64) (int, error) // how many of ids the table lacks
}

// pgAcked and mariaAcked make the table on the cluster cfg points at.
func pgAcked(t *testing.T, cfg *Config) ackedTable {
	ctx := context.Background()
	pool, err := pgxpool.New(ctx, cfg.PGDSN)
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(pool.Close)
	if _, err := pool.Exec(ctx, "CREATE TABLE acked (id bigint PRIMARY KEY)"); err != nil {
		t.Fatal(err)
	}
	return ackedTable{
		insert: func(ctx context.Context, id int64) error {
			_, err := pool.Exec(ctx, "INSERT INTO acked VALUES ($1)", id)
			return err
		},
		missing: func(ids []int64) (missing int, err error) {
			err = pool.QueryRow(ctx, "SELECT count(*) FROM unnest($1::bigint[]) AS a(id) WHERE NOT EXISTS (SELECT FROM acked WHERE acked.id = a.id)",
				ids).Scan(&missing)
			return missing, err
		},
	}
}

func mariaAcked(t *testing.T, cfg *Config) ackedTable {
	db, err := sql.Open("mysql", cfg.StoreDSN)
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { db.Close() })
	if _, err := db.Exec("CREATE TABLE acked (id BIGINT PRIMARY KEY) ENGINE=InnoDB"); err != nil {
		t.Fatal(err)
	}
	return ackedTable{
		insert: func(ctx context.Context, id int64) error {
			_, err := db.ExecContext(ctx, "INSERT INTO acked VALUES (?)", id)
			return err
		},
		missing: func(ids []int64) (int, error) {
			var have []int64
			rows, err := db.Query("SELECT id FROM acked")
			if err != nil {
				return 0, err
			}
			defer rows.Close()
			for rows.Next() {
				var id int64
				if err := rows.Scan(&id); err != nil {
					return 0, err
				}
				have = append(have, id)
			}
			missing := 0
			for _, id := range ids {
				if !slices.Contains(have, id) {
					missing++
				}
			}
			return missing, rows.Err()
		},
	}
}

// A commit acknowledged before a failover is on the new primary of the
// synchronous clusters (pg-sync, mariadb-semisync), and the last ones are
// lost in the asynchronous ones (their replica misses the stream for a
// moment before the kill): the clusters' own positive control, apart from
// the locks.
func TestClusterCommits(t *testing.T) {
	testproc.Short(t, "PostgreSQL and MariaDB clusters of its own")
	t.Parallel()
	for _, tc := range []struct {
		kind  string
		lossy bool
		need  func(*testing.T)
		open  func(*testing.T, *Config) ackedTable
	}{
		{"pg-sync", false, needPGPrograms, pgAcked},
		{"pg-async", true, needPGPrograms, pgAcked},
		{"mariadb-semisync", false, needMariaPrograms, mariaAcked},
		{"mariadb-async", true, needMariaPrograms, mariaAcked},
	} {
		t.Run(tc.kind, func(t *testing.T) {
			tc.need(t)
			var log testproc.SyncBuffer
			c := startClusterT(t, tc.kind, &log)
			var cfg Config
			c.Configure(&cfg)
			table := tc.open(t, &cfg)
			ctx := context.Background()
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
					err := table.insert(wctx, id)
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
			lost, err := table.missing(ids)
			if err != nil {
				t.Fatal(err)
			}
			t.Logf("%d commits acknowledged, %d of them lost; serving %s after the kill\n%s",
				len(ids), lost, time.Duration(ready-killed), log.String())
			switch {
			case len(ids) == 0:
				t.Fatal("no commit was acknowledged")
			case !tc.lossy && lost > 0:
				t.Errorf("%d acknowledged commits lost in a failover that must lose none", lost)
			case tc.lossy && lost == 0:
				t.Errorf("no acknowledged commit lost in an asynchronous failover: the replica did not lag")
			}
		})
	}
}

// wantPass fails the test unless r passed.
func wantPass(t *testing.T, r *RunReport) {
	t.Helper()
	if r.Failed || r.Verdict != "PASS" {
		t.Errorf("%s: %s: %s %v %v\n%s", r.Name, r.Verdict, summarizeViolations(r.Violations), r.Inconclusive, r.Problems,
			strings.Join(r.ViolationList[:min(5, len(r.ViolationList))], "\n"))
	}
}

// A three-member etcd and a ZooKeeper ensemble of three keep every
// guarantee when their leader, the node the clients are connected to, is
// killed: the others elect a leader and hold every acknowledged write, and
// ZooKeeper's sessions move to it. So they do when the leader, with the
// clients spread over the nodes, is paused for several election timeouts
// and resumed, and when it is cut off from the others with its clients
// still on it, and let back.
func TestFailoverQuorum(t *testing.T) {
	if testing.Short() {
		t.Skip("-short: starts etcd and ZooKeeper ensembles")
	}
	t.Parallel()
	for _, tc := range []struct {
		kind string
		have func() error
	}{
		{"etcd-3", haveEtcd},
		{"etcd-3-pause", haveEtcd},
		{"zk-3", haveZK},
		{"zk-3-pause", haveZK},
		{"etcd-3-cut", func() error { return errors.Join(haveEtcd(), cutAvailable()) }},
		{"zk-3-cut", func() error { return errors.Join(haveZK(), cutAvailable()) }},
	} {
		t.Run(tc.kind, func(t *testing.T) {
			t.Parallel()
			if err := tc.have(); err != nil {
				if os.Getenv("CI") == "true" {
					t.Fatalf("%s is required (CI=true): %v", tc.kind, err)
				}
				t.Skipf("SKIPPING: %v", err)
			}
			wantPass(t, runFailover(t, tc.kind, 10*time.Second, 4*time.Second))
		})
	}
}
