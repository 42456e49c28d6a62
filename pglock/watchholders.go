package pglock

import (
	"cmp"
	"context"
	"encoding/hex"
	"errors"
	"slices"
	"strconv"
	"strings"
	"time"

	"github.com/dlock-dev/dlock/internal/ctxend"

	"github.com/dlock-dev/dlock"
	"github.com/jackc/pgx/v5/pgxpool"
)

// A change of a key's holders, in either strategy, bumps the key's change
// counter (the "changes" column of its row) and sends, in the same
// transaction, a NOTIFY whose payload ends with "/" and the change's
// record: the new counter, a kind, and the kind's fields, separated by
// spaces (owner and metadata in hex of their UTF-8, times in microseconds
// since the Unix epoch by the server's clock, tokens in hex):
//
//	g lim token fence acquired expires owner metadata gone   a grant
//	r token                                                  a release
//	m token metadata                                         a metadata change
//	f                                                        a forced release of every holder
//	e tokens                                                 the end of the holders named
//	!                                                        a change too large to tell
//
// lim is -1 for an exclusive grant (its holder is then the only one), 0 for
// shared, n for limited to n; expires is empty where leases end with their
// session; gone and tokens are comma-separated lists of holders that ended
// without a release (expired, or their session ended), which the grant
// found. Changes of one key update its row, so they commit, and PostgreSQL
// delivers their notifications, in counter order.

// maxBehind is how many changes WatchHolders keeps for a reader that is
// behind before it ends the watch (closes its channel).
const maxBehind = 1024

// payloadLimit is the size below which PostgreSQL takes a NOTIFY's payload
// (8000 bytes in a default build).
const payloadLimit = 8000

// snapshot is what a WatchHolders reads before it follows the changes: the
// key's holders and change counter in one statement.
type snapshot struct {
	holders []dlock.LockInfo
	changes int64
	// offset converts the server's clock to the local one: local time of
	// the read minus the server's at the read.
	offset time.Duration
}

// watchHolders is WatchHolders of either strategy: it starts a feed of
// key's changes on ln, then reads the snapshot with q (see readSnapshot) on
// pool, and follows the feed from it. op names the operation in errors.
func watchHolders(ctx context.Context, ln *listener, pool *pgxpool.Pool, q string, tb tables, op, key string) ([]dlock.LockInfo, <-chan []dlock.LockInfo, error) {
	f, err := ln.feedKey(ctx, key)
	if err != nil {
		if !errors.Is(err, dlock.ErrClosed) && ctxend.Err(ctx) == nil {
			err = wrapErr(tb, op, err)
		}
		return nil, nil, err
	}
	s, err := readSnapshot(ctx, pool, q, key)
	if err != nil {
		ln.stopFeed(f)
		if ctxend.Err(ctx) == nil {
			err = wrapErr(tb, op, err)
		}
		return nil, nil, err
	}
	return s.holders, followHolders(ctx, ln, f, key, s), nil
}

// readSnapshot runs q, which returns for key ($1) its change counter and
// the server's clock (microseconds since the epoch) on every row, and on
// each row a holder (or NULLs when there is none): token, owner, fence,
// metadata, acquired_at, the remaining lease in microseconds (NULL for a
// session lock), lim.
func readSnapshot(ctx context.Context, pool *pgxpool.Pool, q, key string) (snapshot, error) {
	rows, err := pool.Query(ctx, q, []byte(key))
	if err != nil {
		return snapshot{}, err
	}
	defer rows.Close()
	var s snapshot
	var serverUs int64
	var read []holderRow
	var lims []*int32
	for rows.Next() {
		var h holderRow
		var lim *int32
		if err := rows.Scan(&s.changes, &serverUs, &h.token, &h.owner, &h.fence, &h.metadata, &h.acquiredAt, &h.remainingUs, &lim); err != nil {
			return snapshot{}, err
		}
		if h.token != nil {
			read, lims = append(read, h), append(lims, lim)
		}
	}
	if err := rows.Err(); err != nil {
		return snapshot{}, err
	}
	now := time.Now()
	s.offset = now.Sub(time.UnixMicro(serverUs))
	for i, h := range read {
		in, _ := h.info(key, now)
		in.Mode, in.Limit = modeOf(*lims[i])
		s.holders = append(s.holders, in)
	}
	return s, nil
}

// followHolders reports s.holders, then applies each change record of f
// newer than s.changes to them and sends the holders after it. It ends
// (closing the channel) at ctx's end, at the feed's end, and at a record it
// cannot apply: a missing counter or a skipped one (a change it did not
// see), a change too large to tell, a reader too far behind.
func followHolders(ctx context.Context, ln *listener, f *feed, key string, s snapshot) <-chan []dlock.LockInfo {
	out := make(chan []dlock.LockInfo)
	go func(hs []dlock.LockInfo) {
		defer close(out)
		defer ln.stopFeed(f)
		last := s.changes
		var queue [][]dlock.LockInfo
		for {
			var send chan<- []dlock.LockInfo
			var next []dlock.LockInfo
			if len(queue) > 0 {
				send, next = out, queue[0]
			}
			select {
			case <-f.wake:
				recs, over := ln.take(f)
				for _, rec := range recs {
					n, nhs, ok := applyChange(key, hs, rec, s.offset)
					switch {
					case !ok || n > last+1:
						return
					case n <= last: // already in the snapshot
						continue
					}
					last = n
					if !sameHolders(nhs, hs) {
						queue = append(queue, nhs)
					}
					hs = nhs
				}
				if over || len(queue) > maxBehind {
					return
				}
			case send <- next:
				queue = queue[1:]
			case <-ctx.Done():
				return
			}
		}
	}(slices.Clone(s.holders))
	return out
}

