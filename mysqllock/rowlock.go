package mysqllock

import (
	"context"
	"database/sql"
	"errors"
	"fmt"
	"math"
	"strings"
	"sync"
	"sync/atomic"
	"time"

	"github.com/dlock-dev/dlock"
	"github.com/dlock-dev/dlock/internal/claims"
	"github.com/dlock-dev/dlock/internal/repeat"
	"github.com/go-sql-driver/mysql"
)

// RowLock is the rowlock strategy: a row per key (created on demand) locked
// with SELECT … FOR UPDATE in a transaction kept open on a pinned session
// until release (COMMIT).
//
// Waiting happens in InnoDB, which grants the row to the next waiter when the
// holder commits. A wait is bounded by innodb_lock_wait_timeout, set for it,
// and on MariaDB it runs with max_statement_time = 0, so that a statement
// limit from the user's grants, the DSN or the server does not end it.
// Crash and pause behave as for GetLock: the server rolls back a dead or
// timed-out session (wait_timeout is set to the TTL) and the row is free.
//
// Each held lock is one open transaction on a connection of its own, pinned
// from db, and each grant needs one more connection for a moment. So a pool
// limited to n connections (SetMaxOpenConns) must allow at least 2, and
// holds at most n−1 locks at once: beyond that Acquire fails at once and
// AcquireWait waits for a lock's release. In a limited pool a released
// lock's connection goes back to the pool at once. The count is each
// RowLock's own: backends that share one limited pool (two RowLocks, or a
// RowLock and a GetLock) can pin every connection between them, and a
// grant then waits for one until its context ends. Share one RowLock
// between Lockers instead (a Backend serves any number), or give each
// backend a pool of its own or Options.Connector.
//
// Fences come from the key's row in the session table (MEMORY, see
// epoch.go), bumped on every grant in one statement on another connection
// than the locking transaction's, so that it counts at once. A fence is
// reported only if the row stayed locked across its write: after the write,
// the locking transaction must still be open, or the acquisition fails. So
// fences reported to holders strictly increase, also across server
// restarts (the epoch of the server's run is their high bits).
//
// As with GetLock, a session the server ends by itself frees the row at
// once, and the holder is told only at its next check (up to TTL/3 later):
// guard the resource with the fence.
//
// Not for Galera: row locks are local to a node and the locking transaction
// writes nothing, so certification never aborts a second holder and clients
// on two nodes would hold a key at once. The first use there fails with
// ErrGalera; use the lease strategy (New).
type RowLock struct {
	claims *claims.Set
	ac     autocommitCheck
	db     *sql.DB
	s      *sessions
	rows   string // quoted rows table
	table  string // the lease table, quoted, whose schema Migrate creates
	mu     sync.Mutex
	held   map[string]*rowHold
	known  map[string]struct{} // keys whose row exists
	// flavor is the server's (flavorUnknown until a wait has asked).
	flavor atomic.Int32
	warn   warner
	// pinned counts the sessions pinned for held locks and acquisitions
	// (under mu); freed is closed and replaced when one is given back.
	pinned int
	freed  chan struct{}
}

type rowHold struct {
	ss    *session
	tx    *sql.Tx
	token dlock.Token
}

var (
	_ dlock.Backend        = (*RowLock)(nil)
	_ dlock.Waiter         = (*RowLock)(nil)
	_ dlock.DirectWaiter   = (*RowLock)(nil)
	_ dlock.Lister         = (*RowLock)(nil)
	_ dlock.ForceReleaser  = (*RowLock)(nil)
	_ dlock.Sharer         = (*RowLock)(nil)
	_ dlock.MetadataSetter = (*RowLock)(nil)
)

// SupportsMode implements dlock.Sharer: a row locked FOR UPDATE has no
// shared mode that a lease could use, so RowLock grants exclusive
// acquisitions only, and the Locker refuses the others before any I/O.
func (r *RowLock) SupportsMode(m dlock.Mode) bool { return m == dlock.ModeExclusive }

// MySQL error numbers of a lock that could not be had.
const (
	errLockWaitTimeout = 1205 // MariaDB's answer to NOWAIT, and any timed-out wait
	errLockNowait      = 3572 // MySQL 8's answer to NOWAIT
)

