package pglock

import (
	"bytes"
	"context"
	"errors"
	"fmt"
	"log/slog"
	"sync"
	"time"

	"github.com/dlock-dev/dlock/internal/ctxend"

	"github.com/dlock-dev/dlock"
	"github.com/dlock-dev/dlock/internal/claims"
	"github.com/dlock-dev/dlock/internal/refusals"
	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgxpool"
)

// Backend is the lease strategy. It is safe for concurrent use. Create it
// with New; Close it to stop its LISTEN connection.
type Backend struct {
	claims *claims.Set
	pool   *pgxpool.Pool
	tb     tables
	grace  time.Duration // < 0: no queue
	log    *slog.Logger
	ln     *listener
	q      leaseQueries

	refused refusals.Set // keys an exclusive attempt found held lately (see join)

	bg    context.Context // ended by Close: stops the resolutions under way
	stop  context.CancelFunc
	stmts sync.WaitGroup // acquisition statements and the undoing of abandoned grants
	wg    sync.WaitGroup // resolutions of broken connections
}

var (
	_ dlock.Backend        = (*Backend)(nil)
	_ dlock.Waiter         = (*Backend)(nil)
	_ dlock.Lister         = (*Backend)(nil)
	_ dlock.ForceReleaser  = (*Backend)(nil)
	_ dlock.Watcher        = (*Backend)(nil)
	_ dlock.MetadataSetter = (*Backend)(nil)
	_ dlock.HolderWatcher  = (*Backend)(nil)
)

// New returns the lease strategy over pool, which the caller keeps owning.
// It does no I/O; call Migrate once to create the tables. The error matches
// dlock.ErrInvalidOption for a nil pool or a bad table name.
func New(pool *pgxpool.Pool, opts *Options) (*Backend, error) {
	tb, o, err := checkArgs(pool == nil, opts)
	if err != nil {
		return nil, err
	}
	grace := o.Grace
	if grace == 0 {
		grace = DefaultGrace
	}
	bg, stop := context.WithCancel(context.Background())
	return &Backend{claims: newClaims(pool, tb, "lease"), pool: pool, tb: tb, grace: grace, log: logger(o), ln: newListener(pool, tb), q: newLeaseQueries(tb),
		bg: bg, stop: stop}, nil
}

// checkArgs validates a constructor's arguments.
func checkArgs(nilPool bool, opts *Options) (tables, Options, error) {
	var o Options
	if opts != nil {
		o = *opts
	}
	tb, err := parseTable(o.Table)
	if err == nil && nilPool {
		err = fmt.Errorf("%w: pglock: nil pool", dlock.ErrInvalidOption)
	}
	return tb, o, err
}

// Close stops the connection that listens for releases on behalf of
// waiters (waiting acquisitions then fall back to the Locker's backoff),
// waits for the acquisition statements still under way and releases what
// those whose callers left took; then it stops the retries for
// acquisitions whose connection broke (such a lease, if it was taken, runs
// out with its TTL). It does not close the pool and does not release
// locks.
func (b *Backend) Close() error {
	b.ln.close()
	b.stmts.Wait()
	b.stop()
	b.wg.Wait()
	return nil
}

// Migrate creates the tables of both strategies if they do not exist, and
// logs what Check finds to Options.Logger. It is safe to run concurrently
// and repeatedly. Acquisitions never create the tables: without them they
// fail with an error matching dlock.ErrNoSchema.
func (b *Backend) Migrate(ctx context.Context) error { return migrate(ctx, b.pool, b.tb, b.log) }

// Check reports the server settings that weaken the lease strategy's
// guarantees; see the function Check.
func (b *Backend) Check(ctx context.Context) ([]Finding, error) { return Check(ctx, b.pool) }

type leaseQueries struct {
	acquire, unregister, extend, release, forceRelease, list, setMetadata string
	handed, join                                                          string
	listWaiters, listKeys, watchHolders                                   string
	// lockKey, lockShared and lockMany lock the lease rows that a
	// statement on shared or limited holders is about to read, first,
	// in the same transaction: see newLeaseQueries.
	lockKey, lockShared, lockMany string
	acquireShared                 string
}

