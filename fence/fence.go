package fence

import (
	"context"
	"database/sql"
	"errors"
	"fmt"
	"math"
	"strings"

	"github.com/dlock-dev/dlock"
)

// Sentinel errors. Invalid arguments are reported before any I/O with the
// dlock sentinels: a bad resource name matches dlock.ErrInvalidKey (it
// follows the rules of lock keys, since it defaults to one) and a bad Table
// matches dlock.ErrInvalidOption.
var (
	// ErrStaleFence means a fence older than the newest one recorded for
	// the resource was presented: a newer lock holder has written. Check
	// changed nothing; the caller must roll its transaction back. It is
	// dlock.ErrStaleFence, which every store's fence helper returns.
	ErrStaleFence = dlock.ErrStaleFence

	// ErrTxEnded means DoTx's transaction had ended when fn returned: fn
	// committed or rolled it back itself (tx.Commit, a COMMIT statement, or
	// on MySQL a statement that commits implicitly, such as CREATE TABLE).
	// What fn wrote until then may have committed, and what it wrote after
	// that was not guarded by the fence.
	ErrTxEnded = errors.New("fence: the transaction ended inside fn")

	// ErrInvalidFence means a fence of 0 (fences start at 1) or one above
	// math.MaxInt64 (beyond what every dialect's column holds). It is
	// returned before any I/O.
	ErrInvalidFence = errors.New("fence: invalid fence")
)

// DefaultTable is the table used when Table.Name is empty.
const DefaultTable = "dlock_fences"

// maxIdent is the longest identifier part accepted: PostgreSQL's limit
// (MySQL's is 64, SQLite has none).
const maxIdent = 63

// A Dialect is the SQL dialect of a database. The zero value is none, and
// every method of a Table without one returns dlock.ErrInvalidOption.
type Dialect int

// The dialects Table speaks.
const (
	// MySQL is MySQL 5.7+ and MariaDB 10.3+, with InnoDB tables.
	MySQL Dialect = iota + 1
	// PostgreSQL is PostgreSQL 9.5+.
	PostgreSQL
	// SQLite is SQLite 3.35+ (for RETURNING).
	SQLite
)

// String returns the dialect's name.
func (d Dialect) String() string {
	switch d {
	case MySQL:
		return "MySQL"
	case PostgreSQL:
		return "PostgreSQL"
	case SQLite:
		return "SQLite"
	}
	return fmt.Sprintf("Dialect(%d)", int(d))
}

// A Table is the table of fences in one database: a row per resource name
// holding the newest fence that has written to the resource. The row is
// never deleted, so a fence once recorded is never accepted as new again.
// The zero Name means DefaultTable. A Table is a value: it holds no
// connection and is safe for concurrent use.
type Table struct {
	// Dialect is the database's SQL dialect. It is required.
	Dialect Dialect
	// Name is the table, optionally qualified by a schema ("app.fences"):
	// each part 1-63 letters, digits or underscores, not starting with a
	// digit. Parts are quoted, so case matters on PostgreSQL. The default is
	// DefaultTable.
	Name string
}

// Migrate creates the table if it does not exist. It is idempotent. It
// returns dlock.ErrInvalidOption before any I/O when the Table is invalid.
func (t Table) Migrate(ctx context.Context, db *sql.DB) error {
	q, err := t.quoted()
	if err != nil {
		return err
	}
	if db == nil {
		return fmt.Errorf("%w: fence: nil *sql.DB", dlock.ErrInvalidOption)
	}
	var ddl string
	switch t.Dialect {
	case MySQL:
		// VARBINARY: resources compare byte for byte, whatever the
		// server's collation.
		ddl = `CREATE TABLE IF NOT EXISTS ` + q + ` (
  resource VARBINARY(255)  NOT NULL PRIMARY KEY,
  fence    BIGINT UNSIGNED NOT NULL
) ENGINE=InnoDB`
	case PostgreSQL:
		ddl = `CREATE TABLE IF NOT EXISTS ` + q + ` (
  resource TEXT   NOT NULL PRIMARY KEY,
  fence    BIGINT NOT NULL
)`
	case SQLite:
		ddl = `CREATE TABLE IF NOT EXISTS ` + q + ` (
  resource TEXT    NOT NULL PRIMARY KEY,
  fence    INTEGER NOT NULL
)`
	}
	if _, err := db.ExecContext(ctx, ddl); err != nil {
		return fmt.Errorf("fence: migrate %s: %w", t.name(), err)
	}
	return nil
}

