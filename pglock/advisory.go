package pglock

import (
	"context"
	"errors"
	"fmt"
	"log/slog"
	"math"
	"strconv"
	"strings"
	"sync"
	"sync/atomic"
	"time"

	"github.com/dlock-dev/dlock/internal/ctxend"

	"github.com/dlock-dev/dlock"
	"github.com/dlock-dev/dlock/internal/claims"
	"github.com/dlock-dev/dlock/internal/refusals"
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

// ErrFencesExhausted is returned by the advisory strategy for a key whose
// fencing counter reached 2^40 in the current epoch: the key is refused
// (and left free) until a new epoch begins, which emptying the
// "_epoch_now" table (or a server restart) does.
var ErrFencesExhausted = errors.New("pglock: the key's fences of this epoch are exhausted")

// fencesExhaustedError is ErrFencesExhausted with the server's error of
// the refused statement: the session that ran it is still usable.
type fencesExhaustedError struct {
	msg string
	pg  *pgconn.PgError
}

func (e *fencesExhaustedError) Error() string   { return e.msg }
func (e *fencesExhaustedError) Unwrap() []error { return []error{ErrFencesExhausted, e.pg} }

// Advisory is the advisory strategy: session-level advisory locks
// (pg_try_advisory_lock, pg_advisory_lock) held by server sessions that it
// opens with the pool's configuration, outside the pool. It is safe for
// concurrent use. Create it with NewAdvisory and Close it to end its
// sessions.
//
// Guarantees and trade-offs:
//
//   - A holder that crashes loses its connection, and the server frees its
//     locks at once. A holder that stops talking (paused, partitioned) is
//     dropped by the server after idle_session_timeout, which each session
//     sets to the longest TTL it serves (PostgreSQL 14+; TTLs beyond what
//     the setting can hold, about 24.8 days, turn it off for that session:
//     the lock then lasts until the server sees the connection end).
//   - A session that ends while it holds locks (pg_terminate_backend,
//     idle_session_timeout, a server restart) is noticed at once, whether
//     or not a statement is under way, and every lock it held is reported
//     lost (dlock.LossReporter); renewal also checks every TTL/3 that the
//     session still holds each lock (in pg_locks, for its backend pid).
//   - A caller's context never ends a session: statements on a session run
//     detached from it, bounded by a fixed limit of their own. A caller
//     whose context ends first gets its error at once; its statement is
//     cancelled with a cancel request, which ends the statement and keeps
//     the session, and whatever it did is settled without the caller (a
//     lock granted after the caller left is unlocked). A context that has
//     already ended is refused before any I/O, except by Release: an
//     advisory lock has no TTL that would free it otherwise, so the unlock
//     is still sent, and Release returns the context's error.
//   - Uncontended locks share one session however many there are. Each
//     blocked waiter, and each lock it was granted, uses a session of its
//     own until released; released sessions are kept for reuse for a few
//     seconds. None of them is a connection of the pool, so the pool may
//     have any size, 1 included.
//   - Waiting happens in the server (pg_advisory_lock), which hands the lock
//     to the first waiter the moment it is released. The server also bounds
//     each exclusive wait (lock_timeout, set for the wait's statement only),
//     so that a writer whose process is frozen cannot keep readers out: a
//     wait that starts while the key has readers ends after 2 s, and a live
//     writer renews its writer mark and waits again, at the back of the
//     queue (each end is an error in the server's log); other waits keep
//     their place for 30 s.
//   - Advisory locks are re-entrant per session, so the Advisory itself
//     refuses a second grant of a lock its sessions already hold.
//   - Fencing tokens are epoch<<40 | n: n is a per-key counter in the key's
//     row of the "_session" table, bumped on every grant, of either mode,
//     while the lock is held. The rows that describe advisory locks are as
//     volatile as the locks: their tables are UNLOGGED, so a grant writes
//     no WAL and commits without a flush. A crash of the server (a backend's
//     crash included) empties them and the counters start again; the
//     epoch, kept durably in the "_epochs" table, then grows, so every
//     key's fences still strictly increase: the first grant after the
//     crash begins an epoch above every earlier one, in a transaction that
//     commits durably (synchronous_commit on) whatever the server's or the
//     role's default. A clean restart keeps the rows and the epoch. A
//     key's counter reaching 2^40 within one epoch refuses its grants with
//     ErrFencesExhausted until a new epoch begins.
//   - With synchronous standbys, a fence is returned only in an epoch that
//     they have: an Advisory's first grant in each epoch writes the
//     epoch's row again and so waits for them. A commit whose wait for the
//     standbys is cancelled (as the cancel request sent when a caller's
//     context ends mid-statement does) is visible at once, replicated or
//     not; without that write, the grants that follow it in its epoch
//     would wait for nothing, and a failover to a standby that lacks the
//     epoch would begin it again and repeat their fences.
//   - A crash also forgets what the rows kept past a lock's end: a pending
//     lock-delay or minimum hold (dlock.WithLockDelay, dlock.WithMinHold) of
//     a lock that the crash freed is not waited out. Its holder's
//     connection broke with the crash (which the Advisory reports as a loss
//     at once), and its fence is below every fence granted after the crash.
//     A clean restart keeps them, as it keeps the rows.
//   - Shared acquisitions (dlock.ModeShared) take the same advisory lock in
//     share mode, so the server itself keeps readers and writers apart.
//     Writers are not starved: while an exclusive request waits in the
//     server, PostgreSQL refuses new shared requests, and an exclusive
//     attempt that the server refuses while readers hold the key leaves a
//     writer mark (dlock.WriterMark) in the counter row that refuses new
//     shared requests until the writer waits in the server or gives up; a
//     writer whose wait the server ended renews it before waiting again. A
//     writer whose process stops while it waits among readers holds them
//     back for dlock.WriterMark at most.
//     Each shared holder is also a row of the "_readers" table, for List.
//     Limited acquisitions are not supported: PostgreSQL has no counting
//     advisory lock.
//   - Keys are hashed to 64 bits (AdvisoryKeys) and locked with the two-int
//     form of the functions, which PostgreSQL keeps apart from the bigint
//     form applications use. Two distinct keys that collide (about one
//     chance in 2^64 per pair) exclude each other: a false contention,
//     never a shared grant. The table keeps the original key for List.
//   - Watches (dlock.Watcher) see every grant, unlock and metadata change,
//     and the end of a session that an Advisory sees (ForceRelease, Close,
//     a session the server ended under a live Advisory); not the end of a
//     session whose process died with it, which only the key's next grant
//     makes known (see Advisory.Watch).
//   - Advisory locks live in one database of one server: not replicated, and
//     unsafe behind a pooler in transaction or statement mode, where two
//     statements of a "session" can run on different server sessions (see
//     ErrTransactionPooling: every statement on a session checks
//     pg_backend_pid(), which catches such a pooler as soon as it switches).
type Advisory struct {
	claims *claims.Set
	pool   *pgxpool.Pool
	tb     tables
	log    *slog.Logger
	q      advisoryQueries
	loss   dlock.LossHandlers
	ln     *listener // serves Watch

	mainSem chan struct{} // serialises choosing the main session
	mu      sync.Mutex
	main    *session           // takes uncontended locks
	held    map[uint64][]*hold // by lock id: one exclusive hold, or shared ones
	idle    []*session         // sessions holding nothing, kept for reuse
	all     map[*session]bool  // every open session
	closed  bool
	wg      sync.WaitGroup // the sessions' goroutines
	refused refusals.Set   // keys a try found held lately (see WaitsDirectly)

	// durable is the epoch of the last grant returned to a caller (0:
	// none yet). A grant in any other epoch writes the epoch's row of
	// "_epochs" again (see newAdvisoryQueries).
	durable atomic.Int64

	// afterUnlock, if set (tests only), runs in Release between the unlock
	// statement and the bookkeeping that follows it.
	afterUnlock func()
	// grantHook, if set (tests only), receives the synchronous_commit in
	// force in each grant's transaction.
	grantHook func(syncCommit string)
}

// hold is a lock this process holds; its fields after ss are guarded by
// Advisory.mu.
type hold struct {
	id    uint64
	key   string
	token dlock.Token
	ss    *session
	// shared: a shared hold (pg_advisory_lock_shared).
	shared bool
	// delay: the grant's lock-delay.
	delay time.Duration
	// releasing: Release has sent (or is about to send) the unlock. From
	// then on the server may grant the key to another session of this
	// process, which must not take the hold for a local holder.
	releasing bool
	// done: the hold has left the books (released, found gone, or its
	// session lost) and no longer counts in ss.n.
	done bool
}

var (
	_ dlock.Backend        = (*Advisory)(nil)
	_ dlock.Waiter         = (*Advisory)(nil)
	_ dlock.DirectWaiter   = (*Advisory)(nil)
	_ dlock.Lister         = (*Advisory)(nil)
	_ dlock.ForceReleaser  = (*Advisory)(nil)
	_ dlock.LossReporter   = (*Advisory)(nil)
	_ dlock.Watcher        = (*Advisory)(nil)
	_ dlock.MetadataSetter = (*Advisory)(nil)
	_ dlock.HolderWatcher  = (*Advisory)(nil)
)

// NewAdvisory returns the advisory strategy over pool. Its server sessions
// are connections of their own, opened with pool's configuration (its
// BeforeConnect and AfterConnect hooks included); the pool itself serves
// Migrate, List, ForceRelease and the description of a refusal's holder.
// It does no I/O; Migrate (of either strategy) creates the fencing table.
// The error matches dlock.ErrInvalidOption for a nil pool or a bad table
// name.
func NewAdvisory(pool *pgxpool.Pool, opts *Options) (*Advisory, error) {
	tb, o, err := checkArgs(pool == nil, opts)
	if err != nil {
		return nil, err
	}
	return &Advisory{claims: newClaims(pool, tb, "advisory"), pool: pool, tb: tb, log: logger(o), held: make(map[uint64][]*hold), all: make(map[*session]bool),
		mainSem: make(chan struct{}, 1), q: newAdvisoryQueries(tb), ln: newListener(pool, tb)}, nil
}

// Migrate creates the tables of both strategies if they do not exist, and
// logs what Check finds to Options.Logger.
func (a *Advisory) Migrate(ctx context.Context) error { return migrate(ctx, a.pool, a.tb, a.log) }

// Check reports the server settings that weaken the advisory strategy's
// guarantees; see the function Check.
func (a *Advisory) Check(ctx context.Context) ([]Finding, error) { return Check(ctx, a.pool) }

// OnLoss implements dlock.LossReporter: f learns of every lock held by a
// session that ended, as soon as the session's end is seen.
func (a *Advisory) OnLoss(f func(key string, token dlock.Token, cause error)) (stop func()) {
	return a.loss.Add(f)
}

// Close ends every session, which frees every lock still held. It does not
// close the pool.
func (a *Advisory) Close() error {
	a.mu.Lock()
	a.closed = true
	all := make([]*session, 0, len(a.all))
	for ss := range a.all {
		all = append(all, ss)
	}
	var freed []*hold
	for _, hs := range a.held {
		freed = append(freed, hs...)
	}
	clear(a.held)
	a.idle, a.main = nil, nil
	a.mu.Unlock()
	for _, ss := range all {
		ss.stop()
	}
	a.wg.Wait()
	a.notifyFreed(freed)
	a.ln.close()
	return nil
}

// notifyFreed tells the watches of the keys of holds that ended without a
// statement (their sessions ended), once the sessions are gone. It is
// bounded by cleanupTimeout; a failure is logged (a server that cannot be
// reached has ended the watches' connections too).
func (a *Advisory) notifyFreed(holds []*hold) {
	if len(holds) == 0 {
		return
	}
	keys := make([][]byte, len(holds))
	tokens := make([][]byte, len(holds))
	for i, h := range holds {
		keys[i], tokens[i] = []byte(h.key), h.token[:]
	}
	ctx, cancel := context.WithTimeout(context.Background(), cleanupTimeout)
	defer cancel()
	_, err := a.pool.Exec(ctx, a.q.notify, keys, tokens)
	for try := 0; try < 3 && err != nil && ctx.Err() == nil && sessionLost(err); try++ {
		// A pooled connection that ended with the session (a restart, a
		// terminated client): again, on another.
		_, err = a.pool.Exec(ctx, a.q.notify, keys, tokens)
	}
	if err != nil {
		a.log.Warn("pglock: could not tell the watches of locks freed with their sessions", "locks", len(keys), "err", err)
	}
}

// AdvisoryKeys returns the two int4 arguments of pg_advisory_lock that the
// advisory strategy uses for key: the first 8 bytes of SHA-256("dlock:"+key),
// split into halves. They appear in pg_locks as classid and objid (as
// unsigned oids) with objsubid 2.
func AdvisoryKeys(key string) (int32, int32) { return split(hashKey(key)) }

func split(id uint64) (int32, int32) { return int32(id >> 32), int32(id) }

type advisoryQueries struct {
	try, wait, tryShared, waitShared, unlock, unlockShared, mark, check, holder, list, setMetadata string
	listWaiters                                                                                    string
	notify, forceRelease, unlockReleased, unlockKept, watchHolders                                 string
}

// Bounds of an exclusive wait in the server (lock_timeout, local to the
// wait's statement), which end it even when its client can no longer
// cancel it (a process stopped by SIGSTOP, a debugger, a VM pause), while
// the session, busy with the statement, is never idle.
//
// A waiting writer keeps new readers out, so a wait that starts while the
// key has shared holders or shared waiters ends after waitBound. A live
// writer then renews its writer mark (dlock.WriterMark, which outlasts
// waitBound, so that the mark covers the gap) and waits again, at the back
// of the server's queue; a frozen one holds readers back for at most
// dlock.WriterMark. A wait that starts without them keeps its place in the
// queue for up to waitAlone: readers that come later queue behind it and
// are no reason to end it. (Only a reader granted in the instant between
// the wait's look at the key and its request would let a frozen writer
// hold new readers back for waitAlone.)
const (
	waitBound = dlock.WriterMark * 2 / 3
	waitAlone = maxWait
)

// quickWait is how soon the reply of a wait's grant must come for the
// grant to be timed from the wait's sending (always safe: the server
// counts a session's idleness from after it) instead of from a statement
// that confirms it: a fifth of the TTL, so that the grant keeps most of
// its lease.
func quickWait(req dlock.Request) time.Duration { return holderTTL(req) / 5 }

// Fences of the advisory strategy are epoch<<epochShift | n: n counts the
// key's grants within the epoch, in its unlogged "_session" row, and ranges
// over 1..2^40-1; a grant that would reach 2^40 fails with an error whose
// message holds fencesExhausted (beginning a new epoch, by emptying the
// "_epoch_now" table, lets the key be granted again).
const (
	epochShift      = 40
	exhausted       = `1099511627774` // 2^40 - 2: s.fence - (epoch<<40 + 1) when n = 2^40 - 1
	fencesExhausted = `pglock: the fencing counter of the key is exhausted in epoch`
)

// The grant statements take the lock and, only if they got it, bump the
// key's fencing row in the same statement. The rows that describe advisory
// locks live in unlogged tables, as volatile as the locks: a grant that
// writes only them commits without a WAL flush (PostgreSQL flushes a
// commit only if its transaction wrote WAL), nor waits for a synchronous
// standby. The fence is epoch<<40 | n (see epochShift). The epoch is
// durable: a crash empties the unlogged tables ("_epoch_now" included), a
// clean restart keeps them, and the first grant that finds "_epoch_now"
// empty (eb: only once it holds the lock, so a waiter never holds its row)
// begins an epoch greater than every recorded one and than every fence
// left in "_session" >> 40 (those of a logged table of an earlier version),
// records it in the logged "_epochs" table, in a transaction that commits
// durably (set_config of synchronous_commit, local to the transaction,
// whatever the server's, the database's or the role's default), and in
// "_epoch_now". Concurrent first grants agree on the epoch through that
// row's key (eu: the later one waits for the first to commit, then takes
// its epoch). A grant in an epoch other than the one its Advisory last
// granted in (the parameter after the others, Advisory.durable) writes the
// epoch's row of "_epochs" again (ed), so its commit waits for the
// synchronous standbys: the epoch is theirs before the Advisory returns a
// fence in it (only a grant whose caller still waited, so whose wait was
// not cancelled, advances Advisory.durable). So a key's fence grows by one
// per grant within an epoch, and a new epoch's fences exceed every fence of
// an earlier one, on the server and on its synchronous standbys. A
// session-level advisory lock survives the rollback of a failed statement,
// so after an error the lock is unlocked (or the session closed).
//
// The fencing row is shared by both modes. A shared grant also records its
// holder in the "_readers" table (and drops the rows of sessions that
// ended), and is refused without asking for the lock while the key's
// writer mark lasts; an exclusive try that the server refuses while shared
// holders hold the lock leaves the mark ($8), and an exclusive grant clears
// it. While an exclusive request waits in the server, PostgreSQL itself
// refuses new shared requests; the exclusive wait sets lock_timeout for its
// own transaction (waitBound or waitAlone) before it asks for the lock (k).
func newAdvisoryQueries(tb tables) advisoryQueries {
	s, r, ch := tb.session, tb.readers, literal(tb.watch)
	en, es, shift := tb.epoch, tb.epochs, strconv.Itoa(epochShift)
	const ours = `l.locktype = 'advisory' AND l.granted AND l.objsubid = 2
  AND l.database = (SELECT oid FROM pg_database WHERE datname = current_database())`
	const keyLock = `l.classid = ((s.lock_id >> 32) & 4294967295)::oid AND l.objid = (s.lock_id & 4294967295)::oid`
	// A grant is written only if the key's record keeps no lock-delay
	// (see Advisory.Abandon); otherwise the statement starts the delay,
	// keeps the fence and unlocks (ul). EXCLUDED.acquired_at is the one
	// instant, read after the lock was granted, that every column uses.
	// The grant was made (won) if the row now has the request's token: a
	// refusal leaves the last grant's, never this request's (after its own
	// grant, a refusal needs another grant in between).
	const undelayed = `s.delay_us = 0 AND s.delay_until <= EXCLUDED.acquired_at`
	granted := func(col, val string) string {
		return col + ` = CASE WHEN ` + undelayed + ` THEN ` + val + ` ELSE s.` + col + ` END`
	}
	grant := func(lock string, shared, marks, bounded bool) string {
		ok, bump, extra, markUs, bound := lock, `,
    `+granted("writer_until", "'-infinity'"), ``, `0::bigint`, ``
		lim, gone := `'-1'`, `''`
		unlockFn := `pg_advisory_unlock`
		durable := `$9` // the epoch this Advisory knows durable (Advisory.durable)
		if marks {
			durable = `$10`
		}
		if shared {
			ok = `CASE WHEN k.wu > k.now THEN false ELSE ` + lock + ` END`
			bump = ``
			lim, gone = `'0'`, `COALESCE((SELECT string_agg(encode(token, 'hex'), ',') FROM gone), '')`
			unlockFn = `pg_advisory_unlock_shared`
			extra = `,
rd AS (
  INSERT INTO ` + r + ` (name, token, owner, fence, pid, acquired_at, metadata)
  SELECT $3, $5, $6, g.fence, pg_backend_pid(), clock_timestamp(), $7 FROM g WHERE g.won
),
gone AS (
  DELETE FROM ` + r + ` x WHERE x.name = $3 AND EXISTS (SELECT FROM g)
    AND NOT EXISTS (SELECT FROM pg_stat_get_activity(x.pid))
  RETURNING x.token
)`
			markUs = `CASE WHEN NOT l.ok AND k.wu > k.now THEN (extract(epoch FROM k.wu - k.now) * 1000000)::bigint ELSE 0 END`
		}
		if bounded {
			bound = fmt.Sprintf(`,
  set_config('lock_timeout', CASE WHEN EXISTS (SELECT FROM pg_locks l WHERE l.locktype = 'advisory' AND l.objsubid = 2
    AND l.database = (SELECT oid FROM pg_database WHERE datname = current_database())
    AND l.mode = 'ShareLock' AND l.classid = $1::int4::oid AND l.objid = $2::int4::oid)
  THEN '%d' ELSE '%d' END, true) AS lt`, waitBound.Milliseconds(), waitAlone.Milliseconds())
		}
		if marks {
			// m reads l's answer in a subquery, which the plan evaluates
			// before it reads pg_locks: a try that got the lock reads no
			// pg_locks (a join with l read it first, about 40 µs of the
			// server's time per grant).
			extra = `,
m AS (
  UPDATE ` + s + ` AS s SET writer_until = clock_timestamp() + $9::bigint * interval '1 microsecond'
  WHERE s.name = $3 AND NOT (SELECT ok FROM l)
    AND EXISTS (SELECT FROM pg_locks l WHERE ` + ours + ` AND l.mode = 'ShareLock' AND ` + keyLock + `)
)`
		}
		return `WITH k AS MATERIALIZED (SELECT clock_timestamp() AS now, (SELECT writer_until FROM ` + s + ` WHERE name = $3) AS wu` + bound + `),
l AS MATERIALIZED (SELECT ` + ok + ` AS ok, set_config('synchronous_commit', 'on', true) AS sc FROM k),
e0 AS (SELECT epoch FROM ` + en + `),
eb AS MATERIALIZED (SELECT greatest((SELECT max(epoch) FROM ` + es + `), (SELECT max(fence) FROM ` + s + `) >> ` + shift + `, 0) + 1 AS epoch
  WHERE NOT EXISTS (SELECT FROM e0) AND (SELECT ok FROM l)),
ei AS (INSERT INTO ` + es + ` (epoch) SELECT epoch FROM eb ON CONFLICT DO NOTHING),
eu AS (INSERT INTO ` + en + ` AS n (one, epoch) SELECT true, epoch FROM eb
  ON CONFLICT (one) DO UPDATE SET one = n.one RETURNING n.epoch),
e AS MATERIALIZED (SELECT coalesce((SELECT epoch FROM e0), (SELECT epoch FROM eu)) AS epoch),
ed AS (INSERT INTO ` + es + ` AS d (epoch) SELECT epoch FROM e
  WHERE (SELECT ok FROM l) AND NOT EXISTS (SELECT FROM eb) AND epoch IS DISTINCT FROM ` + durable + `::bigint
  ON CONFLICT (epoch) DO UPDATE SET epoch = d.epoch),
g AS (
  INSERT INTO ` + s + ` AS s (name, lock_id, token, owner, fence, pid, acquired_at, metadata, delay_us, changes)
  SELECT $3, $4, $5, $6, (e.epoch << ` + shift + `) + 1, pg_backend_pid(), clock_timestamp(), $7, $8::bigint, 1 FROM l, e WHERE l.ok
  ON CONFLICT (name) DO UPDATE SET ` + granted("lock_id", "EXCLUDED.lock_id") + `,
    ` + granted("token", "EXCLUDED.token") + `,
    ` + granted("owner", "EXCLUDED.owner") + `,
    ` + granted("fence", `CASE WHEN s.fence - EXCLUDED.fence >= `+exhausted+`
      THEN ('`+fencesExhausted+` ' || (EXCLUDED.fence >> `+shift+`))::bigint ELSE greatest(s.fence + 1, EXCLUDED.fence) END`) + `,
    ` + granted("changes", "s.changes + 1") + `,
    ` + granted("pid", "EXCLUDED.pid") + `,
    ` + granted("acquired_at", "EXCLUDED.acquired_at") + `,
    ` + granted("metadata", "EXCLUDED.metadata") + bump + `,
    delay_until = CASE WHEN ` + undelayed + ` THEN s.delay_until
      ELSE greatest(s.delay_until, EXCLUDED.acquired_at + s.delay_us * interval '1 microsecond') END,
    delay_us = CASE WHEN ` + undelayed + ` THEN EXCLUDED.delay_us ELSE 0 END
  RETURNING s.fence, s.token = $5 AS won, s.delay_until, s.changes AS n, s.acquired_at
)` + extra + `,
gn AS (SELECT pg_notify(` + ch + `, ` + fitPayload(`encode($3, 'hex') || '/' || `+
			recGrant(`n`, lim, `$5`, `fence::text`, `acquired_at`, `''`, `$6`, `$7`, gone), `encode($3, 'hex')`, `n`) + `) FROM g WHERE g.won),
ul AS (SELECT ` + unlockFn + `($1::int4, $2::int4) FROM g WHERE NOT g.won)
SELECT l.ok AND coalesce((SELECT won FROM g), false), (SELECT fence FROM g WHERE won), pg_backend_pid(),
  current_setting('synchronous_commit'), ` + markUs + `, (SELECT count(*) FROM gn), (SELECT count(*) FROM ul),
  coalesce((SELECT (extract(epoch FROM g.delay_until - clock_timestamp()) * 1000000)::bigint FROM g WHERE NOT won), 0)
FROM l, k`
	}
	// unlocked: an unlock ($4: or a retry of one that a cancel may have
	// cut after it unlocked) tells the key's watches, with the release of
	// $5 counted by c; its transaction need not wait for the flush of its
	// commit (a lost notification after a crash of the server tells nobody
	// anything: watches end with the server's connections). c bumps the
	// key's change counter before the unlock, so that a waiter's grant,
	// which waits for the row, commits after it.
	unlocked := `SELECT pg_notify(` + ch + `, encode($3, 'hex') || COALESCE('/' || (SELECT changes FROM c) || ' r ' || encode($5, 'hex'), '')),
  set_config('synchronous_commit', 'off', true)
  FROM u WHERE u.ok OR $4::bool OR EXISTS (SELECT FROM c)`
	const (
		try  = `pg_try_advisory_lock%s($1::int4, $2::int4)`
		wait = `(SELECT true FROM (SELECT pg_advisory_lock%s($1::int4, $2::int4)) w)`
	)
	return advisoryQueries{
		try:        grant(fmt.Sprintf(try, ""), false, true, false),
		wait:       grant(fmt.Sprintf(wait, ""), false, false, true),
		tryShared:  grant(fmt.Sprintf(try, "_shared"), true, false, false),
		waitShared: grant(fmt.Sprintf(wait, "_shared"), true, false, false),
		unlock: `WITH c AS (UPDATE ` + s + ` SET changes = changes + 1 WHERE name = $3 AND (token = $5 OR $4::bool) RETURNING changes),
u AS MATERIALIZED (SELECT pg_advisory_unlock($1::int4, $2::int4) AS ok FROM (SELECT count(*) FROM c) x)
SELECT u.ok, pg_backend_pid(), (SELECT count(*) FROM (` + unlocked + `) n) FROM u`,
		// unlockReleased is unlock for a grant with a lock-delay: the grant
		// is marked released (delay_us = 0) before the lock is unlocked (u
		// reads c), and the next grant's statement, which waits for the
		// row, sees it so.
		unlockReleased: `WITH c AS (UPDATE ` + s + ` SET delay_us = CASE WHEN token = $5 THEN 0 ELSE delay_us END, changes = changes + 1
  WHERE name = $3 AND (token = $5 OR $4::bool) RETURNING changes),
u AS MATERIALIZED (SELECT pg_advisory_unlock($1::int4, $2::int4) AS ok FROM (SELECT count(*) FROM c) x)
SELECT u.ok, pg_backend_pid(), (SELECT count(*) FROM (` + unlocked + `) n) FROM u`,
		// unlockKept is unlock for a release within a minimum hold: the
		// grant is marked released and the key kept from every grant for
		// $6 µs from now (delay_until, which the grant's statement checks
		// as it does a lock-delay) before the lock is unlocked.
		unlockKept: `WITH c AS (UPDATE ` + s + ` SET delay_us = CASE WHEN token = $5 THEN 0 ELSE delay_us END,
    delay_until = CASE WHEN token = $5 THEN greatest(delay_until, clock_timestamp() + $6::bigint * interval '1 microsecond') ELSE delay_until END,
    changes = changes + 1
  WHERE name = $3 AND (token = $5 OR $4::bool) RETURNING changes),
u AS MATERIALIZED (SELECT pg_advisory_unlock($1::int4, $2::int4) AS ok FROM (SELECT count(*) FROM c) x)
SELECT u.ok, pg_backend_pid(), (SELECT count(*) FROM (` + unlocked + `) n) FROM u`,
		unlockShared: `WITH d AS (DELETE FROM ` + r + ` WHERE name = $3 AND token = $5 RETURNING 1),
c AS (UPDATE ` + s + ` SET changes = changes + 1 WHERE name = $3 AND (EXISTS (SELECT FROM d) OR $4::bool) RETURNING changes),
u AS MATERIALIZED (SELECT pg_advisory_unlock_shared($1::int4, $2::int4) AS ok FROM (SELECT count(*) FROM c) x)
SELECT u.ok, pg_backend_pid(), (SELECT count(*) FROM (` + unlocked + `) n) FROM u`,
		mark: `UPDATE ` + s + ` SET writer_until = clock_timestamp() + $2::bigint * interval '1 microsecond' WHERE name = $1`,
		// check returns the session's pid and the indexes (1-based) of the
		// locks in $1/$2 that it does not hold.
		check: `SELECT pg_backend_pid(), COALESCE((SELECT array_agg(x.i) FROM unnest($1::int4[], $2::int4[]) WITH ORDINALITY AS x(a, b, i)
  WHERE NOT EXISTS (SELECT FROM pg_locks l WHERE ` + ours + ` AND l.pid = pg_backend_pid()
    AND l.classid = x.a::oid AND l.objid = x.b::oid)), '{}')`,
		// The key's latest grant (a shared one when both have its fence).
		holder: `SELECT name, token, owner, fence, metadata, acquired_at, lim FROM (
  SELECT name, token, owner, fence, metadata, acquired_at, -1 AS lim FROM ` + s + ` WHERE name = $1
  UNION ALL
  SELECT name, token, owner, fence, metadata, acquired_at, 0 FROM ` + r + ` WHERE name = $1) x
ORDER BY fence DESC, lim DESC LIMIT 1`,
		// The holder's row, if its session still holds the lock in its
		// mode ($4, $5: the key's two halves), and a notification.
		setMetadata: `WITH ex AS (
  UPDATE ` + s + ` s SET metadata = $3, changes = s.changes + 1 WHERE s.name = $1 AND s.token = $2
    AND EXISTS (SELECT FROM pg_locks l WHERE ` + ours + ` AND l.mode = 'ExclusiveLock' AND l.pid = s.pid
      AND l.classid = $4::int4::oid AND l.objid = $5::int4::oid)
  RETURNING s.name, s.changes
),
sh AS (
  UPDATE ` + r + ` x SET metadata = $3 WHERE x.name = $1 AND x.token = $2
    AND EXISTS (SELECT FROM pg_locks l WHERE ` + ours + ` AND l.mode = 'ShareLock' AND l.pid = x.pid
      AND l.classid = $4::int4::oid AND l.objid = $5::int4::oid)
  RETURNING x.name
),
su AS (
  UPDATE ` + s + ` u SET changes = u.changes + 1 WHERE u.name = $1 AND EXISTS (SELECT FROM sh)
  RETURNING u.name, u.changes
)
SELECT pg_notify(` + ch + `, encode(n.name, 'hex') || '/' || n.changes || ' m ' || encode($2, 'hex') || ' ' || ` + recHex(`$3`) + `),
  set_config('synchronous_commit', 'on', true)
FROM (SELECT name, changes FROM ex UNION ALL SELECT name, changes FROM su) n`,

		// notify tells the watches of the keys in $1 (bytea[]) of the end
		// of locks that no statement ended (a session's end, or Close):
		// those of the tokens in $2 (one per key in $1).
		notify: `WITH x AS (SELECT k, string_agg(encode(t, 'hex'), ',') AS toks FROM unnest($1::bytea[], $2::bytea[]) AS x(k, t) GROUP BY k),
lk AS MATERIALIZED (SELECT s.name FROM ` + s + ` s WHERE s.name IN (SELECT k FROM x) ORDER BY s.name FOR UPDATE),
c AS (
  UPDATE ` + s + ` s SET changes = s.changes + 1 FROM x WHERE s.name = x.k AND EXISTS (SELECT FROM lk)
  RETURNING s.name, s.changes, x.toks
)
SELECT count(pg_notify(` + ch + `, ` + fitPayload(`encode(c.name, 'hex') || '/' || c.changes || ' e ' || c.toks`, `encode(c.name, 'hex')`, `c.changes`) + `)),
  set_config('synchronous_commit', 'off', true)
FROM c`,
		// Terminates each session that holds the key ($1, $2: its halves;
		// $3: the key), then tells the key's watches.
		// The ended holders are named from the statement's snapshot,
		// taken before the sessions ended. A lock taken outside dlock (no
		// row, no counter) is notified without a record.
		forceRelease: `WITH t AS MATERIALIZED (
  SELECT l.pid, pg_terminate_backend(l.pid, 5000) AS ok FROM pg_locks l
  WHERE ` + ours + ` AND l.classid = $1::int4::oid AND l.objid = $2::int4::oid
),
e AS (
  SELECT COALESCE(string_agg(encode(token, 'hex'), ','), '') AS toks FROM (
    SELECT token FROM ` + s + ` WHERE name = $3 AND pid IN (SELECT pid FROM t WHERE t.ok)
    UNION SELECT token FROM ` + r + ` WHERE name = $3 AND pid IN (SELECT pid FROM t WHERE t.ok)) x
),
c AS (UPDATE ` + s + ` SET changes = changes + 1 WHERE name = $3 AND EXISTS (SELECT FROM t WHERE t.ok) RETURNING changes)
SELECT t.ok, (SELECT count(*) FROM (SELECT pg_notify(` + ch + `, ` + fitPayload(`encode($3, 'hex') || COALESCE((SELECT '/' || c.changes || ' e ' || e.toks FROM c, e), '')`,
			`encode($3, 'hex')`, `(SELECT changes FROM c)`) + `)
  FROM t WHERE t.ok LIMIT 1) n) FROM t`,

		// The key's holders as list reports them, its change counter and
		// the server's clock, in one statement.
		watchHolders: `WITH hs AS (
  SELECT s.token, s.owner, s.fence, s.metadata, s.acquired_at, -1 AS lim FROM ` + s + ` s
  WHERE s.name = $1
    AND EXISTS (SELECT FROM pg_locks l WHERE ` + ours + ` AND l.mode = 'ExclusiveLock' AND l.pid = s.pid AND ` + keyLock + `)
  UNION ALL
  SELECT x.token, x.owner, x.fence, x.metadata, x.acquired_at, 0 FROM ` + r + ` x JOIN ` + s + ` s ON s.name = x.name
  WHERE x.name = $1
    AND EXISTS (SELECT FROM pg_locks l WHERE ` + ours + ` AND l.mode = 'ShareLock' AND l.pid = x.pid AND ` + keyLock + `)
)
SELECT COALESCE((SELECT changes FROM ` + s + ` WHERE name = $1), 0), (extract(epoch FROM clock_timestamp()) * 1000000)::bigint,
  hs.token, hs.owner, hs.fence, hs.metadata, hs.acquired_at, NULL::bigint, hs.lim
FROM (SELECT 1) one LEFT JOIN hs ON true ORDER BY hs.fence`,

		list: `SELECT s.name, s.token, s.owner, s.fence, s.metadata, s.acquired_at, -1 FROM ` + s + ` s
WHERE substring(s.name FROM 1 FOR octet_length($1::bytea)) = $1::bytea
  AND EXISTS (SELECT FROM pg_locks l WHERE ` + ours + ` AND l.mode = 'ExclusiveLock' AND l.pid = s.pid AND ` + keyLock + `)
UNION ALL
SELECT x.name, x.token, x.owner, x.fence, x.metadata, x.acquired_at, 0 FROM ` + r + ` x JOIN ` + s + ` s ON s.name = x.name
WHERE substring(x.name FROM 1 FOR octet_length($1::bytea)) = $1::bytea
  AND EXISTS (SELECT FROM pg_locks l WHERE ` + ours + ` AND l.mode = 'ShareLock' AND l.pid = x.pid AND ` + keyLock + `)
ORDER BY 1, 4`,
		// Sessions blocked in pg_advisory_lock(_shared) on a key's lock,
		// named through the key's fencing row (a key is waited for only
		// while held, so its row exists).
		listWaiters: `SELECT s.name, l.mode = 'ShareLock', l.pid, COALESCE(a.usename, ''), COALESCE(host(a.client_addr), 'local'),
  (extract(epoch FROM COALESCE(a.query_start, clock_timestamp()) - clock_timestamp()) * 1000000)::bigint
FROM pg_locks l JOIN ` + s + ` s ON ` + keyLock + `
LEFT JOIN pg_stat_activity a ON a.pid = l.pid
WHERE l.locktype = 'advisory' AND NOT l.granted AND l.objsubid = 2
  AND l.database = (SELECT oid FROM pg_database WHERE datname = current_database())
  AND substring(s.name FROM 1 FOR octet_length($1::bytea)) = $1::bytea
ORDER BY 1, a.query_start, l.pid`,
	}
}

// connect opens a session outside the pool, with the pool's configuration.
// A failure or an ended ctx loses nothing: the session holds nothing yet.
func (a *Advisory) connect(ctx context.Context) (*session, error) {
	conn, err := dial(ctx, a.pool)
	if err != nil {
		return nil, err
	}
	// The user's configuration may bound statements; a wait in the server
	// must not be cut short by it (the bounds are dlock's own).
	var pid uint32
	err = conn.QueryRow(ctx, `SELECT pg_backend_pid(), set_config('statement_timeout', '0', false),
  set_config('lock_timeout', '0', false), set_config('idle_in_transaction_session_timeout', '0', false)`).Scan(&pid, nil, nil, nil)
	if err != nil {
		closeConn(conn)
		return nil, err
	}
	a.mu.Lock()
	defer a.mu.Unlock()
	if a.closed {
		closeConn(conn)
		return nil, dlock.ErrClosed
	}
	ss := a.newSession(conn, pid)
	a.all[ss] = true
	return ss, nil
}

// closeConn closes a connection that no session owns yet.
func closeConn(c *pgx.Conn) {
	ctx, cancel := context.WithTimeout(context.Background(), time.Second)
	_ = c.Close(ctx)
	cancel()
}

// Sessions kept for reuse: at most maxIdle, each for at most parkIdle.
const (
	maxIdle  = 4
	parkIdle = 10 * time.Second
)

// open returns a session for a wait: a parked one if possible.
func (a *Advisory) open(ctx context.Context) (*session, error) {
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
			return a.connect(ctx)
		}
		if a.fresh(ss) && !ss.isGone() {
			return ss, nil
		}
		ss.stop()
	}
}

