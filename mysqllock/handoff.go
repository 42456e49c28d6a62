package mysqllock

import (
	"context"
	"database/sql"
	"errors"
	"strconv"
	"strings"
	"sync/atomic"
	"time"

	"github.com/dlock-dev/dlock"
	"github.com/go-sql-driver/mysql"
)

// The lease strategy's handoffs: a release hands the lease to the waiter
// its doorbell wakes, in the release's own transaction.
//
// Without them a handoff costs two durable commits (the release, then the
// woken waiter's acquisition) and the waiter's round trips in between. With
// them, each wait on a doorbell runs as the wait procedure: it records the
// waiting session, the token and the lease it asks for in the queue table
// (MEMORY), waits on the doorbell, and once woken reads the key's row with
// a locking read. An exclusive release by a holder of the doorbell runs as
// the handoff procedure, on the doorbell's session: it locks the key's row,
// checks that the token holds the lease, rings the doorbell (RELEASE_LOCK),
// asks the server which session the doorbell went to (IS_USED_LOCK: the
// server grants a released named lock to its first waiter before
// RELEASE_LOCK returns), and if that session's queue row asks for an
// exclusive lease of the key, releases the lease and grants it to that row's
// token (the next fence, a lease from the grant's instant), then commits:
// one durable commit per handoff. The woken waiter's locking read waits for
// that commit and finds its token holding, with the doorbell.
//
// InnoDB makes a commit visible to other sessions (and releases its row
// locks) before it flushes the commit to the log, and MariaDB may go on with
// the committing session's next statements before the flush too: only its
// reply to the client waits for it. A waiter that told its client of a
// grant read in between would hold a lease, and a fence, that a crash of
// the server at that instant forgets: the next grant after the restart
// would carry the same fence. So the woken waiter, once it has read its
// grant, writes its own lease row (its end, one microsecond later): its
// reply then waits for a flush that covers the handoff's commit, which
// came before it in the log. Besides, the handoff procedure holds the
// key's commit barrier (a named lock) from before it rings the doorbell
// until its COMMIT statement has returned, and hands nothing over without
// it; the woken waiter passes the barrier (takes and frees it) before it
// reads its grant, and if it cannot within 10 s, it gives back whatever it
// was handed instead of reading it.
//
// Exclusion is the lease row's, as before: a grant is a write of the row
// under its lock by the holder's release. A waiter that is not handed the
// lease (the doorbell went to a session whose queue row does not ask for it,
// or to none, or an earlier version released) finds the lease free, first
// in line, as without handoffs. A wait that ends without an answer (its
// context ended, its session broke) may have been handed the lease as it
// ended: it releases its token before it returns (see leave). A handed
// lease is timed from the start of the wait procedure, sent after the wait
// began: the procedure answers how long after its start the lease ends.
//
// Handoffs need the doorbells on the lease rows' server (not a Galera store)
// and the two procedures, which Migrate creates; a server without them
// (an earlier version's tables, no CREATE ROUTINE) answers the first CALL
// with an error that ran nothing, and the Backend goes on without handoffs.

// handoffVersion is part of the procedures' names (see grantProcVersion).
const handoffVersion = "5"

// queueTable is the queue table of the lock table table (quoted).
func queueTable(table string) string { return strings.TrimSuffix(table, "`") + "_queue`" }

// waitProc and handoffProc are the procedures of the lock table table.
func waitProc(table string) string {
	return strings.TrimSuffix(table, "`") + "_wait" + handoffVersion + "`"
}

func handoffProc(table string) string {
	return strings.TrimSuffix(table, "`") + "_hand" + handoffVersion + "`"
}

// barrierName is the named lock that a handoff of key holds until its
// COMMIT statement has returned (see above).
func barrierName(key string) string { return lockName("dbarr", key) }

// barrierWait bounds (in seconds) a woken waiter's wait for a handoff's
// COMMIT statement to return.
const barrierWait = 10

