package torture

import (
	"context"
	"os"
	"os/exec"
	"strings"
	"testing"
	"time"

	"github.com/dlock-dev/dlock/internal/testproc"
)

// runFailover runs the harness on the cluster of kind for d with a
// failover every `every` (with cfg's other settings changed by tweaks), and
// returns its report, failing the test on a setup error or when no
// failover happened.
func runFailover(t *testing.T, kind string, d, every time.Duration, tweaks ...func(*Config)) *RunReport {
	t.Helper()
	dsn, _ := testDSN(t)
	out := t.TempDir()
	var log strings.Builder
	c, err := StartCluster(context.Background(), kind, out+"/cluster", &log)
	if err != nil {
		t.Fatalf("start %s: %v\n%s", kind, err, log.String())
	}
	defer c.Close()
	tag := "fo" + strings.ReplaceAll(kind, "-", "")
	tag = tag[:min(len(tag), 16)] // tagRE
	cfg := Config{
		Duration: d, Workers: 4, Keys: 2, TTL: time.Second, Seed: uint64(time.Now().UnixNano()),
		FaultEvery: time.Hour, LongFrac: 0.3, Failover: c, FailoverEvery: every,
		MySQLDSN: dsn, Out: out, Tag: tag, Log: &log,
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
	r := rep.Runs[0]
	failovers := 0
	for _, f := range r.Faults {
		if f.Kind == FaultFailover {
			failovers = f.Injected
			if f.Errors > 0 {
				t.Errorf("%d of %d failovers failed: %v", f.Errors, f.Injected, r.Problems)
			}
		}
	}
	if failovers == 0 {
		t.Fatalf("%s: no failover happened", kind)
	}
	return r
}

// A three-member etcd and a ZooKeeper ensemble of three keep every
// guarantee when their leader, the node the clients are connected to, is
// killed: the others elect a leader and hold every acknowledged write, and
// ZooKeeper's sessions move to it.
func TestFailoverQuorum(t *testing.T) {
	if testing.Short() {
		t.Skip("-short: starts etcd and ZooKeeper ensembles")
	}
	for _, tc := range []struct {
		kind string
		have func() error
	}{
		{"etcd-3", func() error { _, err := exec.LookPath("etcd"); return err }},
		{"zk-3", func() error { _, _, err := testproc.ZooKeeperCommand(); return err }},
	} {
		t.Run(tc.kind, func(t *testing.T) {
			if err := tc.have(); err != nil {
				if os.Getenv("CI") == "true" {
					t.Fatalf("%s is required (CI=true): %v", tc.kind, err)
				}
				t.Skipf("SKIPPING: %v", err)
			}
			r := runFailover(t, tc.kind, 15*time.Second, 5*time.Second)
			if r.Failed || r.Verdict != "PASS" {
				t.Errorf("%s: %s: %s %v %v", r.Name, r.Verdict, summarizeViolations(r.Violations), r.Inconclusive, r.Problems)
			}
		})
	}
}
