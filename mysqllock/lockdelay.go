package mysqllock

import (
	"context"
	"database/sql"
	"errors"
	"fmt"
	"time"

	"github.com/dlock-dev/dlock"
)

// Lock-delays on the session strategies (dlock.LockDelayer).
//
// The server frees a session lock the moment the session ends, so the delay
// is kept in the key's row of the session table, where every grant is
// recorded while its lock is held (grants of a key are serialised by the
// lock itself): delay_us is the lock-delay of the last grant while it is
// neither released nor spent, and delay_until the instant, by the server's
// clock, before which no grant is made.
//
//   - A grant records its lock-delay in delay_us (0 without one).
//   - A release sets delay_us to 0 while the lock is still held (getlock:
//     a statement before RELEASE_LOCK, only for a grant with a lock-delay;
//     rowlock: in the locking transaction, with its COMMIT), so it frees
//     the key at once.
//   - The next acquirer, once it holds the lock, writes its grant only if
//     delay_us is 0 and delay_until has passed. Otherwise the last grant
//     ended without a release (its session ended, or it was abandoned), or
//     a delay is running: it moves delay_until to now + delay_us (if later),
//     sets delay_us to 0, keeps the fence, frees the lock and reports the
//     key held for what is left. Its holder lost the lock no later than
//     this acquirer took it, so the key stays from everyone for the delay
//     after the lock ended. Abandon frees the lock without clearing
//     delay_us, which leaves the same work to the next acquirer.
//
// The check is part of the grant's statement: a lock-delay of 0 costs no
// round trip, and a refusal one more (to read what is left of the delay).

// grantIfAlive is grantQuery's condition for a grant written on another
// connection than the locking session's (rowlock): that very session holds
// its own mark (see ownMark; the parameters are the mark's name and the
// session's id).
const grantIfAlive = ` AND ` + ownMarkHeld

// ownMarkHeld is the SQL condition that the session whose own mark's name
// and id are the two parameters holds that mark.
const ownMarkHeld = `IS_USED_LOCK(?) <=> ?`

// grantQuery is the statement that records a grant in the session table
// (quoted), under the condition where (an AND clause, or ""), with the
// fence of this server run (see epoch.go): a grant is made only while the
// run table has the run's epoch. It decides once, in its first assignment,
// whether the grant is made, into the session variable @dlock_granted that
// the others read (MySQL evaluates ON DUPLICATE KEY UPDATE assignments left
// to right, so delay_until is assigned before delay_us, which it reads). A
// key whose fence is the run's last is refused. LAST_INSERT_ID(x) makes the
// reply carry the new fence, or 0 when no grant was made.
func grantQuery(table, run, where string) string {
	return `INSERT INTO ` + table + `
  (name, token, owner, fence, conn_id, lock_name, acquired_at, metadata, delay_us)
SELECT ?, ?, ?, LAST_INSERT_ID(r.epoch << ` + epochShift + ` | 1), ?, ?, UTC_TIMESTAMP(6), ?, ? FROM ` + run + ` r WHERE r.id = 1` + where + `
ON DUPLICATE KEY UPDATE
  delay_until = IF(@dlock_granted := (delay_us = 0 AND delay_until <= UTC_TIMESTAMP(6) AND fence < (r.epoch << ` + epochShift + ` | ` + counterMax + `)), delay_until,
    GREATEST(delay_until, UTC_TIMESTAMP(6) + INTERVAL delay_us MICROSECOND)),
  token = IF(@dlock_granted, ?, token),
  owner = IF(@dlock_granted, ?, owner),
  fence = IF(@dlock_granted, LAST_INSERT_ID(GREATEST(fence + 1, r.epoch << ` + epochShift + ` | 1)), fence + LAST_INSERT_ID(0)),
  conn_id = IF(@dlock_granted, ?, conn_id),
  lock_name = IF(@dlock_granted, ?, lock_name),
  acquired_at = IF(@dlock_granted, UTC_TIMESTAMP(6), acquired_at),
  metadata = IF(@dlock_granted, ?, metadata),
  delay_us = IF(@dlock_granted, ?, 0)`
}

// errSessionGone is a rowlock grant's error when the locking session ended
// before the grant was written.
var errSessionGone = errors.New("the row was not held across the fence's write: the locking session ended")

// errNoRun is refused's answer when the server's run has no epoch yet.
var errNoRun = errors.New("mysqllock: the server's run has no epoch")

// refused explains a grant that wrote no fence: the server's run had no
// epoch yet (errNoRun), or, with alive, the locking session had ended
// (errSessionGone), or the key's fence is the run's last
// (ErrFencesExhausted), or a lock-delay refused it (what is left of it is
// returned, at least 1 ms so that the caller knows).
func (s *sessions) refused(ctx context.Context, ex querier, key string, ss *session, alive bool) (time.Duration, error) {
	held, args := `FALSE`, []any{key, key}
	if alive {
		held, args = ownMarkHeld, append(args, ss.mark, ss.id)
	}
	rows, err := ex.QueryContext(ctx, `SELECT (SELECT epoch FROM `+s.run+` WHERE id = 1),
  (SELECT fence FROM `+s.table+` WHERE name = ?),
  (SELECT GREATEST(TIMESTAMPDIFF(MICROSECOND, UTC_TIMESTAMP(6), delay_until), 0) FROM `+s.table+` WHERE name = ?),
  `+held, args...)
	if err != nil {
		return 0, err
	}
	defer rows.Close()
	var epoch, fence sql.NullInt64
	var us sql.NullInt64
	live := false
	if rows.Next() {
		if err := rows.Scan(&epoch, &fence, &us, &live); err != nil {
			return 0, err
		}
	}
	if err := rows.Close(); err != nil {
		return 0, err
	}
	switch {
	case !epoch.Valid:
		return 0, errNoRun
	case alive && !live:
		return 0, errSessionGone
	case fence.Valid && uint64(fence.Int64) >= lastFence(uint64(epoch.Int64)):
		return 0, fmt.Errorf("%w: key %q has fence %d", ErrFencesExhausted, key, fence.Int64)
	}
	return max(time.Duration(us.Int64)*time.Microsecond, time.Millisecond), nil
}