// waitProcSQL is the CREATE PROCEDURE statement of the wait procedure of
// table: record the wait, wait up to p_wait for the doorbell p_name (as a
// statement SELECT GET_LOCK(X'…', wait), which namedWaiters finds in the
// process list), and if it got the doorbell and waits for an exclusive
// lease, read the key's row with a locking read, which waits for a handoff
// in progress to commit. The row answered is the doorbell's result, whether
// the token holds the lease, its fence, and the microseconds from the
// procedure's start to the lease's end. A wait that cannot record itself
// (the queue table full, missing or denied) waits all the same, and is
// handed nothing.
func waitProcSQL(table string) string {
	return `CREATE PROCEDURE ` + waitProc(table) + `(
  IN p_name VARCHAR(64) CHARACTER SET utf8mb4, IN p_wait DECIMAL(14,6),
  IN p_key VARBINARY(255), IN p_token BINARY(16), IN p_owner VARCHAR(255) CHARACTER SET utf8mb4,
  IN p_meta VARCHAR(1024) CHARACTER SET utf8mb4, IN p_ttl BIGINT UNSIGNED,
  IN p_barrier VARCHAR(64) CHARACTER SET utf8mb4)
MODIFIES SQL DATA SQL SECURITY INVOKER
BEGIN
  DECLARE v_start DATETIME(6) DEFAULT UTC_TIMESTAMP(6);
  DECLARE v_pass INT DEFAULT NULL;
  DECLARE v_mine BOOL DEFAULT FALSE;
  DECLARE v_fence BIGINT UNSIGNED DEFAULT 0;
  DECLARE v_span BIGINT DEFAULT 0;
  DECLARE v_queued BOOL DEFAULT TRUE;
  DECLARE CONTINUE HANDLER FOR NOT FOUND SET v_mine = FALSE;
  BEGIN
    DECLARE CONTINUE HANDLER FOR SQLEXCEPTION SET v_queued = FALSE;
    REPLACE INTO ` + queueTable(table) + ` (conn_id, name, token, owner, metadata, ttl_us, until)
      VALUES (CONNECTION_ID(), p_key, p_token, p_owner, p_meta, p_ttl,
        UTC_TIMESTAMP(6) + INTERVAL CEIL(p_wait) + 1 SECOND);
  END;
  SET @dlock_got = NULL,
    @dlock_wait = CONCAT('SELECT GET_LOCK(X''', LOWER(HEX(p_name)), ''', ', p_wait, ') INTO @dlock_got');
  PREPARE dlock_wait FROM @dlock_wait;
  EXECUTE dlock_wait;
  DEALLOCATE PREPARE dlock_wait;
  IF @dlock_got = 1 AND p_ttl > 0 AND v_queued THEN
    SET v_pass = GET_LOCK(p_barrier, ` + strconv.Itoa(barrierWait) + `);
    IF v_pass = 1 THEN
      DO RELEASE_LOCK(p_barrier);
      SELECT token = p_token AND expires_at > UTC_TIMESTAMP(6), fence, TIMESTAMPDIFF(MICROSECOND, v_start, expires_at)
        INTO v_mine, v_fence, v_span FROM ` + table + ` WHERE name = p_key LOCK IN SHARE MODE;
      IF v_mine THEN
        UPDATE ` + table + ` SET expires_at = expires_at + INTERVAL 1 MICROSECOND
          WHERE name = p_key AND token = p_token AND expires_at > UTC_TIMESTAMP(6);
        SET v_mine = ROW_COUNT() = 1;
      END IF;
    ELSE
      UPDATE ` + table + ` SET expires_at = UTC_TIMESTAMP(6), token = ` + noToken + `
        WHERE name = p_key AND token = p_token AND expires_at > UTC_TIMESTAMP(6);
    END IF;
  END IF;
  IF v_queued THEN
    DELETE FROM ` + queueTable(table) + ` WHERE conn_id = CONNECTION_ID();
  END IF;
  SELECT @dlock_got, v_mine, IF(v_mine, v_fence, 0), IF(v_mine, v_span, 0);
END`
}