// newLeaseQueries builds the lease statements for tb. Every operation is one
// round trip: one autocommit statement, or two in one implicit transaction
// (see below). Times come from clock_timestamp() of the server (now() would
// be the start of the transaction, but clock_timestamp() does not depend on
// how the statement is wrapped).
//
// Every statement that writes commits durably whatever the server's, the
// database's or the role's default (set_config of synchronous_commit, local
// to the statement's transaction): a grant or an extension that a crash
// forgets would let the key be granted again, with a fence already handed
// out, while its holder still trusts it (a forgotten release would only
// leave the key held until the lease's end).
//
// The acquisition takes the row if its lease is over and, during the grace
// period after it ended (or after the release of a shared or limited
// holder, freed_at), only if no live waiter queued ahead of this one
// ($7: the caller's place in the queue, NULL for "now"). Each queue entry
// records its mode (lim), and queued readers do not count for an exclusive
// acquisition while the key's writer mark is live (the mark refuses them:
// the writer would wait out the grace period behind readers that cannot
// go), nor ever for a shared one (they may hold the key together: waiting
// for them would only let readers in one at a time). It only tries to
// write when the statement's snapshot shows it may take the row, so that a
// refusal is read-only (no row lock, no commit to flush: waiters that look
// cost little); the ON CONFLICT clause checks the expiry again on the
// locked, latest version of the row, so a concurrent grant is never
// overridden. A waiter that did not get the row joins the queue or
// refreshes its entry when half of it has run ($8 > 0) in the same
// statement; one that got it leaves the queue. The final SELECT reads the
// holder from the statement's snapshot, for the Result when the row was
// not taken.
//
// Shared and limited holders live in the holders table, and the lock row
// summarises them (shared_until, share_limit), so the exclusive acquisition
// still decides on the locked row alone: it is refused while shared_until
// is in the future. A refusal because of shared holders renews the writer
// mark (writer_until, $9) on the locked row: the only refusal that writes.
// That update waits for the row's lock, and finds nothing to mark if the
// last shared holder left meanwhile, after the statement's snapshot: its
// release could not name this waiter, which looks again at once.
//
// Every statement that reads the holders table to decide (a shared or
// limited grant, a release or renewal of such a holder, a forced release)
// runs after a statement that locked the key's row, in the same implicit
// transaction of one pipeline (one round trip): in READ COMMITTED a
// statement's snapshot is taken when it starts, so a statement that waited
// for the row's lock within itself would decide from holders as they were
// before the wait. Every change to the holders of a key is made under that
// lock, so the second statement's snapshot is the truth. A shared or
// limited acquisition follows the exclusive one's queue rules; its grant
// also wakes the next waiter in the queue (more readers, or the next slot,
// may be free).
//
// The renewal's new expiry counts from its statement's start (no earlier
// than the client sent it), but whether the lease is still live is checked
// with clock_timestamp() at the row: a renewal that waited for the row while
// a release ended the lease would otherwise compare the release's later
// instant with its own start, find the lease live and revive it (found by
// the fault harness; TestExtendRacingReleaseDoesNotRevive). A shared or
// limited holder's renewal raises its key's shared_until.
//
// Every grant (exclusive, shared or limited) and every metadata change
// also sends a NOTIFY on the watch channel ($11), for dlock.Watcher: one
// more NOTIFY in a transaction that commits durably anyway. Waiters do not
// listen to it; watches listen to both.
//
// An exclusive release hands the key over when the first live waiter in
// its queue (in the order below) is exclusive and recorded its lease
// (ttl_us): in the same statement the row gets that waiter's token, owner,
// metadata, the next fence and a lease from the release's instant; the
// waiter's entry becomes a tombstone (until the release's instant, ttl_us
// -1), so that a refresh of it racing the grant cannot queue it again (nor
// can any statement of a waiter that finds its own token holding); and the
// NOTIFY names that waiter with a grant record. Only that waiter wakes. It
// confirms the grant with a read (handed), which also deletes its
// tombstone, and times the lease from that read's sending minus the part
// of the lease already gone; a waiter that missed the notification finds
// its token holding in its next acquisition statement, timed the same way
// (its tombstone then waits for the sweep a minute later). The entry is
// locked (after the key's row) before the grant, so a waiter that leaves
// deletes its entry first and then releases: a release that locked the
// entry before the delete has granted when the delete returns, and one
// after finds no entry. A handoff is one durable commit. A waiter that
// dies while queued can be handed the key until its entry lapses (at most
// waitStep + waitSlack after its last statement); the key then stays held
// until that lease ends, as a dead holder's does.
//
// Otherwise the release's NOTIFY names the key and the first live waiter in
// its queue that may take it (while the writer mark is live, the first
// that is not a reader, if any), which the listener wakes at once; the
// key's other waiters are woken after the grace period, in case that
// waiter is gone.
// Naming a reader that the mark refuses would spend the wake-up, and leave
// the writer behind it asleep. The release's snapshot may miss a waiter
// whose statement ran meanwhile; a waiter that then finds the key free but
// yields it to a waiter ahead (within the grace period) names that one in
// its own statement, so that the key does not sit free while both sleep.
func newLeaseQueries(tb tables) leaseQueries {
	l, w, h := tb.lease, tb.waiters, tb.holders
	const (
		ttl    = `$4::bigint * interval '1 microsecond'`
		firstQ = `(SELECT encode(q.token, 'hex') FROM ` + "%s" + ` q WHERE q.name = r.name AND q.until > clock_timestamp()
    ORDER BY q.lim = 0 AND EXISTS (SELECT FROM ` + "%s" + ` k WHERE k.name = r.name AND k.writer_until > clock_timestamp()),
      q.since, q.token LIMIT 1)`
		remUs    = `(extract(epoch FROM %s - c.now) * 1000000)::bigint`
		syncOn   = `set_config('synchronous_commit', 'on', true)`
		holderQ  = `SELECT s.token, s.owner, s.fence, s.metadata, s.acquired_at, s.expires_at, s.lim FROM `
		earliest = ` s, c WHERE s.name = $1 AND s.expires_at > c.now ORDER BY s.expires_at, s.token LIMIT 1`
	)
	first := fmt.Sprintf(firstQ, w, l)
	rem := func(col string) string { return fmt.Sprintf(remUs, col) }
	// aheadOf: the live waiters queued ahead of $7 (NULL: now). aheadEx
	// and aheadSh: one of them that holds back an exclusive, or a shared
	// or limited ($9), acquisition during the grace period.
	aheadOf := `SELECT q.token FROM ` + w + ` q WHERE q.name = $1 AND q.until > c.now
        AND (q.since, q.token) < (COALESCE($7::timestamptz, c.now), $2)`
	backEx := ` AND (q.lim <> 0 OR NOT EXISTS (SELECT FROM ` + l + ` k WHERE k.name = $1 AND k.writer_until > c.now))`
	backSh := ` AND (q.lim <> 0 OR $9::int > 0)`
	aheadEx := `EXISTS (` + aheadOf + backEx + `)`
	aheadSh := `EXISTS (` + aheadOf + backSh + `)`
	// forward: a waiter ($8 > 0) that yielded a free key to the first of
	// those (back) names it ($10: the channel): the release that freed the
	// key may have named another waiter, or none.
	forward := func(yielded, back string) string {
		return `fw AS (
  SELECT pg_notify($10, encode($1, 'hex') || ' ' || encode(n.token, 'hex'))
  FROM c, LATERAL (` + aheadOf + back + ` ORDER BY q.since, q.token LIMIT 1) n
  WHERE $8::bigint > 0 AND ` + yielded + `
)`
	}
	// register and unqueue: the waiter queue's upkeep, given granted (a
	// grant was made) and refused (the caller may wait for the key).
	register := func(refused, lim string) string {
		return `reg AS (
  INSERT INTO ` + w + ` AS q (name, token, since, until, lim, owner, metadata, ttl_us)
  SELECT $1, $2, c.now, c.now + $8::bigint * interval '1 microsecond', ` + lim + `, $3, $5, $4::bigint FROM c
  WHERE $8::bigint > 0 AND ` + refused + `
    AND NOT EXISTS (SELECT FROM ` + l + ` h WHERE h.name = $1 AND h.token = $2 AND h.expires_at > c.now)
    AND NOT EXISTS (SELECT FROM ` + w + ` q WHERE q.name = $1 AND q.token = $2
      AND q.until > c.now + $8::bigint * interval '1 microsecond' / 2)
  ON CONFLICT (name, token) DO UPDATE SET until = EXCLUDED.until WHERE q.ttl_us >= 0
  RETURNING q.since
)`
	}
	// granted: a grant tells the key's watches ($11: the watch channel)
	// with its change record (see watchholders.go), from the rows of
	// from: n (the key's change counter), fence, acquired_at and
	// expires_at of the grant; lim is its mode and gone the holders that
	// its statement found expired.
	granted := func(from, lim, gone string) string {
		rec := recGrant(`n`, lim, `$2`, `fence::text`, `acquired_at`, recTime(`expires_at`), `$3`, `$5`, gone)
		return `gn AS (SELECT pg_notify($11, ` + fitPayload(`encode($1, 'hex') || '/' || `+rec, `encode($1, 'hex')`, `n`) + `) FROM ` + from + `)`
	}
	unqueue := func(granted string) string {
		return `del AS (
  DELETE FROM ` + w + ` q WHERE q.name = $1
    AND (q.token = $2 AND ` + granted + `
      OR q.token <> $2 AND q.until < (SELECT now FROM c) - interval '1 minute')
)`
	}
	return leaseQueries{
		acquire: `WITH c AS MATERIALIZED (SELECT clock_timestamp() AS now, ` + syncOn + ` AS sc),
acq AS (
  INSERT INTO ` + l + ` AS l (name, token, owner, fence, acquired_at, expires_at, metadata, changes)
  SELECT $1, $2, $3, 1, c.now, c.now + ` + ttl + `, $5, 1 FROM c
  WHERE NOT EXISTS (SELECT FROM ` + l + ` h WHERE h.name = $1 AND (h.expires_at > c.now OR h.shared_until > c.now))
    AND ($6::bigint < 0
      OR NOT EXISTS (SELECT FROM ` + l + ` h WHERE h.name = $1
        AND GREATEST(h.expires_at, h.freed_at) > c.now - $6::bigint * interval '1 microsecond')
      OR NOT ` + aheadEx + `)
  ON CONFLICT (name) DO UPDATE
  SET token = EXCLUDED.token, owner = EXCLUDED.owner, fence = l.fence + 1,
      acquired_at = EXCLUDED.acquired_at, expires_at = EXCLUDED.expires_at, metadata = EXCLUDED.metadata,
      writer_until = '-infinity', changes = l.changes + 1
  WHERE l.expires_at <= EXCLUDED.acquired_at AND l.shared_until <= EXCLUDED.acquired_at
  RETURNING l.fence, l.changes AS n, l.acquired_at, l.expires_at
),
s AS (` + holderQ + h + earliest + `),
mark AS (
  UPDATE ` + l + ` AS l SET writer_until = c.now + $9::bigint * interval '1 microsecond' FROM c
  WHERE l.name = $1 AND NOT EXISTS (SELECT FROM acq)
    AND l.expires_at <= c.now AND l.shared_until > c.now AND l.share_limit = 0
  RETURNING l.name
),
` + register(`NOT EXISTS (SELECT FROM acq) AND NOT EXISTS (SELECT FROM s WHERE s.lim > 0)`, `-1`) + `,
` + unqueue(`EXISTS (SELECT FROM acq)`) + `,
` + forward(`NOT EXISTS (SELECT FROM acq)
    AND NOT EXISTS (SELECT FROM `+l+` h WHERE h.name = $1 AND (h.expires_at > c.now OR h.shared_until > c.now))`, backEx) + `,
` + granted(`acq`, `'-1'`, `''`) + `
SELECT (SELECT fence FROM acq), (SELECT since FROM reg),
  h.name, h.token, h.owner, h.fence, h.metadata, h.acquired_at, ` + rem("h.expires_at") + `,
  s.token, s.owner, s.fence, s.metadata, s.acquired_at, ` + rem("s.expires_at") + `, s.lim,
  EXISTS (SELECT FROM mark), (SELECT count(*) FROM fw), (SELECT count(*) FROM gn)
FROM c LEFT JOIN ` + l + ` h ON h.name = $1 LEFT JOIN s ON true`,

		// The row, created if need be (fence 0: the next grant's is 1),
		// locked by an update that changes nothing.
		lockKey: `INSERT INTO ` + l + ` AS l (name, token, owner, fence, acquired_at, expires_at, metadata)
VALUES ($1, ''::bytea, '', 0, 'epoch', 'epoch', '')
ON CONFLICT (name) DO UPDATE SET fence = l.fence
RETURNING ` + syncOn,

		// $9: the limit (0: shared); $10: the channel. The verdict, in
		// dlock.Sharer's order: an exclusive holder (a limited request
		// mismatches it), holders of another mode or limit, the writer
		// mark, the limit, then the queue of waiters.
		acquireShared: `WITH c AS MATERIALIZED (SELECT clock_timestamp() AS now),
k AS MATERIALIZED (
  SELECT l.*, (SELECT count(*) FROM ` + h + ` s WHERE s.name = $1 AND s.expires_at > c.now) AS n
  FROM ` + l + ` l, c WHERE l.name = $1
),
v AS MATERIALIZED (
  SELECT k.*, CASE
    WHEN k.expires_at > c.now THEN CASE WHEN $9::int > 0 THEN 'mismatch' ELSE 'held' END
    WHEN k.n > 0 AND k.share_limit <> $9::int THEN 'mismatch'
    WHEN $9::int = 0 AND k.writer_until > c.now THEN 'marked'
    WHEN $9::int > 0 AND k.n >= $9::int THEN 'full'
    WHEN $6::bigint >= 0 AND GREATEST(k.expires_at, k.freed_at) > c.now - $6::bigint * interval '1 microsecond'
      AND ` + aheadSh + ` THEN 'queued'
    ELSE 'grant' END AS verdict
  FROM k, c
),
g AS (
  INSERT INTO ` + h + ` (name, token, lim, owner, fence, acquired_at, expires_at, metadata)
  SELECT $1, $2, $9::int, $3, v.fence + 1, c.now, c.now + ` + ttl + `, $5 FROM v, c WHERE v.verdict = 'grant'
  RETURNING fence, acquired_at, expires_at
),
u AS (
  UPDATE ` + l + ` AS l SET fence = g.fence, shared_until = GREATEST(l.shared_until, g.expires_at), share_limit = $9::int,
    changes = l.changes + 1
  FROM g WHERE l.name = $1
  RETURNING l.changes AS n
),
gc AS (
  DELETE FROM ` + h + ` s USING c WHERE s.name = $1 AND s.expires_at <= c.now AND EXISTS (SELECT FROM g)
  RETURNING s.token
),
` + register(`EXISTS (SELECT FROM v WHERE v.verdict NOT IN ('grant', 'mismatch'))`, `$9::int`) + `,
` + unqueue(`EXISTS (SELECT FROM g)`) + `,
` + forward(`EXISTS (SELECT FROM v WHERE v.verdict = 'queued')`, backSh) + `,
nx AS (
  SELECT pg_notify($10, encode($1, 'hex') || ' ' || encode(n.token, 'hex')) FROM (
    SELECT q.token FROM ` + w + ` q, c
    WHERE q.name = $1 AND q.token <> $2 AND q.until > c.now AND EXISTS (SELECT FROM g)
    ORDER BY q.since, q.token LIMIT 1) n
),
s AS (` + holderQ + h + earliest + `),
` + granted(`g, u`, `$9::int::text`, `COALESCE((SELECT string_agg(encode(token, 'hex'), ',') FROM gc), '')`) + `
SELECT v.verdict, (SELECT fence FROM g), (SELECT since FROM reg), (SELECT count(*) FROM nx) + (SELECT count(*) FROM fw) + (SELECT count(*) FROM gn),
  v.token, v.owner, v.fence, v.metadata, v.acquired_at, ` + rem("v.expires_at") + `,
  s.token, s.owner, s.fence, s.metadata, s.acquired_at, ` + rem("s.expires_at") + `, s.lim,
  ` + rem("GREATEST(v.writer_until, c.now)") + `, v.share_limit
FROM v CROSS JOIN c LEFT JOIN s ON true`,

		unregister: `DELETE FROM ` + w + ` WHERE name = $1 AND token = $2`,

		// An exclusive waiter's first statement on a key that is likely
		// held: it joins the queue only if the key has a live exclusive
		// lease of another token ($2), and returns that holder; no row if
		// not (the caller then runs acquire). Where it joins, acquire would
		// take nothing and do only the same insert. Not waiting for the
		// flush: a queue entry that a crash forgets leaves its waiter to
		// its next look, and a release that grants to it commits durably
		// after it.
		join: `WITH c AS MATERIALIZED (SELECT clock_timestamp() AS now, set_config('synchronous_commit', 'off', true) AS sc),
h AS MATERIALIZED (
  SELECT l.token, l.owner, l.fence, l.metadata, l.acquired_at, l.expires_at FROM ` + l + ` l, c
  WHERE l.name = $1 AND l.expires_at > c.now AND l.token <> $2
),
reg AS (
  INSERT INTO ` + w + ` AS q (name, token, since, until, lim, owner, metadata, ttl_us)
  SELECT $1, $2, c.now, c.now + $6::bigint * interval '1 microsecond', -1, $3, $5, $4::bigint FROM c
  WHERE EXISTS (SELECT FROM h)
  ON CONFLICT (name, token) DO UPDATE SET until = EXCLUDED.until WHERE q.ttl_us >= 0
  RETURNING q.since
)
SELECT (SELECT since FROM reg), h.token, h.owner, h.fence, h.metadata, h.acquired_at, ` + rem("h.expires_at") + `
FROM h, c`,

		// The lease a release handed to $2, if it holds: its fence and
		// the microseconds left. It deletes $2's tombstone in the queue
		// (no statement of that wait runs meanwhile, so none can race
		// the grant), so that tombstones do not pile up until the sweep;
		// a crash that forgets the delete leaves a tombstone, hence the
		// commit that does not wait for its flush.
		handed: `WITH c AS MATERIALIZED (SELECT clock_timestamp() AS now, set_config('synchronous_commit', 'off', true) AS sc),
d AS (DELETE FROM ` + w + ` WHERE name = $1 AND token = $2 AND ttl_us = -1)
SELECT fence, ` + rem(`expires_at`) + `
FROM ` + l + `, c
WHERE name = $1 AND token = $2 AND expires_at > c.now`,

		// The rows of the keys in $1 that have shared or limited holders
		// (any other key's holders are all expired), in key order so that
		// two renewals never deadlock.
		lockMany: `SELECT ` + syncOn + `, (SELECT count(*) FROM (SELECT FROM ` + l + `
  WHERE name = ANY($1::bytea[]) AND shared_until > clock_timestamp() ORDER BY name FOR UPDATE) x)`,
		extend: `WITH c AS MATERIALIZED (SELECT clock_timestamp() AS now),
x AS (SELECT * FROM unnest($1::bytea[], $2::bytea[], $3::bigint[]) AS x(name, token, ttl)),
ex AS (
  UPDATE ` + l + ` AS l SET expires_at = c.now + x.ttl * interval '1 microsecond'
  FROM c, x
  WHERE l.name = x.name AND l.token = x.token AND l.expires_at > clock_timestamp()
  RETURNING l.name, l.token
),
sh AS (
  UPDATE ` + h + ` AS s SET expires_at = c.now + x.ttl * interval '1 microsecond'
  FROM c, x
  WHERE s.name = x.name AND s.token = x.token AND s.expires_at > clock_timestamp()
  RETURNING s.name, s.token, s.expires_at
),
su AS (
  UPDATE ` + l + ` AS l SET shared_until = GREATEST(l.shared_until, m.e)
  FROM (SELECT name, max(expires_at) AS e FROM sh GROUP BY name) m WHERE l.name = m.name
)
SELECT name, token FROM ex UNION ALL SELECT name, token FROM sh`,

		// Only a key with shared or limited holders needs its row locked
		// first: an exclusive holder's release updates the row itself.
		lockShared: `SELECT ` + syncOn + `, (SELECT true FROM ` + l + `
  WHERE name = $1 AND shared_until > clock_timestamp() FOR UPDATE)`,
		// An exclusive release ends the lease and sets freed_at to the same
		// instant: the lease was released, not expired (ListKeys).
		release: `WITH c AS MATERIALIZED (SELECT clock_timestamp() AS now),
lk AS MATERIALIZED (
  SELECT FROM ` + l + ` WHERE name = $1 AND token = $2 AND expires_at > clock_timestamp() FOR UPDATE
),
hd AS MATERIALIZED (
  SELECT q.token, q.owner, q.metadata, q.ttl_us, q.lim FROM ` + w + ` q, c
  WHERE q.name = $1 AND q.until > c.now AND q.token <> $2 AND EXISTS (SELECT FROM lk)
  ORDER BY q.lim = 0 AND EXISTS (SELECT FROM ` + l + ` k WHERE k.name = $1 AND k.writer_until > c.now),
    q.since, q.token
  LIMIT 1 FOR UPDATE OF q
),
ex AS (
  UPDATE ` + l + ` AS l SET freed_at = c.now, changes = l.changes + 1,
    expires_at = CASE WHEN hd.token IS NULL THEN c.now ELSE c.now + hd.ttl_us * interval '1 microsecond' END,
    token = COALESCE(hd.token, l.token), owner = COALESCE(hd.owner, l.owner),
    metadata = COALESCE(hd.metadata, l.metadata), fence = l.fence + (hd.token IS NOT NULL)::int,
    acquired_at = CASE WHEN hd.token IS NULL THEN l.acquired_at ELSE c.now END,
    writer_until = CASE WHEN hd.token IS NULL THEN l.writer_until ELSE '-infinity' END
  FROM c LEFT JOIN hd ON hd.lim = -1 AND hd.ttl_us > 0
  WHERE l.name = $1 AND l.token = $2 AND l.expires_at > clock_timestamp()
  RETURNING l.name, l.changes, hd.token AS handed, l.fence, l.acquired_at, l.expires_at, l.owner, l.metadata
),
gone AS (
  UPDATE ` + w + ` q SET until = c.now, ttl_us = -1 FROM ex, c WHERE q.name = $1 AND q.token = ex.handed
),
sh AS (
  DELETE FROM ` + h + ` WHERE name = $1 AND token = $2 AND expires_at > clock_timestamp()
  RETURNING name
),
su AS (
  UPDATE ` + l + ` AS l SET freed_at = clock_timestamp(),
    shared_until = COALESCE((SELECT max(s.expires_at) FROM ` + h + ` s
      WHERE s.name = $1 AND s.token <> $2 AND s.expires_at > clock_timestamp()), '-infinity'),
    changes = l.changes + 1
  WHERE l.name = $1 AND EXISTS (SELECT FROM sh)
  RETURNING l.name, l.changes
)
SELECT pg_notify($3, encode(r.name, 'hex') || COALESCE(' ' || ` + first + `, '') || '/' || r.changes || ' r ' || encode($2, 'hex'))
FROM (SELECT name, changes FROM ex WHERE handed IS NULL UNION ALL SELECT name, changes FROM su) r
UNION ALL
SELECT pg_notify($3, ` + fitPayload(`encode($1, 'hex') || ' ' || encode(handed, 'hex') || '/' || `+
			recGrant(`changes`, `'-1'`, `handed`, `fence::text`, `acquired_at`, recTime(`expires_at`), `owner`, `metadata`, `''`),
			`encode($1, 'hex')`, `changes`) + `)
FROM ex WHERE handed IS NOT NULL`,

		// After lockShared.
		forceRelease: `WITH c AS MATERIALIZED (SELECT clock_timestamp() AS now),
sh AS (DELETE FROM ` + h + ` s WHERE s.name = $1 RETURNING s.expires_at),
r AS (
  UPDATE ` + l + ` AS l SET expires_at = LEAST(l.expires_at, c.now), shared_until = '-infinity', freed_at = c.now,
    changes = l.changes + 1
  FROM c
  WHERE l.name = $1 AND (l.expires_at > c.now OR EXISTS (SELECT FROM sh WHERE sh.expires_at > c.now))
  RETURNING l.name, l.changes
)
SELECT pg_notify($2, encode(r.name, 'hex') || '/' || r.changes || ' f') FROM r`,

		// The lease must be live at the row, as in extend: an update
		// that waited for a release's row lock must not find the release's
		// later instant in the future of its own start. The key's row is
		// locked first (k), as every change of a shared holder does, so
		// that the change counter orders it with them.
		setMetadata: `WITH c AS MATERIALIZED (SELECT ` + syncOn + `),
k AS MATERIALIZED (SELECT name FROM ` + l + ` WHERE name = $1 FOR UPDATE),
ex AS (
  UPDATE ` + l + ` SET metadata = $3, changes = changes + 1
  WHERE name = $1 AND token = $2 AND expires_at > clock_timestamp() AND EXISTS (SELECT FROM k)
  RETURNING name, changes
),
sh AS (
  UPDATE ` + h + ` SET metadata = $3 WHERE name = $1 AND token = $2 AND expires_at > clock_timestamp() AND EXISTS (SELECT FROM k)
  RETURNING name
),
su AS (
  UPDATE ` + l + ` SET changes = changes + 1 WHERE name = $1 AND EXISTS (SELECT FROM sh)
  RETURNING name, changes
)
SELECT pg_notify($4, encode(r.name, 'hex') || '/' || r.changes || ' m ' || encode($2, 'hex') || ' ' || ` + recHex(`$3`) + `)
FROM c, (SELECT name, changes FROM ex UNION ALL SELECT name, changes FROM su) r`,

		// The key's holders as list reports them, its change counter
		// and the server's clock, in one snapshot.
		watchHolders: `WITH c AS MATERIALIZED (SELECT clock_timestamp() AS now),
hs AS (
  SELECT token, owner, fence, metadata, acquired_at, expires_at, -1 AS lim FROM ` + l + `, c WHERE name = $1 AND expires_at > c.now
  UNION ALL
  SELECT token, owner, fence, metadata, acquired_at, expires_at, lim FROM ` + h + `, c WHERE name = $1 AND expires_at > c.now
)
SELECT COALESCE((SELECT changes FROM ` + l + ` WHERE name = $1), 0), (extract(epoch FROM c.now) * 1000000)::bigint,
  hs.token, hs.owner, hs.fence, hs.metadata, hs.acquired_at, ` + rem(`hs.expires_at`) + `, hs.lim
FROM c LEFT JOIN hs ON true ORDER BY hs.fence`,

		listWaiters: `SELECT name, token, owner, metadata, lim, ` + rem("since") + `
FROM ` + w + `, (SELECT clock_timestamp() AS now) c
WHERE until > c.now AND substring(name FROM 1 FOR octet_length($1::bytea)) = $1::bytea
ORDER BY name, since, token`,

		// Rows of fence 0 were locked by a shared request and never granted.
		// The last grant was exclusive unless a shared or limited holder
		// ended after the row's lease (freed_at, shared_until), and a lease
		// ended by release has freed_at at its end (release, forceRelease).
		listKeys: `SELECT name, fence, token, owner, metadata, acquired_at,
  expires_at > c.now OR shared_until > c.now,
  GREATEST(freed_at, shared_until) <= expires_at,
  CASE WHEN GREATEST(freed_at, shared_until) <= expires_at THEN freed_at < expires_at ELSE shared_until > freed_at END,
  ` + rem("GREATEST(expires_at, shared_until, freed_at)") + `
FROM ` + l + `, (SELECT clock_timestamp() AS now) c
WHERE fence > 0 AND substring(name FROM 1 FOR octet_length($1::bytea)) = $1::bytea
ORDER BY name`,

		list: `SELECT name, token, owner, fence, metadata, acquired_at, ` + rem("expires_at") + `, -1
FROM ` + l + `, (SELECT clock_timestamp() AS now) c
WHERE expires_at > c.now AND substring(name FROM 1 FOR octet_length($1::bytea)) = $1::bytea
UNION ALL
SELECT name, token, owner, fence, metadata, acquired_at, ` + rem("expires_at") + `, lim
FROM ` + h + `, (SELECT clock_timestamp() AS now) c
WHERE expires_at > c.now AND substring(name FROM 1 FOR octet_length($1::bytea)) = $1::bytea
ORDER BY 1, 4`,
	}
}

