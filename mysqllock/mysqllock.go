// Package mysqllock is a dlock.Backend on MySQL and MariaDB: the lease
// strategy, one row per key in an InnoDB table, timed by the server's clock.
//
// Acquisition is one INSERT … ON DUPLICATE KEY UPDATE that takes the row only
// if its lease has expired (by UTC_TIMESTAMP(6) on the server) and bumps the
// key's fencing counter; extension and release are UPDATEs that check the
// owner token. Rows are never deleted, so fences never go back.
// The strategy works through connection pools, proxies and Galera, and a
// crashed holder's lock frees itself when its TTL runs out.
//
// With doorbells (Options.NoDoorbell unset), waiters block in the server
// and an exclusive release hands the lease to the exclusive waiter its
// doorbell wakes, in the release's own transaction: one durable commit per
// handoff. Waits record themselves in a MEMORY queue table, and the waits
// and releases run as two stored procedures that Migrate creates; without
// them (tables of an earlier version, no CREATE ROUTINE) the woken waiter
// takes the lease itself, as correctly, with a second commit.
//
// The lease strategy grants every mode (dlock.Sharer): shared holds
// (dlock.Shared) and limited ones (dlock.WithLimit) each have a lease, a
// token and a fence of their own, taken from the same counter as exclusive
// holds; see Backend.SupportsMode. GetLock and RowLock grant exclusive
// acquisitions only: a named lock or a locked row has no shared mode.
// Shared and limited holders live in a table of their own and in columns
// that Migrate adds to a lock table created without them; exclusive
// acquisitions by a client built without them do not see shared or limited
// holders, so stop such clients before any key is taken in those modes.
//
// Every strategy lets a holder change its lock's metadata
// (dlock.MetadataSetter: an Election leader's Proclaim), which List then
// shows. None is a dlock.Watcher, since the server has no notification a
// watcher could wait on without taking a doorbell's wake-ups from lock
// waiters. The lease strategy is a dlock.HolderWatcher: triggers that
// Migrate creates record every change of holders in a journal that
// watchers read with a backoff of up to 1 s, so an Election's observers
// see every term (see Backend.WatchHolders). GetLock and RowLock are not
// HolderWatchers: a journal would add a write to each of their grants and
// releases. With them an Election's Observe polls, and misses terms
// shorter than a poll.
//
// GetLock and RowLock keep each key's last holder and fencing counter in a
// MEMORY session table: their locks live in server sessions, and a server
// restart ends every one of them, and empties the table with every pending
// lock-delay and minimum hold (dlock.HoldKeeper) of these strategies. A
// grant writes that table without a durable commit. Their fences still
// grow across restarts: a fence is the epoch of the server's run, counted
// by a durable counter that the first grant of each run bumps, shifted
// left by 40 bits, or'd with the key's count of grants in the run (see
// ErrFencesExhausted). Migrate converts the InnoDB session table of an
// earlier version, keeping its rows; every fence after it is greater than
// the fences before. Run every client of a table on this version before
// the server next restarts: an earlier version, finding the key's row gone,
// would count from 1 again.
//
// The session table has a row per key granted in the server's run and a
// fixed size limit (256 MiB, about 47,000 keys, from Migrate; the server's
// max_heap_table_size after a restart until Migrate runs again). A grant
// that finds it full restores the limit if it may, starts a new epoch and
// deletes the rows of free keys of earlier ones, then tries again; a table
// full of held keys returns ErrSessionTableFull.
//
// Every strategy's grants, and so its fences, are only as durable as
// the server's commits (for the session strategies, the epoch counter's): with innodb_flush_log_at_trx_commit other than 1,
// or the binary log on and sync_binlog other than 1, a crash can lose a
// committed grant and a fence is handed out twice. No statement can
// override these settings, so each strategy's Check method reports them,
// and with Options.Logger set, Migrate and the first acquisition log a
// warning (see Options.Logger).
//
//	db, _ := sql.Open("mysql", "user:pass@tcp(host:3306)/app")
//	b, err := mysqllock.New(db, nil)
//	err = b.Migrate(ctx) // once: creates the table
//	locker := dlock.New(b, nil)
package mysqllock

import (
	"context"
	"database/sql"
	"database/sql/driver"
	_ "embed"
	"errors"
	"fmt"
	"log/slog"
	"math/rand/v2"
	"regexp"
	"sort"
	"strings"
	"sync"
	"sync/atomic"
	"time"

	"github.com/dlock-dev/dlock/internal/ctxend"

	"github.com/dlock-dev/dlock"
	"github.com/dlock-dev/dlock/internal/claims"
	"github.com/go-sql-driver/mysql"
)

// DefaultTable is the table used when Options.Table is empty.
const DefaultTable = "dlock_locks"

// querier is what the statements need of a *sql.DB or a pinned *sql.Conn.
type querier interface {
	ExecContext(ctx context.Context, query string, args ...any) (sql.Result, error)
	QueryContext(ctx context.Context, query string, args ...any) (*sql.Rows, error)
}

