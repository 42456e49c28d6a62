package mysqllock

import (
	"context"
	"crypto/rand"
	"crypto/sha256"
	"database/sql"
	"database/sql/driver"
	"errors"
	"fmt"
	"log/slog"
	"math"
	"sort"
	"strings"
	"sync"
	"sync/atomic"
	"time"
	"unicode/utf8"

	"github.com/dlock-dev/dlock/internal/ctxend"

	"github.com/dlock-dev/dlock"
	"github.com/go-sql-driver/mysql"
)

// ErrGalera is returned by the session strategies (GetLock, RowLock) on a
// Galera cluster: named locks and InnoDB row locks are local to one node, so
// clients on two nodes would hold a key at once. Use the lease strategy
// (New) there.
var ErrGalera = errors.New("mysqllock: session locks are unsafe on Galera (wsrep_on=ON); use the lease strategy")

// ErrGaleraUnavailable is returned by any strategy when its Galera node
// refuses statements because it is not in the cluster's primary component
// (it lost its quorum) or not synced (WSREP error 1047). The outcome says
// nothing about the lock: neither granted nor refused, held nor lost. Retry
// on another node, or once the node has rejoined.
var ErrGaleraUnavailable = errors.New("mysqllock: Galera node not in the primary component or not synced")

// session is a connection pinned for holding session locks.
type session struct {
	idleSince   time.Time // when it was parked in sessions.idle
	conn        *sql.Conn
	id          int64              // CONNECTION_ID()
	mark        string             // rowlock: the name of its own mark (see ownMark)
	keys        map[string]keyHold // getlock: keys held or being taken on this session
	secs        map[int]int        // getlock: how many of keys need each wait_timeout
	waitTimeout atomic.Int64       // seconds, as set on the session
	broken      atomic.Bool        // the connection is gone or dubious
	own         bool               // counted in sessions.own (a waiter's session)
	waiting     atomic.Bool        // a blocking wait's statement may be running on it
	// mu serializes statements on conn: database/sql lets two goroutines
	// use one *sql.Conn at once, and the driver then breaks the connection
	// (a renewal check racing an acquisition would drop every lock of the
	// session).
	mu stmtLock
}

// stmtLock is a mutex that a caller can also try to take without waiting.
// It records when it was last unlocked: the end of the session's last
// statement, from which the server counts its wait_timeout.
type stmtLock struct {
	ch   chan struct{}
	last atomic.Int64 // UnixNano of the last Unlock
}

func newStmtLock() stmtLock { return stmtLock{ch: make(chan struct{}, 1)} }

func (l *stmtLock) Lock() { l.ch <- struct{}{} }
func (l *stmtLock) Unlock() {
	l.last.Store(time.Now().UnixNano())
	<-l.ch
}

// TryLock takes the lock if it is free.
func (l *stmtLock) TryLock() bool {
	select {
	case l.ch <- struct{}{}:
		return true
	default:
		return false
	}
}

// idleFor is how long ago the last statement under l ended (0 if none has).
func (l *stmtLock) idleFor() time.Duration {
	t := l.last.Load()
	if t == 0 {
		return 0
	}
	return time.Since(time.Unix(0, t))
}

// keyHold is a key held or being taken on a session.
type keyHold struct {
	token dlock.Token
	secs  int           // the wait_timeout that its TTL needs
	delay time.Duration // its grant's lock-delay
}

// waitSecs is the wait_timeout that a lease of ttl needs: whole seconds,
// rounded up, at least 1.
func waitSecs(ttl time.Duration) int { return max(1, int(math.Ceil(ttl.Seconds()))) }

// add records key, held by tok for ttl with a lock-delay, on the session.
func (ss *session) add(key string, tok dlock.Token, ttl, delay time.Duration) {
	n := waitSecs(ttl)
	ss.keys[key] = keyHold{tok, n, delay}
	ss.secs[n]++
}

// remove forgets key.
func (ss *session) remove(key string) {
	n := ss.keys[key].secs
	delete(ss.keys, key)
	if ss.secs[n]--; ss.secs[n] <= 0 {
		delete(ss.secs, n)
	}
}

// need is the wait_timeout that the session's locks need: the largest TTL
// (whole seconds), or 0 when it holds nothing.
func (ss *session) need() int {
	n := 0
	for s := range ss.secs {
		n = max(n, s)
	}
	return n
}

