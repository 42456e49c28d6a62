package mysqllock

import (
	"context"
	"errors"
	"fmt"
	"strconv"
)

// Fences of the session strategies (getlock, rowlock).
//
// Their locks live in the server's sessions and end when the server
// restarts, so their holder records (the session table) are as volatile:
// the table is MEMORY, written without a durable commit, and emptied by a
// restart. A fence must still grow per key across a restart, also a kill -9
// of the server. It is epoch<<40 | counter:
//
//   - epoch numbers the server's runs. The durable epoch table (InnoDB)
//     counts them; the run table (MEMORY) holds the current run's. The
//     first grant of a run finds the run table empty (the grant's statement
//     inserts nothing), bumps the durable counter (the run's one durable
//     commit) and inserts the value it got with INSERT IGNORE, on the same
//     connection, which a restart would have closed: every bump is greater
//     than every earlier run's epoch, so whichever of concurrent first
//     grants inserts first, the run's epoch is greater than the last run's.
//   - counter is the key's count of grants in the run, in the key's row of
//     the session table: a grant's fence is GREATEST(fence + 1, epoch<<40 |
//     1), so a row of an earlier run (or of a version that counted from 1
//     without epochs) is left behind as well. A grant that would take the
//     counter to 2^40 is refused with ErrFencesExhausted until the server
//     restarts.
//
// The epoch counter's commit is durable only if the server flushes InnoDB's
// log at each commit (innodb_flush_log_at_trx_commit=1; Check reports other
// settings): an epoch lost in a crash would be handed out again.

// ErrFencesExhausted is returned by a session strategy (GetLock, RowLock)
// for a key granted 2^40 − 1 times since the server last started: its next
// fence would not fit. The key is refused until the server restarts.
var ErrFencesExhausted = errors.New("mysqllock: the key's fences of this server run are exhausted")

const (
	// epochBits is how many low bits of a fence count a key's grants in
	// the server's run; the epoch takes the rest.
	epochBits = 40
	// maxEpoch keeps fences within int64 (the driver's insert id).
	maxEpoch = 1<<(63-epochBits) - 1
)

var (
	epochShift = strconv.Itoa(epochBits)
	counterMax = strconv.FormatUint(1<<epochBits-1, 10)
)

// lastFence is the largest fence of a run with epoch e.
func lastFence(e uint64) uint64 { return e<<epochBits | (1<<epochBits - 1) }

// startRun gives the server's run its epoch if it has none: a bump of the
// durable epoch counter, then the run table's row unless another client
// inserted it first. Both statements run on one connection, so that a
// bump made before a restart is never inserted after it.
func (s *sessions) startRun(ctx context.Context) error {
	c, err := s.db.Conn(ctx)
	if err != nil {
		return err
	}
	defer c.Close()
	res, err := c.ExecContext(ctx, `INSERT INTO `+s.epochs+` (id, epoch) VALUES (1, LAST_INSERT_ID(1))
ON DUPLICATE KEY UPDATE epoch = LAST_INSERT_ID(epoch + 1)`)
	if err != nil {
		return fmt.Errorf("mysqllock: bump the epoch of the server's run: %w", err)
	}
	e, err := res.LastInsertId()
	if err != nil || e <= 0 || e > maxEpoch {
		return fmt.Errorf("mysqllock: epoch %d of the server's run out of range 1..%d (%v)", e, maxEpoch, err)
	}
	if _, err := c.ExecContext(ctx, `INSERT IGNORE INTO `+s.run+` (id, epoch) VALUES (1, ?)`, e); err != nil {
		return fmt.Errorf("mysqllock: record the epoch of the server's run: %w", err)
	}
	return nil
}

const (
	// sessionTableBytes is the session table's size limit that the
	// schema sets (its max_heap_table_size).
	sessionTableBytes = 256 << 20
	// sessionRowBytes is about what a key takes in the session table:
	// MEMORY rows have the columns' full length.
	sessionRowBytes = 5700
)

// errNoTable is tableEngine's error for a table that does not exist.
var errNoTable = errors.New("no such table")

// toMemory makes the session table (quoted) MEMORY with the size limit
// of the session's max_heap_table_size, keeping its rows: a table of an
// earlier version is InnoDB, and one that a server restart re-created may
// have the server's smaller limit. ALTER TABLE copies the rows while
// writes wait, so no grant is lost; a key's next fence exceeds its old one
// (see grantQuery).
func toMemory(ctx context.Context, db querier, table string) error {
	engine, limit, err := tableEngine(ctx, db, table)
	if err != nil || engine == "MEMORY" && limit >= sessionTableBytes*9/10 {
		return err
	}
	_, err = db.ExecContext(ctx, `ALTER TABLE `+table+` ENGINE=MEMORY`)
	return err
}

// tableEngine returns the engine of table (quoted) and its size limit (0
// if the engine has none that the server reports).
func tableEngine(ctx context.Context, db querier, table string) (engine string, limit int64, err error) {
	schema, name := splitTable(table)
	rows, err := db.QueryContext(ctx, `SELECT UPPER(ENGINE), IFNULL(MAX_DATA_LENGTH, 0) FROM information_schema.TABLES
WHERE TABLE_SCHEMA = IF(? = '', DATABASE(), ?) AND TABLE_NAME = ?`, schema, schema, name)
	if err != nil {
		return "", 0, err
	}
	defer rows.Close()
	if !rows.Next() {
		if err := rows.Err(); err != nil {
			return "", 0, err
		}
		return "", 0, fmt.Errorf("%w: %s", errNoTable, table)
	}
	if err := rows.Scan(&engine, &limit); err != nil {
		return "", 0, err
	}
	return engine, limit, rows.Close()
}