// lockBusy reports whether err says that a locking read could not have the
// row: not acquired, as opposed to failed.
func lockBusy(err error) bool {
	var me *mysql.MySQLError
	return errors.As(err, &me) && (me.Number == errLockWaitTimeout || me.Number == errLockNowait)
}

// NewRowLock returns the rowlock strategy over db, whose connections it pins
// for held locks. It does no I/O; Migrate creates the tables. Call Close to
// roll back what is still held and return the connections. The error
// matches dlock.ErrInvalidOption for a pool limited to one connection.
func NewRowLock(db *sql.DB, opts *Options) (*RowLock, error) {
	table, err := checkArgs(db == nil, opts)
	if err == nil {
		err = leaseOnly("rowlock", opts)
	}
	if err != nil {
		return nil, err
	}
	base := strings.TrimSuffix(table, "`")
	s := newSessions(db, table).forStrategy("rowlock", minRowLockConns, connector(opts))
	s.marked = true
	s.log = logger(opts)
	if n := s.limit(); n == 1 {
		return nil, poolTooSmall(n)
	}
	return &RowLock{claims: newClaims(db, table, "rowlock"), freed: make(chan struct{}), db: db, s: s, rows: base + "_rows`", table: table,
		held: make(map[string]*rowHold), known: make(map[string]struct{}), warn: warner{log: logger(opts)}}, nil
}

// Migrate creates the tables of Options.Table if they are missing (the same
// schema as the lease strategy's, so that any strategy's Migrate serves all
// three), and logs the server settings that break a guarantee (see Check)
// when Options.Logger is set.
func (r *RowLock) Migrate(ctx context.Context) error {
	return migrate(ctx, r.db, r.table, &r.warn, r.Check)
}

// Close rolls back every held lock and returns the pinned connections.
func (r *RowLock) Close() error {
	r.mu.Lock()
	holds := r.held
	r.held = make(map[string]*rowHold)
	r.pinned -= len(holds)
	r.mu.Unlock()
	for _, h := range holds {
		_ = h.tx.Rollback()
	}
	r.s.closeAll()
	return nil
}

// Acquire implements dlock.Backend with FOR UPDATE NOWAIT.
func (r *RowLock) Acquire(ctx context.Context, req dlock.Request) (dlock.Result, error) {
	return r.take(ctx, req, 0, time.Now())
}

// AcquireWait implements dlock.Waiter: a blocking FOR UPDATE bounded by
// innodb_lock_wait_timeout, interrupted when ctx ends (see killUntil). In a
// caller's pool with a limit, it waits for a connection to pin when every
// one it may pin holds a lock.
func (r *RowLock) AcquireWait(ctx context.Context, req dlock.Request) (dlock.Result, error) {
	began := time.Now()
	wait := maxWait
	if d, ok := ctx.Deadline(); ok {
		wait = min(wait, time.Until(d))
	}
	return r.take(ctx, req, max(wait, time.Second), began)
}

// WaitsDirectly implements dlock.DirectWaiter: every acquisition pins a
// session of its own, so a blocking acquisition calls AcquireWait at once,
// whose locking read takes a free key as a try does, and under contention
// saves the try's transaction. A blocking acquisition tries first on MySQL,
// where a wait also sets the session's innodb_lock_wait_timeout first (see
// waitQuery), and in a caller's pool with a limit, where a try fails at once
// when every connection it may pin holds a lock (AcquireWait would wait for
// one, for ever if the caller holds them all).
func (r *RowLock) WaitsDirectly() bool {
	return r.flavor.Load() != flavorMySQL && r.s.limit() == 0
}

