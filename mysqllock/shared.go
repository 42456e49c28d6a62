package mysqllock

import (
	"context"
	"database/sql"
	"database/sql/driver"
	"errors"
	"fmt"
	"strconv"
	"strings"
	"time"

	"github.com/dlock-dev/dlock"
	"github.com/go-sql-driver/mysql"
)

// The lease strategy's shared and limited holders (dlock.Sharer). Each has a
// row of its own in the holders table (named after the lock table with
// "_holders"): its token, lease and fence. Every change to them runs in a
// transaction that first locks the key's row in the lock table and writes
// that row before it commits: a grant takes the row's fence (one counter per
// key for every mode) and raises shared_until, the latest expiry of the
// key's shared or limited holders; a release or an extension sets
// shared_until to what is left. The exclusive acquisition, one statement on
// the same row, reads shared_until and does not look at the holders table,
// so it costs what it did; the row lock orders it with every change of the
// holders, so no interleaving admits a reader and a writer together. On
// Galera, where row locks are local to a node, the writes to the row make
// the certification of concurrent changes from other nodes fail (the
// server reports a deadlock, and the transaction is run again).
//
// Shared and limited holders hold no doorbell; their waiters queue on the
// key's doorbell with the exclusive ones (see AcquireWait).

// SupportsMode implements dlock.Sharer: the lease strategy grants every
// mode.
func (b *Backend) SupportsMode(m dlock.Mode) bool {
	return m == dlock.ModeExclusive || m == dlock.ModeShared || m == dlock.ModeLimited
}

// exclusiveOnly refuses, before any I/O, a request in a mode that a session
// strategy cannot grant: a named lock or a locked row has no shared mode.
func exclusiveOnly(strategy string, req dlock.Request) error {
	if req.Mode != dlock.ModeExclusive {
		return fmt.Errorf("%w: mysqllock: %s grants exclusive acquisitions only, not %s", dlock.ErrUnsupported, strategy, req.Mode)
	}
	return nil
}

// sharedQueries are the statements of shared and limited holders; t is the
// lock table and h the holders table.
type sharedQueries struct {
	lockRow, state, stateLocked, earliest, deleteStale, insert, grant                   string
	lockKey, heldShared, remove, settle, extend, held, settleMany, forceHolders, forced string
}

// holderCols are the columns that query scans, for the lock table's
// exclusive holder; the holders table adds its own mode.
const holderCols = `name, token, owner, fence, metadata,
  TIMESTAMPDIFF(MICROSECOND, '1970-01-01', acquired_at), TIMESTAMPDIFF(MICROSECOND, UTC_TIMESTAMP(6), expires_at)`

