// Package pglock is a dlock.Backend on PostgreSQL (14 or later) through a
// github.com/jackc/pgx/v5 *pgxpool.Pool that the caller owns and the backend
// never closes. It offers two strategies.
//
// # Lease (New, the default)
//
// One row per key in a table (DefaultTable), holding the owner token, a
// fencing counter and the lease's expiry computed by the server
// (clock_timestamp(), so client clocks and session TimeZones do not matter).
// Acquisition is one INSERT … ON CONFLICT … DO UPDATE … WHERE (free) RETURNING
// statement that bumps the fencing counter; renewal is one UPDATE for all the
// leases of a Locker (unnest of arrays) that checks each owner token; release
// is an owner-checked UPDATE that also sends a NOTIFY. Rows are never deleted,
// so fences never go back.
//
// The lease strategy grants every mode (dlock.Sharer): shared (a reader of a
// reader-writer lock) and limited (a counting semaphore) holders each have a
// row of their own in a second table, and the key's row summarises them (the
// latest expiry among them, their limit, the writer mark), so that an
// exclusive acquisition still decides, in its one statement, from that row
// alone. A shared or limited acquisition locks the key's row, then decides
// from its holders, in two statements sent in one round trip (one implicit
// transaction); their renewals and releases do the same. The key's fencing
// counter, in its row, serves every mode.
//
// Waiters (dlock.Waiter) LISTEN on one connection per Backend, shared by all
// its waiting acquisitions, and are woken by the release's NOTIFY; without a
// NOTIFY (a lease that expired) they wake when the holder's lease runs out.
// Waiters queue in a second table, and for a short grace period
// (DefaultGrace) after a lease ends only the waiter that has waited longest
// may take it: a client that releases a key cannot barge straight back in
// ahead of the clients it woke, so contended keys are shared fairly. A waiter
// that died is skipped after the grace period. Queued readers do not hold
// back a reader (they may all hold the key together), and while a writer
// mark keeps readers out they do not count at all: the release names, and
// the key goes to, the first waiter that is not a reader; the readers come
// next, once the writer has had the key. An exclusive release whose first
// waiter is exclusive grants it the lease in the release's own statement
// (one durable commit per handoff) and wakes only that waiter; a waiter that
// dies while queued can be handed the key until its entry lapses, within
// seconds, and the key then stays held until that lease ends.
//
// The lease strategy works through any pool or proxy (PgBouncer in any mode:
// every operation is one autocommit statement, though LISTEN needs session
// pooling: in transaction pooling waiters fall back to sleeping until the
// lease ends). A crashed holder's lock frees itself when its TTL runs out.
//
// # Advisory (NewAdvisory)
//
// Session-level advisory locks (pg_try_advisory_lock, pg_advisory_lock) held
// by server sessions that the Advisory opens itself. It grants exclusive and
// shared acquisitions (pg_advisory_lock_shared), not limited ones (see
// Advisory.SupportsMode). See Advisory for its guarantees: a crashed
// holder's locks are freed the moment the server sees its connection close,
// a session that ends is reported at once, waiting happens in the server
// (first come, first served; a writer waiting among readers asks again every
// 2 s, so that a frozen one cannot keep them out), but it needs a real
// session: it is unsafe behind a pooler in transaction or statement mode
// (PgBouncer's default for many deployments), which pglock detects where it
// can.
//
// # Both strategies
//
// Pool size: the connections that dlock keeps open (the LISTEN connection
// of waiters and watches, the advisory sessions) are opened with the pool's configuration but outside
// the pool, so they never take one of the user's connections and any pool
// size works, 1 included. Statements on the pool are short, one at a time
// per call.
//
// Elections: both strategies are a dlock.Watcher and a dlock.MetadataSetter.
// Every grant, release and metadata change sends a NOTIFY (on a channel
// named after the table, DefaultTable's being "dlock_locks" for the lease's
// releases and "dlock_locks/watch" for the rest), which a watch receives on
// its Backend's or Advisory's LISTEN connection; the end of an advisory
// session is notified by the Advisory that sees it (see Advisory.Watch).
// An expiry of a lease is not notified: no statement sees it happen.
// Both are also a dlock.HolderWatcher: each change bumps the key's change
// counter and carries it, with what changed, in its NOTIFY, so that a
// watch applies every change in commit order and tells one it missed.
//
// Durability: every statement that writes a logged table (a lease grant
// and its fence, a renewal, a release, an advisory epoch, Migrate's DDL)
// commits with synchronous_commit on, set locally to its own transaction,
// whatever the server's, the database's or the role's default: a crash
// never makes the server forget a fence it handed out. The advisory
// strategy's grants write only unlogged tables, which a crash empties with
// the locks they describe; their fences carry a durable epoch that the
// first grant after a crash raises (see Advisory). What dlock cannot set per transaction (fsync, full_page_writes,
// asynchronous standbys that a failover may promote) Check reports, and
// Migrate logs to Options.Logger.
//
// Limits: the table name is checked at New (see Options.Table) so that every
// derived name fits PostgreSQL's 63-byte identifiers; keys of any length
// dlock accepts; any TTL dlock accepts.
//
//	pool, _ := pgxpool.New(ctx, "postgres://app@db/app")
//	b, err := pglock.New(pool, nil)
//	err = b.Migrate(ctx) // once: creates the tables
//	locker := dlock.New(b, nil)
//	defer b.Close()
//
// The key is stored as bytea, byte for byte; owner and metadata are text, so
// they must not contain NUL bytes (PostgreSQL's text cannot hold them).
package pglock