// ExecContext runs a statement on the session, serialized with its others.
func (ss *session) ExecContext(ctx context.Context, query string, args ...any) (sql.Result, error) {
	ss.mu.Lock()
	defer ss.mu.Unlock()
	return ss.conn.ExecContext(ctx, query, args...)
}

// queryRow runs a one-row query on the session, serialized with its others,
// and scans the row into dest.
func (ss *session) queryRow(ctx context.Context, query string, args []any, dest ...any) error {
	ss.mu.Lock()
	defer ss.mu.Unlock()
	return ss.conn.QueryRowContext(ctx, query, args...).Scan(dest...)
}

// sessions pins connections for the session strategies: from the caller's
// *sql.DB, or from a pool of its own over Options.Connector, outside the
// caller's pool and its limits.
//
// In the caller's pool a limit (SetMaxOpenConns) is shared with everything
// else: a session that holds nothing goes straight back to the pool, and
// sessions of their own (waiters) leave two connections to the rest (see
// ownSlots). Without a limit, or in a pool of their own, up to maxIdle
// sessions holding nothing are kept for reuse.
type sessions struct {
	db      *sql.DB // where sessions come from
	private bool    // db is a pool of its own, over Options.Connector
	table   string  // quoted session table
	// what names the strategy in errors; minConns is the smallest limit
	// of the caller's pool that it works with (0: no check).
	what     string
	minConns int
	mu       sync.Mutex
	all      map[*session]struct{}
	idle     []*session // healthy sessions holding nothing, kept for reuse
	own      int        // sessions of their own checked out (under mu)
	// keepTimeout leaves wait_timeout as the server has it (doorbells).
	keepTimeout bool
	// marked: each session holds its alive mark (see aliveMark) from its
	// opening (rowlock).
	marked bool
	// isolationVar is the name of the server's variable for the session's
	// isolation level, once read (see readCommitted).
	isolationVar atomic.Pointer[string]
	// galeraOK: a Galera node is no reason to refuse a session (the lease
	// strategy's doorbells on Options.Connector, whose named locks on that
	// one node serve the waiters of every node).
	galeraOK bool
	// galera is the Galera check's answer once the server has given one.
	// An error is no answer: it fails that check's caller only, and the
	// next session checks again.
	galera galeraProbe
	// grantQuery and grantAliveQuery record a grant (see grant).
	grantQuery, grantAliveQuery string
	// run and epochs are the quoted tables of the server run's epoch
	// (see epoch.go).
	run, epochs string
	// compacting is the running compaction of the session table (under
	// mu; see epoch.go), log where a compaction logs (nil: nowhere).
	compacting *compaction
	log        *slog.Logger
}

// newSessions returns the sessions of the lock table table (quoted).
func newSessions(db *sql.DB, table string) *sessions {
	st, run := sessionTable(table), runTable(table)
	return &sessions{db: db, table: st, run: run, epochs: epochTable(table), all: make(map[*session]struct{}),
		grantQuery: grantQuery(st, run, ""), grantAliveQuery: grantQuery(st, run, grantIfAlive)}
}

// connectorOnly hides every method of a connector but Connect and Driver,
// so that closing the pool built on it does not close the caller's
// connector (sql.DB.Close closes a connector that is an io.Closer).
type connectorOnly struct{ driver.Connector }

// forStrategy sets what the sessions are for and how small a caller's pool
// may be; with a connector, sessions come from a pool of their own.
func (s *sessions) forStrategy(what string, minConns int, c driver.Connector) *sessions {
	s.what, s.minConns = what, minConns
	if c != nil {
		s.db, s.private = sql.OpenDB(connectorOnly{c}), true
	}
	return s
}

// limit is the caller's pool limit that sessions count against (0: none).
func (s *sessions) limit() int {
	if s.private {
		return 0
	}
	return s.db.Stats().MaxOpenConnections
}

// checkPool refuses a caller's pool too small for the strategy (its limit
// may have been lowered after New).
func (s *sessions) checkPool() error {
	if n := s.limit(); n > 0 && n < s.minConns {
		return fmt.Errorf("%w: mysqllock: %s needs a pool of at least %d connections, db has SetMaxOpenConns(%d): raise it, or set Options.Connector to pin sessions outside the pool",
			dlock.ErrInvalidOption, s.what, s.minConns, n)
	}
	return nil
}