// handoffProcSQL is the CREATE PROCEDURE statement of the handoff
// procedure of table, run on the session that holds p_key's doorbell
// p_name: release p_token's exclusive lease of p_key and hand it to the
// exclusive waiter the doorbell wakes, if any, in one transaction. The
// release and the grant are two updates of the row (the journal records
// both). The release ends the lease at the instant its check used (the
// start of the locking read, which may then wait for the row): a later
// instant could be past the lease's end, and move it later. Only a
// doorbell this session held is passed on with the lease, only a release
// that changed the row (still the token's, under the row lock) is followed
// by the grant, and a queue that cannot be read hands nothing. The row
// answered is whether the token held the lease, what RELEASE_LOCK
// answered, and whether the lease was handed over.
func handoffProcSQL(table string) string {
	return `CREATE PROCEDURE ` + handoffProc(table) + `(
  IN p_key VARBINARY(255), IN p_token BINARY(16), IN p_name VARCHAR(64) CHARACTER SET utf8mb4,
  IN p_barrier VARCHAR(64) CHARACTER SET utf8mb4)
MODIFIES SQL DATA SQL SECURITY INVOKER
BEGIN
  DECLARE v_barrier INT DEFAULT NULL;
  DECLARE v_held, v_unshared BOOL DEFAULT FALSE;
  DECLARE v_now DATETIME(6);
  DECLARE v_rang, v_next BIGINT DEFAULT NULL;
  DECLARE v_token BINARY(16) DEFAULT NULL;
  DECLARE v_owner VARCHAR(255) CHARACTER SET utf8mb4 DEFAULT '';
  DECLARE v_meta VARCHAR(1024) CHARACTER SET utf8mb4 DEFAULT '';
  DECLARE v_ttl BIGINT UNSIGNED DEFAULT 0;
  DECLARE CONTINUE HANDLER FOR NOT FOUND SET v_token = NULL;
  DECLARE EXIT HANDLER FOR SQLEXCEPTION BEGIN
    ROLLBACK;
    IF v_barrier = 1 THEN DO RELEASE_LOCK(p_barrier); END IF;
    RESIGNAL;
  END;
  SET v_barrier = GET_LOCK(p_barrier, 0);
  START TRANSACTION;
  SELECT token = p_token AND expires_at > UTC_TIMESTAMP(6), shared_until <= UTC_TIMESTAMP(6), UTC_TIMESTAMP(6)
    INTO v_held, v_unshared, v_now FROM ` + table + ` WHERE name = p_key FOR UPDATE;
  SET v_rang = RELEASE_LOCK(p_name);
  IF v_held THEN
    SET v_next = IS_USED_LOCK(p_name);
    IF v_next IS NOT NULL AND v_unshared AND v_rang = 1 AND v_barrier = 1 THEN
      BEGIN
        DECLARE CONTINUE HANDLER FOR SQLEXCEPTION SET v_token = NULL;
        SELECT token, owner, metadata, ttl_us INTO v_token, v_owner, v_meta, v_ttl FROM ` + queueTable(table) + `
          WHERE conn_id = v_next AND name = p_key AND ttl_us > 0 AND until > UTC_TIMESTAMP(6);
      END;
    END IF;
    UPDATE ` + table + ` SET expires_at = v_now, token = ` + noToken + ` WHERE name = p_key AND token = p_token;
    IF v_token IS NOT NULL AND ROW_COUNT() = 1 THEN
      UPDATE ` + table + ` SET token = v_token, owner = v_owner, metadata = v_meta, acquired_at = UTC_TIMESTAMP(6),
        fence = fence + 1, writer_until = '1970-01-01', expires_at = UTC_TIMESTAMP(6) + INTERVAL v_ttl MICROSECOND
        WHERE name = p_key;
    END IF;
  END IF;
  COMMIT;
  IF v_barrier = 1 THEN DO RELEASE_LOCK(p_barrier); END IF;
  SELECT v_held, v_rang, v_token IS NOT NULL;
END`
}

// handoffs is a Backend's use of the procedures.
type handoffs struct {
	table string      // quoted, as given
	leave string      // deletes a wait's queue row (on the lease table's pool)
	off   atomic.Bool // the server has no procedures: no handoffs
	// calls holds the CALL statements once the procedures' database is
	// known (see procCalls).
	calls atomic.Pointer[procCalls]
}

// procCalls are the CALL statements of the wait and the handoff procedure.
type procCalls struct{ wait, release string }

