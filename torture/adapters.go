package torture

import (
	"context"
	"database/sql"
	"errors"
	"fmt"
	"net"
	"path/filepath"
	"strconv"
	"strings"
	"time"

	"github.com/dlock-dev/dlock"
	"github.com/dlock-dev/dlock/mysqllock"
	"github.com/dlock-dev/dlock/sqlitelock"
	"github.com/go-sql-driver/mysql"
)

// An Adapter is everything the harness knows of one strategy/backend. Adding
// a backend means adding one value to Adapters.
type Adapter struct {
	// Name identifies the strategy in flags and reports.
	Name string

	// Networked reports that the store is a server reached over TCP at the
	// address Upstream returns; the harness then puts one fault proxy per
	// worker in front of it and hands Open the proxy's address. Embedded
	// stores get no network faults.
	Networked bool

	// Upstream returns the store server's TCP address (host:port), from
	// the DSN in env that the strategy uses. Required when Networked.
	Upstream func(env *Env) (string, error)

	// SessionHeld reports that a lock lives in a server session and ends
	// when the session does (getlock, rowlock, pg-advisory), not at its
	// TTL: takeover after a pause or partition then waits for the session
	// to end, and the kill/stop takeover target (TTL + 250 ms) does not
	// apply.
	SessionHeld bool

	// Pooled reports that Open sizes the store client's connection pool by
	// OpenArgs.PoolSize (the smallpool client fault).
	Pooled bool

	// PauseStallsStore reports that a paused worker can stall every other
	// worker's store access: an embedded store whose file lock the paused
	// process may hold mid-transaction (SQLite). Liveness then leaves out
	// free periods that overlap any worker's pause, not only the waiter's.
	PauseStallsStore bool

	// Modes are the modes other than exclusive that the strategy grants
	// (dlock.Sharer): a run with Config.ModeKeys adds a key for each.
	Modes []dlock.Mode

	// Known lists violation kinds that are known limitations of the
	// strategy under a fault kind: they are reported (as known) but do not
	// fail the run.
	Known map[string][]string

	// Prepare runs in the harness before the workers start. It creates a
	// fresh lock table with the instrumentation History reads, and returns
	// what workers need to open the store (opaque to the harness).
	Prepare func(ctx context.Context, env *Env) (store string, err error)

	// Open runs in a worker and returns its backend. close, if non-nil,
	// is called when the worker is done with it.
	Open func(ctx context.Context, a OpenArgs) (b dlock.Backend, close func() error, err error)

	// History returns the store's own record of every change to a lease, in
	// the order the store applied them. Optional: without it the
	// server-side checks are skipped (reported as not run) and lead times
	// are estimated from the next acquisition.
	// History (and Record's stop) may return an error matching ErrNoHistory:
	// the record cannot be read in this setup, and the checks that need it are
	// reported inconclusive instead of failing the run.
	History func(ctx context.Context, env *Env, store string) ([]LeaseEvent, error)

	// Record starts recording the store's changes as they happen, for a
	// store that keeps no history to read afterwards (a MONITOR feed, a
	// watch). It runs in the harness after Prepare and before the workers
	// start, and returns the function that stops the recording and returns
	// it; that replaces History. Optional.
	Record func(ctx context.Context, env *Env, store string) (*Recording, error)

	// Restart kills the store's server with SIGKILL, starts it again and
	// returns once it serves, with the Mono() times of the kill and of
	// readiness. Optional: nil for embedded stores.
	Restart func(ctx context.Context, env *Env) (killed, ready int64, err error)

	// StoreClock reads the store server's clock (Unix µs, as the history
	// stamps instants). The harness samples it through the run when the
	// store runs on a clock of its own (Config.StoreDSN) and maps the
	// history's instants by the samples. Optional.
	StoreClock func(ctx context.Context, env *Env) (int64, error)
}

