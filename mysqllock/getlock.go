package mysqllock

import (
	"context"
	"database/sql"
	"errors"
	"fmt"
	"strings"
	"sync"
	"sync/atomic"
	"time"

	"github.com/dlock-dev/dlock/internal/ctxend"

	"github.com/dlock-dev/dlock"
	"github.com/dlock-dev/dlock/internal/claims"
	"github.com/dlock-dev/dlock/internal/refusals"
)

// GetLock is the getlock strategy: MySQL named locks (GET_LOCK /
// RELEASE_LOCK) held by sessions pinned from the caller's pool, or from a
// pool of their own over Options.Connector.
//
// Waiting happens in the server, which hands the lock to the next waiter the
// moment it is released (no client polling). A holder that crashes loses its
// session and the server frees its locks at once; a holder that stops
// talking (paused, partitioned) is dropped by the server after its session's
// wait_timeout, which is kept at the largest TTL of the locks on that session
// (rounded up to seconds), while renewal checks the lock every TTL/3 and
// reports a loss before that. TTLs above MaxSessionTTL are refused with
// dlock.ErrInvalidOption. Uncontended locks share one session however many
// there are; each blocked waiter and each lock handed over by a wait uses a
// session of its own until released. Keys longer than 58 characters or 186
// bytes are hashed into the servers' name limits (MySQL: 64 characters;
// MariaDB: 192 bytes). Fencing tokens come from a per-key counter row bumped
// on every grant.
//
// A session shared by several locks is never ended by one caller: its
// statements run under a bound of their own (30 s), not under the caller's
// context, whose end (a deadline, a cancellation, one lease's renewal
// deadline) returns the call at once while the statement finishes. An
// acquisition whose caller left is undone when its statement ends. A
// release goes ahead even if its context has ended (the call then returns
// the context's error), so a released lock never stays held by a session
// that other locks keep alive. A context that has ended before an
// acquisition starts fails it before any I/O.
//
// When the server ends a session by itself (the connection is cut, KILL,
// wait_timeout, a restart), every lock on it is free at once. GetLock
// reports each of them lost at once (dlock.LossReporter) when a statement on
// the session fails, or when its liveness check, every 100 ms on each
// session holding locks, finds the connection closed (a read of the socket,
// no round trip; it needs the driver's checkConnLiveness, on by default).
// A cut that the client's socket does not see (a partition) is found by the
// next renewal, up to TTL/3 later; a waiter may hold the lock before then.
// A lease (New) does not have this gap. Guard the resource with the fencing
// token, or choose a short TTL to narrow the window.
//
// Without a Connector the sessions count against db's pool: see
// Options.Connector for the limits.
//
// Named locks belong to the whole server, not to a database or a table: two
// applications (or staging and production) that share a server and use the
// same keys with this strategy exclude each other, whatever their databases
// and Options.Table. Prefix keys per application where that matters.
//
// Not for Galera (GET_LOCK is not replicated: NewGetLock's first use fails
// with ErrGalera), Group Replication or proxies that multiplex sessions.
type GetLock struct {
	claims *claims.Set // nil for a lease's doorbells
	s      *sessions
	bell   bool // a lease's doorbell: "dbell" names, no fencing row
	loss   dlock.LossHandlers
	warn   warner
	table  string // the lease table, quoted, whose schema Migrate creates

	mu       sync.Mutex
	main     *session                 // takes the uncontended locks
	proc     string                   // the grant procedure (see grantproc.go), quoted
	noProc   atomic.Bool              // the server has no grant procedure: use two statements
	byToken  map[dlock.Token]*session // where each held or pending token is
	watching bool                     // the liveness watch runs
	refused  refusals.Set             // keys a try found held lately (see WaitsDirectly)
}

var (
	_ dlock.Backend        = (*GetLock)(nil)
	_ dlock.Waiter         = (*GetLock)(nil)
	_ dlock.DirectWaiter   = (*GetLock)(nil)
	_ dlock.Lister         = (*GetLock)(nil)
	_ dlock.ForceReleaser  = (*GetLock)(nil)
	_ dlock.LossReporter   = (*GetLock)(nil)
	_ dlock.Sharer         = (*GetLock)(nil)
	_ dlock.MetadataSetter = (*GetLock)(nil)
)

// SupportsMode implements dlock.Sharer: GET_LOCK has no shared mode, so
// GetLock grants exclusive acquisitions only, and the Locker refuses the
// others before any I/O.
func (g *GetLock) SupportsMode(m dlock.Mode) bool { return m == dlock.ModeExclusive }

// minSessionConns is the smallest limit of a caller's pool that GetLock and
// the doorbells work with: the shared session, and one connection for every
// other statement.
const minSessionConns = 2

// MaxSessionTTL is the longest TTL that GetLock accepts: the server caps a
// session's wait_timeout at one year, and would end a session kept for a
// longer TTL before its holder checks it.
const MaxSessionTTL = 365 * 24 * time.Hour

