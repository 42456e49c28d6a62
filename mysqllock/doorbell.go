package mysqllock

import (
	"context"
	"database/sql"
	"errors"
	"fmt"
	"sync/atomic"
	"time"

	"github.com/dlock-dev/dlock"
	"github.com/go-sql-driver/mysql"
)

// The lease strategy's doorbells: a lease holder also holds a named lock per
// key on a pinned session, which waiters block on in the server (FIFO). The
// holder rings it by releasing it after the lease, or by dying; the woken
// waiter, first in line, takes the lease while holding the doorbell, so the
// doorbell passes with the lease. The acquisition statement refuses a free
// lease to anyone but the first in line for a short while (staleBell).
//
// Doorbell names, like all named locks, are server-wide: leases of one key in
// two databases (or tables) of a server share a doorbell. That costs wake-ups
// (a waiter may sleep until its recheck) and up to staleBell of delay, never
// exclusion, which the lease rows alone decide.
//
// A doorbell is not the lock: when its session ends (KILL, a cut
// connection), the server frees it and its waiters wake early, find the
// lease still held and back off. A lost doorbell is therefore never
// reported as a lost lease.

// staleBell is how long after a lease's end a doorbell held by someone else
// still stops others from taking the lease: the waiter first in line takes
// it within a round trip, so a doorbell held longer is stale.
const staleBell = 100 * time.Millisecond

// recheck bounds one wait on a doorbell: a waiter behind the first in line
// looks at the lease again at least this often. The first in line, woken by
// the release, may stall before it takes the lease (a GC pause, a partition);
// its doorbell then turns stale staleBell after the lease's end, but nothing
// rings for the waiters queued behind it, who would otherwise sleep until
// the released lease's old expiry (up to a TTL). The fault harness measured
// that tail (finding 7). A re-check costs two statements per waiter per
// TTL/4 (the lease, then the doorbell again, on the same session), and puts
// the waiter back at the end of the doorbell's queue.
func recheck(ttl time.Duration) time.Duration { return max(ttl/4, 2*staleBell) }

// bellPoll bounds the sleep of a waiter that holds a key's doorbell while the
// lease is held: its holder then has no doorbell (it took the lease while
// another session held the bell, or the bell's session ended), so its
// release rings nobody. A release of a lease granted with its bell keeps
// the lease for the doorbell's holder for staleBell (see Release): looking
// twice as often takes it within that window; after one granted without,
// looking often is the waiter's only chance against the releasing client.
const bellPoll = staleBell / 2

// bells reports whether doorbells are in use.
func (b *Backend) bells() bool { return b.bell != nil && !b.noBell.Load() }

// checkPool refuses every call while db's pool limit is below what
// doorbells need (it was lowered after New): their sessions would take the
// connections that the lease statements need, and those would wait.
func (b *Backend) checkPool() error {
	if !b.bells() {
		return nil
	}
	return b.bell.s.checkPool()
}

// Acquire implements dlock.Backend: one attempt at the lease, then its
// doorbell (exclusive acquisitions only).
func (b *Backend) Acquire(ctx context.Context, req dlock.Request) (dlock.Result, error) {
	if err := dlock.ValidateMode(req); err != nil {
		return dlock.Result{}, err
	}
	if err := b.checkPool(); err != nil {
		return dlock.Result{}, err
	}
	if err := b.ac.check(ctx, b.db); err != nil {
		return dlock.Result{}, b.wrap("acquire", err)
	}
	if err := b.claims.Check(ctx, req.Key); err != nil {
		return dlock.Result{}, b.wrap("acquire", err)
	}
	if b.bell != nil {
		// Doorbells are named locks, which Galera does not replicate: on
		// a Galera store they need a server of their own (Options.
		// Connector: see farBells); a setting that cannot work is an
		// error, not silently dropped.
		if err := b.storeGalera.probe(ctx, b.db); err != nil {
			return dlock.Result{}, b.wrap("acquire", err)
		}
		if b.storeGalera.is() && !b.bell.s.galeraOK {
			return dlock.Result{}, fmt.Errorf("%w: mysqllock: the lease strategy's doorbells need named locks, which Galera does not replicate: set Options.Connector to one node for the doorbells, or Options.NoDoorbell: %w",
				dlock.ErrInvalidOption, ErrGalera)
		}
	}
	res, err := b.acquireLease(ctx, req, 0)
	if err != nil || !res.Acquired || !b.bells() || req.Mode != dlock.ModeExclusive {
		return res, err
	}
	return b.takeBell(ctx, req, res)
}