// ownSlots is how many sessions of their own (waiters, and the locks they
// were handed) may be checked out of a caller's pool with a limit: all but
// one connection for the shared session and one for every other statement
// (renewals of leases, KILL QUERY, reads of the session table). -1: no
// bound.
func (s *sessions) ownSlots() int {
	n := s.limit()
	if n == 0 {
		return -1
	}
	return max(n-2, 0)
}

// errNoSlot means that a session of its own would take a connection that the
// caller's pool cannot spare.
var errNoSlot = errors.New("mysqllock: no connection to spare for a session of its own")

// openOwn is open for a session of its own, counted against ownSlots.
func (s *sessions) openOwn(ctx context.Context, ttl time.Duration) (*session, error) {
	s.mu.Lock()
	if n := s.ownSlots(); n >= 0 && s.own >= n {
		s.mu.Unlock()
		return nil, errNoSlot
	}
	s.own++
	s.mu.Unlock()
	ss, err := s.open(ctx, ttl)
	if err != nil {
		s.mu.Lock()
		s.own--
		s.mu.Unlock()
		return nil, err
	}
	ss.own = true
	return ss, nil
}

// checkGalera refuses to run on Galera. The server is asked until it
// answers, then never again.
func (s *sessions) checkGalera(ctx context.Context, c rower) error {
	if err := s.galera.probe(ctx, c); err != nil {
		return err
	}
	if s.galera.is() {
		return ErrGalera
	}
	return nil
}

// rower is a *sql.DB or a *sql.Conn.
type rower interface {
	QueryRowContext(ctx context.Context, query string, args ...any) *sql.Row
}

// open pins a session whose wait_timeout is ttl, so that the server drops
// it (and its locks) if the holder stops talking for longer: a parked one,
// or a new one.
func (s *sessions) open(ctx context.Context, ttl time.Duration) (*session, error) {
	if err := s.checkPool(); err != nil {
		return nil, err
	}
	if ss := s.reuse(); ss != nil {
		if err := s.cover(ctx, ss, waitSecs(ttl)); err == nil {
			return ss, nil
		}
		ss.broken.Store(true)
		s.discard(ss)
	}
	c, err := s.db.Conn(ctx)
	if err != nil {
		return nil, err
	}
	ss := &session{conn: c, keys: make(map[string]keyHold), secs: make(map[int]int), mu: newStmtLock()}
	if err := s.checkGalera(ctx, c); err != nil && !(s.galeraOK && errors.Is(err, ErrGalera)) {
		c.Close()
		return nil, err
	}
	// From here on the session may hold its marks and its own settings: a
	// failure closes it rather than hand it back to the pool so.
	drop := func(err error) (*session, error) {
		_ = c.Raw(func(any) error { return driver.ErrBadConn })
		c.Close()
		return nil, err
	}
	var autocommit bool
	var mark, own sql.NullInt64
	if s.marked {
		n := newNonce()
		err = c.QueryRowContext(ctx, "SELECT CONNECTION_ID(), @@autocommit, "+takeAliveMark+", GET_LOCK("+ownMark+", 0), "+ownMark,
			n, n).Scan(&ss.id, &autocommit, &mark, &own, &ss.mark)
	} else {
		err = c.QueryRowContext(ctx, "SELECT CONNECTION_ID(), @@autocommit").Scan(&ss.id, &autocommit)
	}
	if err != nil {
		return drop(err)
	}
	if !autocommit {
		return drop(errAutocommitOff)
	}
	if s.marked && (mark.Int64 != 1 || own.Int64 != 1) {
		return drop(fmt.Errorf("mysqllock: session %d could not take its named locks %s%d and %s", ss.id, aliveMark, ss.id, ss.mark))
	}
	if s.marked {
		if err := s.readCommitted(ctx, ss); err != nil {
			return drop(err)
		}
	}
	if err := s.cover(ctx, ss, waitSecs(ttl)); err != nil {
		return drop(err)
	}
	s.mu.Lock()
	s.all[ss] = struct{}{}
	s.mu.Unlock()
	return ss, nil
}

