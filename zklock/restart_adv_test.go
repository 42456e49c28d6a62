package zklock_test

import (
	"testing"
	"time"

	"github.com/dlock-dev/dlock"
	"github.com/dlock-dev/dlock/locktest"
)

// TestRestartWhileWaitersWait: ZooKeeper is killed and restarted with its data,
// at once or after longer than the TTL, while a holder holds a key and
// clients wait for it.
func TestRestartWhileWaitersWait(t *testing.T) {
	for _, downtime := range []time.Duration{0, 5 * time.Second} {
		t.Run(downtime.String(), func(t *testing.T) {
			srv := startEnsemble(t, 1)[0]
			locktest.RestartWhileWaitersWait(t, func(t *testing.T) dlock.Backend { return newBackend(t, newConn(t, srv.addr())) },
				func(t *testing.T) {
					srv.kill()
					time.Sleep(downtime)
					if err := srv.start(); err != nil {
						t.Fatal(err)
					}
					if err := srv.waitServing(60 * time.Second); err != nil {
						t.Fatal(err)
					}
				})
		})
	}
}