// Options configure a Backend. The zero value (or nil) means all defaults.
type Options struct {
	// Table is the lock table, optionally qualified by database
	// ("locks.dlock_locks"). Each part is 1..64 of [A-Za-z0-9_$], not all
	// digits, and the table itself at most 56, for the tables named after
	// it ("_session", "_rows", "_claims", "_holders", "_journal", "_epoch",
	// "_run"). The default is DefaultTable.
	Table string

	// Logger receives a warning for each server setting that breaks a
	// guarantee of the strategy (see Backend.Check: commits that are not
	// durable, Galera for the session strategies), from Migrate and once
	// from the first acquisition.
	// The default (nil) logs nothing and checks nothing.
	Logger *slog.Logger

	// NoDoorbell turns off the lease strategy's doorbells; NewGetLock and
	// NewRowLock refuse it (dlock.ErrInvalidOption). By default a
	// lease holder also holds a named lock (a "doorbell": GET_LOCK on a
	// session pinned from a *sql.DB), so that waiters block in the server,
	// wake the moment the lease is released or its holder dies, and are
	// handed the lease in FIFO order: a client that releases a key cannot
	// take it straight back ahead of a waiter. Without doorbells waiters
	// use the Locker's backoff and a releasing client may barge back in,
	// for more acquisitions per second and no fairness. Galera does not
	// replicate named locks: there, doorbells need Options.Connector to one
	// node, the same for every client of the cluster; without it,
	// acquisitions with doorbells fail with ErrGalera (and
	// dlock.ErrInvalidOption), and NoDoorbell turns them off.
	NoDoorbell bool

	// Connector, if set, opens the connections that GetLock, RowLock and
	// the lease strategy's doorbells pin for their sessions, in a pool of their own
	// outside db's pool and its limits (SetMaxOpenConns): give it the
	// server that db uses, as mysql.NewConnector(cfg) does. Without it the
	// sessions are pinned from db, whose limit (if any) must then be at
	// least 2 (New and NewGetLock fail with dlock.ErrInvalidOption, and so
	// does every call if the limit is lowered after); with a limit of n,
	// at most n−2 waiters of one GetLock or Backend wait in the server at
	// once (each on a session of its own), the others poll with the
	// Locker's backoff, and a session that holds nothing goes back to db at
	// once. RowLock, without it, needs a limit of at least 2 and holds at
	// most n−1 locks at once. On a Galera cluster, the lease strategy's
	// doorbells need it, naming one node directly (not a balancer), the
	// same node for every client: db's statements may go to any node, and
	// a release on any node wakes the waiters of every node. GetLock and
	// RowLock refuse Galera with or without it. The default is nil.
	Connector driver.Connector
}

// connector returns opts.Connector, if any.
func connector(opts *Options) driver.Connector {
	if opts == nil {
		return nil
	}
	return opts.Connector
}

// Backend is the lease strategy on MySQL/MariaDB. It is safe for concurrent
// use.
type Backend struct {
	claims *claims.Set
	ac     autocommitCheck
	db     *sql.DB
	table  string // quoted
	q      queries
	sq     sharedQueries
	ho     handoffs
	bell   *GetLock    // the doorbells; nil without them
	noBell atomic.Bool // doorbells turned out to be unavailable (Galera)
	// storeGalera: whether db is a Galera node, asked at the first
	// acquisition with doorbells (see farBells).
	storeGalera galeraProbe
	// belled holds the tokens of the leases granted with their doorbell
	// (*belledLease), until released (see Release) or run out (see
	// belledFor).
	belled sync.Map
	// nonExcl holds the tokens of the shared and limited holds granted
	// here, until released or found lost, so that Extend and Release go
	// straight to the holders table.
	nonExcl sync.Map
	// noIdleTx: the server has no idle_transaction_timeout (MySQL).
	noIdleTx atomic.Bool
	warn     warner
}

var (
	_ dlock.Backend        = (*Backend)(nil)
	_ dlock.Waiter         = (*Backend)(nil)
	_ dlock.DirectWaiter   = (*Backend)(nil)
	_ dlock.Lister         = (*Backend)(nil)
	_ dlock.ForceReleaser  = (*Backend)(nil)
	_ dlock.Sharer         = (*Backend)(nil)
	_ dlock.MetadataSetter = (*Backend)(nil)
)

//go:embed schema.sql
var schemaSQL string

var identRE = regexp.MustCompile(`^[A-Za-z0-9_$]{1,64}$`)
var digitsRE = regexp.MustCompile(`^[0-9]+$`)

// New returns a Backend over db. It does no I/O; call Migrate once to create
// the table. The error matches dlock.ErrInvalidOption for a bad table name,
// or for doorbells on a pool whose limit is below 2 (see Options.Connector).
func New(db *sql.DB, opts *Options) (*Backend, error) {
	table, err := checkArgs(db == nil, opts)
	if err != nil {
		return nil, err
	}
	b := &Backend{db: db, table: table, q: newQueries(table), sq: newSharedQueries(table, holdersTable(table)), ho: newHandoffs(table), warn: warner{log: logger(opts)}, claims: newClaims(db, table, "lease")}
	if opts == nil || !opts.NoDoorbell {
		s := newSessions(db, "").forStrategy("the lease strategy with doorbells (Options.NoDoorbell unset)", minSessionConns, connector(opts))
		if err := s.checkPool(); err != nil {
			return nil, err
		}
		b.bell = &GetLock{s: s, bell: true}
		b.bell.s.keepTimeout = true // a doorbell's session may idle: its death only rings
		b.bell.s.galeraOK = s.private
	}
	return b, nil
}

// Close returns the connections pinned for doorbells to the pool. It does not
// close the DB.
func (b *Backend) Close() error {
	b.belled.Range(func(token, _ any) bool {
		b.unbell(token.(dlock.Token))
		return true
	})
	if b.bell != nil {
		return b.bell.Close()
	}
	return nil
}

