package torture

import (
	"context"
	"fmt"
	"io"
	"net"
	"slices"
	"strings"
	"sync"

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
	"mariadb-async":    startMariaAsync,
	"mariadb-semisync": startMariaSemiSync,
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
// dir. Close stops it.
func StartCluster(ctx context.Context, kind, dir string, log io.Writer) (Cluster, error) {
	start, ok := clusterKinds[kind]
	if !ok {
		return nil, fmt.Errorf("unknown cluster %q (have %s)", kind, strings.Join(ClusterKinds(), ","))
	}
	return start(ctx, dir, log)
}