// A Recording is a store record in progress (Adapter.Record).
type Recording struct {
	// Stop ends the recording and returns the history.
	Stop func(ctx context.Context) ([]LeaseEvent, error)
	// Sync returns once every change the store applied before the call is
	// in the record. Optional; with it, the harness takes the store away
	// from the workers (their fault proxies refuse connections) and syncs
	// before it kills the server, so that no change is lost from the
	// record with the server, and gives it back after Restarted.
	Sync func(ctx context.Context) error
	// Restarted tells the recording that the server was killed at killedUs
	// (Unix µs, this host) and serves again, and returns once the record
	// follows the new server. Optional.
	Restarted func(ctx context.Context, killedUs int64) error
}

// ErrNoHistory means that the store's record is not available in this setup
// (zk-lease without the ZooKeeper's dataDir): see Adapter.History.
var ErrNoHistory = errors.New("torture: no store history in this setup")

// Env is what the harness hands adapters.
type Env struct {
	Tag      string  // run tag, part of every table name
	Dir      string  // the run's output directory
	MySQLDSN string  // the MariaDB server of the resource
	DB       *sql.DB // a direct pool on MySQLDSN
	// The MariaDB server of the mysql strategies' lock tables, and a
	// direct pool on it: MySQLDSN and DB unless Config.StoreDSN is set.
	StoreDSN string
	StoreDB  *sql.DB
	PGDSN    string // the PostgreSQL server of the pg strategies (pgx syntax)
	// The servers of the redis, etcd and zk strategies (host:port).
	RedisAddr, EtcdAddr, ZKAddr string
	RedisMinReplicas            int    // Config.RedisMinReplicas
	ZKDataDir                   string // the ZooKeeper's dataDir, if the harness can read it
	TTL                         time.Duration
	// VersionSessions converts the mysql session strategies' session
	// table to InnoDB, versioned, for a record of their grants (see
	// sessionAdapter).
	VersionSessions bool
	Galera          bool   // Config.Galera
	GaleraBells     string // Config.GaleraBells
	// Unrecorded: the run reads no store history (a failover run), so
	// Prepare adds no instrumentation, which would change what the store
	// does: a trigger's logged write makes an unlogged grant durable and
	// makes it wait for synchronous standbys, and MariaDB logs changes of
	// a transaction-precise versioned table as statements, also those a
	// trigger makes, on which a replica stops.
	Unrecorded bool
	relaunched *relaunched // servers the restart fault started as the harness's children
}

// OpenArgs is what a worker hands Adapter.Open.
type OpenArgs struct {
	DSN      string // Env.MySQLDSN
	StoreDSN string // Env.StoreDSN
	Galera   bool   // Env.Galera
	// GaleraBells is Env.GaleraBells.
	GaleraBells string
	PGDSN       string // Env.PGDSN
	Store       string // from Prepare
	Addr        string // the worker's proxy for a networked store (replaces the DSN's address)
	// PoolSize, if not 0, is the size of the store client's connection
	// pool (the smallpool client fault); clients without a pool ignore it.
	PoolSize int
	// RedisMinReplicas is Env.RedisMinReplicas.
	RedisMinReplicas int
}

// LeaseEvent is one change of a lease as the store applied it: a grant (new
// fence), an extension (same fence, later expiry) or a release (expiry 0).
type LeaseEvent struct {
	Seq     int64  // store's apply order (per key at least)
	Key     string // lock key
	Fence   uint64
	Token   [16]byte
	AtUs    int64 // store clock (Unix µs): the "now" of the statement that made the change
	ExpUs   int64 // the lease's expiry after the change
	Release bool  // the change ended the lease
	// Lost: the store forgot the lease (a server without persistence was
	// killed) at AtUs; with Release. Nobody can be told before that.
	Lost bool
	// Open: the store records grants only (a session lock ends with its
	// session, which leaves no row behind); the lease's end is unknown.
	Open bool
	// Pid is the worker process whose Locker wrote the granted entry, read
	// from the Locker's default metadata ("… pid=N …") where the store keeps
	// it (etcd, ZooKeeper); 0 if unknown. It names the owner of a grant that
	// no worker reported (a waiter's queued entry that reached the head).
	Pid int
}