// A grant's SentAfter (relative to began) is when the locking read returned:
// the session's wait_timeout counts from its last statement's reply, which
// came before that (by one network trip, which the Locker's margin covers).
func (r *RowLock) take(ctx context.Context, req dlock.Request, wait time.Duration, began time.Time) (dlock.Result, error) {
	if err := exclusiveOnly("rowlock", req); err != nil {
		return dlock.Result{}, err
	}
	if err := checkLockDelay("rowlock", req); err != nil {
		return dlock.Result{}, err
	}
	if ttl := holderTTL(req); ttl > MaxSessionTTL {
		return dlock.Result{}, fmt.Errorf("%w: mysqllock: rowlock: ttl %s is above the maximum %s (the server caps wait_timeout at one year)", dlock.ErrInvalidOption, ttl, MaxSessionTTL)
	}
	r.warn.warnOnce(ctx, r.Check)
	if err := r.ac.check(ctx, r.db); err != nil {
		return dlock.Result{}, wrapErr(r.table, "rowlock acquire", err)
	}
	// Refused on Galera before the key is claimed, so that the lease
	// strategy may still take it.
	if err := r.s.checkGalera(ctx, r.db); err != nil {
		return dlock.Result{}, wrapErr(r.table, "rowlock acquire", err)
	}
	if err := r.claims.Check(ctx, req.Key); err != nil {
		return dlock.Result{}, wrapErr(r.table, "rowlock acquire", err)
	}
	r.mu.Lock()
	_, mine := r.held[req.Key]
	r.mu.Unlock()
	if mine && wait == 0 {
		return r.s.notAcquired(ctx, req), nil
	}
	ss, err := r.pin(ctx, holderTTL(req), wait > 0)
	if err != nil {
		if wait > 0 && ctx.Err() != nil { // waited for a connection in vain
			return dlock.Result{}, nil
		}
		return dlock.Result{}, wrapErr(r.rows, "rowlock acquire", err)
	}
	sctx, cancel := detached(ctx)
	defer cancel()
	if err := r.ensureRow(sctx, ss, req.Key); err != nil {
		ss.broken.Store(sessionLost(err))
		r.unpin(ss)
		return dlock.Result{}, wrapErr(r.rows, "rowlock acquire", err)
	}
	// The transaction outlives this call: it is the lock. READ COMMITTED
	// (the session's level, see sessions.readCommitted): its locking read
	// locks the key's row and no gap, where REPEATABLE READ could also lock
	// the gap after it (seen as the supremum of the rows table), and every
	// insert of a new key into that gap would wait for this lock's release.
	tx, err := ss.conn.BeginTx(context.WithoutCancel(ctx), nil)
	if err != nil {
		ss.broken.Store(true)
		r.unpin(ss)
		return dlock.Result{}, wrapErr(r.rows, "rowlock acquire", err)
	}
	q := `SELECT name FROM ` + r.rows + ` WHERE name = ? FOR UPDATE NOWAIT`
	if wait > 0 {
		if q, err = r.waitQuery(sctx, tx, int(math.Ceil(wait.Seconds()))); err == nil {
			waited := make(chan struct{})
			stop := context.AfterFunc(ctx, func() { killUntil(r.db, ss.id, waited) })
			wctx, wcancel := context.WithTimeout(context.WithoutCancel(ctx), wait+statementTimeout)
			var name []byte
			ss.waiting.Store(true)
			err = tx.QueryRowContext(wctx, q, req.Key).Scan(&name)
			ss.waiting.Store(false)
			close(waited)
			wcancel()
			if !stop() { // ctx ended: drop the session, and with it any grant
				ss.broken.Store(true)
				_ = tx.Rollback()
				r.unpin(ss)
				return dlock.Result{}, nil
			}
		}
	} else {
		var name []byte
		err = tx.QueryRowContext(sctx, q, req.Key).Scan(&name)
	}
	if err != nil {
		_ = tx.Rollback()
		ss.broken.Store(sessionLost(err))
		r.unpin(ss)
		if lockBusy(err) || wait > 0 && waitCut(err) {
			return r.s.notAcquired(ctx, req), nil
		}
		return dlock.Result{}, wrapErr(r.rows, "rowlock acquire", err)
	}
	granted := time.Now()
	if f := rowLockedHook.Load(); f != nil {
		(*f)(req.Key, ss.id)
	}
	// The fence is written on another connection, so that it counts at
	// once (it is not part of the locking transaction); it counts only if
	// the row stayed locked across its write. The write is made only while
	// the locking session holds its own mark (see ownMark): if the session
	// ended before, another client may have locked the row and written a
	// smaller fence meanwhile, and the holder's row (List, ForceRelease)
	// stays as it wrote it. That is not proof enough: a server ending a
	// session rolls its transaction back (freeing the row) before it frees
	// its named locks. The locking transaction still open after the write
	// proves it.
	fence, delayed, err := r.s.grant(sctx, r.db, ss, req, "", true)
	if err != nil || fence == 0 {
		_ = tx.Rollback()
		r.unpin(ss)
	}
	switch {
	case err != nil:
		return dlock.Result{}, wrapErr(r.rows, "rowlock acquire", err)
	case fence == 0 && wait > 0: // refused by a lock-delay: wait it out
		sleepDelay(ctx, min(delayed, wait))
		return dlock.Result{}, nil
	case fence == 0:
		res := r.s.notAcquired(ctx, req)
		res.Remaining = delayed
		return res, nil
	}
	if err := txOpen(sctx, tx); err != nil {
		_ = tx.Rollback()
		ss.broken.Store(true)
		r.unpin(ss)
		return dlock.Result{}, wrapErr(r.rows, "rowlock acquire", fmt.Errorf("the row was not held across the fence's write: %w", err))
	}
	r.mu.Lock()
	r.held[req.Key] = &rowHold{ss: ss, tx: tx, token: req.Token}
	r.mu.Unlock()
	return dlock.Result{Acquired: true, Fence: fence, SentAfter: granted.Sub(began)}, nil
}