// NewGetLock returns the getlock strategy over db, whose connections it pins
// for held locks (or over opts.Connector's, outside db's pool). It does no
// I/O; Migrate (any strategy's) creates the fencing table. Call Close to
// return the pinned connections. The error matches dlock.ErrInvalidOption
// for a bad table name or a pool limit below 2 without a Connector.
func NewGetLock(db *sql.DB, opts *Options) (*GetLock, error) {
	table, err := checkArgs(db == nil, opts)
	if err == nil {
		err = leaseOnly("getlock", opts)
	}
	if err != nil {
		return nil, err
	}
	s := newSessions(db, table).forStrategy("getlock", minSessionConns, connector(opts))
	s.log = logger(opts)
	if err := s.checkPool(); err != nil {
		return nil, err
	}
	return &GetLock{s: s, warn: warner{log: logger(opts)}, table: table, proc: grantProc(table), claims: newClaims(db, table, "getlock")}, nil
}

// OnLoss implements dlock.LossReporter: when a session ends (a statement on
// it fails for good, or the liveness check finds its connection closed),
// every lock on it is reported at once.
func (g *GetLock) OnLoss(f func(key string, token dlock.Token, cause error)) (stop func()) {
	return g.loss.Add(f)
}

// Migrate creates the tables of Options.Table if they are missing (the same
// schema as the lease strategy's, so that any strategy's Migrate serves all
// three) and the stored procedure that makes a grant one round trip (with
// the CREATE ROUTINE privilege; without it, Migrate logs a warning and
// grants take two statements), and logs the server settings that break a
// guarantee (see Check) when Options.Logger is set.
func (g *GetLock) Migrate(ctx context.Context) error {
	return migrate(ctx, g.s.db, g.table, &g.warn, g.Check)
}

// Close releases every lock still held and returns the pinned connections to
// the pool. It does not close the *sql.DB.
func (g *GetLock) Close() error {
	g.mu.Lock()
	g.main = nil
	clear(g.byToken)
	g.mu.Unlock()
	g.s.closeAll()
	return nil
}

// checkRequest refuses, before any I/O, a request that cannot be served.
func (g *GetLock) checkRequest(ctx context.Context, req dlock.Request) error {
	if err := exclusiveOnly("getlock", req); err != nil {
		return err
	}
	if err := g.s.checkPool(); err != nil {
		return err
	}
	if !g.bell {
		if err := checkLockDelay("getlock", req); err != nil {
			return err
		}
		if ttl := holderTTL(req); ttl > MaxSessionTTL {
			return fmt.Errorf("%w: mysqllock: getlock: ttl %s is above the maximum %s (the server caps wait_timeout at one year)", dlock.ErrInvalidOption, ttl, MaxSessionTTL)
		}
	}
	if err := ctxend.Err(ctx); err != nil {
		return err
	}
	if g.claims != nil {
		g.warn.warnOnce(ctx, g.Check)
		// Refused on Galera before the key is claimed, so that the
		// lease strategy may still take it.
		if err := g.s.checkGalera(ctx, g.s.db); err != nil {
			return wrapErr(g.table, "getlock acquire", err)
		}
		if err := g.claims.Check(ctx, req.Key); err != nil {
			return wrapErr(g.table, "getlock acquire", err)
		}
	}
	return nil
}

// mainSession reserves req.Key on the shared session, opening it if needed;
// false if the session holds (or is taking) the key already. The
// reservation is made under g.mu while the session is still g.main: a
// shared session that holds nothing may be given back (unmark), and a
// GET_LOCK on it then would be undone by its reset.
func (g *GetLock) mainSession(ctx context.Context, req dlock.Request) (*session, bool, error) {
	g.mu.Lock()
	if ss := g.main; ss != nil && !ss.broken.Load() {
		if len(ss.keys) > 0 || !g.s.staleIdle(ss) {
			ok := g.reserveLocked(ss, req)
			g.mu.Unlock()
			return ss, ok, nil
		}
		// It holds nothing and the server may drop it, idle for its
		// wait_timeout, as the next statement reaches it: a grant there
		// could be lost at once. Give it back and open another.
		g.main = nil
		g.mu.Unlock()
		g.s.close(ss)
	} else {
		g.mu.Unlock()
	}
	// Opened without g.mu: a pool with no connection to spare makes this
	// wait, and renewals must not wait with it.
	fresh, err := g.s.open(ctx, g.ttl(req))
	if err != nil {
		return nil, false, err
	}
	g.mu.Lock()
	if g.main == nil || g.main.broken.Load() {
		g.main = fresh
		fresh = nil
	}
	ss := g.main
	ok := g.reserveLocked(ss, req)
	g.mu.Unlock()
	if fresh != nil { // another acquisition opened one first
		g.s.close(fresh)
	}
	return ss, ok, nil
}

