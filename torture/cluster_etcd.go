package torture

import (
	"context"
	"errors"
	"fmt"
	"io"
	"net/http"
	"os"
	"os/exec"
	"path/filepath"
	"strconv"
	"strings"
	"syscall"
	"time"
)

// etcdCluster is three etcd members on loopback (50 ms heartbeat, 500 ms
// election timeout, as the harness's single etcd). Its Front follows the
// leader: every failover kills the member the clients are connected to,
// and a new leader must be elected before they are served again. The
// killed member restarts with its data and rejoins as a follower.
type etcdCluster struct {
	front   *Front
	members []*etcdMember
}

type etcdMember struct {
	name         string
	client, peer int
	dir, logFile string
	args         []string
	cmd          *exec.Cmd
	done         chan struct{}
}

func (m *etcdMember) endpoint() string { return "127.0.0.1:" + strconv.Itoa(m.client) }

func (m *etcdMember) start() error {
	out, err := os.OpenFile(m.logFile, os.O_CREATE|os.O_WRONLY|os.O_APPEND, 0o644)
	if err != nil {
		return err
	}
	defer out.Close()
	cmd := exec.Command("etcd", m.args...)
	cmd.Stdout, cmd.Stderr = out, out
	cmd.SysProcAttr = &syscall.SysProcAttr{Pdeathsig: syscall.SIGKILL}
	if err := cmd.Start(); err != nil {
		return fmt.Errorf("etcd %s: %w", m.name, err)
	}
	m.cmd, m.done = cmd, make(chan struct{})
	go func() { _ = cmd.Wait(); close(m.done) }()
	return nil
}

// kill stops the member with SIGKILL and waits for it to exit.
func (m *etcdMember) kill() {
	if m.cmd == nil {
		return
	}
	_ = m.cmd.Process.Kill()
	select {
	case <-m.done:
	case <-time.After(10 * time.Second):
	}
}

// healthy reports whether the member answers its /health endpoint as
// healthy (it has a leader and serves a quorum read).
func (m *etcdMember) healthy(ctx context.Context) bool {
	ctx, cancel := context.WithTimeout(ctx, time.Second)
	defer cancel()
	req, _ := http.NewRequestWithContext(ctx, http.MethodGet, "http://"+m.endpoint()+"/health", nil)
	resp, err := http.DefaultClient.Do(req)
	if err != nil {
		return false
	}
	defer resp.Body.Close()
	body, _ := io.ReadAll(io.LimitReader(resp.Body, 256))
	return resp.StatusCode == http.StatusOK && strings.Contains(string(body), `"health":"true"`)
}

// waitHealthy waits until the member is healthy, it exits, or d passes.
func (m *etcdMember) waitHealthy(ctx context.Context, d time.Duration) error {
	ctx, cancel := context.WithTimeout(ctx, d)
	defer cancel()
	for !m.healthy(ctx) {
		select {
		case <-m.done:
			return fmt.Errorf("etcd %s exited (see %s)", m.name, m.logFile)
		case <-ctx.Done():
			return fmt.Errorf("etcd %s: not healthy: %w", m.name, ctx.Err())
		case <-time.After(50 * time.Millisecond):
		}
	}
	return nil
}

func startEtcdCluster(ctx context.Context, dir string, _ io.Writer) (Cluster, error) {
	if _, err := exec.LookPath("etcd"); err != nil {
		return nil, fmt.Errorf("%w: etcd (Debian: etcd-server): %v", ErrNoServer, err)
	}
	if err := os.MkdirAll(dir, 0o755); err != nil {
		return nil, err
	}
	c := &etcdCluster{}
	var initial []string
	for i := range 3 {
		m := &etcdMember{name: fmt.Sprintf("m%d", i), dir: filepath.Join(dir, fmt.Sprintf("etcd%d", i)),
			logFile: filepath.Join(dir, fmt.Sprintf("etcd%d.log", i))}
		var err error
		if m.client, err = freePort(); err != nil {
			return nil, err
		}
		if m.peer, err = freePort(); err != nil {
			return nil, err
		}
		c.members = append(c.members, m)
		initial = append(initial, fmt.Sprintf("%s=http://127.0.0.1:%d", m.name, m.peer))
	}
	for _, m := range c.members {
		cu, pu := "http://"+m.endpoint(), "http://127.0.0.1:"+strconv.Itoa(m.peer)
		m.args = []string{"--name", m.name, "--data-dir", m.dir,
			"--listen-client-urls", cu, "--advertise-client-urls", cu,
			"--listen-peer-urls", pu, "--initial-advertise-peer-urls", pu,
			"--initial-cluster", strings.Join(initial, ","), "--initial-cluster-state", "new",
			"--initial-cluster-token", "torture-" + strconv.Itoa(os.Getpid()),
			"--heartbeat-interval", "50", "--election-timeout", "500", "--log-level", "warn"}
		if err := m.start(); err != nil {
			c.Close()
			return nil, err
		}
	}
	for _, m := range c.members {
		if err := m.waitHealthy(ctx, 30*time.Second); err != nil {
			c.Close()
			return nil, err
		}
	}
	lead, err := c.leader(ctx, nil)
	if err == nil {
		c.front, err = NewFront(lead.endpoint())
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
func (c *etcdCluster) leader(ctx context.Context, skip *etcdMember) (*etcdMember, error) {
	var live []*etcdMember
	for _, m := range c.members {
		if m != skip {
			live = append(live, m)
		}
	}
	cli, err := etcdClient(live[0].endpoint())
	if err != nil {
		return nil, err
	}
	defer cli.Close()
	ids := map[uint64]*etcdMember{}
	var leaders []uint64
	for _, m := range live {
		sctx, cancel := context.WithTimeout(ctx, time.Second)
		st, err := cli.Status(sctx, m.endpoint())
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
// at the leader the other two elect, and restarts the killed member with
// its data once they serve.
func (c *etcdCluster) Failover(ctx context.Context, log io.Writer) (killed, ready int64, err error) {
	old, err := c.leader(ctx, nil)
	if err != nil {
		return 0, 0, err
	}
	old.kill()
	killed = Mono()
	var lead *etcdMember
	for {
		if lead, err = c.leader(ctx, old); err == nil && lead.healthy(ctx) {
			break
		}
		if ctx.Err() != nil {
			return killed, 0, fmt.Errorf("no new leader: %w", err)
		}
		time.Sleep(20 * time.Millisecond)
	}
	if err := c.front.Switch(lead.endpoint()); err != nil {
		return killed, 0, err
	}
	ready = Mono()
	fmt.Fprintf(log, "   failover: etcd %s leads\n", lead.name)
	old.args = append(old.args[:len(old.args):len(old.args)], "--initial-cluster-state", "existing")
	for range 50 { // the killed member's sockets may linger for a moment
		if err = old.start(); err == nil {
			if err = old.waitHealthy(ctx, 30*time.Second); err == nil {
				return killed, ready, nil
			}
			old.kill()
		}
		if ctx.Err() != nil {
			break
		}
		time.Sleep(100 * time.Millisecond)
	}
	return killed, ready, fmt.Errorf("restart etcd %s: %w", old.name, err)
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
