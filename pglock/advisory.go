package pglock

import (
	"context"
	"errors"
	"fmt"
	"math"
	"sync"
	"sync/atomic"
	"time"

	"github.com/dlock-dev/dlock"
	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgconn"
	"github.com/jackc/pgx/v5/pgxpool"
)

// ErrTransactionPooling is returned by the advisory strategy when a pinned
// connection turns out not to be one server session: pg_backend_pid()
// changed between its statements, as it does behind PgBouncer (or another
// pooler) in transaction or statement pooling mode. Session-level advisory
// locks are not safe there: use the lease strategy (New), or session pooling.
var ErrTransactionPooling = errors.New("pglock: the connection's server session changed between statements (a pooler in transaction mode?); advisory locks need session pooling: use the lease strategy")

// Advisory is the advisory strategy: session-level advisory locks
// (pg_try_advisory_lock, pg_advisory_lock) held by connections pinned from
// the caller's pool. It is safe for concurrent use. Create it with
// NewAdvisory and Close it to give the pinned connections back.
//
// Guarantees and trade-offs:
//
//   - A holder that crashes loses its connection, and the server frees its
//     locks at once. A holder that stops talking (paused, partitioned) is
//     dropped by the server after idle_session_timeout, which each pinned
//     session sets to the longest TTL it serves (PostgreSQL 14+), while
//     renewal checks every TTL/3 that the session still holds each lock (in
//     pg_locks, for its own backend pid) and reports a loss otherwise, for
//     example after pg_terminate_backend.
//   - Uncontended locks share one session however many there are. Each
//     blocked waiter, and each lock it was granted, uses a session of its own
//     until released; released sessions are kept for reuse.
//   - Waiting happens in the server (pg_advisory_lock), which hands the lock
//     to the first waiter the moment it is released. A wait whose context
//     ends is cancelled with a cancel request; if the lock was granted
//     anyway its session is closed, so no grant outlives the wait.
//   - Advisory locks are re-entrant per session, so the Advisory itself
//     refuses a second grant of a lock its sessions already hold.
//   - Fencing tokens come from a per-key counter row (the "_session" table)
//     bumped on every grant while the lock is held.
//   - Keys are hashed to 64 bits (AdvisoryKeys) and locked with the two-int
//     form of the functions, which PostgreSQL keeps apart from the bigint
//     form applications use. Two distinct keys that collide (about one
//     chance in 2^64 per pair) exclude each other: a false contention,
//     never a shared grant. The table keeps the original key for List.
//   - Advisory locks live in one database of one server: not replicated, and
//     unsafe behind a pooler in transaction or statement mode, where two
//     statements of a "session" can run on different server sessions (see
//     ErrTransactionPooling: every statement on a pinned session checks
//     pg_backend_pid(), which catches such a pooler as soon as it switches).
type Advisory struct {
	pool *pgxpool.Pool
	tb   tables

	mainMu sync.Mutex // serialises opening the main session
	mu     sync.Mutex
	main   *session          // takes uncontended locks
	held   map[uint64]*hold  // by lock id
	idle   []*session        // sessions holding nothing, kept for reuse
	all    map[*session]bool // every pinned session
	closed bool
	q      advisoryQueries

	// afterUnlock, if set (tests only), runs in Release between the unlock
	// statement and the bookkeeping that follows it.
	afterUnlock func()
}

// hold is a lock this process holds; its fields after ss are guarded by
// Advisory.mu.
type hold struct {
	id    uint64
	key   string
	token dlock.Token
	ss    *session
	// releasing: Release has sent (or is about to send) the unlock. From
	// then on the server may grant the key to another session of this
	// process, which must not take the hold for a local holder.
	releasing bool
	// done: the hold has left the books (released, found gone, or its
	// session lost) and no longer counts in ss.n.
	done bool
}

// session is a pinned connection.
type session struct {
	mu       sync.Mutex // serialises statements
	conn     *pgxpool.Conn
	pid      uint32
	timeout  atomic.Int64 // idle_session_timeout as set, in ns (0: not set)
	lastUsed atomic.Int64 // UnixNano of the last statement
	n        int          // locks held; guarded by Advisory.mu
	broken   atomic.Bool
}

var (
	_ dlock.Backend       = (*Advisory)(nil)
	_ dlock.Waiter        = (*Advisory)(nil)
	_ dlock.Lister        = (*Advisory)(nil)
	_ dlock.ForceReleaser = (*Advisory)(nil)
)

