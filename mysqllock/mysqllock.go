// Package mysqllock is a dlock.Backend on MySQL and MariaDB: the lease
// strategy, one row per key in an InnoDB table, timed by the server's clock.
//
// Acquisition is one INSERT … ON DUPLICATE KEY UPDATE that takes the row only
// if its lease has expired (by UTC_TIMESTAMP(6) on the server) and bumps the
// key's fencing counter; extension and release are UPDATEs that check the
// owner token. Rows are never deleted, so fencing tokens never go back.
// The strategy works through connection pools, proxies and Galera, and a
// crashed holder's lock frees itself when its TTL runs out.
//
//	db, _ := sql.Open("mysql", "user:pass@tcp(host:3306)/app")
//	b, err := mysqllock.New(db, nil)
//	err = b.Migrate(ctx) // once: creates the table
//	locker := dlock.New(b, nil)
package mysqllock

import (
	"context"
	"database/sql"
	_ "embed"
	"errors"
	"fmt"
	"regexp"
	"sort"
	"strings"
	"time"

	"github.com/dlock-dev/dlock"
	"github.com/go-sql-driver/mysql"
)

// DefaultTable is the table used when Options.Table is empty.
const DefaultTable = "dlock_locks"

// DB is what the Backend needs of a *sql.DB (or a *sql.Conn, or a wrapper).
// The caller owns it; the Backend never closes it.
type DB interface {
	ExecContext(ctx context.Context, query string, args ...any) (sql.Result, error)
	QueryContext(ctx context.Context, query string, args ...any) (*sql.Rows, error)
}

// Options configure a Backend. The zero value (or nil) means all defaults.
type Options struct {
	// Table is the lock table, optionally qualified by database
	// ("locks.dlock_locks"). Each part is 1..64 of [A-Za-z0-9_$], not all
	// digits. The default is DefaultTable.
	Table string
}

// Backend is the lease strategy on MySQL/MariaDB. It is safe for concurrent
// use.
type Backend struct {
	db    DB
	table string // quoted
	q     queries
}

var (
	_ dlock.Backend       = (*Backend)(nil)
	_ dlock.Lister        = (*Backend)(nil)
	_ dlock.ForceReleaser = (*Backend)(nil)
)

//go:embed schema.sql
var schemaSQL string

var identRE = regexp.MustCompile(`^[A-Za-z0-9_$]{1,64}$`)
var digitsRE = regexp.MustCompile(`^[0-9]+$`)

// New returns a Backend over db. It does no I/O; call Migrate once to create
// the table. The error matches dlock.ErrInvalidOption for a bad table name.
func New(db DB, opts *Options) (*Backend, error) {
	table, err := checkArgs(db == nil, opts)
	if err != nil {
		return nil, err
	}
	return &Backend{db: db, table: table, q: newQueries(table)}, nil
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
	return strings.Join(parts, "."), nil
}

// Schema returns the DDL that Migrate runs for table ("" for DefaultTable):
// schema.sql with the table name substituted.
func Schema(table string) (string, error) {
	q, err := quoteTable(table)
	if err != nil {
		return "", err
	}
	return schemaFor(q), nil
}

// schemaFor substitutes the quoted table name (which names the lease table
// and prefixes the session strategies' tables) into schema.sql.
func schemaFor(quoted string) string {
	return strings.ReplaceAll(schemaSQL, "`"+DefaultTable, strings.TrimSuffix(quoted, "`"))
}

// execScript runs the statements of a schema one by one (the driver does
// not run several per call unless the DSN allows it). Statements end with
// ";" at the end of a line.
func execScript(ctx context.Context, db DB, script string) error {
	for _, stmt := range strings.Split(script, ";\n") {
		if strings.TrimSpace(stmt) != "" {
			if _, err := db.ExecContext(ctx, stmt); err != nil {
				return err
			}
		}
	}
	return nil
}

// Migrate creates the lock tables of every strategy if they do not exist. It
// is safe to run concurrently and repeatedly.
func (b *Backend) Migrate(ctx context.Context) error {
	if err := execScript(ctx, b.db, schemaFor(b.table)); err != nil {
		return fmt.Errorf("mysqllock: migrate %s: %w", b.table, err)
	}
	return nil
}

type queries struct {
	acquire, holder, release, forceRelease, list string
}

// The acquisition statement assigns columns in this order because MySQL
// evaluates ON DUPLICATE KEY UPDATE assignments left to right with later ones
// seeing earlier results: every assignment tests expires_at, which is
// assigned last. LAST_INSERT_ID(x) makes the reply carry the new fence when
// the row is taken and 0 when it is not, so that the outcome does not depend
// on affected-row counts (which clientFoundRows changes).
func newQueries(t string) queries {
	const free = "expires_at <= UTC_TIMESTAMP(6)"
	return queries{
		acquire: `INSERT INTO ` + t + ` (name, token, owner, fence, acquired_at, expires_at, metadata)
VALUES (?, ?, ?, LAST_INSERT_ID(1), UTC_TIMESTAMP(6), UTC_TIMESTAMP(6) + INTERVAL ? MICROSECOND, ?)
ON DUPLICATE KEY UPDATE
  token = IF(` + free + `, ?, token),
  owner = IF(` + free + `, ?, owner),
  metadata = IF(` + free + `, ?, metadata),
  acquired_at = IF(` + free + `, UTC_TIMESTAMP(6), acquired_at),
  fence = IF(` + free + `, LAST_INSERT_ID(fence + 1), fence + LAST_INSERT_ID(0)),
  expires_at = IF(` + free + `, UTC_TIMESTAMP(6) + INTERVAL ? MICROSECOND, expires_at)`,
		holder: `SELECT name, token, owner, fence, metadata,
  TIMESTAMPDIFF(MICROSECOND, '1970-01-01', acquired_at), TIMESTAMPDIFF(MICROSECOND, UTC_TIMESTAMP(6), expires_at)
FROM ` + t + ` WHERE name = ?`,
		release: `UPDATE ` + t + ` SET expires_at = '1970-01-01 00:00:00'
WHERE name = ? AND token = ? AND expires_at > UTC_TIMESTAMP(6)`,
		forceRelease: `UPDATE ` + t + ` SET expires_at = '1970-01-01 00:00:00'
WHERE name = ? AND expires_at > UTC_TIMESTAMP(6)`,
		list: `SELECT name, token, owner, fence, metadata,
  TIMESTAMPDIFF(MICROSECOND, '1970-01-01', acquired_at), TIMESTAMPDIFF(MICROSECOND, UTC_TIMESTAMP(6), expires_at)
FROM ` + t + ` WHERE LEFT(name, ?) = ? AND expires_at > UTC_TIMESTAMP(6) ORDER BY name`,
	}
}