func newHandoffs(table string) handoffs {
	return handoffs{table: table, leave: "DELETE FROM " + queueTable(table) + " WHERE conn_id = ? AND token = ?"}
}

func newProcCalls(table string) *procCalls {
	return &procCalls{
		wait:    "CALL " + waitProc(table) + "(?, ?, ?, ?, ?, ?, ?, ?)",
		release: "CALL " + handoffProc(table) + "(?, ?, ?, ?)",
	}
}

// procCalls returns the CALL statements, naming the procedures with the
// database of db (the lease table's pool), where Migrate created them: they
// run on doorbell sessions, which resolve an unqualified name in their own
// database, and Options.Connector may give them another (where a table of
// the same name would then be handed the lease instead). db is asked once,
// unless the table names its database.
func (ho *handoffs) procCalls(ctx context.Context, db *sql.DB) (*procCalls, error) {
	if c := ho.calls.Load(); c != nil {
		return c, nil
	}
	table := ho.table
	var schema sql.NullString
	if !strings.Contains(table, "`.`") {
		if err := db.QueryRowContext(ctx, "SELECT DATABASE()").Scan(&schema); err != nil {
			return nil, err
		}
	}
	if schema.Valid {
		table = "`" + strings.ReplaceAll(schema.String, "`", "``") + "`." + table
	}
	c := newProcCalls(table)
	ho.calls.Store(c)
	return c, nil
}

// handing reports whether releases hand the lease over and waits record
// themselves: with doorbells on the lease rows' server and the procedures.
func (b *Backend) handing() bool {
	return b.bells() && !b.storeGalera.is() && !b.ho.off.Load()
}

// bellWait is a lease wait run as the wait procedure (see
// GetLock.acquireWait): what it asks, and what the procedure answered.
type bellWait struct {
	ho    *handoffs
	calls *procCalls
	req   dlock.Request // the lease's request, in its own mode
	sent  time.Time     // when the CALL was sent (zero: it was not)
	conn  int64         // the waiting session
	done  bool          // the CALL answered
	mine  bool          // and the lease was handed to req.Token
	fence uint64
	span  time.Duration // from the procedure's start to the lease's end
}

// run runs the wait procedure on ss for the doorbell name, waiting up to
// wait; it reports whether the procedure exists.
func (w *bellWait) run(ctx context.Context, ss *session, name string, wait time.Duration) (got sql.NullInt64, ok bool, err error) {
	if w.ho.off.Load() {
		return got, false, nil
	}
	var ttl int64
	if w.req.Mode == dlock.ModeExclusive {
		ttl = w.req.TTL.Microseconds()
	}
	secs := strconv.FormatFloat(max(wait, 0).Seconds(), 'f', 6, 64)
	var spanUs int64
	w.sent, w.conn = time.Now(), ss.id
	err = ss.conn.QueryRowContext(ctx, w.calls.wait, name, secs, w.req.Key, w.req.Token[:], w.req.Owner, w.req.Metadata, ttl,
		barrierName(w.req.Key)).
		Scan(&got, &w.mine, &w.fence, &spanUs)
	if noHandoffProc(err) {
		w.ho.off.Store(true)
		w.sent = time.Time{}
		return got, false, nil
	}
	w.done = err == nil
	w.span = time.Duration(spanUs) * time.Microsecond
	return got, true, err
}

// leave ends a wait that returns no lease although it may have been handed
// one: its CALL ended without an answer (its session waits no more), or
// answered a handoff as the wait's context ended. It deletes the wait's
// queue row, then releases the token's lease, if any (a release that read
// the row before holds the key's row lock until it commits, so the release
// below comes after it). It returns when that is done, or after leaveWait,
// and goes on in the background.
func (b *Backend) leave(ctx context.Context, w *bellWait) {
	if w == nil || w.sent.IsZero() || (w.done && !w.mine) || w.req.Mode != dlock.ModeExclusive {
		return
	}
	done := make(chan struct{})
	go func() {
		defer close(done)
		ctx, cancel := context.WithTimeout(context.WithoutCancel(ctx), statementTimeout)
		defer cancel()
		_, _ = b.db.ExecContext(ctx, b.ho.leave, w.conn, w.req.Token[:])
		_ = b.free(ctx, "release", b.q.releaseNoBell, w.req.Key, w.req.Token[:])
	}()
	t := time.NewTimer(leaveWait)
	defer t.Stop()
	select {
	case <-done:
	case <-t.C:
	}
}

