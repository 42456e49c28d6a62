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
// back once it is Synced. With isolate (galera-3-isolate) a failover cuts a
// node off from the others instead, its clients still on it.
type galeraCluster struct {
	nodes  []*clusterNode
	dbs    []*sql.DB // one per node, direct
	fronts []*Front  // one per node
	data   string    // the nodes' data directories
	nobody []int     // uid, gid of nobody when run as root
	next   int       // the node the next failover kills
	// isolate: a failover cuts the node off from the others instead of
	// killing it (galera-3-isolate).
	isolate bool
}

// startGaleraCluster starts three MariaDB Galera nodes on loopback for
// mysql-lease: the first bootstraps the cluster, the others join it by
// rsync state transfer. The data directories lie in a temporary directory
// that Close removes, which a joiner's rsync daemon can reach (dir may not
// be): run as root, that daemon runs as nobody, so the data directories are
// owned by nobody. The nodes' logs are in dir.
func startGaleraCluster(ctx context.Context, dir string, _ io.Writer) (Cluster, error) {
	return newGaleraCluster(ctx, dir, false)
}

// startGaleraIsolate starts the cluster of startGaleraCluster, whose
// failovers isolate a node from the others (see galeraCluster.isolateNode).
func startGaleraIsolate(ctx context.Context, dir string, _ io.Writer) (Cluster, error) {
	return newGaleraCluster(ctx, dir, true)
}

