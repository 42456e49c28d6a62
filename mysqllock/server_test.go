package mysqllock_test

import (
	"context"
	"database/sql"
	"fmt"
	"os"
	"os/exec"
	"path/filepath"
	"strconv"
	"strings"
	"testing"
	"time"

	"github.com/dlock-dev/dlock/internal/testproc"
)

// mariadbHint says how to install what startMariaDB runs.
const mariadbHint = "apt-get install mariadb-server, or run scripts/test.sh"

// galeraProvider is the Galera library of Debian's galera-4 package.
const galeraProvider = testproc.GaleraProvider

// mariadbBinary returns the path of a MariaDB program (in $PATH or in
// /usr/sbin, /usr/bin), or ends the test as testproc.Missing does.
func mariadbBinary(t testing.TB, name string) string {
	t.Helper()
	if p, err := exec.LookPath(name); err == nil {
		return p
	}
	for _, dir := range []string{"/usr/sbin", "/usr/bin"} {
		if p := filepath.Join(dir, name); isExec(p) {
			return p
		}
	}
	testproc.Missing(t, name, mariadbHint, exec.ErrNotFound)
	return ""
}

func isExec(p string) bool {
	fi, err := os.Stat(p)
	return err == nil && fi.Mode().IsRegular() && fi.Mode()&0o111 != 0
}

// startMariaDB starts a MariaDB server of the test's own: a new data
// directory under a temporary directory, a free loopback port, the server
// options args (besides the defaults below) and a small footprint. It
// returns a DSN for root (no password) on its database test once the
// server answers, and kills the server when the test ends. Without the
// server binaries the test fails under CI=true and is skipped otherwise.
//
// args may contain "{port1}" and "{port2}" (in any option), replaced with
// two more free loopback ports (for Galera's group communication).
func startMariaDB(t testing.TB, args ...string) string {
	t.Helper()
	dsn, _ := startRestartableMariaDB(t, args...)
	return dsn
}

// startRestartableMariaDB is startMariaDB that also returns restart, which
// kills the server with SIGKILL and starts it again on the same port and
// data, waiting (bounded) until it serves.
func startRestartableMariaDB(t testing.TB, args ...string) (dsn string, restart func()) {
	t.Helper()
	mariadbd := mariadbBinary(t, "mariadbd")
	install := mariadbBinary(t, "mariadb-install-db")
	// A short directory: the socket path must fit in 108 bytes.
	dir, err := os.MkdirTemp("", "dlock-mdb")
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { os.RemoveAll(dir) })
	data := filepath.Join(dir, "data")
	common := []string{"--datadir=" + data, "--innodb-buffer-pool-size=16M", "--innodb-log-file-size=8M"}
	if os.Geteuid() == 0 {
		common = append(common, "--user=root")
	}
	ictx, cancel := context.WithTimeout(context.Background(), 2*time.Minute)
	defer cancel()
	iargs := append([]string{"--no-defaults", "--auth-root-authentication-method=normal", "--skip-test-db", "--skip-name-resolve"}, common...)
	if out, err := exec.CommandContext(ictx, install, iargs...).CombinedOutput(); err != nil {
		t.Fatalf("mariadb-install-db: %v: %s", err, out)
	}
	var lastErr error
	for range 3 {
		ports := testproc.FreePorts(t, 3, 20000, 32000, nil)
		sargs := append([]string{"--no-defaults"}, common...)
		sargs = append(sargs, "--port="+strconv.Itoa(ports[0]), "--bind-address=127.0.0.1",
			"--socket="+filepath.Join(dir, "sock"), "--pid-file="+filepath.Join(dir, "pid"),
			"--skip-name-resolve", "--performance-schema=OFF", "--log-error="+filepath.Join(dir, "error.log"))
		for _, a := range args {
			a = strings.ReplaceAll(a, "{port1}", strconv.Itoa(ports[1]))
			sargs = append(sargs, strings.ReplaceAll(a, "{port2}", strconv.Itoa(ports[2])))
		}
		p := &testproc.Proc{}
		if lastErr = p.Start(mariadbd, sargs...); lastErr != nil {
			continue
		}
		base := fmt.Sprintf("root@tcp(127.0.0.1:%d)/", ports[0])
		ready := func() error {
			db, err := sql.Open("mysql", base)
			if err != nil {
				t.Fatal(err)
			}
			defer db.Close()
			return p.WaitReady(90*time.Second, 100*time.Millisecond, func() bool {
				ctx, cancel := context.WithTimeout(context.Background(), time.Second)
				defer cancel()
				_, err := db.ExecContext(ctx, "CREATE DATABASE IF NOT EXISTS test")
				return err == nil
			})
		}
		if lastErr = ready(); lastErr == nil {
			t.Cleanup(func() {
				if err := p.Kill(); err != nil {
					t.Errorf("mariadbd: %v", err)
				}
			})
			restart := func() {
				t.Helper()
				if err := p.Kill(); err != nil {
					t.Fatalf("mariadbd: %v", err)
				}
				if err := p.Start(mariadbd, sargs...); err != nil {
					t.Fatalf("mariadbd again: %v", err)
				}
				if err := ready(); err != nil {
					log, _ := os.ReadFile(filepath.Join(dir, "error.log"))
					t.Fatalf("mariadbd again: %v\nerror log:\n%s", err, log)
				}
			}
			return base + "test", restart
		}
		log, _ := os.ReadFile(filepath.Join(dir, "error.log"))
		lastErr = fmt.Errorf("%v\nerror log:\n%s", lastErr, log)
		p.Kill()
	}
	t.Fatalf("could not start mariadbd %v: %v", args, lastErr)
	return "", nil
}

// startGalera starts a one-node MariaDB Galera cluster of the test's own
// (see startMariaDB) and returns its DSN. Without Debian's galera-4 the
// test fails under CI=true and is skipped otherwise.
func startGalera(t testing.TB) string {
	t.Helper()
	if !isRegular(galeraProvider) {
		testproc.Missing(t, "galera-4 ("+galeraProvider+")", "apt-get install galera-4", os.ErrNotExist)
	}
	return startMariaDB(t, "--wsrep-on=ON", "--wsrep-provider="+galeraProvider,
		"--wsrep-cluster-address=gcomm://", "--wsrep-node-address=127.0.0.1",
		"--wsrep-provider-options=gmcast.listen_addr=tcp://127.0.0.1:{port1};ist.recv_addr=127.0.0.1:{port2};gcache.size=16M",
		"--binlog-format=ROW", "--innodb-autoinc-lock-mode=2")
}

func isRegular(p string) bool {
	fi, err := os.Stat(p)
	return err == nil && fi.Mode().IsRegular()
}

// openDSN returns a pool on a server that the test started.
func openDSN(t testing.TB, dsn string) *sql.DB {
	t.Helper()
	db, err := sql.Open("mysql", dsn)
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { db.Close() })
	return db
}
