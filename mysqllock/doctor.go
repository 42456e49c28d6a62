package mysqllock

import (
	"context"
	"database/sql"
	"errors"
	"fmt"
	"log/slog"
	"sync/atomic"

	"github.com/go-sql-driver/mysql"
)

// Finding is a server setting that breaks a guarantee of a strategy, as
// reported by Check.
type Finding struct {
	Setting string // the server variable, e.g. "innodb_flush_log_at_trx_commit"
	Value   string // its value on the server
	Problem string // what breaks, one sentence
	Fix     string // what to set instead
}

// String formats f on one line: "setting=value: problem; fix: fix".
func (f Finding) String() string {
	return fmt.Sprintf("%s=%s: %s; fix: %s", f.Setting, f.Value, f.Problem, f.Fix)
}

// Check reports the server settings under which the lease strategy's
// guarantees do not hold: commits that are not durable (a grant can be
// lost in a crash, and its fence handed out again), replicas that a
// failover could promote without the last grants (replication that is not
// semi-synchronous with wait point AFTER_SYNC), and a server that is itself
// a replica. None of them can be overridden per transaction. No finding and
// no error means that nothing known to be unsafe was found; replicas are
// seen only while attached, and only with the privileges that SHOW REPLICA
// HOSTS or the process list need.
func (b *Backend) Check(ctx context.Context) ([]Finding, error) {
	return checkServer(ctx, b.db, false)
}

// Check reports the server settings under which the getlock strategy's
// guarantees do not hold: those of Backend.Check, and Galera (where the
// strategy refuses to run); and a session table that is not MEMORY, or
// whose size limit is below what Migrate sets (see sessionFindings).
func (g *GetLock) Check(ctx context.Context) ([]Finding, error) {
	return checkSession(ctx, g.s.db, g.s.table)
}

// Check reports the server settings under which the rowlock strategy's
// guarantees do not hold: as GetLock.Check.
func (r *RowLock) Check(ctx context.Context) ([]Finding, error) {
	return checkSession(ctx, r.db, r.s.table)
}

// checkSession is checkServer for a session strategy, with the findings
// about its session table (quoted).
func checkSession(ctx context.Context, db querier, table string) ([]Finding, error) {
	out, err := checkServer(ctx, db, true)
	if err != nil {
		return nil, err
	}
	fs, err := sessionFindings(ctx, db, table)
	if err != nil {
		return nil, fmt.Errorf("mysqllock: check %s: %w", table, err)
	}
	return append(out, fs...), nil
}

// sessionFindings reports a session table that Migrate has not converted
// to MEMORY (every grant is then a durable commit), and one whose size
// limit a server restart has lowered to the server's max_heap_table_size
// (grants beyond it compact the table, and fail when it is full of held
// keys). A missing table is no
// finding: the strategy reports dlock.ErrNoSchema.
func sessionFindings(ctx context.Context, db querier, table string) ([]Finding, error) {
	engine, limit, err := tableEngine(ctx, db, table)
	switch {
	case errors.Is(err, errNoTable):
		return nil, nil
	case err != nil:
		return nil, err
	case engine != "MEMORY":
		return []Finding{{Setting: "engine of " + table, Value: engine,
			Problem: "every grant of a session strategy is a durable commit, and fences are those of an earlier version",
			Fix:     "run Migrate (it converts the table to MEMORY, keeping its rows)"}}, nil
	case limit < sessionTableBytes*9/10:
		return []Finding{{Setting: "max_heap_table_size of " + table, Value: fmt.Sprint(limit),
			Problem: fmt.Sprintf("the session table holds about %d keys; beyond them each grant that finds it full compacts it, and grants of new keys fail (ErrSessionTableFull) while that many are held", limit/sessionRowBytes),
			Fix:     "run Migrate again after each server restart (it resizes the table), or set max_heap_table_size = 256M in the server's configuration"}}, nil
	}
	return nil, nil
}

