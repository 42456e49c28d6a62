package etcdlock_test

import (
	"bytes"
	"context"
	"fmt"
	"math/rand/v2"
	"net/http"
	"strconv"
	"strings"
	"testing"
	"time"

	"github.com/dlock-dev/dlock/internal/testproc"
	clientv3 "go.etcd.io/etcd/client/v3"
	"go.uber.org/zap"
)

// Timing of the test servers. A 50 ms heartbeat and a 500 ms election
// timeout make etcd's smallest lease 1 s (1.5 election timeouts, rounded up
// to a second), which the suite's 1 s leases need; with the defaults
// (100 ms, 1 s) it is 2 s.
const (
	heartbeatMs = 50
	electionMs  = 500
)

// member is one etcd process started by a test on loopback ports. It is
// killed when the test ends.
type member struct {
	t          testing.TB
	name       string
	clientPort int
	peerPort   int
	dir        string
	args       []string // the whole command line after the binary
	proc       testproc.Proc
}

// etcdBinary returns the path of etcd. Without it the test fails under
// CI=true and is skipped otherwise.
func etcdBinary(t testing.TB) string {
	t.Helper()
	return testproc.Binary(t, "etcd", "apt-get install etcd-server, or run scripts/test.sh")
}

// freePorts returns n distinct loopback ports that are free now. The range
// stays below Linux's ephemeral ports.
func freePorts(t testing.TB, n int) []int {
	t.Helper()
	return testproc.FreePorts(t, n, 20000, 32000, nil)
}

func url(port int) string { return "http://127.0.0.1:" + strconv.Itoa(port) }

// cluster is a set of etcd members forming one cluster.
type cluster struct {
	members []*member
}

// endpoints returns the client URLs of all members.
func (c *cluster) endpoints() []string {
	var eps []string
	for _, m := range c.members {
		eps = append(eps, m.endpoint())
	}
	return eps
}

// startCluster starts an etcd cluster of n members on loopback and waits
// until every member reports itself healthy (it has a leader and serves a
// quorum read).
func startCluster(t testing.TB, n int) *cluster {
	t.Helper()
	bin := etcdBinary(t)
	var lastErr error
	for range 3 { // a port may be taken between freePorts and the start
		c, err := tryCluster(t, bin, n)
		if err == nil {
			return c
		}
		lastErr = err
	}
	t.Fatalf("could not start an etcd cluster of %d: %v", n, lastErr)
	return nil
}

func tryCluster(t testing.TB, bin string, n int) (*cluster, error) {
	ports := freePorts(t, 2*n)
	token := "dlock-test-" + strconv.Itoa(rand.IntN(1e9))
	c := &cluster{}
	var initial []string
	for i := range n {
		m := &member{t: t, name: fmt.Sprintf("m%d", i), clientPort: ports[2*i], peerPort: ports[2*i+1], dir: t.TempDir()}
		c.members = append(c.members, m)
		initial = append(initial, m.name+"="+url(m.peerPort))
	}
	for _, m := range c.members {
		m.args = []string{
			"--name", m.name, "--data-dir", m.dir,
			"--listen-client-urls", url(m.clientPort), "--advertise-client-urls", url(m.clientPort),
			"--listen-peer-urls", url(m.peerPort), "--initial-advertise-peer-urls", url(m.peerPort),
			"--initial-cluster", strings.Join(initial, ","), "--initial-cluster-state", "new",
			"--initial-cluster-token", token,
			"--heartbeat-interval", strconv.Itoa(heartbeatMs), "--election-timeout", strconv.Itoa(electionMs),
			"--logger", "zap", "--log-level", "warn", "--log-outputs", "stderr",
		}
		if err := m.start(bin); err != nil {
			c.kill()
			return nil, err
		}
		t.Cleanup(m.kill)
	}
	for _, m := range c.members {
		if err := m.waitHealthy(30 * time.Second); err != nil {
			c.kill()
			return nil, err
		}
	}
	return c, nil
}

func (c *cluster) kill() {
	for _, m := range c.members {
		m.kill()
	}
}

func (m *member) endpoint() string { return "127.0.0.1:" + strconv.Itoa(m.clientPort) }

func (m *member) start(bin string) error { return m.proc.Start(bin, m.args...) }

// waitHealthy polls the member's /health endpoint until it answers healthy,
// the process exits, or d passes.
func (m *member) waitHealthy(d time.Duration) error {
	hc := &http.Client{Timeout: time.Second}
	err := m.proc.WaitReady(d, 50*time.Millisecond, func() bool {
		resp, err := hc.Get(url(m.clientPort) + "/health")
		if err != nil {
			return false
		}
		var body [256]byte
		n, _ := resp.Body.Read(body[:])
		resp.Body.Close()
		return resp.StatusCode == http.StatusOK && bytes.Contains(body[:n], []byte(`"health":"true"`))
	})
	if err != nil {
		return fmt.Errorf("etcd %s: %w", m.name, err)
	}
	return nil
}

// stop freezes the process (SIGSTOP); cont resumes it (SIGCONT).
func (m *member) stop() {
	if err := m.proc.Stop(); err != nil {
		m.t.Errorf("SIGSTOP to etcd %s: %v", m.name, err)
	}
}

func (m *member) cont() {
	if err := m.proc.Cont(); err != nil {
		m.t.Errorf("SIGCONT to etcd %s: %v", m.name, err)
	}
}

// kill stops the process with SIGKILL and waits (bounded) for it to exit.
func (m *member) kill() {
	if err := m.proc.Kill(); err != nil {
		m.t.Errorf("etcd %s: %v", m.name, err)
	}
}

// restart starts the killed member again with its data directory, and
// waits until it is healthy.
func (m *member) restart(t testing.TB) {
	t.Helper()
	m.kill()
	m.args = append(m.args[:len(m.args):len(m.args)], "--initial-cluster-state", "existing")
	var err error
	for range 50 { // the old sockets may linger for a moment
		if err = m.start(etcdBinary(t)); err == nil {
			if err = m.waitHealthy(30 * time.Second); err == nil {
				return
			}
		}
		m.kill()
		time.Sleep(100 * time.Millisecond)
	}
	t.Fatalf("restart etcd %s: %v", m.name, err)
}

// newClient returns a client of the given endpoints, closed at the end of the
// test.
func newClient(t testing.TB, endpoints ...string) *clientv3.Client {
	t.Helper()
	c, err := clientv3.New(clientv3.Config{
		Endpoints:   endpoints,
		DialTimeout: 5 * time.Second,
		Logger:      zap.NewNop(),
		// Notice a dead member's connection quickly (the default waits for
		// the OS), as a production client with several endpoints should.
		DialKeepAliveTime:    time.Second,
		DialKeepAliveTimeout: time.Second,
	})
	if err != nil {
		t.Fatalf("etcd client: %v", err)
	}
	t.Cleanup(func() { c.Close() })
	return c
}

// ctxT returns a context that ends after d or at the end of the test.
func ctxT(t testing.TB, d time.Duration) context.Context {
	ctx, cancel := context.WithTimeout(context.Background(), d)
	t.Cleanup(cancel)
	return ctx
}
