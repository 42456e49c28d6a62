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

// startEtcdCluster starts three etcd members on loopback (50 ms heartbeat,
// 500 ms election timeout, as the harness's single etcd) for etcd-lease.
func startEtcdCluster(ctx context.Context, dir string, _ io.Writer) (Cluster, error) {
	return newEtcdCluster(ctx, dir, false, false)
}

// startEtcdPause is startEtcdCluster whose failovers pause the leader
// (quorumCluster.pause).
func startEtcdPause(ctx context.Context, dir string, _ io.Writer) (Cluster, error) {
	return newEtcdCluster(ctx, dir, true, false)
}

// startEtcdCut is startEtcdCluster whose failovers cut the leader off from
// the others (quorumCluster.cut).
func startEtcdCut(ctx context.Context, dir string, _ io.Writer) (Cluster, error) {
	return newEtcdCluster(ctx, dir, false, true)
}

func newEtcdCluster(ctx context.Context, dir string, pause, cut bool) (Cluster, error) {
	if _, err := exec.LookPath("etcd"); err != nil {
		return nil, fmt.Errorf("%w: etcd (Debian: etcd-server): %v", ErrNoServer, err)
	}
	if cut {
		if err := cutAvailable(); err != nil {
			return nil, err
		}
	}
	if err := os.MkdirAll(dir, 0o755); err != nil {
		return nil, err
	}
	c := &quorumCluster{
		pause: pause, cut: cut,
		configure: func(cfg *Config, addr string) []string {
			cfg.EtcdAddr = addr
			return []string{"etcd-lease"}
		},
		rejoin: func(n *clusterNode) {
			if !slices.Contains(n.args, "existing") {
				n.args = append(n.args, "--initial-cluster-state", "existing")
			}
		},
	}
	c.leader = func(ctx context.Context, skip *clusterNode) (*clusterNode, error) {
		return etcdLeader(ctx, c.nodes, skip)
	}
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
		c.nodes = append(c.nodes, &clusterNode{name: fmt.Sprintf("etcd%d", i), addr: addr, bin: "etcd",
			logFile: filepath.Join(dir, fmt.Sprintf("etcd%d.log", i)), ready: etcdReady(addr)})
		peers = append(peers, "http://127.0.0.1:"+strconv.Itoa(peer))
		initial = append(initial, fmt.Sprintf("etcd%d=%s", i, peers[i]))
		c.peers = append(c.peers, []int{peer})
		if cut {
			if i == 0 {
				c.cutID = client
			}
			n := c.nodes[i]
			n.cred = cutCred(c.cutID, i)
			data := filepath.Join(dir, n.name)
			if err := os.Mkdir(data, 0o700); err != nil {
				return nil, err
			}
			if err := chownTree(data, n.cred); err != nil {
				return nil, err
			}
		}
	}
	for i, n := range c.nodes {
		cu := "http://" + n.addr
		n.args = []string{"--name", n.name, "--data-dir", filepath.Join(dir, n.name),
			"--listen-client-urls", cu, "--advertise-client-urls", cu,
			"--listen-peer-urls", peers[i], "--initial-advertise-peer-urls", peers[i],
			"--initial-cluster", strings.Join(initial, ","), "--initial-cluster-state", "new",
			"--initial-cluster-token", "torture-" + strconv.Itoa(os.Getpid()),
			"--heartbeat-interval", "50", "--election-timeout", "500", "--log-level", "warn"}
	}
	return c.start(ctx, 30*time.Second)
}

// etcdLeader returns the member that leads, as the members other than skip
// report it.
func etcdLeader(ctx context.Context, members []*clusterNode, skip *clusterNode) (*clusterNode, error) {
	var live []*clusterNode
	for _, m := range members {
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
