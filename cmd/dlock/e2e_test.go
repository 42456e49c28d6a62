package main

import (
	"bytes"
	"context"
	"database/sql"
	"encoding/json"
	"errors"
	"flag"
	"fmt"
	"net"
	"net/http"
	"os"
	"os/exec"
	"path/filepath"
	"strconv"
	"strings"
	"sync"
	"syscall"
	"testing"
	"time"

	"github.com/dlock-dev/dlock/internal/testproc"
	_ "github.com/go-sql-driver/mysql"
)

// The end-to-end tests drive the built binary against each store.

var binary string

func TestMain(m *testing.M) {
	flag.Parse()
	if fuzzing := flag.Lookup("test.fuzz"); fuzzing != nil && fuzzing.Value.String() != "" || flag.Lookup("test.fuzzworker").Value.String() == "true" {
		os.Exit(m.Run()) // the fuzz targets run in the process
	}
	dir, err := os.MkdirTemp("", "dlock-e2e")
	if err != nil {
		panic(err)
	}
	binary = filepath.Join(dir, "dlock")
	if out, err := exec.Command("go", "build", "-race", "-o", binary, ".").CombinedOutput(); err != nil {
		fmt.Fprintf(os.Stderr, "go build: %v\n%s", err, out)
		os.Exit(1)
	}
	code := m.Run()
	os.RemoveAll(dir)
	os.Exit(code)
}

// env is one store for the tests: the environment the binary runs with.
type env []string

// stores returns the embedded default (a fresh state directory) and MariaDB.
func stores(t *testing.T) map[string]env {
	out := map[string]env{
		"embedded": {"XDG_STATE_HOME=" + t.TempDir(), "-DLOCK_DB"},
	}
	e := mysqlStore(t)
	if e == nil {
		return out
	}
	if addr := startRedis(t); addr != "" {
		out["redis"] = env{"DLOCK_DB=redis://" + addr + "/0"}
	}
	if addr := startEtcd(t); addr != "" {
		out["etcd"] = env{"DLOCK_DB=etcd://" + addr}
	}
	out["mysql"] = e
	if pg := postgresStore(t); pg != nil {
		out["postgres"] = pg
		out["postgres-advisory"] = env{pg[0] + "&strategy=advisory"}
	}
	out["mysql-getlock"] = env{"DLOCK_DB=mysql://root@127.0.0.1:3306/test?table=dlock_cli_test&strategy=getlock"}
	out["mysql-rowlock"] = env{"DLOCK_DB=mysql://root@127.0.0.1:3306/test?table=dlock_cli_test&strategy=rowlock"}
	return out
}

// mysqlStore migrates and returns the MariaDB store on 127.0.0.1:3306, or nil
// (failing under CI=true) when there is none. With -short it is nil: the
// fast tier runs on the embedded store alone.
func mysqlStore(t *testing.T) env {
	if testing.Short() {
		return nil
	}
	dsn := "root@tcp(127.0.0.1:3306)/test"
	db, _ := sql.Open("mysql", dsn)
	defer db.Close()
	ctx, cancel := context.WithTimeout(context.Background(), 3*time.Second)
	defer cancel()
	if err := db.PingContext(ctx); err != nil {
		if os.Getenv("CI") == "true" {
			t.Fatalf("MariaDB on 127.0.0.1:3306 is required (CI=true): %v", err)
		}
		t.Logf("SKIPPING the MySQL store: %v", err)
		return nil
	}
	e := env{"DLOCK_DB=mysql://root@127.0.0.1:3306/test?table=dlock_cli_test"}
	if r := run(t, e, "migrate"); r.code != 0 {
		t.Fatalf("migrate: %d %s", r.code, r.stderr)
	}
	return e
}

type result struct {
	code           int
	stdout, stderr string
}

