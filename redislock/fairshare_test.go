package redislock_test

import (
	"testing"
	"time"

	"github.com/dlock-dev/dlock"
	"github.com/dlock-dev/dlock/locktest"
)

// The fair-share tests run 8 processes on one key for 3 s each: no process
// may get less than half of its fair share. On one server exclusive waits
// queue and are handed the key in order; a Redlock's woken waiters race,
// but Redis serves commands in arrival order, which keeps the shares even.
func TestFairShare(t *testing.T) {
	addr := serversFromEnv(t, envAddr, 1, false)[0]
	locktest.FairShare(t, func(t *testing.T) dlock.Backend { return newBackend(t, newClient(t, addr), nil) }, 8, 3*time.Second)
}

func TestFairShareRedlock(t *testing.T) {
	addrs := serversFromEnv(t, envRedlock, 3, false)
	locktest.FairShare(t, func(t *testing.T) dlock.Backend { return newRedlock(t, addrs, nil) }, 8, 3*time.Second)
}