// minRowLockConns is the smallest pool limit (SetMaxOpenConns) that rowlock
// works with: a connection pinned for each held lock, and one for the
// grants and the other statements.
const minRowLockConns = 2

// poolTooSmall is the error for a pool whose limit n is below
// minRowLockConns.
func poolTooSmall(n int) error {
	return fmt.Errorf("%w: mysqllock: rowlock needs a pool of at least %d connections, db has SetMaxOpenConns(%d)",
		dlock.ErrInvalidOption, minRowLockConns, n)
}

// pin pins a session for one lock. In a pool with a limit of n connections
// at most n−1 are pinned, so that one is left for the grants and the other
// statements (else acquisitions would block each other for good): beyond
// that an attempt fails at once, and a wait (wait true) waits until a
// pinned session is given back or ctx ends.
func (r *RowLock) pin(ctx context.Context, ttl time.Duration, wait bool) (*session, error) {
	for {
		n := r.s.limit() // 0 with a Connector: sessions are outside db's pool
		if n > 0 && n < minRowLockConns {
			return nil, poolTooSmall(n)
		}
		r.mu.Lock()
		if n == 0 || r.pinned < n-1 {
			r.pinned++
			r.mu.Unlock()
			break
		}
		freed := r.freed
		r.mu.Unlock()
		if !wait {
			return nil, fmt.Errorf("mysqllock: rowlock: no connection to pin: SetMaxOpenConns(%d) allows %d held locks", n, n-1)
		}
		t := time.NewTimer(time.Second) // the limit may be raised meanwhile
		select {
		case <-freed:
		case <-t.C:
		case <-ctx.Done():
			t.Stop()
			return nil, ctx.Err()
		}
		t.Stop()
	}
	ss, err := r.s.open(ctx, ttl)
	if err != nil {
		r.unpinned()
		return nil, err
	}
	return ss, nil
}

// unpin gives a session back: in a pool with a limit to the pool at once
// (a parked session would keep a connection from it), else parked for
// reuse.
func (r *RowLock) unpin(ss *session) {
	if r.s.limit() > 0 {
		r.s.discard(ss)
	} else {
		r.s.close(ss)
	}
	r.unpinned()
}

// unpinned counts a pinned session given back and wakes the waits for one.
func (r *RowLock) unpinned() {
	r.mu.Lock()
	r.pinned--
	close(r.freed)
	r.freed = make(chan struct{})
	r.mu.Unlock()
}

// Server flavours, as far as waitQuery needs to know.
const (
	flavorUnknown = iota
	flavorMariaDB // has SET STATEMENT and max_statement_time
	flavorMySQL
)