// reserve marks req.Key as being taken on ss (a session of its own).
func (g *GetLock) reserve(ss *session, req dlock.Request) bool {
	g.mu.Lock()
	defer g.mu.Unlock()
	return g.reserveLocked(ss, req)
}

// reserveLocked marks req.Key as being taken on ss; false if ss holds it
// already (GET_LOCK is re-entrant per session, so a second GET_LOCK would
// succeed) or ss was found broken. g.mu is held.
func (g *GetLock) reserveLocked(ss *session, req dlock.Request) bool {
	if _, ok := ss.keys[req.Key]; ok || ss.broken.Load() {
		return false
	}
	ss.add(req.Key, req.Token, g.ttl(req), g.delay(req))
	if g.byToken == nil {
		g.byToken = make(map[dlock.Token]*session)
	}
	g.byToken[req.Token] = ss
	g.watchLocked()
	return true
}

// ttl is the wait_timeout that req needs: a doorbell's is the lease's
// whole TTL, a lock's its holder's TTL (the lock-delay follows the
// session's end).
func (g *GetLock) ttl(req dlock.Request) time.Duration {
	if g.bell {
		return req.TTL
	}
	return holderTTL(req)
}

// delay is the lock-delay that req's grant records (doorbells have no
// record).
func (g *GetLock) delay(req dlock.Request) time.Duration {
	if g.bell {
		return 0
	}
	return req.LockDelay
}

// delayOf is the lock-delay of key's grant on ss.
func (g *GetLock) delayOf(ss *session, key string) time.Duration {
	g.mu.Lock()
	defer g.mu.Unlock()
	return ss.keys[key].delay
}

// owns reports whether tok holds (or is taking) key on ss.
func (g *GetLock) owns(ss *session, key string, tok dlock.Token) bool {
	g.mu.Lock()
	defer g.mu.Unlock()
	h, ok := ss.keys[key]
	return ok && h.token == tok && !ss.broken.Load()
}

// unmark drops key (held or being taken by tok) from ss's records and
// reports whether ss now holds nothing and should go: a session of its own,
// or the shared one in a caller's pool with a limit. Only the call that
// dropped the key may give ss back: a second call for the same key (a
// release after a failed acquisition's clean-up) must not, or ss, already
// parked or handed to another acquisition, would be parked twice and
// shared by two.
func (g *GetLock) unmark(ss *session, key string, tok dlock.Token) (done bool) {
	g.mu.Lock()
	defer g.mu.Unlock()
	h, ok := ss.keys[key]
	if !ok || h.token != tok {
		return false
	}
	delete(g.byToken, tok)
	ss.remove(key)
	return g.idleLocked(ss)
}

// idle reports whether ss holds nothing and should go (see unmark).
func (g *GetLock) idle(ss *session) bool {
	g.mu.Lock()
	defer g.mu.Unlock()
	return g.idleLocked(ss)
}

// idleLocked is idle with g.mu held.
func (g *GetLock) idleLocked(ss *session) bool {
	if len(ss.keys) > 0 || ss.broken.Load() {
		return false
	}
	if ss == g.main {
		if g.s.limit() == 0 {
			return false
		}
		g.main = nil
	}
	return true
}

// forget drops key from ss (after a failed or abandoned acquisition, or a
// release) and gives ss back if it holds nothing.
func (g *GetLock) forget(ss *session, key string, tok dlock.Token) {
	if g.unmark(ss, key, tok) {
		g.s.close(ss)
	}
}

// lost ends a session whose connection is gone or dubious: the server has
// freed (or will free) all its locks, and each is reported lost at once.
func (g *GetLock) lost(ss *session, cause error) {
	type held struct {
		key string
		tok dlock.Token
	}
	g.mu.Lock()
	ss.broken.Store(true)
	var gone []held
	for k, h := range ss.keys {
		delete(g.byToken, h.token)
		gone = append(gone, held{k, h.token})
	}
	clear(ss.keys)
	clear(ss.secs)
	if g.main == ss {
		g.main = nil
	}
	g.mu.Unlock()
	err := fmt.Errorf("mysqllock: session %d ended: %w", ss.id, cause)
	for _, h := range gone {
		g.loss.Report(h.key, h.tok, err)
	}
	g.s.close(ss)
}

// failed handles a statement's error on ss: a lost session is ended (and
// its locks reported); otherwise key is forgotten.
func (g *GetLock) failed(ss *session, key string, tok dlock.Token, err error) {
	if sessionLost(err) {
		g.lost(ss, err)
		return
	}
	g.forget(ss, key, tok)
}

// liveEvery is how often the sessions holding locks are checked for a
// connection that the server closed: a check reads the socket, without a
// round trip, so that a killed session's locks are reported lost at once
// rather than at their next renewal.
const liveEvery = 100 * time.Millisecond