// logger is opts.Logger, nil without options.
func logger(opts *Options) *slog.Logger {
	if opts == nil {
		return nil
	}
	return opts.Logger
}

// checkArgs validates a constructor's arguments and returns the quoted table.
func checkArgs(nilDB bool, opts *Options) (string, error) {
	if opts == nil {
		opts = &Options{}
	}
	table, err := quoteTable(opts.Table)
	if err == nil && nilDB {
		err = fmt.Errorf("%w: mysqllock: nil DB", dlock.ErrInvalidOption)
	}
	return table, err
}

// leaseOnly refuses the lease strategy's options for another strategy, so
// that a setting never silently does nothing.
func leaseOnly(strategy string, opts *Options) error {
	if opts != nil && opts.NoDoorbell {
		return fmt.Errorf("%w: mysqllock: NoDoorbell applies to the lease strategy (New), not to %s", dlock.ErrInvalidOption, strategy)
	}
	return nil
}

// longestSuffix is the longest suffix of the tables that Migrate names
// after Options.Table (see schema.sql); "_holders" is as long.
const longestSuffix = "_session"

// holdersTable names the lease strategy's table of shared and limited
// holders after the lock table (quoted).
func holdersTable(table string) string { return strings.TrimSuffix(table, "`") + "_holders`" }

func quoteTable(name string) (string, error) {
	if name == "" {
		name = DefaultTable
	}
	parts := strings.Split(name, ".")
	if len(parts) > 2 {
		return "", fmt.Errorf("%w: mysqllock: table %q has more than two parts", dlock.ErrInvalidOption, name)
	}
	for i, p := range parts {
		if !identRE.MatchString(p) || digitsRE.MatchString(p) {
			return "", fmt.Errorf("%w: mysqllock: table %q: each part must be 1-64 of [A-Za-z0-9_$], not all digits", dlock.ErrInvalidOption, name)
		}
		parts[i] = "`" + p + "`"
	}
	if t := parts[len(parts)-1]; len(t)-2+len(longestSuffix) > 64 {
		return "", fmt.Errorf("%w: mysqllock: table %q: the name is at most %d characters, so that the tables named after it (%s) fit the server's 64",
			dlock.ErrInvalidOption, name, 64-len(longestSuffix), longestSuffix)
	}
	return strings.Join(parts, "."), nil
}

// Schema returns the DDL that Migrate runs for table ("" for DefaultTable),
// as the mysql client reads it: schema.sql with the table name substituted,
// and GetLock's grant procedure.
func Schema(table string) (string, error) {
	q, err := quoteTable(table)
	if err != nil {
		return "", err
	}
	return schemaFor(q) + "\n-- GetLock's grant procedure (see GetLock.Migrate), and the lease strategy's\n-- handoff procedures (see Backend.Migrate).\nDELIMITER //\n" +
		grantProcSQL(q) + "//\n" + waitProcSQL(q) + "//\n" + handoffProcSQL(q) + "//\nDELIMITER ;\n", nil
}

// schemaFor substitutes the quoted table name (which names the lease table
// and prefixes the session strategies' tables) into schema.sql.
func schemaFor(quoted string) string {
	return strings.ReplaceAll(schemaSQL, "`"+DefaultTable, strings.TrimSuffix(quoted, "`"))
}

// execScript runs the statements of a schema one by one (the driver does
// not run several per call unless the DSN allows it).
func execScript(ctx context.Context, db querier, stmts []string) error {
	for _, stmt := range stmts {
		if _, err := db.ExecContext(ctx, stmt); err != nil {
			return err
		}
	}
	return nil
}

// splitScript splits a schema into its statements, which end with the
// delimiter (";", or another set by a DELIMITER line, as the mysql client
// reads it) at the end of a line that is not a comment, and puts the triggers apart: Migrate
// creates them after the columns they use.
func splitScript(script string) (tables, triggers []string) {
	delim := ";"
	var cur strings.Builder
	for _, line := range strings.SplitAfter(script, "\n") {
		if d, ok := strings.CutPrefix(strings.TrimSpace(line), "DELIMITER "); ok {
			delim = strings.TrimSpace(d)
			continue
		}
		body, end := strings.CutSuffix(strings.TrimRight(line, "\n"), delim)
		if !end || strings.HasPrefix(strings.TrimSpace(line), "--") {
			cur.WriteString(line)
			continue
		}
		cur.WriteString(body)
		stmt := strings.TrimSpace(cur.String())
		cur.Reset()
		switch {
		case stmt == "":
		case strings.Contains(stmt, "CREATE TRIGGER"):
			triggers = append(triggers, stmt)
		default:
			tables = append(tables, stmt)
		}
	}
	return tables, triggers
}

// Migrate creates the lock tables of every strategy if they do not exist,
// and adds to a lock table created by an earlier version the columns that
// shared and limited holders need (keeping its rows and fences) and the
// position of the change journal, then creates the journal's triggers
// (see WatchHolders). It is safe to run concurrently and repeatedly. It
// needs the TRIGGER privilege and, on a server that writes the binary log,
// SUPER or log_bin_trust_function_creators=1; without them it creates the
// rest, logs a warning with Options.Logger, and WatchHolders answers
// dlock.ErrUnsupported. It also creates GetLock's grant procedure and the
// lease strategy's wait and handoff procedures, which need CREATE ROUTINE
// (without it, a warning; GetLock's grants then take two statements, and
// a lease handoff two durable commits). With Options.Logger it then logs a
// warning for each finding of Check (and one if Check fails).
func (b *Backend) Migrate(ctx context.Context) error {
	return migrate(ctx, b.db, b.table, &b.warn, b.Check)
}