// attempt is one run of the acquisition statement. since is the caller's
// place in the waiter queue (nil: now); register > 0 makes a refused waiter
// (re)join the queue for that long. It returns the Result, the caller's
// place and whether to look again at once (see attemptOutcome). An ended
// ctx is refused before any I/O; a ctx that ends during the statement
// returns an error matching errLeft (see detached).
func (b *Backend) attempt(ctx context.Context, req dlock.Request, since *time.Time, register time.Duration) (attemptOutcome, error) {
	grace := us(b.grace)
	if b.grace < 0 {
		register = 0
	}
	if err := ctxend.Err(ctx); err != nil {
		return attemptOutcome{}, err
	}
	var out attemptOutcome
	sent := time.Now()
	ran, err := b.detached(ctx, func(sctx context.Context, c *pgxpool.Conn) error {
		if req.Mode == dlock.ModeExclusive {
			return b.acquireExclusive(sctx, c, req, grace, since, register, &out)
		}
		return b.acquireShared(sctx, c, req, grace, since, register, &out)
	}, func(c *pgxpool.Conn, err error) {
		switch {
		case err == nil && out.place != nil: // nobody waits in this place
			b.leave(c, req)
		case err == nil && out.fence != nil: // nobody will use or renew this grant
			b.undo(c, req)
		case err != nil && sessionLost(err):
			b.resolveUntil(req, sent)
		}
	})
	if errors.Is(err, errLeft) {
		return attemptOutcome{}, err
	}
	if err != nil {
		if ran && sessionLost(err) {
			// The connection broke mid-statement: the statement may still
			// commit on the server after the Locker's own resolution.
			b.resolveUntil(req, sent)
		}
		return attemptOutcome{}, wrapErr(b.tb, "acquire", err)
	}
	if out.fence != nil {
		return attemptOutcome{res: dlock.Result{Acquired: true, Fence: uint64(*out.fence)}, short: out.short}, nil
	}
	if out.mismatch != "" {
		return attemptOutcome{}, fmt.Errorf("pglock: %q is held %s, asked %s: %w",
			req.Key, out.mismatch, dlock.DescribeMode(req.Mode, req.Limit), dlock.ErrModeMismatch)
	}
	return out, nil
}