// takeBell takes the doorbell of a lease just acquired, best effort: if it is
// held (a waiter that arrived in the instant between our statements, or a
// stale holder), this lease goes without, and its waiters back off instead
// of being woken.
func (b *Backend) takeBell(ctx context.Context, req dlock.Request, res dlock.Result) (dlock.Result, error) {
	r, err := b.bell.Acquire(ctx, req)
	switch {
	case err == nil && r.Acquired:
		b.belledFor(req.Key, req.Token, req.TTL)
	case errors.Is(err, ErrGalera):
		b.noBell.Store(true)
	}
	return res, nil
}

// AcquireWait implements dlock.Waiter: wait on the key's doorbell, bounded by
// the holder's remaining lease (or by staleBell when the lease is already
// free) and by recheck, then take the lease as the first in line. If the
// lease is still held (its holder died, or holds it without a doorbell), back
// off while keeping the doorbell, never beyond the lease's end nor longer
// than bellPoll at a time. Doorbell failures are never errors: they only
// cost the wake-up. In a pool with a limit, when no connection can be spared
// for a waiter's doorbell session, it returns dlock.ErrUnsupported and the
// Locker polls instead.
//
// Waiters of every mode queue on the same doorbell, so they are served in
// the order they queued: an exclusive holder rings at its release, and a
// shared or limited waiter that gets in passes the doorbell on at once, so
// that the next in line looks too (another reader may join it, another slot
// may be free). Shared and limited holders hold no doorbell: while they
// keep the first in line out, it looks every bellPoll (see inLineShared).
func (b *Backend) AcquireWait(ctx context.Context, req dlock.Request) (dlock.Result, error) {
	if !b.bells() {
		return dlock.Result{}, dlock.ErrUnsupported
	}
	began := time.Now()
	res, err := b.Acquire(ctx, req)
	if err != nil || res.Acquired {
		return res, err
	}
	wait := staleBell
	switch {
	case queuedAhead(req, res):
		// A writer or the first in line waits ahead, on the doorbell or
		// holding it: the end of its mark or turn says nothing of when
		// this waiter's turn comes.
		wait = maxWait
	case res.Remaining > 0:
		wait = res.Remaining + time.Millisecond
	}
	// The bound is GET_LOCK's own timeout, not a context's: a wait that runs
	// out then keeps its session instead of being killed.
	bound := min(wait, recheck(req.TTL), maxWait)
	waiting := time.Now()
	var bw *bellWait
	if b.handing() {
		// Without the CALL statements (db did not answer) this wait
		// waits unrecorded, as without handoffs.
		if calls, err := b.ho.procCalls(ctx, b.db); err == nil {
			bw = &bellWait{ho: &b.ho, calls: calls, req: req}
		}
	}
	r, err := b.bell.acquireWait(ctx, bellRequest(req), bound, bw)
	if err != nil || !r.Acquired {
		// A wait that ended without an answer may have been handed the
		// lease, and one whose answer came as its context ended was.
		b.leave(ctx, bw)
	}
	var bo dlock.Backoff
	switch {
	case errors.Is(err, ErrGalera):
		b.noBell.Store(true)
		return dlock.Result{}, dlock.ErrUnsupported
	case errors.Is(err, dlock.ErrUnsupported): // no connection to spare: took nothing
		return dlock.Result{}, dlock.ErrUnsupported
	case err != nil: // a broken doorbell must not make the Locker spin
		sleep(ctx, bo.Next(res.Remaining))
		return dlock.Result{}, nil
	case !r.Acquired: // the bound passed, or ctx ended: the Locker tries again
		// MySQL rounds GET_LOCK's timeout to whole seconds (MariaDB keeps
		// microseconds): never come back before the bound, or the Locker
		// would call again at once, over and over.
		sleep(ctx, bound-time.Since(waiting))
		return dlock.Result{}, nil
	}
	if bw != nil && bw.mine {
		return b.handed(ctx, bw, began)
	}
	inLine := b.bell.sessionOf(req.Key, req.Token)
	if req.Mode != dlock.ModeExclusive {
		return b.inLineShared(ctx, req, inLine, began)
	}
	for {
		sending := time.Now()
		res, err := b.acquireLease(ctx, req, inLine)
		if errors.Is(err, dlock.ErrModeMismatch) { // the key went limited: nothing was taken
			_ = b.bell.Release(context.WithoutCancel(ctx), req.Key, req.Token)
			return dlock.Result{}, err
		}
		if err != nil || res.Acquired {
			if res.Acquired && inLine != 0 {
				b.belledFor(req.Key, req.Token, req.TTL)
			}
			// The lease starts with this statement, not with the wait.
			res.SentAfter = sending.Sub(began)
			return res, err // after an error the Locker's Release drops the doorbell too
		}
		if !sleep(ctx, min(bo.Next(res.Remaining), bellPoll)) {
			_ = b.bell.Release(context.WithoutCancel(ctx), req.Key, req.Token)
			return dlock.Result{}, nil
		}
	}
}