// NewAdvisory returns the advisory strategy over pool, whose connections it
// pins while it holds locks. It does no I/O; Migrate (of either strategy)
// creates the fencing table. The error matches dlock.ErrInvalidOption for a
// nil pool or a bad table name.
func NewAdvisory(pool *pgxpool.Pool, opts *Options) (*Advisory, error) {
	tb, _, err := checkArgs(pool == nil, opts)
	if err != nil {
		return nil, err
	}
	return &Advisory{pool: pool, tb: tb, held: make(map[uint64]*hold), all: make(map[*session]bool),
		q: newAdvisoryQueries(tb)}, nil
}

// Migrate creates the tables of both strategies if they do not exist.
func (a *Advisory) Migrate(ctx context.Context) error { return migrate(ctx, a.pool, a.tb) }

// Close unlocks every lock still held and gives the pinned connections back
// to the pool. It does not close the pool.
func (a *Advisory) Close() error {
	a.mu.Lock()
	a.closed = true
	all := make([]*session, 0, len(a.all))
	for ss := range a.all {
		all = append(all, ss)
	}
	clear(a.held)
	a.idle, a.main = nil, nil
	a.mu.Unlock()
	for _, ss := range all {
		a.discard(ss)
	}
	return nil
}

// AdvisoryKeys returns the two int4 arguments of pg_advisory_lock that the
// advisory strategy uses for key: the first 8 bytes of SHA-256("dlock:"+key),
// split into halves. They appear in pg_locks as classid and objid (as
// unsigned oids) with objsubid 2.
func AdvisoryKeys(key string) (int32, int32) { return split(hashKey(key)) }

func split(id uint64) (int32, int32) { return int32(id >> 32), int32(id) }

type advisoryQueries struct {
	try, wait, check, holder, list string
}

// The grant statements take the lock and, only if they got it, bump the
// key's fencing row in the same statement. A session-level advisory lock
// survives the rollback of a failed statement, so after an error the lock is
// unlocked (or the session closed).
func newAdvisoryQueries(tb tables) advisoryQueries {
	s := tb.session
	grant := func(lock string) string {
		return `WITH l AS MATERIALIZED (SELECT ` + lock + `),
g AS (
  INSERT INTO ` + s + ` AS s (name, lock_id, token, owner, fence, pid, acquired_at, metadata)
  SELECT $3, $4, $5, $6, 1, pg_backend_pid(), clock_timestamp(), $7 FROM l WHERE l.ok
  ON CONFLICT (name) DO UPDATE SET lock_id = EXCLUDED.lock_id, token = EXCLUDED.token, owner = EXCLUDED.owner,
    fence = s.fence + 1, pid = EXCLUDED.pid, acquired_at = EXCLUDED.acquired_at, metadata = EXCLUDED.metadata
  RETURNING s.fence
)
SELECT l.ok, (SELECT fence FROM g), pg_backend_pid() FROM l`
	}
	const ours = `l.locktype = 'advisory' AND l.granted AND l.objsubid = 2
  AND l.database = (SELECT oid FROM pg_database WHERE datname = current_database())`
	return advisoryQueries{
		try:  grant(`pg_try_advisory_lock($1::int4, $2::int4) AS ok`),
		wait: grant(`true AS ok FROM (SELECT pg_advisory_lock($1::int4, $2::int4)) w`),
		// check returns the session's pid and the indexes (1-based) of the
		// locks in $1/$2 that it does not hold.
		check: `SELECT pg_backend_pid(), COALESCE((SELECT array_agg(x.i) FROM unnest($1::int4[], $2::int4[]) WITH ORDINALITY AS x(a, b, i)
  WHERE NOT EXISTS (SELECT FROM pg_locks l WHERE ` + ours + ` AND l.pid = pg_backend_pid()
    AND l.classid = x.a::oid AND l.objid = x.b::oid)), '{}')`,
		holder: `SELECT name, token, owner, fence, metadata, acquired_at FROM ` + s + ` WHERE name = $1`,
		list: `SELECT s.name, s.token, s.owner, s.fence, s.metadata, s.acquired_at FROM ` + s + ` s
WHERE substring(s.name FROM 1 FOR octet_length($1::bytea)) = $1::bytea
  AND EXISTS (SELECT FROM pg_locks l WHERE ` + ours + ` AND l.pid = s.pid
    AND l.classid = ((s.lock_id >> 32) & 4294967295)::oid AND l.objid = (s.lock_id & 4294967295)::oid)
ORDER BY s.name`,
	}
}