// waitQuery returns the blocking locking read for a wait of secs seconds. On
// MariaDB the read runs with max_statement_time = 0 (a limit from the user's
// grants, the DSN or the server would end the wait with error 1969) and its
// innodb_lock_wait_timeout, both for that statement only. Elsewhere the
// session's innodb_lock_wait_timeout is set first.
func (r *RowLock) waitQuery(ctx context.Context, tx *sql.Tx, secs int) (string, error) {
	q := `SELECT name FROM ` + r.rows + ` WHERE name = ? FOR UPDATE`
	if r.flavor.Load() == flavorUnknown {
		var v sql.NullString
		err := tx.QueryRowContext(ctx, "SELECT @@max_statement_time").Scan(&v)
		switch {
		case err == nil:
			r.flavor.Store(flavorMariaDB)
		case unknownVariable(err):
			r.flavor.Store(flavorMySQL)
		default:
			return "", err
		}
	}
	if r.flavor.Load() == flavorMariaDB {
		return fmt.Sprintf("SET STATEMENT max_statement_time = 0, innodb_lock_wait_timeout = %d FOR %s", secs, q), nil
	}
	_, err := tx.ExecContext(ctx, fmt.Sprintf("SET SESSION innodb_lock_wait_timeout = %d", secs))
	return q, err
}

// MySQL error numbers of a statement ended by a time limit.
const (
	errStatementTimeout = 1969 // MariaDB: max_statement_time exceeded
	errQueryTimeout     = 3024 // MySQL: max_execution_time exceeded
)

// waitCut reports whether err says that a statement time limit ended a
// wait: the wait is over, nothing was taken.
func waitCut(err error) bool {
	var me *mysql.MySQLError
	return errors.As(err, &me) && (me.Number == errStatementTimeout || me.Number == errQueryTimeout)
}

// rowLockedHook, when set (by tests), runs in take between locking the row
// and writing the fence, with the key and the locking session's id.
var rowLockedHook atomic.Pointer[func(key string, connID int64)]

// ensureRow creates key's row if it does not exist yet. The plain read does
// not wait for locks; INSERT IGNORE runs only for a missing row.
func (r *RowLock) ensureRow(ctx context.Context, ss *session, key string) error {
	r.mu.Lock()
	_, seen := r.known[key]
	r.mu.Unlock()
	if seen { // rows are never deleted
		return nil
	}
	var one int
	err := ss.queryRow(ctx, `SELECT 1 FROM `+r.rows+` WHERE name = ?`, []any{key}, &one)
	if errors.Is(err, sql.ErrNoRows) {
		_, err = ss.ExecContext(ctx, `INSERT IGNORE INTO `+r.rows+` (name) VALUES (?)`, key)
	}
	if err == nil {
		r.mu.Lock()
		if len(r.known) >= maxKnownRows {
			clear(r.known)
		}
		r.known[key] = struct{}{}
		r.mu.Unlock()
	}
	return err
}

// maxKnownRows bounds the cache of keys whose row is known to exist.
const maxKnownRows = 10000

// killRepeat is how soon killUntil repeats its KILL QUERY; the interval
// doubles after each, up to killRepeatMax (a statement that ignores it,
// such as a commit that waits, then draws one a second).
const (
	killRepeat    = 50 * time.Millisecond
	killRepeatMax = time.Second
)

// killUntil interrupts the statement of server session id, for a wait
// whose caller left: KILL QUERY, repeated (see killRepeat) until done is
// closed (the statement has returned), since the server discards one that
// arrives before the statement starts. The session is dropped afterwards.
// (KILL CONNECTION is not used: a session killed while it commits to a
// table versioned by transaction can disable the server's transaction
// registry until it restarts.)
func killUntil(db *sql.DB, id int64, done <-chan struct{}) {
	repeat.Until(done, killRepeat, killRepeatMax, func() { killQuery(db, id) })
}

// killQuery sends one KILL QUERY for server session id.
func killQuery(db *sql.DB, id int64) {
	ctx, cancel := context.WithTimeout(context.Background(), 5*time.Second)
	defer cancel()
	_, _ = db.ExecContext(ctx, fmt.Sprintf("KILL QUERY %d", id))
}

// hold returns key's hold if tok holds it.
func (r *RowLock) hold(key string, tok dlock.Token) *rowHold {
	r.mu.Lock()
	defer r.mu.Unlock()
	if h := r.held[key]; h != nil && h.token == tok {
		return h
	}
	return nil
}

// rowEnd is how drop ends a locking transaction: with a ROLLBACK (the
// lock is lost), or with a COMMIT that sets set in the key's record: it
// marks the record as released (for List) and, after a Release, its
// lock-delay as not to be kept; with keep, for a minimum hold, the key
// stays from every grant for keep from the COMMIT (delay_until, which the
// grant's statement checks, as for a lock-delay).
type rowEnd struct {
	set  string
	keep time.Duration
}

