package mysqllock_test

import (
	"testing"

	"github.com/dlock-dev/dlock"
	"github.com/dlock-dev/dlock/fence"
	"github.com/dlock-dev/dlock/locktest"
)

// TestFenceTable checks package fence's table on the test server, with the lease
// strategy for DoTx's locks.
func TestFenceTable(t *testing.T) {
	locktest.RunFence(t, open(t, ""), fence.MySQL, func(t *testing.T) dlock.Backend { return newBackend(t, "") })
}