// metadataPid returns the pid in dlock's default Locker metadata
// ("host=H pid=N prog=P"), or 0.
func metadataPid(meta string) int {
	for _, f := range strings.Fields(meta) {
		if v, ok := strings.CutPrefix(f, "pid="); ok {
			if n, err := strconv.Atoi(v); err == nil {
				return n
			}
		}
	}
	return 0
}

// markReleases flags the changes that ended a lease: the expiry set to the
// epoch, or moved back for the same fence (a release that sets the expiry
// to the statement's now, which is then the release instant).
func markReleases(evs []LeaseEvent) {
	type kfence struct {
		k string
		f uint64
	}
	last := map[kfence]int64{}
	for i := range evs {
		e := &evs[i]
		id := kfence{e.Key, e.Fence}
		prev, seen := last[id]
		switch {
		case e.ExpUs <= 0 || e.Token == [16]byte{}:
			e.Release = true
		case seen && e.ExpUs < prev:
			e.Release, e.AtUs = true, e.ExpUs
		}
		last[id] = e.ExpUs
	}
}

// Adapters lists every strategy the harness can exercise.
var Adapters = []*Adapter{mysqlLease, mysqlGetLock, mysqlRowLock, sqliteLease, pgLease, pgAdvisory, redisLease, etcdLease, zkLease}

// addrUpstream returns an Upstream for a store given by its host:port in
// env (what names the Config field, for the error).
func addrUpstream(what string, addr func(env *Env) string) func(env *Env) (string, error) {
	return func(env *Env) (string, error) {
		a := addr(env)
		if a == "" {
			return "", fmt.Errorf("no %s address (Config.%sAddr)", what, what)
		}
		if _, _, err := net.SplitHostPort(a); err != nil {
			return "", fmt.Errorf("%s address %q: %w", what, a, err)
		}
		return a, nil
	}
}

// adapterByName returns the adapter called name.
func adapterByName(name string) *Adapter {
	for _, a := range Adapters {
		if a.Name == name {
			return a
		}
	}
	return nil
}

