package torture

import (
	"os"
	"testing"
	"time"

	"github.com/dlock-dev/dlock/internal/testproc"
)

// A MariaDB Galera cluster of three keeps every guarantee of mysql-lease,
// its workers spread over the nodes, when a node dies and its clients move
// to another (galera-3), and when a node is cut off from the others with
// its clients still on it (galera-3-isolate): the others keep the
// primary component and every certified grant, the cut-off node refuses,
// and the node rejoins. No node leaves the cluster otherwise: Failover
// checks that every node is Synced before it faults one.
func TestFailoverGalera(t *testing.T) {
	if testing.Short() {
		t.Skip("-short: starts Galera clusters")
	}
	t.Parallel()
	for _, b := range []string{"mariadbd", "mariadb-install-db", "rsync"} {
		if _, err := lookBinary(b); err != nil {
			galeraMissing(t, err)
		}
	}
	if _, err := os.Stat(testproc.GaleraProvider); err != nil {
		galeraMissing(t, err)
	}
	for _, kind := range []string{"galera-3", "galera-3-isolate"} {
		t.Run(kind, func(t *testing.T) {
			// The mode keys too: shared and limited holders are rows of
			// another table, which the journal's triggers tie to the lock
			// table's.
			wantPass(t, runFailover(t, kind, 15*time.Second, 6*time.Second, func(cfg *Config) { cfg.ModeKeys = true }))
		})
	}
}

func galeraMissing(t *testing.T, err error) {
	t.Helper()
	if os.Getenv("CI") == "true" {
		t.Fatalf("a Galera cluster (mariadb-server, rsync, galera-4) is required (CI=true): %v", err)
	}
	t.Skipf("SKIPPING: %v", err)
}