// attemptOutcome is what an acquisition statement returned: the grant's
// fence, or the Result of a refusal, the caller's place in the queue and
// whether to look again at once, or the description of the holders whose
// mode the request mismatches.
type attemptOutcome struct {
	fence    *int64
	short    time.Duration // a grant with this much less than its TTL left when the statement was sent
	place    *time.Time
	res      dlock.Result
	mismatch string
	again    bool // refused, but the key may have been freed meanwhile: look again at once
}

// acquireExclusive runs the exclusive acquisition statement on c.
func (b *Backend) acquireExclusive(ctx context.Context, c *pgxpool.Conn, req dlock.Request, grace int64, since *time.Time, register time.Duration, out *attemptOutcome) error {
	if since == nil && register > 0 && b.refused.Lately(req.Key) {
		if joined, err := b.join(ctx, c, req, register, out); joined || err != nil {
			return err
		}
	}
	var h, s holderRow
	var lim *int32
	var marked bool
	var forwarded int64
	err := c.QueryRow(ctx, b.q.acquire, []byte(req.Key), req.Token[:], req.Owner, us(req.TTL), req.Metadata,
		grace, since, us(register), us(dlock.WriterMark), b.tb.channel, b.tb.watch).
		Scan(&out.fence, &out.place, &h.name, &h.token, &h.owner, &h.fence, &h.metadata, &h.acquiredAt, &h.remainingUs,
			&s.token, &s.owner, &s.fence, &s.metadata, &s.acquiredAt, &s.remainingUs, &lim, &marked, &forwarded, nil)
	if err != nil || out.fence != nil {
		return err
	}
	if h.remainingUs != nil && *h.remainingUs > 0 && bytes.Equal(h.token, req.Token[:]) && h.fence != nil {
		// A release granted the key to this wait's queue entry: the lease
		// has remainingUs left at the statement's start, no earlier than
		// its sending.
		out.fence = h.fence
		out.short = shortOf(req.TTL, *h.remainingUs)
		return nil
	}
	now := time.Now()
	switch {
	case h.remainingUs != nil && *h.remainingUs > 0 || lim == nil: // held exclusive (or free, and queued)
		info, rem := h.info(req.Key, now)
		out.res = dlock.Result{Holder: info, Remaining: rem}
		if rem > 0 {
			b.refused.Refused(req.Key, now)
		}
	case *lim > 0:
		out.mismatch = dlock.DescribeMode(dlock.ModeLimited, int(*lim))
	default: // held shared
		info, rem := s.info(req.Key, now)
		info.Mode = dlock.ModeShared
		out.res = dlock.Result{Holder: info, Remaining: rem}
		// The mark's update waited for the key's row and found it
		// changed: the last reader left while the statement ran, and its
		// release may have named another waiter.
		out.again = !marked
	}
	return nil
}

