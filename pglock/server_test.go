package pglock_test

import (
	"context"
	"fmt"
	"os"
	"os/exec"
	"os/user"
	"path/filepath"
	"strconv"
	"strings"
	"syscall"
	"testing"
	"time"

	"github.com/dlock-dev/dlock/internal/testproc"
	"github.com/jackc/pgx/v5/pgxpool"
)

// pgBinDir holds the PostgreSQL server binaries that ownServer runs
// ($DLOCK_PG_BIN, or Debian's PostgreSQL 15).
func pgBinDir() string {
	if d := os.Getenv("DLOCK_PG_BIN"); d != "" {
		return d
	}
	return "/usr/lib/postgresql/15/bin"
}

const pgHint = "apt-get install postgresql-15, or set DLOCK_PG_BIN"

// ownServer is a PostgreSQL instance of one test: its own data directory
// and loopback port, with the given settings in its configuration.
type ownServer struct {
	t    testing.TB
	dir  string // data directory
	port int
	cred *syscall.Credential // nil: run as ourselves
	cmd  *exec.Cmd
	done chan struct{}
	out  *testproc.SyncBuffer
}

// startOwnServer initialises a cluster in a temporary directory and starts
// it with conf appended to postgresql.conf. PostgreSQL refuses to run as
// root: a root test runs it as the "postgres" user.
func startOwnServer(t testing.TB, conf string) *ownServer {
	t.Helper()
	initdb := filepath.Join(pgBinDir(), "initdb")
	if _, err := os.Stat(initdb); err != nil {
		testproc.Missing(t, "PostgreSQL's initdb", pgHint, err)
	}
	s := &ownServer{t: t}
	if os.Getuid() == 0 {
		u, err := user.Lookup("postgres")
		if err != nil {
			testproc.Missing(t, "a postgres user to run PostgreSQL as (the test runs as root)", pgHint, err)
		}
		uid, _ := strconv.Atoi(u.Uid)
		gid, _ := strconv.Atoi(u.Gid)
		s.cred = &syscall.Credential{Uid: uint32(uid), Gid: uint32(gid)}
	}
	base, err := os.MkdirTemp("", "pglock-server-")
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { os.RemoveAll(base) })
	if err := os.Chmod(base, 0o755); err != nil {
		t.Fatal(err)
	}
	s.dir = filepath.Join(base, "data")
	if err := os.Mkdir(s.dir, 0o700); err != nil {
		t.Fatal(err)
	}
	if s.cred != nil {
		if err := os.Chown(s.dir, int(s.cred.Uid), int(s.cred.Gid)); err != nil {
			t.Fatal(err)
		}
	}
	if out, err := s.command(initdb, "-D", s.dir, "-U", "postgres", "--auth=trust", "-E", "UTF8", "--no-sync", "--no-instructions").CombinedOutput(); err != nil {
		t.Fatalf("initdb: %v\n%s", err, out)
	}
	f, err := os.OpenFile(filepath.Join(s.dir, "postgresql.conf"), os.O_APPEND|os.O_WRONLY, 0)
	if err != nil {
		t.Fatal(err)
	}
	_, err = fmt.Fprintf(f, "\nlisten_addresses = '127.0.0.1'\nunix_socket_directories = '%s'\nmax_connections = 30\nshared_buffers = '16MB'\n%s\n", s.dir, conf)
	f.Close()
	if err != nil {
		t.Fatal(err)
	}
	var lastErr error
	for range 3 {
		s.port = testproc.FreePorts(t, 1, 20000, 32000, nil)[0]
		if lastErr = s.start(); lastErr == nil {
			t.Cleanup(s.stop)
			return s
		}
	}
	t.Fatalf("could not start PostgreSQL: %v", lastErr)
	return nil
}

func (s *ownServer) command(bin string, args ...string) *exec.Cmd {
	cmd := exec.Command(bin, args...)
	cmd.SysProcAttr = &syscall.SysProcAttr{Pdeathsig: syscall.SIGKILL, Credential: s.cred}
	cmd.Dir = "/"
	return cmd
}

// start runs the postmaster and waits until it accepts connections.
func (s *ownServer) start() error {
	s.out = &testproc.SyncBuffer{}
	s.cmd = s.command(filepath.Join(pgBinDir(), "postgres"), "-D", s.dir, "-p", strconv.Itoa(s.port))
	s.cmd.Stdout, s.cmd.Stderr = s.out, s.out
	if err := s.cmd.Start(); err != nil {
		return err
	}
	s.done = make(chan struct{})
	go func() { _ = s.cmd.Wait(); close(s.done) }()
	if err := s.waitReady(60 * time.Second); err != nil {
		s.kill()
		return err
	}
	return nil
}