// aliveMark, followed by a session's CONNECTION_ID(), names the named lock
// that each rowlock session holds from its opening: the server frees it when
// the session ends, so IS_USED_LOCK of it tells from any connection whether
// the session lives, where information_schema.PROCESSLIST costs a listing
// of every session (about 0.25 ms of the server's time here, more with
// more sessions). A session given back to the pool drops it with its other
// named locks (discard).
const aliveMark = "dlock/session/"

// sessionAlive is the SQL condition that the session whose id is the
// expression id holds its alive mark: it lives. A placeholder (?) for id
// takes two arguments.
func sessionAlive(id string) string {
	return `IS_USED_LOCK(` + aliveMarkOf(id) + `) <=> ` + id
}

// aliveMarkOf is the SQL expression of the alive mark's name of the session
// whose id is the expression id.
func aliveMarkOf(id string) string { return `CONCAT('` + aliveMark + `', ` + id + `)` }

// ownMark is the SQL expression of the name of a rowlock session's own
// mark, taken with its alive mark and held as long: the alive mark's name
// followed by a random part (the placeholder: newNonce), so that no other
// session ever holds it. The alive mark tells of a session by its
// CONNECTION_ID(), which a server hands out again after a restart; the
// own mark tells of this session only, which a grant written on another
// connection checks (see RowLock.take).
const ownMark = `CONCAT('` + aliveMark + `', CONNECTION_ID(), '/', ?)`

// newNonce returns 16 random characters (80 bits, base32).
func newNonce() string { return rand.Text()[:16] }

// takeAliveMark is the expression by which a session takes its alive mark
// (1 if it holds it), not taking it twice on a connection that already
// holds it.
var takeAliveMark = `IF(` + sessionAlive("CONNECTION_ID()") + `, 1, GET_LOCK(` + aliveMarkOf("CONNECTION_ID()") + `, 0))`

// readCommitted makes READ COMMITTED the isolation level of the session's
// transactions (rowlock's; see RowLock.take), once for the session rather
// than before each transaction, which costs a statement (database/sql's
// BeginTx with a level). The session's own level is kept in
// @dlock_isolation, which discard restores. The level's variable is
// transaction_isolation (MySQL, MariaDB 11.1+) or tx_isolation (MariaDB
// before 11.1), whichever the server knows.
func (s *sessions) readCommitted(ctx context.Context, ss *session) error {
	v := s.isolationVar.Load()
	if v == nil {
		name := "transaction_isolation"
		var level string
		err := ss.conn.QueryRowContext(ctx, "SELECT @@SESSION.transaction_isolation").Scan(&level)
		if unknownVariable(err) {
			name, err = "tx_isolation", nil
		}
		if err != nil {
			return err
		}
		v = &name
		s.isolationVar.Store(v)
	}
	_, err := ss.ExecContext(ctx, "SET @dlock_isolation = @@SESSION."+*v+", SESSION "+*v+" = 'READ-COMMITTED'")
	return err
}

// unknownVariable reports whether err is the server's error for a system
// variable that it does not have.
func unknownVariable(err error) bool {
	var me *mysql.MySQLError
	return errors.As(err, &me) && me.Number == errUnknownVariable
}

// cover sets the session's wait_timeout to secs (0: leave it). The caller
// makes sure that no lock on the session needs more.
func (s *sessions) cover(ctx context.Context, ss *session, secs int) error {
	if s.keepTimeout || secs == 0 || int64(secs) == ss.waitTimeout.Load() {
		return nil
	}
	if _, err := ss.ExecContext(ctx, fmt.Sprintf("SET SESSION wait_timeout = %d", secs)); err != nil {
		return err
	}
	ss.waitTimeout.Store(int64(secs))
	return nil
}

// maxIdle bounds the sessions kept for reuse.
const maxIdle = 8

// reuse returns a parked session that the server has not timed out.
func (s *sessions) reuse() *session {
	var stale []*session
	defer func() {
		for _, ss := range stale {
			s.discard(ss)
		}
	}()
	limited := s.limit() > 0
	s.mu.Lock()
	defer s.mu.Unlock()
	for len(s.idle) > 0 {
		ss := s.idle[len(s.idle)-1]
		s.idle = s.idle[:len(s.idle)-1]
		// The server drops a session idle for wait_timeout; keep a second
		// of slack rather than find out with an error.
		fresh := s.keepTimeout || time.Since(ss.idleSince) < time.Duration(ss.waitTimeout.Load())*time.Second-time.Second
		if fresh && !limited && ss.alive() == nil {
			return ss
		}
		stale = append(stale, ss)
	}
	return nil
}

