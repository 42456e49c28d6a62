package sqlitelock

import (
	"context"
	"database/sql"
	"errors"
	"fmt"
	"time"

	"github.com/dlock-dev/dlock"
)

// Shared and limited holders live in dlock_shares, one row each; the key's
// row in dlock_locks keeps its exclusive holder, its fencing counter and its
// writer mark. Every acquisition that is not a free key's exclusive grant
// is one write transaction (acquireTx): it reads every holder of the key at
// one instant of SQLite's clock, decides, and writes, while no other
// connection can write the file.

const (
	// purgeSQL deletes the key's expired shared and limited holders. It is
	// the transaction's first statement: a write, so that the transaction
	// holds the write lock from its start even on a database opened without
	// _txlock=immediate (a read first could not become a write if another
	// connection wrote in between).
	purgeSQL = `DELETE FROM dlock_shares WHERE name = ?1 AND expires_us <= ` + now
	// stateSQL reads what decides an acquisition of key ?1 (limit ?2) at one
	// instant: that instant, the ends of the exclusive lease and of the
	// writer mark, and the unexpired shared and limited holders: how many,
	// how many limited, how many limited to ?2, and their largest limit.
	stateSQL = `SELECT ` + now + `,
  coalesce((SELECT expires_us FROM dlock_locks WHERE name = ?1), 0),
  coalesce((SELECT writer_us FROM dlock_locks WHERE name = ?1), 0),
  count(*), coalesce(sum(mode = 'limited'), 0), coalesce(sum(mode = 'limited' AND lim = ?2), 0),
  coalesce(max(lim), 0)
FROM dlock_shares WHERE name = ?1 AND expires_us > ` + now
	// shareHolderSQL reads the key's shared or limited holder whose lease
	// ends first: the slot a waiter can expect first.
	shareHolderSQL = `SELECT name, token, owner, fence, metadata, acquired_us, expires_us - ` + now + `, mode, lim
FROM dlock_shares WHERE name = ? AND expires_us > ` + now + ` ORDER BY expires_us LIMIT 1`
	markSQL = `UPDATE dlock_locks SET writer_us = ?2 WHERE name = ?1`
	// nextFenceSQL counts an acquisition on the key's row, making it if the
	// key is new (with no exclusive holder). The row's exclusive lease has
	// ended (a shared or limited grant needs that): its holder is cleared,
	// so that the row names its key's last holder only while that was
	// exclusive (listKeysSQL).
	nextFenceSQL = `INSERT INTO dlock_locks (name, token, fence, acquired_us, expires_us) VALUES (?1, x'', ` + firstFence + `, 0, 0)
ON CONFLICT (name) DO UPDATE SET fence = ` + nextFence + `, token = x'', owner = '', metadata = ''
RETURNING fence`
	insertShareSQL = `INSERT INTO dlock_shares (name, token, owner, fence, acquired_us, expires_us, metadata, mode, lim)
VALUES (?1, ?2, ?3, ?4, ?5, ?5 + ?6, ?7, ?8, ?9)`
)

// SupportsMode implements dlock.Sharer: every mode.
func (b *Backend) SupportsMode(m dlock.Mode) bool {
	return m == dlock.ModeExclusive || m == dlock.ModeShared || m == dlock.ModeLimited
}

// keyState is what stateSQL reads.
type keyState struct {
	nowUs, exclusiveUs, writerUs int64
	holders, limited, sameLimit  int // unexpired shared and limited holders
	limit                        int // the largest limit among them
}

func (st keyState) exclusive() bool { return st.exclusiveUs > st.nowUs }

// mismatch returns the error wrapping dlock.ErrModeMismatch for req when the
// key's holders disagree with it on the limit, or nil.
func (st keyState) mismatch(req dlock.Request) error {
	var held string
	switch {
	case req.Mode != dlock.ModeLimited:
		if st.limited == 0 {
			return nil
		}
		held = dlock.DescribeMode(dlock.ModeLimited, st.limit)
	case st.exclusive():
		held = dlock.DescribeMode(dlock.ModeExclusive, 0)
	case st.holders > st.limited:
		held = dlock.DescribeMode(dlock.ModeShared, 0)
	case st.sameLimit < st.holders:
		held = dlock.DescribeMode(dlock.ModeLimited, st.limit)
	default:
		return nil
	}
	return fmt.Errorf("sqlitelock: %q is held %s, asked %s: %w", req.Key, held, dlock.DescribeMode(req.Mode, req.Limit), dlock.ErrModeMismatch)
}