// migrate creates the schema of table and reports the server's unsafe
// settings through w.
func migrate(ctx context.Context, pool *sql.DB, table string, w *warner, check func(context.Context) ([]Finding, error)) error {
	// One connection: the script sets the session's max_heap_table_size
	// for the MEMORY tables it creates or converts.
	db, err := pool.Conn(ctx)
	if err != nil {
		return fmt.Errorf("mysqllock: migrate %s: %w", table, err)
	}
	defer db.Close()
	defer db.ExecContext(context.WithoutCancel(ctx), "SET SESSION max_heap_table_size = DEFAULT")
	tables, triggers := splitScript(schemaFor(table))
	if err := execScript(ctx, db, tables); err != nil {
		return fmt.Errorf("mysqllock: migrate %s: %w", table, err)
	}
	if err := upgrade(ctx, db, table, modeColumns); err != nil {
		return fmt.Errorf("mysqllock: migrate %s: add the columns of shared and limited holders: %w", table, err)
	}
	if err := upgrade(ctx, db, sessionTable(table), sessionColumns); err != nil {
		return fmt.Errorf("mysqllock: migrate %s: add the columns of lock-delays: %w", table, err)
	}
	if err := toMemory(ctx, db, sessionTable(table)); err != nil {
		return fmt.Errorf("mysqllock: migrate %s: make the session table MEMORY: %w", table, err)
	}
	if err := upgrade(ctx, db, table, journalColumns); err != nil {
		return fmt.Errorf("mysqllock: migrate %s: add the journal's position: %w", table, err)
	}
	if err := createTriggers(ctx, db, triggers); err != nil {
		if !isDenied(err) {
			return fmt.Errorf("mysqllock: migrate %s: create the journal's triggers: %w", table, err)
		}
		w.journalOff(ctx, table, err)
	}
	// The procedures speed the strategies up; without the right to create
	// them, a warning, and the strategies go on without.
	for _, p := range []struct {
		what, without string
		stmts         []string
	}{
		{"the lease handoff procedures", "a lease handoff takes two durable commits", []string{waitProcSQL(table), handoffProcSQL(table)}},
		{"the getlock grant procedure", "a getlock grant takes two round trips", []string{grantProcSQL(table)}},
	} {
		for _, stmt := range p.stmts {
			err := createProc(ctx, db, stmt)
			if err == nil {
				continue
			}
			if !isDenied(err) && !dbDenied(err) {
				return fmt.Errorf("mysqllock: migrate %s: create %s: %w", table, p.what, err)
			}
			if w.log != nil {
				w.log.WarnContext(ctx, "mysqllock: "+p.what+" cannot be created: "+p.without, "table", table, "err", err)
			}
			break
		}
	}
	if err := w.warn(ctx, check); err != nil {
		w.log.WarnContext(ctx, "mysqllock: could not check the server's settings", "err", err)
	}
	return nil
}

type queries struct {
	acquire, acquireBell, acquireFarBell, release, releaseNoBell string
	forceRelease, list                                           string
	setMetadata, setSharedMetadata, held                         string
	listKeys                                                     string
}