// holderTTL is the TTL of req's holder: the store's lease less the
// lock-delay, which a session strategy keeps after the session ends rather
// than in its wait_timeout.
func holderTTL(req dlock.Request) time.Duration { return req.TTL - req.LockDelay }

// checkLockDelay refuses a lock-delay that the Locker would not send.
func checkLockDelay(what string, req dlock.Request) error {
	if req.LockDelay < 0 || req.LockDelay >= req.TTL {
		return fmt.Errorf("%w: mysqllock: %s: lock-delay %s outside 0..ttl %s", dlock.ErrInvalidOption, what, req.LockDelay, req.TTL)
	}
	return nil
}

// sleepDelay waits out what is left of a lock-delay, or until ctx ends: a
// waiter (AcquireWait) that a lock-delay refused does not return at once,
// which would have the Locker call again at once.
func sleepDelay(ctx context.Context, d time.Duration) {
	t := time.NewTimer(d)
	defer t.Stop()
	select {
	case <-t.C:
	case <-ctx.Done():
	}
}

// ending says how a session lock ends: released (clean) or abandoned, and
// with keep, for a minimum hold, the time its key stays from everyone.
type ending struct {
	clean bool
	keep  time.Duration
	// via, if set, releases the named lock on the session instead of
	// RELEASE_LOCK, answering what RELEASE_LOCK did (see handOff).
	via func(ctx context.Context, conn *sql.Conn) (sql.NullInt64, error)
}

// keepHold marks key's grant to tok as released and keeps the key from
// every grant for keep from now, by the server's clock, in the same
// delay_until a lock-delay uses (the grant's statement refuses while it
// lasts). It runs while the lock is held; a grant row that tok no longer
// has is an error (the lock is then released all the same, early).
func (s *sessions) keepHold(ctx context.Context, ex querier, key string, tok dlock.Token, keep time.Duration) error {
	res, err := ex.ExecContext(ctx, `UPDATE `+s.table+` SET delay_us = 0,
  delay_until = GREATEST(delay_until, UTC_TIMESTAMP(6) + INTERVAL ? MICROSECOND)
WHERE name = ? AND token = ?`, keep.Microseconds(), key, tok[:])
	if err != nil {
		return err
	}
	if n, err := res.RowsAffected(); err != nil || n != 1 {
		return fmt.Errorf("the minimum hold was not recorded: %d rows, %v", n, err)
	}
	return nil
}

// clearDelay marks key's grant to tok as released, so that the next
// acquirer does not keep its lock-delay. It runs while the lock is held.
func (s *sessions) clearDelay(ctx context.Context, ex querier, key string, tok dlock.Token) error {
	_, err := ex.ExecContext(ctx, `UPDATE `+s.table+` SET delay_us = 0 WHERE name = ? AND token = ?`, key, tok[:])
	return err
}

var (
	_ dlock.LockDelayer = (*GetLock)(nil)
	_ dlock.LockDelayer = (*RowLock)(nil)
	_ dlock.HoldKeeper  = (*GetLock)(nil)
	_ dlock.HoldKeeper  = (*RowLock)(nil)
)

// ReleaseKeeping implements dlock.HoldKeeper: the key's row keeps it from
// every grant for keep (delay_until, by the server's clock), written on the
// holding session before RELEASE_LOCK.
func (g *GetLock) ReleaseKeeping(ctx context.Context, key string, token dlock.Token, keep time.Duration) error {
	if g.bell {
		return dlock.ErrUnsupported // a doorbell has no record
	}
	return g.end(ctx, key, token, ending{clean: true, keep: keep})
}

// ReleaseKeeping implements dlock.HoldKeeper: the key's row keeps it from
// every grant for keep (delay_until, by the server's clock), written in the
// locking transaction with its COMMIT.
func (r *RowLock) ReleaseKeeping(ctx context.Context, key string, token dlock.Token, keep time.Duration) error {
	return r.end(key, token, kept(keep))
}

// Abandon implements dlock.LockDelayer: RELEASE_LOCK without marking the
// grant released, so that the next acquirer keeps its lock-delay from then.
func (g *GetLock) Abandon(ctx context.Context, key string, token dlock.Token) error {
	return g.end(ctx, key, token, ending{})
}

// Abandon implements dlock.LockDelayer: COMMIT without marking the grant
// released, so that the next acquirer keeps its lock-delay from then.
func (r *RowLock) Abandon(ctx context.Context, key string, token dlock.Token) error {
	return r.end(key, token, abandoned)
}