// watchLocked starts the liveness watch if it is not running. g.mu is held.
func (g *GetLock) watchLocked() {
	if !g.watching {
		g.watching = true
		go g.watch()
	}
}

// watch checks the sessions holding locks every liveEvery, and ends when
// none holds anything.
func (g *GetLock) watch() {
	t := time.NewTicker(liveEvery)
	defer t.Stop()
	for range t.C {
		g.mu.Lock()
		var held []*session
		seen := map[*session]bool{}
		for _, ss := range g.byToken {
			if !seen[ss] {
				seen[ss] = true
				held = append(held, ss)
			}
		}
		if len(held) == 0 {
			g.watching = false
			g.mu.Unlock()
			return
		}
		g.mu.Unlock()
		for _, ss := range held {
			if err := ss.alive(); err != nil {
				g.lost(ss, err)
			}
		}
	}
}

// Acquire implements dlock.Backend: GET_LOCK(name, 0) on the main session.
// If the main session turns out to be gone (the server drops idle sessions
// after their wait_timeout), it is replaced and the attempt made once more.
func (g *GetLock) Acquire(ctx context.Context, req dlock.Request) (dlock.Result, error) {
	if err := g.checkRequest(ctx, req); err != nil {
		return dlock.Result{}, err
	}
	began := time.Now()
	for try := 0; ; try++ {
		ss, ok, err := g.mainSession(ctx, req)
		if err != nil {
			return dlock.Result{}, wrapErr(g.s.table, "getlock acquire", err)
		}
		if !ok {
			if try == 0 && ss.broken.Load() {
				continue
			}
			return g.notAcquired(ctx, req), nil
		}
		res, err := g.takeShared(ctx, ss, req, began)
		if try == 0 && ss.broken.Load() && !res.Acquired && ctxend.Err(ctx) == nil {
			continue
		}
		if err == nil && !res.Acquired {
			g.refused.Refused(req.Key, began)
		}
		return res, err
	}
}

// cover sets ss's wait_timeout to what its locks need (the largest TTL), on
// a caller that holds ss.mu.
func (g *GetLock) cover(ctx context.Context, ss *session) error {
	g.mu.Lock()
	n := ss.need()
	g.mu.Unlock()
	if g.s.keepTimeout || n == 0 || int64(n) == ss.waitTimeout.Load() {
		return nil
	}
	if _, err := ss.conn.ExecContext(ctx, fmt.Sprintf("SET SESSION wait_timeout = %d", n)); err != nil {
		return err
	}
	ss.waitTimeout.Store(int64(n))
	return nil
}

// takeShared takes req.Key (reserved) on the shared session: it raises
// the session's wait_timeout to what its locks need, runs GET_LOCK(name, 0)
// and records the grant, all while no other statement runs on the session
// (so that a concurrent release cannot lower wait_timeout below a TTL it
// has not seen). If ctx ends first, the caller gets its error at once and
// the acquisition is undone once its statements end.
func (g *GetLock) takeShared(ctx context.Context, ss *session, req dlock.Request, began time.Time) (dlock.Result, error) {
	name := g.name(req.Key)
	var got sql.NullInt64
	var fence uint64
	var delayed time.Duration // what is left of a lock-delay that refused the grant
	var granting time.Time
	grab := func(sctx context.Context) error {
		if err := g.cover(sctx, ss); err != nil {
			return err
		}
		granting = time.Now()
		var err error
		proc := !g.bell && !g.noProc.Load()
		if proc {
			got, fence, err = g.callGrant(sctx, ss, req, name, 0)
			switch {
			case noGrantProc(err):
				g.noProc.Store(true)
				proc = false
			case err != nil && !sessionLost(err):
				// The procedure may have taken the lock before it failed.
				_, err2 := ss.conn.ExecContext(sctx, "DO IF(IS_USED_LOCK(?) = CONNECTION_ID(), RELEASE_LOCK(?), 0)", name, name)
				return dlock.Join(err, err2)
			}
		}
		if !proc {
			err = ss.conn.QueryRowContext(sctx, "SELECT GET_LOCK(?, 0)", name).Scan(&got)
		}
		if err != nil || got.Int64 != 1 || g.bell || fence > 0 {
			return err
		}
		granting = time.Now()
		if fence, delayed, err = g.s.grant(sctx, ss.conn, ss, req, name, false); err != nil || fence == 0 {
			got.Int64 = 0
			if !sessionLost(err) {
				_, err2 := ss.conn.ExecContext(sctx, "DO RELEASE_LOCK(?)", name)
				err = dlock.Join(err, err2)
			}
		}
		return err
	}
	err := ss.run(ctx, statementTimeout, true, grab, func(err error) {
		// The caller left: undo what the statements did.
		if err == nil && got.Int64 == 1 {
			g.release(ss, req.Key, req.Token)
			return
		}
		g.failed(ss, req.Key, req.Token, err)
	})
	switch {
	case callerLeft(err):
		// The caller left; the undo runs when the statements end. The
		// token is no longer found, so the Locker's own resolution
		// changes nothing.
		g.mu.Lock()
		delete(g.byToken, req.Token)
		g.mu.Unlock()
		return dlock.Result{}, wrapErr(g.s.table, "getlock acquire", err)
	case err != nil:
		g.failed(ss, req.Key, req.Token, err)
		return dlock.Result{}, wrapErr(g.s.table, "getlock acquire", err)
	case got.Int64 != 1:
		g.forget(ss, req.Key, req.Token)
		res := g.notAcquired(ctx, req)
		res.Remaining = delayed
		return res, nil
	}
	if g.bell {
		return dlock.Result{Acquired: true}, nil
	}
	return dlock.Result{Acquired: true, Fence: fence, SentAfter: granting.Sub(began)}, nil
}

