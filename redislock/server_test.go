package redislock_test

import (
	"context"
	"fmt"
	"net"
	"os"
	"os/exec"
	"path/filepath"
	"strconv"
	"strings"
	"testing"
	"time"

	"github.com/dlock-dev/dlock/internal/testproc"
	"github.com/redis/go-redis/v9"
)

// server is a redis-server process started by a test on a loopback port,
// without persistence unless its arguments ask for it. It is killed when the
// test ends.
type server struct {
	t    testing.TB
	bin  string
	port int
	dir  string
	conf string // Sentinel's configuration file; empty for a server
	args []string
	proc testproc.Proc
}

// redisServer returns the path of redis-server. Without it the test fails
// under CI=true and is skipped otherwise.
func redisServer(t testing.TB) string {
	t.Helper()
	return testproc.Binary(t, "redis-server", "apt-get install redis-server, or run scripts/test.sh")
}

// freePort returns a loopback port that is free now, and whose cluster bus
// port (+10000) is free too. The range stays below Linux's ephemeral ports.
func freePort(t testing.TB) int {
	t.Helper()
	return testproc.FreePorts(t, 1, 7000, 22000, func(p int) bool { return testproc.IsFree(p + 10000) })[0]
}

// startServer starts a redis-server with extra arguments and waits until it
// answers PING.
func startServer(t testing.TB, args ...string) *server {
	t.Helper()
	bin := redisServer(t)
	var lastErr error
	for range 5 { // the port may be taken between freePort and the start
		s := &server{t: t, bin: bin, port: freePort(t), dir: t.TempDir(), args: args}
		if lastErr = s.start(); lastErr == nil {
			t.Cleanup(s.kill)
			return s
		}
	}
	t.Fatalf("could not start redis-server: %v", lastErr)
	return nil
}

func (s *server) addr() string { return net.JoinHostPort("127.0.0.1", strconv.Itoa(s.port)) }

// start runs the process and waits (bounded) for it to answer.
func (s *server) start() error {
	args := []string{"--port", strconv.Itoa(s.port), "--bind", "127.0.0.1", "--dir", s.dir}
	if s.conf != "" {
		args = append([]string{s.conf, "--sentinel"}, args...)
	} else {
		args = append(args, "--save", "", "--appendonly", "no", "--daemonize", "no", "--logfile", "")
	}
	args = append(args, s.args...)
	if err := s.proc.Start(s.bin, args...); err != nil {
		return err
	}
	if err := s.proc.WaitReady(15*time.Second, 20*time.Millisecond, func() bool { return ping(s.addr()) == nil }); err != nil {
		s.kill()
		return fmt.Errorf("redis-server on port %d: %w", s.port, err)
	}
	return nil
}

// ping sends one PING over a raw connection.
func ping(addr string) error {
	c, err := net.DialTimeout("tcp", addr, time.Second)
	if err != nil {
		return err
	}
	defer c.Close()
	c.SetDeadline(time.Now().Add(time.Second))
	if _, err := c.Write([]byte("PING\r\n")); err != nil {
		return err
	}
	buf := make([]byte, 64)
	n, err := c.Read(buf)
	if err != nil {
		return err
	}
	if !strings.HasPrefix(string(buf[:n]), "+PONG") {
		return fmt.Errorf("PING: %q", buf[:n])
	}
	return nil
}

// kill stops the process with SIGKILL (no save, no goodbye to clients) and
// waits for it to exit.
func (s *server) kill() {
	if err := s.proc.Kill(); err != nil {
		s.t.Errorf("redis-server on port %d: %v", s.port, err)
	}
}

// restart kills the process and starts a new one on the same port and
// directory. Without persistence its data is gone.
func (s *server) restart(t testing.TB) {
	t.Helper()
	s.kill()
	var err error
	for range 50 { // the old socket may linger for a moment
		if err = s.start(); err == nil {
			return
		}
		time.Sleep(100 * time.Millisecond)
	}
	t.Fatalf("restart: %v", err)
}

// client returns a go-redis client of s, closed at the end of the test.
func (s *server) client(t testing.TB) *redis.Client {
	return newClient(t, s.addr())
}

func newClient(t testing.TB, addr string) *redis.Client {
	c := redis.NewClient(&redis.Options{Addr: addr})
	t.Cleanup(func() { c.Close() })
	return c
}

// startCluster starts a Redis Cluster of three primaries and waits until it
// serves every slot.
func startCluster(t testing.TB) []*server {
	t.Helper()
	var nodes []*server
	var addrs []string
	for range 3 {
		s := startServer(t, "--cluster-enabled", "yes", "--cluster-node-timeout", "5000",
			"--cluster-config-file", "nodes.conf")
		nodes = append(nodes, s)
		addrs = append(addrs, s.addr())
	}
	cli, err := exec.LookPath("redis-cli")
	if err != nil {
		t.Fatalf("redis-cli is needed to create a cluster: %v", err)
	}
	ctx, cancel := context.WithTimeout(context.Background(), 60*time.Second)
	defer cancel()
	out, err := exec.CommandContext(ctx, cli, append(append([]string{"--cluster", "create"}, addrs...), "--cluster-yes")...).CombinedOutput()
	if err != nil {
		t.Fatalf("redis-cli --cluster create: %v\n%s", err, out)
	}
	for _, s := range nodes {
		c := s.client(t)
		for {
			info, err := c.ClusterInfo(ctx).Result()
			if err == nil && strings.Contains(info, "cluster_state:ok") {
				break
			}
			if ctx.Err() != nil {
				t.Fatalf("cluster node %s not ready: %v %q", s.addr(), err, info)
			}
			time.Sleep(50 * time.Millisecond)
		}
	}
	return nodes
}

// startSentinel starts a primary and one Sentinel watching it as "primary".
func startSentinel(t testing.TB) (primary, sentinel *server) {
	t.Helper()
	primary = startServer(t)
	bin := redisServer(t)
	var lastErr error
	for range 5 {
		s := &server{t: t, bin: bin, port: freePort(t), dir: t.TempDir()}
		s.conf = filepath.Join(s.dir, "sentinel.conf") // Sentinel rewrites it
		err := os.WriteFile(s.conf, []byte(fmt.Sprintf("sentinel monitor primary 127.0.0.1 %d 1\n", primary.port)), 0o600)
		if err != nil {
			t.Fatal(err)
		}
		if lastErr = s.start(); lastErr == nil {
			t.Cleanup(s.kill)
			return primary, s
		}
	}
	t.Fatalf("could not start a Sentinel: %v", lastErr)
	return nil, nil
}