// statementTimeout bounds a statement on a pinned session. Statements there
// do not run under the caller's context: pgx closes the connection when a
// statement's context ends, which would drop every lock of the session.
const statementTimeout = 10 * time.Second

// sessionCtx is the context of a statement on a pinned session.
func sessionCtx(ctx context.Context) (context.Context, context.CancelFunc) {
	return context.WithTimeout(context.WithoutCancel(ctx), statementTimeout)
}

// sessionLost reports whether err leaves a session unusable: anything but an
// error the server reported for the statement, or a server error that ends
// the session (class 57P: admin shutdown, terminated, ...; 08: connection).
func sessionLost(err error) bool {
	if err == nil {
		return false
	}
	var pe *pgconn.PgError
	if !errors.As(err, &pe) {
		return true
	}
	return len(pe.Code) == 5 && (pe.Code[:3] == "57P" || pe.Code[:2] == "08") || pe.Severity == "FATAL"
}

// open pins a session (a parked one if possible) whose idle_session_timeout
// covers ttl.
func (a *Advisory) open(ctx context.Context, ttl time.Duration) (*session, error) {
	for {
		a.mu.Lock()
		if a.closed {
			a.mu.Unlock()
			return nil, dlock.ErrClosed
		}
		var ss *session
		if n := len(a.idle); n > 0 {
			ss = a.idle[n-1]
			a.idle = a.idle[:n-1]
		}
		a.mu.Unlock()
		if ss == nil {
			break
		}
		if a.fresh(ss) {
			if err := a.cover(ctx, ss, ttl); err == nil {
				return ss, nil
			}
		}
		a.discard(ss)
	}
	c, err := a.pool.Acquire(ctx)
	if err != nil {
		return nil, err
	}
	ss := &session{conn: c}
	ss.touch()
	sctx, cancel := sessionCtx(ctx)
	defer cancel()
	if err := c.QueryRow(sctx, "SELECT pg_backend_pid()").Scan(&ss.pid); err != nil {
		closeConn(c)
		return nil, err
	}
	if err := a.cover(ctx, ss, ttl); err != nil {
		closeConn(c)
		return nil, err
	}
	a.mu.Lock()
	a.all[ss] = true
	a.mu.Unlock()
	return ss, nil
}

// fresh reports whether a session holding nothing can be reused: the server
// ends sessions idle for idle_session_timeout, so keep a margin.
func (a *Advisory) fresh(ss *session) bool {
	timeout := time.Duration(ss.timeout.Load())
	idle := time.Since(time.Unix(0, ss.lastUsed.Load()))
	return !ss.broken.Load() && (timeout == 0 || idle < timeout/2)
}

// touch records a statement on the session.
func (ss *session) touch() { ss.lastUsed.Store(time.Now().UnixNano()) }

// cover raises the session's idle_session_timeout to ttl (whole seconds,
// rounded up), so that the server drops the session, and its locks, when
// the holder stops talking for longer than its lease. Servers before
// PostgreSQL 14 lack the setting; there only TCP keepalives notice.
func (a *Advisory) cover(ctx context.Context, ss *session, ttl time.Duration) error {
	want := time.Duration(math.Ceil(ttl.Seconds())) * time.Second
	ss.mu.Lock()
	defer ss.mu.Unlock()
	if want <= time.Duration(ss.timeout.Load()) {
		return nil
	}
	sctx, cancel := sessionCtx(ctx)
	defer cancel()
	_, err := ss.conn.Exec(sctx, fmt.Sprintf("SET idle_session_timeout = %d", want.Milliseconds()))
	var pe *pgconn.PgError
	if errors.As(err, &pe) && pe.Code == "42704" { // unrecognized configuration parameter
		err = nil
	}
	if err != nil {
		ss.broken.Store(true)
		return err
	}
	ss.timeout.Store(int64(want))
	ss.touch()
	return nil
}

// closeConn closes a pinned connection, ending its session and its locks,
// and lets the pool forget it.
func closeConn(c *pgxpool.Conn) {
	ctx, cancel := context.WithTimeout(context.Background(), time.Second)
	_ = c.Conn().Close(ctx)
	cancel()
	c.Release()
}