func newSharedQueries(t, h string) sharedQueries {
	state := `SELECT token, owner, fence, metadata,
  TIMESTAMPDIFF(MICROSECOND, '1970-01-01', acquired_at), TIMESTAMPDIFF(MICROSECOND, UTC_TIMESTAMP(6), expires_at),
  share_limit, TIMESTAMPDIFF(MICROSECOND, UTC_TIMESTAMP(6), writer_until),
  (SELECT COUNT(*) FROM ` + h + ` AS h WHERE h.name = k.name AND h.expires_at > UTC_TIMESTAMP(6)),
  (SELECT COUNT(*) FROM ` + h + ` AS h WHERE h.name = k.name AND h.expires_at <= UTC_TIMESTAMP(6)),
  IFNULL(IS_USED_LOCK(?), 0),
  TIMESTAMPDIFF(MICROSECOND, GREATEST(expires_at, IF(shared_until <= UTC_TIMESTAMP(6), shared_until, '1970-01-01'),
    IFNULL((SELECT MAX(h.expires_at) FROM ` + h + ` AS h WHERE h.name = k.name AND h.expires_at <= UTC_TIMESTAMP(6)), '1970-01-01')),
    UTC_TIMESTAMP(6))
FROM ` + t + ` AS k WHERE name = ?`
	// What is left of the key's holders: the latest expiry of those still
	// live, or else `none`.
	left := func(none string) string {
		return `IFNULL((SELECT MAX(h.expires_at) FROM ` + h + ` AS h WHERE h.name = ` + t + `.name AND h.expires_at > UTC_TIMESTAMP(6)), ` + none + `)`
	}
	return sharedQueries{
		// A key's first use creates its row as free (fence 0), so that
		// there is a row to lock; an INSERT … ON DUPLICATE KEY UPDATE
		// locks the row exclusively whether it inserts or not.
		lockRow: `INSERT INTO ` + t + ` (name, token, owner, fence, acquired_at, expires_at, metadata)
VALUES (?, ` + noToken + `, '', 0, UTC_TIMESTAMP(6), '1970-01-01', '') ON DUPLICATE KEY UPDATE fence = fence`,
		state:       state,
		stateLocked: state + ` FOR UPDATE`,
		earliest: `SELECT ` + holderCols + `, 1, share_limit FROM ` + h + `
WHERE name = ? AND expires_at > UTC_TIMESTAMP(6) ORDER BY expires_at LIMIT 1`,
		deleteStale: `DELETE FROM ` + h + ` WHERE name = ? AND expires_at <= UTC_TIMESTAMP(6)`,
		insert: `INSERT INTO ` + h + ` (name, token, owner, fence, share_limit, acquired_at, expires_at, metadata)
VALUES (?, ?, ?, ?, ?, UTC_TIMESTAMP(6), UTC_TIMESTAMP(6) + INTERVAL ? MICROSECOND, ?)`,
		grant: `UPDATE ` + t + ` SET fence = ?, share_limit = ?,
  shared_until = GREATEST(shared_until, IFNULL((SELECT h.expires_at FROM ` + h + ` AS h WHERE h.name = ? AND h.token = ?), shared_until))
WHERE name = ?`,
		lockKey:    `SELECT fence FROM ` + t + ` WHERE name = ? FOR UPDATE`,
		heldShared: `SELECT EXISTS (SELECT 1 FROM ` + h + ` WHERE name = ? AND token = ? AND expires_at > UTC_TIMESTAMP(6))`,
		// A released holder's row is kept, expired now, until the key's
		// next grant: its expiry tells when the slot was freed (see
		// decideShared).
		remove: `UPDATE ` + h + ` SET expires_at = UTC_TIMESTAMP(6) WHERE name = ? AND token = ? AND expires_at > UTC_TIMESTAMP(6)`,
		// The last holder's release frees the key now, so that a writer
		// first in line at its doorbell takes it (see newQueries).
		settle: `UPDATE ` + t + ` SET shared_until = ` + left("UTC_TIMESTAMP(6)") + ` WHERE name = ?`,
		extend: `UPDATE ` + h + ` SET expires_at = UTC_TIMESTAMP(6) + INTERVAL ? MICROSECOND
WHERE name IN (%[1]s) AND token IN (%[1]s) AND expires_at > UTC_TIMESTAMP(6)`,
		held:         `SELECT name, token FROM ` + h + ` WHERE name IN (%[1]s) AND token IN (%[1]s) AND expires_at > UTC_TIMESTAMP(6)`,
		settleMany:   `UPDATE ` + t + ` SET shared_until = ` + left("shared_until") + ` WHERE name IN (%[1]s)`,
		forceHolders: `DELETE FROM ` + h + ` WHERE name = ? AND expires_at > UTC_TIMESTAMP(6)`,
		forced: fmt.Sprintf(`UPDATE `+t+` SET shared_until = UTC_TIMESTAMP(6) - INTERVAL %d MICROSECOND WHERE name = ?`,
			staleBell.Microseconds()),
	}
}

// keyState is a key's row in the lock table, with a count of its holders.
type keyState struct {
	excl        holder        // the exclusive holder, or the last one (expired)
	limit       int           // the limit of the shared (0) or limited holders
	writer      time.Duration // the writer mark's remaining time (≤ 0: none)
	live, stale int           // the key's unexpired and expired holders
	bell        int64         // the session holding the key's doorbell (0: none, or no doorbells)
	freed       time.Duration // since a holder of any mode last left (released or expired)
}

