package torture

import (
	"context"
	"errors"
	"fmt"
	"io"
	"net"
	"os"
	"os/exec"
	"path/filepath"
	"strconv"
	"strings"
	"sync"
	"time"

	toxiproxy "github.com/Shopify/toxiproxy/v2"
	"github.com/redis/go-redis/v9"
	"github.com/rs/zerolog"
)

// The Redis clusters of the failover fault: a primary, one replica and
// three Sentinels, which detect the primary's death and promote the
// replica. Clients reach the primary through the Front, which Failover
// points at the node Sentinel reports (SENTINEL get-master-addr-by-name).
//
//   - redis-async: a plain replica; redis-lease waits for none.
//   - redis-minreplicas: redis-lease with redislock.Options.MinReplicas 1
//     (WAIT after each grant and extension), and every node configured with
//     min-replicas-to-write 1 and min-replicas-max-lag 2, so a primary
//     without a current replica refuses writes.
//
// The replica replicates through a proxy of the cluster's (the link), on
// which Failover discards the primary's stream for redisLag before the
// kill: the replica misses the grants of that time, as one that lags or is
// cut off does. Without MinReplicas a grant it missed is lost by the
// promotion; with it, the grant's WAIT does not return in time and the grant
// is withdrawn.
//
// Sentinel repoints a replica that replicates from another address than the
// primary's (the link's) at the primary once it has done so for its
// failover-timeout (redisFailoverTimeout): with failovers further apart
// than that, the replica bypasses the link and the lag cuts nothing. A
// failover that Sentinel aborts is tried again after twice that timeout.
type redisCluster struct {
	bin, dir    string
	minReplicas int
	front       *Front
	linkSrv     *toxiproxy.ApiServer

	mu        sync.Mutex
	link      *toxiproxy.Proxy // replica -> primary
	links     int              // links made, for their names
	primary   *clusterNode
	replica   *clusterNode
	sentinels []*clusterNode
}

const (
	redisMaster          = "torture"
	redisDownAfter       = 500 * time.Millisecond
	redisFailoverTimeout = 30 * time.Second
	redisLag             = time.Second
)

func startRedisAsync(ctx context.Context, dir string, log io.Writer) (Cluster, error) {
	return startRedisCluster(ctx, dir, log, 0)
}

func startRedisMinReplicas(ctx context.Context, dir string, log io.Writer) (Cluster, error) {
	return startRedisCluster(ctx, dir, log, 1)
}

func startRedisCluster(ctx context.Context, dir string, log io.Writer, minReplicas int) (_ Cluster, err error) {
	bin, err := exec.LookPath("redis-server")
	if err != nil {
		return nil, fmt.Errorf("%w: redis-server: %v", ErrNoServer, err)
	}
	if err := os.MkdirAll(filepath.Join(dir, "logs"), 0o755); err != nil {
		return nil, err
	}
	c := &redisCluster{bin: bin, dir: dir, minReplicas: minReplicas,
		linkSrv: toxiproxy.NewServer(toxiproxy.NewMetricsContainer(nil), zerolog.Nop())}
	defer func() {
		if err != nil {
			c.Close()
		}
	}()
	if c.primary, err = c.startNode(ctx, "", 0); err != nil {
		return nil, fmt.Errorf("start the primary: %w", err)
	}
	if err := c.newLink(c.primary.addr); err != nil {
		return nil, err
	}
	if c.replica, err = c.startNode(ctx, c.link.Listen, 0); err != nil {
		return nil, fmt.Errorf("start the replica: %w", err)
	}
	if err := c.awaitReplica(ctx, c.primary, c.replica); err != nil {
		return nil, err
	}
	for i := range 3 {
		s, err := c.startSentinel(ctx, i)
		if err != nil {
			return nil, fmt.Errorf("start Sentinel %d: %w", i, err)
		}
		c.sentinels = append(c.sentinels, s)
	}
	// Each Sentinel knows the replica and the other two before the first
	// failover.
	err = pollUntil(ctx, 60*time.Second, nil, func(ctx context.Context) error {
		return c.eachSentinel(func(s *clusterNode, sc *redis.SentinelClient) error {
			m, err := sc.Master(ctx, redisMaster).Result()
			if err != nil {
				return err
			}
			if m["num-slaves"] != "1" || m["num-other-sentinels"] != "2" {
				return fmt.Errorf("sentinel %s sees %s replicas and %s other Sentinels", s.addr, m["num-slaves"], m["num-other-sentinels"])
			}
			return nil
		})
	})
	if err != nil {
		return nil, err
	}
	if c.front, err = NewFront(c.primary.addr); err != nil {
		return nil, err
	}
	fmt.Fprintf(log, "redis cluster: primary %s, replica %s (through %s), Sentinels %s %s %s, front %s, min replicas %d\n",
		c.primary.addr, c.replica.addr, c.link.Listen, c.sentinels[0].addr, c.sentinels[1].addr, c.sentinels[2].addr,
		c.front.Addr(), minReplicas)
	return c, nil
}