// command returns the binary with args, its environment the test's with e
// applied: "NAME=value" sets NAME, "-NAME" removes it.
func command(e env, args ...string) (*exec.Cmd, *bytes.Buffer, *bytes.Buffer) {
	cmd := exec.Command(binary, args...)
	drop := map[string]bool{}
	var set []string
	for _, kv := range e {
		if name, ok := strings.CutPrefix(kv, "-"); ok {
			drop[name] = true
			continue
		}
		name, _, _ := strings.Cut(kv, "=")
		drop[name] = true
		set = append(set, kv)
	}
	for _, kv := range os.Environ() {
		if name, _, _ := strings.Cut(kv, "="); !drop[name] {
			cmd.Env = append(cmd.Env, kv)
		}
	}
	// The binary is built with -race; do not let it sleep 1s at exit.
	cmd.Env = append(append(cmd.Env, "GORACE=atexit_sleep_ms=0"), set...)
	var stdout, stderr bytes.Buffer
	cmd.Stdout, cmd.Stderr = &stdout, &stderr
	return cmd, &stdout, &stderr
}

func run(t *testing.T, e env, args ...string) result {
	t.Helper()
	cmd, stdout, stderr := command(e, args...)
	err := cmd.Run()
	var ee *exec.ExitError
	if err != nil && !errors.As(err, &ee) {
		t.Fatal(err)
	}
	return result{cmd.ProcessState.ExitCode(), stdout.String(), stderr.String()}
}

// forEachStore runs f once per store, the stores at the same time (each
// test's keys are its own).
func forEachStore(t *testing.T, f func(t *testing.T, e env)) {
	for name, e := range stores(t) {
		t.Run(name, func(t *testing.T) {
			t.Parallel()
			f(t, e)
		})
	}
}

func uniqueKey(t *testing.T) string {
	return fmt.Sprintf("e2e/%s/%d", t.Name(), time.Now().UnixNano())
}

// holder is a background `dlock run` that holds a key.
type holder struct {
	cmd    *exec.Cmd
	stderr *bytes.Buffer // read only after done
	done   chan struct{} // closed when the process has exited
}

// startHolder starts `dlock args...` in the background; it is killed when
// the test ends, and its stderr logged if the test failed.
func startHolder(t *testing.T, e env, args ...string) *holder {
	t.Helper()
	cmd, _, stderr := command(e, args...)
	if err := cmd.Start(); err != nil {
		t.Fatal(err)
	}
	return watch(t, cmd, stderr, func() string { return "holder stderr: " + stderr.String() })
}

// watch makes the started cmd a holder: it is killed when the test ends, and
// what report returns is logged if the test failed.
func watch(t *testing.T, cmd *exec.Cmd, stderr *bytes.Buffer, report func() string) *holder {
	h := &holder{cmd: cmd, stderr: stderr, done: make(chan struct{})}
	go func() { cmd.Wait(); close(h.done) }()
	t.Cleanup(func() {
		cmd.Process.Kill()
		<-h.done
		if t.Failed() {
			t.Log(report())
		}
	})
	return h
}

// exited waits up to d for the holder to exit.
func (h *holder) exited(d time.Duration) bool {
	select {
	case <-h.done:
		return true
	case <-time.After(d):
		return false
	}
}

// waitHeld polls `dlock list` until key shows up (bounded), failing at once
// if the holder exits first.
func waitHeld(t *testing.T, e env, key string, h *holder) {
	t.Helper()
	var last result
	for range 200 {
		if last = run(t, e, "list", key); strings.Contains(last.stdout, key) {
			return
		}
		select {
		case <-h.done:
			t.Fatalf("the holder of %q exited %d before it showed up in dlock list: %s",
				key, h.cmd.ProcessState.ExitCode(), h.stderr)
		case <-time.After(50 * time.Millisecond):
		}
	}
	t.Fatalf("%q never showed up in dlock list; the last list exited %d: %q %q", key, last.code, last.stdout, last.stderr)
}

