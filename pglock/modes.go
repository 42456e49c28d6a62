package pglock

import (
	"context"
	"fmt"
	"time"

	"github.com/dlock-dev/dlock"
	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgxpool"
)

// The lease strategy's shared and limited holders (dlock.Sharer).

var _ dlock.Sharer = (*Backend)(nil)

// SupportsMode implements dlock.Sharer: the lease strategy grants every
// mode.
func (b *Backend) SupportsMode(m dlock.Mode) bool {
	return m == dlock.ModeExclusive || m == dlock.ModeShared || m == dlock.ModeLimited
}

// acquireShared runs the shared or limited acquisition on c: the statement
// that locks the key's row, then the one that decides from the holders as
// they are under that lock, in one round trip.
func (b *Backend) acquireShared(ctx context.Context, c *pgxpool.Conn, req dlock.Request, grace int64, since *time.Time, register time.Duration, out *attemptOutcome) error {
	var verdict string
	var notified int64
	var h, s holderRow
	var lim *int32
	var markUs int64
	var shareLimit int32
	limit := int32(req.Limit)
	if req.Mode == dlock.ModeShared {
		limit = 0
	}
	err := pipelineRow(ctx, c, b.q.lockKey, []any{[]byte(req.Key)}, b.q.acquireShared,
		[]any{[]byte(req.Key), req.Token[:], req.Owner, us(req.TTL), req.Metadata, grace, since, us(register), limit, b.tb.channel, b.tb.watch},
		&verdict, &out.fence, &out.place, &notified,
		&h.token, &h.owner, &h.fence, &h.metadata, &h.acquiredAt, &h.remainingUs,
		&s.token, &s.owner, &s.fence, &s.metadata, &s.acquiredAt, &s.remainingUs, &lim,
		&markUs, &shareLimit)
	if err != nil || verdict == "grant" {
		return err
	}
	now := time.Now()
	switch verdict {
	case "held":
		info, rem := h.info(req.Key, now)
		out.res = dlock.Result{Holder: info, Remaining: rem}
	case "full":
		info, rem := s.info(req.Key, now)
		info.Mode, info.Limit = dlock.ModeLimited, req.Limit
		out.res = dlock.Result{Holder: info, Remaining: rem}
	case "marked": // an exclusive acquisition waits: no holder to name
		out.res = dlock.Result{Holder: dlock.LockInfo{Key: req.Key}, Remaining: time.Duration(markUs) * time.Microsecond}
	case "mismatch":
		if h.remainingUs != nil && *h.remainingUs > 0 {
			out.mismatch = dlock.DescribeMode(dlock.ModeExclusive, 0)
		} else {
			out.mismatch = dlock.DescribeMode(modeOf(shareLimit))
		}
	default: // "queued": free, but a waiter is ahead
		out.res = dlock.Result{Holder: dlock.LockInfo{Key: req.Key}}
	}
	return nil
}

// pipelineRow is pipeline for a q that returns one row, scanned into dest.
func pipelineRow(ctx context.Context, c batcher, lock string, lockArgs []any, q string, args []any, dest ...any) error {
	n := 0
	err := pipeline(ctx, c, lock, lockArgs, q, args, func(rows pgx.Rows) error {
		n++
		return rows.Scan(dest...)
	})
	if err == nil && n != 1 {
		err = fmt.Errorf("pglock: %d rows from a statement that returns one", n)
	}
	return err
}

// modeOf is the mode of a holder whose lim column is lim: -1 exclusive, 0
// shared, n limited to n.
func modeOf(lim int32) (dlock.Mode, int) {
	switch {
	case lim < 0:
		return dlock.ModeExclusive, 0
	case lim == 0:
		return dlock.ModeShared, 0
	}
	return dlock.ModeLimited, int(lim)
}
