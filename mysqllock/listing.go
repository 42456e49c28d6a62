package mysqllock

import (
	"context"
	"time"

	"github.com/dlock-dev/dlock"
	"github.com/dlock-dev/dlock/internal/keylist"
)

var _ dlock.KeyLister = (*Backend)(nil)

// ListKeys implements dlock.KeyLister: every key's row (rows are kept after
// release), with its holders as List reports them. A free key's last holder
// is known when its last grant was exclusive: the row keeps that holder's
// owner, metadata and fence (its token is cleared by the release); shared
// and limited holders are not kept, and such a key has no Last. A lease
// released without a doorbell ends staleBell before its release, and
// FreedAt says so. The holders are read by a second statement, so a key
// granted between the two shows as held, and a listing in which a key held
// by the first read has no holder in the second is read again
// (keylist.Retry).
func (b *Backend) ListKeys(ctx context.Context, prefix string) ([]dlock.KeyInfo, error) {
	return keylist.Retry(func() ([]dlock.KeyInfo, bool, error) { return b.listKeys(ctx, prefix) })
}

// listKeys is one ListKeys by two reads, and whether it is keylist.Torn.
func (b *Backend) listKeys(ctx context.Context, prefix string) ([]dlock.KeyInfo, bool, error) {
	rows, err := b.db.QueryContext(ctx, b.q.listKeys, len(prefix), []byte(prefix))
	if err != nil {
		return nil, false, b.wrap("list keys", err)
	}
	defer rows.Close()
	now := time.Now()
	var out []dlock.KeyInfo
	var held []bool
	for rows.Next() {
		var (
			name, token         []byte
			r                   keylist.Row
			acquiredUs, endedUs int64
		)
		if err := rows.Scan(&name, &r.Last.Fence, &token, &r.Last.Owner, &r.Last.Metadata, &acquiredUs, &r.Held, &r.LastKnown, &r.Expired, &endedUs); err != nil {
			return nil, false, b.wrap("list keys", err)
		}
		r.Last.Key, r.Last.AcquiredAt = string(name), time.UnixMicro(acquiredUs)
		if r.Expired { // a release clears the token
			copy(r.Last.Token[:], token)
		}
		r.Ended = time.Duration(endedUs) * time.Microsecond
		out, held = append(out, r.Info(now)), append(held, r.Held)
	}
	if err := rows.Err(); err != nil {
		return nil, false, b.wrap("list keys", err)
	}
	hs, err := b.List(ctx, prefix)
	if err != nil {
		return nil, false, err
	}
	out = keylist.MergeHolders(out, hs)
	return out, keylist.Torn(held, out), nil
}
