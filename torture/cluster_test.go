package torture

import (
	"context"
	"io"
	"os"
	"os/exec"
	"path/filepath"
	"strings"
	"testing"
	"time"

	"github.com/dlock-dev/dlock/internal/testproc"
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
// and resumed.
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