// The acquisition statement decides once whether the row is free, in the
// first assignment, into the session variable @dlock_free that the others
// read: MySQL evaluates ON DUPLICATE KEY UPDATE assignments left to right,
// and a condition evaluated per assignment could change in between
// (IS_USED_LOCK does, when another session takes the doorbell meanwhile),
// leaving a torn row: a new token on an old fence. The fault harness found
// that tear. expires_at is still assigned last. LAST_INSERT_ID(x) makes the reply carry the new fence when
// the row is taken and 0 when it is not, so that the outcome does not depend
// on affected-row counts (which clientFoundRows changes).
//
// With doorbells, a free lease is not taken while another session holds the
// key's doorbell (IS_USED_LOCK) and the lease was freed less than staleBell
// ago: that session belongs to the waiter first in line, woken by the
// release. A doorbell held longer than that past the lease's end is stale
// (its holder paused or lost the lease without ringing) and is ignored.
//
// The key is free when both its exclusive lease and the latest lease of its
// shared or limited holders (shared_until) have ended. An attempt that finds
// only shared holders leaves the writer mark (writer_until), which a grant
// clears; it is assigned before expires_at, which it reads.
func newQueries(t string) queries {
	acquire := func(free string) string {
		return `INSERT INTO ` + t + ` (name, token, owner, fence, acquired_at, expires_at, metadata)
VALUES (?, ?, ?, LAST_INSERT_ID(1), UTC_TIMESTAMP(6), UTC_TIMESTAMP(6) + INTERVAL ? MICROSECOND, ?)
ON DUPLICATE KEY UPDATE
  token = IF(@dlock_free := (` + free + `), ?, token),
  owner = IF(@dlock_free, ?, owner),
  metadata = IF(@dlock_free, ?, metadata),
  acquired_at = IF(@dlock_free, UTC_TIMESTAMP(6), acquired_at),
  fence = IF(@dlock_free, LAST_INSERT_ID(fence + 1), fence + LAST_INSERT_ID(0)),
  writer_until = IF(@dlock_free, '1970-01-01',
    IF(expires_at <= UTC_TIMESTAMP(6) AND shared_until > UTC_TIMESTAMP(6) AND share_limit = 0, UTC_TIMESTAMP(6) + INTERVAL ` + writerMark + ` MICROSECOND, writer_until)),
  expires_at = IF(@dlock_free, UTC_TIMESTAMP(6) + INTERVAL ? MICROSECOND, expires_at)`
	}
	const free = "GREATEST(expires_at, shared_until) <= UTC_TIMESTAMP(6)"
	freeBell := func(holder string) string {
		return fmt.Sprintf("(%s AND (IFNULL(%s, ?) = ? OR GREATEST(expires_at, shared_until) <= UTC_TIMESTAMP(6) - INTERVAL %d MICROSECOND))",
			free, holder, staleBell.Microseconds())
	}
	return queries{
		acquire:     acquire(free),
		acquireBell: acquire(freeBell("IS_USED_LOCK(?)")),
		// The same, told the doorbell's holder (NULL: none), for doorbells
		// on another server.
		acquireFarBell: acquire(freeBell("?")),
		release: `UPDATE ` + t + ` SET expires_at = UTC_TIMESTAMP(6), token = ` + noToken + `
WHERE name = ? AND token = ? AND expires_at > UTC_TIMESTAMP(6)`,
		releaseNoBell: fmt.Sprintf(`UPDATE `+t+` SET expires_at = UTC_TIMESTAMP(6) - INTERVAL %d MICROSECOND, token = `+noToken+`
WHERE name = ? AND token = ? AND expires_at > UTC_TIMESTAMP(6)`, staleBell.Microseconds()),
		// A forced release keeps the key for no one in line: the holder's
		// doorbell is freed by a KILL, which the server completes later.
		forceRelease: fmt.Sprintf(`UPDATE `+t+` SET expires_at = UTC_TIMESTAMP(6) - INTERVAL %d MICROSECOND, token = `+noToken+`
WHERE name = ? AND expires_at > UTC_TIMESTAMP(6)`, staleBell.Microseconds()),
		// A holder's metadata changes only while its lease is unexpired;
		// LAST_INSERT_ID(fence) makes the reply carry the (non-zero) fence
		// when the row matched, whether or not its value changed, and 0
		// when it did not (see SetMetadata).
		setMetadata: `UPDATE ` + t + ` SET metadata = ?, fence = LAST_INSERT_ID(fence)
WHERE name = ? AND token = ? AND expires_at > UTC_TIMESTAMP(6)`,
		setSharedMetadata: `UPDATE ` + holdersTable(t) + ` SET metadata = ?, fence = LAST_INSERT_ID(fence)
WHERE name = ? AND token = ? AND expires_at > UTC_TIMESTAMP(6)`,
		held: `SELECT (SELECT COUNT(*) FROM ` + t + ` WHERE name = ? AND token = ? AND expires_at > UTC_TIMESTAMP(6))
  + (SELECT COUNT(*) FROM ` + holdersTable(t) + ` WHERE name = ? AND token = ? AND expires_at > UTC_TIMESTAMP(6))`,
		// Rows of fence 0 were made for a shared request and never granted.
		// The row keeps its last exclusive holder, who held last unless a
		// shared or limited holder ended after it (shared_until); a release
		// clears the token, an expiry leaves it.
		listKeys: `SELECT name, fence, token, owner, metadata, TIMESTAMPDIFF(MICROSECOND, '1970-01-01', acquired_at),
  GREATEST(expires_at, shared_until) > UTC_TIMESTAMP(6), shared_until <= expires_at, token <> ` + noToken + `,
  TIMESTAMPDIFF(MICROSECOND, UTC_TIMESTAMP(6), GREATEST(expires_at, shared_until))
FROM ` + t + ` WHERE LEFT(name, ?) = ? AND fence > 0 ORDER BY name`,
		list: `SELECT ` + holderCols + `, 0, 0 FROM ` + t + ` WHERE LEFT(name, ?) = ? AND expires_at > UTC_TIMESTAMP(6)
UNION ALL
SELECT ` + holderCols + `, 1, share_limit FROM ` + holdersTable(t) + ` WHERE LEFT(name, ?) = ? AND expires_at > UTC_TIMESTAMP(6)`,
	}
}

// writerMark is dlock.WriterMark in microseconds, for the statements.
var writerMark = fmt.Sprint(dlock.WriterMark.Microseconds())

// noToken replaces the owner token of a released lease. UTC_TIMESTAMP is the
// time a statement started, so an extension that started before a release
// and waited for its row lock would otherwise find the row still "live" by
// its own clock, and revive a released (or force-released) lease for the
// old holder. With the token gone it matches nothing. No random token is
// all zeros (2^-128).
const noToken = "X'00000000000000000000000000000000'"

// MySQL error numbers handled here.
const (
	errNoSuchTable  = 1146
	errNoSuchColumn = 1054
	errDeadlock     = 1213
	// errWsrepNotReady is ER_UNKNOWN_COM_ERROR, which a Galera node answers
	// ("WSREP has not yet prepared node for application use") while it is
	// outside the primary component or not synced.
	errWsrepNotReady = 1047
)

// wrap adds context and maps a missing table to dlock.ErrNoSchema.
func (b *Backend) wrap(op string, err error) error { return wrapErr(b.table, op, err) }