import (
	"context"
	"crypto/sha256"
	_ "embed"
	"encoding/hex"
	"errors"
	"fmt"
	"log/slog"
	"regexp"
	"strings"
	"time"

	"github.com/dlock-dev/dlock"
	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgconn"
	"github.com/jackc/pgx/v5/pgxpool"
)

// DefaultTable is the table used when Options.Table is empty. The waiter
// queue, the shared and limited holders, the advisory strategy's tables and
// the keys' strategies are named after it with the suffixes "_waiters",
// "_holders", "_session", "_readers", "_epochs", "_epoch_now" and "_claims".
const DefaultTable = "dlock_locks"

// DefaultGrace is the lease strategy's grace period when Options.Grace is 0.
const DefaultGrace = 500 * time.Millisecond

// Options configure a Backend or an Advisory. The zero value (or nil) means
// all defaults.
type Options struct {
	// Table is the lock table, optionally qualified by schema
	// ("locks.dlock_locks"). The table part is 1..50 of [A-Za-z0-9_] not
	// starting with a digit (so that the derived tables' names fit
	// PostgreSQL's 63-byte limit); the schema part 1..63 of the same. Names
	// are quoted, so case matters. The default is DefaultTable.
	Table string

	// Grace is how long after a lease ends (released or expired) only the
	// longest-waiting live waiter may take it. It must cover a NOTIFY and a
	// round trip; longer means fairer handoffs under load, but also that a
	// waiter which died leaves the key unusable for that long after each
	// release (until its queue entry lapses, within seconds). Negative turns
	// the queue off, and with it the handoff in the release: a free lease
	// goes to whoever asks first. The default is DefaultGrace. The advisory
	// strategy ignores it.
	Grace time.Duration

	// Logger receives what Migrate finds wrong with the server's settings
	// (see Check) and the loss of advisory sessions. The default discards
	// everything.
	Logger *slog.Logger
}

// logger returns o's Logger, or one that discards everything.
func logger(o Options) *slog.Logger {
	if o.Logger != nil {
		return o.Logger
	}
	return slog.New(slog.DiscardHandler)
}

