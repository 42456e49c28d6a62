// Package sqlitelock is a dlock.Backend on a local SQLite file (pure Go,
// modernc.org/sqlite): the lease strategy for processes of one host. It is
// the dlock CLI's embedded default store.
//
// The file is opened in WAL mode with a busy timeout; leases are timed by
// SQLite's reading of the host clock. An exclusive acquisition is one
// statement. It grants every mode (dlock.Sharer): shared and limited
// holders have a row each in a second table, and each of their
// acquisitions is one write transaction that checks every holder of the
// key and takes its slot. A key's row is never deleted, and its fencing
// counter serves every mode, so fences never go back. A fence is also at
// least the store's clock in microseconds, so that a file made again
// (deleted, or restored from a backup) hands out fences above the old
// file's; a Backend made by Open notices that its path names another file,
// reports its locks lost at their next renewal and refuses acquisitions
// (ErrFileReplaced). Do not put the file on a network file system:
// SQLite's locking is not reliable there.
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
//
// A holder can change its lock's metadata (dlock.MetadataSetter: an
// Election leader's Proclaim), which List then shows. SQLite cannot notify
// another process of a change, so the Backend is not a dlock.Watcher; it is
// a dlock.HolderWatcher: triggers that Migrate creates record every change
// of holders in a journal that watchers read with a backoff of up to 1 s
// (at once for changes made through the same Backend), so an Election's
// observers see every term (see Backend.WatchHolders).
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
	"sync"
	"time"

	"github.com/dlock-dev/dlock"
	"github.com/dlock-dev/dlock/internal/journal"
	"github.com/dlock-dev/dlock/internal/keylist"
	"modernc.org/sqlite"
	sqlite3 "modernc.org/sqlite/lib"
)

//go:embed schema.sql
var schemaSQL string

// Schema returns the DDL that Migrate runs on a file without the tables.
func Schema() string { return schemaSQL }

// now is the current time in Unix microseconds as SQLite reads it; it is the
// same value throughout one statement.
const now = "CAST(unixepoch('now', 'subsec') * 1000000 AS INTEGER)"

// A key's fences count from the clock: a new row's first fence is now (in
// microseconds), and a grant's fence is the larger of the row's next and
// now. They still grow by at least one per grant, and a row made again (a
// file replaced by another, or restored from a backup) starts above every
// fence handed out before, as long as no key had more grants than the
// microseconds since its first.
const (
	firstFence = "max(1, " + now + ")"
	nextFence  = "max(fence + 1, " + now + ")"
)