// fresh reports whether a session holding nothing can be reused: the server
// ends sessions idle for idle_session_timeout, so keep a margin.
func (a *Advisory) fresh(ss *session) bool {
	timeout := time.Duration(ss.timeout.Load())
	idle := time.Since(time.Unix(0, ss.lastUsed.Load()))
	return idle < parkIdle && (timeout == 0 || idle < timeout/2)
}

// noIdleTimeout marks a session whose idle_session_timeout is off.
const noIdleTimeout = math.MaxInt64

// maxIdleSessionTimeout is the largest idle_session_timeout (an int of ms).
const maxIdleSessionTimeout = math.MaxInt32 * time.Millisecond

// idleTimeoutFor is the idle_session_timeout that covers ttl: ttl rounded
// up to whole seconds, or noIdleTimeout beyond what the setting can hold.
func idleTimeoutFor(ttl time.Duration) time.Duration {
	if ttl > maxIdleSessionTimeout-time.Second {
		return noIdleTimeout
	}
	return (ttl + time.Second - 1) / time.Second * time.Second
}

// cover raises the session's idle_session_timeout to cover ttl, so that the
// server drops the session, and its locks, when the holder stops talking
// for longer than its lease; it runs in the session's goroutine. Servers
// before PostgreSQL 14 lack the setting; there only TCP keepalives notice.
func (a *Advisory) cover(ctx context.Context, ss *session, ttl time.Duration) error {
	want := idleTimeoutFor(ttl)
	if want <= time.Duration(ss.timeout.Load()) {
		return nil
	}
	ms := want.Milliseconds()
	if want == noIdleTimeout {
		ms = 0
	}
	_, err := ss.conn.Exec(ctx, fmt.Sprintf("SET idle_session_timeout = %d", ms))
	var pe *pgconn.PgError
	if errors.As(err, &pe) && pe.Code == "42704" { // unrecognized configuration parameter
		err = nil
	}
	if err != nil {
		return err
	}
	ss.timeout.Store(int64(want))
	return nil
}

