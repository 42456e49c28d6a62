package torture

import (
	"bufio"
	"bytes"
	"context"
	"database/sql"
	"errors"
	"fmt"
	"io"
	"os"
	"os/exec"
	"path/filepath"
	"strconv"
	"strings"
	"time"

	toxiproxy "github.com/Shopify/toxiproxy/v2"
	"github.com/rs/zerolog"
)

// The MariaDB clusters of the failover fault: a primary and one replica
// with GTID replication, each a mariadbd of the cluster's own on a loopback
// port, every node with the binary log (sync_binlog=1, log_slave_updates,
// gtid_strict_mode, binlog_format=ROW) and a server_id of its own. mariadb-async replicates
// asynchronously; mariadb-semisync semi-synchronously with wait point
// AFTER_SYNC and a timeout longer than any run, so that it never falls
// back. The replica reaches the primary through a proxy of the cluster's
// (the replication link), which a failover blackholes for mariaLag before
// the kill: the asynchronous replica then misses the last grants, and the
// semi-synchronous primary's commits wait instead.
//
// A failover promotes the replica once it has applied every transaction
// it received whole (STOP SLAVE; RESET SLAVE ALL; read_only=0), builds a new replica
// from a dump of it into a fresh node, and only then points the Front at
// it: with semi-sync a primary without a replica commits nothing, and a
// dump of a primary that no client reaches yet is consistent, MEMORY
// tables included.

const (
	// mariaLag is how long the replication link drops everything before
	// the primary is killed.
	mariaLag = time.Second
	// mariaSemiSyncTimeout is rpl_semi_sync_master_timeout (ms): an hour,
	// so that semi-sync does not fall back to asynchronous within a run.
	mariaSemiSyncTimeout = 3600 * 1000
	// mariaDB is the database of the strategies' tables on the cluster.
	mariaDB = "dlock"
	// mariaReadyBound bounds each wait for a node (start, replication).
	mariaReadyBound = 90 * time.Second
)

// startMariaAsync and startMariaSemiSync start the two kinds (clusterKinds).
func startMariaAsync(ctx context.Context, dir string, log io.Writer) (Cluster, error) {
	return startMariaCluster(ctx, dir, log, false)
}

func startMariaSemiSync(ctx context.Context, dir string, log io.Writer) (Cluster, error) {
	return startMariaCluster(ctx, dir, log, true)
}

// mariaNode is one mariadbd of a cluster.
type mariaNode struct {
	clusterNode
	id   int // server_id
	dir  string
	sock string
	port int
	db   *sql.DB
}

// kill closes the node's pool and kills the server (clusterNode.kill).
func (n *mariaNode) kill() error {
	if n.db != nil {
		n.db.Close()
	}
	return n.clusterNode.kill()
}

// remove kills the server and removes its data.
func (n *mariaNode) remove() error {
	err := n.kill()
	if n.sock != filepath.Join(n.dir, "sock") {
		os.Remove(n.sock)
	}
	return errors.Join(err, os.RemoveAll(n.dir))
}

// mariaCluster is a MariaDB primary and replica behind a Front.
type mariaCluster struct {
	dir      string
	semisync bool
	front    *Front
	links    *toxiproxy.ApiServer
	link     *toxiproxy.Proxy // the replica's way to the primary
	primary  *mariaNode
	replica  *mariaNode
	nextID   int
	down     error // why the cluster is down: a failover failed after the kill
}

func startMariaCluster(ctx context.Context, dir string, log io.Writer, semisync bool) (_ Cluster, err error) {
	dir, err = filepath.Abs(dir)
	if err != nil {
		return nil, err
	}
	c := &mariaCluster{dir: dir, semisync: semisync, nextID: 1,
		links: toxiproxy.NewServer(toxiproxy.NewMetricsContainer(nil), zerolog.Nop())}
	defer func() {
		if err != nil {
			c.Close()
		}
	}()
	if c.primary, err = c.startNode(ctx); err != nil {
		return nil, err
	}
	if _, err = c.primary.db.ExecContext(ctx, "CREATE DATABASE "+mariaDB); err != nil {
		return nil, fmt.Errorf("create database: %w", err)
	}
	fresh, err := c.startNode(ctx)
	if err != nil {
		return nil, err
	}
	c.replica = fresh
	if err = c.attach(ctx, c.primary, fresh); err != nil {
		return nil, err
	}
	if c.front, err = NewFront(c.primary.addr); err != nil {
		return nil, err
	}
	fmt.Fprintf(log, "cluster: MariaDB primary %s, replica %s (%s), front %s\n",
		c.primary.addr, c.replica.addr, c.mode(), c.front.Addr())
	return c, nil
}