// mysqlLease is mysqllock's lease strategy on the MariaDB at Env.MySQLDSN.
//
// Its lock table gets transaction-precise system versioning: MariaDB keeps
// every version of every row, stamped with the id of the transaction that
// wrote it, and mysql.transaction_registry gives each transaction's commit
// order and time. That is the server's own record of every grant, extension
// and release, in the order it applied them, without touching the backend's
// statements. (Triggers would be simpler, but a trigger that writes to
// another table makes the server report insert id 0 for the acquisition,
// and mysqllock then never acquires anything: see README.md, findings.)
var mysqlLease = &Adapter{
	Name:      "mysql-lease",
	Modes:     bothModes,
	Networked: true,
	Pooled:    true,
	Upstream:  mysqlStoreUpstream,
	Prepare: func(ctx context.Context, env *Env) (string, error) {
		// On Galera the lock table is not versioned: a versioned table
		// written by the journal's triggers replicates their statements
		// as text that the other nodes cannot apply (Unknown column
		// NEW.name), and the cluster expels them. A failover run reads no
		// history anyway.
		return prepareMySQL(ctx, env, "", !env.Galera && !env.Unrecorded)
	},
	Open: func(ctx context.Context, a OpenArgs) (dlock.Backend, func() error, error) {
		return openMySQL(a, func(db *sql.DB, o *mysqllock.Options) (dlock.Backend, error) { return mysqllock.New(db, o) })
	},
	History: func(ctx context.Context, env *Env, store string) ([]LeaseEvent, error) {
		const us = "TIMESTAMPDIFF(MICROSECOND, '1970-01-01', %s)"
		rows, err := env.StoreDB.QueryContext(ctx, versionsQuery(store,
			fmt.Sprintf(us, "t.acquired_at")+", "+fmt.Sprintf(us, "t.expires_at")+", "+
				"CAST(UNIX_TIMESTAMP(r.commit_timestamp) * 1000000 AS SIGNED), t.jseq"))
		if err != nil {
			return nil, err
		}
		defer rows.Close()
		var out []LeaseEvent
		prev := map[string]uint64{}
		lastEv := map[string]LeaseEvent{}
		lastJ := map[string]uint64{}
		for rows.Next() {
			var e LeaseEvent
			var name, token []byte
			var acquiredUs, commitUs int64
			var jseq uint64
			if err := rows.Scan(&e.Seq, &name, &e.Fence, &token, &acquiredUs, &e.ExpUs, &commitUs, &jseq); err != nil {
				return nil, err
			}
			e.Key = string(name)
			copy(e.Token[:], token)
			p, ok := lastEv[e.Key]
			j, jok := lastJ[e.Key]
			lastJ[e.Key] = jseq
			if ok && p.Fence == e.Fence && p.Token == e.Token && p.ExpUs == e.ExpUs {
				continue // a version that changed nothing we track
			}
			// A release that hands the lease over updates the row twice in
			// one transaction, a release and then the grant (the journal's
			// position moves by exactly two), and leaves one version: the
			// old lease ended at the grant's instant.
			if ok && jok && jseq == j+2 && p.Fence != e.Fence &&
				p.Token != e.Token && p.Token != ([16]byte{}) && e.Token != ([16]byte{}) && p.ExpUs > acquiredUs {
				out = append(out, LeaseEvent{Seq: e.Seq, Key: e.Key, Fence: p.Fence, Token: p.Token, ExpUs: acquiredUs})
			}
			lastEv[e.Key] = e
			// The instant the statement used as "now": the grant's
			// acquired_at, an extension's expiry minus the TTL (markReleases
			// fixes releases that set the expiry to now; one that sets the
			// epoch leaves no trace of it, so its commit time stands in).
			f, seen := prev[e.Key]
			switch {
			case e.ExpUs <= 0:
				e.AtUs = commitUs
			case e.Token == [16]byte{}:
				// A release (mysqllock clears the token) sets the expiry
				// to its "now", or up to 100 ms before it (a release that
				// reserves nothing for a waiter): a lower bound.
				e.AtUs = e.ExpUs
			case !seen || f != e.Fence:
				e.AtUs = acquiredUs
			default:
				e.AtUs = e.ExpUs - env.TTL.Microseconds()
			}
			prev[e.Key] = e.Fence
			out = append(out, e)
		}
		markReleases(out)
		return out, rows.Err()
	},
	Restart:    restartMariaDB,
	StoreClock: mysqlClock,
}

// mysqlGetLock and mysqlRowLock are mysqllock's session strategies. Their
// session table (fence, token, holder's connection per key) is MEMORY,
// which a server restart empties and which MariaDB cannot version by
// transaction: there is no store record (ErrNoHistory), and fences are
// checked on the workers' and the resource's records (a fence granted
// twice is a violation). With Env.VersionSessions the table is converted
// to InnoDB and versioned the same way as the lease table, for a record of
// grants only; a restart then keeps its rows, and only the epoch of the
// server's run starts afresh.
var (
	mysqlGetLock = sessionAdapter("mysql-getlock", func(db *sql.DB, o *mysqllock.Options) (dlock.Backend, error) {
		return mysqllock.NewGetLock(db, o)
	})
	mysqlRowLock = sessionAdapter("mysql-rowlock", func(db *sql.DB, o *mysqllock.Options) (dlock.Backend, error) {
		return mysqllock.NewRowLock(db, o)
	})
)

// sessionEnds are the session strategies' known limitations: a cut
// connection, a server restart or a failover ends the session, and with it
// the lock, at once; the holder learns of it only when it next uses the
// connection (its next renewal, within TTL/3), so another client can hold
// the lock before the holder is told, and its Err says "held" until then.
// Only those faults: any other end of a session (a caller's deadline, a
// pool too small, a pause) is a violation.
var sessionEnds = map[string][]string{
	FaultCut:       {vLateNotice, vNoNotice, vErrNilAfterEnd, vOverClaimed},
	FaultDBRestart: {vLateNotice, vNoNotice, vErrNilAfterEnd, vOverClaimed},
	FaultFailover:  {vLateNotice, vNoNotice, vErrNilAfterEnd, vOverClaimed},
}

