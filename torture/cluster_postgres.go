package torture

import (
	"context"
	"errors"
	"fmt"
	"io"
	"net"
	"os"
	"os/exec"
	"os/user"
	"path/filepath"
	"strconv"
	"strings"
	"sync"
	"syscall"
	"time"

	toxiproxy "github.com/Shopify/toxiproxy/v2"
	"github.com/jackc/pgx/v5/pgconn"
	"github.com/rs/zerolog"
)

// The PostgreSQL clusters of the failover fault: a primary and one
// streaming standby of PostgreSQL 15, each a postmaster of the harness's
// own on a loopback port, behind a Front.
//
//   - pg-async: the standby replicates asynchronously, the default of
//     streaming replication: a failover loses the commits the standby had
//     not received. This is the positive control.
//   - pg-sync: synchronous_standby_names names the standby and
//     synchronous_commit is remote_apply, so a commit returns once the
//     standby has applied it (pglock's grants set synchronous_commit to on
//     for their own transactions: the standby has flushed them).
//
// The standby reaches the primary through a proxy of the cluster's (the
// replication link). Before each kill the link drops the primary's stream
// for pgLag, so that an asynchronous standby misses the last commits, as a
// standby a second behind does; then the primary's processes die with
// SIGKILL, the link closes with the data it still held, the standby is
// promoted (pg_promote) and the Front forwards to it. A new standby is
// then made from scratch (pg_basebackup of the new primary, through a new
// link) and the failover returns once it streams (pg-sync: once it is the
// synchronous one, until when commits on the new primary wait).
//
// Every node runs as the "postgres" user when the harness runs as root
// (PostgreSQL refuses to run as root), in a process group of its own so
// that a kill takes its backends with it, and dies with the harness
// (Pdeathsig).

// pgLag is how long the link drops the primary's stream before the kill:
// about a TTL of the runs.
const pgLag = time.Second

// pgReplicaName is every standby's application_name, the one pg-sync's
// synchronous_standby_names lists: whichever node is the standby.
const pgReplicaName = "replica"

// pgBin holds PostgreSQL's server programs ($DLOCK_PG_BIN, or Debian's
// PostgreSQL 15), as for pglock's tests.
func pgBin(name string) string {
	dir := os.Getenv("DLOCK_PG_BIN")
	if dir == "" {
		dir = "/usr/lib/postgresql/15/bin"
	}
	return filepath.Join(dir, name)
}

// pgNode is one postmaster of a pgCluster.
type pgNode struct {
	clusterNode // named n1, n2, …: its data directory and log under the cluster's
	data        string
}

// pgCluster is the Cluster of the pg-async and pg-sync kinds.
type pgCluster struct {
	dir  string
	sync bool
	cred *syscall.Credential // nil: run as ourselves
	log  io.Writer

	mu       sync.Mutex
	front    *Front
	srv      *toxiproxy.ApiServer
	link     *toxiproxy.Proxy // the standby's way to the primary
	linkAddr string           // fixed: every standby's primary_conninfo names it
	links    int              // link proxies made so far (their names)
	primary  *pgNode
	replica  *pgNode
	nodes    int // nodes made so far (their names)
}

func startPGAsync(ctx context.Context, dir string, log io.Writer) (Cluster, error) {
	return startPGCluster(ctx, dir, false, log)
}

func startPGSync(ctx context.Context, dir string, log io.Writer) (Cluster, error) {
	return startPGCluster(ctx, dir, true, log)
}