// discard gives a session back to the pool after dropping its locks and
// settings, or closes it if it is broken.
func (a *Advisory) discard(ss *session) {
	a.mu.Lock()
	delete(a.all, ss)
	a.mu.Unlock()
	ss.mu.Lock()
	defer ss.mu.Unlock()
	if ss.conn == nil {
		return
	}
	c := ss.conn
	ss.conn = nil
	if !ss.broken.Load() {
		ctx, cancel := context.WithTimeout(context.Background(), 5*time.Second)
		_, err := c.Exec(ctx, "SELECT pg_advisory_unlock_all(); RESET idle_session_timeout")
		cancel()
		if err == nil {
			c.Release()
			return
		}
	}
	closeConn(c)
}

// park keeps a session that holds nothing for reuse (the main session stays
// where it is).
func (a *Advisory) park(ss *session) {
	a.mu.Lock()
	if ss.n > 0 || ss == a.main {
		a.mu.Unlock()
		return
	}
	if !a.closed && !ss.broken.Load() && len(a.idle) < maxIdle {
		a.idle = append(a.idle, ss)
		a.mu.Unlock()
		return
	}
	a.mu.Unlock()
	a.discard(ss)
}

// maxIdle bounds the sessions kept for reuse.
const maxIdle = 4

// mainSession returns the session that takes uncontended locks, replacing
// it if it is broken or holds nothing and may have timed out.
func (a *Advisory) mainSession(ctx context.Context, ttl time.Duration) (*session, error) {
	a.mainMu.Lock()
	defer a.mainMu.Unlock()
	a.mu.Lock()
	ss := a.main
	stale := ss != nil && (ss.broken.Load() || ss.n == 0 && !a.fresh(ss))
	if stale {
		a.main = nil
	}
	a.mu.Unlock()
	if stale {
		a.dropHolds(ss)
		a.discard(ss)
		ss = nil
	}
	if ss == nil {
		var err error
		if ss, err = a.open(ctx, ttl); err != nil {
			return nil, err
		}
		a.mu.Lock()
		a.main = ss
		a.mu.Unlock()
		return ss, nil
	}
	return ss, a.cover(ctx, ss, ttl)
}

// dropHolds forgets the locks of a session that is gone.
func (a *Advisory) dropHolds(ss *session) {
	a.mu.Lock()
	defer a.mu.Unlock()
	for id, h := range a.held {
		if h.ss == ss {
			delete(a.held, id)
			h.done = true
		}
	}
	ss.n = 0
	if a.main == ss {
		a.main = nil
	}
}

// lost marks a session gone: its locks are dropped by the server.
func (a *Advisory) lost(ss *session) {
	ss.broken.Store(true)
	a.dropHolds(ss)
	a.discard(ss)
}

// heldLocally returns the local holder of id, if any.
func (a *Advisory) heldLocally(id uint64) *hold {
	a.mu.Lock()
	defer a.mu.Unlock()
	h := a.held[id]
	if h != nil && (h.ss.broken.Load() || h.releasing) {
		return nil
	}
	return h
}

// Acquire implements dlock.Backend: pg_try_advisory_lock on the main
// session, and the fencing row in the same statement. If the main session
// turns out to be gone it is replaced and the attempt made once more.
func (a *Advisory) Acquire(ctx context.Context, req dlock.Request) (dlock.Result, error) {
	id := hashKey(req.Key)
	for try := 0; try < 2; try++ {
		if h := a.heldLocally(id); h != nil {
			return a.notAcquired(ctx, req.Key, h), nil
		}
		if err := ctx.Err(); err != nil {
			return dlock.Result{}, err
		}
		ss, err := a.mainSession(ctx, req.TTL)
		if err != nil {
			return dlock.Result{}, wrapErr(a.tb, "advisory acquire", err)
		}
		ss.mu.Lock()
		// Checked again under the session's lock: a second grant on the
		// same session would succeed (advisory locks are re-entrant).
		if h := a.heldLocally(id); h != nil {
			ss.mu.Unlock()
			return a.notAcquired(ctx, req.Key, h), nil
		}
		ok, fence, err := a.grant(ctx, ss, a.q.try, id, req, statementTimeout)
		if ok {
			a.record(id, req, ss)
		}
		ss.mu.Unlock()
		if sessionLost(err) {
			// Whatever the statement did died with the session.
			a.lost(ss)
			if try == 0 && !errors.Is(err, ErrTransactionPooling) {
				continue
			}
		}
		if err != nil {
			return dlock.Result{}, wrapErr(a.tb, "advisory acquire", err)
		}
		if !ok {
			return a.notAcquired(ctx, req.Key, nil), nil
		}
		return dlock.Result{Acquired: true, Fence: fence}, nil
	}
	return dlock.Result{}, fmt.Errorf("pglock: advisory acquire: session lost twice")
}

