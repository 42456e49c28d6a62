package pglock

import (
	"context"
	"errors"
	"fmt"
	"log/slog"
	"sync"
	"time"

	"github.com/dlock-dev/dlock"
	"github.com/dlock-dev/dlock/internal/claims"
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

	bg    context.Context // ended by Close: stops the resolutions under way
	stop  context.CancelFunc
	stmts sync.WaitGroup // acquisition statements and the undoing of abandoned grants
	wg    sync.WaitGroup // resolutions of broken connections
}

var (
	_ dlock.Backend       = (*Backend)(nil)
	_ dlock.Waiter        = (*Backend)(nil)
	_ dlock.Lister        = (*Backend)(nil)
	_ dlock.ForceReleaser = (*Backend)(nil)
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
	return &Backend{claims: newClaims(pool, tb, "lease"), pool: pool, tb: tb, grace: grace, log: logger(o), ln: newListener(pool, tb.channel), q: newLeaseQueries(tb),
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
	acquire, unregister, extend, release, forceRelease, list string
}

// newLeaseQueries builds the lease statements for tb. Every statement is one
// autocommit statement whose times all come from one clock_timestamp() of
// the server (now() would be the start of the transaction, the same here,
// but clock_timestamp() does not depend on how the statement is wrapped).
//
// Every statement that writes commits durably whatever the server's, the
// database's or the role's default (set_config of synchronous_commit, local
// to the statement's transaction): a grant or an extension that a crash
// forgets would let the key be granted again, with a fence already handed
// out, while its holder still trusts it (a forgotten release would only
// leave the key held until the lease's end).
//
// The acquisition takes the row if its lease is over and, during the grace
// period after it ended, only if no live waiter queued ahead of this one
// ($7: the caller's place in the queue, NULL for "now"). It only tries to
// write when the statement's snapshot shows it may take the row, so that a
// refusal is read-only (no row lock, no commit to flush: waiters that look
// cost little); the ON CONFLICT clause checks the expiry again on the locked,
// latest version of the row, so a concurrent grant is never overridden. A
// waiter that did not get the row joins the queue or refreshes its entry
// when half of it has run ($8 > 0) in the same statement; one that got it
// leaves the queue. The final SELECT reads the holder from the statement's
// snapshot, for the Result when the row was not taken.
//
// The renewal's new expiry counts from its statement's start (no earlier
// than the client sent it), but whether the lease is still live is checked
// with clock_timestamp() at the row: a renewal that waited for the row while
// a release ended the lease would otherwise compare the release's later
// instant with its own start, find the lease live and revive it (found by
// the fault harness; TestExtendRacingReleaseDoesNotRevive).
//
// The release's NOTIFY names the key and the first live waiter in its queue,
// which the listener wakes at once; the key's other waiters are woken after
// the grace period, in case that waiter is gone.
func newLeaseQueries(tb tables) leaseQueries {
	l, w := tb.lease, tb.waiters
	return leaseQueries{
		acquire: `WITH c AS MATERIALIZED (SELECT clock_timestamp() AS now, set_config('synchronous_commit', 'on', true) AS sc),
acq AS (
  INSERT INTO ` + l + ` AS l (name, token, owner, fence, acquired_at, expires_at, metadata)
  SELECT $1, $2, $3, 1, c.now, c.now + $4::bigint * interval '1 microsecond', $5 FROM c
  WHERE NOT EXISTS (SELECT FROM ` + l + ` h WHERE h.name = $1 AND h.expires_at > c.now)
    AND ($6::bigint < 0
      OR NOT EXISTS (SELECT FROM ` + l + ` h WHERE h.name = $1 AND h.expires_at > c.now - $6::bigint * interval '1 microsecond')
      OR NOT EXISTS (SELECT FROM ` + w + ` q WHERE q.name = $1 AND q.until > c.now
        AND (q.since, q.token) < (COALESCE($7::timestamptz, c.now), $2)))
  ON CONFLICT (name) DO UPDATE
  SET token = EXCLUDED.token, owner = EXCLUDED.owner, fence = l.fence + 1,
      acquired_at = EXCLUDED.acquired_at, expires_at = EXCLUDED.expires_at, metadata = EXCLUDED.metadata
  WHERE l.expires_at <= EXCLUDED.acquired_at
  RETURNING l.fence
),
reg AS (
  INSERT INTO ` + w + ` AS q (name, token, since, until)
  SELECT $1, $2, c.now, c.now + $8::bigint * interval '1 microsecond' FROM c
  WHERE $8::bigint > 0 AND NOT EXISTS (SELECT FROM acq)
    AND NOT EXISTS (SELECT FROM ` + w + ` q WHERE q.name = $1 AND q.token = $2
      AND q.until > c.now + $8::bigint * interval '1 microsecond' / 2)
  ON CONFLICT (name, token) DO UPDATE SET until = EXCLUDED.until
  RETURNING q.since
),
del AS (
  DELETE FROM ` + w + ` q WHERE q.name = $1
    AND (q.token = $2 AND EXISTS (SELECT FROM acq)
      OR q.token <> $2 AND q.until < (SELECT now FROM c) - interval '1 minute')
)
SELECT (SELECT fence FROM acq), (SELECT since FROM reg),
  h.name, h.token, h.owner, h.fence, h.metadata, h.acquired_at,
  (extract(epoch FROM h.expires_at - c.now) * 1000000)::bigint
FROM c LEFT JOIN ` + l + ` h ON h.name = $1`,
		unregister: `DELETE FROM ` + w + ` WHERE name = $1 AND token = $2`,
		extend: `WITH c AS MATERIALIZED (SELECT clock_timestamp() AS now, set_config('synchronous_commit', 'on', true) AS sc)
UPDATE ` + l + ` AS l SET expires_at = c.now + x.ttl * interval '1 microsecond'
FROM c, unnest($1::bytea[], $2::bytea[], $3::bigint[]) AS x(name, token, ttl)
WHERE l.name = x.name AND l.token = x.token AND l.expires_at > clock_timestamp()
RETURNING l.name, l.token`,
		release: `WITH r AS (
  UPDATE ` + l + ` SET expires_at = clock_timestamp()
  WHERE name = $1 AND token = $2 AND expires_at > clock_timestamp() AND set_config('synchronous_commit', 'on', true) IS NOT NULL
  RETURNING name
)
SELECT pg_notify($3, encode(r.name, 'hex') || COALESCE(' ' || (SELECT encode(q.token, 'hex') FROM ` + w + ` q
  WHERE q.name = r.name AND q.until > clock_timestamp() ORDER BY q.since, q.token LIMIT 1), '')) FROM r`,
		forceRelease: `WITH r AS (
  UPDATE ` + l + ` SET expires_at = clock_timestamp()
  WHERE name = $1 AND expires_at > clock_timestamp() AND set_config('synchronous_commit', 'on', true) IS NOT NULL
  RETURNING name
)
SELECT pg_notify($2, encode(r.name, 'hex')) FROM r`,
		list: `SELECT name, token, owner, fence, metadata, acquired_at,
  (extract(epoch FROM expires_at - c.now) * 1000000)::bigint
FROM ` + l + `, (SELECT clock_timestamp() AS now) c
WHERE expires_at > c.now AND substring(name FROM 1 FOR octet_length($1::bytea)) = $1::bytea
ORDER BY name`,
	}
}

// attempt is one run of the acquisition statement. since is the caller's
// place in the waiter queue (nil: now); register > 0 makes a refused waiter
// (re)join the queue for that long. It returns the caller's place. An ended
// ctx is refused before any I/O; a ctx that ends during the statement
// returns an error matching errLeft (see detached).
func (b *Backend) attempt(ctx context.Context, req dlock.Request, since *time.Time, register time.Duration) (dlock.Result, *time.Time, error) {
	grace := us(b.grace)
	if b.grace < 0 {
		register = 0
	}
	if err := ended(ctx); err != nil {
		return dlock.Result{}, nil, err
	}
	var fence *int64
	var place *time.Time
	var h holderRow
	sent := time.Now()
	ran, err := b.detached(ctx, func(sctx context.Context, c *pgxpool.Conn) error {
		return c.QueryRow(sctx, b.q.acquire, []byte(req.Key), req.Token[:], req.Owner, us(req.TTL), req.Metadata,
			grace, since, us(register)).
			Scan(&fence, &place, &h.name, &h.token, &h.owner, &h.fence, &h.metadata, &h.acquiredAt, &h.remainingUs)
	}, func(c *pgxpool.Conn, err error) {
		switch {
		case err == nil && fence != nil: // nobody will use or renew this grant
			b.undo(c, req)
		case err == nil && place != nil: // nobody waits in this place
			b.leave(c, req)
		case err != nil && sessionLost(err):
			b.resolveUntil(req, sent)
		}
	})
	if errors.Is(err, errLeft) {
		return dlock.Result{}, nil, err
	}
	if err != nil {
		if ran && sessionLost(err) {
			// The connection broke mid-statement: the statement may still
			// commit on the server after the Locker's own resolution.
			b.resolveUntil(req, sent)
		}
		return dlock.Result{}, nil, wrapErr(b.tb, "acquire", err)
	}
	if fence != nil {
		return dlock.Result{Acquired: true, Fence: uint64(*fence)}, nil, nil
	}
	info, rem := h.info(req.Key, time.Now())
	return dlock.Result{Holder: info, Remaining: rem}, place, nil
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
		if ended(ctx) != nil {
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
		_, err := c.Exec(ctx, b.q.release, []byte(req.Key), req.Token[:], b.tb.channel)
		if err == nil || !cancelled(err) {
			if err != nil {
				b.log.Warn("pglock: could not release a lease whose acquisition was abandoned; it expires with its TTL",
					"key", req.Key, "ttl", req.TTL, "err", err)
			}
			return
		}
	}
}

// leave takes out of the key's waiter queue the place that an abandoned
// acquisition joined, on the connection that joined it: a live entry of a
// waiter that left would be named by every release, and the waiters behind
// it would wait out the grace period each time, until the entry runs out.
func (b *Backend) leave(c *pgxpool.Conn, req dlock.Request) {
	ctx, cancel := context.WithTimeout(context.Background(), cleanupTimeout)
	defer cancel()
	for try := 0; try < 3; try++ { // a late cancel request may hit it
		if _, err := c.Exec(ctx, b.q.unregister, []byte(req.Key), req.Token[:]); !cancelled(err) {
			return
		}
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
			err := b.free(ctx, "release", b.q.release, []byte(req.Key), req.Token[:], b.tb.channel)
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
	if err := b.claims.Check(ctx, req.Key); err != nil {
		return dlock.Result{}, wrapErr(b.tb, "acquire", err)
	}
	res, _, err := b.attempt(ctx, req, nil, 0)
	if errors.Is(err, errLeft) {
		return dlock.Result{}, ctx.Err()
	}
	return res, err
}

// Waiting bounds (see AcquireWait).
const (
	waitStep  = 5 * time.Second  // a waiter looks at least this often
	waitSlack = time.Second      // its queue entry outlives the look by this much
	maxWait   = 30 * time.Second // one AcquireWait call; the Locker calls again
	maxLooks  = 10000            // bounds AcquireWait's loop in any case
)

// AcquireWait implements dlock.Waiter. It listens for the key's release on
// the Backend's shared LISTEN connection, joins the key's waiter queue, and
// tries again on each release, when the holder's lease runs out, and at
// least every few seconds, for up to 30 s. If the LISTEN connection cannot
// be had it returns dlock.ErrUnsupported, having taken nothing.
func (b *Backend) AcquireWait(ctx context.Context, req dlock.Request) (dlock.Result, error) {
	if err := b.claims.Check(ctx, req.Key); err != nil {
		if ctx.Err() != nil {
			return dlock.Result{}, nil
		}
		return dlock.Result{}, wrapErr(b.tb, "acquire", err)
	}
	wake, unsubscribe := b.ln.subscribe(req.Key, req.Token, max(b.grace, 0))
	defer unsubscribe()
	var since *time.Time
	defer func() {
		if since != nil { // still queued: leave the queue
			cctx, cancel := context.WithTimeout(context.WithoutCancel(ctx), 5*time.Second)
			_, _ = b.pool.Exec(cctx, b.q.unregister, []byte(req.Key), req.Token[:])
			cancel()
		}
	}()
	began := time.Now()
	end := began.Add(maxWait)
	var res dlock.Result
	for range maxLooks {
		if err := b.ln.ensure(ctx); err != nil {
			if ctx.Err() != nil {
				return dlock.Result{Holder: res.Holder}, nil
			}
			return dlock.Result{}, dlock.ErrUnsupported
		}
		var place *time.Time
		var err error
		sending := time.Now()
		res, place, err = b.attempt(ctx, req, since, waitStep+waitSlack)
		if errors.Is(err, errLeft) {
			return dlock.Result{}, nil
		}
		if err != nil {
			return res, err
		}
		if res.Acquired {
			since = nil // the statement left the queue
			// The lease starts with this statement, not with the wait.
			res.SentAfter = sending.Sub(began)
			return res, nil
		}
		if place != nil {
			since = place
		}
		d := waitStep
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
	return dlock.Result{Holder: res.Holder, Remaining: res.Remaining}, nil
}

// Extend implements dlock.Backend with one statement for all leases.
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
	rows, err := b.pool.Query(ctx, b.q.extend, names, tokens, ttls)
	if err != nil {
		return nil, wrapErr(b.tb, "extend", err)
	}
	type lease struct {
		key   string
		token dlock.Token
	}
	extended := make(map[lease]bool, len(leases))
	for rows.Next() {
		var name, token []byte
		if err := rows.Scan(&name, &token); err != nil {
			rows.Close()
			return nil, wrapErr(b.tb, "extend", err)
		}
		var l lease
		l.key = string(name)
		copy(l.token[:], token)
		extended[l] = true
	}
	if err := rows.Err(); err != nil {
		return nil, wrapErr(b.tb, "extend", err)
	}
	for i, l := range leases {
		if !extended[lease{l.Key, l.Token}] {
			errs[i] = dlock.ErrNotHeld
		}
	}
	return errs, nil
}

// Release implements dlock.Backend. The same statement notifies the key's
// waiters.
func (b *Backend) Release(ctx context.Context, key string, token dlock.Token) error {
	return b.free(ctx, "release", b.q.release, []byte(key), token[:], b.tb.channel)
}

// ForceRelease implements dlock.ForceReleaser: it ends the lease whatever
// token holds it, and wakes the waiters. The holder learns of it at its next
// renewal; the next holder gets a larger fence.
func (b *Backend) ForceRelease(ctx context.Context, key string) error {
	if err := b.claims.CheckOnly(ctx, key); err != nil {
		return wrapErr(b.tb, "force release", err)
	}
	return b.free(ctx, "force release", b.q.forceRelease, []byte(key), b.tb.channel)
}

// free runs a releasing statement, which returns a row if it freed the key.
func (b *Backend) free(ctx context.Context, op, q string, args ...any) error {
	rows, err := b.pool.Query(ctx, q, args...)
	if err != nil {
		return wrapErr(b.tb, op, err)
	}
	n := 0
	for rows.Next() {
		n++
	}
	if err := rows.Err(); err != nil {
		return wrapErr(b.tb, op, err)
	}
	if n == 0 {
		return dlock.ErrNotHeld
	}
	return nil
}

// List implements dlock.Lister.
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
		if err := rows.Scan(&h.name, &h.token, &h.owner, &h.fence, &h.metadata, &h.acquiredAt, &h.remainingUs); err != nil {
			return nil, wrapErr(b.tb, "list", err)
		}
		info, _ := h.info("", now)
		out = append(out, info)
	}
	if err := rows.Err(); err != nil {
		return nil, wrapErr(b.tb, "list", err)
	}
	return out, nil
}