// park keeps a session that holds nothing for reuse (the main session stays
// where it is), and ends sessions parked too long.
func (a *Advisory) park(ss *session) {
	a.mu.Lock()
	if !a.holdsNothingLocked(ss) {
		a.mu.Unlock()
		return
	}
	var stale []*session
	keep := a.idle[:0]
	for _, p := range a.idle {
		if time.Since(p.parkedAt) < parkIdle {
			keep = append(keep, p)
		} else {
			stale = append(stale, p)
		}
	}
	a.idle = keep
	if !a.closed && len(a.idle) < maxIdle {
		ss.parkedAt = time.Now()
		a.idle = append(a.idle, ss)
	} else {
		stale = append(stale, ss)
	}
	a.mu.Unlock()
	for _, p := range stale {
		p.stop()
	}
}

// mainSession returns the session that takes uncontended locks, replacing
// it if it ended, or if it holds nothing and may have timed out.
func (a *Advisory) mainSession(ctx context.Context) (*session, error) {
	select {
	case a.mainSem <- struct{}{}:
	case <-ctx.Done():
		return nil, ctx.Err()
	}
	defer func() { <-a.mainSem }()
	a.mu.Lock()
	ss := a.main
	if ss != nil && (ss.isGone() || ss.n == 0 && !a.fresh(ss)) {
		a.main = nil
		a.mu.Unlock()
		ss.stop() // holds nothing (or is gone already)
		ss = nil
	} else {
		a.mu.Unlock()
	}
	if ss != nil {
		return ss, nil
	}
	ss, err := a.connect(ctx)
	if err != nil {
		return nil, err
	}
	a.mu.Lock()
	a.main = ss
	a.mu.Unlock()
	return ss, nil
}

