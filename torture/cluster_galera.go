package torture

import (
	"context"
	"database/sql"
	"errors"
	"fmt"
	"io"
	"io/fs"
	"os"
	"os/exec"
	"os/user"
	"path/filepath"
	"regexp"
	"slices"
	"strconv"
	"strings"
	"time"

	"github.com/dlock-dev/dlock/internal/testproc"
)

// galeraCluster is a MariaDB Galera cluster of three nodes, each behind a
// Front of its own, with the workers spread over the Fronts (Spread). A
// failover kills one node (each in turn), points its Front at a live node,
// as a load balancer that routes around a dead node does, restarts the
// killed node so that it rejoins by state transfer, and points its Front
// back once it is Synced.
type galeraCluster struct {
	nodes  []*clusterNode
	dbs    []*sql.DB // one per node, direct
	fronts []*Front  // one per node
	data   string    // the nodes' data directories
	nobody []int     // uid, gid of nobody when run as root
	next   int       // the node the next failover kills
}

// startGaleraCluster starts three MariaDB Galera nodes on loopback for
// mysql-lease: the first bootstraps the cluster, the others join it by
// rsync state transfer. Run as root, the joiner's rsync daemon runs as
// nobody: the data directories are then owned by nobody and lie in a
// temporary directory that nobody can reach (dir may not be); logs are in
// dir.
func startGaleraCluster(ctx context.Context, dir string, _ io.Writer) (Cluster, error) {
	bins := map[string]string{}
	for _, b := range []string{"mariadbd", "mariadb-install-db", "rsync"} {
		p, err := lookBinary(b)
		if err != nil {
			return nil, fmt.Errorf("%w: %s (Debian: mariadb-server, rsync): %v", ErrNoServer, b, err)
		}
		bins[b] = p
	}
	if _, err := os.Stat(testproc.GaleraProvider); err != nil {
		return nil, fmt.Errorf("%w: galera-4 (Debian: galera-4): %v", ErrNoServer, err)
	}
	if err := os.MkdirAll(dir, 0o755); err != nil {
		return nil, err
	}
	data, err := os.MkdirTemp("", "dlock-galera-")
	if err != nil {
		return nil, err
	}
	c := &galeraCluster{data: data}
	if err := c.setUp(ctx, dir, bins); err != nil {
		c.Close()
		return nil, err
	}
	return c, nil
}

func (c *galeraCluster) setUp(ctx context.Context, dir string, bins map[string]string) error {
	var common []string
	if os.Geteuid() == 0 {
		u, err := user.Lookup("nobody")
		if err != nil {
			return err
		}
		uid, _ := strconv.Atoi(u.Uid)
		gid, _ := strconv.Atoi(u.Gid)
		c.nobody = []int{uid, gid}
		if err := os.Chmod(c.data, 0o755); err != nil {
			return err
		}
		common = append(common, "--user=root")
	}
	// Per node: the client port, group communication, state transfer
	// (rsync) and incremental state transfer.
	ports := make([]int, 12)
	for i := range ports {
		p, err := freePort()
		if err != nil {
			return err
		}
		ports[i] = p
	}
	var peers []string
	for i := range 3 {
		peers = append(peers, "127.0.0.1:"+strconv.Itoa(ports[4*i+1]))
	}
	for i := range 3 {
		p := ports[4*i : 4*i+4]
		name := fmt.Sprintf("galera%d", i)
		nd := filepath.Join(c.data, name)
		datadir := filepath.Join(nd, "data")
		if err := os.MkdirAll(datadir, 0o755); err != nil {
			return err
		}
		base := append([]string{"--datadir=" + datadir, "--innodb-buffer-pool-size=8M", "--innodb-log-file-size=4M"}, common...)
		if i == 0 {
			ictx, cancel := context.WithTimeout(ctx, 2*time.Minute)
			out, err := exec.CommandContext(ictx, bins["mariadb-install-db"], append([]string{"--no-defaults",
				"--auth-root-authentication-method=normal", "--skip-test-db", "--skip-name-resolve"}, base...)...).CombinedOutput()
			cancel()
			if err != nil {
				return fmt.Errorf("mariadb-install-db: %v: %s", err, out)
			}
		}
		addr := "127.0.0.1:" + strconv.Itoa(p[0])
		args := append([]string{"--no-defaults"}, base...)
		args = append(args, testproc.GaleraArgs(testproc.GaleraNode{Name: name, Dir: nd,
			Port: p[0], GroupPort: p[1], SSTPort: p[2], ISTPort: p[3]}, peers)...)
		if i == 0 {
			args = append(args, "--wsrep-new-cluster")
		}
		db, err := sql.Open("mysql", "root@tcp("+addr+")/?timeout=2s")
		if err != nil {
			return err
		}
		c.dbs = append(c.dbs, db)
		n := &clusterNode{name: name, addr: addr, bin: bins["mariadbd"], args: args,
			logFile: filepath.Join(dir, name+".log"), ready: galeraSynced(db, i == 0)}
		c.nodes = append(c.nodes, n)
		if err := c.ownData(n); err != nil {
			return err
		}
		if err := n.start(); err != nil {
			return err
		}
		// One joiner at a time: state transfers from one donor queue
		// behind each other anyway.
		if err := n.waitReady(ctx, 2*time.Minute); err != nil {
			return err
		}
		n.ready = galeraSynced(db, false)
		f, err := NewFront(addr)
		if err != nil {
			return err
		}
		c.fronts = append(c.fronts, f)
	}
	return nil
}

