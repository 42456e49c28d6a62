package mysqllock

import (
	"context"
	"database/sql"
	"errors"
	"strings"

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
		res, err := db.ExecContext(ctx, claim, []byte(key), strategy, strategy)
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