var (
	rollback  = rowEnd{}
	released  = rowEnd{set: "conn_id = 0, delay_us = 0"}
	abandoned = rowEnd{set: "conn_id = 0"}
)

func kept(keep time.Duration) rowEnd {
	return rowEnd{set: "conn_id = 0, delay_us = 0, delay_until = GREATEST(delay_until, UTC_TIMESTAMP(6) + INTERVAL ? MICROSECOND)", keep: keep}
}

// drop forgets a hold and ends its transaction (setting how.set in the
// key's record, then committing, or rolling back for rollback) and session.
func (r *RowLock) drop(key string, h *rowHold, how rowEnd) error {
	r.mu.Lock()
	if r.held[key] == h {
		delete(r.held, key)
	}
	r.mu.Unlock()
	var err error
	// Serialized with a renewal check on the same transaction: two
	// statements in flight on one connection break it.
	h.ss.mu.Lock()
	if how != rollback {
		args := []any{key, h.token[:]}
		if how.keep > 0 {
			args = append([]any{how.keep.Microseconds()}, args...)
		}
		sctx, cancel := context.WithTimeout(context.Background(), statementTimeout)
		var res sql.Result
		res, err = h.tx.ExecContext(sctx, `UPDATE `+r.s.table+` SET `+how.set+` WHERE name = ? AND token = ?`, args...)
		cancel()
		if err == nil && how.keep > 0 {
			if n, rerr := res.RowsAffected(); rerr != nil || n != 1 {
				err = fmt.Errorf("the minimum hold was not recorded: %d rows, %v", n, rerr)
			}
		}
		if err == nil {
			err = h.tx.Commit()
		} else {
			_ = h.tx.Rollback()
		}
	} else {
		_ = h.tx.Rollback()
	}
	h.ss.mu.Unlock()
	if sessionLost(err) {
		h.ss.broken.Store(true)
	}
	r.unpin(h.ss)
	return err
}

// Extend implements dlock.Backend: each held transaction is asked whether it
// is still open (which also keeps its session from timing out).
func (r *RowLock) Extend(ctx context.Context, leases []dlock.Lease) ([]error, error) {
	errs := make([]error, len(leases))
	sctx, cancel := detached(ctx)
	defer cancel()
	for i, l := range leases {
		h := r.hold(l.Key, l.Token)
		if h == nil {
			errs[i] = dlock.ErrNotHeld
			continue
		}
		h.ss.mu.Lock()
		err := txOpen(sctx, h.tx)
		h.ss.mu.Unlock()
		switch {
		case errors.Is(err, errTxEnded):
			r.drop(l.Key, h, rollback)
			errs[i] = fmt.Errorf("%w: %v", dlock.ErrNotHeld, err)
		case sessionLost(err):
			h.ss.broken.Store(true)
			r.drop(l.Key, h, rollback)
			errs[i] = fmt.Errorf("%w: session lost: %v", dlock.ErrNotHeld, err)
		case err != nil:
			errs[i] = wrapErr(r.rows, "rowlock extend", err)
		}
	}
	return errs, nil
}

// errTxEnded says that a locking transaction ended without our COMMIT.
var errTxEnded = errors.New("the transaction holding the row ended")

// txOpen asks the locking transaction whether it is still open (then its
// session is alive and its row lock held since the locking read): nil if so,
// errTxEnded if the session is alive without it, the statement's error if
// the session is gone.
func txOpen(ctx context.Context, tx *sql.Tx) error {
	var open int
	err := tx.QueryRowContext(ctx, "SELECT @@in_transaction").Scan(&open)
	if unknownVariable(err) { // MySQL
		err = tx.QueryRowContext(ctx, "SELECT 1").Scan(&open)
	}
	if err == nil && open != 1 {
		return errTxEnded
	}
	return err
}

// Release implements dlock.Backend: COMMIT, with the grant marked released
// (no lock-delay to keep) in the same transaction.
func (r *RowLock) Release(ctx context.Context, key string, token dlock.Token) error {
	return r.end(key, token, released)
}