// ownData gives n's data directory to nobody (run as root), whose rsync
// daemon writes it in a state transfer to n.
func (c *galeraCluster) ownData(n *clusterNode) error {
	if c.nobody == nil {
		return nil
	}
	return filepath.WalkDir(filepath.Join(c.data, n.name, "data"), func(p string, _ fs.DirEntry, err error) error {
		if err != nil {
			return err
		}
		return os.Lchown(p, c.nobody[0], c.nobody[1])
	})
}

// galeraSynced reports a node ready when it is Synced with a primary
// component; the bootstrapping node (first) also creates the database
// test, which the others receive by replication.
func galeraSynced(db *sql.DB, first bool) func(ctx context.Context) error {
	return func(ctx context.Context) error {
		var name, state, status string
		if err := db.QueryRowContext(ctx, "SHOW STATUS LIKE 'wsrep_local_state_comment'").Scan(&name, &state); err != nil {
			return err
		}
		if err := db.QueryRowContext(ctx, "SHOW STATUS LIKE 'wsrep_cluster_status'").Scan(&name, &status); err != nil {
			return err
		}
		if state != "Synced" || status != "Primary" {
			return fmt.Errorf("%s, %s", state, status)
		}
		if first {
			_, err := db.ExecContext(ctx, "CREATE DATABASE IF NOT EXISTS test")
			return err
		}
		return nil
	}
}

// lookBinary finds a MariaDB program in $PATH or in /usr/sbin, /usr/bin.
func lookBinary(name string) (string, error) {
	if p, err := exec.LookPath(name); err == nil {
		return p, nil
	}
	for _, d := range []string{"/usr/sbin", "/usr/bin"} {
		if p := filepath.Join(d, name); isExecutable(p) {
			return p, nil
		}
	}
	return "", fmt.Errorf("%s not found", name)
}

func isExecutable(p string) bool {
	fi, err := os.Stat(p)
	return err == nil && fi.Mode().IsRegular() && fi.Mode()&0o111 != 0
}

// Configure points the mysql strategies' lock tables at the first node's
// Front, each statement waiting for what the cluster has committed
// (wsrep_sync_wait=15), and runs mysql-lease, the strategy Galera keeps.
func (c *galeraCluster) Configure(cfg *Config) []string {
	cfg.StoreDSN = "root@tcp(" + c.fronts[0].Addr() + ")/test?wsrep_sync_wait=15"
	cfg.Galera = true
	return []string{"mysql-lease"}
}