func TestRunNeverOverlaps(t *testing.T) {
	forEachStore(t, func(t *testing.T, e env) {
		key, dir := uniqueKey(t), t.TempDir()
		script := `mkdir "$D/inside" || exit 99; echo "$DLOCK_FENCE" >> "$D/log"; [ "$DLOCK_FENCE" = "$DLOCK_TOKEN" ] || exit 98; sleep 0.05; rmdir "$D/inside"`
		var wg sync.WaitGroup
		codes := make([]int, 6)
		for i := range codes {
			wg.Add(1)
			go func() {
				defer wg.Done()
				codes[i] = run(t, append(e, "D="+dir), "run", "--ttl", "5s", key, "--", "sh", "-c", script).code
			}()
		}
		wg.Wait()
		for i, c := range codes {
			if c != 0 {
				t.Errorf("run %d exited %d (99 means two critical sections overlapped)", i, c)
			}
		}
		data, _ := os.ReadFile(filepath.Join(dir, "log"))
		var last uint64
		lines := strings.Fields(string(data))
		for _, l := range lines {
			tok, _ := strconv.ParseUint(l, 10, 64)
			if tok <= last {
				t.Errorf("DLOCK_FENCE %d after %d: fences must increase", tok, last)
			}
			last = tok
		}
		if len(lines) != 6 {
			t.Errorf("%d critical sections ran, want 6", len(lines))
		}
	})
}

func TestRunPassesExitStatusAndEnvironment(t *testing.T) {
	forEachStore(t, func(t *testing.T, e env) {
		key := uniqueKey(t)
		if r := run(t, e, "run", key, "--", "sh", "-c", "exit 7"); r.code != 7 {
			t.Errorf("exit status %d, want 7 (%s)", r.code, r.stderr)
		}
		// DLOCK_DB may hold a password: the child must not see it.
		r := run(t, e, "run", "--owner", "ci-7", key, "--", "sh", "-c", `echo "$DLOCK_KEY|$DLOCK_OWNER|$DLOCK_TOKEN|${DLOCK_DB+DLOCK_DB is set}"`)
		parts := strings.Split(strings.TrimSpace(r.stdout), "|")
		if r.code != 0 || len(parts) != 4 || parts[0] != key || parts[1] != "ci-7" || parts[2] == "" || parts[2] == "0" || parts[3] != "" {
			t.Errorf("child environment %q (exit %d, %s)", r.stdout, r.code, r.stderr)
		}
		if r := run(t, e, "run", key, "--", "sh", "-c", "kill -TERM $$"); r.code != 128+15 {
			t.Errorf("a child killed by SIGTERM: exit %d, want 143", r.code)
		}
	})
}

func TestRunConflictAndList(t *testing.T) {
	forEachStore(t, func(t *testing.T, e env) {
		key := uniqueKey(t)
		h := startHolder(t, e, "run", "--owner", "alice", key, "--", "sleep", "30")
		waitHeld(t, e, key, h)

		if r := run(t, e, "run", "--wait", "0", key, "--", "true"); r.code != 75 || !strings.Contains(r.stderr, "alice") {
			t.Errorf("--wait 0 on a held key: exit %d (%q), want 75 naming the holder", r.code, r.stderr)
		}
		if r := run(t, e, "run", "-q", "--wait", "0", "--conflict-exit-code", "9", key, "--", "true"); r.code != 9 || r.stderr != "" {
			t.Errorf("--conflict-exit-code 9 -q: exit %d stderr %q", r.code, r.stderr)
		}
		if r := run(t, e, "run", "--wait", "300ms", key, "--", "true"); r.code != 75 || !strings.Contains(r.stderr, "gave up after 300ms") || !strings.Contains(r.stderr, "alice") {
			t.Errorf("--wait 300ms on a held key: exit %d (%q), want 75 saying it gave up after 300ms, naming the holder", r.code, r.stderr)
		}
		r := run(t, e, "list", "--json", key)
		var got []struct {
			Key, Owner string
			Token      uint64
		}
		if err := json.Unmarshal([]byte(r.stdout), &got); err != nil || len(got) != 1 || got[0].Key != key || got[0].Owner != "alice" || got[0].Token == 0 {
			t.Errorf("list --json: %v %q", err, r.stdout)
		}
		if r := run(t, e, "list"); !strings.Contains(r.stdout, "OWNER") || !strings.Contains(r.stdout, key) {
			t.Errorf("list: %q", r.stdout)
		}
		if r := run(t, e, "release", key); r.code != 64 {
			t.Errorf("release without --force: exit %d, want 64", r.code)
		}
		// SIGTERM to dlock reaches the child; the key is then free.
		h.cmd.Process.Signal(syscall.SIGTERM)
		if !h.exited(20 * time.Second) {
			t.Fatal("dlock run did not exit within 20 s of SIGTERM")
		}
		if code := h.cmd.ProcessState.ExitCode(); code != 128+15 {
			t.Errorf("dlock run after SIGTERM exited %d, want 143 (the child's death by SIGTERM)", code)
		}
		if r := run(t, e, "run", "--wait", "0", key, "--", "true"); r.code != 0 {
			t.Errorf("key not released after the holder stopped: exit %d %s", r.code, r.stderr)
		}
	})
}