// modeText is a mode as dlock_shares stores it; modeOf reads it back ("" is
// an exclusive holder of dlock_locks).
func modeText(m dlock.Mode) string { return m.String() }

func modeOf(s string) dlock.Mode {
	switch s {
	case "shared":
		return dlock.ModeShared
	case "limited":
		return dlock.ModeLimited
	}
	return dlock.ModeExclusive
}

// acquireTx decides req in tx, which holds the write lock: it deletes the
// key's expired shared and limited holders, reads the key's state and
// grants req or says who holds the key (see decide).
func (b *Backend) acquireTx(ctx context.Context, tx *sql.Tx, req dlock.Request) (dlock.Result, error) {
	if _, err := tx.ExecContext(ctx, purgeSQL, req.Key); err != nil {
		return dlock.Result{}, err
	}
	var st keyState
	err := tx.QueryRowContext(ctx, stateSQL, req.Key, req.Limit).Scan(
		&st.nowUs, &st.exclusiveUs, &st.writerUs, &st.holders, &st.limited, &st.sameLimit, &st.limit)
	if err != nil {
		return dlock.Result{}, err
	}
	if err := st.mismatch(req); err != nil {
		return dlock.Result{}, err
	}
	return decide(ctx, tx, req, st)
}

// decide grants req or says who holds the key, inside acquireTx. The order
// is the Sharer contract's: any holder blocks an exclusive request (shared
// holders also get the writer mark), an exclusive holder blocks every
// request, the writer mark blocks a shared one, and the limit a limited one.
func decide(ctx context.Context, tx *sql.Tx, req dlock.Request, st keyState) (dlock.Result, error) {
	switch {
	case req.Mode == dlock.ModeExclusive && st.holders > 0:
		// Shared holders (limited ones are a mismatch): readers that come
		// now wait behind this writer.
		if _, err := tx.ExecContext(ctx, markSQL, req.Key, st.nowUs+dlock.WriterMark.Microseconds()); err != nil {
			return dlock.Result{}, err
		}
		return blocked(ctx, tx, req.Key, shareHolderSQL)
	case st.exclusive():
		return blocked(ctx, tx, req.Key, holderSQL)
	case req.Mode == dlock.ModeExclusive:
		// Free since the single statement was refused: take it here.
		var fence uint64
		var acquired int64 // the caller times the grant from its BEGIN
		err := tx.QueryRowContext(ctx, acquireSQL, req.Key, req.Token[:], req.Owner, req.TTL.Microseconds(), req.Metadata).Scan(&fence, &acquired)
		if errors.Is(err, sql.ErrNoRows) {
			return blocked(ctx, tx, req.Key, holderSQL)
		}
		return dlock.Result{Acquired: err == nil, Fence: fence}, err
	case req.Mode == dlock.ModeShared && st.writerUs > st.nowUs:
		return dlock.Result{Holder: dlock.LockInfo{Key: req.Key}, Remaining: usec(st.writerUs - st.nowUs)}, nil
	case req.Mode == dlock.ModeLimited && st.holders >= req.Limit:
		return blocked(ctx, tx, req.Key, shareHolderSQL)
	}
	var fence uint64
	if err := tx.QueryRowContext(ctx, nextFenceSQL, req.Key).Scan(&fence); err != nil {
		return dlock.Result{}, err
	}
	_, err := tx.ExecContext(ctx, insertShareSQL, req.Key, req.Token[:], req.Owner, fence, st.nowUs,
		req.TTL.Microseconds(), req.Metadata, modeText(req.Mode), req.Limit)
	if err != nil {
		return dlock.Result{}, err
	}
	return dlock.Result{Acquired: true, Fence: fence}, nil
}

// blocked is the Result of a refused request: the holder that stmt reads
// for key, and its remaining lease.
func blocked(ctx context.Context, q querier, key, stmt string) (dlock.Result, error) {
	hs, err := query(ctx, q, stmt, key)
	if err != nil || len(hs) == 0 {
		return dlock.Result{Holder: dlock.LockInfo{Key: key}}, err
	}
	return dlock.Result{Holder: hs[0].LockInfo, Remaining: max(hs[0].remaining, 0)}, nil
}

func usec(us int64) time.Duration { return time.Duration(us) * time.Microsecond }
