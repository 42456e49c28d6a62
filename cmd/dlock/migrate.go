package main

import (
	"context"
	"database/sql"
	"net/url"
	"regexp"
	"strings"

	"github.com/jackc/pgx/v5/pgxpool"
)

// tableExists reports whether a table of the store exists; name is as
// spelled in its schema (quoted).
type tableExists func(ctx context.Context, name string) (bool, error)

var createTableRE = regexp.MustCompile("(?i)CREATE (?:UNLOGGED )?TABLE IF NOT EXISTS ((?:[`\"][^`\"]+[`\"]\\.)?[`\"][^`\"]+[`\"]|\\w+)")

// schemaTables returns the tables that schema creates, as spelled there.
func schemaTables(schema string) []string {
	var out []string
	for _, m := range createTableRE.FindAllStringSubmatch(schema, -1) {
		out = append(out, m[1])
	}
	return out
}

func unquote(name string) string { return strings.Trim(name, "`\"") }

func mysqlTableExists(db *sql.DB) tableExists {
	return func(ctx context.Context, name string) (bool, error) {
		var n int
		err := db.QueryRowContext(ctx, "SELECT COUNT(*) FROM information_schema.tables WHERE table_schema = DATABASE() AND table_name = ?", unquote(name)).Scan(&n)
		return n > 0, err
	}
}

func pgTableExists(pool *pgxpool.Pool) tableExists {
	return func(ctx context.Context, name string) (bool, error) {
		var ok bool
		err := pool.QueryRow(ctx, "SELECT to_regclass($1) IS NOT NULL", name).Scan(&ok)
		return ok, err
	}
}

// sqliteTableExists looks in the file path, read-only: a file that does not
// exist has no tables.
func sqliteTableExists(path string) tableExists {
	return func(ctx context.Context, name string) (bool, error) {
		db, err := sql.Open("sqlite", "file:"+(&url.URL{Path: path}).EscapedPath()+"?mode=ro")
		if err != nil {
			return false, err
		}
		defer db.Close()
		var n int
		err = db.QueryRowContext(ctx, "SELECT COUNT(*) FROM sqlite_master WHERE type = 'table' AND name = ?", unquote(name)).Scan(&n)
		if err != nil && strings.Contains(err.Error(), "unable to open") {
			return false, nil
		}
		return n > 0, err
	}
}