func newGaleraCluster(ctx context.Context, dir string, isolate bool) (Cluster, error) {
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
	c := &galeraCluster{data: data, isolate: isolate}
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
// (wsrep_sync_wait=15), and runs mysql-lease, the strategy Galera keeps,
// with the doorbells of every worker on the first node, reached directly.
func (c *galeraCluster) Configure(cfg *Config) []string {
	cfg.StoreDSN = "root@tcp(" + c.fronts[0].Addr() + ")/test?wsrep_sync_wait=15"
	cfg.Galera = true
	// The doorbells on the first node, which the failovers fault in turn.
	cfg.GaleraBells = "root@tcp(" + c.nodes[0].addr + ")/test?timeout=2s"
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

// Failover faults the next node: it kills it (killNode) or, for
// galera-3-isolate, cuts it off from the others (isolateNode).
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
	if c.isolate {
		return c.isolateNode(ctx, k, log)
	}
	return c.killNode(ctx, k, log)
}

// killNode kills node k, points its Front at the node after it (the
// instant it returns as ready: no election is needed, the other two keep
// the primary component), waits until the others have dropped the node
// from their view, restarts it, waits until it is Synced and points its
// Front back at it.
func (c *galeraCluster) killNode(ctx context.Context, k int, log io.Writer) (killed, ready int64, err error) {
	dead, live := c.nodes[k], c.nodes[(k+1)%len(c.nodes)]
	dead.kill()
	killed = Mono()
	if err := c.fronts[k].Switch(live.addr); err != nil {
		return killed, 0, err
	}
	ready = Mono()
	// The others' commits wait until they drop the dead node from their
	// view; the node restarts after that, as a crashed server does.
	err = pollUntil(ctx, time.Minute, nil, func(ctx context.Context) error {
		if !galeraPrimaryOf(ctx, c.dbs[(k+1)%len(c.nodes)], len(c.nodes)-1) {
			return errors.New("not a primary component of the others")
		}
		return nil
	})
	if err != nil {
		return killed, ready, fmt.Errorf("the others never dropped %s: %w", dead.name, err)
	}
	fmt.Fprintf(log, "   failover: %s killed, its front on %s; the others Primary without it after %s\n",
		dead.name, live.name, time.Duration(Mono()-killed).Round(time.Millisecond))
	t0 := time.Now()
	how, err := c.rejoin(ctx, dead)
	if err != nil {
		return killed, ready, err
	}
	if err := c.fronts[k].Switch(dead.addr); err != nil {
		return killed, ready, err
	}
	fmt.Fprintf(log, "   failover: %s rejoined (%s: %s), its front back on it\n", dead.name, time.Since(t0).Round(time.Millisecond), how)
	return killed, ready, nil
}

// rejoin restarts the killed node n from the position it recovers and
// waits until it is Synced; it returns how it caught up (transferKind).
func (c *galeraCluster) rejoin(ctx context.Context, n *clusterNode) (string, error) {
	// It joins the cluster now; bootstrapping again would split it.
	n.args = slices.DeleteFunc(n.args, func(a string) bool { return a == "--wsrep-new-cluster" })
	var logSize int64
	if fi, err := os.Stat(n.logFile); err == nil {
		logSize = fi.Size()
	}
	if err := c.ownData(n); err != nil {
		return "", err
	}
	if err := recoverPosition(ctx, n); err != nil {
		return "", err
	}
	if err := n.restart(ctx); err != nil {
		return "", err
	}
	return transferKind(n.logFile, logSize), nil
}

// isolation is how long a partition keeps a node cut off: long enough for
// the node to leave the primary component (evs.suspect_timeout 2 s,
// evs.inactive_timeout 3 s) and for its clients to find it refusing.
const isolation = 6 * time.Second

// isolateNode cuts node k off from the others (gmcast.isolate=1: Galera drops
// its group connections and refuses new ones) while its Front stays on it,
// as when a network partition leaves a node and its clients on one side.
// The others keep the primary component once they have dropped the node
// from their view (until then their commits wait); the isolated node
// leaves it and refuses every statement (WSREP 1047, or a lock wait
// timeout with wsrep_sync_wait), so that its clients must see errors,
// never a grant. After isolation the node is let back and rejoins by IST.
// It returns the instants of the cut and of the others' new primary
// component.
func (c *galeraCluster) isolateNode(ctx context.Context, k int, log io.Writer) (cut, ready int64, err error) {
	n, db := c.nodes[k], c.dbs[k]
	if _, err := db.ExecContext(ctx, "SET GLOBAL wsrep_provider_options = 'gmcast.isolate=1'"); err != nil {
		return 0, 0, fmt.Errorf("isolate %s: %w", n.name, err)
	}
	cut = Mono()
	fmt.Fprintf(log, "   failover: %s isolated from the others, its front still on it\n", n.name)
	other := c.dbs[(k+1)%len(c.dbs)]
	out := ""
	deadline := time.Now().Add(isolation)
	for ready == 0 || time.Now().Before(deadline) {
		if ready == 0 && galeraPrimaryOf(ctx, other, len(c.nodes)-1) {
			ready = Mono()
		}
		if err := n.ready(ctx); err != nil && out == "" {
			out = fmt.Sprintf("%s after %s", err, time.Duration(Mono()-cut).Round(time.Millisecond))
		}
		if ctx.Err() != nil {
			return cut, ready, fmt.Errorf("partition of %s: %w", n.name, ctx.Err())
		}
		time.Sleep(50 * time.Millisecond)
	}
	if out == "" {
		return cut, ready, fmt.Errorf("%s stayed Synced and Primary for %s while isolated", n.name, isolation)
	}
	if _, err := db.ExecContext(ctx, "SET GLOBAL wsrep_provider_options = 'gmcast.isolate=0'"); err != nil {
		return cut, ready, fmt.Errorf("let %s back: %w", n.name, err)
	}
	t0 := time.Now()
	if err := n.waitReady(ctx, 2*time.Minute); err != nil {
		return cut, ready, err
	}
	fmt.Fprintf(log, "   failover: the others Primary without %s after %s; it left (%s), rejoined %s after its return\n",
		n.name, time.Duration(ready-cut).Round(time.Millisecond), out, time.Since(t0).Round(time.Millisecond))
	return cut, ready, nil
}

// galeraPrimaryOf reports whether the node of db is in a primary component
// of size nodes.
func galeraPrimaryOf(ctx context.Context, db *sql.DB, size int) bool {
	var name, status, n string
	if db.QueryRowContext(ctx, "SHOW STATUS LIKE 'wsrep_cluster_status'").Scan(&name, &status) != nil ||
		db.QueryRowContext(ctx, "SHOW STATUS LIKE 'wsrep_cluster_size'").Scan(&name, &n) != nil {
		return false
	}
	return status == "Primary" && n == strconv.Itoa(size)
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

// transferKind tells from the node's log past offset (its size before
// the restart) how it caught up: an incremental state transfer (IST), a
// full one (SST), or none.
func transferKind(logFile string, offset int64) string {
	b, err := os.ReadFile(logFile)
	if err != nil || int64(len(b)) < offset {
		return "?"
	}
	s := string(b[offset:])
	switch {
	case strings.Contains(s, "IST received"):
		return "IST"
	case strings.Contains(s, "SST succeeded"):
		return "SST"
	default:
		return "no state transfer"
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