// maxWait bounds one server-side wait; the Locker calls AcquireWait again.
const maxWait = 30 * time.Second

// quickShare: a grant of the grant procedure whose reply came within the
// TTL over quickShare of the CALL's sending is timed from that sending
// (always safe: the server counts the session's idleness from after it),
// and keeps most of its lease; a later one is confirmed by a statement
// after the reply, and timed from that statement.
const quickShare = 5

// AcquireWait implements dlock.Waiter: a blocking GET_LOCK on a session of
// its own, interrupted when ctx ends (see killUntil). A key is tried first, as
// Acquire does, on the shared session, unless a try of this GetLock found
// it held in the last second and the caller's pool has no limit (see
// WaitsDirectly). In a caller's pool with a limit,
// when no connection can be spared for a session of its own, it returns
// dlock.ErrUnsupported, having taken nothing, and the Locker polls with
// Acquire instead.
func (g *GetLock) AcquireWait(ctx context.Context, req dlock.Request) (dlock.Result, error) {
	// In a caller's pool with a limit a session of its own takes one of
	// few slots (see openOwn): a free key is always tried first there.
	if res, done, err := g.refused.TryFirst(ctx, req, g.s.limit() == 0, g.Acquire); done {
		return res, err
	}
	return g.acquireWait(ctx, req, maxWait, nil)
}

// WaitsDirectly implements dlock.DirectWaiter: a blocking acquisition
// calls AcquireWait at once, which tries first unless a try found the key
// held lately and the caller's pool has no limit, so that a contended
// acquisition costs one statement before its wait, not two.
func (g *GetLock) WaitsDirectly() bool { return !g.bell }

// acquireWait is AcquireWait bounded by bound in the server: GET_LOCK's own
// timeout ends the wait and returns 0, and the session is kept for reuse
// (a wait ended by ctx is killed, and its session dropped). A doorbell
// wait with bw runs as the lease table's wait procedure (see handoff.go).
func (g *GetLock) acquireWait(ctx context.Context, req dlock.Request, bound time.Duration, bw *bellWait) (dlock.Result, error) {
	if err := g.checkRequest(ctx, req); err != nil {
		return dlock.Result{}, err
	}
	began := time.Now()
	ss, err := g.s.openOwn(ctx, g.ttl(req))
	if errors.Is(err, errNoSlot) {
		return dlock.Result{}, dlock.ErrUnsupported
	}
	if err != nil {
		return dlock.Result{}, wrapErr(g.s.table, "getlock acquire", err)
	}
	g.reserve(ss, req)
	wait := bound
	if d, ok := ctx.Deadline(); ok {
		wait = min(wait, time.Until(d))
	}
	wait = max(wait, 0)
	name := g.name(req.Key)
	var got sql.NullInt64
	var fence uint64
	var called time.Time // when the grant procedure was called
	quick := false       // and it answered within the TTL over quickShare
	// The wait runs on a session of its own, and ends by GET_LOCK's own
	// timeout or by KILL QUERY (see killUntil), never by a context.
	waited := make(chan struct{})
	stop := context.AfterFunc(ctx, func() { killUntil(g.s.db, ss.id, waited) })
	ss.waiting.Store(true)
	err = ss.run(context.WithoutCancel(ctx), wait+statementTimeout, false, func(sctx context.Context) error {
		if err := g.cover(sctx, ss); err != nil {
			return err
		}
		if !g.bell && !g.noProc.Load() {
			called = time.Now()
			var err error
			got, fence, err = g.callGrant(sctx, ss, req, name, wait)
			quick = time.Since(called) <= g.ttl(req)/quickShare
			if !noGrantProc(err) {
				return err
			}
			g.noProc.Store(true)
			called = time.Time{}
		}
		if bw != nil {
			var ok bool
			var err error
			if got, ok, err = bw.run(sctx, ss, name, wait); ok {
				called = bw.sent
				return err
			}
		}
		return ss.conn.QueryRowContext(sctx, waitStatement(name, wait)).Scan(&got)
	}, nil)
	ss.waiting.Store(false)
	close(waited)
	if !stop() {
		// ctx ended: whatever the wait's outcome, drop the session so
		// that no grant can outlive it.
		g.lost(ss, errAbandoned)
		return dlock.Result{}, nil
	}
	if err != nil {
		if !called.IsZero() {
			// The procedure may have taken the lock before it failed:
			// the session goes with it.
			g.lost(ss, err)
		} else {
			g.failed(ss, req.Key, req.Token, err)
		}
		return dlock.Result{}, wrapErr(g.s.table, "getlock acquire", err)
	}
	if got.Int64 != 1 {
		g.forget(ss, req.Key, req.Token)
		return g.notAcquired(ctx, req), nil
	}
	if g.bell {
		return dlock.Result{Acquired: true}, nil
	}
	if fence > 0 && quick {
		return dlock.Result{Acquired: true, Fence: fence, SentAfter: called.Sub(began)}, nil
	}
	if fence > 0 {
		return g.confirm(ctx, ss, req, name, fence, began)
	}
	// The grant's SentAfter (relative to began) is when the statement
	// recording it was sent on the session: the session's wait_timeout
	// counts from its last statement, so a long wait does not shorten the
	// lease.
	granting := time.Now()
	var delayed time.Duration
	err = ss.run(ctx, statementTimeout, false, func(sctx context.Context) error {
		var err error
		fence, delayed, err = g.s.grant(sctx, ss.conn, ss, req, name, false)
		if err == nil && fence == 0 { // refused by a lock-delay
			_, err = ss.conn.ExecContext(sctx, "DO RELEASE_LOCK(?)", name)
		}
		return err
	}, func(error) { g.lost(ss, errAbandoned) }) // the session holds this lock alone
	if err != nil {
		if callerLeft(err) {
			return dlock.Result{}, wrapErr(g.s.table, "getlock acquire", err)
		}
		g.lost(ss, err) // the session holds this lock alone
		return dlock.Result{}, wrapErr(g.s.table, "getlock acquire", err)
	}
	if fence == 0 {
		g.forget(ss, req.Key, req.Token)
		sleepDelay(ctx, min(delayed, bound))
		return dlock.Result{}, nil
	}
	return dlock.Result{Acquired: true, Fence: fence, SentAfter: granting.Sub(began)}, nil
}