// readState reads key's row with q (state or stateLocked); false if there is
// none. bell is the key's doorbell name, nil without doorbells.
func readState(ctx context.Context, db querier, q, key string, bell any) (keyState, bool, error) {
	rows, err := db.QueryContext(ctx, q, bell, key)
	if err != nil {
		return keyState{}, false, err
	}
	defer rows.Close()
	if !rows.Next() {
		return keyState{}, false, rows.Err()
	}
	var s keyState
	var token []byte
	var acquiredUs, remainingUs, writerUs, freedUs int64
	if err := rows.Scan(&token, &s.excl.Owner, &s.excl.Fence, &s.excl.Metadata, &acquiredUs, &remainingUs,
		&s.limit, &writerUs, &s.live, &s.stale, &s.bell, &freedUs); err != nil {
		return keyState{}, false, err
	}
	s.excl.Key = key
	copy(s.excl.Token[:], token)
	s.excl.AcquiredAt = time.UnixMicro(acquiredUs)
	s.excl.remaining = time.Duration(remainingUs) * time.Microsecond
	s.excl.ExpiresAt = time.Now().Add(s.excl.remaining)
	s.writer = time.Duration(writerUs) * time.Microsecond
	s.freed = time.Duration(freedUs) * time.Microsecond
	return s, true, rows.Close()
}

// mismatch is the error for a request that disagrees with the key's holders
// on its mode or limit.
func mismatch(key string, heldMode dlock.Mode, heldLimit int, req dlock.Request) error {
	return fmt.Errorf("mysqllock: %q is held %s, asked %s: %w",
		key, dlock.DescribeMode(heldMode, heldLimit), dlock.DescribeMode(req.Mode, req.Limit), dlock.ErrModeMismatch)
}

// sharedMode is the mode of holders with limit.
func sharedMode(limit int) dlock.Mode {
	if limit == 0 {
		return dlock.ModeShared
	}
	return dlock.ModeLimited
}

// inTx runs f in a transaction, which it commits if f says so and rolls back
// otherwise. A deadlock (or a failed Galera certification, which reports
// one) rolls the whole transaction back, so it is run again.
//
// The transaction locks the key's row across several round trips: a client
// that pauses among them (a GC pause, SIGSTOP) would keep every other
// client's statements on the key, the holder's renewals included, waiting
// for as long as it stays paused. On MariaDB the server ends a transaction
// idle for longer than idleTx (idle_transaction_timeout, set for its
// duration on its connection, which is closed if the setting cannot be
// undone); MySQL has no such bound, and there a paused client holds the
// key's row until it goes on.
func (b *Backend) inTx(ctx context.Context, f func(tx *sql.Tx) (commit bool, err error)) error {
	for try := 0; ; try++ {
		err := b.txOnce(ctx, f)
		if !retryDeadlock(ctx, err, try) {
			return err
		}
	}
}

// idleTx is the idle_transaction_timeout (whole seconds) of inTx's
// transactions on MariaDB.
const idleTx = 1

// errUnknownVariable is the server's error for a system variable it lacks.
const errUnknownVariable = 1193