// startPGCluster initialises a primary under dir, gives it a standby and a
// Front.
func startPGCluster(ctx context.Context, dir string, syncRep bool, log io.Writer) (Cluster, error) {
	if _, err := os.Stat(pgBin("initdb")); err != nil {
		return nil, fmt.Errorf("%w: PostgreSQL's initdb (apt-get install postgresql-15, or set DLOCK_PG_BIN): %v", ErrNoServer, err)
	}
	c := &pgCluster{dir: dir, sync: syncRep, log: log,
		srv: toxiproxy.NewServer(toxiproxy.NewMetricsContainer(nil), zerolog.Nop())}
	if os.Getuid() == 0 {
		u, err := user.Lookup("postgres")
		if err != nil {
			return nil, fmt.Errorf("%w: a postgres user to run PostgreSQL as (the harness runs as root): %v", ErrNoServer, err)
		}
		uid, _ := strconv.Atoi(u.Uid)
		gid, _ := strconv.Atoi(u.Gid)
		c.cred = &syscall.Credential{Uid: uint32(uid), Gid: uint32(gid)}
	}
	if err := os.MkdirAll(dir, 0o755); err != nil {
		return nil, err
	}
	if err := os.Chmod(dir, 0o755); err != nil {
		return nil, err
	}
	if err := c.start(ctx); err != nil {
		_ = c.Close()
		return nil, err
	}
	return c, nil
}

func (c *pgCluster) start(ctx context.Context) error {
	p, err := c.newNode()
	if err != nil {
		return err
	}
	if out, err := c.command(pgBin("initdb"), "-D", p.data, "-U", "postgres", "--auth=trust", "-E", "UTF8",
		"--no-sync", "--no-instructions").CombinedOutput(); err != nil {
		return fmt.Errorf("initdb: %w: %s", err, lastLines(out, 5))
	}
	// The link's address is fixed before the first standby exists: it is
	// in the configuration every node copies from this one.
	if err := c.newLink(p.addr); err != nil {
		return err
	}
	conf := fmt.Sprintf(`
listen_addresses = '127.0.0.1'
unix_socket_directories = ''
max_connections = 200
shared_buffers = '32MB'
wal_level = replica
max_wal_senders = 4
wal_keep_size = '256MB'
hot_standby = on
primary_conninfo = 'host=127.0.0.1 port=%d user=postgres application_name=%s connect_timeout=2'
wal_retrieve_retry_interval = '100ms'
`, portOf(c.linkAddr), pgReplicaName)
	if c.sync {
		conf += fmt.Sprintf("synchronous_standby_names = '%s'\nsynchronous_commit = remote_apply\n", pgReplicaName)
	}
	f, err := os.OpenFile(filepath.Join(p.data, "postgresql.conf"), os.O_APPEND|os.O_WRONLY, 0)
	if err != nil {
		return err
	}
	_, err = f.WriteString(conf)
	if cerr := f.Close(); err == nil {
		err = cerr
	}
	if err != nil {
		return err
	}
	if err := c.run(ctx, p); err != nil {
		return err
	}
	c.primary = p
	if c.front, err = NewFront(p.addr); err != nil {
		return err
	}
	return c.addReplica(ctx)
}

// Configure points the pg strategies at the Front.
func (c *pgCluster) Configure(cfg *Config) []string {
	cfg.PGDSN = "postgres://postgres@" + c.front.Addr() + "/postgres?sslmode=disable"
	return []string{pgLease.Name, pgAdvisory.Name}
}

// Failover drops the link's stream for pgLag, kills the primary, promotes
// the standby, switches the Front to it and makes a new standby.
func (c *pgCluster) Failover(ctx context.Context, log io.Writer) (killed, ready int64, err error) {
	c.mu.Lock()
	defer c.mu.Unlock()
	if c.replica == nil {
		return 0, 0, errors.New("no standby to promote (the last failover did not make one)")
	}
	// A timeout toxic of 0 drops whatever the primary sends the standby
	// and keeps the connection open: the standby falls behind, silently.
	js := `{"name":"lag","type":"timeout","stream":"downstream","attributes":{"timeout":0}}`
	if _, err := c.link.Toxics.AddToxicJson(strings.NewReader(js)); err != nil {
		return 0, 0, fmt.Errorf("drop the replication stream: %w", err)
	}
	if !sleepCtx(ctx, pgLag) {
		return 0, 0, ctx.Err()
	}
	old, next := c.primary, c.replica
	killed = Mono()
	if err := old.kill(); err != nil {
		return killed, 0, err
	}
	c.closeLink() // with what it held of the stream
	c.primary, c.replica = next, nil
	if err := c.promote(ctx, next); err != nil {
		return killed, 0, err
	}
	if err := c.front.Switch(next.addr); err != nil {
		return killed, 0, fmt.Errorf("switch the front to %s: %w", next.addr, err)
	}
	ready = Mono()
	if err := os.RemoveAll(old.data); err != nil {
		return killed, ready, err
	}
	if err := c.newLink(next.addr); err != nil {
		return killed, ready, err
	}
	if err := c.addReplica(ctx); err != nil {
		return killed, ready, err
	}
	fmt.Fprintf(log, "   failover: %s promoted, serving %s after the kill; new standby %s streaming %s after the kill\n",
		next.name, time.Duration(ready-killed).Round(time.Millisecond), c.replica.name,
		time.Duration(Mono()-killed).Round(time.Millisecond))
	return killed, ready, nil
}

