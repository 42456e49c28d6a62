package pglock_test

import (
	"context"
	"database/sql"
	"os"
	"testing"
	"time"

	"github.com/dlock-dev/dlock"
	"github.com/dlock-dev/dlock/fence"
	"github.com/dlock-dev/dlock/locktest"
	_ "github.com/jackc/pgx/v5/stdlib" // database/sql driver "pgx"
)

// TestFenceTable checks package fence's table on the test server through
// database/sql, with the lease strategy for DoTx's locks.
func TestFenceTable(t *testing.T) {
	needServer(t)
	db, err := sql.Open("pgx", dsn())
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { db.Close() })
	ctx, cancel := context.WithTimeout(context.Background(), 5*time.Second)
	defer cancel()
	if err := db.PingContext(ctx); err != nil {
		if os.Getenv("CI") == "true" {
			t.Fatalf("PostgreSQL at %s through database/sql: %v", dsn(), err)
		}
		t.Skipf("SKIPPING: PostgreSQL at %s through database/sql: %v", dsn(), err)
	}
	locktest.RunFence(t, db, fence.PostgreSQL, func(t *testing.T) dlock.Backend { return newLease(t, nil) })
}