func wrapErr(table, op string, err error) error {
	var me *mysql.MySQLError
	if errors.As(err, &me) && me.Number == errNoSuchTable {
		return fmt.Errorf("mysqllock: %s: table %s does not exist: %w (%w)", op, table, dlock.ErrNoSchema, err)
	}
	if errors.As(err, &me) && me.Number == errNoSuchColumn {
		return fmt.Errorf("mysqllock: %s: table %s lacks columns of this version: %w (%w)", op, table, dlock.ErrNoSchema, err)
	}
	if errors.As(err, &me) && me.Number == errWsrepNotReady {
		return fmt.Errorf("%w: %s: %w", ErrGaleraUnavailable, op, err)
	}
	return fmt.Errorf("mysqllock: %s: %w", op, err)
}

// deadlockTries bounds the attempts of a statement or transaction that a
// deadlock rolled back.
const deadlockTries = 10

// retryDeadlock reports whether an attempt that ended in err (try counts
// from 0) is to be made again: err is a deadlock, tries remain and ctx has
// not ended during a short, growing, jittered pause. On Galera a failed
// certification reports a deadlock, and contending writers on several
// nodes fail it again and again unless they spread out.
func retryDeadlock(ctx context.Context, err error, try int) bool {
	if err == nil || !isDeadlock(err) || try >= deadlockTries-1 {
		return false
	}
	d := min(time.Millisecond<<try, 64*time.Millisecond)
	d = d/2 + rand.N(d)
	select {
	case <-ctx.Done():
		return false
	case <-time.After(d):
		return true
	}
}

func isDeadlock(err error) bool {
	var me *mysql.MySQLError
	return errors.As(err, &me) && me.Number == errDeadlock
}

// acquireLease is one attempt at the lease row (see tryLease), run by
// outlive: a statement cut by the caller's deadline may still land on the
// server after the Locker's resolving release has looked for it, and hold
// the key for its TTL; instead, a grant that lands after the caller left is
// released as soon as it is known. A ctx that has ended already fails the
// call before any I/O.
func (b *Backend) acquireLease(ctx context.Context, req dlock.Request, inLine int64) (dlock.Result, error) {
	b.warn.warnOnce(ctx, b.Check)
	if err := ctxend.Err(ctx); err != nil {
		return dlock.Result{}, b.wrap("acquire", err)
	}
	res, err := outlive(ctx, func(ctx context.Context) (dlock.Result, error) {
		return b.tryLease(ctx, req, inLine)
	}, func(res dlock.Result, _ error) {
		if res.Acquired { // granted to a caller that has gone
			rctx, cancel := context.WithTimeout(context.Background(), statementTimeout)
			if req.Mode == dlock.ModeExclusive {
				_ = b.free(rctx, "release", b.q.release, req.Key, req.Token[:])
			} else {
				_ = b.releaseShared(rctx, req.Key, req.Token)
			}
			cancel()
		}
	})
	if callerLeft(err) {
		return dlock.Result{}, b.wrap("acquire", err)
	}
	return res, err
}

// outlive runs f under a context of its own (ctx's values, bounded by
// statementTimeout) and returns its result, or ctx's error as soon as ctx
// ends (or at once if it has ended): a statement that the driver cuts when
// its context ends may still land on the server, at a time nobody knows.
// When the caller has left, left gets f's result once f is done.
func outlive[T any](ctx context.Context, f func(context.Context) (T, error), left func(T, error)) (T, error) {
	if ctx.Done() == nil {
		return f(ctx)
	}
	type outcome struct {
		v   T
		err error
	}
	var mu sync.Mutex
	gone := false
	done := make(chan outcome, 1)
	go func() {
		sctx, cancel := context.WithTimeout(context.WithoutCancel(ctx), statementTimeout)
		v, err := f(sctx)
		cancel()
		mu.Lock()
		if !gone {
			done <- outcome{v, err}
			mu.Unlock()
			return
		}
		mu.Unlock()
		if left != nil {
			left(v, err)
		}
	}()
	var zero T
	if err := ctxend.Err(ctx); err != nil {
		mu.Lock()
		defer mu.Unlock()
		select {
		case o := <-done:
			return o.v, o.err
		default:
		}
		gone = true
		return zero, leftError{err}
	}
	select {
	case o := <-done:
		return o.v, o.err
	case <-ctx.Done():
	}
	mu.Lock()
	defer mu.Unlock()
	select {
	case o := <-done:
		return o.v, o.err
	default:
	}
	gone = true
	return zero, leftError{ctx.Err()}
}

