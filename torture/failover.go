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
	"slices"
	"strconv"
	"strings"
	"sync"
	"syscall"
	"time"

	toxiproxy "github.com/Shopify/toxiproxy/v2"
	"github.com/rs/zerolog"
)

// FaultFailover is the failover fault: the replicated store's primary dies
// and a replica takes its place (Config.Failover).
const FaultFailover = "failover"

// A Cluster is a replicated store that the failover fault fails over: a
// primary, at least one replica, and a Front through which every client
// reaches whichever node is the primary, as a virtual IP or a proxy does in
// front of a replicated database.
type Cluster interface {
	// Configure points cfg's DSN or address for the cluster's store at
	// the Front, and returns the strategies that run on it.
	Configure(cfg *Config) []string
	// Failover kills the primary with SIGKILL, promotes a replica, points
	// the Front at it (which drops every connection to the old primary)
	// and returns the Mono() instants of the kill and of the new primary
	// serving. It then gives the new primary a replica again, so that the
	// next failover has one to promote; the configuration (synchronous or
	// not) is the cluster's throughout.
	Failover(ctx context.Context, log io.Writer) (killed, ready int64, err error)
	// Close stops every node and removes their data.
	Close() error
}

// A Spread is a Cluster whose clients spread over several nodes, each
// behind a Front of its own: worker slot i connects to Upstreams()[i % len].
// A Cluster without it has every slot on the one Front Configure names.
type Spread interface {
	Upstreams() []string
}

// Front is a TCP forwarder with a fixed address whose upstream a failover
// switches.
type Front struct {
	srv *toxiproxy.ApiServer
	mu  sync.Mutex
	p   *toxiproxy.Proxy
}

// NewFront listens on a free loopback port and forwards to upstream.
func NewFront(upstream string) (*Front, error) {
	f := &Front{srv: toxiproxy.NewServer(toxiproxy.NewMetricsContainer(nil), zerolog.Nop())}
	f.p = toxiproxy.NewProxy(f.srv, "front", "127.0.0.1:0", upstream)
	if err := f.p.Start(); err != nil {
		return nil, fmt.Errorf("start the front: %w", err)
	}
	return f, nil
}

// Addr is the address clients connect to.
func (f *Front) Addr() string {
	f.mu.Lock()
	defer f.mu.Unlock()
	return f.p.Listen
}

// Upstream is the node the Front forwards to.
func (f *Front) Upstream() string {
	f.mu.Lock()
	defer f.mu.Unlock()
	return f.p.Upstream
}

// Switch closes every connection through the Front and forwards the next
// ones to upstream.
func (f *Front) Switch(upstream string) error {
	f.mu.Lock()
	defer f.mu.Unlock()
	f.p.Stop()
	f.p.Upstream = upstream
	return f.p.Start()
}

// Close stops forwarding.
func (f *Front) Close() {
	f.mu.Lock()
	defer f.mu.Unlock()
	f.p.Stop()
}

// portOf returns the port of a host:port address (0 if it has none).
func portOf(addr string) int {
	_, p, _ := net.SplitHostPort(addr)
	n, _ := strconv.Atoi(p)
	return n
}

// freePort returns a TCP port free on loopback now.
func freePort() (int, error) {
	ln, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		return 0, err
	}
	defer ln.Close()
	return ln.Addr().(*net.TCPAddr).Port, nil
}

// clusterKinds are the replicated stores the failover fault runs on, by
// name; each starts its nodes under dir, on loopback ports of its own.
var clusterKinds = map[string]func(ctx context.Context, dir string, log io.Writer) (Cluster, error){
	"etcd-3":            startEtcdCluster,
	"etcd-3-pause":      startEtcdPause,
	"etcd-3-cut":        startEtcdCut,
	"galera-3":          startGaleraCluster,
	"galera-3-isolate":  startGaleraIsolate,
	"pg-async":          startPGAsync,
	"pg-sync":           startPGSync,
	"redis-async":       startRedisAsync,
	"redis-minreplicas": startRedisMinReplicas,
	"zk-3":              startZKCluster,
	"zk-3-pause":        startZKPause,
	"zk-3-cut":          startZKCut,
	"mariadb-async":     startMariaAsync,
	"mariadb-semisync":  startMariaSemiSync,
}

// ClusterKinds names the clusters StartCluster starts.
func ClusterKinds() []string {
	var ks []string
	for k := range clusterKinds {
		ks = append(ks, k)
	}
	slices.Sort(ks)
	return ks
}

// StartCluster starts a cluster of the kind named, its nodes' data under
// dir. Close stops it. A start that fails (a port taken between freePort
// and the server's bind, by anyone) is tried again with new ports, twice,
// in a directory of its own; a missing program (ErrNoServer) is not.
func StartCluster(ctx context.Context, kind, dir string, log io.Writer) (Cluster, error) {
	start, ok := clusterKinds[kind]
	if !ok {
		return nil, fmt.Errorf("unknown cluster %q (have %s)", kind, strings.Join(ClusterKinds(), ","))
	}
	dir, err := filepath.Abs(dir) // the nodes may run in another directory
	if err != nil {
		return nil, err
	}
	var errs []error
	for try := range 3 {
		d := dir
		if try > 0 {
			d = filepath.Join(dir, fmt.Sprintf("try%d", try))
		}
		c, err := start(ctx, d, log)
		if err == nil {
			return c, nil
		}
		errs = append(errs, err)
		if errors.Is(err, ErrNoServer) || ctx.Err() != nil {
			break
		}
		fmt.Fprintf(log, "   cluster %s did not start, trying again: %v\n", kind, err)
	}
	return nil, fmt.Errorf("start %s: %w", kind, errors.Join(errs...))
}