// bothModes are the modes of a strategy that grants every one.
var bothModes = []dlock.Mode{dlock.ModeShared, dlock.ModeLimited}

func sessionAdapter(name string, newB func(*sql.DB, *mysqllock.Options) (dlock.Backend, error)) *Adapter {
	return &Adapter{
		Name:        name,
		Networked:   true,
		Pooled:      true,
		Upstream:    mysqlStoreUpstream,
		SessionHeld: true,
		Known:       sessionEnds,
		Prepare: func(ctx context.Context, env *Env) (string, error) {
			if !env.VersionSessions || env.Unrecorded {
				return prepareMySQL(ctx, env, "", false)
			}
			return prepareMySQL(ctx, env, "_session", true)
		},
		Open: func(ctx context.Context, a OpenArgs) (dlock.Backend, func() error, error) {
			return openMySQL(a, newB)
		},
		History: func(ctx context.Context, env *Env, store string) ([]LeaseEvent, error) {
			if !env.VersionSessions {
				return nil, errMemorySessions
			}
			rows, err := env.StoreDB.QueryContext(ctx, versionsQuery(store+"_session",
				"TIMESTAMPDIFF(MICROSECOND, '1970-01-01', t.acquired_at)"))
			if err != nil {
				return nil, err
			}
			defer rows.Close()
			var out []LeaseEvent
			last := map[string]uint64{}
			for rows.Next() {
				e := LeaseEvent{Open: true}
				var name, token []byte
				if err := rows.Scan(&e.Seq, &name, &e.Fence, &token, &e.AtUs); err != nil {
					return nil, err
				}
				e.Key = string(name)
				copy(e.Token[:], token)
				if f, ok := last[e.Key]; ok && f == e.Fence {
					continue // same grant, another column changed
				}
				last[e.Key] = e.Fence
				out = append(out, e)
			}
			return out, rows.Err()
		},
		Restart:    restartMariaDB,
		StoreClock: mysqlClock,
	}
}

// mysqlClock reads the lock server's clock as the history's instants are
// computed (UTC_TIMESTAMP(6) is what mysqllock's statements use as now).
func mysqlClock(ctx context.Context, env *Env) (int64, error) {
	var us int64
	err := env.StoreDB.QueryRowContext(ctx, "SELECT TIMESTAMPDIFF(MICROSECOND, '1970-01-01', UTC_TIMESTAMP(6))").Scan(&us)
	return us, err
}

// versionsQuery selects every version of the system-versioned table (alias
// t) in commit order: the commit id, name, fence and token, then cols
// (which may use r, the version's mysql.transaction_registry row).
func versionsQuery(table, cols string) string {
	return "SELECT r.commit_id, t.name, t.fence, t.token, " + cols +
		" FROM " + table + " FOR SYSTEM_TIME ALL AS t" +
		" JOIN mysql.transaction_registry AS r ON r.transaction_id = t.row_start" +
		" ORDER BY r.commit_id"
}

// errMemorySessions is the session strategies' History without
// Env.VersionSessions.
var errMemorySessions = fmt.Errorf("%w: the session table is MEMORY (run with -version-sessions for a record of grants)", ErrNoHistory)

