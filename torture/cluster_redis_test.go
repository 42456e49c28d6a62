package torture

import (
	"os"
	"os/exec"
	"testing"
	"time"
)

// A Redis primary whose replica misses its last second before the kill,
// failed over by Sentinel: with MinReplicas 1 (WAIT after each grant and
// extension) and min-replicas-to-write 1, the grants the replica missed
// were withdrawn when their WAIT timed out, so no holder overlaps another.
func TestFailoverRedisMinReplicas(t *testing.T) {
	if testing.Short() {
		t.Skip("-short: starts a Redis primary, a replica and three Sentinels")
	}
	if _, err := exec.LookPath("redis-server"); err != nil {
		if os.Getenv("CI") == "true" {
			t.Fatalf("redis-server is required (CI=true): %v", err)
		}
		t.Skipf("SKIPPING: %v", err)
	}
	t.Parallel()
	wantPass(t, runFailover(t, "redis-minreplicas", 15*time.Second, 6*time.Second))
}