// staleIdle reports whether the server may drop ss for idling as its next
// statement reaches it: its last statement ended less than a second (half
// its wait_timeout, if that is shorter) before its wait_timeout.
func (s *sessions) staleIdle(ss *session) bool {
	w := time.Duration(ss.waitTimeout.Load()) * time.Second
	return !s.keepTimeout && w > 0 && ss.mu.idleFor() >= w-min(time.Second, w/2)
}

// close parks a healthy session for reuse, or gives it back to the pool.
// The caller makes sure that it holds nothing. A caller's pool with a limit
// gets it back at once: a parked session would still be checked out.
func (s *sessions) close(ss *session) {
	s.mu.Lock()
	if ss.own {
		ss.own = false
		s.own--
	}
	if !ss.broken.Load() && len(s.idle) < maxIdle && s.limit() == 0 {
		ss.idleSince = time.Now()
		s.idle = append(s.idle, ss)
		s.mu.Unlock()
		return
	}
	s.mu.Unlock()
	s.discard(ss)
}

// discard returns a session to the pool after dropping its named locks and
// restoring its settings, or closes it if it is broken.
func (s *sessions) discard(ss *session) {
	s.mu.Lock()
	delete(s.all, ss)
	s.mu.Unlock()
	err := errors.New("broken")
	if !ss.broken.Load() {
		ctx, cancel := context.WithTimeout(context.Background(), 5*time.Second)
		defer cancel()
		_, err = ss.ExecContext(ctx, "DO RELEASE_ALL_LOCKS()")
		if err == nil {
			// rowlock also sets innodb_lock_wait_timeout for its waits, and
			// its isolation level (readCommitted).
			q := "SET SESSION wait_timeout = @@GLOBAL.wait_timeout, innodb_lock_wait_timeout = @@GLOBAL.innodb_lock_wait_timeout"
			if v := s.isolationVar.Load(); s.marked && v != nil {
				q += ", SESSION " + *v + " = @dlock_isolation, @dlock_isolation = NULL"
			}
			_, err = ss.ExecContext(ctx, q)
		}
	}
	if err != nil { // do not hand a dubious session back to the pool
		_ = ss.conn.Raw(func(any) error { return driver.ErrBadConn })
	}
	ss.conn.Close()
}

// closeAll gives every session back: their locks are released. A pool of
// their own is closed.
func (s *sessions) closeAll() {
	s.mu.Lock()
	all := make([]*session, 0, len(s.all))
	for ss := range s.all {
		all = append(all, ss)
	}
	s.idle = nil
	s.mu.Unlock()
	for _, ss := range all {
		if !ss.waiting.Load() {
			s.discard(ss)
			continue
		}
		// Its wait would hold up the statements that give it back
		// until the wait's bound: interrupt it, and drop the session,
		// which frees whatever it holds as those would.
		ss.broken.Store(true)
		done := make(chan struct{})
		go killUntil(s.db, ss.id, done)
		s.discard(ss)
		close(done)
	}
	if s.private {
		s.db.Close()
	}
}

// alive checks, without a round trip, that the server has not closed the
// session's connection (KILL, wait_timeout, a restart): the driver's
// liveness check reads the socket, where a healthy session between
// statements has nothing to read. A session busy with a statement is left
// alone: the statement will tell. With the DSN's checkConnLiveness=false
// the driver skips the check, and a loss is found by the next statement.
func (ss *session) alive() error {
	if !ss.mu.TryLock() {
		return nil
	}
	defer ss.mu.Unlock()
	return ss.conn.Raw(func(dc any) error {
		if r, ok := dc.(driver.SessionResetter); ok {
			return r.ResetSession(context.Background())
		}
		return nil
	})
}

// errSkipped is run's answer for a statement not run because its caller had
// left.
var errSkipped = errors.New("mysqllock: statement skipped: its caller had left")