// ended forgets a session whose goroutine has ended, and reports the locks
// it held as lost unless it was stopped on purpose (cause nil).
func (a *Advisory) ended(ss *session, cause error) {
	a.mu.Lock()
	delete(a.all, ss)
	if a.main == ss {
		a.main = nil
	}
	for i, p := range a.idle {
		if p == ss {
			a.idle = append(a.idle[:i], a.idle[i+1:]...)
			break
		}
	}
	var lost []*hold
	for id, hs := range a.held {
		keep := hs[:0]
		for _, h := range hs {
			if h.ss == ss {
				h.done = true
				lost = append(lost, h)
			} else {
				keep = append(keep, h)
			}
		}
		a.setHolds(id, keep)
	}
	ss.n = 0
	closed := a.closed
	a.mu.Unlock()
	if closed || cause == nil {
		return
	}
	err := fmt.Errorf("pglock: the server session holding it ended: %w", cause)
	if len(lost) > 0 {
		a.log.Warn("pglock: an advisory session ended; its locks are lost", "locks", len(lost), "err", cause)
		a.wg.Add(1) // this session's goroutine still counts: Close waits for it
		go func() {
			defer a.wg.Done()
			a.notifyFreed(lost)
		}()
	}
	for _, h := range lost {
		a.loss.Report(h.key, h.token, err)
	}
}

