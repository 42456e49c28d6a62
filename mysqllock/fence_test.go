package mysqllock_test

import (
	"strings"
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

// TestFenceTableReadCommitted checks the same rules in sessions at READ
// COMMITTED, whose reads and locks differ from the default REPEATABLE READ.
func TestFenceTableReadCommitted(t *testing.T) {
	// MariaDB names the variable tx_isolation; MySQL 8 knows only
	// transaction_isolation.
	variable := "transaction_isolation"
	var version string
	if err := open(t, "").QueryRowContext(t.Context(), "SELECT VERSION()").Scan(&version); err != nil {
		t.Fatal(err)
	}
	if strings.Contains(version, "MariaDB") {
		variable = "tx_isolation"
	}
	db := open(t, variable+"=%27READ-COMMITTED%27")
	var level string
	if err := db.QueryRowContext(t.Context(), "SELECT @@"+variable).Scan(&level); err != nil || level != "READ-COMMITTED" {
		t.Fatalf("session isolation %q, %v; want READ-COMMITTED", level, err)
	}
	locktest.RunFence(t, db, fence.MySQL, func(t *testing.T) dlock.Backend { return newBackend(t, "") })
}