// run runs f on the session, serialized with its other statements, under a
// context of its own: ctx's values without its cancellation or deadline,
// ending after bound. The driver closes the connection when a statement's
// context ends mid-statement, and the server then frees every lock of the
// session: a statement on a session that may hold other locks must never end
// with one caller's deadline.
//
// ctx bounds the caller's wait instead. If ctx ends first (or has ended
// already), run returns its error at once and f goes on without the caller
// (or, with skip, does not start if it has not yet); left, if not nil, then
// receives f's error, or errSkipped, once f is done.
func (ss *session) run(ctx context.Context, bound time.Duration, skip bool, f func(ctx context.Context) error, left func(error)) error {
	if ctx.Done() == nil {
		ss.mu.Lock()
		defer ss.mu.Unlock()
		sctx, cancel := context.WithTimeout(ctx, bound)
		defer cancel()
		return f(sctx)
	}
	cerr := ctxend.Err(ctx)
	if cerr != nil && skip {
		return leftError{cerr}
	}
	var mu sync.Mutex
	gone := cerr != nil
	done := make(chan error, 1)
	go func() {
		ss.mu.Lock()
		mu.Lock()
		skipped := skip && gone
		mu.Unlock()
		err := errSkipped
		if !skipped {
			sctx, cancel := context.WithTimeout(context.WithoutCancel(ctx), bound)
			err = f(sctx)
			cancel()
		}
		ss.mu.Unlock()
		mu.Lock()
		if !gone {
			done <- err
			mu.Unlock()
			return
		}
		mu.Unlock()
		if left != nil {
			left(err)
		}
	}()
	if cerr != nil {
		return leftError{cerr}
	}
	select {
	case err := <-done:
		return err
	case <-ctx.Done():
	}
	mu.Lock()
	defer mu.Unlock()
	select {
	case err := <-done:
		return err
	default:
	}
	gone = true
	return leftError{ctx.Err()}
}

// leftError is run's error when its caller's context ended first: it wraps
// the context's error.
type leftError struct{ err error }

func (e leftError) Error() string { return e.err.Error() }
func (e leftError) Unwrap() error { return e.err }

// callerLeft reports whether err is run's answer to a caller that left.
func callerLeft(err error) bool {
	var l leftError
	return errors.As(err, &l)
}

// statementTimeout bounds a statement on a pinned session: a server that
// does not answer for that long costs the session, and every lock on it.
const statementTimeout = 30 * time.Second

// detached returns a context for a statement on a pinned session: it keeps
// ctx's values and deadline but not its cancellation, and ends after
// statementTimeout at the latest.
func detached(ctx context.Context) (context.Context, context.CancelFunc) {
	d := time.Now().Add(statementTimeout)
	if dl, ok := ctx.Deadline(); ok && dl.Before(d) {
		d = dl
	}
	return context.WithDeadline(context.WithoutCancel(ctx), d)
}

// errAbandoned marks a session dropped on purpose.
var errAbandoned = errors.New("mysqllock: session abandoned")

// sessionLost reports whether err leaves the session unusable: anything but
// an error reported by the server (the driver closes the connection when a
// statement's context ends, and the server then drops the session's locks),
// or the server's word that it ended the session.
func sessionLost(err error) bool {
	if err == nil || callerLeft(err) || errors.Is(err, errSkipped) || errors.Is(err, dlock.ErrNotHeld) ||
		errors.Is(err, ErrFencesExhausted) { // a refusal by the statements: the session answered
		return false
	}
	var me *mysql.MySQLError
	if !errors.As(err, &me) {
		return true
	}
	switch me.Number {
	case 1053, // ER_SERVER_SHUTDOWN
		1927, // ER_CONNECTION_KILLED (MariaDB)
		4031: // ER_CLIENT_INTERACTION_TIMEOUT (MySQL 8: wait_timeout)
		return true
	}
	return false
}

// lockName maps a key to a GET_LOCK name: prefix + ":" + key when it fits
// the servers' limits (MySQL: 64 characters; MariaDB: 192 bytes), else
// prefix + "#" + a SHA-256 prefix. The two forms cannot collide. prefix has
// 5 characters.
func lockName(prefix, key string) string {
	if utf8.RuneCountInString(key) <= 58 && len(key) <= 186 {
		return prefix + ":" + key
	}
	sum := sha256.Sum256([]byte(key))
	return prefix + "#" + fmt.Sprintf("%x", sum)[:58]
}

// execer runs a statement: a *sql.Conn or a *sql.DB.
type execer interface {
	ExecContext(ctx context.Context, query string, args ...any) (sql.Result, error)
}

// sessionTable is the session table of the lock table table (quoted).
func sessionTable(table string) string { return strings.TrimSuffix(table, "`") + "_session`" }