// confirm times a grant that the grant procedure recorded after a long
// wait: from a statement, sent on the session after the reply, that finds
// the lock still held by it.
func (g *GetLock) confirm(ctx context.Context, ss *session, req dlock.Request, name string, fence uint64, began time.Time) (dlock.Result, error) {
	confirming := time.Now()
	var held sql.NullBool
	err := ss.run(ctx, statementTimeout, false, func(sctx context.Context) error {
		return ss.conn.QueryRowContext(sctx, "SELECT IS_USED_LOCK(?) = CONNECTION_ID()", name).Scan(&held)
	}, func(error) { g.lost(ss, errAbandoned) }) // the session holds this lock alone
	if err == nil && !held.Bool {
		err = errors.New("mysqllock: the session no longer held the lock when its grant was confirmed")
	}
	if err != nil {
		if !callerLeft(err) {
			g.lost(ss, err)
		}
		return dlock.Result{}, wrapErr(g.s.table, "getlock acquire", err)
	}
	return dlock.Result{Acquired: true, Fence: fence, SentAfter: confirming.Sub(began)}, nil
}

// notAcquired describes the key's last holder (doorbells have no record).
func (g *GetLock) notAcquired(ctx context.Context, req dlock.Request) dlock.Result {
	if g.bell {
		return dlock.Result{Holder: dlock.LockInfo{Key: req.Key}}
	}
	return g.s.notAcquired(ctx, req)
}

// name is key's GET_LOCK name.
func (g *GetLock) name(key string) string {
	if g.bell {
		return lockName("dbell", key)
	}
	return lockName("dlock", key)
}

// holding returns the session where key is held by tok.
func (g *GetLock) holding(key string, tok dlock.Token) *session {
	g.mu.Lock()
	defer g.mu.Unlock()
	if ss := g.byToken[tok]; ss != nil && ss.keys[key].token == tok && !ss.broken.Load() {
		return ss
	}
	return nil
}

// sessionOf returns the id of the session where tok holds key, or 0.
func (g *GetLock) sessionOf(key string, tok dlock.Token) int64 {
	if ss := g.holding(key, tok); ss != nil {
		return ss.id
	}
	return 0
}

