package mysqllock_test

import (
	"context"
	"database/sql"
	"errors"
	"fmt"
	"testing"
	"time"

	"github.com/dlock-dev/dlock"
	"github.com/dlock-dev/dlock/mysqllock"
)

// schemaSuffixes are the suffixes of the tables of a lock table.
var schemaSuffixes = []string{"", "_session", "_rows", "_claims", "_holders", "_journal", "_epoch", "_run", "_queue"}

// freshSchema drops the tables of table, migrates them again and drops
// them when the test ends.
func freshSchema(t *testing.T, db *sql.DB, table string) {
	t.Helper()
	drop := func() {
		for _, suffix := range schemaSuffixes {
			if _, err := db.ExecContext(context.Background(), "DROP TABLE IF EXISTS `"+table+suffix+"`"); err != nil {
				t.Error(err)
			}
		}
		for _, proc := range []string{"_grant1", "_wait4", "_hand4", "_wait5", "_hand5"} {
			if _, err := db.ExecContext(context.Background(), "DROP PROCEDURE IF EXISTS `"+table+proc+"`"); err != nil {
				t.Error(err)
			}
		}
	}
	drop()
	t.Cleanup(drop)
	migrateTwice(t, db, &mysqllock.Options{Table: table})
}

// shrinkSession empties table's MEMORY tables and gives its session table
// a small size limit, as a server restart gives it the server's
// max_heap_table_size.
func shrinkSession(t *testing.T, db *sql.DB, table string) {
	t.Helper()
	ctx := t.Context()
	emptyAsRestart(t, db, table)
	c, err := db.Conn(ctx)
	if err != nil {
		t.Fatal(err)
	}
	defer c.Close()
	for _, q := range []string{"SET SESSION max_heap_table_size = 65536", "ALTER TABLE `" + table + "_session` ENGINE=MEMORY",
		"SET SESSION max_heap_table_size = DEFAULT"} {
		if _, err := c.ExecContext(ctx, q); err != nil {
			t.Fatal(err)
		}
	}
}

// sessionLimit is the size limit of table's session table.
func sessionLimit(t *testing.T, db *sql.DB, table string) int64 {
	t.Helper()
	var limit int64
	if err := db.QueryRowContext(t.Context(), `SELECT MAX_DATA_LENGTH FROM information_schema.TABLES
WHERE TABLE_SCHEMA = DATABASE() AND TABLE_NAME = ?`, table+"_session").Scan(&limit); err != nil {
		t.Fatal(err)
	}
	return limit
}

// onShrunkTable runs f with each session strategy on a fresh schema of
// table, whose session table is shrunk as a restart shrinks it before each;
// with fixed, compactions leave its size limit as it is.
func onShrunkTable(t *testing.T, table string, fixed bool, f func(st string, be dlock.Backend)) {
	t.Helper()
	db := open(t, "")
	freshSchema(t, db, table)
	if fixed {
		mysqllock.SkipSessionResize(t)
	}
	for _, st := range sessionStrategies {
		be, closeBe, err := st.make(db, &mysqllock.Options{Table: table})
		if err != nil {
			t.Fatal(err)
		}
		t.Cleanup(func() { closeBe() })
		shrinkSession(t, db, table)
		f(st.name, be)
	}
}

