package testproc

import (
	"bufio"
	"fmt"
	"net"
	"net/http"
	"os"
	"os/exec"
	"path/filepath"
	"strconv"
	"strings"
	"testing"
	"time"
)

// This file starts one standalone server of each consensus/cache store, for
// tests that need one server and nothing else of it (the fault harness).
// The backends' own tests start theirs with more control (clusters,
// restarts, sentinels).

// Install hints for Missing.
const (
	RedisHint     = "apt-get install redis-server, or run scripts/test.sh"
	EtcdHint      = "apt-get install etcd-server, or run scripts/test.sh"
	ZooKeeperHint = "apt-get install zookeeper, or run scripts/test.sh"
)

// startWithRetry starts a server on a fresh free port up to three times (a
// port may be taken between the check and the start), kills it when the
// test ends, and returns its client address.
func startWithRetry(t testing.TB, what string, start func(p *Proc, port int) error) string {
	t.Helper()
	var lastErr error
	for range 3 {
		port := FreePorts(t, 1, 20000, 32000, nil)[0]
		p := &Proc{}
		if lastErr = start(p, port); lastErr == nil {
			t.Cleanup(func() {
				if err := p.Kill(); err != nil {
					t.Errorf("%s: %v", what, err)
				}
			})
			return net.JoinHostPort("127.0.0.1", strconv.Itoa(port))
		}
		p.Kill()
	}
	t.Fatalf("could not start %s: %v", what, lastErr)
	return ""
}

// StartRedis starts a redis-server on a loopback port without persistence
// and returns its address once it answers PING.
func StartRedis(t testing.TB) string {
	t.Helper()
	bin := Binary(t, "redis-server", RedisHint)
	dir := t.TempDir()
	return startWithRetry(t, "redis-server", func(p *Proc, port int) error {
		addr := net.JoinHostPort("127.0.0.1", strconv.Itoa(port))
		if err := p.Start(bin, "--port", strconv.Itoa(port), "--bind", "127.0.0.1", "--dir", dir,
			"--save", "", "--appendonly", "no", "--daemonize", "no", "--logfile", ""); err != nil {
			return err
		}
		return p.WaitReady(15*time.Second, 20*time.Millisecond, func() bool {
			return strings.HasPrefix(roundTrip(addr, "PING\r\n"), "+PONG")
		})
	})
}

// StartEtcd starts a single-member etcd on loopback ports and returns its
// client address once it reports itself healthy. Its 50 ms heartbeat and
// 500 ms election timeout make its smallest lease 1 s (the default timing
// gives 2 s).
func StartEtcd(t testing.TB) string {
	t.Helper()
	bin := Binary(t, "etcd", EtcdHint)
	hc := &http.Client{Timeout: time.Second}
	return startWithRetry(t, "etcd", func(p *Proc, port int) error {
		peer := FreePorts(t, 1, 20000, 32000, func(q int) bool { return q != port })[0]
		client := "http://127.0.0.1:" + strconv.Itoa(port)
		peerURL := "http://127.0.0.1:" + strconv.Itoa(peer)
		if err := p.Start(bin, "--name", "torture", "--data-dir", t.TempDir(),
			"--listen-client-urls", client, "--advertise-client-urls", client,
			"--listen-peer-urls", peerURL, "--initial-advertise-peer-urls", peerURL,
			"--initial-cluster", "torture="+peerURL, "--initial-cluster-state", "new",
			"--heartbeat-interval", "50", "--election-timeout", "500",
			"--logger", "zap", "--log-level", "warn", "--log-outputs", "stderr"); err != nil {
			return err
		}
		return p.WaitReady(30*time.Second, 50*time.Millisecond, func() bool {
			resp, err := hc.Get(client + "/health")
			if err != nil {
				return false
			}
			var body [256]byte
			n, _ := resp.Body.Read(body[:])
			resp.Body.Close()
			return resp.StatusCode == http.StatusOK && strings.Contains(string(body[:n]), `"health":"true"`)
		})
	})
}