// end commits key's locking transaction held by token, ending it as how
// says (released, abandoned or kept).
func (r *RowLock) end(key string, token dlock.Token, how rowEnd) error {
	h := r.hold(key, token)
	if h == nil {
		return dlock.ErrNotHeld
	}
	if err := r.drop(key, h, how); err != nil {
		return fmt.Errorf("%w: commit: %v", dlock.ErrNotHeld, err)
	}
	return nil
}

// rowHeld is the condition, on a row of the session table, that its last
// holder still holds it: not released (conn_id 0) and its session alive
// (holding its alive mark, see aliveMark).
var rowHeld = `lock_name = '' AND conn_id <> 0
  AND ` + sessionAlive("conn_id")

// SetMetadata implements dlock.MetadataSetter for a lock held here: one
// UPDATE of the key's row in the session table, on a pool connection, that
// matches only if token is the key's last holder, not released, and its
// session alive (what List shows). It runs in autocommit, not in the
// locking transaction, whose writes nobody sees before its COMMIT, and
// never on the pinned session, which ctx therefore cannot end. A release
// marks the row in the locking transaction before it commits, so that the
// UPDATE, which waits for that row, then matches nothing.
func (r *RowLock) SetMetadata(ctx context.Context, key string, token dlock.Token, metadata string) error {
	if r.hold(key, token) == nil {
		return dlock.ErrNotHeld
	}
	ok, err := setMetadata(ctx, r.db, `UPDATE `+r.s.table+` SET metadata = ?, fence = LAST_INSERT_ID(fence)
WHERE name = ? AND token = ? AND `+rowHeld, key, token, metadata)
	if err == nil && !ok {
		// No fence in the reply: no row matched, or a trigger hid it. A
		// released or lost lock does not come back, so one held now was
		// held when the UPDATE ran.
		var n int
		err = r.db.QueryRowContext(ctx, `SELECT COUNT(*) FROM `+r.s.table+` WHERE name = ? AND token = ? AND `+rowHeld, key, token[:]).Scan(&n)
		if err == nil && n == 0 {
			return dlock.ErrNotHeld
		}
	}
	if err != nil {
		return wrapErr(r.rows, "rowlock set metadata", err)
	}
	return nil
}

// ForceRelease implements dlock.ForceReleaser by killing the session of the
// key's last holder if its row is locked.
func (r *RowLock) ForceRelease(ctx context.Context, key string) error {
	if err := r.claims.CheckOnly(ctx, key); err != nil {
		return wrapErr(r.table, "rowlock force release", err)
	}
	tx, err := r.db.BeginTx(ctx, nil)
	if err != nil {
		return wrapErr(r.rows, "rowlock force release", err)
	}
	var name []byte
	err = tx.QueryRowContext(ctx, `SELECT name FROM `+r.rows+` WHERE name = ? FOR UPDATE NOWAIT`, key).Scan(&name)
	_ = tx.Rollback()
	switch {
	case err == nil || errors.Is(err, sql.ErrNoRows):
		return dlock.ErrNotHeld
	case !lockBusy(err):
		return wrapErr(r.rows, "rowlock force release", err)
	}
	var id int64
	if err := r.db.QueryRowContext(ctx, `SELECT conn_id FROM `+r.s.table+` WHERE name = ?`, key).Scan(&id); err != nil {
		return wrapErr(r.rows, "rowlock force release", err)
	}
	if _, err := r.db.ExecContext(ctx, fmt.Sprintf("KILL CONNECTION %d", id)); err != nil {
		return wrapErr(r.rows, "rowlock force release", err)
	}
	return nil
}

// List implements dlock.Lister: keys whose last holder has not released them
// and whose session still exists (it holds its alive mark). InnoDB's own
// lock tables are not used: INNODB_TRX is a cache that polling keeps stale.
// ExpiresAt is zero: the lock lasts as long as the holder's session.
func (r *RowLock) List(ctx context.Context, prefix string) ([]dlock.LockInfo, error) {
	hs, err := r.s.holders(ctx, `LEFT(name, ?) = ? AND `+rowHeld, len(prefix), []byte(prefix))
	if err != nil {
		return nil, wrapErr(r.rows, "rowlock list", err)
	}
	return hs, nil
}
