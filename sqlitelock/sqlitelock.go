// Package sqlitelock is a dlock.Backend on a local SQLite file (pure Go,
// modernc.org/sqlite): the lease strategy for processes of one host. It is
// the dlock CLI's embedded default store.
//
// The file is opened in WAL mode with a busy timeout; each operation is one
// statement, timed by SQLite's reading of the host clock. Rows are never
// deleted, so fences never go back. Do not put the file on a network
// file system: SQLite's locking is not reliable there.
//
// Two limits of one file on one host (found with the fault harness):
//   - Leases are timed by the host's wall clock, while holders time theirs
//     by the monotonic clock. A step of the system clock (an NTP correction)
//     moves every lease at once: a forward step can free held keys before
//     their holders are told. Keep the clock slewed, not stepped, or guard
//     the resource with the fence.
//   - A process stopped (SIGSTOP, swapped out) in the middle of a write holds
//     SQLite's write lock, and every other process's acquisitions and
//     renewals wait for it up to the busy timeout: their leases can be lost
//     meanwhile (they are told, as for any failed renewal).
package sqlitelock

import (
	"context"
	"database/sql"
	_ "embed"
	"errors"
	"fmt"
	"math/rand/v2"
	"net/url"
	"os"
	"path/filepath"
	"strings"
	"time"

	"github.com/dlock-dev/dlock"
	"modernc.org/sqlite"
	sqlite3 "modernc.org/sqlite/lib"
)

//go:embed schema.sql
var schemaSQL string

// Schema returns the DDL that Migrate runs.
func Schema() string { return schemaSQL }

// now is the current time in Unix microseconds as SQLite reads it; it is the
// same value throughout one statement.
const now = "CAST(unixepoch('now', 'subsec') * 1000000 AS INTEGER)"

const (
	acquireSQL = `INSERT INTO dlock_locks (name, token, owner, fence, acquired_us, expires_us, metadata)
VALUES (?1, ?2, ?3, 1, ` + now + `, ` + now + ` + ?4, ?5)
ON CONFLICT (name) DO UPDATE SET
  token = excluded.token, owner = excluded.owner, fence = fence + 1,
  acquired_us = excluded.acquired_us, expires_us = excluded.expires_us, metadata = excluded.metadata
WHERE expires_us <= excluded.acquired_us
RETURNING fence`
	holderSQL = `SELECT name, token, owner, fence, metadata, acquired_us, expires_us - ` + now + `
FROM dlock_locks WHERE name = ?`
	listSQL = `SELECT name, token, owner, fence, metadata, acquired_us, expires_us - ` + now + `
FROM dlock_locks WHERE expires_us > ` + now + ` AND substr(name, 1, length(?1)) = ?1 ORDER BY name`
	extendSQL       = `UPDATE dlock_locks SET expires_us = ` + now + ` + ? WHERE name = ? AND token = ? AND expires_us > ` + now
	releaseSQL      = `UPDATE dlock_locks SET expires_us = 0 WHERE name = ? AND token = ? AND expires_us > ` + now
	forceReleaseSQL = `UPDATE dlock_locks SET expires_us = 0 WHERE name = ? AND expires_us > ` + now
)

// Backend is the lease strategy on SQLite. It is safe for concurrent use by
// goroutines and by processes sharing the file.
type Backend struct {
	db    *sql.DB
	owned bool // opened by Open: Close closes it
}

var (
	_ dlock.Backend       = (*Backend)(nil)
	_ dlock.Lister        = (*Backend)(nil)
	_ dlock.ForceReleaser = (*Backend)(nil)
)

