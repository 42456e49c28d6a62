package torture

import (
	"context"
	"database/sql"
	"errors"
	"fmt"

	"github.com/dlock-dev/dlock"
	"github.com/dlock-dev/dlock/fence"
)

// Resource is the shared resource the workers guard with their locks: one
// MariaDB row per key holding a counter, and a log of every access.
//
// Each access presents the holder's fence and the mode of its lock. With
// fencing (the normal mode) the resource refuses an exclusive holder's token
// smaller than the largest it has seen for the key, and every access raises
// that largest token, so a holder whose lease has passed to someone who
// already touched the resource can neither read nor write. A shared holder
// only reads, and is refused a token smaller than the largest an exclusive
// holder presented: readers overlap one another, never a newer writer. A
// semaphore's holders (limited) are never refused: their fences say in which
// order they were granted, not which of them still holds, so no token rule
// can keep a paused holder out (see checkModes). With NoFencing it accepts
// everything: the positive control.
//
// An exclusive access to a key that only exclusive holders use (not the mode
// keys) is decided by package fence, as an application would guard its
// writes: fence.Table.Check in the access's transaction, against a fence
// table of the run's own, so that what the run proves is that helper. The
// mode keys' rules (readers among writers, semaphores) are the harness's own.
//
// An access is one transaction that locks the row (SELECT … FOR UPDATE),
// decides, updates, and appends to the log. The log's AUTO_INCREMENT ids are
// taken under the row lock, so per key they are in commit order, and the log
// is the ground truth of what the resource accepted: a transaction cut off
// before COMMIT left no trace, whatever the worker saw.
type Resource struct {
	db        *sql.DB
	res, log  string
	fences    fence.Table
	noFencing bool
}

// resourceTables returns the table names for a run tag.
func resourceTables(tag string) (res, log string) {
	return "torture_" + tag + "_res", "torture_" + tag + "_reslog"
}

// fenceTable returns the fence table of a run tag.
func fenceTable(tag string) fence.Table {
	return fence.Table{Dialect: fence.MySQL, Name: "torture_" + tag + "_fences"}
}

