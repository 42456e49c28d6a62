package testproc

import (
	"fmt"
	"path/filepath"
	"strconv"
	"strings"
)

// GaleraProvider is the Galera library of Debian's galera-4 package.
const GaleraProvider = "/usr/lib/galera/libgalera_smm.so"

// GaleraNode is one node of a MariaDB Galera cluster on loopback: its
// client port, group communication port, rsync state transfer port and
// incremental state transfer port.
type GaleraNode struct {
	Name                              string
	Dir                               string // holds the node's socket and pid file
	Port, GroupPort, SSTPort, ISTPort int
}

// GaleraArgs returns the mariadbd arguments of node n, after those naming
// its data directory, in a cluster whose nodes' group ports are peers
// (host:port): rsync state transfer, and a failure detector that drops a
// silent node from the view within about 3 s. The node that bootstraps
// the cluster adds --wsrep-new-cluster.
func GaleraArgs(n GaleraNode, peers []string) []string {
	return []string{"--port=" + strconv.Itoa(n.Port), "--bind-address=127.0.0.1",
		"--socket=" + filepath.Join(n.Dir, "sock"), "--pid-file=" + filepath.Join(n.Dir, "pid"),
		"--skip-name-resolve", "--performance-schema=OFF",
		"--skip-log-bin", "--innodb-flush-log-at-trx-commit=2", "--skip-innodb-doublewrite",
		"--wsrep-on=ON", "--wsrep-provider=" + GaleraProvider,
		"--wsrep-cluster-address=gcomm://" + strings.Join(peers, ","),
		"--wsrep-node-address=127.0.0.1", "--wsrep-node-name=" + n.Name,
		"--wsrep-sst-method=rsync", fmt.Sprintf("--wsrep-sst-receive-address=127.0.0.1:%d", n.SSTPort),
		"--wsrep-provider-options=" + fmt.Sprintf(
			"gmcast.listen_addr=tcp://127.0.0.1:%d;ist.recv_addr=127.0.0.1:%d;gcache.size=32M;"+
				"evs.inactive_timeout=PT3S;evs.suspect_timeout=PT2S;evs.keepalive_period=PT0.5S;evs.inactive_check_period=PT0.5S;"+
				"evs.join_retrans_period=PT0.5S;evs.install_timeout=PT3S;pc.wait_prim_timeout=PT10S",
			n.GroupPort, n.ISTPort),
		"--binlog-format=ROW", "--innodb-autoinc-lock-mode=2"}
}
