package etcdlock_test

import (
	"testing"
	"time"

	"github.com/dlock-dev/dlock"
	"github.com/dlock-dev/dlock/locktest"
)

// TestRestartWhileWaitersWait: etcd is killed and restarted with its data,
// at once or after longer than the TTL, while a holder holds a key and
// clients wait for it.
func TestRestartWhileWaitersWait(t *testing.T) {
	for _, downtime := range []time.Duration{0, 5 * time.Second} {
		t.Run(downtime.String(), func(t *testing.T) {
			c := startCluster(t, 1)
			eps := c.endpoints()
			locktest.RestartWhileWaitersWait(t, func(t *testing.T) dlock.Backend { return newBackend(t, eps) },
				func(t *testing.T) {
					c.members[0].kill()
					time.Sleep(downtime)
					c.members[0].restart(t)
				})
		})
	}
}
