package torture

import (
	"context"
	"errors"
	"fmt"
	"io"
	"slices"
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
	// cut: the clients spread over the nodes (Spread), and a failover cuts
	// the leader off from the others for pauseFor (cutMember), its clients
	// still on it; peers are each node's peer ports, and each node runs as
	// cutCred of cutID (the cluster's first port) and its index.
	cut   bool
	cutID int
	peers [][]int
	cuts  []*memberCut // cuts in force (healed by Failover and Close)
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
	if !c.pause && !c.cut {
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
	if c.cut {
		return c.cutLeader(ctx, old, log)
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

// pauseLeader stops old, the leader (SIGSTOP), and cutLeader cuts it off
// from the others (cutMember), its clients still on it; see holdLeader.
func (c *quorumCluster) pauseLeader(ctx context.Context, old *clusterNode, log io.Writer) (killed, ready int64, err error) {
	return c.holdLeader(ctx, old, log, "paused",
		func() error { return old.signal(syscall.SIGSTOP) },
		func() error { return old.signal(syscall.SIGCONT) })
}

func (c *quorumCluster) cutLeader(ctx context.Context, old *clusterNode, log io.Writer) (killed, ready int64, err error) {
	i := slices.Index(c.nodes, old)
	return c.holdLeader(ctx, old, log, "cut off from the others, its clients still on it",
		func() error {
			cut, err := cutMember(c.cutID, i, portOf(old.addr), c.peers[i])
			if err == nil {
				c.cuts = append(c.cuts, cut)
			}
			return err
		}, c.heal)
}

// holdLeader faults old, the leader, with start until the others elect a
// leader and pauseFor has passed, then ends the fault (end, which may run
// twice) and waits until old serves again. killed and ready are the
// fault's start and the new leader's election.
func (c *quorumCluster) holdLeader(ctx context.Context, old *clusterNode, log io.Writer, what string, start, end func() error) (killed, ready int64, err error) {
	if err := start(); err != nil {
		return 0, 0, err
	}
	killed = Mono()
	defer func() {
		if eerr := end(); eerr != nil && err == nil {
			err = eerr
		}
	}()
	lead, err := c.awaitLeader(ctx, old)
	if err != nil {
		return killed, 0, err
	}
	ready = Mono()
	fmt.Fprintf(log, "   failover: %s %s; %s leads\n", old.name, what, lead.name)
	sleepCtx(ctx, time.Duration(killed+int64(pauseFor)-Mono()))
	if err := end(); err != nil {
		return killed, ready, err
	}
	return killed, ready, old.waitReady(ctx, 30*time.Second)
}

// heal removes the cuts in force.
func (c *quorumCluster) heal() error {
	var errs []error
	for _, cut := range c.cuts {
		errs = append(errs, cut.heal())
	}
	c.cuts = nil
	return errors.Join(errs...)
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
	return c.heal()
}