// Extend implements dlock.Backend: one query per session checks that the
// server still gives each lock to that session (IS_USED_LOCK =
// CONNECTION_ID()), which also keeps the session from timing out. When ctx
// ends first (a slow server), the leases of the sessions not yet answered
// get its error, and their statements go on.
func (g *GetLock) Extend(ctx context.Context, leases []dlock.Lease) ([]error, error) {
	errs := make([]error, len(leases))
	bySession := map[*session][]int{}
	for i, l := range leases {
		ss := g.holding(l.Key, l.Token)
		if ss == nil {
			errs[i] = dlock.ErrNotHeld
			continue
		}
		bySession[ss] = append(bySession[ss], i)
	}
	for ss, idx := range bySession {
		q := "SELECT CONNECTION_ID()" + strings.Repeat(", IS_USED_LOCK(?)", len(idx))
		args := make([]any, len(idx))
		dest := make([]any, len(idx)+1)
		ids := make([]sql.NullInt64, len(idx)+1)
		for j, i := range idx {
			args[j] = g.name(leases[i].Key)
		}
		for j := range dest {
			dest[j] = &ids[j]
		}
		err := ss.run(ctx, statementTimeout, true, func(sctx context.Context) error {
			return ss.conn.QueryRowContext(sctx, q, args...).Scan(dest...)
		}, func(err error) {
			if sessionLost(err) {
				g.lost(ss, err)
			}
		})
		lost := sessionLost(err)
		for j, i := range idx {
			switch {
			case lost:
				errs[i] = fmt.Errorf("%w: session lost: %v", dlock.ErrNotHeld, err)
			case err != nil:
				errs[i] = wrapErr(g.s.table, "getlock extend", err)
			case ids[j+1].Int64 != ids[0].Int64:
				errs[i] = dlock.ErrNotHeld
			}
		}
		if lost {
			g.lost(ss, err)
		}
	}
	return errs, nil
}

// Release implements dlock.Backend. The release goes ahead even if ctx ends
// (or has ended) first: ctx bounds only the wait for its answer, and the
// error is then ctx's. A grant with a lock-delay is marked released first
// (one more statement), so that the next holder does not keep the delay.
func (g *GetLock) Release(ctx context.Context, key string, token dlock.Token) error {
	return g.end(ctx, key, token, ending{clean: true})
}

// end is Release when clean, and Abandon otherwise.
func (g *GetLock) end(ctx context.Context, key string, token dlock.Token, how ending) error {
	ss := g.holding(key, token)
	if ss == nil {
		return dlock.ErrNotHeld
	}
	var got sql.NullInt64
	var removed bool
	err := ss.run(ctx, statementTimeout, false, func(sctx context.Context) error {
		return g.releaseLocked(sctx, ss, key, token, how, &got, &removed)
	}, func(err error) { g.released(ss, key, token, err, removed) })
	if callerLeft(err) {
		return fmt.Errorf("mysqllock: getlock release: %w", err)
	}
	g.released(ss, key, token, err, removed)
	switch {
	case errors.Is(err, dlock.ErrNotHeld):
		return dlock.ErrNotHeld
	case sessionLost(err):
		return fmt.Errorf("%w: session lost: %v", dlock.ErrNotHeld, err)
	case err != nil:
		return wrapErr(g.s.table, "getlock release", err)
	case got.Int64 != 1:
		return dlock.ErrNotHeld
	}
	return nil
}

// releaseLocked runs RELEASE_LOCK for key on ss if tok holds it there
// (first marking a grant with a lock-delay released, when clean, or
// keeping the key for how.keep), drops key
// from ss's records (setting *removed), then lowers the session's
// wait_timeout to what its other locks need. The caller holds ss.mu: the
// check and the release cannot be overtaken by another statement on the
// session.
func (g *GetLock) releaseLocked(ctx context.Context, ss *session, key string, tok dlock.Token, how ending, got *sql.NullInt64, removed *bool) error {
	if !g.owns(ss, key, tok) {
		return dlock.ErrNotHeld
	}
	switch {
	case how.keep > 0:
		if err := g.s.keepHold(ctx, ss.conn, key, tok, how.keep); err != nil {
			return err
		}
	case how.clean && g.delayOf(ss, key) > 0:
		if err := g.s.clearDelay(ctx, ss.conn, key, tok); err != nil {
			return err
		}
	}
	if how.via != nil {
		var err error
		if *got, err = how.via(ctx, ss.conn); err != nil {
			return err
		}
	} else if err := ss.conn.QueryRowContext(ctx, "SELECT RELEASE_LOCK(?)", g.name(key)).Scan(got); err != nil {
		return err
	}
	g.mu.Lock()
	if h, ok := ss.keys[key]; ok && h.token == tok {
		delete(g.byToken, tok)
		ss.remove(key)
		*removed = true
	}
	g.mu.Unlock()
	if err := g.cover(ctx, ss); sessionLost(err) {
		return err
	}
	return nil
}