const (
	// acquireSQL takes the key exclusively if its exclusive lease has
	// expired and it has no unexpired shared or limited holder; the grant
	// clears the writer mark.
	acquireSQL = `INSERT INTO dlock_locks (name, token, owner, fence, acquired_us, expires_us, metadata)
VALUES (?1, ?2, ?3, ` + firstFence + `, ` + now + `, ` + now + ` + ?4, ?5)
ON CONFLICT (name) DO UPDATE SET
  token = excluded.token, owner = excluded.owner, fence = ` + nextFence + `,
  acquired_us = excluded.acquired_us, expires_us = excluded.expires_us, metadata = excluded.metadata,
  writer_us = 0
WHERE expires_us <= excluded.acquired_us
  AND NOT EXISTS (SELECT 1 FROM dlock_shares s WHERE s.name = ?1 AND s.expires_us > ` + now + `)
RETURNING fence, acquired_us`
	holderSQL = `SELECT name, token, owner, fence, metadata, acquired_us, expires_us - ` + now + `, '', 0
FROM dlock_locks WHERE name = ?`
	listSQL = `SELECT name, token, owner, fence, metadata, acquired_us, expires_us - ` + now + `, '', 0
FROM dlock_locks WHERE expires_us > ` + now + ` AND substr(name, 1, length(?1)) = ?1
UNION ALL
SELECT name, token, owner, fence, metadata, acquired_us, expires_us - ` + now + `, mode, lim
FROM dlock_shares WHERE expires_us > ` + now + ` AND substr(name, 1, length(?1)) = ?1
ORDER BY 1, 4`
	// listKeysSQL reads every key's row (fence 0: made for a shared
	// request and never granted), whether it is held, and whether its
	// last holder was exclusive (a shared or limited grant clears the
	// row's holder), then expired (a release sets expires_us to 0).
	listKeysSQL = `SELECT name, fence, token, owner, metadata, acquired_us,
  expires_us > ` + now + ` OR EXISTS (SELECT 1 FROM dlock_shares s WHERE s.name = l.name AND s.expires_us > ` + now + `),
  length(token) > 0, length(token) > 0 AND expires_us <> 0, expires_us, freed_us, ` + now + `
FROM dlock_locks l WHERE fence > 0 AND substr(name, 1, length(?1)) = ?1 ORDER BY name`
	extendSQL      = `UPDATE dlock_locks SET expires_us = ` + now + ` + ?1 WHERE name = ?2 AND token = ?3 AND expires_us > ` + now
	extendShareSQL = `UPDATE dlock_shares SET expires_us = ` + now + ` + ?1 WHERE name = ?2 AND token = ?3 AND expires_us > ` + now
	// A release sets expires_us to 0, not to now, so that a host clock
	// that steps back cannot keep the key held, and records its time in
	// freed_us (listKeysSQL).
	releaseSQL = `UPDATE dlock_locks SET expires_us = 0, freed_us = ` + now + ` WHERE name = ? AND token = ? AND expires_us > ` + now
	// releaseShareSQL deletes the row: the key's fence is in dlock_locks,
	// where freedSQL then records the release.
	releaseShareSQL = `DELETE FROM dlock_shares WHERE name = ? AND token = ? AND expires_us > ` + now
	freedSQL        = `UPDATE dlock_locks SET freed_us = ` + now + ` WHERE name = ?`
	// A holder's metadata changes only while its lease is unexpired. SQLite
	// counts every row an UPDATE matches as changed, even to the value it
	// had.
	setMetadataSQL       = `UPDATE dlock_locks SET metadata = ? WHERE name = ? AND token = ? AND expires_us > ` + now
	setShareMetadataSQL  = `UPDATE dlock_shares SET metadata = ? WHERE name = ? AND token = ? AND expires_us > ` + now
	forceReleaseSQL      = `UPDATE dlock_locks SET expires_us = 0, freed_us = ` + now + ` WHERE name = ? AND expires_us > ` + now
	forceReleaseShareSQL = `DELETE FROM dlock_shares WHERE name = ? AND expires_us > ` + now
)

// Backend is the lease strategy on SQLite. It is safe for concurrent use by
// goroutines and by processes sharing the file.
type Backend struct {
	db    *sql.DB
	owned bool         // opened by Open: Close closes it
	bell  journal.Bell // wakes this Backend's holder watchers on its changes
	path  string       // the file Open opened ("" with New)

	mu   sync.Mutex
	file os.FileInfo // the file at path at Open, or when first made (see checkFile)
}

// ErrFileReplaced is the error of a Backend made by Open whose path no
// longer names the file it first used (the file was deleted, or replaced
// by another, such as a restored backup). Its locks lived in that file:
// renewals report them lost, and acquisitions are refused. Open the path
// again to use the file now there.
var ErrFileReplaced = errors.New("sqlitelock: the database file was replaced or removed")

// checkFile returns ErrFileReplaced if b's path no longer names the file
// it first used: the file there at Open, or else at the first call after
// one made it.
func (b *Backend) checkFile() error {
	if b.path == "" {
		return nil
	}
	fi, err := os.Stat(b.path)
	b.mu.Lock()
	defer b.mu.Unlock()
	switch {
	case err != nil && b.file == nil:
		return nil // not made yet: the first connection makes it
	case err != nil:
		return fmt.Errorf("%w: %s: %w", ErrFileReplaced, b.path, err)
	case b.file == nil:
		b.file = fi
		return nil
	}
	if !os.SameFile(b.file, fi) {
		return fmt.Errorf("%w: %s", ErrFileReplaced, b.path)
	}
	return nil
}

var (
	_ dlock.Backend        = (*Backend)(nil)
	_ dlock.Lister         = (*Backend)(nil)
	_ dlock.ForceReleaser  = (*Backend)(nil)
	_ dlock.Sharer         = (*Backend)(nil)
	_ dlock.MetadataSetter = (*Backend)(nil)
	_ dlock.KeyLister      = (*Backend)(nil)
)