// inLineShared takes a shared or limited hold as the first in line: req
// holds the key's doorbell (on session inLine). A grant passes the doorbell
// on at once: shared and limited holders ring nothing at their release.
// While holders keep req out, it keeps the doorbell and looks again every
// bellPoll at most, as an exclusive waiter does behind readers. A reader
// that meets a writer mark passes the doorbell on and returns: the writer
// that left the mark is ahead of it, and may be queued behind it.
func (b *Backend) inLineShared(ctx context.Context, req dlock.Request, inLine int64, began time.Time) (dlock.Result, error) {
	// The doorbell goes on however this ends: after an error the Locker
	// releases the token, which finds no exclusive lease to ring for.
	defer b.ring(context.WithoutCancel(ctx), req.Key, req.Token)
	var bo dlock.Backoff
	for {
		sending := time.Now()
		res, err := b.acquireLease(ctx, req, inLine)
		switch {
		case err != nil:
			return res, err
		case res.Acquired:
			res.SentAfter = sending.Sub(began)
			return res, nil
		case queuedAhead(req, res): // a writer's mark (the doorbell's turn is this waiter's)
			// Pass the doorbell to the writer, then give it the time to
			// take it: with no writer in line (it gave up, or is between
			// two waits) this reader would get it straight back.
			b.ring(context.WithoutCancel(ctx), req.Key, req.Token)
			sleep(ctx, min(bellPoll, res.Remaining+time.Millisecond))
			return dlock.Result{}, nil
		}
		if !sleep(ctx, min(bo.Next(res.Remaining), bellPoll)) {
			return dlock.Result{}, nil
		}
	}
}

// bellRequest is req for its doorbell, a named lock: exclusive whatever
// the mode of the lease it waits for.
func bellRequest(req dlock.Request) dlock.Request {
	req.Mode, req.Limit = dlock.ModeExclusive, 0
	return req
}

// bellName is key's doorbell name, or nil without doorbells.
func (b *Backend) bellName(key string) any {
	if !b.bells() {
		return nil
	}
	return b.bell.name(key)
}

// ring releases the doorbell token holds for key, if any.
func (b *Backend) ring(ctx context.Context, key string, token dlock.Token) {
	b.unbell(token)
	if b.bell != nil {
		_ = b.bell.Release(ctx, key, token)
	}
}