func (b *Backend) txOnce(ctx context.Context, f func(tx *sql.Tx) (bool, error)) (err error) {
	conn, err := b.db.Conn(ctx)
	if err != nil {
		return err
	}
	bounded := false
	defer func() {
		// Undone within the caller's context; a connection where that
		// fails (the context ended) is closed instead of going back to
		// the pool with the setting.
		if bounded {
			if _, rerr := conn.ExecContext(ctx, "SET SESSION idle_transaction_timeout = DEFAULT, idle_write_transaction_timeout = DEFAULT, idle_readonly_transaction_timeout = DEFAULT"); rerr != nil {
				_ = conn.Raw(func(any) error { return driver.ErrBadConn })
			}
		}
		conn.Close()
	}()
	if !b.noIdleTx.Load() {
		// The write and read-only variants, when set, take precedence.
		n := strconv.Itoa(idleTx)
		_, err := conn.ExecContext(ctx, "SET SESSION idle_transaction_timeout = "+n+", idle_write_transaction_timeout = "+n+", idle_readonly_transaction_timeout = "+n)
		var me *mysql.MySQLError
		switch {
		case err == nil:
			bounded = true
		case errors.As(err, &me) && me.Number == errUnknownVariable:
			b.noIdleTx.Store(true)
		default:
			return err
		}
	}
	tx, err := conn.BeginTx(ctx, nil)
	if err != nil {
		return err
	}
	commit, err := f(tx)
	if err != nil || !commit {
		_ = tx.Rollback()
		return err
	}
	return tx.Commit()
}

// tryShared is one attempt at a shared or limited hold of req.Key: a
// transaction on the key's row that decides as the Sharer contract says
// and, on a grant, records the holder and takes the next fence. A refusal
// changes nothing. With doorbells, inLine is the session holding req's
// doorbell (0 if none), as for exclusive acquisitions (see decideShared).
func (b *Backend) tryShared(ctx context.Context, req dlock.Request, inLine int64) (dlock.Result, error) {
	var res dlock.Result
	var refused error // a mode mismatch: nothing was taken
	// With doorbells on another server, their holder is read there, once,
	// before the row is locked; the state's read then asks for none.
	bell, farHolder := b.bellName(req.Key), int64(0)
	if b.farBells() {
		bell = nil
		farHolder, _ = b.bellHolder(ctx, req.Key).(int64)
	}
	err := b.inTx(ctx, func(tx *sql.Tx) (bool, error) {
		if _, err := tx.ExecContext(ctx, b.sq.lockRow, req.Key); err != nil {
			return false, err
		}
		st, _, err := readState(ctx, tx, b.sq.stateLocked, req.Key, bell)
		if err != nil {
			return false, err
		}
		if farHolder != 0 {
			st.bell = farHolder
		}
		res, refused = decideShared(req, st, inLine)
		if !res.Acquired {
			return false, nil
		}
		return true, b.grantShared(ctx, tx, req, st)
	})
	switch {
	case err != nil:
		return dlock.Result{}, b.wrap("acquire", err)
	case refused != nil:
		return dlock.Result{}, refused
	case res.Acquired:
		b.nonExcl.Store(req.Token, struct{}{})
	case res.Holder.Key == "": // the limit is reached
		res = b.firstToLeave(ctx, req.Key)
	}
	return res, nil
}

// decideShared applies the Sharer contract to a shared or limited request
// and the key's state. A full limited key is reported with no holder.
//
// As the exclusive statement does, it keeps what a holder's departure
// freed for the waiter first in line, woken or looking every bellPoll:
// while another session (not inLine) holds the key's doorbell, a request
// that could be granted is refused for staleBell after a holder of any
// mode last left, with no holder named. A doorbell held longer than that
// past a departure is stale, and ignored.
func decideShared(req dlock.Request, st keyState, inLine int64) (dlock.Result, error) {
	switch {
	case st.excl.remaining > 0 && req.Mode == dlock.ModeLimited:
		return dlock.Result{}, mismatch(req.Key, dlock.ModeExclusive, 0, req)
	case st.excl.remaining > 0:
		return dlock.Result{Holder: st.excl.LockInfo, Remaining: st.excl.remaining}, nil
	case st.live > 0 && st.limit != req.Limit:
		return dlock.Result{}, mismatch(req.Key, sharedMode(st.limit), st.limit, req)
	case req.Mode == dlock.ModeLimited && st.live >= req.Limit:
		return dlock.Result{}, nil
	case req.Mode == dlock.ModeShared && st.writer > 0:
		return dlock.Result{Holder: dlock.LockInfo{Key: req.Key}, Remaining: st.writer}, nil
	case st.bell != 0 && st.bell != inLine && st.freed < staleBell:
		return dlock.Result{Holder: dlock.LockInfo{Key: req.Key}, Remaining: staleBell - st.freed}, nil
	}
	return dlock.Result{Acquired: true, Fence: st.excl.Fence + 1}, nil
}