// Configure implements Cluster.
func (c *redisCluster) Configure(cfg *Config) []string {
	cfg.RedisAddr = c.front.Addr()
	cfg.RedisMinReplicas = c.minReplicas
	return []string{redisLease.Name}
}

// start runs redis-server with args on port (killed with the harness),
// its output in logs/name.log, and waits (bounded) until it answers PING.
func (c *redisCluster) start(ctx context.Context, name string, port int, args ...string) (*clusterNode, error) {
	addr := net.JoinHostPort("127.0.0.1", strconv.Itoa(port))
	rdb := redis.NewClient(&redis.Options{Addr: addr, MaxRetries: -1, DialTimeout: time.Second})
	defer rdb.Close()
	n := &clusterNode{name: name, addr: addr, logFile: filepath.Join(c.dir, "logs", name+".log"), bin: c.bin, args: args,
		ready: func(ctx context.Context) error { return rdb.Ping(ctx).Err() }}
	if err := n.start(); err != nil {
		return nil, err
	}
	if err := n.waitReady(ctx, 15*time.Second); err != nil {
		n.kill()
		return nil, err
	}
	return n, nil
}

// startNode starts a data node without persistence on port (a free one if
// 0), in a fresh directory, as a replica of master if not empty.
func (c *redisCluster) startNode(ctx context.Context, master string, port int) (*clusterNode, error) {
	var err error
	for range 3 { // a free port may be taken before the server binds it
		p := port
		if p == 0 {
			if p, err = freePort(); err != nil {
				return nil, err
			}
		}
		dir := filepath.Join(c.dir, fmt.Sprintf("node-%d", p))
		if err := freshDir(dir); err != nil {
			return nil, err
		}
		args := []string{"--port", strconv.Itoa(p), "--bind", "127.0.0.1", "--dir", dir,
			"--save", "", "--appendonly", "no", "--daemonize", "no", "--logfile", "", "--protected-mode", "no",
			"--repl-diskless-sync", "yes", "--repl-diskless-sync-delay", "0"}
		if c.minReplicas > 0 {
			args = append(args, "--min-replicas-to-write", strconv.Itoa(c.minReplicas), "--min-replicas-max-lag", "2")
		}
		if master != "" {
			host, mport, _ := net.SplitHostPort(master)
			args = append(args, "--replicaof", host, mport)
		}
		var n *clusterNode
		if n, err = c.start(ctx, fmt.Sprintf("node-%d", p), p, args...); err == nil {
			return n, nil
		}
		if port != 0 {
			// The killed node's port: its socket may linger a moment.
			time.Sleep(100 * time.Millisecond)
		}
	}
	return nil, err
}

