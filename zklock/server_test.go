package zklock_test

import (
	"bytes"
	"context"
	"fmt"
	"net"
	"os"
	"path/filepath"
	"strconv"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/dlock-dev/dlock/internal/testproc"
	"github.com/go-zookeeper/zk"
)

// sessionTimeout is the tests' session: dlock's DefaultTTL of 30 s needs it,
// and the servers (testproc.ZooKeeperConfig) grant sessions up to 60 s.
const sessionTimeout = 30 * time.Second

// serverCommand returns java and the classpath. Without them the test fails
// under CI=true and is skipped otherwise.
func serverCommand(t testing.TB) (java, classpath string) {
	t.Helper()
	testproc.Short(t, "a ZooKeeper server")
	java, classpath, err := testproc.ZooKeeperCommand()
	if err != nil {
		testproc.Missing(t, "ZooKeeper", testproc.ZooKeeperHint, err)
	}
	return java, classpath
}

// server is one ZooKeeper server process on loopback ports.
type server struct {
	id                    int
	port, peer, election  int
	dir                   string
	java, classpath, conf string
	proc                  testproc.Proc
}

func (s *server) addr() string { return net.JoinHostPort("127.0.0.1", strconv.Itoa(s.port)) }

// freePorts returns n distinct loopback ports that are free now, below
// Linux's ephemeral range.
func freePorts(t testing.TB, n int) []int {
	t.Helper()
	return testproc.FreePorts(t, n, 20000, 32000, nil)
}

// writeConfig writes zoo.cfg (and myid) for s, a member of peers (nil for a
// standalone server).
func (s *server) writeConfig(t testing.TB, peers []*server) {
	t.Helper()
	data := filepath.Join(s.dir, "data")
	if err := os.MkdirAll(data, 0o700); err != nil {
		t.Fatal(err)
	}
	cfg := testproc.ZooKeeperConfig(data, s.port)
	for _, p := range peers {
		cfg += fmt.Sprintf("server.%d=127.0.0.1:%d:%d\n", p.id, p.peer, p.election)
	}
	if peers != nil {
		if err := os.WriteFile(filepath.Join(data, "myid"), []byte(strconv.Itoa(s.id)), 0o600); err != nil {
			t.Fatal(err)
		}
	}
	s.conf = filepath.Join(s.dir, "zoo.cfg")
	if err := os.WriteFile(s.conf, []byte(cfg), 0o600); err != nil {
		t.Fatal(err)
	}
}

// start runs the JVM. It does not wait for the server to serve.
func (s *server) start() error {
	return s.proc.Start(s.java, testproc.ZooKeeperArgs(s.classpath, s.conf)...)
}

// waitServing waits (bounded) until the server reports a mode: it has
// joined a quorum, or runs standalone.
func (s *server) waitServing(d time.Duration) error {
	var last string
	err := s.proc.WaitReady(d, 50*time.Millisecond, func() bool {
		last = fourLetter(s.addr(), "srvr")
		return strings.Contains(last, "Mode: ")
	})
	if err != nil {
		return fmt.Errorf("zookeeper %d on %s (last srvr: %q): %w", s.id, s.addr(), last, err)
	}
	return nil
}

// mode returns "leader", "follower", "standalone" or "".
func (s *server) mode() string {
	_, m, _ := strings.Cut(fourLetter(s.addr(), "srvr"), "Mode: ")
	m, _, _ = strings.Cut(m, "\n")
	return strings.TrimSpace(m)
}

// fourLetter sends a four-letter command and returns the reply ("" on
// error).
func fourLetter(addr, cmd string) string {
	c, err := net.DialTimeout("tcp", addr, time.Second)
	if err != nil {
		return ""
	}
	defer c.Close()
	c.SetDeadline(time.Now().Add(2 * time.Second))
	if _, err := c.Write([]byte(cmd)); err != nil {
		return ""
	}
	var buf bytes.Buffer
	buf.ReadFrom(c)
	return buf.String()
}

// stop freezes the server (SIGSTOP); cont resumes it (SIGCONT).
func (s *server) stop(t testing.TB) {
	if err := s.proc.Stop(); err != nil {
		t.Errorf("SIGSTOP to zookeeper %d: %v", s.id, err)
	}
}