// checkServer reads the global settings that decide whether a committed
// grant survives a crash, and with session strategies whether the server
// is a Galera node. Reading them needs no privilege.
func checkServer(ctx context.Context, db querier, session bool) ([]Finding, error) {
	var flush, syncBinlog, logBin string
	if err := queryRow(ctx, db, `SELECT @@GLOBAL.innodb_flush_log_at_trx_commit, @@GLOBAL.sync_binlog, @@GLOBAL.log_bin`,
		&flush, &syncBinlog, &logBin); err != nil {
		return nil, fmt.Errorf("mysqllock: check: %w", err)
	}
	var out []Finding
	// MariaDB's 3 is 1 with 5.5-style group commit: as durable.
	if flush != "1" && flush != "3" {
		out = append(out, Finding{
			Setting: "innodb_flush_log_at_trx_commit", Value: flush,
			Problem: "a committed grant can be lost in a server or OS crash, and its fence handed out again",
			Fix:     "SET GLOBAL innodb_flush_log_at_trx_commit = 1",
		})
	}
	if logBin == "1" && syncBinlog != "1" {
		out = append(out, Finding{
			Setting: "sync_binlog", Value: syncBinlog,
			Problem: "with the binary log on, a committed grant can be lost in an OS crash (and be missing on replicas), and its fence handed out again",
			Fix:     "SET GLOBAL sync_binlog = 1",
		})
	}
	r, err := readReplication(ctx, db)
	if err != nil {
		return nil, fmt.Errorf("mysqllock: check replication: %w", err)
	}
	out = append(out, replicationFindings(r)...)
	if session {
		var on sql.NullString
		err := queryRow(ctx, db, "SELECT @@wsrep_on", &on)
		var me *mysql.MySQLError
		switch {
		case errors.As(err, &me) && me.Number == errUnknownVariable: // not MariaDB: no Galera
		case err != nil:
			return nil, fmt.Errorf("mysqllock: check: %w", err)
		case on.String == "1" || on.String == "ON":
			out = append(out, Finding{
				Setting: "wsrep_on", Value: on.String,
				Problem: "Galera: named locks and row locks are local to a node, so this strategy refuses to run (ErrGalera)",
				Fix:     "use the lease strategy (mysqllock.New)",
			})
		}
	}
	return out, nil
}

// queryRow runs a one-row query through db and scans it into dest.
func queryRow(ctx context.Context, db querier, q string, dest ...any) error {
	rows, err := db.QueryContext(ctx, q)
	if err != nil {
		return err
	}
	defer rows.Close()
	if !rows.Next() {
		if err := rows.Err(); err != nil {
			return err
		}
		return sql.ErrNoRows
	}
	if err := rows.Scan(dest...); err != nil {
		return err
	}
	return rows.Close()
}

// warner logs a strategy's findings through Options.Logger: at Migrate, and
// once at the first acquisition. Without a Logger it does nothing (no I/O).
type warner struct {
	log  *slog.Logger
	done atomic.Bool // the first acquisition's check has run
}

// warn logs the findings of check; it returns check's error unlogged.
func (w *warner) warn(ctx context.Context, check func(context.Context) ([]Finding, error)) error {
	if w.log == nil {
		return nil
	}
	fs, err := check(ctx)
	if err != nil {
		return err
	}
	for _, f := range fs {
		w.log.WarnContext(ctx, "mysqllock: unsafe server setting", "setting", f.Setting, "value", f.Value,
			"problem", f.Problem, "fix", f.Fix)
	}
	return nil
}

// warnOnce is warn until it succeeds once. A failed check is not logged:
// the acquisition that follows reports the server's trouble.
func (w *warner) warnOnce(ctx context.Context, check func(context.Context) ([]Finding, error)) {
	if w.log == nil || !w.done.CompareAndSwap(false, true) {
		return
	}
	if w.warn(ctx, check) != nil {
		w.done.Store(false)
	}
}