// record notes a grant.
func (a *Advisory) record(id uint64, req dlock.Request, ss *session) {
	a.mu.Lock()
	// A hold being released may still be here: the server granted the key
	// because its unlock went through. Its Release does its accounting.
	a.held[id] = &hold{id: id, key: req.Key, token: req.Token, ss: ss}
	ss.n++
	a.mu.Unlock()
}

// grant runs a grant statement on ss (whose mu the caller holds) and checks
// that the session is still the one it was. After an error that leaves the
// session usable it unlocks what the statement may have locked.
func (a *Advisory) grant(ctx context.Context, ss *session, q string, id uint64, req dlock.Request, timeout time.Duration) (bool, uint64, error) {
	if ss.conn == nil {
		// Discarded since the caller picked it: a renewal on it found it
		// lost, or Close. Nothing was sent; the error reads as a lost session.
		return false, 0, errors.New("pglock: session closed")
	}
	k1, k2 := split(id)
	var ok bool
	var fence *int64
	var pid uint32
	sctx, cancel := context.WithTimeout(context.WithoutCancel(ctx), timeout)
	defer cancel()
	err := ss.conn.QueryRow(sctx, q, k1, k2, []byte(req.Key), int64(id), req.Token[:], req.Owner, req.Metadata).
		Scan(&ok, &fence, &pid)
	ss.touch()
	switch {
	case err == nil && pid != ss.pid:
		ss.broken.Store(true)
		return false, 0, ErrTransactionPooling
	case err == nil && ok && fence == nil:
		err = errors.New("pglock: no fence from the grant")
	case err == nil:
		if !ok {
			return false, 0, nil
		}
		return true, uint64(*fence), nil
	}
	if !sessionLost(err) {
		_, uerr := ss.conn.Exec(sctx, "SELECT pg_advisory_unlock($1::int4, $2::int4)", k1, k2)
		if uerr != nil {
			ss.broken.Store(true)
			err = errors.Join(err, uerr)
		}
	}
	return false, 0, err
}

// notAcquired describes the holder: the local one, or the key's last grant.
func (a *Advisory) notAcquired(ctx context.Context, key string, h *hold) dlock.Result {
	if h != nil && h.key == key {
		return dlock.Result{Holder: dlock.LockInfo{Key: key, Token: h.token}}
	}
	var r holderRow
	err := a.pool.QueryRow(ctx, a.q.holder, []byte(key)).Scan(&r.name, &r.token, &r.owner, &r.fence, &r.metadata, &r.acquiredAt)
	if err != nil {
		return dlock.Result{Holder: dlock.LockInfo{Key: key}}
	}
	info, _ := r.info(key, time.Now())
	return dlock.Result{Holder: info}
}

// AcquireWait implements dlock.Waiter: pg_advisory_lock on a session of its
// own, for up to 30 s. When ctx ends first the wait is cancelled with a
// cancel request; a grant that raced with the cancellation is undone by
// closing the session.
func (a *Advisory) AcquireWait(ctx context.Context, req dlock.Request) (dlock.Result, error) {
	began := time.Now()
	ss, err := a.open(ctx, req.TTL)
	if err != nil {
		if ctx.Err() != nil {
			return dlock.Result{}, nil
		}
		return dlock.Result{}, wrapErr(a.tb, "advisory acquire", err)
	}
	id := hashKey(req.Key)
	type outcome struct {
		ok    bool
		fence uint64
		err   error
	}
	done := make(chan outcome, 1)
	ss.mu.Lock()
	go func() {
		ok, fence, err := a.grant(context.Background(), ss, a.q.wait, id, req, maxWait+statementTimeout)
		done <- outcome{ok, fence, err}
	}()
	t := time.NewTimer(maxWait)
	var out outcome
	var granted time.Time
	cancelled := false
	select {
	case out = <-done:
		granted = time.Now()
	case <-ctx.Done():
		cancelled = true
	case <-t.C:
		cancelled = true
	}
	t.Stop()
	if cancelled {
		cctx, cancel := context.WithTimeout(context.Background(), 5*time.Second)
		if ss.conn != nil { // nil if Close discarded it
			_ = ss.conn.Conn().PgConn().CancelRequest(cctx)
		}
		cancel()
		out = <-done
	}
	ss.mu.Unlock()
	if cancelled {
		// Granted or not, a cancel request may still be in flight and hit a
		// later statement: close the session, which ends any grant.
		ss.broken.Store(true)
		a.discard(ss)
		return dlock.Result{}, nil
	}
	if out.err != nil {
		if sessionLost(out.err) {
			ss.broken.Store(true)
		}
		a.park(ss)
		return dlock.Result{}, wrapErr(a.tb, "advisory acquire", out.err)
	}
	if h := a.heldLocally(id); h != nil {
		// Cannot happen (the server excludes other sessions); refuse.
		a.lost(ss)
		return dlock.Result{}, fmt.Errorf("pglock: advisory lock of %q granted twice in one process", req.Key)
	}
	a.record(id, req, ss)
	// The session's idle_session_timeout counts from the reply that
	// granted the lock, which came before it was received by one network
	// trip (the Locker's margin covers that), not from the wait's start.
	return dlock.Result{Acquired: true, Fence: out.fence, SentAfter: granted.Sub(began)}, nil
}