// Open opens (creating if needed) the SQLite file at path in WAL mode with a
// 10 s busy timeout, creating its directory too. Close the Backend when done.
// It does not create the table: call Migrate.
func Open(path string) (*Backend, error) {
	if path == "" {
		return nil, fmt.Errorf("%w: sqlitelock: empty path", dlock.ErrInvalidOption)
	}
	if err := os.MkdirAll(filepath.Dir(path), 0o700); err != nil {
		return nil, fmt.Errorf("sqlitelock: %w", err)
	}
	q := url.Values{}
	q.Add("_pragma", "busy_timeout(10000)")
	q.Add("_pragma", "journal_mode(WAL)")
	q.Add("_pragma", "synchronous(NORMAL)")
	q.Set("_txlock", "immediate")
	db, err := sql.Open("sqlite", "file:"+(&url.URL{Path: path}).EscapedPath()+"?"+q.Encode())
	if err != nil {
		return nil, fmt.Errorf("sqlitelock: open %s: %w", path, err)
	}
	return &Backend{db: db, owned: true}, nil
}

// New returns a Backend over a database the caller opened with the
// modernc.org/sqlite driver (set a busy timeout). The caller owns db: Close
// leaves it open.
func New(db *sql.DB) *Backend { return &Backend{db: db} }

// Close closes the database if Open opened it.
func (b *Backend) Close() error {
	if !b.owned {
		return nil
	}
	return b.db.Close()
}

// Migrate creates the lock table if it does not exist. Any number of
// processes may call it at once on a new file: it waits for the others as
// long as the busy timeout (10 s with Open), or until ctx ends.
//
// A fresh file starts in rollback-journal mode, and there SQLite answers
// SQLITE_BUSY at once, without waiting, when two connections that both read
// the file try to write it (switching to WAL, creating the table): waiting
// would deadlock them. Migrate therefore reads first (most calls find the
// table and write nothing), creates the table in a transaction that takes
// the write lock at its start (BEGIN IMMEDIATE, which waits), and tries
// again after a short pause when SQLite still answers SQLITE_BUSY.
func (b *Backend) Migrate(ctx context.Context) error {
	deadline := time.Now().Add(migrateBusyTimeout)
	pause := time.Millisecond
	for {
		err := b.migrate(ctx)
		if err == nil || !isBusy(err) || time.Now().After(deadline) {
			if err != nil {
				return fmt.Errorf("sqlitelock: migrate: %w", err)
			}
			return nil
		}
		t := time.NewTimer(pause + time.Duration(rand.Int64N(int64(pause))))
		select {
		case <-ctx.Done():
			t.Stop()
			return fmt.Errorf("sqlitelock: migrate: %w (%w)", ctx.Err(), err)
		case <-t.C:
		}
		pause = min(2*pause, 50*time.Millisecond)
	}
}

// migrateBusyTimeout bounds Migrate's retries, as busy_timeout bounds a wait.
const migrateBusyTimeout = 10 * time.Second

func (b *Backend) migrate(ctx context.Context) error {
	var n int
	err := b.db.QueryRowContext(ctx, `SELECT count(*) FROM sqlite_schema WHERE type = 'table' AND name = 'dlock_locks'`).Scan(&n)
	if err != nil || n > 0 {
		return err
	}
	tx, err := b.db.BeginTx(ctx, nil) // BEGIN IMMEDIATE (Open's _txlock)
	if err != nil {
		return err
	}
	defer tx.Rollback()
	if _, err := tx.ExecContext(ctx, schemaSQL); err != nil {
		return err
	}
	return tx.Commit()
}

// isBusy reports whether err is SQLite's SQLITE_BUSY or SQLITE_LOCKED (with
// any extended code): another connection has the file.
func isBusy(err error) bool {
	var se *sqlite.Error
	if !errors.As(err, &se) {
		return false
	}
	c := se.Code() & 0xff
	return c == sqlite3.SQLITE_BUSY || c == sqlite3.SQLITE_LOCKED
}

func wrap(op string, err error) error {
	var se *sqlite.Error
	if errors.As(err, &se) && se.Code() == sqlite3.SQLITE_ERROR && strings.Contains(se.Error(), "no such table") {
		return fmt.Errorf("sqlitelock: %s: %w (%w)", op, dlock.ErrNoSchema, err)
	}
	return fmt.Errorf("sqlitelock: %s: %w", op, err)
}