func TestKilledDlockFreesKeyAndStopsChild(t *testing.T) {
	forEachStore(t, func(t *testing.T, e env) {
		key, dir := uniqueKey(t), t.TempDir()
		pidFile := filepath.Join(dir, "pid")
		h := startHolder(t, e, "run", "--ttl", "1s", key, "--", "sh", "-c", `echo $$ > "`+pidFile+`"; exec sleep 60`)
		waitHeld(t, e, key, h)
		var pid int
		for i := 0; pid == 0; i++ { // the child has started
			if i == 100 {
				t.Fatal("the child never wrote its pid")
			}
			time.Sleep(20 * time.Millisecond)
			data, _ := os.ReadFile(pidFile)
			pid, _ = strconv.Atoi(strings.TrimSpace(string(data)))
		}
		h.cmd.Process.Signal(syscall.SIGKILL)
		<-h.done
		start := time.Now()
		if r := run(t, e, "run", "--wait", "2s", key, "--", "true"); r.code != 0 {
			t.Errorf("the key of a killed dlock was not free within TTL + 1s: exit %d %s", r.code, r.stderr)
		}
		t.Logf("taken %s after the holder's SIGKILL (ttl 1s)", time.Since(start).Round(time.Millisecond))
		for i := 0; syscall.Kill(pid, 0) == nil; i++ {
			if i == 100 {
				t.Fatalf("child %d still runs after dlock was killed", pid)
			}
			time.Sleep(20 * time.Millisecond)
		}
	})
}

func TestLockLossStopsChild(t *testing.T) {
	forEachStore(t, func(t *testing.T, e env) {
		key := uniqueKey(t)
		h := startHolder(t, e, "run", "--ttl", "1s", "--grace", "500ms", key, "--", "sh", "-c", `trap "" TERM; exec sleep 60`)
		waitHeld(t, e, key, h)
		if r := run(t, e, "release", "--force", key); r.code != 0 {
			t.Fatalf("release --force: %d %s", r.code, r.stderr)
		}
		if !h.exited(10 * time.Second) {
			t.Fatal("dlock run kept the child running after losing the lock")
		}
		if code := h.cmd.ProcessState.ExitCode(); code != 76 {
			t.Errorf("exit %d after lock loss, want 76; stderr %q", code, h.stderr)
		}
		if r := run(t, e, "release", "--force", key); r.code != 1 {
			t.Errorf("release --force of a free key: exit %d, want 1", r.code)
		}
	})
}