// runTable and epochTable are the tables of the server run's epoch of the
// lock table table (quoted): see epoch.go.
func runTable(table string) string   { return strings.TrimSuffix(table, "`") + "_run`" }
func epochTable(table string) string { return strings.TrimSuffix(table, "`") + "_epoch`" }

// grant records a new holder of key (on session ss) in the session table
// through ex, in one statement, bumping the key's fencing counter, and
// returns the new fence. It runs while ss holds the lock, so grants of a
// key are serialised. The first grant of a server run gives the run its
// epoch first (see epoch.go). With alive, the row is written only if ss
// is still alive (see RowLock.take), and the error is errSessionGone if it
// was not. A grant that finds the table full compacts it and tries again
// once (see epoch.go). A grant that a lock-delay refuses (see grantQuery) returns a
// fence of 0 and what is left of the delay; the caller frees the lock.
func (s *sessions) grant(ctx context.Context, ex querier, ss *session, req dlock.Request, lockName string, alive bool) (uint64, time.Duration, error) {
	q, args := s.grantQuery, []any{req.Key, req.Token[:], req.Owner, ss.id, lockName, req.Metadata, req.LockDelay.Microseconds()}
	if alive {
		q = s.grantAliveQuery
		args = append(args, ss.mark, ss.id)
	}
	args = append(args, req.Token[:], req.Owner, ss.id, lockName, req.Metadata, req.LockDelay.Microseconds())
	// Each of the two remedies is tried once: a compaction of a full
	// table, and the epoch of a server run that has none.
	compacted, started := false, false
	for {
		res, err := ex.ExecContext(ctx, q, args...)
		if tableFull(err) {
			if compacted {
				return 0, 0, fmt.Errorf("%w: %s: raise max_heap_table_size and run Migrate (%w)", ErrSessionTableFull, s.table, err)
			}
			if err := s.compactOnce(ctx); err != nil {
				return 0, 0, fmt.Errorf("mysqllock: compact the full session table %s: %w", s.table, err)
			}
			compacted = true
			continue
		}
		if err != nil {
			return 0, 0, err
		}
		if fence, err := res.LastInsertId(); err != nil || fence > 0 {
			if err != nil {
				return 0, 0, fmt.Errorf("mysqllock: no fence from the grant (%v)", err)
			}
			return uint64(fence), 0, nil
		}
		left, err := s.refused(ctx, ex, req.Key, ss, alive)
		if !errors.Is(err, errNoRun) || started {
			return 0, left, err
		}
		if err := s.startRun(ctx); err != nil {
			return 0, 0, err
		}
		started = true
	}
}

// notAcquired describes the key's last holder, best effort (not at all
// for a request whose refusal goes unread: NoHolder).
func (s *sessions) notAcquired(ctx context.Context, req dlock.Request) dlock.Result {
	if req.NoHolder {
		return dlock.Result{Holder: dlock.LockInfo{Key: req.Key}}
	}
	hs, err := s.holders(ctx, "name = ?", req.Key)
	if err != nil || len(hs) == 0 {
		return dlock.Result{Holder: dlock.LockInfo{Key: req.Key}}
	}
	return dlock.Result{Holder: hs[0]}
}

// holders reads the session table; where is a condition on the row that
// tells whether its holder still holds it.
func (s *sessions) holders(ctx context.Context, where string, args ...any) ([]dlock.LockInfo, error) {
	rows, err := s.db.QueryContext(ctx, `SELECT name, token, owner, fence, metadata,
  TIMESTAMPDIFF(MICROSECOND, '1970-01-01', acquired_at)
FROM `+s.table+` WHERE `+where, args...)
	if err != nil {
		return nil, err
	}
	defer rows.Close()
	var out []dlock.LockInfo
	for rows.Next() {
		var h dlock.LockInfo
		var name, token []byte
		var acquiredUs int64
		if err := rows.Scan(&name, &token, &h.Owner, &h.Fence, &h.Metadata, &acquiredUs); err != nil {
			return nil, err
		}
		h.Key = string(name)
		copy(h.Token[:], token)
		h.AcquiredAt = time.UnixMicro(acquiredUs)
		out = append(out, h)
	}
	sort.Slice(out, func(i, j int) bool { return out[i].Key < out[j].Key })
	return out, rows.Err()
}