// join runs the join statement for an exclusive wait's first attempt
// (register > 0) on a key whose attempts were refused lately, so that it
// joins the queue behind the key's live exclusive holder with a statement
// much smaller than acquire. It reports whether it joined, with out set as
// acquire's refusal would set it; otherwise (the key is free, or held in
// another mode) the caller runs acquire.
func (b *Backend) join(ctx context.Context, c *pgxpool.Conn, req dlock.Request, register time.Duration, out *attemptOutcome) (bool, error) {
	var h holderRow
	h.name = []byte(req.Key)
	err := c.QueryRow(ctx, b.q.join, []byte(req.Key), req.Token[:], req.Owner, us(req.TTL), req.Metadata, us(register)).
		Scan(&out.place, &h.token, &h.owner, &h.fence, &h.metadata, &h.acquiredAt, &h.remainingUs)
	switch {
	case errors.Is(err, pgx.ErrNoRows):
		return false, nil
	case err != nil:
		return false, err
	case out.place == nil:
		return false, nil
	}
	info, rem := h.info(req.Key, time.Now())
	out.res = dlock.Result{Holder: info, Remaining: rem}
	return true, nil
}

// detached runs stmt on a connection of the pool, detached from ctx (bounded
// by statementBound), and waits for it until ctx ends; ran reports whether
// stmt was run (false: no connection could be had). If ctx ends first it
// returns an error matching errLeft and ctx.Err() at once, sends a cancel
// request for the statement, and once the statement has ended (cancelled or
// not) runs abandoned with its error on the same connection, in the
// background: a statement whose caller left is settled from its own
// outcome, never raced by a resolution on another connection.
func (b *Backend) detached(ctx context.Context, stmt func(ctx context.Context, c *pgxpool.Conn) error, abandoned func(c *pgxpool.Conn, err error)) (ran bool, err error) {
	c, err := b.pool.Acquire(ctx)
	if err != nil {
		if ctxend.Err(ctx) != nil {
			return false, dlock.Join(errLeft, context.Cause(ctx))
		}
		return false, err
	}
	var mu sync.Mutex
	var left, settled bool
	done := make(chan error, 1)
	cancelSent := make(chan struct{})
	b.stmts.Add(1)
	go func() {
		defer b.stmts.Done()
		defer c.Release()
		sctx, cancel := context.WithTimeout(context.Background(), statementBound)
		err := stmt(sctx, c)
		cancel()
		mu.Lock()
		settled = true
		gone := left
		mu.Unlock()
		if !gone {
			done <- err
			return
		}
		<-cancelSent
		abandoned(c, err)
	}()
	select {
	case err := <-done:
		return true, err
	case <-ctx.Done():
	}
	mu.Lock()
	if settled {
		mu.Unlock()
		return true, <-done
	}
	left = true
	mu.Unlock()
	b.stmts.Add(1)
	go func() {
		defer b.stmts.Done()
		cctx, cancel := context.WithTimeout(context.Background(), cancelTimeout)
		_ = c.Conn().PgConn().CancelRequest(cctx)
		cancel()
		close(cancelSent)
	}()
	return true, dlock.Join(errLeft, context.Cause(ctx))
}

