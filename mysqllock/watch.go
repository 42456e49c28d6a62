package mysqllock

import (
	"context"
	"database/sql"
	"errors"
	"fmt"
	"strings"

	"github.com/dlock-dev/dlock"
	"github.com/dlock-dev/dlock/internal/journal"
	"github.com/go-sql-driver/mysql"
)

var _ dlock.HolderWatcher = (*Backend)(nil)

// journalColumns is the lock table's journal position, defined as in
// schema.sql: Migrate adds it to a table created without it. Existing rows
// start at 1 with no entry: a watcher starts after it.
var journalColumns = []column{{"jseq", "BIGINT UNSIGNED NOT NULL DEFAULT 1"}}

// journalTriggers is how many triggers schema.sql creates.
const journalTriggers = 6

// Server errors that deny the creation of a trigger: no TRIGGER privilege
// (1142), no SUPER (1227), and binary logging without SUPER or
// log_bin_trust_function_creators (1419).
const (
	errTableDenied     = 1142
	errSpecificDenied  = 1227
	errBinlogNeedSuper = 1419
	errTriggerExists   = 1359
)

func isDenied(err error) bool {
	var me *mysql.MySQLError
	return errors.As(err, &me) && (me.Number == errTableDenied || me.Number == errSpecificDenied || me.Number == errBinlogNeedSuper)
}

// createTriggers creates the journal's triggers; one that exists already
// (made by an earlier or a concurrent Migrate) is kept.
func createTriggers(ctx context.Context, db querier, triggers []string) error {
	for _, stmt := range triggers {
		_, err := db.ExecContext(ctx, stmt)
		var me *mysql.MySQLError
		if err != nil && !(errors.As(err, &me) && me.Number == errTriggerExists) {
			return err
		}
	}
	return nil
}

// journalOff logs that Migrate could not create the journal's triggers.
func (w *warner) journalOff(ctx context.Context, table string, err error) {
	if w.log != nil {
		w.log.WarnContext(ctx, "mysqllock: the change journal's triggers cannot be created: Election observers poll and miss terms shorter than a poll",
			"table", table, "err", err)
	}
}

// WatchHolders implements dlock.HolderWatcher for the lease strategy. The
// server cannot notify another session, so the holders come from a
// journal: triggers that Migrate creates write an entry for every change of
// a key's holders (a grant in any mode, a release, a metadata change, a
// forced release, a grant over an expired lease, the removal of expired
// shared holders) in the transaction that makes it, numbered per key under
// the key's row lock, and keep a key's last 256. The watcher reads the
// entries after the last it saw after 5 ms, doubling up to 1 s while none
// come. The expiry of a lease is not a change: holders keep the ExpiresAt
// of their grant (extensions are not journaled), and a lease that runs out
// without a release stays among them until the key's next change. The
// channel is closed when ctx ends, when a read fails, and when the watcher
// falls more than 256 changes behind. Without the triggers (see Migrate)
// it returns an error matching dlock.ErrUnsupported.
func (b *Backend) WatchHolders(ctx context.Context, key string) ([]dlock.LockInfo, <-chan []dlock.LockInfo, error) {
	n, err := b.triggers(ctx)
	if err != nil {
		return nil, nil, b.wrap("watch holders", err)
	}
	if n < journalTriggers {
		return nil, nil, fmt.Errorf("mysqllock: watch holders: %s has %d of the journal's %d triggers (run Migrate with the TRIGGER privilege): %w",
			b.table, n, journalTriggers, dlock.ErrUnsupported)
	}
	hs, ch, err := journal.Watch(ctx, source{b}, key, nil)
	if err != nil {
		return nil, nil, b.wrap("watch holders", err)
	}
	return hs, ch, nil
}

// triggers counts the journal's triggers on the lock table.
func (b *Backend) triggers(ctx context.Context) (int, error) {
	parts := strings.Split(strings.ReplaceAll(b.table, "`", ""), ".")
	schema, name := "", parts[len(parts)-1]
	if len(parts) == 2 {
		schema = parts[0]
	}
	var n int
	err := b.db.QueryRowContext(ctx, `SELECT COUNT(*) FROM information_schema.TRIGGERS
WHERE TRIGGER_SCHEMA = IF(? = '', DATABASE(), ?) AND TRIGGER_NAME IN (?, ?, ?, ?, ?, ?)`,
		schema, schema, name+"_jbu", name+"_jau", name+"_jai", name+"_jhi", name+"_jhu", name+"_jhd").Scan(&n)
	return n, err
}

// source is the journal of a Backend.
type source struct{ *Backend }

func (s source) Position(ctx context.Context, key string) (uint64, error) {
	var pos uint64
	err := s.db.QueryRowContext(ctx, `SELECT jseq FROM `+s.table+` WHERE name = ?`, key).Scan(&pos)
	if errors.Is(err, sql.ErrNoRows) {
		return 0, nil
	}
	return pos, err
}

func (s source) Read(ctx context.Context, key string, after uint64, limit int) ([]journal.Entry, error) {
	rows, err := s.db.QueryContext(ctx, `SELECT seq, kind, token, owner, fence, share_limit,
  TIMESTAMPDIFF(MICROSECOND, '1970-01-01', acquired_at), TIMESTAMPDIFF(MICROSECOND, UTC_TIMESTAMP(6), expires_at), metadata,
  IF(kind = 'x', 'exclusive', IF(share_limit = 0, 'shared', 'limited'))
FROM `+strings.TrimSuffix(s.table, "`")+`_journal`+"`"+` WHERE name = ? AND seq > ?
  AND seq <= (SELECT jseq FROM `+s.table+` WHERE name = ?) ORDER BY seq LIMIT ?`, key, after, key, limit)
	if err != nil {
		return nil, err
	}
	return journal.Scan(rows, key)
}
