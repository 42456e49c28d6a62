package sqlitelock_test

import (
	"database/sql"
	"os"
	"path/filepath"
	"testing"

	"github.com/dlock-dev/dlock"
	"github.com/dlock-dev/dlock/fence"
	"github.com/dlock-dev/dlock/locktest"
)

// TestFenceTable checks package fence's table in a file of its own (WAL mode,
// waiting for the writer), with the lock file of the other tests for
// DoTx's locks.
func TestFenceTable(t *testing.T) {
	path := filepath.Join(t.TempDir(), "data.db")
	db, err := sql.Open("sqlite", "file:"+path+"?_pragma=busy_timeout(30000)&_pragma=journal_mode(WAL)")
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { db.Close() })
	locks := os.Getenv(envDB)
	if err := open(t, locks).Migrate(t.Context()); err != nil {
		t.Fatal(err)
	}
	locktest.RunFence(t, db, fence.SQLite, func(t *testing.T) dlock.Backend { return open(t, locks) })
}