// heldLocally returns the local hold that forbids a grant of id on ss (nil:
// on a session of its own) in the mode shared says: any hold on ss itself
// (a grant there would be re-entrant, and its unlock would undo the wrong
// one; whatever the modes, since an exclusive grant on a session that holds
// the lock shared would go with the shared holds of other sessions), or a
// hold on another session, not being released, whose mode conflicts.
func (a *Advisory) heldLocally(id uint64, ss *session, shared bool) *hold {
	a.mu.Lock()
	defer a.mu.Unlock()
	for _, h := range a.held[id] {
		switch {
		case h.done:
		case h.ss == ss, !h.releasing && (!shared || !h.shared):
			return h
		}
	}
	return nil
}

// holdsOn reports whether ss holds id for this process.
func (a *Advisory) holdsOn(id uint64, ss *session) bool {
	a.mu.Lock()
	defer a.mu.Unlock()
	for _, h := range a.held[id] {
		if h.ss == ss && !h.done {
			return true
		}
	}
	return false
}

// setHolds sets the holds of id, forgetting id when there are none. The
// caller holds a.mu.
func (a *Advisory) setHolds(id uint64, hs []*hold) {
	if len(hs) == 0 {
		delete(a.held, id)
		return
	}
	a.held[id] = hs
}

// find returns the hold of key with token, or nil. The caller holds a.mu.
func (a *Advisory) find(key string, token dlock.Token) *hold {
	for _, h := range a.held[hashKey(key)] {
		if h.key == key && h.token == token && !h.done {
			return h
		}
	}
	return nil
}

// grantResult is the outcome of a grant job.
type grantResult struct {
	ok      bool
	fence   uint64
	holder  *hold         // the local hold that refused it
	mark    time.Duration // a shared request refused by the writer mark: its remaining time
	delayed time.Duration // a request refused by a lock-delay: its remaining time
}