func (c *mariaCluster) mode() string {
	if c.semisync {
		return "semi-synchronous, AFTER_SYNC"
	}
	return "asynchronous"
}

// Configure points the mysql strategies' lock store at the Front.
func (c *mariaCluster) Configure(cfg *Config) []string {
	cfg.StoreDSN = "root@tcp(" + c.front.Addr() + ")/" + mariaDB
	return []string{"mysql-lease", "mysql-getlock", "mysql-rowlock"}
}

// startNode initialises a data directory and starts a mariadbd on it, on
// a free port (a few tries: another process may take the port first).
func (c *mariaCluster) startNode(ctx context.Context) (*mariaNode, error) {
	n := &mariaNode{id: c.nextID}
	c.nextID++
	n.dir = filepath.Join(c.dir, "node"+strconv.Itoa(n.id))
	data := filepath.Join(n.dir, "data")
	if err := os.MkdirAll(n.dir, 0o755); err != nil {
		return nil, err
	}
	n.sock = filepath.Join(n.dir, "sock")
	if len(n.sock) > 100 { // a socket path must fit in 108 bytes
		n.sock = filepath.Join(os.TempDir(), fmt.Sprintf("dlock-mdb-%d-%d.sock", os.Getpid(), n.id))
	}
	common := []string{"--datadir=" + data, "--innodb-buffer-pool-size=16M", "--innodb-log-file-size=8M"}
	if os.Geteuid() == 0 {
		common = append(common, "--user=root")
	}
	ictx, cancel := context.WithTimeout(ctx, 2*time.Minute)
	defer cancel()
	install := append([]string{"--no-defaults", "--auth-root-authentication-method=normal", "--skip-test-db", "--skip-name-resolve"}, common...)
	if out, err := exec.CommandContext(ictx, "mariadb-install-db", install...).CombinedOutput(); err != nil {
		return nil, fmt.Errorf("mariadb-install-db: %v: %s", err, out)
	}
	var lastErr error
	for range 3 {
		port, err := freePort()
		if err != nil {
			return nil, err
		}
		n.port, n.addr = port, "127.0.0.1:"+strconv.Itoa(port)
		args := append([]string{"--no-defaults"}, common...)
		args = append(args, "--port="+strconv.Itoa(port), "--bind-address=127.0.0.1",
			"--socket="+n.sock, "--pid-file="+filepath.Join(n.dir, "pid"),
			"--skip-name-resolve", "--performance-schema=OFF", "--log-error="+filepath.Join(n.dir, "error.log"),
			"--server-id="+strconv.Itoa(n.id), "--log-bin="+filepath.Join(n.dir, "binlog"), "--log-slave-updates",
			"--sync-binlog=1", "--innodb-flush-log-at-trx-commit=1", "--gtid-strict-mode=1",
			"--skip-slave-start", "--slave-net-timeout=5",
			// Row events: replicas apply the primary's changes, those
			// of the lock tables' triggers included, rather than run the
			// statements again.
			"--binlog-format=ROW",
			// The session strategies' MEMORY table keeps the limit Migrate
			// gave it on every node, also where replication created it.
			"--max-heap-table-size=256M")
		if c.semisync {
			// The master side is enabled on a primary once it has a
			// replica (attach): without one, every commit would wait.
			args = append(args, "--rpl-semi-sync-slave-enabled=ON", "--rpl-semi-sync-master-wait-point=AFTER_SYNC",
				"--rpl-semi-sync-master-timeout="+strconv.Itoa(mariaSemiSyncTimeout))
		}
		if lastErr = n.start(ctx, args); lastErr == nil {
			return n, nil
		}
	}
	return nil, fmt.Errorf("start mariadbd %d: %w", n.id, lastErr)
}