// TestSessionTableCompaction fills a session table whose size limit a
// restart lowered with grants of distinct keys, released: each grant
// succeeds, as a full table is compacted; a key granted again gets a greater
// fence; the rows of a held key and of keys with a pending lock-delay stay.
func TestSessionTableCompaction(t *testing.T) {
	ctx := t.Context()
	db := open(t, "")
	table := scoped("dlock_compact")
	session := "`" + table + "_session`"
	onShrunkTable(t, table, true, func(st string, be dlock.Backend) {
		p := st + "/"
		held, heldTok := p+"held", dlock.NewToken()
		res, err := be.Acquire(ctx, dlock.Request{Key: held, Token: heldTok, TTL: time.Minute})
		if err != nil || !res.Acquired {
			t.Fatalf("%s: acquire %s: %+v, %v", st, held, res, err)
		}
		// Pending lock-delays: one running, one of a grant that ended
		// without a release.
		delayed, unreleased := p+"delayed", p+"unreleased"
		grantOnce(t, be, delayed)
		grantOnce(t, be, unreleased)
		if _, err := db.ExecContext(ctx, `UPDATE `+session+` SET delay_until = UTC_TIMESTAMP(6) + INTERVAL 1 HOUR WHERE name = ?`, delayed); err != nil {
			t.Fatal(err)
		}
		if _, err := db.ExecContext(ctx, `UPDATE `+session+` SET delay_us = 3600000000 WHERE name = ?`, unreleased); err != nil {
			t.Fatal(err)
		}
		// A rowlock holder whose session ended: its row goes. (A getlock
		// session holds every key of its client.)
		dead := p + "dead"
		if st != "rowlock" {
			dead = ""
		} else if res, err := be.Acquire(ctx, dlock.Request{Key: dead, Token: dlock.NewToken(), TTL: time.Minute}); err != nil || !res.Acquired {
			t.Fatalf("%s: acquire %s: %+v, %v", st, dead, res, err)
		}
		var deadConn int64
		if dead != "" {
			if err := db.QueryRowContext(ctx, `SELECT conn_id FROM `+session+` WHERE name = ?`, dead).Scan(&deadConn); err != nil {
				t.Fatal(err)
			}
			if _, err := db.ExecContext(ctx, fmt.Sprintf("KILL CONNECTION %d", deadConn)); err != nil {
				t.Fatal(err)
			}
		}
		early := p + "early"
		f1 := grantOnce(t, be, early)
		for i := range 100 {
			grantOnce(t, be, fmt.Sprintf("%sk%d", p, i))
		}
		if f2 := grantOnce(t, be, early); f2>>40 <= f1>>40 {
			t.Errorf("%s: fence %#x after compactions, want one of a later epoch than %#x", st, f2, f1)
		}
		for _, key := range []string{held, delayed, unreleased} {
			var n int
			if err := db.QueryRowContext(ctx, `SELECT COUNT(*) FROM `+session+` WHERE name = ?`, key).Scan(&n); err != nil || n != 1 {
				t.Errorf("%s: %d rows of %s (%v), want it kept", st, n, key, err)
			}
		}
		var n int
		if err := db.QueryRowContext(ctx, `SELECT COUNT(*) FROM `+session+` WHERE name = ?`, dead).Scan(&n); dead != "" && (err != nil || n != 0) {
			t.Errorf("%s: %d rows of %s, whose holder's session ended (%v), want it deleted", st, n, dead, err)
		}
		hs, err := be.(dlock.Lister).List(ctx, held)
		if err != nil || len(hs) != 1 || hs[0].Token != heldTok {
			t.Errorf("%s: List(%s) = %+v, %v; want its holder", st, held, hs, err)
		}
		if err := be.Release(ctx, held, heldTok); err != nil {
			t.Errorf("%s: release %s after compactions: %v", st, held, err)
		}
	})
}

// TestSessionTableFull: a session table full of held keys, which a
// compaction cannot free, refuses a grant of another key with
// ErrSessionTableFull.
func TestSessionTableFull(t *testing.T) {
	ctx := t.Context()
	onShrunkTable(t, scoped("dlock_full"), true, func(st string, be dlock.Backend) {
		var full error
		for i := 0; i < 100 && full == nil; i++ {
			key, tok := fmt.Sprintf("%s/k%d", st, i), dlock.NewToken()
			res, err := be.Acquire(ctx, dlock.Request{Key: key, Token: tok, TTL: time.Minute})
			switch {
			case err != nil:
				full = err
			case !res.Acquired:
				t.Fatalf("%s: %s not acquired: %+v", st, key, res)
			default:
				defer be.Release(context.Background(), key, tok)
			}
		}
		if !errors.Is(full, mysqllock.ErrSessionTableFull) {
			t.Errorf("%s: a table full of held keys: %v, want ErrSessionTableFull", st, full)
		}
	})
}

// TestSessionTableResize: a full session table whose size limit a restart
// lowered gets the schema's limit back.
func TestSessionTableResize(t *testing.T) {
	db := open(t, "")
	table := scoped("dlock_resize")
	onShrunkTable(t, table, false, func(st string, be dlock.Backend) {
		small := sessionLimit(t, db, table)
		for i := range 30 {
			grantOnce(t, be, fmt.Sprintf("%s/k%d", st, i))
		}
		if limit := sessionLimit(t, db, table); limit < 200<<20 {
			t.Errorf("%s: session table limit %d after it filled (%d before), want the schema's", st, limit, small)
		}
	})
}