// dial opens a connection outside pool with pool's configuration, running
// the pool's BeforeConnect and AfterConnect hooks as the pool would: the
// connections that dlock keeps (advisory sessions, the LISTEN connection)
// never take one of the user's pool connections.
func dial(ctx context.Context, pool *pgxpool.Pool) (*pgx.Conn, error) {
	cfg := pool.Config()
	cc := cfg.ConnConfig
	if cfg.BeforeConnect != nil {
		if err := cfg.BeforeConnect(ctx, cc); err != nil {
			return nil, err
		}
	}
	conn, err := pgx.ConnectConfig(ctx, cc)
	if err != nil {
		return nil, err
	}
	if cfg.AfterConnect != nil {
		if err := cfg.AfterConnect(ctx, conn); err != nil {
			closeConn(conn)
			return nil, err
		}
	}
	return conn, nil
}

var (
	identRE = regexp.MustCompile(`^[A-Za-z_][A-Za-z0-9_]*$`)
)

// tables holds the quoted names of the tables of one configuration.
type tables struct {
	base    string // as given (or DefaultTable), unquoted
	lease   string
	waiters string
	holders string // shared and limited holders of the lease strategy
	session string
	readers string // shared holders of the advisory strategy
	epochs  string // every fencing epoch of the advisory strategy (logged)
	epoch   string // the epoch of the unlogged tables' rows (unlogged)
	claims  string // the strategy of each key
	channel string // NOTIFY channel of the lease strategy's releases
	watch   string // NOTIFY channel of the other changes that watches see
}

// parseTable validates name ("" for DefaultTable) and quotes the tables
// derived from it. It does no I/O.
func parseTable(name string) (tables, error) {
	if name == "" {
		name = DefaultTable
	}
	bad := func(why string) (tables, error) {
		return tables{}, fmt.Errorf("%w: pglock: table %q: %s", dlock.ErrInvalidOption, name, why)
	}
	parts := strings.Split(name, ".")
	if len(parts) > 2 {
		return bad("more than two parts")
	}
	for i, p := range parts {
		limit := 63
		if i == len(parts)-1 {
			limit = 50
		}
		if !identRE.MatchString(p) || len(p) > limit {
			return bad("each part must be [A-Za-z_][A-Za-z0-9_]*, the table at most 50 bytes and the schema 63")
		}
	}
	prefix := ""
	if len(parts) == 2 {
		prefix = `"` + parts[0] + `".`
	}
	t := parts[len(parts)-1]
	tb := tables{
		base:    name,
		lease:   prefix + `"` + t + `"`,
		waiters: prefix + `"` + t + `_waiters"`,
		holders: prefix + `"` + t + `_holders"`,
		session: prefix + `"` + t + `_session"`,
		readers: prefix + `"` + t + `_readers"`,
		epochs:  prefix + `"` + t + `_epochs"`,
		epoch:   prefix + `"` + t + `_epoch_now"`,
		claims:  prefix + `"` + t + `_claims"`,
		channel: channelName(name),
		// "/" is in no table name, so no other table's release channel
		// has this name.
		watch: channelName(name + "/watch"),
	}
	return tb, nil
}

// channelName is name, or a digest of it where name is longer than a
// channel name may be (63 bytes).
func channelName(name string) string {
	if len(name) <= 63 {
		return name
	}
	sum := sha256.Sum256([]byte(name))
	return "dlock_" + hex.EncodeToString(sum[:16])
}

// literal quotes s as an SQL string literal.
func literal(s string) string { return "'" + strings.ReplaceAll(s, "'", "''") + "'" }

//go:embed schema.sql
var schemaSQL string

// Schema returns the DDL that Migrate runs for table ("" for DefaultTable):
// schema.sql with the table names substituted. The error matches
// dlock.ErrInvalidOption for a bad name.
func Schema(table string) (string, error) {
	tb, err := parseTable(table)
	if err != nil {
		return "", err
	}
	return tb.schema(), nil
}

// schema substitutes the table names into schema.sql, where every table is
// spelled "dlock_locks…" (quoted).
func (tb tables) schema() string {
	return strings.ReplaceAll(schemaSQL, `"`+DefaultTable, strings.TrimSuffix(tb.lease, `"`))
}

