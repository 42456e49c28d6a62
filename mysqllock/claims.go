package mysqllock

import (
	"context"
	"database/sql"
	"errors"
	"fmt"
	"strings"
	"sync"

	"github.com/dlock-dev/dlock"
	"github.com/dlock-dev/dlock/internal/claims"
)

// ErrOtherStrategy means that a key is used with another strategy of the
// same table (lease, getlock, rowlock). The strategies do not exclude each
// other, so a key keeps the strategy that first took it: the first
// acquisition of each key records it in the table named after the lock
// table with "_claims", and acquisitions and forced releases of the key
// with another strategy fail with this error (which also matches
// dlock.ErrInvalidOption) before touching the lock. To move a key to
// another strategy, stop its holders and delete its row there.
var ErrOtherStrategy = errors.New("mysqllock: key used with another strategy")

// newClaims returns the claims of strategy in the table named after
// leaseTable (quoted).
func newClaims(db *sql.DB, leaseTable, strategy string) *claims.Set {
	t := strings.TrimSuffix(leaseTable, "`") + "_claims`"
	// LAST_INSERT_ID(x) makes the reply's insert id 0 when the key is new
	// or has this strategy, 1 when it has another: one round trip, whatever
	// clientFoundRows does to affected-row counts.
	claim := `INSERT INTO ` + t + ` (name, strategy) VALUES (?, IF(LAST_INSERT_ID(0) = 0, ?, ''))
ON DUPLICATE KEY UPDATE strategy = IF(LAST_INSERT_ID(strategy <> ?) = 0, strategy, strategy)`
	query := func(ctx context.Context, key string) (string, error) {
		var got string
		err := db.QueryRowContext(ctx, `SELECT strategy FROM `+t+` WHERE name = ?`, []byte(key)).Scan(&got)
		if errors.Is(err, sql.ErrNoRows) {
			return "", nil
		}
		return got, err
	}
	return claims.New(strategy, ErrOtherStrategy, func(ctx context.Context, key, strategy string) (string, error) {
		// First claims of one key race; on Galera, from several nodes,
		// all but one fail certification (a deadlock).
		var res sql.Result
		var err error
		for try := 0; ; try++ {
			res, err = db.ExecContext(ctx, claim, []byte(key), strategy, strategy)
			if !retryDeadlock(ctx, err, try) {
				break
			}
		}
		if err != nil {
			return "", err
		}
		other, err := res.LastInsertId()
		if err != nil || other == 0 {
			return strategy, err
		}
		got, err := query(ctx, key)
		if err != nil || got == "" {
			return "another", nil
		}
		return got, nil
	}, query)
}

// autocommitCheck refuses, once the server has answered, a pool whose
// connections have autocommit off (autocommit=0 in the DSN, or the
// server's init_connect): the strategies' writes would never be committed,
// and a rollback would hand a held key to another client and repeat a
// fence. The answer of the first connection asked stands for the pool.
type autocommitCheck struct {
	mu sync.Mutex
	ok bool
}

// errAutocommitOff is the error for a connection with autocommit off.
var errAutocommitOff = fmt.Errorf("%w: mysqllock: the pool's connections have autocommit off (autocommit=0 in the DSN, or init_connect): grants would never commit; turn autocommit on for this pool", dlock.ErrInvalidOption)

func (a *autocommitCheck) check(ctx context.Context, db *sql.DB) error {
	a.mu.Lock()
	ok := a.ok
	a.mu.Unlock()
	if ok {
		return nil
	}
	var on bool
	if err := db.QueryRowContext(ctx, "SELECT @@autocommit").Scan(&on); err != nil {
		return err
	}
	if !on {
		return errAutocommitOff
	}
	a.mu.Lock()
	a.ok = true
	a.mu.Unlock()
	return nil
}
