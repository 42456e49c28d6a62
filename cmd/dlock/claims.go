package main

import (
	"context"
	"database/sql"
	"errors"
	"fmt"
	"strings"

	"github.com/dlock-dev/dlock"
	"github.com/dlock-dev/dlock/mysqllock"
	"github.com/dlock-dev/dlock/pglock"
	"github.com/go-sql-driver/mysql"
	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgconn"
	"github.com/jackc/pgx/v5/pgxpool"
)

// claims records, in a table of a store that offers several strategies,
// which strategy each key is used with, and lets dlock refuse a key used
// with another. The strategies of one store do not exclude each other: a
// MySQL getlock holder (GET_LOCK), a lease holder (a row of the lease table)
// and a rowlock holder (a row lock in another table) can all hold the same
// key at once. A key is claimed by the first strategy that takes it, for
// good.
type claims struct {
	table    string // quoted
	strategy string
	ddl      string
	exec     func(ctx context.Context, q string, args ...any) error
	runDDL   func(ctx context.Context, ddl string) error
	get      func(ctx context.Context, q string, key string) (string, error) // "" when no row
	insert   string                                                          // (key, strategy); no-op on a duplicate
	query    string                                                          // the key's strategy
}

// errOtherStrategy means a key is claimed by another strategy.
var errOtherStrategy = errors.New("key used with another strategy")

// claimsSuffix names the claims table after the lease table.
const claimsSuffix = "_strategy"

// claim records that key is used with c's strategy unless it is claimed
// already, and returns an error matching errOtherStrategy if it is claimed
// by another.
func (c *claims) claim(ctx context.Context, key string) error {
	if err := c.exec(ctx, c.insert, []byte(key), c.strategy); err != nil {
		return err
	}
	return c.check(ctx, key)
}

// check returns an error matching errOtherStrategy if key is claimed by
// another strategy than c's.
func (c *claims) check(ctx context.Context, key string) error {
	got, err := c.get(ctx, c.query, key)
	if err != nil {
		return err
	}
	if got != "" && got != c.strategy {
		return fmt.Errorf("%w: %q is locked with strategy=%s in this store, and this URL says strategy=%s: "+
			"a key's holders must all use the same strategy (the strategies do not exclude each other)",
			errOtherStrategy, key, got, c.strategy)
	}
	return nil
}

// migrate creates the claims table.
func (c *claims) migrate(ctx context.Context) error {
	if err := c.runDDL(ctx, c.ddl); err != nil {
		return fmt.Errorf("migrate %s: %w", c.table, err)
	}
	return nil
}

// claimsTable is the quoted name of the claims table of the lease table
// table ("" for def), in quote characters q.
func claimsTable(table, def, q string) (string, error) {
	if table == "" {
		table = def
	}
	parts := strings.Split(table, ".")
	parts[len(parts)-1] += claimsSuffix
	for i, p := range parts {
		if len(p) > 63 {
			return "", usageError("table name %q is too long to name its %s table: at most %d bytes", table, claimsSuffix, 63-len(claimsSuffix))
		}
		parts[i] = q + p + q
	}
	return strings.Join(parts, "."), nil
}

func mysqlClaims(db *sql.DB, table, strategy string) (*claims, error) {
	t, err := claimsTable(table, mysqllock.DefaultTable, "`")
	if err != nil {
		return nil, err
	}
	c := &claims{
		table:    t,
		strategy: strategy,
		ddl: `-- dlock CLI: the strategy each key is used with (lease, getlock or rowlock).
CREATE TABLE IF NOT EXISTS ` + t + ` (
  name     VARBINARY(255) NOT NULL,
  strategy VARCHAR(16)    CHARACTER SET ascii NOT NULL,
  PRIMARY KEY (name)
) ENGINE=InnoDB;
`,
		insert: `INSERT INTO ` + t + ` (name, strategy) VALUES (?, ?) ON DUPLICATE KEY UPDATE name = name`,
		query:  `SELECT strategy FROM ` + t + ` WHERE name = ?`,
	}
	c.exec = func(ctx context.Context, q string, args ...any) error {
		_, err := db.ExecContext(ctx, q, args...)
		return mysqlClaimsErr(err)
	}
	c.get = func(ctx context.Context, q, key string) (string, error) {
		var s string
		err := db.QueryRowContext(ctx, q, []byte(key)).Scan(&s)
		if errors.Is(err, sql.ErrNoRows) {
			return "", nil
		}
		return s, mysqlClaimsErr(err)
	}
	c.runDDL = func(ctx context.Context, ddl string) error { return c.exec(ctx, ddl) }
	return c, nil
}

func mysqlClaimsErr(err error) error {
	var me *mysql.MySQLError
	if errors.As(err, &me) && me.Number == 1146 { // no such table
		return fmt.Errorf("%w: %w", dlock.ErrNoSchema, err)
	}
	return err
}

func pgClaims(pool *pgxpool.Pool, table, strategy string) (*claims, error) {
	t, err := claimsTable(table, pglock.DefaultTable, `"`)
	if err != nil {
		return nil, err
	}
	c := &claims{
		table:    t,
		strategy: strategy,
		ddl: `-- dlock CLI: the strategy each key is used with (lease or advisory).
CREATE TABLE IF NOT EXISTS ` + t + ` (
  name     bytea NOT NULL PRIMARY KEY,
  strategy text  NOT NULL
);
`,
		insert: `INSERT INTO ` + t + ` (name, strategy) VALUES ($1, $2) ON CONFLICT (name) DO NOTHING`,
		query:  `SELECT strategy FROM ` + t + ` WHERE name = $1`,
	}
	c.exec = func(ctx context.Context, q string, args ...any) error {
		_, err := pool.Exec(ctx, q, args...)
		return pgClaimsErr(err)
	}
	c.get = func(ctx context.Context, q, key string) (string, error) {
		var s string
		err := pool.QueryRow(ctx, q, []byte(key)).Scan(&s)
		if errors.Is(err, pgx.ErrNoRows) {
			return "", nil
		}
		return s, pgClaimsErr(err)
	}
	c.runDDL = func(ctx context.Context, ddl string) error {
		// Concurrent CREATE TABLE IF NOT EXISTS can fail on the catalog's
		// unique indexes: serialise them.
		return pgx.BeginFunc(ctx, pool, func(tx pgx.Tx) error {
			if _, err := tx.Exec(ctx, "SELECT pg_advisory_xact_lock(hashtext($1))", "dlock migrate "+t); err != nil {
				return err
			}
			_, err := tx.Exec(ctx, ddl)
			return err
		})
	}
	return c, nil
}

func pgClaimsErr(err error) error {
	var pe *pgconn.PgError
	if errors.As(err, &pe) && pe.Code == "42P01" { // undefined_table
		return fmt.Errorf("%w: %w", dlock.ErrNoSchema, err)
	}
	return err
}
