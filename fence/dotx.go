package fence

import (
	"context"
	"database/sql"
	"errors"
	"fmt"
	"time"

	"github.com/dlock-dev/dlock"
)

// savepoint is the savepoint DoTx sets around fn.
const savepoint = "dlock_fence"

// releaseTimeout bounds the release at DoTx's end, which must run even when
// the caller's context has ended (as dlock's Do does).
const releaseTimeout = 5 * time.Second

// DoTx acquires key on l (waiting as Locker.Acquire does, with opts),
// begins a transaction on db, checks the lock's fence for the resource named
// key, runs fn, and commits if the lock is still held; then it releases the
// lock. fn's context and the transaction's are the lock's
// (dlock.Lock.Context): a lost lock cancels fn's statements, and
// database/sql rolls the transaction back. Every writer of the resource must
// go through the same key; to fence a resource by another name, or several,
// use Check in a transaction of your own.
//
// DoTx returns nil exactly when the transaction committed, even if the
// release then fails (the lease then ends with its TTL, and the next
// holder's larger fence keeps this one out): an error would invite a retry
// of work that is done. Otherwise the transaction is rolled back and the
// error is Acquire's, or one matching ErrStaleFence (a newer holder has
// written), or fn's, or the database's; when the lock was lost before the
// commit, the error also matches dlock.ErrLockLost. An error from Commit
// itself leaves the outcome unknown, as database/sql documents. fn must not
// end the transaction (tx.Commit or Rollback, a COMMIT statement, or on
// MySQL a statement that commits implicitly, such as CREATE TABLE): DoTx
// then returns an error matching ErrTxEnded, and what fn wrote may have
// committed, partly outside the fence's protection. A nil l, db
// or fn is dlock.ErrInvalidOption, as an invalid Table is, before any I/O.
// A panic in fn rolls the transaction back and releases the lock, then goes
// on.
func (t Table) DoTx(ctx context.Context, l *dlock.Locker, db *sql.DB, key string, fn func(ctx context.Context, tx *sql.Tx) error, opts ...dlock.AcquireOption) (err error) {
	if _, err := t.quoted(); err != nil {
		return err
	}
	if l == nil || db == nil || fn == nil {
		return fmt.Errorf("%w: fence: DoTx needs a Locker, a DB and a function", dlock.ErrInvalidOption)
	}
	lk, err := l.Acquire(ctx, key, opts...)
	if err != nil {
		return err
	}
	lctx, cancel := lk.Context(ctx)
	committed := false
	// Deferred, so that a panic in fn also ends the transaction and frees
	// the lock.
	defer func() {
		cancel()
		lost := lk.Err()
		rctx, rcancel := context.WithTimeout(context.WithoutCancel(ctx), releaseTimeout)
		lk.Release(rctx) // an error leaves the lease to its TTL; see above
		rcancel()
		if !committed && lost != nil && !errors.Is(err, dlock.ErrLockLost) {
			err = dlock.Join(err, lost)
		}
	}()
	tx, err := db.BeginTx(lctx, nil)
	if err != nil {
		return err
	}
	defer tx.Rollback() // after a commit: sql.ErrTxDone, nothing done
	if err := t.Check(lctx, tx, key, lk.Fence()); err != nil {
		return err
	}
	// A savepoint tells, after fn, whether the transaction is still the
	// one the check ran in: its release fails if fn ended it.
	if _, err := tx.ExecContext(lctx, "SAVEPOINT "+savepoint); err != nil {
		return err
	}
	if err := fn(lctx, tx); err != nil {
		return err
	}
	if _, err := tx.ExecContext(lctx, "RELEASE SAVEPOINT "+savepoint); err != nil {
		if lerr := lk.Err(); lerr != nil {
			return lerr
		}
		return fmt.Errorf("%w: %w", ErrTxEnded, err)
	}
	if err := lk.Err(); err != nil {
		return err
	}
	if err := tx.Commit(); err != nil {
		return err
	}
	committed = true
	return nil
}
