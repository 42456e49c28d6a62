package torture

import (
	"context"
	"errors"
	"fmt"
	"io"
	"os"
	"path/filepath"
	"strconv"
	"strings"
	"time"

	"github.com/dlock-dev/dlock/internal/testproc"
)

// zkCluster is a ZooKeeper ensemble of three on loopback (the test
// server's 200 ms tick). Its Front follows the leader: every failover kills
// the server the clients are connected to; their sessions must survive on
// the server the other two elect. The killed server restarts with its data
// and rejoins as a follower.
type zkCluster struct {
	front   *Front
	servers []*clusterNode
}

func startZKCluster(ctx context.Context, dir string, _ io.Writer) (Cluster, error) {
	java, cp, err := testproc.ZooKeeperCommand()
	if err != nil {
		return nil, fmt.Errorf("%w: ZooKeeper (Debian: zookeeper): %v", ErrNoServer, err)
	}
	c := &zkCluster{}
	var ensemble strings.Builder
	ports := make([]int, 9)
	for i := range ports {
		if ports[i], err = freePort(); err != nil {
			return nil, err
		}
	}
	for i := range 3 {
		fmt.Fprintf(&ensemble, "server.%d=127.0.0.1:%d:%d\n", i+1, ports[3*i+1], ports[3*i+2])
	}
	for i := range 3 {
		data := filepath.Join(dir, fmt.Sprintf("zk%d", i), "data")
		if err := os.MkdirAll(data, 0o755); err != nil {
			return nil, err
		}
		if err := os.WriteFile(filepath.Join(data, "myid"), []byte(strconv.Itoa(i+1)), 0o644); err != nil {
			return nil, err
		}
		conf := filepath.Join(dir, fmt.Sprintf("zk%d", i), "zoo.cfg")
		if err := os.WriteFile(conf, []byte(testproc.ZooKeeperConfig(data, ports[3*i])+ensemble.String()), 0o644); err != nil {
			return nil, err
		}
		addr := "127.0.0.1:" + strconv.Itoa(ports[3*i])
		c.servers = append(c.servers, &clusterNode{name: fmt.Sprintf("zk%d", i), addr: addr, bin: java,
			args: testproc.ZooKeeperArgs(cp, conf), logFile: filepath.Join(dir, fmt.Sprintf("zk%d.log", i)), ready: zkReady(addr)})
	}
	for _, s := range c.servers {
		if err := s.start(); err != nil {
			c.Close()
			return nil, err
		}
	}
	for _, s := range c.servers {
		if err := s.waitReady(ctx, 60*time.Second); err != nil {
			c.Close()
			return nil, err
		}
	}
	lead, err := c.leader(ctx, nil)
	if err == nil {
		c.front, err = NewFront(lead.addr)
	}
	if err != nil {
		c.Close()
		return nil, err
	}
	return c, nil
}

func (c *zkCluster) Configure(cfg *Config) []string {
	cfg.ZKAddr, cfg.ZKDataDir = c.front.Addr(), ""
	return []string{"zk-lease"}
}

// leader returns the server other than skip that reports itself leader.
func (c *zkCluster) leader(ctx context.Context, skip *clusterNode) (*clusterNode, error) {
	for _, s := range c.servers {
		if s == skip {
			continue
		}
		out, err := roundTrip(ctx, s.addr, "srvr", "Mode: ")
		if err == nil && strings.Contains(out, "Mode: leader") {
			return s, nil
		}
	}
	return nil, errors.New("zookeeper: no server leads")
}

// Failover kills the leader, which the Front forwards to, points the Front
// at the leader the other two elect once it serves, and restarts the
// killed server with its data.
func (c *zkCluster) Failover(ctx context.Context, log io.Writer) (killed, ready int64, err error) {
	old, err := c.leader(ctx, nil)
	if err != nil {
		return 0, 0, err
	}
	old.kill()
	killed = Mono()
	var lead *clusterNode
	for {
		if lead, err = c.leader(ctx, old); err == nil {
			break
		}
		if ctx.Err() != nil {
			return killed, 0, fmt.Errorf("no new leader: %w", err)
		}
		time.Sleep(20 * time.Millisecond)
	}
	if err := c.front.Switch(lead.addr); err != nil {
		return killed, 0, err
	}
	ready = Mono()
	fmt.Fprintf(log, "   failover: %s leads\n", lead.name)
	return killed, ready, old.restart(ctx)
}

func (c *zkCluster) Close() error {
	if c.front != nil {
		c.front.Close()
	}
	for _, s := range c.servers {
		s.kill()
	}
	return nil
}
