package mysqllock

import (
	"context"
	"database/sql"
	"errors"
	"strconv"
	"strings"
	"time"

	"github.com/dlock-dev/dlock"
	"github.com/go-sql-driver/mysql"
)

// A getlock grant in one round trip.
//
// A getlock grant is GET_LOCK and then the statement that records the
// grant and its fence (see grant). Sent one after the other, they cost two
// round trips, and a woken waiter holds the lock for a whole round trip
// before it records the grant: under contention that round trip is most of
// a handoff. The grant procedure that Migrate creates runs both in the
// server: it takes the named lock (waiting up to a bound) and, if it got
// it, records the grant, and answers GET_LOCK's result and the fence.
//
// A wait runs as a statement of its own, SELECT GET_LOCK(X'…', wait),
// prepared in the procedure from the lock name's bytes, so that the
// server's process list shows it as namedWaiters expects; an attempt that
// does not wait (wait 0) skips that preparation. Any error of
// the recording statement is caught and answered as a fence of 0: the
// caller then records the grant with the statement of its own (grant),
// which meets the same error and deals with it (a full table, a server run
// without an epoch, a lock-delay, exhausted fences). The procedure runs
// with the caller's privileges (SQL SECURITY INVOKER).
//
// A server without the procedure (a table migrated by an older version, or
// a user without CREATE ROUTINE) answers the CALL with an error before the
// lock is taken: the strategy then uses the two statements.

// grantProcVersion is part of the procedure's name: a procedure whose
// body changes gets a new name, so that clients of another version keep
// calling the body they expect.
const grantProcVersion = "1"

// grantProc is the grant procedure of the lock table table (quoted).
func grantProc(table string) string {
	return strings.TrimSuffix(table, "`") + "_grant" + grantProcVersion + "`"
}

// grantProcSQL is the CREATE PROCEDURE statement of the grant procedure of
// the lock table table (quoted), recording grants with grantQuery.
func grantProcSQL(table string) string {
	params := []string{"p_key", "p_token", "p_owner", "p_conn", "p_name", "p_meta", "p_delay",
		"p_token", "p_owner", "p_conn", "p_name", "p_meta", "p_delay"}
	q := grantQuery(sessionTable(table), runTable(table), "")
	var b strings.Builder
	for _, p := range params {
		i := strings.IndexByte(q, '?')
		b.WriteString(q[:i])
		b.WriteString(p)
		q = q[i+1:]
	}
	b.WriteString(q)
	return `CREATE PROCEDURE ` + grantProc(table) + `(
  IN p_name VARCHAR(64) CHARACTER SET utf8mb4, IN p_wait DECIMAL(14,6),
  IN p_key VARBINARY(255), IN p_token BINARY(16), IN p_owner VARCHAR(255) CHARACTER SET utf8mb4,
  IN p_conn BIGINT UNSIGNED, IN p_meta VARCHAR(1024) CHARACTER SET utf8mb4, IN p_delay BIGINT UNSIGNED)
MODIFIES SQL DATA SQL SECURITY INVOKER
BEGIN
  IF p_wait = 0 THEN
    SET @dlock_fence = LAST_INSERT_ID(0), @dlock_got = GET_LOCK(p_name, 0);
  ELSE
    SET @dlock_fence = LAST_INSERT_ID(0), @dlock_got = NULL,
      @dlock_wait = CONCAT('SELECT GET_LOCK(X''', LOWER(HEX(p_name)), ''', ', p_wait, ') INTO @dlock_got');
    PREPARE dlock_wait FROM @dlock_wait;
    EXECUTE dlock_wait;
    DEALLOCATE PREPARE dlock_wait;
  END IF;
  IF @dlock_got = 1 THEN
    BEGIN
      DECLARE EXIT HANDLER FOR SQLEXCEPTION SET @dlock_fence = 0;
      ` + b.String() + `;
      SET @dlock_fence = LAST_INSERT_ID();
    END;
  END IF;
  SELECT @dlock_got, @dlock_fence;
END`
}

// errProcExists is the server's error for a procedure that exists already.
const errProcExists = 1304

// createProc runs a CREATE PROCEDURE statement; a procedure that exists
// already (made by an earlier or a concurrent Migrate) is kept.
func createProc(ctx context.Context, db execer, stmt string) error {
	_, err := db.ExecContext(ctx, stmt)
	var me *mysql.MySQLError
	if err != nil && errors.As(err, &me) && me.Number == errProcExists {
		return nil
	}
	return err
}

// errDBDenied is the server's error for a privilege on a database that the
// user lacks (CREATE ROUTINE).
const errDBDenied = 1044

// dbDenied reports whether err is errDBDenied.
func dbDenied(err error) bool {
	var me *mysql.MySQLError
	return errors.As(err, &me) && me.Number == errDBDenied
}

// Errors of a CALL that ran nothing: the procedure does not exist, or the
// user may not run it.
const (
	errNoProc         = 1305
	errProcDenied     = 1370
	errNoProcDatabase = 1049
)

// noGrantProc reports whether err is a CALL's error that ran nothing of the
// procedure, so that the lock was not taken.
func noGrantProc(err error) bool {
	var me *mysql.MySQLError
	return errors.As(err, &me) && (me.Number == errNoProc || me.Number == errProcDenied || me.Number == errNoProcDatabase)
}

// callGrant runs the grant procedure on ss: GET_LOCK(name, wait) and, if
// that got the lock, the grant's record. It returns GET_LOCK's result and
// the fence (0: the record is still to be written with grant).
func (g *GetLock) callGrant(ctx context.Context, ss *session, req dlock.Request, name string, wait time.Duration) (sql.NullInt64, uint64, error) {
	var got sql.NullInt64
	var fence uint64
	secs := strconv.FormatFloat(max(wait, 0).Seconds(), 'f', 6, 64)
	err := ss.conn.QueryRowContext(ctx, "CALL "+g.proc+"(?, ?, ?, ?, ?, ?, ?, ?)",
		name, secs, req.Key, req.Token[:], req.Owner, ss.id, req.Metadata, req.LockDelay.Microseconds()).Scan(&got, &fence)
	return got, fence, err
}