// tryLease is one attempt at the lease row. With doorbells, inLine is
// the session holding this request's doorbell (0 if none): the lease is not
// taken while anyone else holds a fresh doorbell (see newQueries).
func (b *Backend) tryLease(ctx context.Context, req dlock.Request, inLine int64) (dlock.Result, error) {
	if req.Mode != dlock.ModeExclusive {
		return b.tryShared(ctx, req, inLine)
	}
	ttl := req.TTL.Microseconds()
	q := b.q.acquire
	args := []any{req.Key, req.Token[:], req.Owner, ttl, req.Metadata,
		req.Token[:], req.Owner, req.Metadata, ttl}
	if b.bells() {
		q = b.q.acquireBell
		var bell any = b.bell.name(req.Key)
		if b.farBells() {
			q, bell = b.q.acquireFarBell, b.bellHolder(ctx, req.Key)
		}
		args = append(args[:5:5], bell, inLine, inLine,
			req.Token[:], req.Owner, req.Metadata, ttl)
	}
	var res sql.Result
	var err error
	// A deadlock rolls the statement back, so it is safe to repeat; they
	// happen when first inserts of one key race.
	for try := 0; ; try++ {
		res, err = b.db.ExecContext(ctx, q, args...)
		if !retryDeadlock(ctx, err, try) {
			break
		}
	}
	if err != nil {
		return dlock.Result{}, b.wrap("acquire", err)
	}
	fence, err := res.LastInsertId()
	if err != nil {
		return dlock.Result{}, b.wrap("acquire", err)
	}
	if fence > 0 {
		return dlock.Result{Acquired: true, Fence: uint64(fence)}, nil
	}
	// Insert id 0: either the row was not taken, or a trigger on the table
	// wrote another table, and MariaDB then reports 0 for a statement that
	// did take the row (audit triggers, pt-online-schema-change). The row
	// decides: our token (128 random bits) in an unexpired lease is proof of
	// a grant.
	st, ok, err := readState(ctx, b.db, b.sq.state, req.Key, nil)
	if err != nil {
		// The outcome is unknown; the Locker releases our token.
		return dlock.Result{}, b.wrap("acquire", err)
	}
	if !ok {
		return dlock.Result{Holder: dlock.LockInfo{Key: req.Key}}, nil
	}
	return b.exclusiveRefused(ctx, req, st)
}

// Extend implements dlock.Backend with one UPDATE and one SELECT per distinct
// TTL among the exclusive leases, and one transaction per distinct TTL among
// the shared and limited ones.
func (b *Backend) Extend(ctx context.Context, leases []dlock.Lease) ([]error, error) {
	if err := b.checkPool(); err != nil {
		return nil, err
	}
	excl, shared := map[time.Duration][]int{}, map[time.Duration][]int{}
	for i, l := range leases {
		if _, ok := b.nonExcl.Load(l.Token); ok {
			shared[l.TTL] = append(shared[l.TTL], i)
		} else {
			excl[l.TTL] = append(excl[l.TTL], i)
		}
	}
	errs := make([]error, len(leases))
	for ttl, idx := range shared {
		if err := b.extendShared(ctx, leases, idx, ttl, errs); err != nil {
			return nil, err
		}
	}
	for ttl, idx := range excl {
		names := make([]any, len(idx))
		tokens := make([]any, len(idx))
		for j, i := range idx {
			names[j] = leases[i].Key
			tokens[j] = leases[i].Token[:]
		}
		in := placeholders(len(idx))
		args := append(append([]any{ttl.Microseconds()}, names...), tokens...)
		if _, err := b.db.ExecContext(ctx, `UPDATE `+b.table+
			` SET expires_at = UTC_TIMESTAMP(6) + INTERVAL ? MICROSECOND
WHERE name IN (`+in+`) AND token IN (`+in+`) AND expires_at > UTC_TIMESTAMP(6)`, args...); err != nil {
			return nil, b.wrap("extend", err)
		}
		// Confirm by reading rather than by counting affected rows, which
		// depend on clientFoundRows and on whether the value changed.
		rows, err := b.query(ctx, `SELECT `+holderCols+`, 0, 0 FROM `+b.table+` WHERE name IN (`+in+`)`, names...)
		if err != nil {
			return nil, b.wrap("extend", err)
		}
		got := make(map[string]holder, len(rows))
		for _, r := range rows {
			got[r.Key] = r
		}
		for _, i := range idx {
			r, ok := got[leases[i].Key]
			if !ok || r.Token != leases[i].Token || r.remaining <= 0 {
				errs[i] = dlock.ErrNotHeld
				b.ring(ctx, leases[i].Key, leases[i].Token) // a lost lease keeps no doorbell
				continue
			}
			b.renewedBell(leases[i].Token, ttl)
		}
	}
	return errs, nil
}

// Release implements dlock.Backend. The lease is freed before the doorbell
// rings, so that the woken waiter finds it free. The release goes ahead
// even if ctx ends (or has ended) first: ctx bounds only the wait for its
// answer, and the error is then ctx's.
//
// A lease granted without its doorbell (another session held the bell: a
// stalled former holder) wakes nobody, so it is released as long past: the
// acquisition statement then keeps it for no one in line. A lease granted
// with its doorbell is released as now even if the bell's session has
// ended since (KILL, a cut connection): whoever holds the bell then took it
// after the grant, so it is a waiter first in line, which looks at the lease
// often (bellPoll) and for staleBell is the only one that may take it.
// Released as long past, the lease would go to its releasing client, which
// takes it straight back without the doorbell, and again at every release.
//
// A shared or limited hold is released in a transaction on the key's row
// (see releaseShared). A token that this Backend does not know as such (an
// acquisition whose outcome was unknown) is looked for there when it holds
// no exclusive lease.
func (b *Backend) Release(ctx context.Context, key string, token dlock.Token) error {
	if err := b.checkPool(); err != nil {
		return err
	}
	if _, ok := b.nonExcl.Load(token); ok {
		_, err := outlive(ctx, func(ctx context.Context) (struct{}, error) {
			return struct{}{}, b.releaseShared(ctx, key, token)
		}, nil)
		if callerLeft(err) {
			err = b.wrap("release", err)
		}
		return err
	}
	q := b.q.release
	belled := b.unbell(token)
	if b.bells() && !belled {
		q = b.q.releaseNoBell
	}
	if belled && b.handing() {
		if err, ok := b.handOff(ctx, key, token); ok {
			return err
		}
	}
	_, err := outlive(ctx, func(ctx context.Context) (struct{}, error) {
		err := b.free(ctx, "release", q, key, token[:])
		if errors.Is(err, dlock.ErrNotHeld) {
			err = b.releaseIfShared(ctx, key, token)
		}
		b.ring(ctx, key, token)
		return struct{}{}, err
	}, nil)
	if callerLeft(err) {
		err = b.wrap("release", err)
	}
	return err
}