// startSentinel starts Sentinel i watching the primary.
func (c *redisCluster) startSentinel(ctx context.Context, i int) (*clusterNode, error) {
	var err error
	for range 3 {
		var port int
		if port, err = freePort(); err != nil {
			return nil, err
		}
		dir := filepath.Join(c.dir, fmt.Sprintf("sentinel-%d", i))
		if err := freshDir(dir); err != nil {
			return nil, err
		}
		// Sentinel rewrites its configuration file.
		conf := filepath.Join(dir, "sentinel.conf")
		text := fmt.Sprintf("sentinel monitor %[1]s 127.0.0.1 %[2]d 2\n"+
			"sentinel down-after-milliseconds %[1]s %[3]d\n"+
			"sentinel failover-timeout %[1]s %[4]d\n"+
			"sentinel parallel-syncs %[1]s 1\n",
			redisMaster, portOf(c.primary.addr), redisDownAfter.Milliseconds(), redisFailoverTimeout.Milliseconds())
		if err := os.WriteFile(conf, []byte(text), 0o600); err != nil {
			return nil, err
		}
		var s *clusterNode
		if s, err = c.start(ctx, fmt.Sprintf("sentinel-%d", i), port, conf, "--sentinel", "--port", strconv.Itoa(port), "--bind", "127.0.0.1",
			"--dir", dir, "--daemonize", "no", "--logfile", "", "--protected-mode", "no"); err == nil {
			return s, nil
		}
	}
	return nil, err
}

// newLink replaces the replication link with a new proxy to primary (a new
// one rather than the old one's toxic removed: a proxy's stop can wedge on
// a link to a dead server).
func (c *redisCluster) newLink(primary string) error {
	c.mu.Lock()
	old := c.link
	c.links++
	p := toxiproxy.NewProxy(c.linkSrv, fmt.Sprintf("link%d", c.links), "127.0.0.1:0", primary)
	c.mu.Unlock()
	if err := p.Start(); err != nil {
		return fmt.Errorf("start the replication link: %w", err)
	}
	c.mu.Lock()
	c.link = p
	c.mu.Unlock()
	if old != nil {
		stopBounded(old)
	}
	return nil
}

// stopBounded stops a proxy, waiting at most stopBound.
func stopBounded(p *toxiproxy.Proxy) {
	done := make(chan struct{})
	go func() { p.Stop(); close(done) }()
	select {
	case <-done:
	case <-time.After(stopBound):
	}
}

// awaitReplica waits until replica streams from primary.
func (c *redisCluster) awaitReplica(ctx context.Context, primary, replica *clusterNode) error {
	rc := redis.NewClient(&redis.Options{Addr: replica.addr, MaxRetries: -1})
	defer rc.Close()
	pc := redis.NewClient(&redis.Options{Addr: primary.addr, MaxRetries: -1})
	defer pc.Close()
	return pollUntil(ctx, 60*time.Second, nil, func(ctx context.Context) error {
		info, err := rc.Info(ctx, "replication").Result()
		if err != nil {
			return err
		}
		if !strings.Contains(info, "master_link_status:up") {
			return fmt.Errorf("replica %s: link not up", replica.addr)
		}
		info, err = pc.Info(ctx, "replication").Result()
		if err != nil {
			return err
		}
		if !strings.Contains(info, "state=online") {
			return fmt.Errorf("primary %s: no replica online", primary.addr)
		}
		return nil
	})
}

// eachSentinel calls f with a client of each Sentinel in turn, until one
// returns an error.
func (c *redisCluster) eachSentinel(f func(s *clusterNode, sc *redis.SentinelClient) error) error {
	for _, s := range c.sentinels {
		sc := redis.NewSentinelClient(&redis.Options{Addr: s.addr, MaxRetries: -1, DialTimeout: time.Second,
			ReadTimeout: time.Second})
		err := f(s, sc)
		sc.Close()
		if err != nil {
			return err
		}
	}
	return nil
}

