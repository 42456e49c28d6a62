package mysqllock

import (
	"context"
	"database/sql"
	"database/sql/driver"
	"errors"
	"fmt"
	"strconv"
	"sync/atomic"

	"github.com/go-sql-driver/mysql"
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
	e, err := s.bumpEpoch(ctx, c)
	if err != nil {
		return err
	}
	if _, err := c.ExecContext(ctx, `INSERT IGNORE INTO `+s.run+` (id, epoch) VALUES (1, ?)`, e); err != nil {
		return fmt.Errorf("mysqllock: record the epoch of the server's run: %w", err)
	}
	return nil
}

// bumpEpoch bumps the durable epoch counter and returns its new value.
func (s *sessions) bumpEpoch(ctx context.Context, c execer) (uint64, error) {
	res, err := c.ExecContext(ctx, `INSERT INTO `+s.epochs+` (id, epoch) VALUES (1, LAST_INSERT_ID(1))
ON DUPLICATE KEY UPDATE epoch = LAST_INSERT_ID(epoch + 1)`)
	if err != nil {
		return 0, fmt.Errorf("mysqllock: bump the epoch of the server's run: %w", err)
	}
	e, err := res.LastInsertId()
	if err != nil || e <= 0 || e > maxEpoch {
		return 0, fmt.Errorf("mysqllock: epoch %d of the server's run out of range 1..%d (%v)", e, maxEpoch, err)
	}
	return uint64(e), nil
}

// A full session table.
//
// The session table keeps a row for every key granted in the server's run,
// and its size limit is fixed (a server restart may also have lowered it to
// the server's max_heap_table_size). A grant that finds it full (error 1114)
// compacts it, then tries once more:
//
//  1. It restores the schema's size limit (as Migrate does), if the client
//     may ALTER the table; a failure is logged (Options.Logger) and the
//     compaction goes on.
//  2. It starts a new epoch within the run: it bumps the durable counter to
//     E and sets the run table's epoch to E (or leaves a greater one), on
//     one connection, as startRun does.
//  3. Only then it deletes the rows of the keys that are free and whose
//     fence is below E<<40: getlock rows whose named lock is not held by
//     the row's session, rowlock rows released or whose session is gone
//     (the negations of the conditions of List), in both cases with no
//     lock-delay or minimum hold pending (delay_us = 0, delay_until past).
//
// Fences still grow per key. A deleted row's fences were all below E<<40;
// the key's next grant inserts a new row with the run table's epoch, at
// least E from step 2 on (the run's epoch never goes back: GREATEST), so
// its fence is at least E<<40 | 1. A grant made between steps 2 and 3
// already has a fence of at least E<<40 | 1, so step 3 keeps its row. The
// MEMORY engine locks the whole table for each statement, so no grant
// interleaves with the DELETE. A holder's row, and that of a key whose
// lock-delay runs, is never deleted: the holder's release and List find it,
// and the key stays refused for the delay.
//
// Compactions of one strategy value run one at a time; grants that find
// the table full meanwhile wait for the running one. Compactions of other
// clients may run at once: each takes an epoch of its own, and each is
// safe on its own. An epoch per compaction leaves 2^23 of them (maxEpoch).
//
// A grant that finds the table full again after the compaction (every row
// is of a held key, or of a key whose lock-delay runs) returns
// ErrSessionTableFull.

// ErrSessionTableFull is returned by a session strategy (GetLock, RowLock)
// for a grant of a key that has no row in the session table when the table
// is full of keys that are held, or whose lock-delay or minimum hold runs.
// Raise max_heap_table_size and run Migrate (it resizes the table).
var ErrSessionTableFull = errors.New("mysqllock: the session table is full of held keys")

// errTableFull is the server's error for a full table (ER_RECORD_FILE_FULL).
const errTableFull = 1114

// tableFull reports whether err is the server's word that a table is full.
func tableFull(err error) bool {
	var me *mysql.MySQLError
	return errors.As(err, &me) && me.Number == errTableFull
}

// skipResize keeps compactions from restoring the session table's size
// limit (tests of a small table).
var skipResize atomic.Bool

// compaction is a running compaction of the session table: done is closed
// when it ends.
type compaction struct{ done chan struct{} }

// compactOnce compacts the session table, or waits for the compaction
// that is running (and then returns nil: the caller's grant tells).
func (s *sessions) compactOnce(ctx context.Context) error {
	s.mu.Lock()
	if c := s.compacting; c != nil {
		s.mu.Unlock()
		select {
		case <-c.done:
			return nil
		case <-ctx.Done():
			return ctx.Err()
		}
	}
	c := &compaction{done: make(chan struct{})}
	s.compacting = c
	s.mu.Unlock()
	defer func() {
		s.mu.Lock()
		s.compacting = nil
		s.mu.Unlock()
		close(c.done)
	}()
	return s.compact(ctx)
}

// compact restores the session table's size limit, starts a new epoch and
// deletes the rows of free keys of earlier epochs (see above).
func (s *sessions) compact(ctx context.Context) error {
	c, err := s.db.Conn(ctx)
	if err != nil {
		return err
	}
	defer c.Close()
	if !skipResize.Load() {
		if err := s.resize(ctx, c); err != nil {
			if ctx.Err() != nil {
				return err
			}
			if s.log != nil {
				s.log.WarnContext(ctx, "mysqllock: could not restore the size limit of the full session table", "table", s.table,
					"error", err, "fix", "run Migrate, or grant ALTER on the table")
			}
		}
	}
	e, err := s.bumpEpoch(ctx, c)
	if err != nil {
		return err
	}
	if _, err := c.ExecContext(ctx, `INSERT INTO `+s.run+` (id, epoch) VALUES (1, ?)
ON DUPLICATE KEY UPDATE epoch = GREATEST(epoch, ?)`, e, e); err != nil {
		return fmt.Errorf("mysqllock: record the epoch of the server's run: %w", err)
	}
	if _, err := c.ExecContext(ctx, `DELETE FROM `+s.table+`
WHERE fence < ? AND delay_us = 0 AND delay_until <= UTC_TIMESTAMP(6)
  AND (lock_name <> '' AND NOT (IS_USED_LOCK(lock_name) <=> conn_id) OR lock_name = '' AND NOT (`+rowHeld+`))`, e<<epochBits); err != nil {
		return fmt.Errorf("mysqllock: delete the rows of free keys: %w", err)
	}
	return nil
}

// resize restores the session table's size limit on c, waiting a few
// seconds at most for statements on the table to end (ALTER TABLE waits
// for them, and the table's statements wait for it).
func (s *sessions) resize(ctx context.Context, c *sql.Conn) error {
	if _, err := c.ExecContext(ctx, fmt.Sprintf("SET SESSION max_heap_table_size = %d, lock_wait_timeout = 5", sessionTableBytes)); err != nil {
		return err
	}
	err := toMemory(ctx, c, s.table)
	if _, rerr := c.ExecContext(context.WithoutCancel(ctx), "SET SESSION max_heap_table_size = DEFAULT, lock_wait_timeout = DEFAULT"); rerr != nil {
		// Do not hand a connection with these settings back to the pool.
		_ = c.Raw(func(any) error { return driver.ErrBadConn })
	}
	return err
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
