package mysqllock_test

import (
	"context"
	"database/sql"
	"fmt"
	"os"
	"os/exec"
	"os/user"
	"path/filepath"
	"strconv"
	"strings"
	"testing"
	"time"

	"github.com/dlock-dev/dlock/internal/testproc"
	"github.com/dlock-dev/dlock/mysqllock"
	"github.com/go-sql-driver/mysql"
)

// galeraNode is one member of a cluster started by startGaleraCluster.
type galeraNode struct {
	dsn  string
	proc *testproc.Proc
	log  string
}

// startGaleraCluster starts an n-node MariaDB Galera cluster of the test's
// own on loopback: the first node bootstraps it (--wsrep-new-cluster), the
// others join it by rsync state transfer. It returns once every node
// reports wsrep_cluster_size=n and Synced, and kills the nodes when the test
// ends. Without the server binaries or galera-4 the test fails under
// CI=true and is skipped otherwise.
func startGaleraCluster(t testing.TB, n int) []*galeraNode {
	t.Helper()
	if !isRegular(galeraProvider) {
		testproc.Missing(t, "galera-4 ("+galeraProvider+")", "apt-get install galera-4", os.ErrNotExist)
	}
	mariadbd := mariadbBinary(t, "mariadbd")
	install := mariadbBinary(t, "mariadb-install-db")
	mariadbBinary(t, "rsync")
	root, err := os.MkdirTemp("", "dlock-gal")
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { os.RemoveAll(root) })
	// Run as root, a joiner's rsync daemon drops to nobody, which must be
	// able to write the joiner's data directory.
	asRoot := os.Geteuid() == 0
	var nobody [2]int
	if asRoot {
		u, err := user.Lookup("nobody")
		if err != nil {
			t.Fatal(err)
		}
		nobody[0], _ = strconv.Atoi(u.Uid)
		nobody[1], _ = strconv.Atoi(u.Gid)
		if err := os.Chmod(root, 0o755); err != nil {
			t.Fatal(err)
		}
	}
	// Per node: the client port, group communication, state transfer
	// (rsync) and incremental state transfer.
	ports := testproc.FreePorts(t, 4*n, 20000, 32000, nil)
	var peers []string
	for i := range n {
		peers = append(peers, fmt.Sprintf("127.0.0.1:%d", ports[4*i+1]))
	}
	nodes := make([]*galeraNode, n)
	for i := range n {
		dir := filepath.Join(root, strconv.Itoa(i))
		data := filepath.Join(dir, "data")
		if err := os.MkdirAll(data, 0o755); err != nil {
			t.Fatal(err)
		}
		common := []string{"--datadir=" + data, "--innodb-buffer-pool-size=8M", "--innodb-log-file-size=4M"}
		if asRoot {
			common = append(common, "--user=root")
		}
		if i == 0 {
			ictx, cancel := context.WithTimeout(context.Background(), 2*time.Minute)
			iargs := append([]string{"--no-defaults", "--auth-root-authentication-method=normal", "--skip-test-db", "--skip-name-resolve"}, common...)
			out, err := exec.CommandContext(ictx, install, iargs...).CombinedOutput()
			cancel()
			if err != nil {
				t.Fatalf("mariadb-install-db: %v: %s", err, out)
			}
		} else if asRoot {
			if err := os.Chown(data, nobody[0], nobody[1]); err != nil {
				t.Fatal(err)
			}
		}
		p := ports[4*i : 4*i+4]
		node := &galeraNode{proc: &testproc.Proc{}, log: filepath.Join(dir, "error.log"),
			dsn: fmt.Sprintf("root@tcp(127.0.0.1:%d)/test", p[0])}
		args := append([]string{"--no-defaults"}, common...)
		args = append(args, "--log-error="+node.log)
		args = append(args, testproc.GaleraArgs(testproc.GaleraNode{Name: "n" + strconv.Itoa(i), Dir: dir,
			Port: p[0], GroupPort: p[1], SSTPort: p[2], ISTPort: p[3]}, peers)...)
		if i == 0 {
			args = append(args, "--wsrep-new-cluster")
		}
		if err := node.proc.Start(mariadbd, args...); err != nil {
			t.Fatal(err)
		}
		t.Cleanup(func() {
			if err := node.proc.Kill(); err != nil {
				t.Errorf("mariadbd node %d: %v", i, err)
			}
		})
		nodes[i] = node
		// Joiners are started one at a time: two state transfers at once
		// from one donor queue behind each other anyway.
		if err := waitGaleraNode(node, i == 0, 0); err != nil {
			t.Fatalf("galera node %d: %v", i, err)
		}
	}
	for i, node := range nodes {
		if err := waitGaleraNode(node, false, n); err != nil {
			t.Fatalf("galera node %d: %v", i, err)
		}
	}
	return nodes
}

// waitGaleraNode waits until node answers and is Synced (and, for size > 0,
// sees a cluster of size nodes); the first node also creates the database
// test, which the others receive by replication.
func waitGaleraNode(node *galeraNode, first bool, size int) error {
	base := strings.TrimSuffix(node.dsn, "test")
	db, err := sql.Open("mysql", base)
	if err != nil {
		return err
	}
	defer db.Close()
	var last error
	err = node.proc.WaitReady(2*time.Minute, 100*time.Millisecond, func() bool {
		ctx, cancel := context.WithTimeout(context.Background(), time.Second)
		defer cancel()
		var name, state, csize string
		if last = db.QueryRowContext(ctx, "SHOW STATUS LIKE 'wsrep_local_state_comment'").Scan(&name, &state); last != nil {
			return false
		}
		if state != "Synced" {
			last = fmt.Errorf("state %s", state)
			return false
		}
		if size > 0 {
			if last = db.QueryRowContext(ctx, "SHOW STATUS LIKE 'wsrep_cluster_size'").Scan(&name, &csize); last != nil {
				return false
			}
			if csize != strconv.Itoa(size) {
				last = fmt.Errorf("cluster size %s", csize)
				return false
			}
		}
		if first {
			_, last = db.ExecContext(ctx, "CREATE DATABASE IF NOT EXISTS test")
			return last == nil
		}
		return true
	})
	if err != nil {
		log, _ := os.ReadFile(node.log)
		if len(log) > 4000 {
			log = log[len(log)-4000:]
		}
		return fmt.Errorf("%v (last: %v)\nerror log tail:\n%s", err, last, log)
	}
	return nil
}

// galeraConfig is a way to run the lease strategy on Galera.
type galeraConfig struct {
	name string
	opts mysqllock.Options
}

// galeraConfigs are the lease strategy's two ways on Galera: without
// doorbells, and with every backend's doorbells on the node of bellDSN
// (Options.Connector).
func galeraConfigs(tb testing.TB, table, bellDSN string) []galeraConfig {
	tb.Helper()
	cfg, err := mysql.ParseDSN(bellDSN)
	if err != nil {
		tb.Fatal(err)
	}
	bells, err := mysql.NewConnector(cfg)
	if err != nil {
		tb.Fatal(err)
	}
	return []galeraConfig{
		{"NoDoorbell", mysqllock.Options{Table: table, NoDoorbell: true}},
		{"DoorbellsOnOneNode", mysqllock.Options{Table: table, Connector: bells}},
	}
}