// waitReady waits until the server accepts a query.
func (s *ownServer) waitReady(d time.Duration) error {
	deadline := time.Now().Add(d)
	for time.Now().Before(deadline) {
		select {
		case <-s.done:
			return fmt.Errorf("postgres exited: %s", s.out.String())
		default:
		}
		ctx, cancel := context.WithTimeout(context.Background(), time.Second)
		pool, err := pgxpool.New(ctx, s.dsn())
		if err == nil {
			err = pool.Ping(ctx)
			pool.Close()
		}
		cancel()
		if err == nil {
			return nil
		}
		time.Sleep(50 * time.Millisecond)
	}
	return fmt.Errorf("postgres not ready within %s: %s", d, s.out.String())
}

func (s *ownServer) dsn() string {
	return fmt.Sprintf("postgres://postgres@127.0.0.1:%d/postgres?sslmode=disable", s.port)
}

// pool opens a pool on the server, closed when the test ends.
func (s *ownServer) pool(t testing.TB, maxConns int) *pgxpool.Pool {
	t.Helper()
	cfg, err := pgxpool.ParseConfig(s.dsn())
	if err != nil {
		t.Fatal(err)
	}
	if maxConns > 0 {
		cfg.MaxConns = int32(maxConns)
	}
	pool, err := pgxpool.NewWithConfig(context.Background(), cfg)
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(pool.Close)
	return pool
}

// crashBackend kills a backend of this server with SIGKILL, which makes the
// postmaster end every session and recover from its WAL, as after a power
// loss of everything that was not flushed, then waits until it serves again.
func (s *ownServer) crashBackend(pid uint32) {
	s.t.Helper()
	if !strings.Contains(string(mustRead(s.t, fmt.Sprintf("/proc/%d/cmdline", pid))), "postgres") {
		s.t.Fatalf("pid %d is not a backend of the test's server", pid)
	}
	if ppid := procPPid(s.t, int(pid)); ppid != s.cmd.Process.Pid {
		s.t.Fatalf("pid %d is not a child of the test's postmaster (%d): %d", pid, s.cmd.Process.Pid, ppid)
	}
	if err := syscall.Kill(int(pid), syscall.SIGKILL); err != nil {
		s.t.Fatal(err)
	}
	// The postmaster notices, ends every backend and restarts: wait until
	// the restarted server answers, after the crash was processed.
	deadline := time.Now().Add(60 * time.Second)
	for !strings.Contains(s.out.String(), "database system is ready to accept connections") ||
		strings.Count(s.out.String(), "database system is ready to accept connections") < 2 {
		if time.Now().After(deadline) {
			s.t.Fatalf("the server did not recover from the crash: %s", s.out.String())
		}
		time.Sleep(20 * time.Millisecond)
	}
	if err := s.waitReady(60 * time.Second); err != nil {
		s.t.Fatal(err)
	}
}

// crashPooled crashes (see crashBackend) the backend of a connection of
// pool, which may first meet connections that an earlier crash ended.
func (s *ownServer) crashPooled(ctx context.Context, pool *pgxpool.Pool) {
	s.t.Helper()
	var pid uint32
	var err error
	for try := 0; ; try++ {
		if err = pool.QueryRow(ctx, "SELECT pg_backend_pid()").Scan(&pid); err == nil || try == 20 {
			break
		}
		time.Sleep(100 * time.Millisecond)
	}
	if err != nil {
		s.t.Fatal(err)
	}
	s.crashBackend(pid)
}

func mustRead(t testing.TB, path string) []byte {
	t.Helper()
	b, err := os.ReadFile(path)
	if err != nil {
		t.Fatal(err)
	}
	return b
}

// procPPid returns the parent pid of pid from /proc/<pid>/stat.
func procPPid(t testing.TB, pid int) int {
	t.Helper()
	stat := string(mustRead(t, fmt.Sprintf("/proc/%d/stat", pid)))
	fields := strings.Fields(stat[strings.LastIndexByte(stat, ')')+1:])
	ppid, err := strconv.Atoi(fields[1])
	if err != nil {
		t.Fatal(err)
	}
	return ppid
}

func (s *ownServer) kill() {
	if s.cmd != nil && s.cmd.Process != nil {
		_ = s.cmd.Process.Kill()
		select {
		case <-s.done:
		case <-time.After(testproc.KillTimeout):
		}
	}
}

// stop shuts the server down (fast shutdown), killing it if it lingers.
func (s *ownServer) stop() {
	if s.cmd == nil || s.cmd.Process == nil {
		return
	}
	_ = s.cmd.Process.Signal(syscall.SIGINT)
	select {
	case <-s.done:
	case <-time.After(15 * time.Second):
		s.kill()
	}
}