func TestUsageErrors(t *testing.T) {
	e := env{"XDG_STATE_HOME=" + t.TempDir(), "-DLOCK_DB"}
	for _, args := range [][]string{
		{"run", "k"},
		{"run", "k", "true"},
		{"run", "", "--", "true"},
		{"run", "--ttl", "10ms", "k", "--", "true"},
		{"run", "--ttl", "0", "k", "--", "true"},
		{"run", "--grace", "-1s", "k", "--", "true"},
		{"run", "--db", "memcached://x", "k", "--", "true"},
		{"run", "--db", "mysql://u:hunter2@h/db?strategy=nope", "k", "--", "true"},
		{"run", "--db", "mysql://u:hunter2@h/db?color=red", "k", "--", "true"},
		{"run", "--db", "mysql://u:hunter2@h/db?doorbell=h", "k", "--", "true"},
		{"run", "--db", "mysql://u:hunter2@h/db?doorbell=h:3306&strategy=getlock", "k", "--", "true"},
		{"run", "--db", "mysql:u:hunter2@h/db", "k", "--", "true"}, // no "//": an opaque URL
		{"run", "--db", "u:hunter2@tcp(h:3306)/db", "k", "--", "true"},
		{"list", "a", "b"},
		{"frobnicate"},
	} {
		r := run(t, e, args...)
		if r.code != 64 {
			t.Errorf("dlock %q: exit %d, want 64 (%s)", args, r.code, r.stderr)
		}
		if strings.Contains(r.stderr, "hunter2") {
			t.Errorf("dlock %q printed the password: %s", args, r.stderr)
		}
	}
	if _, err := os.Stat(filepath.Join(e[0][len("XDG_STATE_HOME="):], "dlock")); err == nil {
		t.Error("a usage error created the embedded store")
	}
	if r := run(t, env{"DLOCK_DB=mysql://root:hunter2@127.0.0.1:1/test"}, "list"); r.code != 70 || strings.Contains(r.stderr, "hunter2") || !strings.Contains(r.stderr, "cannot reach") {
		t.Errorf("unreachable store: exit %d %q", r.code, r.stderr)
	}
	if r := run(t, e, "list", "--db", "mysql:u:hunter2@h/db"); !strings.Contains(r.stderr, "mysql://") {
		t.Errorf("a store URL without // : %q, want advice to write mysql://", r.stderr)
	}
	if r := run(t, env{"DLOCK_DB=postgres://u@127.0.0.1:1/test?password=hunter2&sslmode=disable"}, "list"); r.code != 70 || strings.Contains(r.stderr, "hunter2") {
		t.Errorf("unreachable store with ?password=: exit %d %q", r.code, r.stderr)
	}
	if r := run(t, env{"DLOCK_DB=mysql://root@127.0.0.1:3306/test?table=dlock_never_migrated"}, "list"); r.code != 70 || !strings.Contains(r.stderr, "dlock migrate") {
		t.Errorf("missing table: exit %d %q, want advice to run dlock migrate", r.code, r.stderr)
	}
	if r := run(t, e, "migrate", "--print"); r.code != 0 || !strings.Contains(r.stdout, "CREATE TABLE") {
		t.Errorf("migrate --print: %d %q", r.code, r.stdout)
	}
	if r := run(t, e, "version"); r.code != 0 || !strings.HasPrefix(r.stdout, "dlock ") {
		t.Errorf("version: %d %q", r.code, r.stdout)
	}
	if r := run(t, e, "run", "--help"); r.code != 0 || !strings.Contains(r.stdout, "crontab") {
		t.Errorf("run --help: %d %q", r.code, r.stdout)
	}
}

// TestEmbeddedStorePath checks that the embedded store is in
// $XDG_STATE_HOME/dlock/locks.db even when that path would not survive being
// read as a URL.
func TestEmbeddedStorePath(t *testing.T) {
	dir := filepath.Join(t.TempDir(), "state #1?%zz")
	e := env{"XDG_STATE_HOME=" + dir, "-DLOCK_DB"}
	if r := run(t, e, "run", "k", "--", "true"); r.code != 0 {
		t.Fatalf("dlock run with XDG_STATE_HOME=%q: exit %d %s", dir, r.code, r.stderr)
	}
	if _, err := os.Stat(filepath.Join(dir, "dlock", "locks.db")); err != nil {
		t.Errorf("the embedded store is not in $XDG_STATE_HOME/dlock/locks.db: %v", err)
	}
}

// startRedis starts a redis-server on a free loopback port for the test and
// returns its address ("" when there is no redis-server and CI is not set).
func startRedis(t *testing.T) string {
	bin, err := exec.LookPath("redis-server")
	if err != nil {
		if os.Getenv("CI") == "true" {
			t.Fatalf("redis-server is required (CI=true): %v", err)
		}
		t.Logf("SKIPPING the Redis store: %v", err)
		return ""
	}
	port := freeLoopbackPort(t)
	p := startProc(t, bin, "--bind", "127.0.0.1", "--port", strconv.Itoa(port), "--save", "", "--appendonly", "no")
	addr := net.JoinHostPort("127.0.0.1", strconv.Itoa(port))
	err = p.WaitReady(5*time.Second, 50*time.Millisecond, func() bool {
		c, err := net.Dial("tcp", addr)
		if err == nil {
			c.Close()
		}
		return err == nil
	})
	if err != nil {
		t.Fatalf("redis-server on %s did not start: %v", addr, err)
	}
	return addr
}