// applyChange applies the change record rec to key's holders hs and
// returns its counter and the holders after it (a new slice, ordered by
// fence); ok is false if rec cannot be applied.
func applyChange(key string, hs []dlock.LockInfo, rec string, offset time.Duration) (n int64, after []dlock.LockInfo, ok bool) {
	f := strings.Split(rec, " ")
	if len(f) < 2 {
		return 0, nil, false
	}
	n, err := strconv.ParseInt(f[0], 10, 64)
	if err != nil {
		return 0, nil, false
	}
	without := func(tokens ...string) []dlock.LockInfo {
		var out []dlock.LockInfo
		for _, h := range hs {
			if !slices.Contains(tokens, h.Token.String()) {
				out = append(out, h)
			}
		}
		return out
	}
	switch kind, args := f[1], f[2:]; {
	case kind == "g" && len(args) == 8:
		in, ok := grantInfo(key, args[:7], offset)
		if !ok {
			return 0, nil, false
		}
		if in.Mode == dlock.ModeExclusive {
			return n, []dlock.LockInfo{in}, true
		}
		// Shared and limited holders never hold with an exclusive one.
		var rest []dlock.LockInfo
		for _, h := range without(strings.Split(args[7], ",")...) {
			if h.Mode != dlock.ModeExclusive {
				rest = append(rest, h)
			}
		}
		after = append(rest, in)
		slices.SortFunc(after, func(a, b dlock.LockInfo) int { return cmp.Compare(a.Fence, b.Fence) })
		return n, after, true
	case kind == "r" && len(args) == 1:
		return n, without(args[0]), true
	case kind == "e" && len(args) == 1:
		return n, without(strings.Split(args[0], ",")...), true
	case kind == "f" && len(args) == 0:
		return n, nil, true
	case kind == "m" && len(args) == 2:
		md, err := hex.DecodeString(args[1])
		if err != nil {
			return 0, nil, false
		}
		after = slices.Clone(hs)
		for i := range after {
			if after[i].Token.String() == args[0] {
				after[i].Metadata = string(md)
			}
		}
		return n, after, true
	}
	return 0, nil, false
}

// grantInfo decodes a grant's fields: lim token fence acquired expires
// owner metadata.
func grantInfo(key string, a []string, offset time.Duration) (dlock.LockInfo, bool) {
	in := dlock.LockInfo{Key: key}
	lim, err1 := strconv.Atoi(a[0])
	tok, err2 := hex.DecodeString(a[1])
	fence, err3 := strconv.ParseUint(a[2], 10, 64)
	acq, err4 := strconv.ParseInt(a[3], 10, 64)
	owner, err5 := hex.DecodeString(a[5])
	md, err6 := hex.DecodeString(a[6])
	if err := firstErr(err1, err2, err3, err4, err5, err6); err != nil || len(tok) != len(in.Token) {
		return in, false
	}
	if a[4] != "" {
		exp, err := strconv.ParseInt(a[4], 10, 64)
		if err != nil {
			return in, false
		}
		in.ExpiresAt = time.UnixMicro(exp).Add(offset)
	}
	copy(in.Token[:], tok)
	in.Fence, in.AcquiredAt, in.Owner, in.Metadata = fence, time.UnixMicro(acq), string(owner), string(md)
	in.Mode, in.Limit = modeOf(int32(lim))
	return in, true
}

func firstErr(errs ...error) error {
	for _, err := range errs {
		if err != nil {
			return err
		}
	}
	return nil
}

// sameHolders reports whether a and b are the same holders with the same
// metadata.
func sameHolders(a, b []dlock.LockInfo) bool {
	return slices.EqualFunc(a, b, func(x, y dlock.LockInfo) bool {
		return x.Token == y.Token && x.Fence == y.Fence && x.Metadata == y.Metadata
	})
}

// SQL pieces that build change records (see above); each takes SQL
// expressions.
func recHex(textExpr string) string { return `encode(convert_to(` + textExpr + `, 'UTF8'), 'hex')` }
func recTime(tsExpr string) string {
	return `(extract(epoch FROM ` + tsExpr + `) * 1000000)::bigint::text`
}

// recGrant is the record of a grant after counter n.
func recGrant(n, lim, token, fence, acquired, expires, owner, metadata, gone string) string {
	return n + ` || ' g ' || ` + lim + ` || ' ' || encode(` + token + `, 'hex') || ' ' || ` + fence + ` || ' ' || ` +
		recTime(acquired) + ` || ' ' || ` + expires + ` || ' ' || ` + recHex(owner) + ` || ' ' || ` + recHex(metadata) +
		` || ' ' || ` + gone
}

// fitPayload keeps a payload (SQL expression) within NOTIFY's limit: a
// longer one becomes hk's record "n !" (the watch then ends and reads
// again).
func fitPayload(payload, hk, n string) string {
	return `(SELECT CASE WHEN octet_length(p) < ` + strconv.Itoa(payloadLimit) + ` THEN p ELSE ` + hk + ` || '/' || ` + n + ` || ' !' END
  FROM (SELECT ` + payload + ` AS p) p)`
}