// zooKeeperJars are the jars (in Debian's /usr/share/java) that a ZooKeeper
// 3.8 server needs, logging to nowhere.
var zooKeeperJars = []string{
	"zookeeper.jar", "zookeeper-jute.jar", "slf4j-api.jar", "slf4j-nop.jar",
	"netty-handler.jar", "netty-transport.jar", "netty-common.jar", "netty-buffer.jar",
	"netty-resolver.jar", "netty-codec.jar", "netty-transport-native-epoll.jar",
	"netty-transport-native-unix-common.jar", "commons-io.jar", "commons-cli.jar",
	"metrics-core.jar", "snappy-java.jar",
}

// ZooKeeperCommand returns the java binary and the classpath that run a
// ZooKeeper 3.8 server from Debian's zookeeper package (main class
// org.apache.zookeeper.server.quorum.QuorumPeerMain), or an error naming
// what is missing.
func ZooKeeperCommand() (java, classpath string, err error) {
	java, err = exec.LookPath("java")
	if err != nil {
		return "", "", err
	}
	var cp []string
	for _, j := range zooKeeperJars {
		p := filepath.Join("/usr/share/java", j)
		if _, err := os.Stat(p); err != nil {
			return "", "", err
		}
		cp = append(cp, p)
	}
	return java, strings.Join(cp, ":"), nil
}

// ZooKeeperConfig returns the zoo.cfg of a test server with its data in
// dataDir, serving on the loopback port: a 200 ms tick (quick elections and
// session expiry) and session bounds of 1–60 s, so that clients can ask for
// short sessions and for the 30 s sessions dlock's DefaultTTL needs. An
// ensemble member adds its server.N lines (and a myid file in dataDir).
func ZooKeeperConfig(dataDir string, port int) string {
	return fmt.Sprintf(`tickTime=200
initLimit=20
syncLimit=5
dataDir=%s
clientPort=%d
clientPortAddress=127.0.0.1
admin.enableServer=false
4lw.commands.whitelist=srvr,ruok,wchp,wchc,cons
minSessionTimeout=1000
maxSessionTimeout=60000
`, dataDir, port)
}

// ZooKeeperArgs returns the java arguments that run a test server from
// classpath (see ZooKeeperCommand) with the configuration file conf: a
// small heap, no fsync.
func ZooKeeperArgs(classpath, conf string) []string {
	return []string{"-Xmx128m", "-XX:+UseSerialGC", "-XX:TieredStopAtLevel=1",
		"-Dzookeeper.forceSync=no", "-Dzookeeper.admin.enableServer=false",
		"-cp", classpath, "org.apache.zookeeper.server.quorum.QuorumPeerMain", conf}
}

// StartZooKeeper starts a standalone ZooKeeper (ZooKeeperConfig) on a
// loopback port and returns its address once it serves, and its data
// directory (which holds its transaction log, in version-2/).
func StartZooKeeper(t testing.TB) (addr, dataDir string) {
	t.Helper()
	Short(t, "a ZooKeeper server")
	java, cp, err := ZooKeeperCommand()
	if err != nil {
		Missing(t, "ZooKeeper", ZooKeeperHint, err)
	}
	dir := t.TempDir()
	dataDir = filepath.Join(dir, "data")
	addr = startWithRetry(t, "ZooKeeper", func(p *Proc, port int) error {
		conf := filepath.Join(dir, "zoo.cfg")
		if err := os.WriteFile(conf, []byte(ZooKeeperConfig(dataDir, port)), 0o600); err != nil {
			return err
		}
		if err := p.Start(java, ZooKeeperArgs(cp, conf)...); err != nil {
			return err
		}
		addr := net.JoinHostPort("127.0.0.1", strconv.Itoa(port))
		return p.WaitReady(60*time.Second, 50*time.Millisecond, func() bool {
			return strings.Contains(roundTrip(addr, "srvr"), "Mode: ")
		})
	})
	return addr, dataDir
}

// roundTrip sends req over a new connection and returns the first line (or
// everything, up to 4 KiB) of the reply; "" on error.
func roundTrip(addr, req string) string {
	c, err := net.DialTimeout("tcp", addr, time.Second)
	if err != nil {
		return ""
	}
	defer c.Close()
	c.SetDeadline(time.Now().Add(2 * time.Second))
	if _, err := c.Write([]byte(req)); err != nil {
		return ""
	}
	var b strings.Builder
	sc := bufio.NewScanner(c)
	for sc.Scan() && b.Len() < 4096 {
		b.WriteString(sc.Text() + "\n")
		if strings.HasPrefix(req, "PING") {
			break
		}
	}
	return b.String()
}