// setupResource drops and recreates the resource tables with a row per key.
func setupResource(ctx context.Context, db *sql.DB, tag string, keys []string) error {
	res, log := resourceTables(tag)
	fences := fenceTable(tag)
	stmts := []string{
		"DROP TABLE IF EXISTS " + res + ", " + log + ", " + fences.Name,
		"CREATE TABLE " + res + ` (
  k      VARCHAR(64)     NOT NULL PRIMARY KEY,
  fence  BIGINT UNSIGNED NOT NULL DEFAULT 0,
  xfence BIGINT UNSIGNED NOT NULL DEFAULT 0,
  value  BIGINT          NOT NULL DEFAULT 0,
  writer VARCHAR(64)     NOT NULL DEFAULT ''
) ENGINE=InnoDB`,
		"CREATE TABLE " + log + ` (
  id        BIGINT UNSIGNED NOT NULL AUTO_INCREMENT PRIMARY KEY,
  k         VARCHAR(64)     NOT NULL,
  op        CHAR(1)         NOT NULL,
  mode      CHAR(1)         NOT NULL,
  fence     BIGINT UNSIGNED NOT NULL,
  worker    VARCHAR(64)     NOT NULL,
  accepted  TINYINT         NOT NULL,
  seen      BIGINT UNSIGNED NOT NULL,
  xseen     BIGINT UNSIGNED NOT NULL,
  read_val  BIGINT          NOT NULL,
  cur_val   BIGINT          NOT NULL,
  new_val   BIGINT          NOT NULL,
  at_us     BIGINT          NOT NULL,
  chk       BIGINT          NOT NULL
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
	if err := fences.Migrate(ctx, db); err != nil {
		return fmt.Errorf("resource setup: %w", err)
	}
	return nil
}

func newResource(db *sql.DB, tag string, noFencing bool) *Resource {
	res, log := resourceTables(tag)
	return &Resource{db: db, res: res, log: log, fences: fenceTable(tag), noFencing: noFencing}
}

// Access modes: the mode of the lock an access is made under.
const (
	accessExclusive = "x"
	accessShared    = "s"
	accessLimited   = "l"
)

// admits reports whether the fencing rule accepts an access in mode with
// fence, given the largest fence seen and the largest an exclusive holder
// presented.
func admits(mode string, fence, seen, xseen uint64) bool {
	switch mode {
	case accessShared:
		return fence >= xseen
	case accessLimited:
		return true
	}
	return fence >= seen
}

// An access is what a holder presents to the resource.
type access struct {
	mode   string // the lock's: accessExclusive, accessShared, accessLimited
	key    string
	fence  uint64
	worker string
	chk    int64 // Mono() before the lock check that preceded it; 0: none
}

// Read presents a and returns the current value, or accepted=false if the
// resource refused the token.
func (r *Resource) Read(ctx context.Context, a access) (int64, bool, error) {
	return r.access(ctx, 'r', a, 0)
}

// Write stores readValue+1 for a's key under its fence.
func (r *Resource) Write(ctx context.Context, a access, readValue int64) (bool, error) {
	_, ok, err := r.access(ctx, 'w', a, readValue)
	return ok, err
}

func (r *Resource) access(ctx context.Context, op byte, a access, readValue int64) (int64, bool, error) {
	mode, key, fence, worker := a.mode, a.key, a.fence, a.worker
	tx, err := r.db.BeginTx(ctx, nil)
	if err != nil {
		return 0, false, err
	}
	defer tx.Rollback()
	var seen, xseen uint64
	var cur int64
	err = tx.QueryRowContext(ctx, "SELECT fence, xfence, value FROM "+r.res+" WHERE k = ? FOR UPDATE", key).Scan(&seen, &xseen, &cur)
	if err != nil {
		return 0, false, err
	}
	var accepted bool
	switch {
	case r.noFencing:
		accepted = true
	case mode == accessExclusive && key != rwKey && key != semKey:
		err := r.fences.Check(ctx, tx, key, fence)
		if err != nil && !errors.Is(err, dlock.ErrStaleFence) {
			return 0, false, err
		}
		accepted = err == nil
	default:
		accepted = admits(mode, fence, seen, xseen)
	}
	xfence := uint64(0)
	if mode == accessExclusive {
		xfence = fence
	}
	newVal := cur
	if accepted {
		if op == 'w' {
			newVal = readValue + 1
		} else {
			readValue = cur
		}
		if _, err := tx.ExecContext(ctx, "UPDATE "+r.res+" SET fence = GREATEST(fence, ?), xfence = GREATEST(xfence, ?), value = ?, writer = ? WHERE k = ?",
			fence, xfence, newVal, worker, key); err != nil {
			return 0, false, err
		}
	}
	if _, err := tx.ExecContext(ctx, "INSERT INTO "+r.log+
		" (k, op, mode, fence, worker, accepted, seen, xseen, read_val, cur_val, new_val, at_us, chk)"+
		" VALUES (?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, TIMESTAMPDIFF(MICROSECOND, '1970-01-01', UTC_TIMESTAMP(6)), ?)",
		key, string(op), mode, fence, worker, accepted, seen, xseen, readValue, cur, newVal, a.chk); err != nil {
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
	Mode     string // accessExclusive, accessShared, accessLimited
	Fence    uint64
	Worker   string
	Accepted bool
	Seen     uint64 // largest token seen before this access
	XSeen    uint64 // largest token of an exclusive access before this one
	ReadVal  int64  // w: the value the writer had read; r: the value returned
	CurVal   int64  // the value before this access
	NewVal   int64
	AtUs     int64 // server clock, Unix µs
	Chk      int64 // Mono() before the lock check that preceded the access; 0: none
}

// readResourceLog returns the whole log in id order.
func readResourceLog(ctx context.Context, db *sql.DB, tag string) ([]logRow, error) {
	_, log := resourceTables(tag)
	rows, err := db.QueryContext(ctx, "SELECT id, k, op, mode, fence, worker, accepted, seen, xseen, read_val, cur_val, new_val, at_us, chk FROM "+log+" ORDER BY id")
	if err != nil {
		return nil, err
	}
	defer rows.Close()
	var out []logRow
	for rows.Next() {
		var r logRow
		if err := rows.Scan(&r.ID, &r.Key, &r.Op, &r.Mode, &r.Fence, &r.Worker, &r.Accepted, &r.Seen, &r.XSeen, &r.ReadVal, &r.CurVal, &r.NewVal, &r.AtUs, &r.Chk); err != nil {
			return nil, err
		}
		out = append(out, r)
	}
	return out, rows.Err()
}