// migrate creates the tables, serialised by an advisory transaction lock
// because concurrent CREATE TABLE IF NOT EXISTS can fail on the catalog's
// unique indexes, in a transaction that commits durably whatever the
// server's default. Then it logs what Check finds.
func migrate(ctx context.Context, pool *pgxpool.Pool, tb tables, log *slog.Logger) error {
	ddl := tb.schema()
	err := pgx.BeginFunc(ctx, pool, func(tx pgx.Tx) error {
		id := int64(hashKey("migrate\x00" + tb.base))
		if _, err := tx.Exec(ctx, "SELECT pg_advisory_xact_lock($1), set_config('synchronous_commit', 'on', true)", id); err != nil {
			return err
		}
		// No arguments: the simple protocol, which runs several statements.
		_, err := tx.Exec(ctx, ddl)
		return err
	})
	if err != nil {
		return fmt.Errorf("pglock: migrate %s: %w", tb.lease, err)
	}
	findings, err := Check(ctx, pool)
	if err != nil {
		log.Warn("pglock: could not check the server's settings", "err", err)
	}
	for _, f := range findings {
		level := slog.LevelWarn
		if f.Severity == SeverityInfo {
			level = slog.LevelInfo
		}
		log.Log(ctx, level, "pglock: "+f.Message, "setting", f.Setting)
	}
	return nil
}

// PostgreSQL error codes handled here.
const (
	codeUndefinedTable  = "42P01"
	codeUndefinedColumn = "42703"
	codeQueryCanceled   = "57014"
	codeLockTimeout     = "55P03" // lock_not_available: lock_timeout ran out
)

// wrapErr adds context and maps a missing table to dlock.ErrNoSchema.
func wrapErr(tb tables, op string, err error) error {
	var pe *pgconn.PgError
	if errors.As(err, &pe) && pe.Code == codeUndefinedTable {
		return fmt.Errorf("pglock: %s: table %s does not exist: %w (%w)", op, tb.lease, dlock.ErrNoSchema, err)
	}
	if errors.As(err, &pe) && pe.Code == codeUndefinedColumn {
		return fmt.Errorf("pglock: %s: the tables of %s lack a column of this version: %w (%w)", op, tb.lease, dlock.ErrNoSchema, err)
	}
	return fmt.Errorf("pglock: %s: %w", op, err)
}

// us is d in whole microseconds, the unit of the SQL below.
func us(d time.Duration) int64 { return d.Microseconds() }

// hashKey is the first 8 bytes of SHA-256("dlock:" + s), big-endian.
func hashKey(s string) uint64 {
	sum := sha256.Sum256([]byte("dlock:" + s))
	var h uint64
	for _, b := range sum[:8] {
		h = h<<8 | uint64(b)
	}
	return h
}

// holderRow is what the statements return about a key's holder.
type holderRow struct {
	name            []byte
	token           []byte
	owner, metadata *string
	fence           *int64
	acquiredAt      *time.Time
	remainingUs     *int64 // nil for session locks
}

// info converts a holder row; now is the local time the row was read.
func (h holderRow) info(key string, now time.Time) (dlock.LockInfo, time.Duration) {
	li := dlock.LockInfo{Key: key}
	if h.name != nil {
		li.Key = string(h.name)
	}
	copy(li.Token[:], h.token)
	if h.owner != nil {
		li.Owner = *h.owner
	}
	if h.metadata != nil {
		li.Metadata = *h.metadata
	}
	if h.fence != nil {
		li.Fence = uint64(*h.fence)
	}
	if h.acquiredAt != nil {
		li.AcquiredAt = *h.acquiredAt
	}
	var rem time.Duration
	if h.remainingUs != nil {
		rem = time.Duration(*h.remainingUs) * time.Microsecond
		li.ExpiresAt = now.Add(rem)
	}
	return li, max(rem, 0)
}
