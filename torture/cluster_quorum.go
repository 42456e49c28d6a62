package torture

import (
	"context"
	"fmt"
	"io"
	"time"
)

// quorumCluster is a consensus store's ensemble (etcd, ZooKeeper) whose
// Front follows the leader: every failover kills the node the clients are
// connected to, and the others must elect a leader and serve every
// acknowledged write. The killed node restarts with its data and rejoins.
type quorumCluster struct {
	front *Front
	nodes []*clusterNode
	// leader returns the node that leads, asking the nodes but skip.
	leader func(ctx context.Context, skip *clusterNode) (*clusterNode, error)
	// configure points cfg at addr and names the strategies.
	configure func(cfg *Config, addr string) []string
	// rejoin, if set, prepares a killed node's restart.
	rejoin func(n *clusterNode)
}

// start starts every node, waits until each is ready within d, and puts
// the Front before the leader.
func (c *quorumCluster) start(ctx context.Context, d time.Duration) (Cluster, error) {
	for _, n := range c.nodes {
		if err := n.start(); err != nil {
			c.Close()
			return nil, err
		}
	}
	for _, n := range c.nodes {
		if err := n.waitReady(ctx, d); err != nil {
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

func (c *quorumCluster) Configure(cfg *Config) []string { return c.configure(cfg, c.front.Addr()) }

// Failover kills the leader, which the Front forwards to, points the Front
// at the leader the others elect once it serves, and restarts the killed
// node with its data.
func (c *quorumCluster) Failover(ctx context.Context, log io.Writer) (killed, ready int64, err error) {
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
	if c.rejoin != nil {
		c.rejoin(old)
	}
	return killed, ready, old.restart(ctx)
}

func (c *quorumCluster) Close() error {
	if c.front != nil {
		c.front.Close()
	}
	for _, n := range c.nodes {
		n.kill()
	}
	return nil
}
