package torture

import (
	"context"
	"errors"
	"fmt"
	"io"
	"os"
	"os/exec"
	"path/filepath"
	"slices"
	"strconv"
	"strings"
	"time"
)

// etcdCluster is three etcd members on loopback (50 ms heartbeat, 500 ms
// election timeout, as the harness's single etcd). Its Front follows the
// leader: every failover kills the member the clients are connected to,
// and a new leader must be elected before they are served again. The
// killed member restarts with its data and rejoins as a follower.
type etcdCluster struct {
	front   *Front
	members []*clusterNode
}

func startEtcdCluster(ctx context.Context, dir string, _ io.Writer) (Cluster, error) {
	if _, err := exec.LookPath("etcd"); err != nil {
		return nil, fmt.Errorf("%w: etcd (Debian: etcd-server): %v", ErrNoServer, err)
	}
	if err := os.MkdirAll(dir, 0o755); err != nil {
		return nil, err
	}
	c := &etcdCluster{}
	var initial, peers []string
	for i := range 3 {
		client, err := freePort()
		if err != nil {
			return nil, err
		}
		peer, err := freePort()
		if err != nil {
			return nil, err
		}
		addr := "127.0.0.1:" + strconv.Itoa(client)
		c.members = append(c.members, &clusterNode{name: fmt.Sprintf("etcd%d", i), addr: addr, bin: "etcd",
			logFile: filepath.Join(dir, fmt.Sprintf("etcd%d.log", i)), ready: etcdReady(addr)})
		peers = append(peers, "http://127.0.0.1:"+strconv.Itoa(peer))
		initial = append(initial, fmt.Sprintf("etcd%d=%s", i, peers[i]))
	}
	for i, m := range c.members {
		cu := "http://" + m.addr
		m.args = []string{"--name", m.name, "--data-dir", filepath.Join(dir, m.name),
			"--listen-client-urls", cu, "--advertise-client-urls", cu,
			"--listen-peer-urls", peers[i], "--initial-advertise-peer-urls", peers[i],
			"--initial-cluster", strings.Join(initial, ","), "--initial-cluster-state", "new",
			"--initial-cluster-token", "torture-" + strconv.Itoa(os.Getpid()),
			"--heartbeat-interval", "50", "--election-timeout", "500", "--log-level", "warn"}
		if err := m.start(); err != nil {
			c.Close()
			return nil, err
		}
	}
	for _, m := range c.members {
		if err := m.waitReady(ctx, 30*time.Second); err != nil {
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

func (c *etcdCluster) Configure(cfg *Config) []string {
	cfg.EtcdAddr = c.front.Addr()
	return []string{"etcd-lease"}
}

// leader returns the member that leads, as the members other than skip
// report it.
func (c *etcdCluster) leader(ctx context.Context, skip *clusterNode) (*clusterNode, error) {
	var live []*clusterNode
	for _, m := range c.members {
		if m != skip {
			live = append(live, m)
		}
	}
	cli, err := etcdClient(live[0].addr)
	if err != nil {
		return nil, err
	}
	defer cli.Close()
	ids := map[uint64]*clusterNode{}
	var leaders []uint64
	for _, m := range live {
		sctx, cancel := context.WithTimeout(ctx, time.Second)
		st, err := cli.Status(sctx, m.addr)
		cancel()
		if err == nil {
			ids[st.Header.MemberId] = m
			leaders = append(leaders, st.Leader)
		}
	}
	for _, id := range leaders {
		if m := ids[id]; m != nil {
			return m, nil
		}
	}
	return nil, errors.New("etcd: no member leads")
}

// Failover kills the leader, which the Front forwards to, points the Front
// at the leader the other two elect once it serves, and restarts the
// killed member with its data.
func (c *etcdCluster) Failover(ctx context.Context, log io.Writer) (killed, ready int64, err error) {
	old, err := c.leader(ctx, nil)
	if err != nil {
		return 0, 0, err
	}
	old.kill()
	killed = Mono()
	var lead *clusterNode
	for {
		if lead, err = c.leader(ctx, old); err == nil {
			if err = lead.ready(ctx); err == nil {
				break
			}
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
	if !slices.Contains(old.args, "existing") {
		old.args = append(old.args, "--initial-cluster-state", "existing")
	}
	return killed, ready, old.restart(ctx)
}

func (c *etcdCluster) Close() error {
	if c.front != nil {
		c.front.Close()
	}
	for _, m := range c.members {
		m.kill()
	}
	return nil
}
