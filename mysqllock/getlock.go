package mysqllock

import (
	"context"
	"database/sql"
	"errors"
	"fmt"
	"strings"
	"sync"
	"time"

	"github.com/dlock-dev/dlock"
)

// GetLock is the getlock strategy: MySQL named locks (GET_LOCK /
// RELEASE_LOCK) held by sessions pinned from the caller's pool.
//
// Waiting happens in the server, which hands the lock to the next waiter the
// moment it is released (no client polling). A holder that crashes loses its
// session and the server frees its locks at once; a holder that stops
// talking (paused, partitioned) is dropped by the server after its session's
// wait_timeout, which is kept at the largest TTL of the locks on that session
// (rounded up to seconds), while renewal checks the lock every TTL/3 and
// reports a loss before that.
// Uncontended locks share one session however many there are; each blocked
// waiter and each lock handed over by a wait uses a session of its own until
// released. Keys longer than 58 characters are hashed into the server's
// 64-character name limit. Fencing tokens come from a per-key counter row
// bumped on every grant.
//
// When the server ends the session by itself (the connection is cut, KILL,
// a proxy restart), the lock is free at once and a waiter may take it
// before the holder is told: the holder learns of it at its next check, up
// to TTL/3 later (the fault harness measured this under connection cuts). A
// lease (New) does not have this gap. Guard the resource with the fencing
// token, or choose a short TTL to narrow the window.
//
// Named locks belong to the whole server, not to a database or a table: two
// applications (or staging and production) that share a server and use the
// same keys with this strategy exclude each other, whatever their databases
// and Options.Table. Prefix keys per application where that matters.
//
// Not for Galera (GET_LOCK is not replicated: NewGetLock's first use fails
// with ErrGalera), Group Replication or proxies that multiplex sessions.
type GetLock struct {
	db      *sql.DB
	s       *sessions
	bell    bool // a lease's doorbell: "dbell" names, no fencing row
	mu      sync.Mutex
	main    *session                 // takes the uncontended locks
	byToken map[dlock.Token]*session // where each held or pending token is
}

var (
	_ dlock.Backend       = (*GetLock)(nil)
	_ dlock.Waiter        = (*GetLock)(nil)
	_ dlock.Lister        = (*GetLock)(nil)
	_ dlock.ForceReleaser = (*GetLock)(nil)
)

// NewGetLock returns the getlock strategy over db, whose connections it pins
// for held locks. It does no I/O; Migrate (any strategy's) creates the
// fencing table. Call Close to return the pinned connections.
func NewGetLock(db *sql.DB, opts *Options) (*GetLock, error) {
	table, err := checkArgs(db == nil, opts)
	if err != nil {
		return nil, err
	}
	return &GetLock{db: db, s: newSessions(db, strings.TrimSuffix(table, "`")+"_session`")}, nil
}

// Close releases every lock still held and returns the pinned connections to
// the pool. It does not close the *sql.DB.
func (g *GetLock) Close() error {
	g.mu.Lock()
	g.main = nil
	g.mu.Unlock()
	g.s.closeAll()
	return nil
}

// mainSession reserves req.Key on the shared session, opening it if needed,
// and sets the session's wait_timeout to what its locks need; false if the
// session holds the key already. Reserving and setting under g.mu keeps a
// concurrent acquisition from lowering wait_timeout below a TTL it has not
// seen. A session found gone is replaced once.
func (g *GetLock) mainSession(ctx context.Context, req dlock.Request) (*session, bool, error) {
	for try := 0; ; try++ {
		g.mu.Lock()
		if g.main == nil || g.main.broken.Load() {
			ss, err := g.s.open(ctx, req.TTL)
			if err != nil {
				g.mu.Unlock()
				return nil, false, err
			}
			g.main = ss
		}
		ss := g.main
		if !g.reserveLocked(ss, req) {
			g.mu.Unlock()
			return nil, false, nil
		}
		sctx, cancel := detached(ctx)
		err := g.s.cover(sctx, ss, ss.need())
		cancel()
		g.mu.Unlock()
		if err == nil {
			return ss, true, nil
		}
		if !sessionLost(err) {
			g.forget(ss, req.Key, err)
			return nil, false, err
		}
		g.dropSession(ss)
		if try > 0 {
			return nil, false, err
		}
	}
}

// reserve marks req.Key as being taken on ss; false if ss holds it already
// (GET_LOCK is re-entrant per session, so a second GET_LOCK would succeed).
func (g *GetLock) reserve(ss *session, req dlock.Request) bool {
	g.mu.Lock()
	defer g.mu.Unlock()
	return g.reserveLocked(ss, req)
}