// Check records f as the newest fence of resource, inside tx, if f is at
// least the newest one recorded (an equal fence is accepted: one holder
// writes many times under one fence). Otherwise it returns an error
// matching ErrStaleFence and changes nothing; the caller must then roll tx
// back. Call Check before the guarded writes of tx and commit only if it
// returned nil.
//
// The check is one upsert of the resource's row, which keeps the row locked
// until tx ends: another transaction checking the same resource waits for
// tx to commit or roll back, then compares its fence with what tx left. So
// a transaction with an older fence never commits after one with a newer
// fence has committed, at any isolation level. Under PostgreSQL's
// REPEATABLE READ or SERIALIZABLE the waiting transaction may fail with a
// serialization error instead (retry it); under SQLite, tx holds the
// database's write lock from Check to its end.
//
// Errors before any I/O: dlock.ErrInvalidOption (an invalid Table or a nil
// tx), dlock.ErrInvalidKey (resource empty, over 255 bytes, not UTF-8 or
// with a NUL byte), ErrInvalidFence. The database's error is wrapped; a
// missing table is one of those (run Migrate).
func (t Table) Check(ctx context.Context, tx *sql.Tx, resource string, f uint64) error {
	q, err := t.quoted()
	if err != nil {
		return err
	}
	if err := dlock.ValidateKey(resource); err != nil {
		return fmt.Errorf("fence: resource: %w", err)
	}
	if f == 0 || f > math.MaxInt64 {
		return fmt.Errorf("%w: %d (fences are 1 to %d)", ErrInvalidFence, f, int64(math.MaxInt64))
	}
	if tx == nil {
		return fmt.Errorf("%w: fence: nil *sql.Tx", dlock.ErrInvalidOption)
	}
	var ok bool
	switch t.Dialect {
	case MySQL:
		ok, err = checkMySQL(ctx, tx, q, resource, int64(f))
	default:
		ok, err = checkReturning(ctx, tx, q, t.Dialect, resource, int64(f))
	}
	if err != nil {
		return fmt.Errorf("fence: check %q in %s: %w", resource, t.name(), err)
	}
	if !ok {
		return fmt.Errorf("%w: %d for %q: a newer fence has written to it", ErrStaleFence, f, resource)
	}
	return nil
}

// checkReturning is the check on PostgreSQL and SQLite: the upsert's WHERE
// refuses an older fence, and RETURNING yields a row only when the row was
// inserted or updated. PostgreSQL locks the conflicting row even when the
// WHERE is false, and reads its newest committed version under READ
// COMMITTED; SQLite's upsert takes the database's write lock.
func checkReturning(ctx context.Context, tx *sql.Tx, q string, d Dialect, resource string, f int64) (bool, error) {
	stmt := `INSERT INTO ` + q + ` AS f (resource, fence) VALUES ($1, $2)
ON CONFLICT (resource) DO UPDATE SET fence = excluded.fence WHERE f.fence <= excluded.fence
RETURNING fence`
	if d == SQLite {
		stmt = strings.ReplaceAll(strings.ReplaceAll(stmt, "$1", "?1"), "$2", "?2")
	}
	var got int64
	switch err := tx.QueryRowContext(ctx, stmt, resource, f).Scan(&got); {
	case errors.Is(err, sql.ErrNoRows):
		return false, nil
	case err != nil:
		return false, err
	}
	return true, nil
}

// checkMySQL is the check on MySQL and MariaDB. The upsert keeps the larger
// fence and locks the row (ON DUPLICATE KEY UPDATE takes an exclusive lock
// on the duplicate even when nothing changes); its affected-rows count
// cannot tell an equal fence from a stale one (0 for both, or 1 for both
// with clientFoundRows), so the stored fence is read back. The read must be
// a locking read: under REPEATABLE READ a plain SELECT would return the
// transaction's snapshot, which may predate a newer fence committed since;
// FOR UPDATE reads the newest version, which the lock held keeps current.
func checkMySQL(ctx context.Context, tx *sql.Tx, q, resource string, f int64) (bool, error) {
	_, err := tx.ExecContext(ctx, `INSERT INTO `+q+` (resource, fence) VALUES (?, ?)
ON DUPLICATE KEY UPDATE fence = GREATEST(fence, ?)`, resource, f, f)
	if err != nil {
		return false, err
	}
	var stored uint64
	if err := tx.QueryRowContext(ctx, `SELECT fence FROM `+q+` WHERE resource = ? FOR UPDATE`, resource).Scan(&stored); err != nil {
		return false, err
	}
	return stored == uint64(f), nil
}

// name returns the table's name as given, or DefaultTable.
func (t Table) name() string {
	if t.Name == "" {
		return DefaultTable
	}
	return t.Name
}

// quoted validates t and returns its name quoted for its dialect.
func (t Table) quoted() (string, error) {
	var lq, rq string
	switch t.Dialect {
	case MySQL:
		lq, rq = "`", "`"
	case PostgreSQL, SQLite:
		lq, rq = `"`, `"`
	default:
		return "", fmt.Errorf("%w: fence: no dialect (%v)", dlock.ErrInvalidOption, t.Dialect)
	}
	parts := strings.Split(t.name(), ".")
	if len(parts) > 2 {
		return "", fmt.Errorf("%w: fence: table %q has more than two parts", dlock.ErrInvalidOption, t.Name)
	}
	for i, p := range parts {
		if !isIdent(p) {
			return "", fmt.Errorf("%w: fence: table %q: each part must be 1-%d letters, digits or underscores, not starting with a digit",
				dlock.ErrInvalidOption, t.Name, maxIdent)
		}
		parts[i] = lq + p + rq
	}
	return strings.Join(parts, "."), nil
}

func isIdent(s string) bool {
	if s == "" || len(s) > maxIdent || ('0' <= s[0] && s[0] <= '9') {
		return false
	}
	for i := 0; i < len(s); i++ {
		c := s[i]
		if c != '_' && !('a' <= c && c <= 'z') && !('A' <= c && c <= 'Z') && !('0' <= c && c <= '9') {
			return false
		}
	}
	return true
}