// start runs mariadbd with args and waits (bounded) until it answers.
func (n *mariaNode) start(ctx context.Context, args []string) error {
	db, err := sql.Open("mysql", "root@tcp("+n.addr+")/?timeout=2s&interpolateParams=true")
	if err != nil {
		return err
	}
	n.db = db
	n.name, n.bin, n.args = "mariadbd "+strconv.Itoa(n.id), mariadbd, args
	n.logFile = filepath.Join(n.dir, "mariadbd.out")
	n.ready = db.PingContext
	if err := n.clusterNode.start(); err != nil {
		db.Close()
		return err
	}
	if err := n.waitReady(ctx, mariaReadyBound); err != nil {
		_ = n.kill()
		log, _ := os.ReadFile(filepath.Join(n.dir, "error.log"))
		return fmt.Errorf("%w: %s", err, lastLines(log, 5))
	}
	return nil
}

// attach makes fresh, a node with no data of its own, a replica of
// primary: a dump of primary's database loaded without the binary log,
// the binary log started at the dump's GTID position (so that fresh can
// serve replicas of its own once promoted), then replication through a new
// link from that position. It returns once the replica streams, and with
// semi-sync once the primary counts it as a semi-synchronous replica.
func (c *mariaCluster) attach(ctx context.Context, primary, fresh *mariaNode) error {
	if c.semisync {
		if _, err := primary.db.ExecContext(ctx, "SET GLOBAL rpl_semi_sync_master_enabled = ON"); err != nil {
			return fmt.Errorf("enable semi-sync: %w", err)
		}
	}
	pos, err := dumpInto(ctx, primary, fresh)
	if err != nil {
		return err
	}
	link := toxiproxy.NewProxy(c.links, "link"+strconv.Itoa(fresh.id), "127.0.0.1:0", primary.addr)
	if err := link.Start(); err != nil {
		return fmt.Errorf("start the replication link: %w", err)
	}
	c.link = link
	_, port, _ := strings.Cut(link.Listen, ":")
	for _, q := range []string{
		"RESET MASTER",
		"SET GLOBAL gtid_binlog_state = '" + pos + "'",
		"SET GLOBAL gtid_slave_pos = '" + pos + "'",
		"CHANGE MASTER TO MASTER_HOST = '127.0.0.1', MASTER_PORT = " + port + ", MASTER_USER = 'root', " +
			"MASTER_USE_GTID = slave_pos, MASTER_CONNECT_RETRY = 1, MASTER_HEARTBEAT_PERIOD = 1",
		"SET GLOBAL read_only = ON",
		"START SLAVE",
	} {
		if _, err := fresh.db.ExecContext(ctx, q); err != nil {
			return fmt.Errorf("make node %d a replica: %s: %w", fresh.id, q, err)
		}
	}
	return c.waitStreaming(ctx, primary, fresh)
}

// dumpInto loads a dump of from's database into to, without the binary
// log, and returns the dump's GTID position.
func dumpInto(ctx context.Context, from, to *mariaNode) (string, error) {
	dctx, cancel := context.WithTimeout(ctx, 2*time.Minute)
	defer cancel()
	file := filepath.Join(to.dir, "dump.sql")
	out, err := os.Create(file)
	if err != nil {
		return "", err
	}
	defer out.Close()
	dump := exec.CommandContext(dctx, "mariadb-dump", "-h127.0.0.1", "-P"+strconv.Itoa(from.port), "-uroot",
		"--single-transaction", "--gtid", "--master-data=2", "--routines", "--events", "--triggers",
		"--databases", mariaDB)
	var stderr bytes.Buffer
	dump.Stdout, dump.Stderr = out, &stderr
	if err := dump.Run(); err != nil {
		return "", fmt.Errorf("mariadb-dump: %v: %s", err, bytes.TrimSpace(stderr.Bytes()))
	}
	if _, err := out.Seek(0, io.SeekStart); err != nil {
		return "", err
	}
	// With --master-data=2 the position is a comment:
	// "-- SET GLOBAL gtid_slave_pos='0-1-42';".
	pos, found := "", false
	sc := bufio.NewScanner(out)
	sc.Buffer(make([]byte, 1<<20), 64<<20)
	for sc.Scan() && !found {
		pos, found = strings.CutPrefix(sc.Text(), "-- SET GLOBAL gtid_slave_pos='")
	}
	if !found {
		return "", fmt.Errorf("no GTID position in the dump of node %d (%v)", from.id, sc.Err())
	}
	pos = strings.TrimSuffix(pos, "';")
	if _, err := out.Seek(0, io.SeekStart); err != nil {
		return "", err
	}
	load := exec.CommandContext(dctx, "mariadb", "-h127.0.0.1", "-P"+strconv.Itoa(to.port), "-uroot",
		"--init-command=SET SESSION sql_log_bin = 0")
	load.Stdin = out
	if msg, err := load.CombinedOutput(); err != nil {
		return "", fmt.Errorf("load the dump into node %d: %v: %s", to.id, err, lastLines(msg, 3))
	}
	return pos, nil
}

