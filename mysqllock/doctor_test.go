package mysqllock_test

import (
	"context"
	"log/slog"
	"strings"
	"testing"
	"time"

	"github.com/dlock-dev/dlock"
	"github.com/dlock-dev/dlock/internal/testproc"
	"github.com/dlock-dev/dlock/locktest"
	"github.com/dlock-dev/dlock/mysqllock"
)

// checker is what the three strategies offer the store doctor.
type checker interface {
	Check(ctx context.Context) ([]mysqllock.Finding, error)
}

// TestCheckFindsUnsafeCommitSettings starts a MariaDB of its own whose
// commits are not durable (innodb_flush_log_at_trx_commit=2; the binary log
// on with sync_binlog=0): every strategy's Check reports both settings, and
// with a Logger, Migrate and the first acquisition of lease and rowlock
// warn.
func TestCheckFindsUnsafeCommitSettings(t *testing.T) {
	dsn := startMariaDB(t, "--innodb-flush-log-at-trx-commit=2", "--log-bin=binlog", "--sync-binlog=0", "--server-id=1")
	db := openDSN(t, dsn)
	ctx := t.Context()
	var logs testproc.SyncBuffer
	opts := &mysqllock.Options{Table: scoped("dlock_doctor"), Logger: slog.New(slog.NewTextHandler(&logs, nil))}
	lease, err := mysqllock.New(db, opts)
	if err != nil {
		t.Fatal(err)
	}
	defer lease.Close()
	row, err := mysqllock.NewRowLock(db, opts)
	if err != nil {
		t.Fatal(err)
	}
	defer row.Close()
	get, err := mysqllock.NewGetLock(db, opts)
	if err != nil {
		t.Fatal(err)
	}
	defer get.Close()

	for name, c := range map[string]checker{"lease": lease, "rowlock": row, "getlock": get} {
		fs, err := c.Check(ctx)
		if err != nil {
			t.Fatalf("%s: Check: %v", name, err)
		}
		got := map[string]string{}
		for _, f := range fs {
			got[f.Setting] = f.Value
			if f.Problem == "" || f.Fix == "" || !strings.HasPrefix(f.String(), f.Setting+"="+f.Value+": ") {
				t.Errorf("%s: finding without its consequence or fix: %q", name, f)
			}
		}
		if got["innodb_flush_log_at_trx_commit"] != "2" || got["sync_binlog"] != "0" || len(got) != 2 {
			t.Errorf("%s: Check found %v; want innodb_flush_log_at_trx_commit=2 and sync_binlog=0", name, fs)
		}
	}

	warnings := func() int { return strings.Count(logs.String(), "unsafe server setting") }
	if err := lease.Migrate(ctx); err != nil {
		t.Fatal(err)
	}
	if n := warnings(); n != 2 {
		t.Fatalf("Migrate logged %d warnings, want 2:\n%s", n, logs.String())
	}
	for name, b := range map[string]dlock.Backend{"lease": lease, "rowlock": row} {
		before := warnings()
		l := dlock.New(b, nil)
		key := locktest.UniqueKey("doctor-" + name)
		for range 2 {
			lk, err := l.TryAcquire(ctx, key, dlock.WithTTL(5*time.Second))
			if err != nil {
				t.Fatalf("%s: %v", name, err)
			}
			if err := lk.Release(ctx); err != nil {
				t.Fatal(err)
			}
		}
		l.Close(ctx)
		if n := warnings() - before; n != 2 {
			t.Errorf("%s: two acquisitions logged %d warnings, want 2 (once, at the first):\n%s", name, n, logs.String())
		}
	}
}

// TestCheckSharedServer: the test server commits durably, so Check finds
// nothing, and without a Logger nothing is checked or logged.
func TestCheckSharedServer(t *testing.T) {
	ctx := t.Context()
	for name, c := range map[string]checker{"lease": newBackend(t, ""), "rowlock": newRowLock(t, ""), "getlock": newGetLock(t, "")} {
		fs, err := c.Check(ctx)
		if err != nil {
			t.Fatalf("%s: %v", name, err)
		}
		if len(fs) != 0 {
			t.Errorf("%s: findings on the test server (%s): %v", name, dsn(), fs)
		}
	}
}

// TestCheckSessionTable: Check reports a session table that is not MEMORY,
// or whose size limit is the server's default, as a restart leaves it;
// Migrate fixes both.
func TestCheckSessionTable(t *testing.T) {
	ctx := t.Context()
	table := scoped("dlock_doctorsession")
	opts := &mysqllock.Options{Table: table}
	db := open(t, "")
	migrateTwice(t, db, opts)
	g, err := mysqllock.NewGetLock(db, opts)
	if err != nil {
		t.Fatal(err)
	}
	defer g.Close()
	for _, alter := range []string{
		"SET STATEMENT max_heap_table_size = 16777216 FOR ALTER TABLE `" + table + "_session` ENGINE=MEMORY",
		"ALTER TABLE `" + table + "_session` ENGINE=InnoDB",
	} {
		if _, err := db.ExecContext(ctx, alter); err != nil {
			t.Fatal(err)
		}
		fs, err := g.Check(ctx)
		if err != nil || len(fs) != 1 {
			t.Errorf("after %s: findings %v, %v; want one about the session table", alter, fs, err)
		}
		migrateTwice(t, db, opts)
		if fs, err := g.Check(ctx); err != nil || len(fs) != 0 {
			t.Errorf("after %s and Migrate: findings %v, %v; want none", alter, fs, err)
		}
	}
}