// Open opens (creating if needed) the SQLite file at path in WAL mode with a
// 10 s busy timeout, creating its directory too. Close the Backend when done.
// It does not create the table: call Migrate.
func Open(path string) (*Backend, error) {
	if path == "" {
		return nil, fmt.Errorf("%w: sqlitelock: empty path", dlock.ErrInvalidOption)
	}
	path, err := filepath.Abs(path) // a later chdir names no other file
	if err != nil {
		return nil, fmt.Errorf("sqlitelock: %w", err)
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
	b := &Backend{db: db, owned: true, path: path}
	if err := b.checkFile(); err != nil { // the file there now, if any
		db.Close()
		return nil, err
	}
	return b, nil
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

// Migrate creates the lock tables if they do not exist, and brings tables
// made by an earlier version up to date: it adds the writer mark's, the
// release time's and the journal position's columns to dlock_locks, whose
// rows and fences stay as they are, the table of shared and limited
// holders, and the change journal with its triggers (see WatchHolders). Any number of processes may call it at once,
// on a new file or an old one: it waits for the others as long as the busy
// timeout (10 s with Open), or until ctx ends.
//
// A fresh file starts in rollback-journal mode, and there SQLite answers
// SQLITE_BUSY at once, without waiting, when two connections that both read
// the file try to write it (switching to WAL, creating the table): waiting
// would deadlock them. Migrate therefore reads first (most calls find the
// tables up to date and write nothing), changes the schema in a transaction
// that takes the write lock at its start (BEGIN IMMEDIATE, which waits) and
// looks again there, and tries again after a short pause when SQLite still
// answers SQLITE_BUSY.
func (b *Backend) Migrate(ctx context.Context) error {
	deadline := time.Now().Add(migrateBusyTimeout)
	pause := time.Millisecond
	for {
		err := b.migrate(ctx)
		if err == nil || !isBusy(err) || time.Now().After(deadline) {
			if err != nil {
				return fmt.Errorf("sqlitelock: migrate: %w", err)
			}
			return b.checkFile() // made now if it was not there: record it
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

// schemaStateSQL tells whether dlock_locks exists, whether it has the
// writer mark's, the release time's and the journal position's columns,
// whether dlock_shares exists, and whether the journal and its five
// triggers do.
const schemaStateSQL = `SELECT
  (SELECT count(*) FROM sqlite_schema WHERE type = 'table' AND name = 'dlock_locks'),
  (SELECT count(*) FROM pragma_table_info('dlock_locks') WHERE name = 'writer_us'),
  (SELECT count(*) FROM pragma_table_info('dlock_locks') WHERE name = 'freed_us'),
  (SELECT count(*) FROM pragma_table_info('dlock_locks') WHERE name = 'jseq'),
  (SELECT count(*) FROM sqlite_schema WHERE type = 'table' AND name = 'dlock_shares'),
  (SELECT count(*) FROM sqlite_schema WHERE type = 'table' AND name = 'dlock_journal')
    + (SELECT count(*) FROM sqlite_schema WHERE type = 'trigger' AND name LIKE 'dlock\_%\_journal\_%' ESCAPE '\') = 6`

// upgradeSQL brings a dlock_locks table made before the shared modes up to
// date; schemaSQL then adds dlock_shares. upgradeFreedSQL adds the release
// time (dlock.KeyLister) to one made before it, upgradeJournalSQL the
// journal position (schemaSQL then adds the journal and its triggers).
const (
	upgradeSQL        = `ALTER TABLE "dlock_locks" ADD COLUMN writer_us INTEGER NOT NULL DEFAULT 0`
	upgradeFreedSQL   = `ALTER TABLE "dlock_locks" ADD COLUMN freed_us INTEGER NOT NULL DEFAULT 0`
	upgradeJournalSQL = `ALTER TABLE "dlock_locks" ADD COLUMN jseq INTEGER NOT NULL DEFAULT 0`
)

// schemaState is what schemaStateSQL finds.
type schemaState struct{ locks, writerCol, freedCol, jseqCol, shares, journal bool }

func readSchemaState(ctx context.Context, q querier) (schemaState, error) {
	var st schemaState
	err := q.QueryRowContext(ctx, schemaStateSQL).Scan(&st.locks, &st.writerCol, &st.freedCol, &st.jseqCol, &st.shares, &st.journal)
	return st, err
}

func (st schemaState) current() bool {
	return st.locks && st.writerCol && st.freedCol && st.jseqCol && st.shares && st.journal
}

func (b *Backend) migrate(ctx context.Context) error {
	st, err := readSchemaState(ctx, b.db)
	if err != nil || st.current() {
		return err
	}
	tx, err := b.db.BeginTx(ctx, nil) // BEGIN IMMEDIATE (Open's _txlock)
	if err != nil {
		return err
	}
	defer tx.Rollback()
	// Another process may have done it since the first look.
	if st, err = readSchemaState(ctx, tx); err != nil || st.current() {
		return err
	}
	if st.locks && !st.writerCol {
		if _, err := tx.ExecContext(ctx, upgradeSQL); err != nil {
			return err
		}
	}
	if st.locks && !st.freedCol {
		if _, err := tx.ExecContext(ctx, upgradeFreedSQL); err != nil {
			return err
		}
	}
	if st.locks && !st.jseqCol {
		if _, err := tx.ExecContext(ctx, upgradeJournalSQL); err != nil {
			return err
		}
	}
	if _, err := tx.ExecContext(ctx, schemaSQL); err != nil {
		return err
	}
	return tx.Commit()
}

// querier is what *sql.DB and *sql.Tx share that Backend uses.
type querier interface {
	ExecContext(ctx context.Context, query string, args ...any) (sql.Result, error)
	QueryContext(ctx context.Context, query string, args ...any) (*sql.Rows, error)
	QueryRowContext(ctx context.Context, query string, args ...any) *sql.Row
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

// startedAfter is how long after sent (a time.Now before the statement)
// a lease that the statement started at acquired (µs of the store's clock,
// this host's wall clock) began, within what has passed since sent: the
// statement may have waited for the file's write lock first.
func startedAfter(sent time.Time, acquired int64) time.Duration {
	return min(max(time.UnixMicro(acquired).Sub(sent.Round(0)), 0), time.Since(sent))
}

// Acquire implements dlock.Backend. An exclusive or shared request first
// reads the key's exclusive holder, without the write lock: while one
// holds the key, waiters that ask again and again do not queue for the
// write lock ahead of its release. An exclusive request is then one
// statement when the key is free, whose grant's SentAfter is when the
// store's clock started the lease (the statement may wait for the file's
// write lock first); the others, and an exclusive request that finds the
// key held, are one write transaction (see acquireTx), whose BEGIN
// IMMEDIATE (Open's _txlock) waits for the file's write lock: a grant's
// SentAfter is when it returned, since SQLite times the lease from a
// statement sent after it.
func (b *Backend) Acquire(ctx context.Context, req dlock.Request) (dlock.Result, error) {
	if err := dlock.ValidateMode(req); err != nil {
		return dlock.Result{}, err
	}
	if err := b.checkFile(); err != nil {
		return dlock.Result{}, err
	}
	if req.Mode != dlock.ModeLimited {
		res, err := blocked(ctx, b.db, req.Key, holderSQL)
		if err != nil {
			return dlock.Result{}, wrap("acquire", err)
		}
		if res.Remaining > 0 { // a live exclusive holder
			return res, nil
		}
	}
	if req.Mode == dlock.ModeExclusive {
		var fence uint64
		var acquired int64
		sent := time.Now()
		err := b.db.QueryRowContext(ctx, acquireSQL, req.Key, req.Token[:], req.Owner, req.TTL.Microseconds(), req.Metadata).Scan(&fence, &acquired)
		switch {
		case err == nil:
			b.bell.Ring()
			return dlock.Result{Acquired: true, Fence: fence, SentAfter: startedAfter(sent, acquired)}, nil
		case !errors.Is(err, sql.ErrNoRows):
			return dlock.Result{}, wrap("acquire", err)
		}
	}
	began := time.Now()
	tx, err := b.db.BeginTx(ctx, nil)
	if err != nil {
		return dlock.Result{}, wrap("acquire", err)
	}
	defer tx.Rollback()
	locked := time.Since(began)
	res, err := b.acquireTx(ctx, tx, req)
	if errors.Is(err, dlock.ErrModeMismatch) {
		return dlock.Result{}, err // the store's answer: nothing changed
	}
	if err == nil {
		err = tx.Commit()
	}
	if err != nil {
		return dlock.Result{}, wrap("acquire", err)
	}
	b.bell.Ring() // a grant, or the end of expired holders
	if res.Acquired {
		res.SentAfter = locked
	}
	return res, nil
}

// Extend implements dlock.Backend in one transaction.
func (b *Backend) Extend(ctx context.Context, leases []dlock.Lease) ([]error, error) {
	if err := b.checkFile(); errors.Is(err, ErrFileReplaced) {
		errs := make([]error, len(leases))
		for i := range errs {
			errs[i] = fmt.Errorf("%w: %w", dlock.ErrNotHeld, err)
		}
		return errs, nil
	}
	tx, err := b.db.BeginTx(ctx, nil)
	if err != nil {
		return nil, wrap("extend", err)
	}
	defer tx.Rollback()
	errs := make([]error, len(leases))
	for i, l := range leases {
		// The exclusive table first: its holders' renewals cost one statement.
		n, err := affected(tx.ExecContext(ctx, extendSQL, l.TTL.Microseconds(), l.Key, l.Token[:]))
		if err == nil && n == 0 {
			n, err = affected(tx.ExecContext(ctx, extendShareSQL, l.TTL.Microseconds(), l.Key, l.Token[:]))
		}
		if err != nil {
			return nil, wrap("extend", err)
		}
		if n == 0 {
			errs[i] = dlock.ErrNotHeld
		}
	}
	if err := tx.Commit(); err != nil {
		return nil, wrap("extend", err)
	}
	return errs, nil
}

// affected returns the rows an ExecContext changed.
func affected(res sql.Result, err error) (int64, error) {
	if err != nil {
		return 0, err
	}
	return res.RowsAffected()
}

// Release implements dlock.Backend. A token is in one of the two tables
// only, so that each statement alone is the release.
func (b *Backend) Release(ctx context.Context, key string, token dlock.Token) error {
	n, err := affected(b.db.ExecContext(ctx, releaseSQL, key, token[:]))
	if err == nil && n == 0 {
		n, err = affected(b.db.ExecContext(ctx, releaseShareSQL, key, token[:]))
		if err == nil && n > 0 {
			// After the release itself, which this does not undo if it
			// fails: the time is for operators only.
			_, _ = b.db.ExecContext(ctx, freedSQL, key)
		}
	}
	if err != nil {
		return wrap("release", err)
	}
	if n == 0 {
		return dlock.ErrNotHeld
	}
	b.bell.Ring()
	return nil
}

// SetMetadata implements dlock.MetadataSetter: one UPDATE of the holder's
// row, exclusive or (if none matches) shared or limited, that matches only
// while its lease is unexpired. A token is in one of the two tables only,
// so that each statement alone is the change.
func (b *Backend) SetMetadata(ctx context.Context, key string, token dlock.Token, metadata string) error {
	n, err := affected(b.db.ExecContext(ctx, setMetadataSQL, metadata, key, token[:]))
	if err == nil && n == 0 {
		n, err = affected(b.db.ExecContext(ctx, setShareMetadataSQL, metadata, key, token[:]))
	}
	if err != nil {
		return wrap("set metadata", err)
	}
	if n == 0 {
		return dlock.ErrNotHeld
	}
	b.bell.Ring()
	return nil
}

// ForceRelease implements dlock.ForceReleaser: it frees every holder of
// key, in one transaction.
func (b *Backend) ForceRelease(ctx context.Context, key string) error {
	tx, err := b.db.BeginTx(ctx, nil)
	if err != nil {
		return wrap("force release", err)
	}
	defer tx.Rollback()
	n, err := affected(tx.ExecContext(ctx, forceReleaseSQL, key))
	if err != nil {
		return wrap("force release", err)
	}
	m, err := affected(tx.ExecContext(ctx, forceReleaseShareSQL, key))
	if err == nil && m > 0 {
		_, err = tx.ExecContext(ctx, freedSQL, key)
	}
	if err != nil {
		return wrap("force release", err)
	}
	if err := tx.Commit(); err != nil {
		return wrap("force release", err)
	}
	b.bell.Ring()
	if n+m == 0 {
		return dlock.ErrNotHeld
	}
	return nil
}

// List implements dlock.Lister: every holder, in every mode, ordered by
// key, then fence.
func (b *Backend) List(ctx context.Context, prefix string) ([]dlock.LockInfo, error) {
	hs, err := query(ctx, b.db, listSQL, prefix)
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

// query reads holders: name, token, owner, fence, metadata, acquired_us,
// the remaining lease in µs, the mode (empty for exclusive) and the limit.
func query(ctx context.Context, q querier, stmt string, args ...any) ([]holder, error) {
	rows, err := q.QueryContext(ctx, stmt, args...)
	if err != nil {
		return nil, err
	}
	defer rows.Close()
	t := time.Now()
	var out []holder
	for rows.Next() {
		var h holder
		var token []byte
		var mode string
		var acquiredUs, remainingUs int64
		if err := rows.Scan(&h.Key, &token, &h.Owner, &h.Fence, &h.Metadata, &acquiredUs, &remainingUs, &mode, &h.Limit); err != nil {
			return nil, err
		}
		copy(h.Token[:], token)
		h.Mode = modeOf(mode)
		h.AcquiredAt = time.UnixMicro(acquiredUs)
		h.remaining = time.Duration(remainingUs) * time.Microsecond
		h.ExpiresAt = t.Add(h.remaining)
		out = append(out, h)
	}
	return out, rows.Err()
}

// ListKeys implements dlock.KeyLister: every key's row (rows are kept after
// release), with its holders as List reports them. A free key's last
// holder is known when it was exclusive: the row keeps its owner, metadata,
// token and fence. A shared or limited holder's row goes with its release,
// and such a key has no Last and no Expired, and its FreedAt is its last
// release. A release made by a version that did not record its time has
// no FreedAt. The holders are read by a second statement, so a key granted
// between the two shows as held, and a listing in which a key held by the
// first read has no holder in the second is read again (keylist.Retry).
func (b *Backend) ListKeys(ctx context.Context, prefix string) ([]dlock.KeyInfo, error) {
	return keylist.Retry(func() ([]dlock.KeyInfo, bool, error) { return b.listKeys(ctx, prefix) })
}

// listKeys is one ListKeys by two reads, and whether it is keylist.Torn.
func (b *Backend) listKeys(ctx context.Context, prefix string) ([]dlock.KeyInfo, bool, error) {
	rows, err := b.db.QueryContext(ctx, listKeysSQL, prefix)
	if err != nil {
		return nil, false, wrap("list keys", err)
	}
	defer rows.Close()
	t := time.Now()
	var out []dlock.KeyInfo
	var held []bool
	for rows.Next() {
		var (
			r                                     keylist.Row
			token                                 []byte
			acquiredUs, expiresUs, freedUs, nowUs int64
		)
		if err := rows.Scan(&r.Last.Key, &r.Last.Fence, &token, &r.Last.Owner, &r.Last.Metadata, &acquiredUs,
			&r.Held, &r.LastKnown, &r.Expired, &expiresUs, &freedUs, &nowUs); err != nil {
			return nil, false, wrap("list keys", err)
		}
		copy(r.Last.Token[:], token)
		r.Last.AcquiredAt = time.UnixMicro(acquiredUs)
		switch {
		case r.Expired:
			r.Ended = usec(expiresUs - nowUs)
		case freedUs > 0:
			r.Ended = usec(freedUs - nowUs)
		default:
			r.EndUnknown = true
		}
		out, held = append(out, r.Info(t)), append(held, r.Held)
	}
	if err := rows.Err(); err != nil {
		return nil, false, wrap("list keys", err)
	}
	hs, err := b.List(ctx, prefix)
	if err != nil {
		return nil, false, err
	}
	out = keylist.MergeHolders(out, hs)
	return out, keylist.Torn(held, out), nil
}