// promote makes n the primary and waits (bounded) until it takes writes.
func (c *pgCluster) promote(ctx context.Context, n *pgNode) error {
	ctx, cancel := context.WithTimeout(ctx, 60*time.Second)
	defer cancel()
	conn, err := pgconn.Connect(ctx, n.dsn())
	if err != nil {
		return fmt.Errorf("promote %s: %w", n.name, err)
	}
	defer conn.Close(context.Background())
	// pg_promote waits for the end of recovery (60 s at most).
	res := conn.ExecParams(ctx, "SELECT pg_promote(true, 60), pg_is_in_recovery()", nil, nil, nil, nil).Read()
	if res.Err != nil {
		return fmt.Errorf("promote %s: %w", n.name, res.Err)
	}
	if len(res.Rows) != 1 || string(res.Rows[0][0]) != "t" || string(res.Rows[0][1]) != "f" {
		return fmt.Errorf("promote %s: pg_promote, pg_is_in_recovery: %q", n.name, res.Rows)
	}
	return nil
}

// addReplica makes a standby of the primary from a base backup, starts it
// and waits (bounded) until it streams through the link (pg-sync: until it
// is the primary's synchronous standby).
func (c *pgCluster) addReplica(ctx context.Context) error {
	r, err := c.newNode()
	if err != nil {
		return err
	}
	host, port, _ := net.SplitHostPort(c.primary.addr)
	if out, err := c.command(pgBin("pg_basebackup"), "-h", host, "-p", port, "-U", "postgres", "-D", r.data,
		"-X", "stream", "--checkpoint=fast", "--no-sync").CombinedOutput(); err != nil {
		return fmt.Errorf("pg_basebackup of %s: %w: %s", c.primary.name, err, lastLines(out, 5))
	}
	sig := filepath.Join(r.data, "standby.signal")
	if err := os.WriteFile(sig, nil, 0o600); err != nil {
		return err
	}
	if c.cred != nil {
		if err := os.Chown(sig, int(c.cred.Uid), int(c.cred.Gid)); err != nil {
			return err
		}
	}
	if err := c.run(ctx, r); err != nil {
		return err
	}
	c.replica = r
	want := "streaming async"
	if c.sync {
		want = "streaming sync"
	}
	var got string
	err = pollUntil(ctx, 60*time.Second, r.done, func(ctx context.Context) error {
		conn, err := pgconn.Connect(ctx, c.primary.dsn())
		if err != nil {
			return err
		}
		defer conn.Close(context.Background())
		res := conn.ExecParams(ctx, "SELECT state || ' ' || sync_state FROM pg_stat_replication WHERE application_name = $1",
			[][]byte{[]byte(pgReplicaName)}, nil, nil, nil).Read()
		if res.Err != nil {
			return res.Err
		}
		got = fmt.Sprint(res.Rows)
		if len(res.Rows) != 1 || string(res.Rows[0][0]) != want {
			return fmt.Errorf("pg_stat_replication of %s: %s, want %q", c.primary.name, got, want)
		}
		return nil
	})
	if err != nil {
		return fmt.Errorf("standby %s: %w", r.name, err)
	}
	return nil
}

