package sqlitelock

import (
	"context"
	"database/sql"
	"errors"

	"github.com/dlock-dev/dlock"
	"github.com/dlock-dev/dlock/internal/journal"
)

var _ dlock.HolderWatcher = (*Backend)(nil)

const (
	positionSQL = `SELECT jseq FROM dlock_locks WHERE name = ?`
	// journalSQL reads a key's entries after a position, with the time
	// left of each lease as it was granted. Entries past the key's position
	// are left over from a dropped lock table, and are overwritten (the
	// triggers replace) as the position reaches them.
	journalSQL = `SELECT seq, kind, token, owner, fence, lim, acquired_us, expires_us - ` + now + `, metadata, mode
FROM dlock_journal WHERE name = ?1 AND seq > ?2 AND seq <= (SELECT jseq FROM dlock_locks WHERE name = ?1)
ORDER BY seq LIMIT ?3`
)

// WatchHolders implements dlock.HolderWatcher. SQLite cannot notify another
// process, so the holders come from a journal: triggers that Migrate
// creates write an entry for every change of a key's holders (a grant in
// any mode, a release, a metadata change, a forced release, the end of
// expired shared holders that a grant clears away) in the transaction that
// makes it, numbered per key, and keep a key's last 256. The watcher reads
// the entries after the last it saw after 5 ms, doubling up to 1 s while
// none come; a change made through this Backend wakes it at once. The
// expiry of a lease is not a change: holders keep the ExpiresAt of their
// grant (extensions are not journaled), and a lease that runs out without a
// release stays among them until the key's next change. The channel is
// closed when ctx ends, when a read fails, and when the watcher falls more
// than 256 changes behind.
func (b *Backend) WatchHolders(ctx context.Context, key string) ([]dlock.LockInfo, <-chan []dlock.LockInfo, error) {
	hs, ch, err := journal.Watch(ctx, source{b}, key, &b.bell)
	if err != nil {
		return nil, nil, wrap("watch holders", err)
	}
	return hs, ch, nil
}

// source is the journal of a Backend.
type source struct{ *Backend }

func (s source) Position(ctx context.Context, key string) (uint64, error) {
	var pos uint64
	err := s.db.QueryRowContext(ctx, positionSQL, key).Scan(&pos)
	if errors.Is(err, sql.ErrNoRows) {
		return 0, nil
	}
	return pos, err
}

func (s source) Read(ctx context.Context, key string, after uint64, limit int) ([]journal.Entry, error) {
	rows, err := s.db.QueryContext(ctx, journalSQL, key, after, limit)
	if err != nil {
		return nil, err
	}
	return journal.Scan(rows, key)
}