func (s *server) cont(t testing.TB) {
	if err := s.proc.Cont(); err != nil {
		t.Errorf("SIGCONT to zookeeper %d: %v", s.id, err)
	}
}

// kill stops the process with SIGKILL and waits (bounded) for it to exit.
// It reports a failure on stderr: TestMain kills the shared server, after
// the tests.
func (s *server) kill() {
	if err := s.proc.Kill(); err != nil {
		fmt.Fprintf(os.Stderr, "zookeeper %d: %v\n", s.id, err)
	}
}

// startServers starts a standalone server (n = 1) or an ensemble of n on
// loopback and waits until every member serves. The caller kills them.
func startServers(t testing.TB, n int, dir string) ([]*server, error) {
	java, cp := serverCommand(t)
	ports := freePorts(t, 3*n)
	var ss []*server
	for i := range n {
		ss = append(ss, &server{id: i + 1, port: ports[3*i], peer: ports[3*i+1], election: ports[3*i+2],
			dir: filepath.Join(dir, strconv.Itoa(i+1)), java: java, classpath: cp})
	}
	var peers []*server
	if n > 1 {
		peers = ss
	}
	kill := func() {
		for _, s := range ss {
			s.kill()
		}
	}
	for _, s := range ss {
		s.writeConfig(t, peers)
		if err := s.start(); err != nil {
			kill()
			return nil, err
		}
	}
	for _, s := range ss {
		if err := s.waitServing(60 * time.Second); err != nil {
			kill()
			return nil, err
		}
	}
	return ss, nil
}

// startEnsemble starts n servers for one test, killed when it ends.
func startEnsemble(t testing.TB, n int) []*server {
	t.Helper()
	var lastErr error
	for range 3 { // a port may be taken between freePorts and the start
		ss, err := startServers(t, n, t.TempDir())
		if err == nil {
			t.Cleanup(func() {
				for _, s := range ss {
					s.kill()
				}
			})
			return ss
		}
		lastErr = err
	}
	t.Fatalf("could not start %d ZooKeeper servers: %v", n, lastErr)
	return nil
}

// The shared standalone server of the package's tests, started by the first
// test that needs it and killed by TestMain. Helper processes find it in
// envAddr.
var shared struct {
	mu  sync.Mutex
	srv *server
	dir string
}

// envAddr names the ZooKeeper servers (comma-separated) of the shared
// server; set it to use running servers instead.
const envAddr = "DLOCK_ZK_ADDR"

// sharedAddrs returns the servers of the shared server, starting it if
// needed.
func sharedAddrs(t testing.TB) []string {
	t.Helper()
	if v := os.Getenv(envAddr); v != "" {
		return strings.Split(v, ",")
	}
	shared.mu.Lock()
	defer shared.mu.Unlock()
	if shared.srv == nil {
		dir, err := os.MkdirTemp("", "zklock-test-")
		if err != nil {
			t.Fatal(err)
		}
		var ss []*server
		for range 3 {
			if ss, err = startServers(t, 1, dir); err == nil {
				break
			}
		}
		if err != nil {
			os.RemoveAll(dir)
			t.Fatalf("could not start ZooKeeper: %v", err)
		}
		shared.srv, shared.dir = ss[0], dir
		os.Setenv(envAddr, ss[0].addr())
	}
	return []string{shared.srv.addr()}
}

func stopShared() {
	shared.mu.Lock()
	defer shared.mu.Unlock()
	if shared.srv != nil {
		shared.srv.kill()
		os.RemoveAll(shared.dir)
		shared.srv = nil
	}
}

type nopLogger struct{}

func (nopLogger) Printf(string, ...any) {}

// newConn connects to servers with the tests' session timeout; the
// connection is closed when the test ends.
func newConn(t testing.TB, servers ...string) *zk.Conn {
	t.Helper()
	c, _, err := zk.Connect(servers, sessionTimeout, zk.WithLogger(nopLogger{}), zk.WithLogInfo(false))
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(c.Close)
	return c
}

// ctxT returns a context that ends after d or at the end of the test.
func ctxT(t testing.TB, d time.Duration) context.Context {
	ctx, cancel := context.WithTimeout(context.Background(), d)
	t.Cleanup(cancel)
	return ctx
}