// Upstreams are the nodes' Fronts.
func (c *galeraCluster) Upstreams() []string {
	var out []string
	for _, f := range c.fronts {
		out = append(out, f.Addr())
	}
	return out
}

// Failover kills the next node, points its Front at the node after it (the
// instant it returns as ready: no election is needed, the other two keep
// the primary component), restarts the killed node, waits until it is
// Synced and points its Front back at it.
func (c *galeraCluster) Failover(ctx context.Context, log io.Writer) (killed, ready int64, err error) {
	// A node that left the cluster on its own (an inconsistency: a write
	// set it could not apply) is a failure of the run, not of the fault.
	for _, n := range c.nodes {
		if err := n.ready(ctx); err != nil {
			return 0, 0, fmt.Errorf("%s is out of the cluster before the failover: %v (see %s)", n.name, err, n.logFile)
		}
	}
	k := c.next
	c.next = (k + 1) % len(c.nodes)
	dead, live := c.nodes[k], c.nodes[(k+1)%len(c.nodes)]
	dead.kill()
	killed = Mono()
	if err := c.fronts[k].Switch(live.addr); err != nil {
		return killed, 0, err
	}
	ready = Mono()
	fmt.Fprintf(log, "   failover: %s killed, its front on %s\n", dead.name, live.name)
	// It joins the cluster now; bootstrapping again would split it.
	dead.args = slices.DeleteFunc(dead.args, func(a string) bool { return a == "--wsrep-new-cluster" })
	t0 := time.Now()
	if err := c.ownData(dead); err != nil {
		return killed, ready, err
	}
	if err := recoverPosition(ctx, dead); err != nil {
		return killed, ready, err
	}
	if err := dead.restart(ctx); err != nil {
		return killed, ready, err
	}
	if err := c.fronts[k].Switch(dead.addr); err != nil {
		return killed, ready, err
	}
	fmt.Fprintf(log, "   failover: %s rejoined (%s: %s), its front back on it\n", dead.name, time.Since(t0).Round(time.Millisecond), transferKind(dead.logFile))
	return killed, ready, nil
}

// recoverPosition finds the last transaction a killed node committed
// (mariadbd --wsrep-recover, as the distributions' service scripts do after
// a crash) and starts the node from it, so that a donor sends it only what
// it missed (IST) rather than its whole data (SST).
func recoverPosition(ctx context.Context, n *clusterNode) error {
	args := slices.DeleteFunc(slices.Clone(n.args), func(a string) bool { return strings.HasPrefix(a, "--wsrep-start-position=") })
	rctx, cancel := context.WithTimeout(ctx, time.Minute)
	defer cancel()
	out, err := exec.CommandContext(rctx, n.bin, append(args, "--wsrep-recover")...).CombinedOutput()
	if err != nil {
		return fmt.Errorf("%s: wsrep-recover: %v: %s", n.name, err, lastLines(out, 5))
	}
	m := recoveredRE.FindSubmatch(out)
	if m == nil {
		return fmt.Errorf("%s: wsrep-recover found no position: %s", n.name, lastLines(out, 5))
	}
	n.args = append(args, "--wsrep-start-position="+string(m[1]))
	return nil
}

var recoveredRE = regexp.MustCompile(`Recovered position: (\S+)`)

// transferKind tells from the node's log whether its last rejoin took an
// incremental (IST) or a full (SST) state transfer.
func transferKind(logFile string) string {
	b, err := os.ReadFile(logFile)
	if err != nil {
		return "?"
	}
	s := string(b)
	ist, sst := strings.LastIndex(s, "IST received"), strings.LastIndex(s, "SST succeeded")
	switch {
	case ist < 0 && sst < 0:
		return "?"
	case ist > sst:
		return "IST"
	default:
		return "SST"
	}
}

func (c *galeraCluster) Close() error {
	for _, f := range c.fronts {
		f.Close()
	}
	for _, n := range c.nodes {
		n.kill()
	}
	var errs []error
	for _, db := range c.dbs {
		errs = append(errs, db.Close())
	}
	errs = append(errs, os.RemoveAll(c.data))
	return errors.Join(errs...)
}