// grantShared records req as a holder of the key whose row tx has locked,
// with the key's next fence, and raises the row's shared_until to its
// expiry. It clears the key's expired holders first.
func (b *Backend) grantShared(ctx context.Context, tx *sql.Tx, req dlock.Request, st keyState) error {
	if st.stale > 0 {
		if _, err := tx.ExecContext(ctx, b.sq.deleteStale, req.Key); err != nil {
			return err
		}
	}
	fence := st.excl.Fence + 1
	if _, err := tx.ExecContext(ctx, b.sq.insert, req.Key, req.Token[:], req.Owner, fence, req.Limit,
		req.TTL.Microseconds(), req.Metadata); err != nil {
		return err
	}
	_, err := tx.ExecContext(ctx, b.sq.grant, fence, req.Limit, req.Key, req.Token[:], req.Key)
	return err
}

// queuedAhead reports whether a refused shared or limited request was kept
// out for a waiter ahead of it (a writer's mark, or the turn of the
// doorbell's holder) rather than by a holder: decideShared then names no
// holder and the time it keeps the request out.
func queuedAhead(req dlock.Request, res dlock.Result) bool {
	return req.Mode != dlock.ModeExclusive && res.Holder.Token == (dlock.Token{}) && res.Remaining > 0
}

// firstToLeave describes the shared or limited holder of key whose lease
// ends first, for a refused request. It is only a hint: if it cannot be
// read, the holder is unknown.
func (b *Backend) firstToLeave(ctx context.Context, key string) dlock.Result {
	hs, err := b.query(ctx, b.sq.earliest, key)
	if err != nil || len(hs) == 0 {
		return dlock.Result{Holder: dlock.LockInfo{Key: key}}
	}
	return dlock.Result{Holder: hs[0].LockInfo, Remaining: max(hs[0].remaining, 0)}
}

// exclusiveRefused is the outcome of an exclusive acquisition statement that
// reported no grant, from the key's row (st): a trigger may have hidden a
// grant, the key may be held exclusively, or by shared holders (the
// statement then left the writer mark), or by limited ones (a mismatch).
func (b *Backend) exclusiveRefused(ctx context.Context, req dlock.Request, st keyState) (dlock.Result, error) {
	h := st.excl
	switch {
	case h.Token == req.Token && h.remaining > 0:
		return dlock.Result{Acquired: true, Fence: h.Fence}, nil
	case h.remaining > 0:
		return dlock.Result{Holder: h.LockInfo, Remaining: h.remaining}, nil
	case st.live > 0 && st.limit > 0:
		return dlock.Result{}, mismatch(req.Key, dlock.ModeLimited, st.limit, req)
	case st.live > 0:
		return b.firstToLeave(ctx, req.Key), nil
	}
	return dlock.Result{Holder: h.LockInfo}, nil
}

// releaseShared frees the shared or limited hold of key by token, and sets
// the key's shared_until to what is left.
func (b *Backend) releaseShared(ctx context.Context, key string, token dlock.Token) error {
	b.nonExcl.Delete(token)
	err := b.inTx(ctx, func(tx *sql.Tx) (bool, error) {
		if err := lockKey(ctx, tx, b.sq.lockKey, key); err != nil {
			return false, err
		}
		n, err := affected(tx.ExecContext(ctx, b.sq.remove, key, token[:]))
		switch {
		case err != nil:
			return false, err
		case n == 0:
			return false, dlock.ErrNotHeld
		}
		_, err = tx.ExecContext(ctx, b.sq.settle, key)
		return true, err
	})
	if err != nil && !errors.Is(err, dlock.ErrNotHeld) {
		return b.wrap("release", err)
	}
	return err
}