// SupportsMode implements dlock.Sharer: exclusive and shared acquisitions
// (pg_advisory_lock_shared); PostgreSQL has no counting advisory lock.
func (a *Advisory) SupportsMode(m dlock.Mode) bool {
	return m == dlock.ModeExclusive || m == dlock.ModeShared
}

// checkAdvisoryMode refuses, before any I/O, a mode the Advisory does not
// grant.
func checkAdvisoryMode(req dlock.Request) error {
	if err := dlock.ValidateMode(req); err != nil {
		return err
	}
	if req.Mode == dlock.ModeLimited {
		return fmt.Errorf("%w: pglock: the advisory strategy has no limited acquisitions", dlock.ErrUnsupported)
	}
	if req.LockDelay < 0 || req.LockDelay >= req.TTL {
		return fmt.Errorf("%w: pglock: advisory: lock-delay %s outside 0..ttl %s", dlock.ErrInvalidOption, req.LockDelay, req.TTL)
	}
	if req.LockDelay > 0 && req.Mode == dlock.ModeShared {
		return fmt.Errorf("%w: pglock: the advisory strategy keeps a lock-delay for exclusive acquisitions only", dlock.ErrUnsupported)
	}
	return nil
}

// Acquire implements dlock.Backend: pg_try_advisory_lock (or
// pg_try_advisory_lock_shared) on the main session, and the fencing row in
// the same statement; a shared request for a key the main session holds
// already tries on a session of its own. If the session turns out to be
// gone it is replaced and the attempt made once more. An ended ctx is
// refused before any I/O.
func (a *Advisory) Acquire(ctx context.Context, req dlock.Request) (dlock.Result, error) {
	if err := checkAdvisoryMode(req); err != nil {
		return dlock.Result{}, err
	}
	if err := a.claims.Check(ctx, req.Key); err != nil {
		return dlock.Result{}, wrapErr(a.tb, "advisory acquire", err)
	}
	began := time.Now()
	id := hashKey(req.Key)
	shared := req.Mode == dlock.ModeShared
	q := a.q.try
	if shared {
		q = a.q.tryShared
	}
	for try := 0; ; try++ {
		if h := a.heldLocally(id, nil, shared); h != nil {
			return a.notAcquired(ctx, req, h, 0), nil
		}
		if err := ctxend.Err(ctx); err != nil {
			return dlock.Result{}, err
		}
		ss, err := a.mainSession(ctx)
		own := false
		if err == nil && shared && a.holdsOn(id, ss) {
			ss, err = a.open(ctx)
			own = true
		}
		if err != nil {
			return dlock.Result{}, a.wrap("advisory acquire", err)
		}
		var res grantResult
		err = ss.do(ctx, statementBound, false, func(jctx context.Context, j *job) error {
			if own {
				defer func() {
					if !res.ok {
						a.park(ss)
					}
				}()
			}
			// Checked again in the session's turn: a second grant on the
			// same session would succeed (advisory locks are re-entrant).
			if res.holder = a.heldLocally(id, ss, shared); res.holder != nil {
				return nil
			}
			if err := a.cover(jctx, ss, holderTTL(req)); err != nil {
				return err
			}
			return a.grant(jctx, j, ss, q, id, req, &res)
		})
		switch {
		case errors.Is(err, errLeft):
			if own && errors.Is(err, errNotRun) {
				a.park(ss) // what the job would have done
			}
			return dlock.Result{}, ctx.Err()
		case endsSession(err) && try == 0 && !errors.Is(err, ErrTransactionPooling):
			continue // whatever the statement did died with the session
		case err != nil:
			return dlock.Result{}, a.wrap("advisory acquire", err)
		case res.holder != nil || !res.ok:
			a.refused.Refused(req.Key, began)
			out := a.notAcquired(ctx, req, res.holder, res.mark)
			out.Remaining = max(out.Remaining, res.delayed)
			return out, nil
		}
		return dlock.Result{Acquired: true, Fence: res.fence}, nil
	}
}

// wrap is wrapErr, with dlock.ErrClosed for an Advisory that was closed.
func (a *Advisory) wrap(op string, err error) error {
	a.mu.Lock()
	closed := a.closed
	a.mu.Unlock()
	if closed || errors.Is(err, dlock.ErrClosed) {
		return dlock.ErrClosed
	}
	return wrapErr(a.tb, op, err)
}

// record notes a grant.
func (a *Advisory) record(id uint64, req dlock.Request, ss *session) {
	a.mu.Lock()
	// A hold being released may still be here: the server granted the key
	// because its unlock went through. Its Release does its accounting.
	a.held[id] = append(a.held[id], &hold{id: id, key: req.Key, token: req.Token, ss: ss, shared: req.Mode == dlock.ModeShared, delay: req.LockDelay})
	ss.n++
	a.mu.Unlock()
}

// grant runs a grant statement in the session's goroutine, checks that the
// session is still the one it was, and settles the outcome: a grant whose
// caller still waits is recorded; one whose caller left is unlocked. After
// an error that leaves the session usable it unlocks what the statement may
// have locked.
func (a *Advisory) grant(ctx context.Context, j *job, ss *session, q string, id uint64, req dlock.Request, res *grantResult) error {
	k1, k2 := split(id)
	var fence *int64
	var pid uint32
	var syncCommit string
	var markUs, delayUs int64
	shared := req.Mode == dlock.ModeShared
	args := []any{k1, k2, []byte(req.Key), int64(id), req.Token[:], req.Owner, req.Metadata, us(req.LockDelay)}
	if q == a.q.try {
		args = append(args, us(dlock.WriterMark))
	}
	args = append(args, a.durable.Load())
	err := ss.conn.QueryRow(ctx, q, args...).Scan(&res.ok, &fence, &pid, &syncCommit, &markUs, nil, nil, &delayUs)
	if pe := (*pgconn.PgError)(nil); errors.As(err, &pe) && strings.Contains(pe.Message, fencesExhausted) {
		err = &fencesExhaustedError{pg: pe,
			msg: fmt.Sprintf("%v: %q reached 2^%d; emptying %s begins a new epoch", ErrFencesExhausted, req.Key, epochShift, a.tb.epoch)}
	}
	res.mark = time.Duration(markUs) * time.Microsecond
	if err == nil && !res.ok && delayUs > 0 {
		res.delayed = time.Duration(delayUs) * time.Microsecond
	}
	switch {
	case err == nil && pid != ss.pid:
		return ErrTransactionPooling
	case err == nil && res.ok && fence == nil:
		err = errors.New("pglock: no fence from the grant")
	case err == nil && res.ok && (q == a.q.wait || q == a.q.waitShared) && a.heldLocally(id, ss, shared) != nil:
		// Cannot happen (the server excludes other sessions); refuse.
		err = fmt.Errorf("pglock: advisory lock of %q granted twice in one process", req.Key)
	}
	if err == nil && a.grantHook != nil {
		a.grantHook(syncCommit)
	}
	if err != nil {
		res.ok = false
		if sessionLost(err) {
			return err
		}
		j.waitCancel()
		if _, uerr := a.unlock(ctx, ss, id, req.Key, req.Token, shared, req.LockDelay > 0, 0); uerr != nil {
			return dlock.Join(err, uerr)
		}
		if q != a.q.wait || !lockTimedOut(err) || j.callerLeft() {
			return err
		}
		// The wait reached its bound: not acquired yet. The mark keeps new
		// readers out until the caller waits again.
		if _, err := ss.conn.Exec(ctx, a.q.mark, []byte(req.Key), us(dlock.WriterMark)); sessionLost(err) {
			return err
		} else if err != nil && !cancelled(err) {
			a.log.Warn("pglock: could not renew the writer mark", "key", req.Key, "err", err)
		}
		return nil
	}
	if res.ok {
		res.fence = uint64(*fence)
	}
	if j.settle() {
		if res.ok {
			a.record(id, req, ss)
			// Its commit waited for the standbys, uncancelled: its
			// epoch is as durable as the server's commits are.
			a.durable.Store(int64(res.fence >> epochShift))
		}
		return nil
	}
	// The caller left: nobody will use or release this grant.
	if res.ok {
		j.waitCancel()
		_, err = a.unlock(ctx, ss, id, req.Key, req.Token, shared, req.LockDelay > 0, 0)
		switch {
		case err == nil:
			res.ok = false // the session holds nothing for the caller: it may be parked
		case !sessionLost(err) && a.holdsNothing(ss):
			ss.stop() // its end frees the grant that could not be unlocked
		}
	}
	return err
}

// holdsNothing reports whether ss holds no lock recorded for a caller and
// is not the main session, so that ending it costs nobody a lock.
func (a *Advisory) holdsNothing(ss *session) bool {
	a.mu.Lock()
	defer a.mu.Unlock()
	return a.holdsNothingLocked(ss)
}

// holdsNothingLocked is holdsNothing with a.mu held.
func (a *Advisory) holdsNothingLocked(ss *session) bool { return ss.n == 0 && ss != a.main }