// holding returns the session where token holds key.
func (a *Advisory) holding(key string, token dlock.Token) (uint64, *session) {
	id := hashKey(key)
	a.mu.Lock()
	defer a.mu.Unlock()
	if h := a.held[id]; h != nil && h.key == key && h.token == token && !h.ss.broken.Load() {
		return id, h.ss
	}
	return id, nil
}

// beginRelease returns the hold of key and token, marked as being released,
// or nil if this process does not hold it.
func (a *Advisory) beginRelease(key string, token dlock.Token) *hold {
	id := hashKey(key)
	a.mu.Lock()
	defer a.mu.Unlock()
	h := a.held[id]
	if h == nil || h.key != key || h.token != token || h.ss.broken.Load() || h.releasing {
		return nil
	}
	h.releasing = true
	return h
}

// dropHold takes h off the books, once, and parks its session if that
// held nothing more.
func (a *Advisory) dropHold(h *hold) {
	a.mu.Lock()
	first := !h.done
	if first {
		h.done = true
		if a.held[h.id] == h {
			delete(a.held, h.id)
		}
		if h.ss.n > 0 {
			h.ss.n--
		}
	}
	a.mu.Unlock()
	if first {
		a.park(h.ss)
	}
}

// Extend implements dlock.Backend: one query per session checks that the
// server still grants each lock to that session (pg_locks, for its backend
// pid), which also keeps the session from going idle.
func (a *Advisory) Extend(ctx context.Context, leases []dlock.Lease) ([]error, error) {
	errs := make([]error, len(leases))
	bySession := map[*session][]int{}
	for i, l := range leases {
		if _, ss := a.holding(l.Key, l.Token); ss != nil {
			bySession[ss] = append(bySession[ss], i)
		} else {
			errs[i] = dlock.ErrNotHeld
		}
	}
	for ss, idx := range bySession {
		k1s, k2s := make([]int32, len(idx)), make([]int32, len(idx))
		for j, i := range idx {
			k1s[j], k2s[j] = AdvisoryKeys(leases[i].Key)
		}
		var pid uint32
		var missing []int64
		ss.mu.Lock()
		err := errors.New("session closed")
		if ss.conn != nil {
			sctx, cancel := sessionCtx(ctx)
			err = ss.conn.QueryRow(sctx, a.q.check, k1s, k2s).Scan(&pid, &missing)
			cancel()
			ss.touch()
		}
		ss.mu.Unlock()
		if err == nil && pid != ss.pid {
			err = ErrTransactionPooling
		}
		gone := make(map[int]bool, len(missing))
		for _, m := range missing {
			gone[int(m)-1] = true
		}
		for j, i := range idx {
			switch {
			case err != nil && (sessionLost(err) || errors.Is(err, ErrTransactionPooling)):
				errs[i] = fmt.Errorf("%w: session lost: %w", dlock.ErrNotHeld, err)
			case err != nil:
				errs[i] = wrapErr(a.tb, "advisory extend", err)
			case gone[j]:
				errs[i] = dlock.ErrNotHeld
				a.forget(hashKey(leases[i].Key), leases[i].Token)
			}
		}
		if err != nil && (sessionLost(err) || errors.Is(err, ErrTransactionPooling)) {
			a.lost(ss)
		}
	}
	return errs, nil
}

