package torture

import (
	"context"
	"database/sql"
	"fmt"
)

// Resource is the shared resource the workers guard with their locks: one
// MariaDB row per key holding a counter, and a log of every access.
//
// Each access presents the holder's fence. With fencing (the normal
// mode) the resource refuses a token smaller than the largest it has seen for
// the key, and a read raises that largest token, so a holder whose lease has
// passed to someone who already touched the resource can neither read nor
// write. With NoFencing it accepts everything: the positive control.
//
// An access is one transaction that locks the row (SELECT … FOR UPDATE),
// decides, updates, and appends to the log. The log's AUTO_INCREMENT ids are
// taken under the row lock, so per key they are in commit order, and the log
// is the ground truth of what the resource accepted: a transaction cut off
// before COMMIT left no trace, whatever the worker saw.
type Resource struct {
	db        *sql.DB
	res, log  string
	noFencing bool
}

// resourceTables returns the table names for a run tag.
func resourceTables(tag string) (res, log string) {
	return "torture_" + tag + "_res", "torture_" + tag + "_reslog"
}

// setupResource drops and recreates the resource tables with a row per key.
func setupResource(ctx context.Context, db *sql.DB, tag string, keys []string) error {
	res, log := resourceTables(tag)
	stmts := []string{
		"DROP TABLE IF EXISTS " + res + ", " + log,
		"CREATE TABLE " + res + ` (
  k      VARCHAR(64)     NOT NULL PRIMARY KEY,
  fence  BIGINT UNSIGNED NOT NULL DEFAULT 0,
  value  BIGINT          NOT NULL DEFAULT 0,
  writer VARCHAR(64)     NOT NULL DEFAULT ''
) ENGINE=InnoDB`,
		"CREATE TABLE " + log + ` (
  id        BIGINT UNSIGNED NOT NULL AUTO_INCREMENT PRIMARY KEY,
  k         VARCHAR(64)     NOT NULL,
  op        CHAR(1)         NOT NULL,
  fence     BIGINT UNSIGNED NOT NULL,
  worker    VARCHAR(64)     NOT NULL,
  accepted  TINYINT         NOT NULL,
  seen      BIGINT UNSIGNED NOT NULL,
  read_val  BIGINT          NOT NULL,
  cur_val   BIGINT          NOT NULL,
  new_val   BIGINT          NOT NULL,
  at_us     BIGINT          NOT NULL
) ENGINE=InnoDB`,
	}
	for _, s := range stmts {
		if _, err := db.ExecContext(ctx, s); err != nil {
			return fmt.Errorf("resource setup: %w", err)
		}
	}
	for _, k := range keys {
		if _, err := db.ExecContext(ctx, "INSERT INTO "+res+" (k) VALUES (?)", k); err != nil {
			return fmt.Errorf("resource setup: %w", err)
		}
	}
	return nil
}

func newResource(db *sql.DB, tag string, noFencing bool) *Resource {
	res, log := resourceTables(tag)
	return &Resource{db: db, res: res, log: log, noFencing: noFencing}
}

// Read presents fence for key and returns the current value, or
// accepted=false if the resource refused the token.
func (r *Resource) Read(ctx context.Context, key string, fence uint64, worker string) (int64, bool, error) {
	v, ok, err := r.access(ctx, 'r', key, fence, worker, 0)
	return v, ok, err
}

// Write stores readValue+1 for key under fence.
func (r *Resource) Write(ctx context.Context, key string, fence uint64, worker string, readValue int64) (bool, error) {
	_, ok, err := r.access(ctx, 'w', key, fence, worker, readValue)
	return ok, err
}

func (r *Resource) access(ctx context.Context, op byte, key string, fence uint64, worker string, readValue int64) (int64, bool, error) {
	tx, err := r.db.BeginTx(ctx, nil)
	if err != nil {
		return 0, false, err
	}
	defer tx.Rollback()
	var seen uint64
	var cur int64
	err = tx.QueryRowContext(ctx, "SELECT fence, value FROM "+r.res+" WHERE k = ? FOR UPDATE", key).Scan(&seen, &cur)
	if err != nil {
		return 0, false, err
	}
	accepted := r.noFencing || fence >= seen
	newVal := cur
	if accepted {
		if op == 'w' {
			newVal = readValue + 1
		} else {
			readValue = cur
		}
		if _, err := tx.ExecContext(ctx, "UPDATE "+r.res+" SET fence = GREATEST(fence, ?), value = ?, writer = ? WHERE k = ?",
			fence, newVal, worker, key); err != nil {
			return 0, false, err
		}
	}
	if _, err := tx.ExecContext(ctx, "INSERT INTO "+r.log+
		" (k, op, fence, worker, accepted, seen, read_val, cur_val, new_val, at_us)"+
		" VALUES (?, ?, ?, ?, ?, ?, ?, ?, ?, TIMESTAMPDIFF(MICROSECOND, '1970-01-01', UTC_TIMESTAMP(6)))",
		key, string(op), fence, worker, accepted, seen, readValue, cur, newVal); err != nil {
		return 0, false, err
	}
	if err := tx.Commit(); err != nil {
		return 0, false, err
	}
	return cur, accepted, nil
}

// logRow is one access from the resource log.
type logRow struct {
	ID       int64
	Key      string
	Op       string
	Fence    uint64
	Worker   string
	Accepted bool
	Seen     uint64 // largest token seen before this access
	ReadVal  int64  // w: the value the writer had read; r: the value returned
	CurVal   int64  // the value before this access
	NewVal   int64
	AtUs     int64 // server clock, Unix µs
}

// readResourceLog returns the whole log in id order.
func readResourceLog(ctx context.Context, db *sql.DB, tag string) ([]logRow, error) {
	_, log := resourceTables(tag)
	rows, err := db.QueryContext(ctx, "SELECT id, k, op, fence, worker, accepted, seen, read_val, cur_val, new_val, at_us FROM "+log+" ORDER BY id")
	if err != nil {
		return nil, err
	}
	defer rows.Close()
	var out []logRow
	for rows.Next() {
		var r logRow
		if err := rows.Scan(&r.ID, &r.Key, &r.Op, &r.Fence, &r.Worker, &r.Accepted, &r.Seen, &r.ReadVal, &r.CurVal, &r.NewVal, &r.AtUs); err != nil {
			return nil, err
		}
		out = append(out, r)
	}
	return out, rows.Err()
}