// unlock runs pg_advisory_unlock (pg_advisory_unlock_shared for a shared
// hold, which also deletes the hold's row) in the session's goroutine and
// checks the session. With released, the grant (which had a lock-delay) is
// marked released first, so that the next grant keeps no lock-delay. A
// statement cancelled by a late cancel request is run again; if the
// cancelled one had unlocked, the next reports it not held, which then
// counts as unlocked (a session holds a key at most once: see heldLocally).
func (a *Advisory) unlock(ctx context.Context, ss *session, id uint64, key string, token dlock.Token, shared, released bool, keep time.Duration) (bool, error) {
	k1, k2 := split(id)
	q := a.q.unlock
	switch {
	case shared:
		q = a.q.unlockShared
	case keep > 0:
		q = a.q.unlockKept
	case released:
		q = a.q.unlockReleased
	}
	args := []any{k1, k2, []byte(key), false, token[:]}
	if keep > 0 && !shared {
		args = append(args, us(keep))
	}
	var ok bool
	var pid uint32
	var err error
	for try := 0; try < 3; try++ {
		args[3] = try > 0
		err = ss.conn.QueryRow(ctx, q, args...).Scan(&ok, &pid, nil)
		if !cancelled(err) {
			ok = ok || try > 0
			break
		}
	}
	if err == nil && pid != ss.pid {
		return false, ErrTransactionPooling
	}
	return ok, err
}

// notAcquired describes the holder of a refused request: the local one, or
// the key's last grant (not read for a request whose refusal goes unread:
// NoHolder); or the writer mark that refused a shared request (mark > 0).
// An exclusive request refused by a local shared hold leaves the writer
// mark, as the grant statement does when the server refuses it.
func (a *Advisory) notAcquired(ctx context.Context, req dlock.Request, h *hold, mark time.Duration) dlock.Result {
	key := req.Key
	if mark > 0 {
		return dlock.Result{Holder: dlock.LockInfo{Key: key}, Remaining: mark}
	}
	if h != nil && h.shared && req.Mode == dlock.ModeExclusive && ctxend.Err(ctx) == nil {
		if _, err := a.pool.Exec(ctx, a.q.mark, []byte(key), us(dlock.WriterMark)); err != nil {
			a.log.Warn("pglock: could not leave the writer mark", "key", key, "err", err)
		}
	}
	if h != nil && h.key == key {
		info := dlock.LockInfo{Key: key, Token: h.token}
		if h.shared {
			info.Mode = dlock.ModeShared
		}
		return dlock.Result{Holder: info}
	}
	if req.NoHolder || ctxend.Err(ctx) != nil {
		return dlock.Result{Holder: dlock.LockInfo{Key: key}}
	}
	var r holderRow
	var lim int32
	err := a.pool.QueryRow(ctx, a.q.holder, []byte(key)).Scan(&r.name, &r.token, &r.owner, &r.fence, &r.metadata, &r.acquiredAt, &lim)
	if err != nil {
		return dlock.Result{Holder: dlock.LockInfo{Key: key}}
	}
	info, _ := r.info(key, time.Now())
	info.Mode, info.Limit = modeOf(lim)
	return dlock.Result{Holder: info}
}

// markRecheck bounds the sleep of a shared waiter that met the writer mark:
// the writer's grant clears the mark long before it ends, and the reader,
// asking again, then queues behind the writer in the server instead of
// sleeping out the mark while readers that came later get in.
const markRecheck = 100 * time.Millisecond

// AcquireWait implements dlock.Waiter: pg_advisory_lock (or
// pg_advisory_lock_shared) on a session of its own, for up to 30 s. When
// ctx ends first the wait is cancelled with a cancel request, and a grant
// that raced with the cancellation is unlocked. While an exclusive request
// waits in the server, PostgreSQL refuses new shared requests, waiting or
// not; the server ends an exclusive wait by itself (see waitBound), which
// renews the writer mark and returns without the key, nor an error, for
// the caller to wait again. A shared request that meets the writer mark of
// an exclusive attempt sleeps until the mark ends, or markRecheck at most
// (or until ctx ends), and returns without the key. A key that no try of
// this Advisory found held in the last second is tried first, as Acquire
// does, on the main session (see WaitsDirectly).
func (a *Advisory) AcquireWait(ctx context.Context, req dlock.Request) (dlock.Result, error) {
	began := time.Now()
	if err := checkAdvisoryMode(req); err != nil {
		return dlock.Result{}, err
	}
	if ctxend.Err(ctx) != nil {
		return dlock.Result{}, nil
	}
	if res, done, err := a.refused.TryFirst(ctx, req, true, a.Acquire); done {
		return res, err
	}
	if err := a.claims.Check(ctx, req.Key); err != nil {
		if ctx.Err() != nil {
			return dlock.Result{}, nil
		}
		return dlock.Result{}, wrapErr(a.tb, "advisory acquire", err)
	}
	ss, err := a.open(ctx)
	if err != nil {
		if ctx.Err() != nil {
			return dlock.Result{}, nil
		}
		return dlock.Result{}, a.wrap("advisory acquire", err)
	}
	id := hashKey(req.Key)
	// The server ends an exclusive wait first (waitAlone).
	wctx, cancel := context.WithTimeout(ctx, maxWait+waitBound)
	defer cancel()
	var res grantResult
	var waitSent time.Time // when a quick wait that granted was sent
	err = ss.do(wctx, maxWait+statementBound, false, func(jctx context.Context, j *job) error {
		defer func() {
			if !res.ok {
				a.park(ss)
			}
		}()
		if j.callerLeft() { // do not queue a wait nobody waits for
			return nil
		}
		if err := a.cover(jctx, ss, holderTTL(req)); err != nil {
			return err
		}
		q := a.q.wait
		if req.Mode == dlock.ModeShared {
			q = a.q.waitShared
		}
		sent := time.Now()
		err := a.grant(jctx, j, ss, q, id, req, &res)
		if res.ok && time.Since(sent) <= quickWait(req) {
			waitSent = sent
		}
		return err
	})
	switch {
	case errors.Is(err, errNotRun):
		a.park(ss) // what the job would have done
		return dlock.Result{}, nil
	case errors.Is(err, errLeft):
		return dlock.Result{}, nil
	case err != nil:
		return dlock.Result{}, a.wrap("advisory acquire", err)
	case !res.ok && res.mark > 0:
		t := time.NewTimer(min(res.mark, markRecheck))
		defer t.Stop()
		select {
		case <-t.C:
		case <-ctx.Done():
		}
		return dlock.Result{Holder: dlock.LockInfo{Key: req.Key}}, nil
	case !res.ok && res.delayed > 0: // wait out the lock-delay, then ask again
		t := time.NewTimer(res.delayed)
		defer t.Stop()
		select {
		case <-t.C:
		case <-ctx.Done():
		}
		return dlock.Result{}, nil
	case !res.ok:
		return dlock.Result{}, nil
	}
	if !waitSent.IsZero() {
		// The grant's reply came within quickWait of the wait's sending:
		// timed from that sending, it keeps most of its lease without the
		// round trip that confirms it.
		if ctx.Err() == nil {
			return dlock.Result{Acquired: true, Fence: res.fence, SentAfter: waitSent.Sub(began)}, nil
		}
		// The caller left: nobody will use this grant.
		cctx, ccancel := context.WithTimeout(context.WithoutCancel(ctx), statementBound)
		defer ccancel()
		_ = a.Release(cctx, req.Key, req.Token)
		return dlock.Result{}, nil
	}
	// The lease is timed from a statement sent on the session after the
	// granting reply arrived: the reply may have arrived long after it was
	// sent (a paused process, a reply held up in the network), and the
	// server counts idle_session_timeout from its sending. A session that
	// is gone by then took the grant with it: the wait returns without it.
	confirming := time.Now()
	// The check runs whatever the caller does meanwhile (a check cut by
	// the caller's context would read as a lost session and leave the
	// grant held with nobody to release it); the caller's leaving is
	// looked at afterwards.
	cctx, ccancel := context.WithTimeout(context.WithoutCancel(ctx), statementBound)
	defer ccancel()
	errs, _ := a.Extend(cctx, []dlock.Lease{{Key: req.Key, Token: req.Token, TTL: req.TTL}})
	if err := errs[0]; err == nil && ctx.Err() == nil {
		return dlock.Result{Acquired: true, Fence: res.fence, SentAfter: confirming.Sub(began)}, nil
	}
	// Unconfirmed, or the caller left: nobody will use this grant. A
	// release that finds it gone changes nothing.
	rerr := a.Release(cctx, req.Key, req.Token)
	switch err := errs[0]; {
	case err == nil, errors.Is(err, dlock.ErrNotHeld), ctx.Err() != nil:
		return dlock.Result{}, nil
	case rerr == nil || errors.Is(rerr, dlock.ErrNotHeld):
		return dlock.Result{}, a.wrap("advisory acquire", err)
	default:
		return dlock.Result{}, a.wrap("advisory acquire", dlock.Join(err, rerr))
	}
}

// WaitsDirectly implements dlock.DirectWaiter: a blocking acquisition
// calls AcquireWait at once, which tries first unless a try found the key
// held lately, so that a contended acquisition costs one statement before
// its wait, not two, and a free key costs no session of its own.
func (a *Advisory) WaitsDirectly() bool { return true }