// releaseIfShared is releaseShared for a token that held no exclusive lease
// and that this Backend does not know as a shared hold (an acquisition of
// unknown outcome): a read first, which locks nothing, so that the release
// of a lease already gone runs no transaction on the key's row. A shared
// grant of the token that commits after the read is found by the Locker's
// next attempt to resolve that acquisition.
func (b *Backend) releaseIfShared(ctx context.Context, key string, token dlock.Token) error {
	var held bool
	if err := b.db.QueryRowContext(ctx, b.sq.heldShared, key, token[:]).Scan(&held); err != nil {
		return b.wrap("release", err)
	}
	if !held {
		return dlock.ErrNotHeld
	}
	return b.releaseShared(ctx, key, token)
}

// lockKey locks key's row in the lock table for the transaction; the error
// is dlock.ErrNotHeld if there is no row.
func lockKey(ctx context.Context, tx *sql.Tx, q, key string) error {
	var fence uint64
	err := tx.QueryRowContext(ctx, q, key).Scan(&fence)
	if errors.Is(err, sql.ErrNoRows) {
		return dlock.ErrNotHeld
	}
	return err
}

// affected returns the rows a statement affected.
func affected(res sql.Result, err error) (int64, error) {
	if err != nil {
		return 0, err
	}
	return res.RowsAffected()
}

// extendShared renews the shared and limited leases idx of leases, all with
// ttl, in one transaction that locks their keys' rows; errs gets
// dlock.ErrNotHeld for each that is no longer held.
func (b *Backend) extendShared(ctx context.Context, leases []dlock.Lease, idx []int, ttl time.Duration, errs []error) error {
	names, tokens := make([]any, len(idx)), make([]any, len(idx))
	for j, i := range idx {
		names[j], tokens[j] = leases[i].Key, leases[i].Token[:]
	}
	in := placeholders(len(idx))
	type lease struct {
		key   string
		token dlock.Token
	}
	var held map[lease]bool
	err := b.inTx(ctx, func(tx *sql.Tx) (bool, error) {
		held = map[lease]bool{}
		rows, err := tx.QueryContext(ctx, `SELECT fence FROM `+b.table+` WHERE name IN (`+in+`) FOR UPDATE`, names...)
		if err != nil {
			return false, err
		}
		if err := rows.Close(); err != nil {
			return false, err
		}
		args := append(append([]any{ttl.Microseconds()}, names...), tokens...)
		if _, err := tx.ExecContext(ctx, fmt.Sprintf(b.sq.extend, in), args...); err != nil {
			return false, err
		}
		// Confirm by reading, as for exclusive leases.
		rows, err = tx.QueryContext(ctx, fmt.Sprintf(b.sq.held, in), append(names, tokens...)...)
		if err != nil {
			return false, err
		}
		defer rows.Close()
		for rows.Next() {
			var name, token []byte
			if err := rows.Scan(&name, &token); err != nil {
				return false, err
			}
			l := lease{key: string(name)}
			copy(l.token[:], token)
			held[l] = true
		}
		if err := rows.Close(); err != nil {
			return false, err
		}
		_, err = tx.ExecContext(ctx, fmt.Sprintf(b.sq.settleMany, in), names...)
		return true, err
	})
	if err != nil {
		return b.wrap("extend", err)
	}
	for _, i := range idx {
		if !held[lease{leases[i].Key, leases[i].Token}] {
			errs[i] = dlock.ErrNotHeld
			b.nonExcl.Delete(leases[i].Token)
		}
	}
	return nil
}

// placeholders returns n comma-separated "?".
func placeholders(n int) string { return "?" + strings.Repeat(", ?", n-1) }