// reserveLocked is reserve for a caller that holds g.mu.
func (g *GetLock) reserveLocked(ss *session, req dlock.Request) bool {
	if _, ok := ss.keys[req.Key]; ok {
		return false
	}
	ss.add(req.Key, req.Token, req.TTL)
	if g.byToken == nil {
		g.byToken = make(map[dlock.Token]*session)
	}
	g.byToken[req.Token] = ss
	return true
}

// forget drops key from ss and lowers the session's wait_timeout to what
// its other locks need; a session left holding nothing (other than the
// main one) goes back to the pool, a broken one is discarded.
func (g *GetLock) forget(ss *session, key string, err error) {
	g.mu.Lock()
	if h, ok := ss.keys[key]; ok {
		delete(g.byToken, h.token)
		ss.remove(key)
	}
	if sessionLost(err) {
		ss.broken.Store(true)
	}
	if len(ss.keys) > 0 && !ss.broken.Load() {
		ctx, cancel := context.WithTimeout(context.Background(), statementTimeout)
		if err := g.s.cover(ctx, ss, ss.need()); sessionLost(err) {
			ss.broken.Store(true) // its holders learn it at their next renewal
		}
		cancel()
	}
	done := ss != g.main && len(ss.keys) == 0 || ss.broken.Load()
	if ss.broken.Load() && ss == g.main {
		g.main = nil
	}
	g.mu.Unlock()
	if done {
		g.s.close(ss)
	}
}

// Acquire implements dlock.Backend: GET_LOCK(name, 0) on the main session.
// If the main session turns out to be gone (the server drops idle sessions
// after their wait_timeout), it is replaced and the attempt made once more.
func (g *GetLock) Acquire(ctx context.Context, req dlock.Request) (dlock.Result, error) {
	for try := 0; ; try++ {
		ss, ok, err := g.mainSession(ctx, req)
		if err != nil {
			return dlock.Result{}, wrapErr(g.s.table, "getlock acquire", err)
		}
		if !ok {
			return g.notAcquired(ctx, req.Key), nil
		}
		res, err := g.take(ctx, ss, req, 0, time.Now())
		if try == 0 && ss.broken.Load() && !res.Acquired {
			continue
		}
		return res, err
	}
}

// maxWait bounds one server-side wait; the Locker calls AcquireWait again.
const maxWait = 30 * time.Second

// AcquireWait implements dlock.Waiter: a blocking GET_LOCK on a session of
// its own, killed with KILL QUERY when ctx ends.
func (g *GetLock) AcquireWait(ctx context.Context, req dlock.Request) (dlock.Result, error) {
	return g.acquireWait(ctx, req, maxWait)
}

// acquireWait is AcquireWait bounded by bound in the server: GET_LOCK's own
// timeout ends the wait and returns 0, and the session is kept for reuse
// (a wait ended by ctx is killed, and its session dropped).
func (g *GetLock) acquireWait(ctx context.Context, req dlock.Request, bound time.Duration) (dlock.Result, error) {
	began := time.Now()
	ss, err := g.s.open(ctx, req.TTL)
	if err != nil {
		return dlock.Result{}, wrapErr(g.s.table, "getlock acquire", err)
	}
	g.reserve(ss, req)
	wait := bound
	if d, ok := ctx.Deadline(); ok {
		wait = min(wait, time.Until(d))
	}
	return g.take(ctx, ss, req, max(wait, 0), began)
}