// holding returns the session where token holds key.
func (a *Advisory) holding(key string, token dlock.Token) *session {
	a.mu.Lock()
	defer a.mu.Unlock()
	if h := a.find(key, token); h != nil {
		return h.ss
	}
	return nil
}

// beginRelease returns the hold of key and token, marked as being released,
// or nil if this process does not hold it.
func (a *Advisory) beginRelease(key string, token dlock.Token) *hold {
	a.mu.Lock()
	defer a.mu.Unlock()
	h := a.find(key, token)
	if h == nil || h.releasing {
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
		hs := a.held[h.id]
		for i, o := range hs {
			if o == h {
				a.setHolds(h.id, append(hs[:i:i], hs[i+1:]...))
				break
			}
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
// pid), which also keeps the session from going idle. A renewal whose ctx
// ends first reports the context's error for its leases (the Locker tries
// again); the session is left alone.
func (a *Advisory) Extend(ctx context.Context, leases []dlock.Lease) ([]error, error) {
	errs := make([]error, len(leases))
	bySession := map[*session][]int{}
	for i, l := range leases {
		if ss := a.holding(l.Key, l.Token); ss != nil {
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
		gone := make(map[int]bool)
		err := ctxend.Err(ctx)
		if err == nil {
			err = ss.do(ctx, statementBound, false, func(jctx context.Context, _ *job) error {
				var pid uint32
				var missing []int64
				err := ss.conn.QueryRow(jctx, a.q.check, k1s, k2s).Scan(&pid, &missing)
				if err == nil && pid != ss.pid {
					err = ErrTransactionPooling
				}
				if err != nil {
					return err
				}
				for _, m := range missing {
					i := idx[int(m)-1]
					gone[int(m)-1] = true
					a.forget(leases[i].Key, leases[i].Token)
				}
				return nil
			})
		}
		for j, i := range idx {
			switch {
			case endsSession(err):
				errs[i] = fmt.Errorf("%w: session lost: %w", dlock.ErrNotHeld, err)
			case err != nil:
				errs[i] = wrapErr(a.tb, "advisory extend", err)
			case gone[j]:
				errs[i] = dlock.ErrNotHeld
			}
		}
	}
	return errs, nil
}

// forget drops a local hold that the server no longer grants.
func (a *Advisory) forget(key string, token dlock.Token) {
	a.mu.Lock()
	h := a.find(key, token)
	a.mu.Unlock()
	if h != nil {
		a.dropHold(h)
	}
}

// grantedAfter reports whether the server granted exclusive h's key to
// another session of this process since h's release began, which means
// that the unlock went through. The caller holds a.mu.
func (a *Advisory) grantedAfter(h *hold) bool {
	for _, o := range a.held[h.id] {
		if o != h && !o.done && !o.shared && !h.shared && o.ss != h.ss {
			return true
		}
	}
	return false
}

// Release implements dlock.Backend: pg_advisory_unlock on the holding
// session (for a grant with a lock-delay, in a statement that first marks
// it released). A session that holds nothing more is kept for reuse. The
// unlock runs to its end even when ctx ends first (even if it had ended
// before the call): Release then returns the context's error at once, and
// the lock is freed without it.
func (a *Advisory) Release(ctx context.Context, key string, token dlock.Token) error {
	return a.end(ctx, key, token, true, 0)
}

// end is Release when released, and Abandon otherwise.
func (a *Advisory) end(ctx context.Context, key string, token dlock.Token, released bool, keep time.Duration) error {
	h := a.beginRelease(key, token)
	if h == nil {
		return dlock.ErrNotHeld
	}
	ss := h.ss
	var ok bool
	err := ss.do(ctx, statementBound, true, func(jctx context.Context, _ *job) error {
		var err error
		ok, err = a.unlock(jctx, ss, h.id, h.key, h.token, h.shared, released && h.delay > 0, keep)
		if a.afterUnlock != nil {
			a.afterUnlock()
		}
		switch {
		case err == nil:
			a.dropHold(h)
		case endsSession(err):
			// The session, and the lock with it, is gone.
		default:
			a.mu.Lock()
			mine := !h.done && !a.grantedAfter(h)
			if mine {
				h.releasing = false // the unlock may not have run: still held
			}
			a.mu.Unlock()
			if !mine {
				// Another session of this process was granted the key
				// meanwhile, so the server did unlock it.
				a.dropHold(h)
				ok, err = true, nil
			}
		}
		return err
	})
	switch {
	case errors.Is(err, errLeft):
		return fmt.Errorf("pglock: advisory release: %w (the unlock goes on without the caller)", context.Cause(ctx))
	case endsSession(err):
		return fmt.Errorf("%w: session lost: %w", dlock.ErrNotHeld, err)
	case err != nil:
		return wrapErr(a.tb, "advisory release", err)
	case !ok:
		return dlock.ErrNotHeld
	}
	return nil
}

// ForceRelease implements dlock.ForceReleaser. PostgreSQL cannot unlock
// another session's advisory lock, so this terminates the holder's session
// (pg_terminate_backend, waiting up to 5 s for it to end): every lock that
// session held is freed, and its holders learn it at their next renewal.
// The same statement notifies the key's watches. It
// needs the right to signal that backend (same role, pg_signal_backend or
// superuser).
func (a *Advisory) ForceRelease(ctx context.Context, key string) error {
	if err := a.claims.CheckOnly(ctx, key); err != nil {
		return wrapErr(a.tb, "advisory force release", err)
	}
	k1, k2 := AdvisoryKeys(key)
	rows, err := a.pool.Query(ctx, a.q.forceRelease, k1, k2, []byte(key))
	if err != nil {
		return wrapErr(a.tb, "advisory force release", err)
	}
	oks, err := pgx.CollectRows(rows, func(row pgx.CollectableRow) (bool, error) {
		var ok bool
		err := row.Scan(&ok, nil)
		return ok, err
	})
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

// Watch implements dlock.Watcher on a LISTEN connection of the Advisory's
// own (opened on the first Watch, outside the pool): every grant, unlock
// and metadata change sends a NOTIFY in its own transaction, and so do
// ForceRelease, Close (for the locks it frees) and the Advisory whose
// session ended (for the locks it held, as soon as it sees the end). A
// lock freed because its holder's session ended and nobody saw it (the
// holder's process died with it) sends nothing: the key's next grant does,
// at once if a waiter queues for it. The channel is closed when ctx ends
// or the connection breaks; Watch returns once the connection LISTENs, and
// an error if it cannot (dlock.ErrClosed after Close).
func (a *Advisory) Watch(ctx context.Context, key string) (<-chan struct{}, error) {
	ch, err := a.ln.watchKey(ctx, key)
	if err != nil && !errors.Is(err, dlock.ErrClosed) && ctxend.Err(ctx) == nil {
		return nil, wrapErr(a.tb, "advisory watch", err)
	}
	return ch, err
}

// WatchHolders implements dlock.HolderWatcher on the Advisory's LISTEN
// connection: it LISTENs, then reads key's holders (as List) and change
// counter in one statement, then applies each later change that the
// notifications carry (a grant, an unlock, a metadata change, and the ends
// of sessions that Watch reports), in the order the server commits them.
// ExpiresAt is zero: a lock lasts as long as its session. A session that
// ended unseen (its process died with it) still shows until the key's next
// grant, which drops it. The channel is closed when ctx ends, when the
// connection breaks, after Close, when a change was missed (its counter
// skips, or it came from a client of an earlier version) or could not be
// told (its record would not fit in a NOTIFY), and when the reader falls
// more than 1024 changes behind.
func (a *Advisory) WatchHolders(ctx context.Context, key string) ([]dlock.LockInfo, <-chan []dlock.LockInfo, error) {
	return watchHolders(ctx, a.ln, a.pool, a.q.watchHolders, a.tb, "advisory watch", key)
}

// SetMetadata implements dlock.MetadataSetter, for a lock of this Advisory
// (ErrNotHeld without I/O otherwise), in one statement on the pool that
// checks that the holder's session still holds the lock, and notifies the
// key's watches. It never runs on a session that holds locks, so its ctx
// cannot end one.
func (a *Advisory) SetMetadata(ctx context.Context, key string, token dlock.Token, metadata string) error {
	if a.holding(key, token) == nil {
		return dlock.ErrNotHeld
	}
	k1, k2 := AdvisoryKeys(key)
	rows, err := a.pool.Query(ctx, a.q.setMetadata, []byte(key), token[:], metadata, k1, k2)
	if err != nil {
		return wrapErr(a.tb, "advisory set metadata", err)
	}
	n := 0
	for rows.Next() {
		n++
	}
	rows.Close()
	if err := rows.Err(); err != nil {
		return wrapErr(a.tb, "advisory set metadata", err)
	}
	if n == 0 {
		return dlock.ErrNotHeld
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
		var lim int32
		if err := rows.Scan(&h.name, &h.token, &h.owner, &h.fence, &h.metadata, &h.acquiredAt, &lim); err != nil {
			return nil, wrapErr(a.tb, "advisory list", err)
		}
		info, _ := h.info("", time.Time{})
		info.Mode, info.Limit = modeOf(lim)
		out = append(out, info)
	}
	if err := rows.Err(); err != nil {
		return nil, wrapErr(a.tb, "advisory list", err)
	}
	return out, nil
}