// A doorbell whose lease ends without a Release (a minimum hold that the
// Locker keeps with a last Extend, a lease it gave up on with a lock-delay
// pending) would stay held, and the key's waiters would sleep until their
// recheck, as would those of every later lease of the key (taken without
// its doorbell). So each doorbell is rung once its lease has run out
// unrenewed: bellSlack after the TTL of its grant or last renewal.
const bellSlack = 500 * time.Millisecond

// belledLease is a doorbell held for a lease, with the timer that rings it
// when the lease has run out unrenewed.
type belledLease struct{ t *time.Timer }

// belledFor records that token's lease of key, of ttl from now, holds its
// doorbell.
func (b *Backend) belledFor(key string, token dlock.Token, ttl time.Duration) {
	bl := &belledLease{}
	bl.t = time.AfterFunc(ttl+bellSlack, func() {
		if v, ok := b.belled.Load(token); ok && v.(*belledLease) == bl {
			ctx, cancel := context.WithTimeout(context.Background(), staleBell)
			defer cancel()
			b.ring(ctx, key, token)
		}
	})
	if old, loaded := b.belled.Swap(token, bl); loaded {
		old.(*belledLease).t.Stop()
	}
}

// renewedBell pushes back the ring of token's doorbell, if it holds one,
// to ttl from now.
func (b *Backend) renewedBell(token dlock.Token, ttl time.Duration) {
	if v, ok := b.belled.Load(token); ok {
		v.(*belledLease).t.Reset(ttl + bellSlack)
	}
}

// unbell forgets token's doorbell, and reports whether it held one.
func (b *Backend) unbell(token dlock.Token) bool {
	v, ok := b.belled.LoadAndDelete(token)
	if ok {
		v.(*belledLease).t.Stop()
	}
	return ok
}

// sleep waits for d or ctx, and reports whether d passed.
func sleep(ctx context.Context, d time.Duration) bool {
	t := time.NewTimer(d)
	defer t.Stop()
	select {
	case <-t.C:
		return true
	case <-ctx.Done():
		return false
	}
}

// farBells reports whether the doorbells are on another server than the
// lease rows (a Galera store, its doorbells on Options.Connector's node):
// the lease statements are then told who holds a doorbell rather than
// asking IS_USED_LOCK (see bellHolder). Known from the first acquisition.
func (b *Backend) farBells() bool {
	return b.bells() && b.bell.s.galeraOK && b.storeGalera.is()
}

// bellHolder returns the session that holds key's doorbell on the doorbells'
// server (int64), or nil when none does or it cannot be told within
// staleBell: a doorbell failure costs fairness, never the acquisition.
func (b *Backend) bellHolder(ctx context.Context, key string) any {
	ctx, cancel := context.WithTimeout(ctx, staleBell)
	defer cancel()
	var id sql.NullInt64
	if err := b.bell.s.db.QueryRowContext(ctx, "SELECT IS_USED_LOCK(?)", b.bell.name(key)).Scan(&id); err != nil || !id.Valid {
		return nil
	}
	return id.Int64
}

// galeraProbe learns once whether a server is a Galera node (an error is
// no answer: the next call asks again).
type galeraProbe struct {
	known, galera atomic.Bool
}

// probe asks db unless the answer is known.
func (p *galeraProbe) probe(ctx context.Context, db rower) error {
	if p.known.Load() {
		return nil
	}
	var on sql.NullString
	err := db.QueryRowContext(ctx, "SELECT @@wsrep_on").Scan(&on)
	var me *mysql.MySQLError
	switch {
	case errors.As(err, &me) && me.Number == errUnknownVariable: // unknown variable: not MariaDB/Galera
	case err != nil:
		return err
	default:
		p.galera.Store(on.String == "1" || on.String == "ON")
	}
	p.known.Store(true)
	return nil
}

// is reports the answer (false until known).
func (p *galeraProbe) is() bool { return p.galera.Load() }

// WaitsDirectly implements dlock.DirectWaiter: with doorbells, AcquireWait
// attempts the lease before it waits, so a blocking acquisition starts with
// it (without them AcquireWait answers dlock.ErrUnsupported at once).
func (b *Backend) WaitsDirectly() bool { return b.bells() }