// forget drops a local hold that the server no longer grants.
func (a *Advisory) forget(id uint64, token dlock.Token) {
	a.mu.Lock()
	h := a.held[id]
	a.mu.Unlock()
	if h != nil && h.token == token {
		a.dropHold(h)
	}
}

// Release implements dlock.Backend: pg_advisory_unlock on the holding
// session. A session that holds nothing more is kept for reuse.
func (a *Advisory) Release(ctx context.Context, key string, token dlock.Token) error {
	h := a.beginRelease(key, token)
	if h == nil {
		return dlock.ErrNotHeld
	}
	ss := h.ss
	k1, k2 := split(h.id)
	var ok bool
	var pid uint32
	ss.mu.Lock()
	err := errors.New("session closed")
	if ss.conn != nil {
		sctx, cancel := sessionCtx(ctx)
		err = ss.conn.QueryRow(sctx, "SELECT pg_advisory_unlock($1::int4, $2::int4), pg_backend_pid()", k1, k2).Scan(&ok, &pid)
		cancel()
		ss.touch()
	}
	ss.mu.Unlock()
	if a.afterUnlock != nil {
		a.afterUnlock()
	}
	if err == nil && pid != ss.pid {
		err = ErrTransactionPooling
	}
	switch {
	case err != nil && (sessionLost(err) || errors.Is(err, ErrTransactionPooling)):
		a.lost(ss)
		return fmt.Errorf("%w: session lost: %w", dlock.ErrNotHeld, err)
	case err != nil:
		a.mu.Lock()
		mine := a.held[h.id] == h && !h.done
		if mine {
			h.releasing = false // the unlock may not have run: still held
		}
		a.mu.Unlock()
		if mine {
			return wrapErr(a.tb, "advisory release", err)
		}
		// Another session of this process was granted the key meanwhile,
		// so the server did unlock it.
		a.dropHold(h)
		return nil
	}
	a.dropHold(h)
	if !ok {
		return dlock.ErrNotHeld
	}
	return nil
}

// ForceRelease implements dlock.ForceReleaser. PostgreSQL cannot unlock
// another session's advisory lock, so this terminates the holder's session
// (pg_terminate_backend, waiting up to 5 s for it to end): every lock that
// session held is freed, and its holders learn it at their next renewal. It
// needs the right to signal that backend (same role, pg_signal_backend or
// superuser).
func (a *Advisory) ForceRelease(ctx context.Context, key string) error {
	k1, k2 := AdvisoryKeys(key)
	rows, err := a.pool.Query(ctx, `SELECT pg_terminate_backend(l.pid, 5000) FROM pg_locks l
WHERE l.locktype = 'advisory' AND l.granted AND l.objsubid = 2
  AND l.database = (SELECT oid FROM pg_database WHERE datname = current_database())
  AND l.classid = $1::int4::oid AND l.objid = $2::int4::oid`, k1, k2)
	if err != nil {
		return wrapErr(a.tb, "advisory force release", err)
	}
	oks, err := pgx.CollectRows(rows, pgx.RowTo[bool])
	if err != nil {
		return wrapErr(a.tb, "advisory force release", err)
	}
	if len(oks) == 0 {
		return dlock.ErrNotHeld
	}
	for _, ok := range oks {
		if !ok {
			return fmt.Errorf("pglock: advisory force release %q: the holder's session did not end within 5 s", key)
		}
	}
	return nil
}

// List implements dlock.Lister: the keys whose last grant's session still
// holds the advisory lock. ExpiresAt is zero: session locks last as long as
// the holder's session.
func (a *Advisory) List(ctx context.Context, prefix string) ([]dlock.LockInfo, error) {
	rows, err := a.pool.Query(ctx, a.q.list, []byte(prefix))
	if err != nil {
		return nil, wrapErr(a.tb, "advisory list", err)
	}
	defer rows.Close()
	var out []dlock.LockInfo
	for rows.Next() {
		var h holderRow
		if err := rows.Scan(&h.name, &h.token, &h.owner, &h.fence, &h.metadata, &h.acquiredAt); err != nil {
			return nil, wrapErr(a.tb, "advisory list", err)
		}
		info, _ := h.info("", time.Time{})
		out = append(out, info)
	}
	if err := rows.Err(); err != nil {
		return nil, wrapErr(a.tb, "advisory list", err)
	}
	return out, nil
}
