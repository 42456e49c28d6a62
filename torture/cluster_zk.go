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

// startZKCluster starts a ZooKeeper ensemble of three on loopback (the test
// server's 200 ms tick) for zk-lease. Sessions must survive the leader's
// death: the clients reconnect, through the Front, to the new leader.
func startZKCluster(ctx context.Context, dir string, _ io.Writer) (Cluster, error) {
	return newZKCluster(ctx, dir, false, false)
}

// startZKPause is startZKCluster whose failovers pause the leader
// (quorumCluster.pause).
func startZKPause(ctx context.Context, dir string, _ io.Writer) (Cluster, error) {
	return newZKCluster(ctx, dir, true, false)
}

// startZKCut is startZKCluster whose failovers cut the leader off from the
// others (quorumCluster.cut).
func startZKCut(ctx context.Context, dir string, _ io.Writer) (Cluster, error) {
	return newZKCluster(ctx, dir, false, true)
}

func newZKCluster(ctx context.Context, dir string, pause, cut bool) (Cluster, error) {
	java, cp, err := testproc.ZooKeeperCommand()
	if err != nil {
		return nil, fmt.Errorf("%w: ZooKeeper (Debian: zookeeper): %v", ErrNoServer, err)
	}
	if cut {
		if err := cutAvailable(); err != nil {
			return nil, err
		}
	}
	c := &quorumCluster{
		pause: pause, cut: cut,
		configure: func(cfg *Config, addr string) []string {
			cfg.ZKAddr, cfg.ZKDataDir = addr, ""
			return []string{"zk-lease"}
		},
	}
	c.leader = func(ctx context.Context, skip *clusterNode) (*clusterNode, error) {
		return zkLeader(ctx, c.nodes, skip)
	}
	var ensemble strings.Builder
	ports := make([]int, 9)
	for i := range ports {
		if ports[i], err = freePort(); err != nil {
			return nil, err
		}
	}
	c.cutID = ports[0]
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
		n := &clusterNode{name: fmt.Sprintf("zk%d", i), addr: addr, bin: java,
			args: testproc.ZooKeeperArgs(cp, conf), logFile: filepath.Join(dir, fmt.Sprintf("zk%d.log", i)), ready: zkReady(addr)}
		c.nodes = append(c.nodes, n)
		c.peers = append(c.peers, []int{ports[3*i+1], ports[3*i+2]})
		if cut {
			n.cred = cutCred(c.cutID, i)
			// No per-user JVM files in /tmp for a user without a name.
			n.args = append([]string{"-XX:-UsePerfData"}, n.args...)
			if err := chownTree(filepath.Join(dir, n.name), n.cred); err != nil {
				return nil, err
			}
		}
	}
	return c.start(ctx, 60*time.Second)
}

// zkLeader returns the server other than skip that reports itself leader.
func zkLeader(ctx context.Context, servers []*clusterNode, skip *clusterNode) (*clusterNode, error) {
	for _, s := range servers {
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
