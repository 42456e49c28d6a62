package pglock

import (
	"context"
	"fmt"
	"time"

	"github.com/dlock-dev/dlock"
	"github.com/dlock-dev/dlock/internal/keylist"
)

var (
	_ dlock.WaiterLister = (*Backend)(nil)
	_ dlock.KeyLister    = (*Backend)(nil)
)

// ListWaiters implements dlock.WaiterLister: the live entries of the
// waiter queue, by key and then in queue order, with Since the time the
// entry was queued. An acquisition queues when the Locker waits for the key
// (AcquireWait) and leaves the queue when it takes the key or gives up; an
// entry of a waiter that vanished lapses within the Backend's grace period.
// Entries written before the queue recorded owners have none. With a
// negative Options.Grace there is no queue, and the list is always empty.
func (b *Backend) ListWaiters(ctx context.Context, prefix string) ([]dlock.WaiterInfo, error) {
	rows, err := b.pool.Query(ctx, b.q.listWaiters, []byte(prefix))
	if err != nil {
		return nil, wrapErr(b.tb, "list waiters", err)
	}
	defer rows.Close()
	now := time.Now()
	var out []dlock.WaiterInfo
	for rows.Next() {
		var (
			name, token []byte
			w           dlock.WaiterInfo
			lim         int32
			sinceUs     int64
		)
		if err := rows.Scan(&name, &token, &w.Owner, &w.Metadata, &lim, &sinceUs); err != nil {
			return nil, wrapErr(b.tb, "list waiters", err)
		}
		w.Key, w.Since = string(name), now.Add(time.Duration(sinceUs)*time.Microsecond)
		copy(w.Token[:], token)
		w.Mode, w.Limit = modeOf(lim)
		out = append(out, w)
	}
	if err := rows.Err(); err != nil {
		return nil, wrapErr(b.tb, "list waiters", err)
	}
	return out, nil
}

// ListKeys implements dlock.KeyLister: every key's row (rows are kept
// after release), with its holders as List reports them. A free key's last
// holder is known when its last grant was exclusive: the row keeps that
// holder; shared and limited holders' rows go with their release, and such
// a key has no Last. Keys released by a version that did not record
// releases show as expired. The holders are read by a second statement: a
// key granted between the two shows as held, and a listing in which a key
// held by the first read has no holder in the second is read again
// (keylist.Retry).
func (b *Backend) ListKeys(ctx context.Context, prefix string) ([]dlock.KeyInfo, error) {
	return keylist.Retry(func() ([]dlock.KeyInfo, bool, error) { return b.listKeys(ctx, prefix) })
}

// listKeys is one ListKeys by two reads, and whether it is keylist.Torn.
func (b *Backend) listKeys(ctx context.Context, prefix string) ([]dlock.KeyInfo, bool, error) {
	rows, err := b.pool.Query(ctx, b.q.listKeys, []byte(prefix))
	if err != nil {
		return nil, false, wrapErr(b.tb, "list keys", err)
	}
	defer rows.Close()
	now := time.Now()
	var out []dlock.KeyInfo
	var held []bool
	for rows.Next() {
		var (
			h       holderRow
			r       keylist.Row
			endedUs int64
		)
		if err := rows.Scan(&h.name, &h.fence, &h.token, &h.owner, &h.metadata, &h.acquiredAt, &r.Held, &r.LastKnown, &r.Expired, &endedUs); err != nil {
			return nil, false, wrapErr(b.tb, "list keys", err)
		}
		r.Last, _ = h.info("", now)
		r.Ended = time.Duration(endedUs) * time.Microsecond
		out, held = append(out, r.Info(now)), append(held, r.Held)
	}
	if err := rows.Err(); err != nil {
		return nil, false, wrapErr(b.tb, "list keys", err)
	}
	hs, err := b.List(ctx, prefix)
	if err != nil {
		return nil, false, err
	}
	out = keylist.MergeHolders(out, hs)
	return out, keylist.Torn(held, out), nil
}

var _ dlock.WaiterLister = (*Advisory)(nil)

// ListWaiters implements dlock.WaiterLister: the server sessions blocked in
// pg_advisory_lock or pg_advisory_lock_shared on a key's lock (pg_locks rows
// not granted), by key and then by when their statement started (Since),
// named by Client ("pid N user@address"). PostgreSQL records no token, owner
// or metadata for a wait. Seeing other roles' sessions' details needs
// pg_read_all_stats (or superuser); without it Client lacks user and
// address.
func (a *Advisory) ListWaiters(ctx context.Context, prefix string) ([]dlock.WaiterInfo, error) {
	rows, err := a.pool.Query(ctx, a.q.listWaiters, []byte(prefix))
	if err != nil {
		return nil, wrapErr(a.tb, "advisory list waiters", err)
	}
	defer rows.Close()
	now := time.Now()
	var out []dlock.WaiterInfo
	for rows.Next() {
		var (
			name       []byte
			shared     bool
			pid        int32
			user, addr string
			sinceUs    int64
		)
		if err := rows.Scan(&name, &shared, &pid, &user, &addr, &sinceUs); err != nil {
			return nil, wrapErr(a.tb, "advisory list waiters", err)
		}
		w := dlock.WaiterInfo{Key: string(name), Mode: dlock.ModeExclusive, Since: now.Add(time.Duration(sinceUs) * time.Microsecond)}
		if shared {
			w.Mode = dlock.ModeShared
		}
		w.Client = fmt.Sprintf("pid %d %s@%s", pid, user, addr)
		out = append(out, w)
	}
	if err := rows.Err(); err != nil {
		return nil, wrapErr(a.tb, "advisory list waiters", err)
	}
	return out, nil
}
