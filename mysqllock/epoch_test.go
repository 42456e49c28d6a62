package mysqllock_test

import (
	"context"
	"database/sql"
	"errors"
	"testing"
	"time"

	"github.com/dlock-dev/dlock"
	"github.com/dlock-dev/dlock/mysqllock"
)

// sessionStrategies builds each session strategy on db with opts.
var sessionStrategies = []struct {
	name string
	make func(db *sql.DB, opts *mysqllock.Options) (dlock.Backend, func() error, error)
}{
	{"getlock", func(db *sql.DB, opts *mysqllock.Options) (dlock.Backend, func() error, error) {
		g, err := mysqllock.NewGetLock(db, opts)
		if err != nil {
			return nil, nil, err
		}
		return g, g.Close, nil
	}},
	{"rowlock", func(db *sql.DB, opts *mysqllock.Options) (dlock.Backend, func() error, error) {
		r, err := mysqllock.NewRowLock(db, opts)
		if err != nil {
			return nil, nil, err
		}
		return r, r.Close, nil
	}},
}

// grantOnce acquires key on be and releases it, and returns the fence.
func grantOnce(t *testing.T, be dlock.Backend, key string) uint64 {
	t.Helper()
	ctx := t.Context()
	tok := dlock.NewToken()
	res, err := be.Acquire(ctx, dlock.Request{Key: key, Token: tok, TTL: 10 * time.Second})
	if err != nil || !res.Acquired {
		t.Fatalf("acquire %s: %+v, %v", key, res, err)
	}
	if err := be.Release(ctx, key, tok); err != nil {
		t.Fatalf("release %s: %v", key, err)
	}
	return res.Fence
}

// TestSessionFencesAcrossRestart kills a MariaDB of its own with SIGKILL
// and starts it again, twice: each session strategy's fences for a key
// increase strictly across the restarts, which empty the session table.
func TestSessionFencesAcrossRestart(t *testing.T) {
	dsn, restart := startRestartableMariaDB(t)
	ctx := t.Context()
	admin := openDSN(t, dsn)
	migrateTwice(t, admin, nil)
	last := map[string]uint64{}
	for round := range 3 {
		for _, st := range sessionStrategies {
			db := openDSN(t, dsn)
			be, closeBe, err := st.make(db, nil)
			if err != nil {
				t.Fatal(err)
			}
			key := "restart/" + st.name
			for range 3 {
				f := grantOnce(t, be, key)
				if f <= last[key] {
					t.Errorf("%s, round %d: fence %d after %d: fences must increase across server restarts", st.name, round, f, last[key])
				}
				last[key] = f
				t.Logf("%s, round %d: fence %#x", st.name, round, f)
			}
			closeBe()
			db.Close()
		}
		if round < 2 {
			restart()
			var n int
			if err := admin.QueryRowContext(ctx, "SELECT COUNT(*) FROM dlock_locks_session").Scan(&n); err != nil || n != 0 {
				t.Fatalf("after the restart the session table has %d rows (%v), want 0", n, err)
			}
		}
	}
}

// TestSessionTableMigration converts a session table of an earlier version
// (InnoDB) holding a key with a high fence: Migrate keeps the row, and the
// key's next fences, also after the session table is emptied as a server
// restart empties it, are greater.
func TestSessionTableMigration(t *testing.T) {
	ctx := t.Context()
	db := open(t, "")
	table := scoped("dlock_oldsession")
	session := "`" + table + "_session`"
	for _, suffix := range []string{"", "_session", "_rows", "_claims", "_holders", "_journal", "_epoch", "_run"} {
		if _, err := db.ExecContext(ctx, "DROP TABLE IF EXISTS `"+table+suffix+"`"); err != nil {
			t.Fatal(err)
		}
	}
	if _, err := db.ExecContext(ctx, `CREATE TABLE `+session+` (
  name        VARBINARY(255)  NOT NULL,
  token       BINARY(16)      NOT NULL,
  owner       VARCHAR(255)    CHARACTER SET utf8mb4 NOT NULL DEFAULT '',
  fence       BIGINT UNSIGNED NOT NULL,
  conn_id     BIGINT UNSIGNED NOT NULL,
  lock_name   VARCHAR(64)     CHARACTER SET utf8mb4 NOT NULL DEFAULT '',
  acquired_at DATETIME(6)     NOT NULL,
  metadata    VARCHAR(1024)   CHARACTER SET utf8mb4 NOT NULL DEFAULT '',
  PRIMARY KEY (name)
) ENGINE=InnoDB`); err != nil {
		t.Fatal(err)
	}
	const old = 1 << 39 // far above any fence that the one-counter scheme reached
	for _, st := range sessionStrategies {
		if _, err := db.ExecContext(ctx, `INSERT INTO `+session+` (name, token, fence, conn_id, acquired_at)
VALUES (?, X'00000000000000000000000000000001', ?, 0, UTC_TIMESTAMP(6))`, "old/"+st.name, old); err != nil {
			t.Fatal(err)
		}
	}
	opts := &mysqllock.Options{Table: table}
	migrateTwice(t, db, opts)
	var engine string
	var rows int
	if err := db.QueryRowContext(ctx, `SELECT ENGINE, (SELECT COUNT(*) FROM `+session+`) FROM information_schema.TABLES
WHERE TABLE_SCHEMA = DATABASE() AND TABLE_NAME = ?`, table+"_session").Scan(&engine, &rows); err != nil {
		t.Fatal(err)
	}
	if engine != "MEMORY" || rows != len(sessionStrategies) {
		t.Errorf("after Migrate the session table is %s with %d rows, want MEMORY with the %d rows it had", engine, rows, len(sessionStrategies))
	}
	for _, st := range sessionStrategies {
		be, closeBe, err := st.make(db, opts)
		if err != nil {
			t.Fatal(err)
		}
		key := "old/" + st.name
		f1 := grantOnce(t, be, key)
		if f1 <= old {
			t.Errorf("%s: fence %d after migration, want more than the old %d", st.name, f1, uint64(old))
		}
		emptyAsRestart(t, db, table)
		f2 := grantOnce(t, be, key)
		if f2 <= f1 {
			t.Errorf("%s: fence %d after the session table was emptied, want more than %d", st.name, f2, f1)
		}
		closeBe()
	}
}