// undo releases a lease that an abandoned acquisition took, on the
// connection that took it.
func (b *Backend) undo(c *pgxpool.Conn, req dlock.Request) {
	// Not bounded by Close, which waits for it.
	ctx, cancel := context.WithTimeout(context.Background(), cleanupTimeout)
	defer cancel()
	for try := 0; try < 3; try++ { // a late cancel request may hit it
		err := b.release(ctx, c, req.Key, req.Token)
		if err == nil || errors.Is(err, dlock.ErrNotHeld) || !cancelled(err) {
			if err != nil && !errors.Is(err, dlock.ErrNotHeld) {
				b.log.Warn("pglock: could not release a lease whose acquisition was abandoned; it expires with its TTL",
					"key", req.Key, "ttl", req.TTL, "err", err)
			}
			return
		}
	}
}

// leave takes out of the key's waiter queue the place that an abandoned
// acquisition joined, on the connection that joined it, then releases the
// key if a release granted it to that place meanwhile: a live entry of a
// waiter that left would be granted the key, which would stay held until
// its lease ran out. The delete comes first: a release that locked the
// place before it has granted the key when the delete returns, and one
// that comes after finds no place.
func (b *Backend) leave(c *pgxpool.Conn, req dlock.Request) {
	ctx, cancel := context.WithTimeout(context.Background(), cleanupTimeout)
	defer cancel()
	for try := 0; try < 3; try++ { // a late cancel request may hit it
		_, err := c.Exec(ctx, b.q.unregister, []byte(req.Key), req.Token[:])
		if cancelled(err) {
			continue
		}
		if err == nil {
			b.undo(c, req)
		}
		return
	}
}

// resolveUntil releases, in the background, the lease that an acquisition
// whose connection broke mid-statement may take, until that lease would
// have ended anyway: the statement may still be running on the server, and
// commit after any single resolution.
func (b *Backend) resolveUntil(req dlock.Request, sent time.Time) {
	b.wg.Add(1)
	go func() {
		defer b.wg.Done()
		until := sent.Add(req.TTL + time.Second)
		t := time.NewTimer(0)
		defer t.Stop()
		for time.Now().Before(until) {
			select {
			case <-t.C:
			case <-b.bg.Done():
				return
			}
			ctx, cancel := context.WithTimeout(b.bg, cleanupTimeout)
			err := b.release(ctx, b.pool, req.Key, req.Token)
			cancel()
			if err == nil {
				b.log.Warn("pglock: released a lease taken by an acquisition whose connection broke", "key", req.Key)
				return
			}
			t.Reset(resolveEvery)
		}
	}()
}

// Bounds of the resolution of abandoned acquisitions.
const (
	cleanupTimeout = 5 * time.Second
	resolveEvery   = time.Second
)

// Acquire implements dlock.Backend with one statement. A ctx that ends
// while it runs returns its error at once; the statement is cancelled, and a
// lease it took all the same is released.
func (b *Backend) Acquire(ctx context.Context, req dlock.Request) (dlock.Result, error) {
	if err := dlock.ValidateMode(req); err != nil {
		return dlock.Result{}, err
	}
	if err := b.claims.Check(ctx, req.Key); err != nil {
		return dlock.Result{}, wrapErr(b.tb, "acquire", err)
	}
	out, err := b.attempt(ctx, req, nil, 0)
	if errors.Is(err, errLeft) {
		return dlock.Result{}, ctx.Err()
	}
	out.res.SentAfter = -out.short
	return out.res, err
}

