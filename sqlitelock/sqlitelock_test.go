package sqlitelock_test

import (
	"context"
	"database/sql"
	"errors"
	"os"
	"path/filepath"
	"testing"

	"github.com/dlock-dev/dlock"
	"github.com/dlock-dev/dlock/locktest"
	"github.com/dlock-dev/dlock/sqlitelock"
	"go.uber.org/goleak"
)

// envDB names the file shared by this test process and its helper processes.
const envDB = "DLOCK_SQLITE_TEST_DB"

func TestMain(m *testing.M) {
	if os.Getenv(envDB) == "" {
		dir, err := os.MkdirTemp("", "sqlitelock")
		if err != nil {
			panic(err)
		}
		os.Setenv(envDB, filepath.Join(dir, "locks.db"))
		defer os.RemoveAll(dir)
	}
	goleak.VerifyTestMain(m)
}

func open(t *testing.T, path string) *sqlitelock.Backend { return sqliteOpen(t, path) }

func sqliteOpen(t testing.TB, path string) *sqlitelock.Backend {
	t.Helper()
	b, err := sqlitelock.Open(path)
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { b.Close() })
	return b
}

func TestConformance(t *testing.T) {
	path := os.Getenv(envDB)
	if err := open(t, path).Migrate(context.Background()); err != nil {
		t.Fatal(err)
	}
	locktest.Run(t, func(t *testing.T) dlock.Backend { return open(t, path) },
		locktest.PoolOf(func(t *testing.T, conns int) dlock.Backend { return pooled(t, path, conns) }))
}

// pooled is a Backend over a database/sql pool of at most conns
// connections to the file at path, opened by the caller as New documents.
func pooled(t *testing.T, path string, conns int) dlock.Backend {
	t.Helper()
	db, err := sql.Open("sqlite", "file:"+path+"?_pragma=busy_timeout(10000)&_pragma=journal_mode(WAL)&_txlock=immediate")
	if err != nil {
		t.Fatal(err)
	}
	db.SetMaxOpenConns(conns)
	t.Cleanup(func() { db.Close() })
	return sqlitelock.New(db)
}

func TestMissingTable(t *testing.T) {
	b := open(t, filepath.Join(t.TempDir(), "sub", "empty.db"))
	l := dlock.New(b, nil)
	defer l.Close(context.Background())
	if _, err := l.TryAcquire(context.Background(), "k"); !errors.Is(err, dlock.ErrNoSchema) || errors.Is(err, dlock.ErrNotAcquired) {
		t.Errorf("acquire without the table: %v, want ErrNoSchema", err)
	}
	if err := b.Migrate(context.Background()); err != nil {
		t.Fatal(err)
	}
	if err := b.Migrate(context.Background()); err != nil {
		t.Fatalf("second Migrate: %v", err)
	}
	lk, err := l.TryAcquire(context.Background(), "k")
	if err != nil {
		t.Fatal(err)
	}
	lk.Release(context.Background())
}