// startProc starts bin with args, killed when the test ends.
func startProc(t *testing.T, bin string, args ...string) *testproc.Proc {
	t.Helper()
	p := &testproc.Proc{}
	if err := p.Start(bin, args...); err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() {
		if err := p.Kill(); err != nil {
			t.Errorf("%s: %v", bin, err)
		}
	})
	return p
}

// postgresStore migrates and returns the PostgreSQL store on 127.0.0.1:5432,
// or nil (failing under CI=true) when there is none, and with -short.
func postgresStore(t *testing.T) env {
	if testing.Short() {
		return nil
	}
	e := env{"DLOCK_DB=postgres://postgres@127.0.0.1:5432/test?sslmode=disable&table=dlock_cli_test"}
	if r := run(t, e, "migrate"); r.code != 0 {
		if os.Getenv("CI") == "true" {
			t.Fatalf("PostgreSQL on 127.0.0.1:5432 is required (CI=true): migrate: %d %s", r.code, r.stderr)
		}
		t.Logf("SKIPPING the PostgreSQL store: %s", r.stderr)
		return nil
	}
	return e
}

// freeLoopbackPort returns a loopback port that is free now.
func freeLoopbackPort(t *testing.T) int {
	l, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	defer l.Close()
	return l.Addr().(*net.TCPAddr).Port
}

// startEtcd starts a one-member etcd on loopback ports for the test and
// returns its client address, or "" (failing under CI=true) without etcd.
// A 500 ms election timeout makes 1 s leases possible.
func startEtcd(t *testing.T) string {
	bin, err := exec.LookPath("etcd")
	if err != nil {
		if os.Getenv("CI") == "true" {
			t.Fatalf("etcd is required (CI=true): %v", err)
		}
		t.Logf("SKIPPING the etcd store: %v", err)
		return ""
	}
	client, peer := freeLoopbackPort(t), freeLoopbackPort(t)
	cu := fmt.Sprintf("http://127.0.0.1:%d", client)
	pu := fmt.Sprintf("http://127.0.0.1:%d", peer)
	p := startProc(t, bin, "--name", "e2e", "--data-dir", t.TempDir(),
		"--listen-client-urls", cu, "--advertise-client-urls", cu,
		"--listen-peer-urls", pu, "--initial-advertise-peer-urls", pu, "--initial-cluster", "e2e="+pu,
		"--heartbeat-interval", "50", "--election-timeout", "500", "--log-level", "error")
	addr := fmt.Sprintf("127.0.0.1:%d", client)
	err = p.WaitReady(10*time.Second, 50*time.Millisecond, func() bool {
		resp, err := http.Get(cu + "/health")
		if err != nil {
			return false
		}
		resp.Body.Close()
		return resp.StatusCode == http.StatusOK
	})
	if err != nil {
		t.Fatalf("etcd on %s did not become healthy: %v", addr, err)
	}
	return addr
}

// The doorbell parameter of a mysql:// store: off, the store's own server,
// or a server that does not answer (a dead doorbell node costs wake-ups,
// never the lock): a waiter gets the key when its holder's command ends.
func TestMySQLDoorbellParam(t *testing.T) {
	if mysqlStore(t) == nil {
		t.Skip("no MySQL store")
	}
	for _, bell := range []string{"off", "127.0.0.1:3306", "127.0.0.1:1"} {
		t.Run(bell, func(t *testing.T) {
			e := env{"DLOCK_DB=mysql://root@127.0.0.1:3306/test?table=dlock_cli_test&doorbell=" + bell}
			key := uniqueKey(t)
			h := startHolder(t, e, "run", key, "--", "sleep", "1")
			waitHeld(t, e, key, h)
			if r := run(t, e, "run", "--wait", "30s", key, "--", "true"); r.code != 0 {
				t.Errorf("waiter with doorbell=%s: exit %d %s", bell, r.code, r.stderr)
			}
			if !h.exited(20 * time.Second) {
				t.Fatal("the holder did not exit")
			}
		})
	}
}