// waitStreaming waits (bounded) until replica's replication threads run
// and, with semi-sync, until primary counts a semi-synchronous replica.
func (c *mariaCluster) waitStreaming(ctx context.Context, primary, replica *mariaNode) error {
	err := pollUntil(ctx, mariaReadyBound, replica.done, func(ctx context.Context) error {
		st, err := slaveStatus(ctx, replica.db)
		if err != nil {
			return err
		}
		if st["Slave_SQL_Running"] == "No" || st["Last_IO_Errno"] != "0" && st["Last_IO_Errno"] != "" {
			return finalError{fmt.Errorf("IO %s %s, SQL %s %s",
				st["Slave_IO_Running"], st["Last_IO_Error"], st["Slave_SQL_Running"], st["Last_SQL_Error"])}
		}
		if st["Slave_IO_Running"] != "Yes" || st["Slave_SQL_Running"] != "Yes" {
			return fmt.Errorf("IO %s, SQL %s", st["Slave_IO_Running"], st["Slave_SQL_Running"])
		}
		if !c.semisync {
			return nil
		}
		var name string
		var clients int
		if err := primary.db.QueryRowContext(ctx, "SHOW GLOBAL STATUS LIKE 'Rpl_semi_sync_master_clients'").Scan(&name, &clients); err != nil {
			return err
		}
		if clients == 0 {
			return errors.New("no semi-synchronous replica counted")
		}
		return nil
	})
	if err != nil {
		return fmt.Errorf("node %d does not stream from node %d: %w", replica.id, primary.id, err)
	}
	return nil
}

// slaveStatus returns the row of SHOW SLAVE STATUS by column (empty for a
// server that is no replica).
func slaveStatus(ctx context.Context, db *sql.DB) (map[string]string, error) {
	rows, err := db.QueryContext(ctx, "SHOW SLAVE STATUS")
	if err != nil {
		return nil, err
	}
	defer rows.Close()
	cols, err := rows.Columns()
	if err != nil {
		return nil, err
	}
	st := map[string]string{}
	if !rows.Next() {
		return st, rows.Err()
	}
	vals := make([]sql.NullString, len(cols))
	ptrs := make([]any, len(cols))
	for i := range vals {
		ptrs[i] = &vals[i]
	}
	if err := rows.Scan(ptrs...); err != nil {
		return nil, err
	}
	for i, col := range cols {
		st[col] = vals[i].String
	}
	return st, rows.Close()
}

// promote makes replica a primary once it has applied every transaction it
// received (what the old primary's semi-synchronous commits waited for),
// and returns its GTID position. A transaction cut off in the relay log
// by the link's end is not applied.
func promote(ctx context.Context, replica *mariaNode) (string, error) {
	if _, err := replica.db.ExecContext(ctx, "STOP SLAVE IO_THREAD"); err != nil {
		return "", fmt.Errorf("promote: %w", err)
	}
	err := pollUntil(ctx, mariaReadyBound, replica.done, func(ctx context.Context) error {
		st, err := slaveStatus(ctx, replica.db)
		switch {
		case err != nil:
			return err
		case st["Slave_SQL_Running"] != "Yes":
			return finalError{fmt.Errorf("the replica's SQL thread stopped: %s", st["Last_SQL_Error"])}
		case !strings.HasPrefix(st["Slave_SQL_Running_State"], "Slave has read all relay log"):
			return fmt.Errorf("relay log not applied: %s", st["Slave_SQL_Running_State"])
		}
		return nil
	})
	if err != nil {
		return "", fmt.Errorf("promote: %w", err)
	}
	for _, q := range []string{"STOP SLAVE", "RESET SLAVE ALL", "SET GLOBAL read_only = OFF"} {
		if _, err := replica.db.ExecContext(ctx, q); err != nil {
			return "", fmt.Errorf("promote: %s: %w", q, err)
		}
	}
	var pos string
	err = replica.db.QueryRowContext(ctx, "SELECT @@GLOBAL.gtid_slave_pos").Scan(&pos)
	return pos, err
}