// leaveWait bounds how long a wait that ends waits for its leave.
const leaveWait = 250 * time.Millisecond

// handed is the Result of a lease handed to w's wait, begun at began. The
// lease ends w.span after the procedure's start, which came after w.sent.
// A grant found late (the waiter paused) is renewed first, so that the
// Locker gets most of a TTL.
func (b *Backend) handed(ctx context.Context, w *bellWait, began time.Time) (dlock.Result, error) {
	req := w.req
	b.belledFor(req.Key, req.Token, w.span)
	res := dlock.Result{Acquired: true, Fence: w.fence, SentAfter: w.sent.Sub(began) + w.span - req.TTL}
	if short := req.TTL - (w.span - time.Since(w.sent)); short > req.TTL/5 {
		extending := time.Now()
		errs, err := b.Extend(ctx, []dlock.Lease{{Key: req.Key, Token: req.Token, TTL: req.TTL}})
		switch {
		case err == nil && errors.Is(errs[0], dlock.ErrNotHeld): // gone already (a forced release)
			return dlock.Result{}, nil
		case err == nil && errs[0] == nil:
			res.SentAfter = extending.Sub(began)
		}
	}
	return res, nil
}

// noHandoffProc reports whether err is a CALL's error that ran nothing of a
// handoff procedure: none, no right to run it, or no database to find it
// in (a doorbell Connector without one).
func noHandoffProc(err error) bool {
	var me *mysql.MySQLError
	return noGrantProc(err) || errors.As(err, &me) && me.Number == errNoDatabase
}

// errNoDatabase is the server's error for a session without a database.
const errNoDatabase = 1046

// handOff releases token's lease of key with the handoff procedure on the
// session that holds the key's doorbell for it. ok is false when it did
// not run (no such session): the caller releases as without handoffs.
func (b *Backend) handOff(ctx context.Context, key string, token dlock.Token) (err error, ok bool) {
	calls, err := b.ho.procCalls(ctx, b.db)
	if err != nil {
		return nil, false // db did not answer: release as without handoffs
	}
	var held, handed bool
	var callErr, fallback error
	ran := false
	err = b.bell.end(ctx, key, token, ending{clean: true, via: func(ctx context.Context, conn *sql.Conn) (sql.NullInt64, error) {
		ran = true
		var rang sql.NullInt64
		callErr = conn.QueryRowContext(ctx, calls.release, key, token[:], b.bell.name(key), barrierName(key)).Scan(&held, &rang, &handed)
		if noHandoffProc(callErr) {
			// Nothing ran: release as without handoffs, lease first.
			b.ho.off.Store(true)
			if callErr = b.free(ctx, "release", b.q.release, key, token[:]); callErr != nil && !errors.Is(callErr, dlock.ErrNotHeld) {
				return rang, callErr
			}
			held = callErr == nil
			return rang, conn.QueryRowContext(ctx, "SELECT RELEASE_LOCK(?)", b.bell.name(key)).Scan(&rang)
		}
		if callErr != nil {
			// The outcome is unknown (the doorbell's session goes with
			// the error): end whatever transaction the session still has
			// open, then release as without handoffs, on a context of its
			// own, whether or not the caller still waits; a handoff that
			// committed leaves the token nothing to release.
			fctx, cancel := context.WithTimeout(context.WithoutCancel(ctx), statementTimeout)
			_, _ = conn.ExecContext(fctx, "ROLLBACK")
			fallback = b.free(fctx, "release", b.q.releaseNoBell, key, token[:])
			cancel()
		}
		return rang, callErr
	}})
	switch {
	case callerLeft(err): // the procedure goes on without the caller
		return b.wrap("release", err), true
	case !ran:
		return nil, false
	case callErr != nil:
		return fallback, true
	case !held:
		return dlock.ErrNotHeld, true
	}
	return nil, true
}