// MySQL error numbers handled here.
const (
	errNoSuchTable = 1146
	errDeadlock    = 1213
)

// wrap adds context and maps a missing table to dlock.ErrNoSchema.
func (b *Backend) wrap(op string, err error) error { return wrapErr(b.table, op, err) }

func wrapErr(table, op string, err error) error {
	var me *mysql.MySQLError
	if errors.As(err, &me) && me.Number == errNoSuchTable {
		return fmt.Errorf("mysqllock: %s: table %s does not exist: %w (%w)", op, table, dlock.ErrNoSchema, err)
	}
	return fmt.Errorf("mysqllock: %s: %w", op, err)
}

func isDeadlock(err error) bool {
	var me *mysql.MySQLError
	return errors.As(err, &me) && me.Number == errDeadlock
}

// Acquire implements dlock.Backend.
func (b *Backend) Acquire(ctx context.Context, req dlock.Request) (dlock.Result, error) {
	ttl := req.TTL.Microseconds()
	var res sql.Result
	var err error
	// A deadlock rolls the statement back, so it is safe to repeat; they
	// happen when first inserts of one key race.
	for try := 0; ; try++ {
		res, err = b.db.ExecContext(ctx, b.q.acquire,
			req.Key, req.Token[:], req.Owner, ttl, req.Metadata,
			req.Token[:], req.Owner, req.Metadata, ttl)
		if err == nil || !isDeadlock(err) || try == 4 {
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
	// Not taken: report the holder (a failure here is not an outage of the
	// acquisition, whose outcome is known).
	holders, err := b.query(ctx, b.q.holder, req.Key)
	if err != nil || len(holders) == 0 {
		return dlock.Result{Holder: dlock.LockInfo{Key: req.Key}}, nil
	}
	h := holders[0]
	return dlock.Result{Holder: h.LockInfo, Remaining: max(h.remaining, 0)}, nil
}

// Extend implements dlock.Backend with one UPDATE and one SELECT per distinct
// TTL in leases.
func (b *Backend) Extend(ctx context.Context, leases []dlock.Lease) ([]error, error) {
	byTTL := map[time.Duration][]int{}
	for i, l := range leases {
		byTTL[l.TTL] = append(byTTL[l.TTL], i)
	}
	errs := make([]error, len(leases))
	for ttl, idx := range byTTL {
		names := make([]any, len(idx))
		tokens := make([]any, len(idx))
		for j, i := range idx {
			names[j] = leases[i].Key
			tokens[j] = leases[i].Token[:]
		}
		in := "?" + strings.Repeat(", ?", len(idx)-1)
		args := append(append([]any{ttl.Microseconds()}, names...), tokens...)
		if _, err := b.db.ExecContext(ctx, `UPDATE `+b.table+
			` SET expires_at = UTC_TIMESTAMP(6) + INTERVAL ? MICROSECOND
WHERE name IN (`+in+`) AND token IN (`+in+`) AND expires_at > UTC_TIMESTAMP(6)`, args...); err != nil {
			return nil, b.wrap("extend", err)
		}
		// Confirm by reading rather than by counting affected rows, which
		// depend on clientFoundRows and on whether the value changed.
		rows, err := b.query(ctx, `SELECT name, token, owner, fence, metadata,
  TIMESTAMPDIFF(MICROSECOND, '1970-01-01', acquired_at), TIMESTAMPDIFF(MICROSECOND, UTC_TIMESTAMP(6), expires_at)
FROM `+b.table+` WHERE name IN (`+in+`)`, names...)
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
			}
		}
	}
	return errs, nil
}

// Release implements dlock.Backend.
func (b *Backend) Release(ctx context.Context, key string, token dlock.Token) error {
	return b.free(ctx, "release", b.q.release, key, token[:])
}

// ForceRelease implements dlock.ForceReleaser.
func (b *Backend) ForceRelease(ctx context.Context, key string) error {
	return b.free(ctx, "force release", b.q.forceRelease, key)
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

// List implements dlock.Lister.
func (b *Backend) List(ctx context.Context, prefix string) ([]dlock.LockInfo, error) {
	rows, err := b.query(ctx, b.q.list, len(prefix), []byte(prefix))
	if err != nil {
		return nil, b.wrap("list", err)
	}
	out := make([]dlock.LockInfo, len(rows))
	for i, r := range rows {
		out[i] = r.LockInfo
	}
	sort.Slice(out, func(i, j int) bool { return out[i].Key < out[j].Key })
	return out, nil
}

type holder struct {
	dlock.LockInfo
	remaining time.Duration
}

// query runs a SELECT of the holder columns.
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
		if err := rows.Scan(&name, &token, &h.Owner, &h.Fence, &h.Metadata, &acquiredUs, &remainingUs); err != nil {
			return nil, err
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