// newNode reserves a data directory and a port for the next node.
func (c *pgCluster) newNode() (*pgNode, error) {
	c.nodes++
	n := &pgNode{clusterNode: clusterNode{name: "n" + strconv.Itoa(c.nodes), cred: c.cred, group: true}}
	n.data = filepath.Join(c.dir, n.name)
	if err := os.Mkdir(n.data, 0o700); err != nil {
		return nil, err
	}
	if c.cred != nil {
		if err := os.Chown(n.data, int(c.cred.Uid), int(c.cred.Gid)); err != nil {
			return nil, err
		}
	}
	port, err := freePort()
	if err != nil {
		return nil, err
	}
	n.addr = net.JoinHostPort("127.0.0.1", strconv.Itoa(port))
	return n, nil
}

func (n *pgNode) dsn() string {
	return "postgres://postgres@" + n.addr + "/postgres?sslmode=disable&connect_timeout=2"
}

// command runs a PostgreSQL program as the cluster's user; it dies with the
// harness.
func (c *pgCluster) command(bin string, args ...string) *exec.Cmd {
	cmd := exec.Command(bin, args...)
	cmd.SysProcAttr = &syscall.SysProcAttr{Pdeathsig: syscall.SIGKILL, Credential: c.cred}
	cmd.Dir = "/"
	return cmd
}

// run starts n's postmaster in a process group of its own, logging to
// <name>.log, and waits (bounded) until it answers queries.
func (c *pgCluster) run(ctx context.Context, n *pgNode) error {
	n.bin, n.args = pgBin("postgres"), []string{"-D", n.data, "-p", strconv.Itoa(portOf(n.addr))}
	n.logFile = filepath.Join(c.dir, n.name+".log")
	n.ready = func(ctx context.Context) error {
		conn, err := pgconn.Connect(ctx, n.dsn())
		if err != nil {
			return err
		}
		defer conn.Close(context.Background())
		return conn.Exec(ctx, "SELECT 1").Close()
	}
	if err := n.start(); err != nil {
		return err
	}
	if err := n.waitReady(ctx, 60*time.Second); err != nil {
		_ = n.kill()
		return err
	}
	return nil
}

// newLink starts a link proxy to upstream on the link's address (any free
// one the first time).
func (c *pgCluster) newLink(upstream string) error {
	listen := c.linkAddr
	if listen == "" {
		listen = "127.0.0.1:0"
	}
	c.links++
	p := toxiproxy.NewProxy(c.srv, "link"+strconv.Itoa(c.links), listen, upstream)
	if err := p.Start(); err != nil {
		return fmt.Errorf("start the replication link: %w", err)
	}
	c.link, c.linkAddr = p, p.Listen
	return nil
}

// closeLink stops the link proxy, dropping the data it holds. toxiproxy's
// Stop can wedge (see stopBound); its listener is closed by then, and the
// next link listens anew.
func (c *pgCluster) closeLink() {
	if c.link == nil {
		return
	}
	done := make(chan struct{})
	go func() { c.link.Stop(); close(done) }()
	select {
	case <-done:
	case <-time.After(stopBound):
	}
	c.link = nil
}

// Close kills every node and removes their data directories (their logs
// stay in the cluster's directory).
func (c *pgCluster) Close() error {
	c.mu.Lock()
	defer c.mu.Unlock()
	var errs []error
	for _, n := range []*pgNode{c.primary, c.replica} {
		if n != nil {
			errs = append(errs, n.kill())
		}
	}
	for i := 1; i <= c.nodes; i++ {
		if err := os.RemoveAll(filepath.Join(c.dir, "n"+strconv.Itoa(i))); err != nil {
			errs = append(errs, err)
		}
	}
	c.primary, c.replica = nil, nil
	if c.front != nil {
		c.front.Close()
	}
	c.closeLink()
	return errors.Join(errs...)
}