// migrateTwice runs Migrate on db with opts, and again (with nothing left
// to do).
func migrateTwice(t *testing.T, db *sql.DB, opts *mysqllock.Options) {
	t.Helper()
	lease, err := mysqllock.New(db, opts)
	if err != nil {
		t.Fatal(err)
	}
	defer lease.Close()
	for range 2 {
		if err := lease.Migrate(t.Context()); err != nil {
			t.Fatal(err)
		}
	}
}

// emptyAsRestart empties what a server restart empties: the MEMORY tables
// of table's session strategies.
func emptyAsRestart(t *testing.T, db *sql.DB, table string) {
	t.Helper()
	for _, suffix := range []string{"_session", "_run"} {
		if _, err := db.ExecContext(t.Context(), "DELETE FROM `"+table+suffix+"`"); err != nil {
			t.Fatal(err)
		}
	}
}

// TestSessionFenceLimit: a key whose counter would reach 2^40 in the
// server's run is refused with ErrFencesExhausted, and nothing is granted;
// the refusal is the server's answer, not a lost session: a lock held on
// the same session before it is still held after it.
func TestSessionFenceLimit(t *testing.T) {
	ctx := t.Context()
	db := open(t, "")
	newBackend(t, "") // migrated
	session := "`" + testTable + "_session`"
	for _, st := range sessionStrategies {
		be, closeBe, err := st.make(db, &mysqllock.Options{Table: testTable})
		if err != nil {
			t.Fatal(err)
		}
		defer closeBe()
		key := "limit/" + st.name + "/" + dlock.NewToken().String()
		f := grantOnce(t, be, key)
		kept := dlock.Lease{Key: key + "/kept", Token: dlock.NewToken(), TTL: 10 * time.Second}
		if res, err := be.Acquire(ctx, dlock.Request{Key: kept.Key, Token: kept.Token, TTL: kept.TTL}); err != nil || !res.Acquired {
			t.Fatalf("%s: acquire %s: %+v, %v", st.name, kept.Key, res, err)
		}
		// The largest fence of f's run.
		if _, err := db.ExecContext(ctx, `UPDATE `+session+` SET fence = ? WHERE name = ?`, f|(1<<40-1), key); err != nil {
			t.Fatal(err)
		}
		res, err := be.Acquire(ctx, dlock.Request{Key: key, Token: dlock.NewToken(), TTL: 10 * time.Second})
		if !errors.Is(err, mysqllock.ErrFencesExhausted) || res.Acquired {
			t.Errorf("%s: past the run's last fence: %+v, %v; want ErrFencesExhausted and no grant", st.name, res, err)
		}
		if errs, err := be.Extend(ctx, []dlock.Lease{kept}); err != nil || errs[0] != nil {
			t.Errorf("%s: extend a lock of the same session after the refusal: %v, %v; want it held", st.name, errs, err)
		}
		var fence uint64
		if err := db.QueryRowContext(ctx, `SELECT fence FROM `+session+` WHERE name = ?`, key).Scan(&fence); err != nil || fence != f|(1<<40-1) {
			t.Errorf("%s: fence %d (%v) after the refusal, want it unchanged", st.name, fence, err)
		}
		cctx, cancel := context.WithTimeout(ctx, 5*time.Second)
		res, err = be.Acquire(cctx, dlock.Request{Key: key, Token: dlock.NewToken(), TTL: 10 * time.Second})
		cancel()
		if err == nil || res.Acquired {
			t.Errorf("%s: second try: %+v, %v; want an error and no grant", st.name, res, err)
		}
	}
}