// take runs GET_LOCK on ss (reserved for req.Key) and records the grant.
//
// Statements on a session never run under the caller's ctx: the driver
// closes the connection when a statement's context ends, which would drop
// every lock of the session. They run under detached(ctx) instead, and a
// blocking wait is interrupted with KILL QUERY when ctx ends.
//
// The grant's SentAfter (relative to began) is when the statement recording
// it was sent on the session: the session's wait_timeout counts from its
// last statement, so a long wait does not shorten the lease.
func (g *GetLock) take(ctx context.Context, ss *session, req dlock.Request, wait time.Duration, began time.Time) (dlock.Result, error) {
	name := g.name(req.Key)
	var got sql.NullInt64
	var err error
	if wait == 0 {
		sctx, cancel := detached(ctx)
		err = ss.queryRow(sctx, "SELECT GET_LOCK(?, 0)", []any{name}, &got)
		cancel()
	} else {
		stop := context.AfterFunc(ctx, func() { g.kill(ss.id) })
		sctx, cancel := context.WithTimeout(context.WithoutCancel(ctx), wait+statementTimeout)
		err = ss.conn.QueryRowContext(sctx, "SELECT GET_LOCK(?, ?)", name, wait.Seconds()).Scan(&got)
		cancel()
		if !stop() {
			// ctx ended: whatever the wait's outcome, drop the session so
			// that no grant can outlive it.
			g.forget(ss, req.Key, errAbandoned)
			return dlock.Result{}, nil
		}
	}
	if err != nil || got.Int64 != 1 {
		g.forget(ss, req.Key, err)
		if err != nil {
			return dlock.Result{}, wrapErr(g.s.table, "getlock acquire", err)
		}
		return g.notAcquired(ctx, req.Key), nil
	}
	if g.bell {
		return dlock.Result{Acquired: true}, nil
	}
	sctx, cancel := detached(ctx)
	defer cancel()
	granting := time.Now()
	fence, err := g.s.grant(sctx, ss, ss, req, name)
	if err != nil {
		if !sessionLost(err) {
			_, err2 := ss.ExecContext(sctx, "DO RELEASE_LOCK(?)", name)
			err = errors.Join(err, err2)
		}
		g.forget(ss, req.Key, err)
		return dlock.Result{}, wrapErr(g.s.table, "getlock acquire", err)
	}
	return dlock.Result{Acquired: true, Fence: fence, SentAfter: granting.Sub(began)}, nil
}

// notAcquired describes the key's last holder (doorbells have no record).
func (g *GetLock) notAcquired(ctx context.Context, key string) dlock.Result {
	if g.bell {
		return dlock.Result{Holder: dlock.LockInfo{Key: key}}
	}
	return g.s.notAcquired(ctx, key)
}

// name is key's GET_LOCK name.
func (g *GetLock) name(key string) string {
	if g.bell {
		return lockName("dbell", key)
	}
	return lockName("dlock", key)
}

// kill interrupts the statement running on session id.
func (g *GetLock) kill(id int64) { killQuery(g.db, id) }

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
// CONNECTION_ID()), which also keeps the session from timing out.
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
		sctx, cancel := detached(ctx)
		err := ss.queryRow(sctx, q, args, dest...)
		cancel()
		for j, i := range idx {
			switch {
			case sessionLost(err):
				errs[i] = fmt.Errorf("%w: session lost: %v", dlock.ErrNotHeld, err)
			case err != nil:
				errs[i] = wrapErr(g.s.table, "getlock extend", err)
			case ids[j+1].Int64 != ids[0].Int64:
				errs[i] = dlock.ErrNotHeld
			}
		}
		if sessionLost(err) {
			g.dropSession(ss)
		}
	}
	return errs, nil
}

// dropSession discards a session whose connection is gone.
func (g *GetLock) dropSession(ss *session) {
	g.mu.Lock()
	ss.broken.Store(true)
	for _, h := range ss.keys {
		delete(g.byToken, h.token)
	}
	clear(ss.keys)
	clear(ss.secs)
	if g.main == ss {
		g.main = nil
	}
	g.mu.Unlock()
	g.s.close(ss)
}

// Release implements dlock.Backend.
func (g *GetLock) Release(ctx context.Context, key string, token dlock.Token) error {
	ss := g.holding(key, token)
	if ss == nil {
		return dlock.ErrNotHeld
	}
	var got sql.NullInt64
	sctx, cancel := detached(ctx)
	err := ss.queryRow(sctx, "SELECT RELEASE_LOCK(?)", []any{g.name(key)}, &got)
	cancel()
	g.forget(ss, key, err)
	switch {
	case sessionLost(err):
		return fmt.Errorf("%w: session lost: %v", dlock.ErrNotHeld, err)
	case err != nil:
		return wrapErr(g.s.table, "getlock release", err)
	case got.Int64 != 1:
		return dlock.ErrNotHeld
	}
	return nil
}

// ForceRelease implements dlock.ForceReleaser. MySQL cannot release another
// session's named lock, so this kills the holder's session: every lock that
// session held is freed, and its holders learn it at their next renewal.
func (g *GetLock) ForceRelease(ctx context.Context, key string) error {
	var id sql.NullInt64
	if err := g.db.QueryRowContext(ctx, "SELECT IS_USED_LOCK(?)", g.name(key)).Scan(&id); err != nil {
		return wrapErr(g.s.table, "getlock force release", err)
	}
	if !id.Valid {
		return dlock.ErrNotHeld
	}
	if _, err := g.db.ExecContext(ctx, fmt.Sprintf("KILL CONNECTION %d", id.Int64)); err != nil {
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