// prepareMySQL creates fresh lock tables for env's tag and, with version,
// versions the one named by suffix (the lease table, or "_session", which
// is converted to InnoDB first).
func prepareMySQL(ctx context.Context, env *Env, suffix string, version bool) (string, error) {
	locks := mysqlTable(env.Tag)
	b, err := mysqllock.New(env.StoreDB, &mysqllock.Options{Table: locks})
	if err != nil {
		return "", err
	}
	if c, ok := any(b).(interface{ Close() error }); ok {
		defer c.Close()
	}
	if _, err := env.StoreDB.ExecContext(ctx, "DROP TABLE IF EXISTS "+locks+", "+locks+"_session, "+locks+"_rows, "+locks+"_claims, "+locks+"_holders, "+locks+"_journal, "+locks+"_epoch, "+locks+"_run, "+locks+"_queue"); err != nil {
		return "", fmt.Errorf("prepare: %w", err)
	}
	if err := b.Migrate(ctx); err != nil {
		return "", err
	}
	if !version {
		return locks, nil
	}
	if _, err := env.StoreDB.ExecContext(ctx, "ALTER TABLE "+locks+suffix+" ENGINE=InnoDB,"+
		" ADD COLUMN row_start BIGINT UNSIGNED GENERATED ALWAYS AS ROW START INVISIBLE,"+
		" ADD COLUMN row_end BIGINT UNSIGNED GENERATED ALWAYS AS ROW END INVISIBLE,"+
		" ADD PERIOD FOR SYSTEM_TIME(row_start, row_end), ADD SYSTEM VERSIONING"); err != nil {
		return "", fmt.Errorf("prepare: version %s%s: %w", locks, suffix, err)
	}
	return locks, nil
}

// openMySQL opens a pool on the worker's proxy and a backend on it.
func openMySQL(a OpenArgs, newB func(*sql.DB, *mysqllock.Options) (dlock.Backend, error)) (dlock.Backend, func() error, error) {
	dsn := a.StoreDSN
	if dsn == "" {
		dsn = a.DSN
	}
	cfg, err := mysql.ParseDSN(dsn)
	if err != nil {
		return nil, nil, err
	}
	if a.Addr != "" {
		cfg.Net, cfg.Addr = "tcp", a.Addr
	}
	cfg.InterpolateParams = true
	if cfg.Timeout == 0 {
		cfg.Timeout = 2 * time.Second
	}
	db, err := sql.Open("mysql", cfg.FormatDSN())
	if err != nil {
		return nil, nil, err
	}
	opts := &mysqllock.Options{Table: a.Store, NoDoorbell: a.Galera && a.GaleraBells == ""}
	if a.PoolSize > 0 {
		// A small pool is the application's; dlock's sessions are pinned
		// outside it, as mysqllock documents for small pools.
		db.SetMaxOpenConns(a.PoolSize)
		if opts.Connector, err = mysql.NewConnector(cfg); err != nil {
			db.Close()
			return nil, nil, err
		}
	}
	if a.Galera && a.GaleraBells != "" {
		// The doorbells of every worker on one node (see Config.Galera).
		bells, err := mysql.ParseDSN(a.GaleraBells)
		if err == nil {
			opts.Connector, err = mysql.NewConnector(bells)
		}
		if err != nil {
			db.Close()
			return nil, nil, err
		}
	}
	b, err := newB(db, opts)
	if err != nil {
		db.Close()
		return nil, nil, err
	}
	closeAll := func() error {
		if c, ok := b.(interface{ Close() error }); ok {
			_ = c.Close()
		}
		return db.Close()
	}
	return b, closeAll, nil
}

func mysqlTable(tag string) string { return "torture_" + tag + "_locks" }