// Waiting bounds (see AcquireWait).
const (
	waitStep  = 5 * time.Second  // a waiter looks at least this often
	waitSlack = time.Second      // its queue entry outlives the look by this much
	maxWait   = 30 * time.Second // one AcquireWait call; the Locker calls again
	maxLooks  = 10000            // bounds AcquireWait's loop in any case
	// markStep: an exclusive waiter behind shared holders looks this often,
	// renewing its writer mark well within dlock.WriterMark.
	markStep = dlock.WriterMark / 3
)

// AcquireWait implements dlock.Waiter. It listens for the key's release on
// the Backend's shared LISTEN connection, joins the key's waiter queue
// (where an exclusive release may grant it the key: see newLeaseQueries),
// and tries again on each release, when the holder's lease runs out, and at
// least every few seconds (every second for an exclusive waiter behind
// shared holders, which renews its writer mark; at once when that mark
// found the last of them gone), for up to 30 s; in every mode, since a
// release of any holder notifies. If the LISTEN connection
// cannot be had it returns dlock.ErrUnsupported, having taken nothing.
func (b *Backend) AcquireWait(ctx context.Context, req dlock.Request) (dlock.Result, error) {
	if err := dlock.ValidateMode(req); err != nil {
		return dlock.Result{}, err
	}
	if err := b.claims.Check(ctx, req.Key); err != nil {
		if ctx.Err() != nil {
			return dlock.Result{}, nil
		}
		return dlock.Result{}, wrapErr(b.tb, "acquire", err)
	}
	began := time.Now()
	if !b.ln.running() && !b.refused.Lately(req.Key) {
		// No wait of this Backend listens: try first, so that a free key
		// costs no LISTEN connection (see WaitsDirectly), unless the key
		// was found held lately.
		out, err := b.attempt(ctx, req, nil, 0)
		switch {
		case errors.Is(err, errLeft) || err != nil && ctxend.Err(ctx) != nil:
			return dlock.Result{}, nil
		case err != nil || out.res.Acquired:
			out.res.SentAfter = -out.short
			return out.res, err
		}
	}
	wake, handed, unsubscribe := b.ln.subscribe(req.Key, req.Token, max(b.grace, 0))
	defer unsubscribe()
	var since *time.Time
	defer func() {
		if since != nil {
			// Still queued: leave the queue, and release what a release
			// granted to the place since the last statement (see leave).
			cctx, cancel := context.WithTimeout(context.WithoutCancel(ctx), cleanupTimeout)
			c, err := b.pool.Acquire(cctx)
			cancel()
			if err == nil {
				b.leave(c, req)
				c.Release()
			}
		}
	}()
	// confirm takes a grant a release said it made to this wait: a read
	// confirms it, timed from its sending. done reports a Result to return.
	confirm := func() (res dlock.Result, done bool, err error) {
		if since == nil || !handed() {
			return dlock.Result{}, false, nil
		}
		sending := time.Now()
		fence, short, ok, err := b.confirmHandoff(ctx, req)
		switch {
		case ctx.Err() != nil:
			return dlock.Result{}, true, nil
		case err != nil:
			return dlock.Result{}, true, wrapErr(b.tb, "acquire", err)
		case !ok:
			return dlock.Result{}, false, nil
		}
		since = nil // the release took the entry out of the queue
		res, err = b.handedLease(ctx, req, dlock.Result{Acquired: true, Fence: fence}, began, sending, short)
		return res, true, err
	}
	end := began.Add(maxWait)
	var res dlock.Result
	for range maxLooks {
		if r, done, err := confirm(); done {
			return r, err
		}
		if err := b.ln.ensure(ctx); err != nil {
			if ctx.Err() != nil {
				return dlock.Result{Holder: res.Holder}, nil
			}
			return dlock.Result{}, dlock.ErrUnsupported
		}
		sending := time.Now()
		out, err := b.attempt(ctx, req, since, waitStep+waitSlack)
		if errors.Is(err, errLeft) || err != nil && ctxend.Err(ctx) != nil {
			return dlock.Result{}, nil
		}
		if err != nil {
			return dlock.Result{}, err
		}
		res = out.res
		if res.Acquired {
			since = nil // the statement left the queue (or a release took it out)
			// The lease starts with this statement, not with the wait (a
			// lease a release granted started out.short earlier).
			return b.handedLease(ctx, req, res, began, sending, out.short)
		}
		if out.place != nil {
			since = out.place
		}
		if out.again {
			continue
		}
		d := waitStep
		if req.Mode == dlock.ModeExclusive && res.Holder.Mode == dlock.ModeShared {
			d = markStep // each attempt renews the writer mark
		}
		switch {
		case res.Remaining > 0:
			d = min(d, res.Remaining+time.Millisecond)
		case b.grace > 0: // free, but someone is ahead in the queue
			d = b.grace + time.Millisecond
		default:
			d = 10 * time.Millisecond
		}
		d = min(d, time.Until(end))
		if d <= 0 {
			break
		}
		t := time.NewTimer(d)
		select {
		case <-wake:
		case <-t.C:
		case <-ctx.Done():
		}
		t.Stop()
		if ctx.Err() != nil || !time.Now().Before(end) {
			break
		}
	}
	if ctx.Err() == nil { // the call's bound: take a grant that came meanwhile
		if r, done, err := confirm(); done {
			return r, err
		}
	}
	return dlock.Result{Holder: res.Holder, Remaining: res.Remaining}, nil
}

// handedLease returns the Result of a grant found by a statement sent at
// sending, whose lease had short less than req.TTL left then (0: a grant
// the statement made). A lease a release handed over that this wait found
// late (after a fifth of the holder's part of the TTL: no notification
// came, or the statement waited for a connection) is renewed first, so
// that the Locker does not get a lease mostly gone, or one already past
// its safe deadline, which it would release. A renewal that finds the
// lease gone returns a Result that is not Acquired (the Locker waits again).
func (b *Backend) handedLease(ctx context.Context, req dlock.Request, res dlock.Result, began, sending time.Time, short time.Duration) (dlock.Result, error) {
	res.SentAfter = sending.Sub(began) - short
	if short <= (req.TTL-req.LockDelay)/5 {
		return res, nil
	}
	sending = time.Now()
	errs, err := b.Extend(ctx, []dlock.Lease{{Key: req.Key, Token: req.Token, TTL: req.TTL}})
	switch {
	case err != nil:
		return dlock.Result{}, err
	case errs[0] != nil:
		return dlock.Result{}, nil
	}
	res.SentAfter = sending.Sub(began)
	return res, nil
}

// confirmHandoff reads whether req's token holds the key's exclusive
// lease, with its fence and how much less than req.TTL it has left at the
// statement's start (no earlier than its sending).
func (b *Backend) confirmHandoff(ctx context.Context, req dlock.Request) (fence uint64, short time.Duration, ok bool, err error) {
	var f, remUs int64
	err = b.pool.QueryRow(ctx, b.q.handed, []byte(req.Key), req.Token[:]).Scan(&f, &remUs)
	if errors.Is(err, pgx.ErrNoRows) {
		return 0, 0, false, nil
	}
	if err != nil {
		return 0, 0, false, err
	}
	return uint64(f), shortOf(req.TTL, remUs), true, nil
}

// shortOf is how much less than ttl a lease with remainingUs left has.
func shortOf(ttl time.Duration, remainingUs int64) time.Duration {
	return max(ttl-time.Duration(remainingUs)*time.Microsecond, 0)
}

