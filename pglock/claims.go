package pglock

import (
	"context"
	"errors"

	"github.com/dlock-dev/dlock/internal/claims"
	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgxpool"
)

// ErrOtherStrategy means that a key is used with the other strategy of the
// same table (lease, advisory). The strategies do not exclude each other,
// so a key keeps the strategy that first took it: the first acquisition of
// each key records it in the table named after the lock table with
// "_claims", and acquisitions and forced releases of the key with the other
// strategy fail with this error (which also matches dlock.ErrInvalidOption)
// before touching the lock. To move a key to the other strategy, stop its
// holders and delete its row there.
var ErrOtherStrategy = errors.New("pglock: key used with another strategy")

// newClaims returns the claims of strategy in tb's claims table.
func newClaims(pool *pgxpool.Pool, tb tables, strategy string) *claims.Set {
	claim := `INSERT INTO ` + tb.claims + ` AS c (name, strategy) VALUES ($1, $2)
ON CONFLICT (name) DO UPDATE SET strategy = c.strategy RETURNING strategy`
	query := `SELECT strategy FROM ` + tb.claims + ` WHERE name = $1`
	return claims.New(strategy, ErrOtherStrategy, func(ctx context.Context, key, strategy string) (string, error) {
		var got string
		err := pool.QueryRow(ctx, claim, []byte(key), strategy).Scan(&got)
		if err != nil && ctx.Err() == nil && sessionLost(err) {
			// A pooled connection the server ended meanwhile (a
			// terminated backend, a restart): the statement is
			// idempotent, so it is sent once more, on another.
			err = pool.QueryRow(ctx, claim, []byte(key), strategy).Scan(&got)
		}
		return got, err
	}, func(ctx context.Context, key string) (string, error) {
		var got string
		err := pool.QueryRow(ctx, query, []byte(key)).Scan(&got)
		if errors.Is(err, pgx.ErrNoRows) {
			return "", nil
		}
		return got, err
	})
}