// forceRelease frees every holder of key, in every mode, in one transaction
// on the key's row; excl reports whether an exclusive holder was among them.
// Like an exclusive forced release, it keeps the key for no one in line.
func (b *Backend) forceRelease(ctx context.Context, key string) (excl bool, err error) {
	err = b.inTx(ctx, func(tx *sql.Tx) (bool, error) {
		if err := lockKey(ctx, tx, b.sq.lockKey, key); err != nil {
			return false, err
		}
		n, err := affected(tx.ExecContext(ctx, b.q.forceRelease, key))
		if err != nil {
			return false, err
		}
		excl = n > 0
		if n, err = affected(tx.ExecContext(ctx, b.sq.forceHolders, key)); err != nil {
			return false, err
		}
		if n > 0 {
			_, err = tx.ExecContext(ctx, b.sq.forced, key)
			return true, err
		}
		if !excl {
			return false, dlock.ErrNotHeld
		}
		return true, nil
	})
	if err != nil && !errors.Is(err, dlock.ErrNotHeld) {
		err = b.wrap("force release", err)
	}
	return excl, err
}

// modeColumns are the lock table's columns for shared and limited holders,
// defined as in schema.sql: Migrate adds those that a table created before
// them lacks. Existing rows keep their fences, and read as keys without
// shared or limited holders.
var modeColumns = []column{
	{"shared_until", "DATETIME(6) NOT NULL DEFAULT '1970-01-01 00:00:00'"},
	{"share_limit", "INT UNSIGNED NOT NULL DEFAULT 0"},
	{"writer_until", "DATETIME(6) NOT NULL DEFAULT '1970-01-01 00:00:00'"},
}

// sessionColumns are the session table's columns for lock-delays, defined
// as in schema.sql: Migrate adds those that a table created before them
// lacks. Existing rows read as keys whose last holder left no lock-delay.
var sessionColumns = []column{
	{"delay_us", "BIGINT UNSIGNED NOT NULL DEFAULT 0"},
	{"delay_until", "DATETIME(6) NOT NULL DEFAULT '1970-01-01 00:00:00'"},
}

// column is a column that Migrate adds to a table created without it.
type column struct{ name, def string }

// errDupColumn is the server's error for a column that exists already.
const errDupColumn = 1060

// upgrade adds the columns of cols that table (quoted) lacks. A concurrent
// Migrate may add them first; the columns are then looked at again.
func upgrade(ctx context.Context, db querier, table string, cols []column) error {
	for try := 0; ; try++ {
		missing, err := missingColumns(ctx, db, table, cols)
		if err != nil || len(missing) == 0 {
			return err
		}
		_, err = db.ExecContext(ctx, `ALTER TABLE `+table+` `+strings.Join(missing, ", "))
		var me *mysql.MySQLError
		if err == nil || !errors.As(err, &me) || me.Number != errDupColumn || try == 1 {
			return err
		}
	}
}

// missingColumns returns the ADD COLUMN clauses for the columns of cols
// that table lacks.
func missingColumns(ctx context.Context, db querier, table string, cols []column) ([]string, error) {
	schema, name := splitTable(table)
	rows, err := db.QueryContext(ctx, `SELECT LOWER(COLUMN_NAME) FROM information_schema.COLUMNS
WHERE TABLE_SCHEMA = IF(? = '', DATABASE(), ?) AND TABLE_NAME = ?`, schema, schema, name)
	if err != nil {
		return nil, err
	}
	defer rows.Close()
	have := map[string]bool{}
	for rows.Next() {
		var c string
		if err := rows.Scan(&c); err != nil {
			return nil, err
		}
		have[c] = true
	}
	if err := rows.Err(); err != nil {
		return nil, err
	}
	var add []string
	for _, c := range cols {
		if !have[c.name] {
			add = append(add, "ADD COLUMN "+c.name+" "+c.def)
		}
	}
	return add, nil
}

// splitTable splits a quoted table name into its schema ("" for the
// connection's) and name.
func splitTable(table string) (schema, name string) {
	parts := strings.Split(strings.ReplaceAll(table, "`", ""), ".")
	if len(parts) == 2 {
		schema = parts[0]
	}
	return schema, parts[len(parts)-1]
}