// Acquire implements dlock.Backend.
func (b *Backend) Acquire(ctx context.Context, req dlock.Request) (dlock.Result, error) {
	var fence uint64
	err := b.db.QueryRowContext(ctx, acquireSQL, req.Key, req.Token[:], req.Owner, req.TTL.Microseconds(), req.Metadata).Scan(&fence)
	switch {
	case err == nil:
		return dlock.Result{Acquired: true, Fence: fence}, nil
	case !errors.Is(err, sql.ErrNoRows):
		return dlock.Result{}, wrap("acquire", err)
	}
	hs, err := b.query(ctx, holderSQL, req.Key)
	if err != nil || len(hs) == 0 {
		return dlock.Result{Holder: dlock.LockInfo{Key: req.Key}}, nil
	}
	return dlock.Result{Holder: hs[0].LockInfo, Remaining: max(hs[0].remaining, 0)}, nil
}

// Extend implements dlock.Backend in one transaction.
func (b *Backend) Extend(ctx context.Context, leases []dlock.Lease) ([]error, error) {
	tx, err := b.db.BeginTx(ctx, nil)
	if err != nil {
		return nil, wrap("extend", err)
	}
	defer tx.Rollback()
	errs := make([]error, len(leases))
	for i, l := range leases {
		res, err := tx.ExecContext(ctx, extendSQL, l.TTL.Microseconds(), l.Key, l.Token[:])
		if err != nil {
			return nil, wrap("extend", err)
		}
		if n, err := res.RowsAffected(); err != nil {
			return nil, wrap("extend", err)
		} else if n == 0 {
			errs[i] = dlock.ErrNotHeld
		}
	}
	if err := tx.Commit(); err != nil {
		return nil, wrap("extend", err)
	}
	return errs, nil
}

// Release implements dlock.Backend.
func (b *Backend) Release(ctx context.Context, key string, token dlock.Token) error {
	return b.free(ctx, "release", releaseSQL, key, token[:])
}

// ForceRelease implements dlock.ForceReleaser.
func (b *Backend) ForceRelease(ctx context.Context, key string) error {
	return b.free(ctx, "force release", forceReleaseSQL, key)
}

func (b *Backend) free(ctx context.Context, op, q string, args ...any) error {
	res, err := b.db.ExecContext(ctx, q, args...)
	if err != nil {
		return wrap(op, err)
	}
	n, err := res.RowsAffected()
	if err != nil {
		return wrap(op, err)
	}
	if n == 0 {
		return dlock.ErrNotHeld
	}
	return nil
}

// List implements dlock.Lister.
func (b *Backend) List(ctx context.Context, prefix string) ([]dlock.LockInfo, error) {
	hs, err := b.query(ctx, listSQL, prefix)
	if err != nil {
		return nil, wrap("list", err)
	}
	out := make([]dlock.LockInfo, len(hs))
	for i, h := range hs {
		out[i] = h.LockInfo
	}
	return out, nil
}

type holder struct {
	dlock.LockInfo
	remaining time.Duration
}

func (b *Backend) query(ctx context.Context, q string, args ...any) ([]holder, error) {
	rows, err := b.db.QueryContext(ctx, q, args...)
	if err != nil {
		return nil, err
	}
	defer rows.Close()
	t := time.Now()
	var out []holder
	for rows.Next() {
		var h holder
		var token []byte
		var acquiredUs, remainingUs int64
		if err := rows.Scan(&h.Key, &token, &h.Owner, &h.Fence, &h.Metadata, &acquiredUs, &remainingUs); err != nil {
			return nil, err
		}
		copy(h.Token[:], token)
		h.AcquiredAt = time.UnixMicro(acquiredUs)
		h.remaining = time.Duration(remainingUs) * time.Microsecond
		h.ExpiresAt = t.Add(h.remaining)
		out = append(out, h)
	}
	return out, rows.Err()
}