// ForceRelease implements dlock.ForceReleaser: it frees every holder of key,
// in every mode. The exclusive holder's doorbell, if any, is freed by killing
// the session that holds it (which rings the doorbells of that client's
// other keys: a spurious wake-up, no more).
func (b *Backend) ForceRelease(ctx context.Context, key string) error {
	if err := b.claims.CheckOnly(ctx, key); err != nil {
		return b.wrap("force release", err)
	}
	excl, err := b.forceRelease(ctx, key)
	if excl && b.bell != nil {
		_ = b.bell.ForceRelease(ctx, key)
	}
	return err
}

// free runs a releasing UPDATE; no affected row means the key was not held
// (the UPDATE always changes expires_at when it matches).
func (b *Backend) free(ctx context.Context, op, q string, args ...any) error {
	res, err := b.db.ExecContext(ctx, q, args...)
	if err != nil {
		return b.wrap(op, err)
	}
	n, err := res.RowsAffected()
	if err != nil {
		return b.wrap(op, err)
	}
	if n == 0 {
		return dlock.ErrNotHeld
	}
	return nil
}

// SetMetadata implements dlock.MetadataSetter: one UPDATE of the holder's
// row (the lock table's for an exclusive lease, the holders table's for a
// shared or limited one) that matches only while its lease is unexpired by
// the server's clock. A token that this Backend does not know as shared is
// looked for in the lock table first, then in the holders table, as
// Release does; a token is in one of them only.
func (b *Backend) SetMetadata(ctx context.Context, key string, token dlock.Token, metadata string) error {
	qs := []string{b.q.setMetadata, b.q.setSharedMetadata}
	if _, ok := b.nonExcl.Load(token); ok {
		qs = qs[1:]
	}
	for _, q := range qs {
		set, err := setMetadata(ctx, b.db, q, key, token, metadata)
		if err != nil {
			return b.wrap("set metadata", err)
		}
		if set {
			return nil
		}
	}
	// No fence in the reply: either no row matched, or a trigger on the
	// table hid it (see tryLease). A lease is never revived, so one held
	// now was held when the UPDATE ran, and the UPDATE matched it.
	var n int
	if err := b.db.QueryRowContext(ctx, b.q.held, key, token[:], key, token[:]).Scan(&n); err != nil {
		return b.wrap("set metadata", err)
	}
	if n == 0 {
		return dlock.ErrNotHeld
	}
	return nil
}

// setMetadata runs an UPDATE of a holder's metadata that sets
// LAST_INSERT_ID(fence) on the row it matches, and reports whether it
// matched one: the affected-row count cannot tell (it is 0 when the value
// is unchanged, and clientFoundRows changes it).
func setMetadata(ctx context.Context, ex execer, q, key string, token dlock.Token, metadata string) (bool, error) {
	var res sql.Result
	var err error
	// The journal's trigger on the holders table locks the key's row after
	// the holder's, where grants lock the key's first: a deadlock rolls
	// the statement back, so it is safe to repeat.
	for try := 0; ; try++ {
		res, err = ex.ExecContext(ctx, q, metadata, key, token[:])
		if err == nil || !isDeadlock(err) || try == 4 {
			break
		}
	}
	if err != nil {
		return false, err
	}
	id, err := res.LastInsertId()
	return id > 0, err
}

// List implements dlock.Lister: every holder in every mode, ordered by key,
// then fence.
func (b *Backend) List(ctx context.Context, prefix string) ([]dlock.LockInfo, error) {
	rows, err := b.query(ctx, b.q.list, len(prefix), []byte(prefix), len(prefix), []byte(prefix))
	if err != nil {
		return nil, b.wrap("list", err)
	}
	out := make([]dlock.LockInfo, len(rows))
	for i, r := range rows {
		out[i] = r.LockInfo
	}
	sort.Slice(out, func(i, j int) bool {
		if out[i].Key != out[j].Key {
			return out[i].Key < out[j].Key
		}
		return out[i].Fence < out[j].Fence
	})
	return out, nil
}

type holder struct {
	dlock.LockInfo
	remaining time.Duration
}

// query runs a SELECT of holderCols, then whether the row is a shared or
// limited holder's, and its limit.
func (b *Backend) query(ctx context.Context, q string, args ...any) ([]holder, error) {
	rows, err := b.db.QueryContext(ctx, q, args...)
	if err != nil {
		return nil, err
	}
	defer rows.Close()
	now := time.Now()
	var out []holder
	for rows.Next() {
		var h holder
		var name, token []byte
		var acquiredUs, remainingUs int64
		var shared bool
		if err := rows.Scan(&name, &token, &h.Owner, &h.Fence, &h.Metadata, &acquiredUs, &remainingUs, &shared, &h.Limit); err != nil {
			return nil, err
		}
		if shared {
			h.Mode = sharedMode(h.Limit)
		}
		h.Key = string(name)
		copy(h.Token[:], token)
		h.AcquiredAt = time.UnixMicro(acquiredUs)
		h.remaining = time.Duration(remainingUs) * time.Microsecond
		h.ExpiresAt = now.Add(h.remaining)
		out = append(out, h)
	}
	return out, rows.Err()
}