// clusterNode is one server process of a Cluster, started by the harness
// (killed with it: Pdeathsig), its output in logFile.
type clusterNode struct {
	name, addr, logFile string
	bin                 string
	args                []string
	ready               func(ctx context.Context) error
	// cred runs the process as another user (nil: as the harness's).
	cred *syscall.Credential
	// group runs the process in a process group of its own, which kill
	// kills whole (a server that forks workers, as PostgreSQL does).
	group bool
	cmd   *exec.Cmd
	done  chan struct{}
}

// start runs the node's process; it does not wait for it to serve.
func (n *clusterNode) start() error {
	out, err := os.OpenFile(n.logFile, os.O_CREATE|os.O_WRONLY|os.O_APPEND, 0o644)
	if err != nil {
		return err
	}
	defer out.Close()
	cmd := exec.Command(n.bin, n.args...)
	cmd.Stdout, cmd.Stderr = out, out
	if n.cred != nil {
		cmd.Dir = "/" // reachable by every user
	}
	cmd.SysProcAttr = &syscall.SysProcAttr{Pdeathsig: syscall.SIGKILL, Credential: n.cred, Setpgid: n.group}
	if err := cmd.Start(); err != nil {
		return fmt.Errorf("%s: %w", n.name, err)
	}
	n.cmd, n.done = cmd, make(chan struct{})
	go func() { _ = cmd.Wait(); close(n.done) }()
	return nil
}

// kill stops the node with SIGKILL (its process group with group) and
// waits (bounded) until it has exited.
func (n *clusterNode) kill() error {
	if n.cmd == nil || n.cmd.Process == nil {
		return nil
	}
	pid := n.cmd.Process.Pid
	if n.group {
		_ = syscall.Kill(-pid, syscall.SIGKILL)
	} else {
		_ = n.cmd.Process.Kill()
	}
	deadline := time.After(30 * time.Second)
	select {
	case <-n.done:
	case <-deadline:
		return fmt.Errorf("%s did not exit after SIGKILL", n.name)
	}
	for n.group && syscall.Kill(-pid, 0) == nil {
		select {
		case <-deadline:
			return fmt.Errorf("processes of %s did not exit after SIGKILL", n.name)
		case <-time.After(5 * time.Millisecond):
		}
	}
	return nil
}

// signal sends sig to the node's process.
func (n *clusterNode) signal(sig syscall.Signal) error {
	if n.cmd == nil {
		return fmt.Errorf("%s: not started", n.name)
	}
	return n.cmd.Process.Signal(sig)
}

// waitReady waits until the node is ready, it exits, or d passes.
func (n *clusterNode) waitReady(ctx context.Context, d time.Duration) error {
	if err := pollUntil(ctx, d, n.done, n.ready); err != nil {
		return fmt.Errorf("%s: not ready: %w (see %s)", n.name, err, n.logFile)
	}
	return nil
}

// pollUntil calls check (each call bounded to 2 s) every 50 ms until it
// returns nil, it returns an error marked final, exited closes (a nil
// channel never does), ctx ends or d passes; it returns check's last error.
func pollUntil(ctx context.Context, d time.Duration, exited <-chan struct{}, check func(context.Context) error) error {
	ctx, cancel := context.WithTimeout(ctx, d)
	defer cancel()
	for {
		cctx, ccancel := context.WithTimeout(ctx, 2*time.Second)
		err := check(cctx)
		ccancel()
		var f finalError
		switch {
		case err == nil:
			return nil
		case errors.As(err, &f):
			return f.err
		}
		select {
		case <-exited:
			return fmt.Errorf("the process exited: %w", err)
		case <-ctx.Done():
			return fmt.Errorf("not within %s: %w", d, err)
		case <-time.After(50 * time.Millisecond):
		}
	}
}

// finalError marks a check's error that waiting longer cannot mend
// (pollUntil returns it at once).
type finalError struct{ err error }

func (f finalError) Error() string { return f.err.Error() }

// restart starts the killed node again with its data and waits until it
// is ready; its old sockets may linger for a moment, so a failed start is
// tried again (bounded).
func (n *clusterNode) restart(ctx context.Context) error {
	var err error
	for range 50 {
		if err = n.start(); err == nil {
			if err = n.waitReady(ctx, 30*time.Second); err == nil {
				return nil
			}
			n.kill()
		}
		if ctx.Err() != nil {
			break
		}
		time.Sleep(100 * time.Millisecond)
	}
	return fmt.Errorf("restart %s: %w", n.name, err)
}