// WaitsDirectly implements dlock.DirectWaiter: a blocking acquisition
// calls AcquireWait at once. AcquireWait tries first (one statement, no
// LISTEN connection) when no wait of this Backend listens, and otherwise
// joins the key's queue with its first statement, so that a contended
// acquisition costs one statement before its wait.
func (b *Backend) WaitsDirectly() bool { return true }

// Extend implements dlock.Backend in one round trip for all leases: one
// statement renews them, after one that locks the rows of their keys that
// have shared or limited holders.
func (b *Backend) Extend(ctx context.Context, leases []dlock.Lease) ([]error, error) {
	errs := make([]error, len(leases))
	if len(leases) == 0 {
		return errs, nil
	}
	names := make([][]byte, len(leases))
	tokens := make([][]byte, len(leases))
	ttls := make([]int64, len(leases))
	for i, l := range leases {
		names[i] = []byte(l.Key)
		tokens[i] = l.Token[:]
		ttls[i] = us(l.TTL)
	}
	type lease struct {
		key   string
		token dlock.Token
	}
	extended := make(map[lease]bool, len(leases))
	err := pipeline(ctx, b.pool, b.q.lockMany, []any{names}, b.q.extend, []any{names, tokens, ttls}, func(rows pgx.Rows) error {
		var name, token []byte
		if err := rows.Scan(&name, &token); err != nil {
			return err
		}
		var l lease
		l.key = string(name)
		copy(l.token[:], token)
		extended[l] = true
		return nil
	})
	if err != nil {
		return nil, wrapErr(b.tb, "extend", err)
	}
	for i, l := range leases {
		if !extended[lease{l.Key, l.Token}] {
			errs[i] = dlock.ErrNotHeld
		}
	}
	return errs, nil
}

// Release implements dlock.Backend, for a holder of any mode. The same
// statement notifies the key's waiters.
func (b *Backend) Release(ctx context.Context, key string, token dlock.Token) error {
	return b.release(ctx, b.pool, key, token)
}

// release runs Release's statements on c.
func (b *Backend) release(ctx context.Context, c batcher, key string, token dlock.Token) error {
	return b.free(ctx, c, "release", b.q.release, []byte(key), token[:], b.tb.channel)
}

// ForceRelease implements dlock.ForceReleaser: it ends the leases of every
// holder of key, whatever their tokens and modes, and wakes the waiters.
// The holders learn of it at their next renewal; the next holder gets a
// larger fence.
func (b *Backend) ForceRelease(ctx context.Context, key string) error {
	if err := b.claims.CheckOnly(ctx, key); err != nil {
		return wrapErr(b.tb, "force release", err)
	}
	return b.free(ctx, b.pool, "force release", b.q.forceRelease, []byte(key), b.tb.channel)
}

// free runs a releasing statement after lockShared, which returns a row if
// it freed the key. args[0] is the key.
func (b *Backend) free(ctx context.Context, c batcher, op, q string, args ...any) error {
	n := 0
	err := pipeline(ctx, c, b.q.lockShared, args[:1], q, args, func(pgx.Rows) error { n++; return nil })
	if err != nil {
		return wrapErr(b.tb, op, err)
	}
	if n == 0 {
		return dlock.ErrNotHeld
	}
	return nil
}

// batcher is what runs a pipeline: a pool, or one of its connections.
type batcher interface {
	SendBatch(ctx context.Context, b *pgx.Batch) pgx.BatchResults
}

// pipeline runs lock, then q, in one implicit transaction sent in one round
// trip, and calls each for every row of q.
func pipeline(ctx context.Context, c batcher, lock string, lockArgs []any, q string, args []any, each func(pgx.Rows) error) error {
	var batch pgx.Batch
	batch.Queue(lock, lockArgs...)
	batch.Queue(q, args...)
	br := c.SendBatch(ctx, &batch)
	_, err := br.Exec()
	if err == nil {
		var rows pgx.Rows
		rows, err = br.Query()
		for err == nil && rows.Next() {
			err = each(rows)
		}
		if rows != nil {
			rows.Close()
			if err == nil {
				err = rows.Err()
			}
		}
	}
	if cerr := br.Close(); err == nil {
		err = cerr
	}
	return err
}

// Watch implements dlock.Watcher on the Backend's LISTEN connection (the
// one its waiters share, outside the pool): every grant, release, forced
// release and metadata change sends a NOTIFY in its own transaction. A
// lease that runs out is not reported: no statement sees it end (the next
// grant of the key is). The channel is closed when ctx ends or the
// connection breaks; Watch returns once the connection LISTENs, and an
// error if it cannot (dlock.ErrClosed after Close).
func (b *Backend) Watch(ctx context.Context, key string) (<-chan struct{}, error) {
	ch, err := b.ln.watchKey(ctx, key)
	if err != nil && !errors.Is(err, dlock.ErrClosed) && ctxend.Err(ctx) == nil {
		return nil, wrapErr(b.tb, "watch", err)
	}
	return ch, err
}

// WatchHolders implements dlock.HolderWatcher on the Backend's LISTEN
// connection: it LISTENs, then reads key's holders and change counter in
// one statement, then applies each later change that the notifications
// carry (a grant of any mode, a release, a metadata change, a forced
// release), in the order the server commits them. A lease that runs out is
// not a change: the holders carry their ExpiresAt, as of their grant (a
// renewal is not reported either: a holder whose ExpiresAt has passed may
// have renewed; List tells), and a grant drops those it finds expired. The
// channel is closed when ctx ends, when the connection breaks, after Close,
// when a change was missed (its counter skips, or it came from a client of
// an earlier version) or could not be told (its record would not fit in a
// NOTIFY), and when the reader falls more than 1024 changes behind.
func (b *Backend) WatchHolders(ctx context.Context, key string) ([]dlock.LockInfo, <-chan []dlock.LockInfo, error) {
	return watchHolders(ctx, b.ln, b.pool, b.q.watchHolders, b.tb, "watch", key)
}

// SetMetadata implements dlock.MetadataSetter for a holder of any mode, in
// one statement that also notifies the key's watches.
func (b *Backend) SetMetadata(ctx context.Context, key string, token dlock.Token, metadata string) error {
	rows, err := b.pool.Query(ctx, b.q.setMetadata, []byte(key), token[:], metadata, b.tb.watch)
	if err != nil {
		return wrapErr(b.tb, "set metadata", err)
	}
	n := 0
	for rows.Next() {
		n++
	}
	rows.Close()
	if err := rows.Err(); err != nil {
		return wrapErr(b.tb, "set metadata", err)
	}
	if n == 0 {
		return dlock.ErrNotHeld
	}
	return nil
}

// List implements dlock.Lister: every holder, of every mode, ordered by key
// then fence.
func (b *Backend) List(ctx context.Context, prefix string) ([]dlock.LockInfo, error) {
	rows, err := b.pool.Query(ctx, b.q.list, []byte(prefix))
	if err != nil {
		return nil, wrapErr(b.tb, "list", err)
	}
	defer rows.Close()
	now := time.Now()
	var out []dlock.LockInfo
	for rows.Next() {
		var h holderRow
		var lim int32
		if err := rows.Scan(&h.name, &h.token, &h.owner, &h.fence, &h.metadata, &h.acquiredAt, &h.remainingUs, &lim); err != nil {
			return nil, wrapErr(b.tb, "list", err)
		}
		info, _ := h.info("", now)
		info.Mode, info.Limit = modeOf(lim)
		out = append(out, info)
	}
	if err := rows.Err(); err != nil {
		return nil, wrapErr(b.tb, "list", err)
	}
	return out, nil
}