// released settles ss after a release of key by tok that ended with err;
// removed says whether that release dropped key from ss's records (only
// then may it give ss back). A release that failed but left the session up
// is not known to have happened: the session is ended, so that no lock
// outlives the holder's wish to release it.
func (g *GetLock) released(ss *session, key string, tok dlock.Token, err error, removed bool) {
	switch {
	case err != nil && !errors.Is(err, dlock.ErrNotHeld):
		g.lost(ss, err)
	case removed:
		if g.idle(ss) {
			g.s.close(ss)
		}
	default:
		g.forget(ss, key, tok)
	}
}

// release releases key on ss in the background (an acquisition whose caller
// left).
func (g *GetLock) release(ss *session, key string, tok dlock.Token) {
	var got sql.NullInt64
	var removed bool
	err := ss.run(context.Background(), statementTimeout, false, func(sctx context.Context) error {
		return g.releaseLocked(sctx, ss, key, tok, ending{clean: true}, &got, &removed)
	}, nil)
	g.released(ss, key, tok, err, removed)
}

// SetMetadata implements dlock.MetadataSetter: one UPDATE of the key's row
// in the session table, run on the session that holds the lock, that
// matches only if token is the key's last holder and the server still gives
// the named lock to that session (IS_USED_LOCK = CONNECTION_ID()). It runs
// as the session's other short statements do: serialized with them (so that
// a release and a new grant on the session cannot come between its check
// and its write) and bounded by a timeout of its own, never by ctx, whose
// end returns the call at once while the statement finishes, so that the
// session and its other locks stay. An error other than ErrNotHeld (ctx's,
// the server's) means that the metadata may or may not have changed.
func (g *GetLock) SetMetadata(ctx context.Context, key string, token dlock.Token, metadata string) error {
	if g.bell {
		return dlock.ErrUnsupported // a doorbell has no record
	}
	ss := g.holding(key, token)
	if ss == nil {
		return dlock.ErrNotHeld
	}
	set := `UPDATE ` + g.s.table + ` SET metadata = ?, fence = LAST_INSERT_ID(fence)
WHERE name = ? AND token = ? AND IS_USED_LOCK(lock_name) = CONNECTION_ID()`
	held := `SELECT COUNT(*) FROM ` + g.s.table + ` WHERE name = ? AND token = ? AND IS_USED_LOCK(lock_name) = CONNECTION_ID()`
	err := ss.run(ctx, statementTimeout, true, func(sctx context.Context) error {
		if !g.owns(ss, key, token) {
			return dlock.ErrNotHeld
		}
		ok, err := setMetadata(sctx, ss.conn, set, key, token, metadata)
		if err != nil || ok {
			return err
		}
		// No fence in the reply: no row matched, or a trigger hid it.
		// Nothing else ran on the session since the UPDATE, so the lock
		// held now was held then.
		var n int
		if err := ss.conn.QueryRowContext(sctx, held, key, token[:]).Scan(&n); err != nil {
			return err
		}
		if n == 0 {
			return dlock.ErrNotHeld
		}
		return nil
	}, func(err error) {
		if sessionLost(err) {
			g.lost(ss, err)
		}
	})
	switch {
	case err == nil, errors.Is(err, dlock.ErrNotHeld):
		return err
	case callerLeft(err):
		return fmt.Errorf("mysqllock: getlock set metadata: %w", err)
	case sessionLost(err):
		// The UPDATE may have run before the session ended.
		g.lost(ss, err)
	}
	return wrapErr(g.s.table, "getlock set metadata", err)
}

// ForceRelease implements dlock.ForceReleaser. MySQL cannot release another
// session's named lock, so this kills the holder's session: every lock that
// session held is freed, and its holders learn it at once if they watch
// their sessions (GetLock does), else at their next renewal.
func (g *GetLock) ForceRelease(ctx context.Context, key string) error {
	if g.claims != nil {
		if err := g.claims.CheckOnly(ctx, key); err != nil {
			return wrapErr(g.table, "getlock force release", err)
		}
	}
	var id sql.NullInt64
	if err := g.s.db.QueryRowContext(ctx, "SELECT IS_USED_LOCK(?)", g.name(key)).Scan(&id); err != nil {
		return wrapErr(g.s.table, "getlock force release", err)
	}
	if !id.Valid {
		return dlock.ErrNotHeld
	}
	if _, err := g.s.db.ExecContext(ctx, fmt.Sprintf("KILL CONNECTION %d", id.Int64)); err != nil {
		return wrapErr(g.s.table, "getlock force release", err)
	}
	return nil
}

// List implements dlock.Lister: the keys whose last grant's session still
// holds the named lock. ExpiresAt is zero: session locks last as long as the
// holder's session.
func (g *GetLock) List(ctx context.Context, prefix string) ([]dlock.LockInfo, error) {
	hs, err := g.s.holders(ctx, "LEFT(name, ?) = ? AND lock_name <> '' AND IS_USED_LOCK(lock_name) = conn_id", len(prefix), []byte(prefix))
	if err != nil {
		return nil, wrapErr(g.s.table, "getlock list", err)
	}
	return hs, nil
}