// sqliteLease is sqlitelock on a fresh file in the run directory, with the
// same history triggers (SQLite's 'now' is fixed for one statement, so the
// trigger sees the instant the statement used).
var sqliteLease = &Adapter{
	Name:   "sqlite-lease",
	Modes:  bothModes,
	Pooled: true,
	// A paused worker may hold the database file's write lock.
	PauseStallsStore: true,
	Prepare: func(ctx context.Context, env *Env) (string, error) {
		path := filepath.Join(env.Dir, "sqlite-"+env.Tag+".db")
		b, err := sqlitelock.Open(path)
		if err != nil {
			return "", err
		}
		defer b.Close()
		if err := b.Migrate(ctx); err != nil {
			return "", err
		}
		db, err := openSQLite(path)
		if err != nil {
			return "", err
		}
		defer db.Close()
		const ins = "INSERT INTO torture_hist (name, fence, token, at_us, exp_us) VALUES " +
			"(NEW.name, NEW.fence, NEW.token, CAST(unixepoch('now', 'subsec') * 1000000 AS INTEGER), NEW.expires_us)"
		for _, s := range []string{
			`CREATE TABLE IF NOT EXISTS torture_hist (seq INTEGER PRIMARY KEY AUTOINCREMENT,
  name TEXT NOT NULL, fence INTEGER NOT NULL, token BLOB NOT NULL, at_us INTEGER NOT NULL, exp_us INTEGER NOT NULL)`,
			"CREATE TRIGGER IF NOT EXISTS torture_ai AFTER INSERT ON dlock_locks BEGIN " + ins + "; END",
			"CREATE TRIGGER IF NOT EXISTS torture_au AFTER UPDATE ON dlock_locks " +
				"WHEN NEW.fence <> OLD.fence OR NEW.expires_us <> OLD.expires_us OR NEW.token <> OLD.token BEGIN " + ins + "; END",
		} {
			if _, err := db.ExecContext(ctx, s); err != nil {
				return "", fmt.Errorf("sqlite-lease prepare: %w", err)
			}
		}
		return path, nil
	},
	Open: func(ctx context.Context, a OpenArgs) (dlock.Backend, func() error, error) {
		if a.PoolSize > 0 {
			// A small pool is the caller's own database: sqlitelock.New.
			db, err := sql.Open("sqlite", "file:"+a.Store+"?_pragma=busy_timeout(10000)&_pragma=journal_mode(WAL)&_txlock=immediate")
			if err != nil {
				return nil, nil, err
			}
			db.SetMaxOpenConns(a.PoolSize)
			return sqlitelock.New(db), db.Close, nil
		}
		b, err := sqlitelock.Open(a.Store)
		if err != nil {
			return nil, nil, err
		}
		return b, b.Close, nil
	},
	History: func(ctx context.Context, env *Env, store string) ([]LeaseEvent, error) {
		db, err := openSQLite(store)
		if err != nil {
			return nil, err
		}
		defer db.Close()
		return scanHistory(ctx, db, "SELECT seq, name, fence, token, at_us, exp_us FROM torture_hist ORDER BY seq")
	},
}

func openSQLite(path string) (*sql.DB, error) {
	return sql.Open("sqlite", "file:"+path+"?_pragma=busy_timeout(10000)&_pragma=journal_mode(WAL)")
}

func scanHistory(ctx context.Context, db *sql.DB, q string) ([]LeaseEvent, error) {
	rows, err := db.QueryContext(ctx, q)
	if err != nil {
		return nil, err
	}
	defer rows.Close()
	var out []LeaseEvent
	for rows.Next() {
		var e LeaseEvent
		var name, token []byte
		if err := rows.Scan(&e.Seq, &name, &e.Fence, &token, &e.AtUs, &e.ExpUs); err != nil {
			return nil, err
		}
		e.Key = string(name)
		copy(e.Token[:], token)
		out = append(out, e)
	}
	markReleases(out)
	return out, rows.Err()
}

// mysqlStoreUpstream returns the TCP address of the mysql strategies' server.
func mysqlStoreUpstream(env *Env) (string, error) { return dsnUpstream(env.StoreDSN) }

// mysqlUpstream returns the TCP address of the resource's server.
func mysqlUpstream(env *Env) (string, error) { return dsnUpstream(env.MySQLDSN) }

// dsnUpstream returns the TCP address in a MySQL DSN.
func dsnUpstream(dsn string) (string, error) {
	cfg, err := mysql.ParseDSN(dsn)
	if err != nil {
		return "", err
	}
	if cfg.Net != "tcp" {
		return "", fmt.Errorf("the MySQL DSN must use tcp to put a proxy in the path, not %q", cfg.Net)
	}
	if _, _, err := net.SplitHostPort(cfg.Addr); err != nil {
		return cfg.Addr + ":3306", nil
	}
	return cfg.Addr, nil
}

// adapterNames lists the adapters' names.
func adapterNames() string {
	var s []string
	for _, a := range Adapters {
		s = append(s, a.Name)
	}
	return strings.Join(s, ",")
}