// stopLink stops the replication link (bounded: see stopBound).
func (c *mariaCluster) stopLink() {
	if c.link == nil {
		return
	}
	done := make(chan struct{})
	go func(p *toxiproxy.Proxy) { p.Stop(); close(done) }(c.link)
	select {
	case <-done:
	case <-time.After(stopBound):
	}
	c.link = nil
}

// Failover drops the replication link for mariaLag, kills the primary,
// promotes the replica, gives it a new replica and points the Front at it.
// The new node starts before the kill, so that the downtime is the
// promotion and the new replica's dump, load and attachment.
func (c *mariaCluster) Failover(ctx context.Context, log io.Writer) (killed, ready int64, err error) {
	if c.down != nil {
		return 0, 0, fmt.Errorf("the cluster is down since a failed failover: %w", c.down)
	}
	fresh, err := c.startNode(ctx)
	if err != nil {
		return 0, 0, err
	}
	defer func() {
		if err != nil && fresh != c.replica {
			_ = fresh.remove()
		}
		if err != nil && killed != 0 {
			c.down = err
		}
	}()
	lag := `{"name":"lag","type":"timeout","stream":"downstream","attributes":{"timeout":0}}`
	if _, err := c.link.Toxics.AddToxicJson(strings.NewReader(lag)); err != nil {
		return 0, 0, fmt.Errorf("drop the replication link: %w", err)
	}
	if !sleepCtx(ctx, mariaLag) {
		c.down = fmt.Errorf("the replication link was left dropped: %w", ctx.Err())
		return 0, 0, c.down
	}
	old := c.primary
	killed = Mono()
	if err := old.kill(); err != nil {
		return killed, 0, err
	}
	c.stopLink()
	t0 := Mono()
	pos, err := promote(ctx, c.replica)
	if err != nil {
		return killed, 0, err
	}
	t1 := Mono()
	if err := c.attach(ctx, c.replica, fresh); err != nil {
		return killed, 0, err
	}
	t2 := Mono()
	if err := c.front.Switch(c.replica.addr); err != nil {
		return killed, 0, fmt.Errorf("switch the front: %w", err)
	}
	ready = Mono()
	c.primary, c.replica = c.replica, fresh
	last := lastBinlogGTID(ctx, old.dir)
	fmt.Fprintf(log, "   failover: node %d promoted at %s (the old primary's binlog ends at %s) in %s, node %d attached in %s (%s)\n",
		c.primary.id, pos, last, time.Duration(t1-t0).Round(time.Millisecond), c.replica.id,
		time.Duration(t2-t1).Round(time.Millisecond), c.mode())
	return killed, ready, old.remove()
}

// lastBinlogGTID returns the last GTID in the binary log of a node's
// directory (what its last commits were), or a word of why not.
func lastBinlogGTID(ctx context.Context, dir string) string {
	index, err := os.ReadFile(filepath.Join(dir, "binlog.index"))
	if err != nil {
		return "unknown"
	}
	files := strings.Fields(string(index))
	if len(files) == 0 {
		return "unknown"
	}
	file := files[len(files)-1]
	if !filepath.IsAbs(file) {
		file = filepath.Join(dir, "data", file)
	}
	out, err := exec.CommandContext(ctx, "mariadb-binlog", "--base64-output=never", file).Output()
	if err != nil {
		return "unknown (" + err.Error() + ")"
	}
	last := "none"
	for _, l := range strings.Split(string(out), "\n") {
		if _, after, ok := strings.Cut(l, "\tGTID "); ok {
			last = strings.Fields(after)[0]
		}
	}
	return last
}

// Close stops every node and removes the cluster's directory.
func (c *mariaCluster) Close() error {
	if c.front != nil {
		c.front.Close()
	}
	c.stopLink()
	var errs []error
	for _, n := range []*mariaNode{c.primary, c.replica} {
		if n != nil && n.cmd != nil {
			errs = append(errs, n.remove())
		}
	}
	errs = append(errs, os.RemoveAll(c.dir))
	return errors.Join(errs...)
}