// Failover implements Cluster: the link discards the primary's stream for
// redisLag, the primary dies, Sentinel promotes the replica, the Front
// follows, and the killed node comes back, empty, as the new primary's
// replica (on its port, which the Sentinels know as a replica since the
// promotion).
func (c *redisCluster) Failover(ctx context.Context, log io.Writer) (killed, ready int64, err error) {
	c.mu.Lock()
	old, promoted, link := c.primary, c.replica, c.link
	c.mu.Unlock()
	if _, err := link.Toxics.AddToxicJson(strings.NewReader(
		`{"name":"lag","type":"timeout","stream":"downstream","attributes":{"timeout":0}}`)); err != nil {
		return 0, 0, fmt.Errorf("cut the replication link: %w", err)
	}
	if !sleepCtx(ctx, redisLag) {
		return 0, 0, ctx.Err()
	}
	killed = Mono()
	old.kill()
	stopBounded(link)
	// The Sentinels' answer: the promoted replica, serving as a primary.
	want := promoted.addr
	pc := redis.NewClient(&redis.Options{Addr: want, MaxRetries: -1})
	defer pc.Close()
	err = pollUntil(ctx, 60*time.Second, nil, func(ctx context.Context) error {
		var addrs []string
		err := c.eachSentinel(func(_ *clusterNode, sc *redis.SentinelClient) error {
			a, err := sc.GetMasterAddrByName(ctx, redisMaster).Result()
			if err == nil && len(a) == 2 {
				addrs = append(addrs, net.JoinHostPort(a[0], a[1]))
			}
			return err
		})
		if err != nil {
			return err
		}
		for _, a := range addrs {
			if a != want {
				return fmt.Errorf("the Sentinels report %v, not %s", addrs, want)
			}
		}
		role, err := pc.Do(ctx, "ROLE").Slice()
		if err != nil {
			return err
		}
		if len(role) == 0 || role[0] != "master" {
			return fmt.Errorf("%s is still a replica", want)
		}
		return nil
	})
	if err != nil {
		return killed, 0, fmt.Errorf("promotion: %w", err)
	}
	if err := c.front.Switch(want); err != nil {
		return killed, 0, err
	}
	ready = Mono()
	fmt.Fprintf(log, "   failover: %s promoted by Sentinel %s after the kill\n", want, time.Duration(ready-killed).Round(time.Millisecond))
	// A replica again: the killed node, empty, through a new link.
	if err := c.newLink(want); err != nil {
		return killed, ready, err
	}
	c.mu.Lock()
	c.primary, c.replica = promoted, nil
	c.mu.Unlock()
	replica, err := c.startNode(ctx, c.link.Listen, portOf(old.addr))
	if err != nil {
		return killed, ready, fmt.Errorf("restart %s as a replica: %w", old.addr, err)
	}
	c.mu.Lock()
	c.replica = replica
	c.mu.Unlock()
	if err := c.awaitReplica(ctx, promoted, replica); err != nil {
		return killed, ready, err
	}
	// Sentinel must see it streaming before the next failover can pick it.
	err = pollUntil(ctx, 60*time.Second, nil, func(ctx context.Context) error {
		return c.eachSentinel(func(s *clusterNode, sc *redis.SentinelClient) error {
			rs, err := sc.Replicas(ctx, redisMaster).Result()
			if err != nil {
				return err
			}
			ok := false
			for _, r := range rs {
				// Up, streaming, and answering Sentinel's pings now (its
				// link to the killed node may still wait for a reply).
				ok = ok || (r["port"] == strconv.Itoa(portOf(replica.addr)) && r["master-link-status"] == "ok" &&
					r["flags"] == "slave" && r["last-ping-sent"] == "0")
			}
			if !ok {
				return fmt.Errorf("sentinel %s does not see %s streaming", s.addr, replica.addr)
			}
			return nil
		})
	})
	if err != nil {
		return killed, ready, err
	}
	fmt.Fprintf(log, "   failover: %s streams from %s, %s after the kill\n", replica.addr, want, time.Duration(Mono()-killed).Round(time.Millisecond))
	return killed, ready, nil
}

// Close implements Cluster.
func (c *redisCluster) Close() error {
	var errs []error
	c.mu.Lock()
	defer c.mu.Unlock()
	for _, n := range append(c.sentinels, c.primary, c.replica) {
		if n != nil {
			n.kill()
		}
	}
	if c.front != nil {
		c.front.Close()
	}
	if c.link != nil {
		stopBounded(c.link)
	}
	// The data; the logs stay.
	ents, err := os.ReadDir(c.dir)
	for _, e := range ents {
		if e.Name() != "logs" {
			errs = append(errs, os.RemoveAll(filepath.Join(c.dir, e.Name())))
		}
	}
	return errors.Join(append(errs, err)...)
}

// freshDir makes dir an empty directory.
func freshDir(dir string) error {
	if err := os.RemoveAll(dir); err != nil {
		return err
	}
	return os.MkdirAll(dir, 0o755)
}
