package torture

import (
	"context"
	"fmt"
	"io"
	"syscall"
	"time"
)

// quorumCluster is a consensus store's ensemble (etcd, ZooKeeper). Its
// Front follows the leader: every failover kills the node the clients are
// connected to, and the others must elect a leader and serve every
// acknowledged write; the killed node restarts with its data and rejoins.
// With pause, the clients spread over the nodes instead (Spread), and a
// failover stops the leader with SIGSTOP for pauseFor, as a long GC pause
// or a partition would: the others elect a leader and serve their clients
// while the old leader's clients wait, and the old leader, resumed, must
// learn that it was replaced before it serves anything.
type quorumCluster struct {
	front *Front
	nodes []*clusterNode
	pause bool
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

// Upstreams is every node when the clients spread over them (pause), else
// the Front.
func (c *quorumCluster) Upstreams() []string {
	if !c.pause {
		return []string{c.front.Addr()}
	}
	var ups []string
	for _, n := range c.nodes {
		ups = append(ups, n.addr)
	}
	return ups
}

// pauseFor is how long a paused leader stays stopped: several election
// timeouts of both stores, and more than a 1 s lease.
const pauseFor = 3 * time.Second

// Failover kills the leader, which the Front forwards to, points the Front
// at the leader the others elect once it serves, and restarts the killed
// node with its data.
func (c *quorumCluster) Failover(ctx context.Context, log io.Writer) (killed, ready int64, err error) {
	old, err := c.leader(ctx, nil)
	if err != nil {
		return 0, 0, err
	}
	if c.pause {
		return c.pauseLeader(ctx, old, log)
	}
	old.kill()
	killed = Mono()
	lead, err := c.awaitLeader(ctx, old)
	if err != nil {
		return killed, 0, err
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

// pauseLeader stops old, the leader, until the others elect a leader
// and pauseFor has passed, then resumes it and waits until it serves
// again. killed and ready are the stop and the new leader's election.
func (c *quorumCluster) pauseLeader(ctx context.Context, old *clusterNode, log io.Writer) (killed, ready int64, err error) {
	if err := old.signal(syscall.SIGSTOP); err != nil {
		return 0, 0, err
	}
	killed = Mono()
	defer func() {
		if cerr := old.signal(syscall.SIGCONT); cerr != nil && err == nil {
			err = cerr
		}
	}()
	lead, err := c.awaitLeader(ctx, old)
	if err != nil {
		return killed, 0, err
	}
	ready = Mono()
	fmt.Fprintf(log, "   failover: %s paused, %s leads\n", old.name, lead.name)
	sleepCtx(ctx, time.Duration(killed+int64(pauseFor)-Mono()))
	if err := old.signal(syscall.SIGCONT); err != nil {
		return killed, ready, err
	}
	return killed, ready, old.waitReady(ctx, 30*time.Second)
}

// awaitLeader waits until the nodes other than old elect a leader that
// serves, and returns it.
func (c *quorumCluster) awaitLeader(ctx context.Context, old *clusterNode) (*clusterNode, error) {
	for {
		lead, err := c.leader(ctx, old)
		if err == nil {
			if err = lead.ready(ctx); err == nil {
				return lead, nil
			}
		}
		if ctx.Err() != nil {
			return nil, fmt.Errorf("no new leader: %w", err)
		}
		time.Sleep(20 * time.Millisecond)
	}
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
