// Command dlock-bench measures dlock's strategies against their physical
// floors and against peer libraries, side by side in one run, and prints a
// Markdown report (and JSON with -json) that ends with the performance targets,
// each judged met, MISSED or not measured from the run's own rows.
//
//	go run ./bench/cmd/dlock-bench -duration 3s -json bench.json
//
// It needs MariaDB/MySQL (-mysql, default the local test server) and starts
// its own redis-server on a free loopback port unless -redis is given. It
// also measures PostgreSQL (-pg, default the local test server) and etcd
// (-etcd; by default it starts etcd on free loopback ports when the binary
// is installed); either is left out, with a note, when it cannot be
// reached ("-pg off", "-etcd off" leave them out on purpose), and
// ZooKeeper (-zk; by default it starts one from Debian's zookeeper package
// when that is installed; "-zk off" leaves it out).
// -only REGEXP measures only the rows whose name it matches (-only pg,
// -only 'getlock|GET_LOCK'): a quicker run to compare two versions of one
// backend; -table names the lock table. Peer libraries live only in
// this module, so dlock's users never download them.
package main

import (
	"context"
	"database/sql"
	"encoding/json"
	"errors"
	"flag"
	"fmt"
	"io"
	"net"
	"os"
	"os/exec"
	"path/filepath"
	"regexp"
	"runtime"
	"slices"
	"strconv"
	"strings"
	"sync/atomic"
	"syscall"
	"time"

	bsm "github.com/bsm/redislock"
	"github.com/dlock-dev/dlock"
	"github.com/dlock-dev/dlock/etcdlock"
	"github.com/dlock-dev/dlock/internal/testproc"
	"github.com/dlock-dev/dlock/locktest"
	"github.com/dlock-dev/dlock/mysqllock"
	"github.com/dlock-dev/dlock/pglock"
	"github.com/dlock-dev/dlock/redislock"
	"github.com/dlock-dev/dlock/sqlitelock"
	"github.com/dlock-dev/dlock/zklock"
	"github.com/go-redsync/redsync/v4"
	"github.com/go-redsync/redsync/v4/redis/goredis/v9"
	"github.com/go-sql-driver/mysql"
	"github.com/go-zookeeper/zk"
	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgxpool"
	"github.com/redis/go-redis/v9"
	clientv3 "go.etcd.io/etcd/client/v3"
	"go.uber.org/zap"
)

type config struct {
	mysqlDSN, redisAddr string
	pgDSN, etcdAddr     string
	zkAddr              string
	duration            time.Duration
	iterations          int
	manyLocks           int
	jsonOut             string
	table               string
	// only, when set, keeps the rows whose name it matches: the others
	// are not run.
	only *regexp.Regexp
}

// Sections of the report, which the rows carry.
const (
	secFloor       = "floor"
	secBackend     = "backend alone (no Locker)"
	secUncontended = "uncontended acquire+release"
	secContended   = "8 contenders, one key"
	secMany        = "many locks held at once"
)

// Names of dlock's strategies, as the rows and the targets name them.
const (
	mysqlLease       = "dlock mysql lease (doorbells)"
	mysqlLeaseNoBell = "dlock mysql lease (NoDoorbell)"
	mysqlGetLock     = "dlock mysql getlock"
	mysqlRowLock     = "dlock mysql rowlock"
	sqliteLease      = "dlock sqlite lease"
	redisStrategy    = "dlock redis"
	pgLease          = "dlock pg lease"
	pgAdvisory       = "dlock pg advisory"
	etcdStrategy     = "dlock etcd"
	zkStrategy       = "dlock zk"
)

// allStrategies lists every strategy the bench knows, whether or not a run
// measures it, so that the targets can name those it left out.
var allStrategies = []string{mysqlLease, mysqlLeaseNoBell, mysqlGetLock, mysqlRowLock, sqliteLease,
	redisStrategy, pgLease, pgAdvisory, etcdStrategy, zkStrategy}

// Row is one measurement.
type Row struct {
	Section  string  `json:"section"`
	Name     string  `json:"name"`
	P50us    float64 `json:"p50_us,omitempty"`
	P99us    float64 `json:"p99_us,omitempty"`
	OpsPerS  float64 `json:"ops_per_s,omitempty"`
	Handoffs float64 `json:"handoffs_per_s,omitempty"`
	// Contended rows: each worker's acquisitions, and the smallest and
	// largest of them relative to a fair share (1 = fair).
	Shares   []int    `json:"shares,omitempty"`
	MinShare *float64 `json:"min_share,omitempty"`
	MaxShare *float64 `json:"max_share,omitempty"`
	Many     *Many    `json:"many,omitempty"`  // many-locks rows
	Floor    string   `json:"floor,omitempty"` // the row this one is compared with
	Ratio    float64  `json:"ratio,omitempty"` // p50 / floor's p50, or handoffs / floor's
	Note     string   `json:"note,omitempty"`
}

// Many is what the many-locks run measured for one strategy. A renewal
// period is a third of the TTL, the Locker's renewal interval.
type Many struct {
	Locks       int     `json:"locks"`
	HeapPerLock float64 `json:"heap_bytes_per_lock"`
	Goroutines  int     `json:"goroutines_added"`
	Lost        int     `json:"lost"`
	// Conns is the client's open connections, when its pool can tell.
	Conns *int `json:"connections,omitempty"`
	// PerPeriod is what the client sent per renewal period, in Unit
	// ("statements" or "commands"), when it is counted.
	PerPeriod *float64 `json:"per_renewal_period,omitempty"`
	Unit      string   `json:"unit,omitempty"`
	// TripsPerPeriod is the client's round trips per renewal period, when
	// they differ from PerPeriod (Redis pipelines).
	TripsPerPeriod *float64 `json:"round_trips_per_renewal_period,omitempty"`
	// ServerEvalsPerPeriod is the EVALSHA and EVAL calls Redis itself
	// counted per renewal period (INFO commandstats), a check on PerPeriod.
	ServerEvalsPerPeriod *float64 `json:"server_evals_per_renewal_period,omitempty"`
}

func main() {
	var c config
	flag.StringVar(&c.mysqlDSN, "mysql", "root@tcp(127.0.0.1:3306)/test?interpolateParams=true", "MySQL/MariaDB DSN")
	flag.StringVar(&c.redisAddr, "redis", "", "Redis address (default: start a redis-server)")
	flag.StringVar(&c.pgDSN, "pg", "postgres://postgres@127.0.0.1:5432/test", `PostgreSQL DSN, or "off"`)
	flag.StringVar(&c.etcdAddr, "etcd", "", `etcd client address (default: start an etcd), or "off"`)
	flag.StringVar(&c.zkAddr, "zk", "", `ZooKeeper address (default: start a ZooKeeper), or "off"`)
	flag.DurationVar(&c.duration, "duration", 3*time.Second, "length of each contended run")
	flag.IntVar(&c.iterations, "n", 2000, "iterations of each uncontended measurement")
	flag.IntVar(&c.manyLocks, "many", 10000, "locks held at once in the many-locks run")
	flag.StringVar(&c.jsonOut, "json", "", `also write {"rows": […], "targets": […]} as JSON to this file`)
	flag.StringVar(&c.table, "table", "dlock_bench_locks", "lock table (the others are named after it); Migrate runs on it")
	only := flag.String("only", "", "run only the rows whose name matches this regular expression (default: all)")
	flag.Parse()
	if *only != "" {
		re, err := regexp.Compile(*only)
		if err != nil {
			fmt.Fprintln(os.Stderr, "dlock-bench: -only:", err)
			os.Exit(2)
		}
		c.only = re
	}
	if err := run(c, os.Stdout); err != nil {
		fmt.Fprintln(os.Stderr, "dlock-bench:", err)
		os.Exit(1)
	}
}

func run(c config, out io.Writer) error {
	ctx := context.Background()
	db, err := sql.Open("mysql", c.mysqlDSN)
	if err != nil {
		return err
	}
	defer db.Close()
	if err := db.PingContext(ctx); err != nil {
		return fmt.Errorf("MySQL at %s: %w", c.mysqlDSN, err)
	}
	if c.redisAddr == "" {
		addr, stop, err := startRedis()
		if err != nil {
			return err
		}
		defer stop()
		c.redisAddr = addr
	}
	rdb := redis.NewClient(&redis.Options{Addr: c.redisAddr})
	defer rdb.Close()
	dir, err := os.MkdirTemp("", "dlock-bench")
	if err != nil {
		return err
	}
	defer os.RemoveAll(dir)

	b := &bench{c: c, db: db, rdb: rdb, sqlitePath: filepath.Join(dir, "locks.db")}
	if c.pgDSN == "off" {
		b.rows = append(b.rows, Row{Section: secFloor, Name: "PostgreSQL", Note: "left out: -pg off"})
	} else {
		if err := b.openPG(ctx); err != nil {
			b.rows = append(b.rows, Row{Section: secFloor, Name: "PostgreSQL", Note: "left out: " + err.Error()})
		} else {
			defer b.pg.Close()
		}
	}
	if c.etcdAddr == "off" {
		b.rows = append(b.rows, Row{Section: secFloor, Name: "etcd", Note: "left out: -etcd off"})
	} else {
		if c.etcdAddr == "" {
			addr, stop, err := startEtcd(dir)
			if err != nil {
				b.rows = append(b.rows, Row{Section: secFloor, Name: "etcd", Note: "left out: " + err.Error()})
			} else {
				defer stop()
				b.c.etcdAddr = addr
			}
		}
		if b.c.etcdAddr != "" && b.c.etcdAddr != "off" {
			if err := b.openEtcd(ctx); err != nil {
				b.rows = append(b.rows, Row{Section: secFloor, Name: "etcd", Note: "left out: " + err.Error()})
			} else {
				defer b.etcd.Close()
			}
		}
	}
	if c.zkAddr == "off" {
		b.rows = append(b.rows, Row{Section: secFloor, Name: "ZooKeeper", Note: "left out: -zk off"})
	} else {
		if c.zkAddr == "" {
			addr, stop, err := startZooKeeper(dir)
			if err != nil {
				b.rows = append(b.rows, Row{Section: secFloor, Name: "ZooKeeper", Note: "left out: " + err.Error()})
			} else {
				defer stop()
				b.c.zkAddr = addr
			}
		}
		if b.c.zkAddr != "" && b.c.zkAddr != "off" {
			if err := b.openZK(); err != nil {
				b.rows = append(b.rows, Row{Section: secFloor, Name: "ZooKeeper", Note: "left out: " + err.Error()})
			} else {
				defer b.zk.Close()
			}
		}
	}
	if err := b.setup(ctx); err != nil {
		return err
	}
	defer b.closeAll()
	b.floors(ctx)
	b.redisScripts(ctx)
	b.uncontended(ctx)
	b.contended(ctx)
	b.many(ctx)
	b.report(out)
	targets := evaluateTargets(b.rows)
	reportTargets(out, targets)
	if c.jsonOut != "" {
		data, _ := json.MarshalIndent(struct {
			Rows    []Row    `json:"rows"`
			Targets []Target `json:"targets"`
		}{b.rows, targets}, "", "  ")
		return os.WriteFile(c.jsonOut, data, 0o644)
	}
	return nil
}

type bench struct {
	c          config
	db         *sql.DB
	rdb        *redis.Client
	sqlitePath string
	pg         *pgxpool.Pool    // nil when PostgreSQL is left out
	etcd       *clientv3.Client // nil when etcd is left out
	zk         *zk.Conn         // nil when ZooKeeper is left out
	rows       []Row
	closers    []func()
	// lastProbe observes the client most recently made by a strategy's
	// constructor, for the many-locks run; nil when it cannot be observed.
	lastProbe *probe
}

// probe is what the many-locks run can observe of a strategy's client.
type probe struct {
	conns func() int    // open connections; nil when not counted
	sent  *atomic.Int64 // statements or commands sent
	unit  string        // what sent counts
	trips *atomic.Int64 // round trips, when they differ from sent; or nil
	redis bool          // the client talks to the bench's Redis server
}

// want reports whether the run measures the row name (see -only).
func (b *bench) want(name string) bool { return b.c.only == nil || b.c.only.MatchString(name) }

func (b *bench) setup(ctx context.Context) error {
	lease, err := mysqllock.New(b.db, &mysqllock.Options{Table: b.c.table})
	if err != nil {
		return err
	}
	defer lease.Close()
	if err := lease.Migrate(ctx); err != nil {
		return err
	}
	s, err := sqlitelock.Open(b.sqlitePath)
	if err != nil {
		return err
	}
	defer s.Close()
	if err := s.Migrate(ctx); err != nil {
		return err
	}
	if b.pg != nil {
		pl, err := pglock.New(b.pg, &pglock.Options{Table: b.c.table})
		if err != nil {
			return err
		}
		defer pl.Close()
		if err := pl.Migrate(ctx); err != nil {
			return fmt.Errorf("PostgreSQL: %w", err)
		}
	}
	return nil
}

func (b *bench) closeAll() {
	for _, f := range slices.Backward(b.closers) {
		f()
	}
}

// strategy is one of dlock's backends: its name, the floor row it is
// compared with, and a constructor.
type strategy struct {
	name  string
	floor string
	make  func() dlock.Backend
}

// strategies are the backends that -only selects (all by default).
func (b *bench) strategies() []strategy {
	return slices.DeleteFunc(b.everyStrategy(), func(st strategy) bool { return !b.want(st.name) })
}

// everyStrategy is strategies without -only.
func (b *bench) everyStrategy() []strategy {
	mysqlPool := func() *sql.DB {
		cfg, err := mysql.ParseDSN(b.c.mysqlDSN)
		if err != nil {
			panic(err) // the DSN was opened once already
		}
		conn, err := mysql.NewConnector(cfg)
		if err != nil {
			panic(err)
		}
		n := new(atomic.Int64)
		db := sql.OpenDB(countingConnector{conn, n})
		b.lastProbe = &probe{conns: func() int { return db.Stats().OpenConnections }, sent: n, unit: "statements"}
		b.closers = append(b.closers, func() { db.Close() })
		return db
	}
	closing := func(be interface {
		dlock.Backend
		Close() error
	}, err error) dlock.Backend {
		if err != nil {
			panic(err) // options are constants
		}
		b.closers = append(b.closers, func() { be.Close() })
		return be
	}
	out := []strategy{
		{mysqlLease, "raw lease + doorbell: upsert, GET_LOCK, release, RELEASE_LOCK", func() dlock.Backend {
			return closing(mysqllock.New(mysqlPool(), &mysqllock.Options{Table: b.c.table}))
		}},
		{mysqlLeaseNoBell, "raw lease upsert + release", func() dlock.Backend {
			return closing(mysqllock.New(mysqlPool(), &mysqllock.Options{Table: b.c.table, NoDoorbell: true}))
		}},
		{mysqlGetLock, "raw GET_LOCK + fence upsert + RELEASE_LOCK", func() dlock.Backend {
			return closing(mysqllock.NewGetLock(mysqlPool(), &mysqllock.Options{Table: b.c.table}))
		}},
		{mysqlRowLock, "raw BEGIN + FOR UPDATE NOWAIT + fence upsert + COMMIT", func() dlock.Backend {
			return closing(mysqllock.NewRowLock(mysqlPool(), &mysqllock.Options{Table: b.c.table}))
		}},
		{sqliteLease, "", func() dlock.Backend {
			return closing(sqlitelock.Open(b.sqlitePath))
		}},
		{redisStrategy, redisScriptsFloor, func() dlock.Backend {
			rdb := redis.NewClient(&redis.Options{Addr: b.c.redisAddr})
			cmds, trips := new(atomic.Int64), new(atomic.Int64)
			rdb.AddHook(redisCounter{cmds, trips})
			b.lastProbe = &probe{conns: func() int { return int(rdb.PoolStats().TotalConns) }, sent: cmds,
				unit: "commands", trips: trips, redis: true}
			b.closers = append(b.closers, func() { rdb.Close() })
			be, err := redislock.New(rdb, nil)
			if err != nil {
				panic(err)
			}
			return be
		}},
	}
	if b.pg != nil {
		pgPool := func() *pgxpool.Pool {
			cfg, err := pgxpool.ParseConfig(b.c.pgDSN)
			if err != nil {
				panic(err) // the DSN was opened once already
			}
			n := new(atomic.Int64)
			cfg.ConnConfig.Tracer = pgCounter{n}
			p, err := pgxpool.NewWithConfig(context.Background(), cfg)
			if err != nil {
				panic(err)
			}
			b.lastProbe = &probe{conns: func() int { return int(p.Stat().TotalConns()) }, sent: n, unit: "statements"}
			b.closers = append(b.closers, p.Close)
			return p
		}
		out = append(out, strategy{pgLease, pgLeaseFloor, func() dlock.Backend {
			return closing(pglock.New(pgPool(), &pglock.Options{Table: b.c.table}))
		}}, strategy{pgAdvisory, pgAdvisoryFloor, func() dlock.Backend {
			return closing(pglock.NewAdvisory(pgPool(), &pglock.Options{Table: b.c.table}))
		}})
	}
	if b.etcd != nil {
		out = append(out, strategy{etcdStrategy, etcdFloor, func() dlock.Backend {
			c, err := b.newEtcdClient()
			if err != nil {
				panic(err) // the address was dialled once already
			}
			b.closers = append(b.closers, func() { c.Close() })
			be, err := etcdlock.New(c, nil)
			if err != nil {
				panic(err)
			}
			b.closers = append(b.closers, func() { be.Close() }) // runs before the client's
			return be
		}})
	}
	if b.zk != nil {
		out = append(out, strategy{zkStrategy, zkFloor, func() dlock.Backend {
			c, err := b.newZKConn()
			if err != nil {
				panic(err) // the address was dialled once already
			}
			b.closers = append(b.closers, c.Close)
			be, err := zklock.New(c, &zklock.Options{SessionTimeout: zkSession, Root: "/dlock-bench"})
			if err != nil {
				panic(err)
			}
			return be
		}})
	}
	return out
}

// zkSession is the bench's ZooKeeper session timeout: at least the 30 s
// default TTL, as zklock requires.
const zkSession = 40 * time.Second

// etcdFloor is one etcd write: a lower bound of etcdlock's acquire + release
// (a lease grant, a transaction and a revoke), not its own commands.
const etcdFloor = "etcd one put"

// zkFloor is the raw recipe's uncontended acquire + release: one ephemeral
// sequential create and one delete.
const zkFloor = "ZooKeeper create ephemeral sequential + delete"

// newZKConn connects to the ZooKeeper at c.zkAddr, silent, and waits
// (bounded) for its session.
func (b *bench) newZKConn() (*zk.Conn, error) {
	c, events, err := zk.Connect([]string{b.c.zkAddr}, zkSession, zk.WithLogger(zkQuiet{}))
	if err != nil {
		return nil, err
	}
	timeout := time.After(10 * time.Second)
	for {
		select {
		case ev := <-events:
			if ev.State == zk.StateHasSession {
				return c, nil
			}
		case <-timeout:
			c.Close()
			return nil, fmt.Errorf("ZooKeeper at %s: no session within 10 s", b.c.zkAddr)
		}
	}
}

type zkQuiet struct{}

func (zkQuiet) Printf(string, ...any) {}

// openZK connects to ZooKeeper at c.zkAddr.
func (b *bench) openZK() error {
	c, err := b.newZKConn()
	if err != nil {
		return err
	}
	if _, err := c.Create("/dlock-bench-floor", nil, 0, zk.WorldACL(zk.PermAll)); err != nil && !errors.Is(err, zk.ErrNodeExists) {
		c.Close()
		return fmt.Errorf("ZooKeeper at %s: %w", b.c.zkAddr, err)
	}
	b.zk = c
	return nil
}

// openPG connects to PostgreSQL at c.pgDSN.
func (b *bench) openPG(ctx context.Context) error {
	p, err := pgxpool.New(ctx, b.c.pgDSN)
	if err != nil {
		return err
	}
	pctx, cancel := context.WithTimeout(ctx, 5*time.Second)
	defer cancel()
	if err := p.Ping(pctx); err != nil {
		p.Close()
		return fmt.Errorf("PostgreSQL at %s: %w", b.c.pgDSN, err)
	}
	b.pg = p
	return nil
}

// newEtcdClient returns a client of the etcd at c.etcdAddr, silent.
func (b *bench) newEtcdClient() (*clientv3.Client, error) {
	return clientv3.New(clientv3.Config{Endpoints: []string{b.c.etcdAddr}, DialTimeout: 5 * time.Second, Logger: zap.NewNop()})
}

// openEtcd connects to etcd at c.etcdAddr.
func (b *bench) openEtcd(ctx context.Context) error {
	c, err := b.newEtcdClient()
	if err != nil {
		return err
	}
	sctx, cancel := context.WithTimeout(ctx, 5*time.Second)
	defer cancel()
	if _, err := c.Status(sctx, b.c.etcdAddr); err != nil {
		c.Close()
		return fmt.Errorf("etcd at %s: %w", b.c.etcdAddr, err)
	}
	b.etcd = c
	return nil
}

// latency runs op n times and records p50, p99 and ops/s.
func (b *bench) latency(section, name, floor string, n int, op func(i int) error) {
	if !b.want(name) {
		return
	}
	d := make([]time.Duration, 0, n)
	start := time.Now()
	for i := range n {
		t := time.Now()
		if err := op(i); err != nil {
			b.rows = append(b.rows, Row{Section: section, Name: name, Note: "error: " + err.Error()})
			return
		}
		d = append(d, time.Since(t))
	}
	total := time.Since(start)
	slices.Sort(d)
	b.rows = append(b.rows, Row{Section: section, Name: name, Floor: floor,
		P50us: us(d[len(d)/2]), P99us: us(d[len(d)*99/100]), OpsPerS: float64(n) / total.Seconds()})
}

func us(d time.Duration) float64 { return float64(d.Nanoseconds()) / 1e3 }

func (b *bench) floors(ctx context.Context) {
	const s = secFloor
	n := b.c.iterations
	b.latency(s, "MySQL SELECT 1", "", n, func(int) error {
		_, err := b.db.ExecContext(ctx, "SELECT 1")
		return err
	})
	// The row is created once; each UPDATE then changes it, so that every
	// statement commits a write.
	if _, err := b.db.ExecContext(ctx, `INSERT IGNORE INTO `+b.c.table+` (name, token, fence, acquired_at, expires_at)
VALUES ('bench-floor', ?, 0, UTC_TIMESTAMP(6), UTC_TIMESTAMP(6))`, make([]byte, 16)); err != nil {
		b.rows = append(b.rows, Row{Section: s, Name: "MySQL autocommit PK UPDATE", Note: "error: " + err.Error()})
	} else {
		b.latency(s, "MySQL autocommit PK UPDATE", "", n, func(int) error {
			r, err := b.db.ExecContext(ctx, "UPDATE "+b.c.table+" SET fence = fence + 1 WHERE name = 'bench-floor'")
			if err != nil {
				return err
			}
			if n, err := r.RowsAffected(); err != nil || n != 1 {
				return fmt.Errorf("UPDATE changed %d rows (%v), want 1", n, err)
			}
			return nil
		})
	}
	if b.pg != nil {
		b.latency(s, "PostgreSQL SELECT 1", "", n, func(int) error {
			_, err := b.pg.Exec(ctx, "SELECT 1")
			return err
		})
		b.pgFloors(ctx, n)
	}
	if b.etcd != nil {
		b.latency(s, etcdFloor, "", n, func(int) error {
			_, err := b.etcd.Put(ctx, "bench-floor", "x")
			return err
		})
	}
	if b.zk != nil {
		b.latency(s, zkFloor, "", n, func(int) error {
			p, err := b.zk.Create("/dlock-bench-floor/n-", nil, zk.FlagEphemeral|zk.FlagSequence, zk.WorldACL(zk.PermAll))
			if err != nil {
				return err
			}
			return b.zk.Delete(p, -1)
		})
	}
	tok := dlock.NewToken()
	b.latency(s, "raw lease upsert + release", "", n, func(int) error {
		if _, err := b.db.ExecContext(ctx, `INSERT INTO `+b.c.table+` (name, token, fence, acquired_at, expires_at)
VALUES ('bench-raw', ?, 1, UTC_TIMESTAMP(6), UTC_TIMESTAMP(6) + INTERVAL 30 SECOND)
ON DUPLICATE KEY UPDATE token = VALUES(token), fence = fence + 1, expires_at = VALUES(expires_at)`, tok[:]); err != nil {
			return err
		}
		_, err := b.db.ExecContext(ctx, `UPDATE `+b.c.table+` SET expires_at = UTC_TIMESTAMP(6) WHERE name = 'bench-raw' AND token = ?`, tok[:])
		return err
	})
	// Each strategy's floor is the SQL it issues for an uncontended
	// acquire+release, without dlock around it.
	conn, err := b.db.Conn(ctx)
	if err != nil {
		b.rows = append(b.rows, Row{Section: s, Name: "pinned connection", Note: "error: " + err.Error()})
	} else {
		defer conn.Close()
		upsertFence := `INSERT INTO ` + b.c.table + `_session (name, token, owner, fence, conn_id, lock_name, acquired_at, metadata)
VALUES ('bench-raw', ?, '', 1, CONNECTION_ID(), 'bench-raw', UTC_TIMESTAMP(6), '')
ON DUPLICATE KEY UPDATE token = VALUES(token), fence = fence + 1, conn_id = VALUES(conn_id), acquired_at = VALUES(acquired_at)`
		b.latency(s, "raw lease + doorbell: upsert, GET_LOCK, release, RELEASE_LOCK", "", n, func(int) error {
			if _, err := b.db.ExecContext(ctx, `INSERT INTO `+b.c.table+` (name, token, fence, acquired_at, expires_at)
VALUES ('bench-raw', ?, 1, UTC_TIMESTAMP(6), UTC_TIMESTAMP(6) + INTERVAL 30 SECOND)
ON DUPLICATE KEY UPDATE token = VALUES(token), fence = fence + 1, expires_at = VALUES(expires_at)`, tok[:]); err != nil {
				return err
			}
			if _, err := conn.ExecContext(ctx, "DO GET_LOCK('bench-raw-bell', 0)"); err != nil {
				return err
			}
			if _, err := b.db.ExecContext(ctx, `UPDATE `+b.c.table+` SET expires_at = UTC_TIMESTAMP(6) WHERE name = 'bench-raw' AND token = ?`, tok[:]); err != nil {
				return err
			}
			_, err := conn.ExecContext(ctx, "DO RELEASE_LOCK('bench-raw-bell')")
			return err
		})
		b.latency(s, "raw GET_LOCK + RELEASE_LOCK (no fencing)", "", n, func(int) error {
			if _, err := conn.ExecContext(ctx, "DO GET_LOCK('bench-raw', 0)"); err != nil {
				return err
			}
			_, err := conn.ExecContext(ctx, "DO RELEASE_LOCK('bench-raw')")
			return err
		})
		b.latency(s, "raw GET_LOCK + fence upsert + RELEASE_LOCK", "", n, func(int) error {
			if _, err := conn.ExecContext(ctx, "DO GET_LOCK('bench-raw', 0)"); err != nil {
				return err
			}
			if _, err := conn.ExecContext(ctx, upsertFence, tok[:]); err != nil {
				return err
			}
			_, err := conn.ExecContext(ctx, "DO RELEASE_LOCK('bench-raw')")
			return err
		})
		_, _ = conn.ExecContext(ctx, "INSERT IGNORE INTO "+b.c.table+"_rows (name) VALUES ('bench-raw')")
		b.latency(s, "raw BEGIN + FOR UPDATE NOWAIT + fence upsert + COMMIT", "", n, func(int) error {
			tx, err := conn.BeginTx(ctx, nil)
			if err != nil {
				return err
			}
			if _, err := tx.ExecContext(ctx, "SELECT name FROM "+b.c.table+"_rows WHERE name = 'bench-raw' FOR UPDATE NOWAIT"); err != nil {
				tx.Rollback()
				return err
			}
			if _, err := b.db.ExecContext(ctx, upsertFence, tok[:]); err != nil {
				tx.Rollback()
				return err
			}
			if _, err := tx.ExecContext(ctx, "UPDATE "+b.c.table+"_session SET conn_id = 0 WHERE name = 'bench-raw' AND token = ?", tok[:]); err != nil {
				tx.Rollback()
				return err
			}
			return tx.Commit()
		})
	}
	b.latency(s, "Redis PING", "", n, func(int) error { return b.rdb.Ping(ctx).Err() })
	release := redis.NewScript(`if redis.call('get', KEYS[1]) == ARGV[1] then return redis.call('del', KEYS[1]) end return 0`)
	b.latency(s, "raw SET NX PX + Lua release", "", n, func(int) error {
		if err := b.rdb.SetNX(ctx, "bench-raw", "tok", 30*time.Second).Err(); err != nil {
			return err
		}
		return release.Run(ctx, b.rdb, []string{"bench-raw"}, "tok").Err()
	})
}

// PostgreSQL strategies' own statements for an uncontended acquire and
// release, without dlock (the floors of pglock's BenchmarkRawSQL).
const (
	pgLeaseFloor    = "raw pg lease upsert + release"
	pgAdvisoryFloor = "raw pg_try_advisory_lock + fence upsert + pg_advisory_unlock"
)

// pgFloors measures pgLeaseFloor on the pool and pgAdvisoryFloor on one
// connection of it, on the tables setup migrated.
func (b *bench) pgFloors(ctx context.Context, n int) {
	table := `"` + b.c.table + `"`
	tok := dlock.NewToken()
	b.latency(secFloor, pgLeaseFloor, "", n, func(int) error {
		if _, err := b.pg.Exec(ctx, `INSERT INTO `+table+` (name, token, fence, acquired_at, expires_at)
VALUES ('bench-raw', $1, 1, clock_timestamp(), clock_timestamp() + interval '30 seconds')
ON CONFLICT (name) DO UPDATE SET token = EXCLUDED.token, fence = `+table+`.fence + 1, expires_at = EXCLUDED.expires_at`, tok[:]); err != nil {
			return err
		}
		_, err := b.pg.Exec(ctx, `UPDATE `+table+` SET expires_at = clock_timestamp() WHERE name = 'bench-raw' AND token = $1`, tok[:])
		return err
	})
	c, err := b.pg.Acquire(ctx)
	if err != nil {
		b.rows = append(b.rows, Row{Section: secFloor, Name: pgAdvisoryFloor, Note: "error: " + err.Error()})
		return
	}
	defer c.Release()
	session := `"` + b.c.table + `_session"`
	k1, k2 := pglock.AdvisoryKeys("bench-raw")
	b.latency(secFloor, pgAdvisoryFloor, "", n, func(int) error {
		var ok bool
		if err := c.QueryRow(ctx, "SELECT pg_try_advisory_lock($1, $2)", k1, k2).Scan(&ok); err != nil || !ok {
			return fmt.Errorf("pg_try_advisory_lock: %v, %v", ok, err)
		}
		if _, err := c.Exec(ctx, `INSERT INTO `+session+` (name, lock_id, token, fence, pid, acquired_at)
VALUES ('bench-raw', 0, $1, 1, pg_backend_pid(), clock_timestamp())
ON CONFLICT (name) DO UPDATE SET fence = `+session+`.fence + 1, token = EXCLUDED.token`, tok[:]); err != nil {
			return err
		}
		if err := c.QueryRow(ctx, "SELECT pg_advisory_unlock($1, $2)", k1, k2).Scan(&ok); err != nil || !ok {
			return fmt.Errorf("pg_advisory_unlock: %v, %v", ok, err)
		}
		return nil
	})
}

// redisScriptsFloor is the Redis backend's own commands without the Locker:
// its acquisition and release scripts (fencing counter, pub/sub wake-up).
const redisScriptsFloor = "raw dlock Redis scripts (acquire.lua + release.lua)"

func (b *bench) redisScripts(ctx context.Context) {
	be, err := redislock.New(b.rdb, nil)
	if err != nil {
		b.rows = append(b.rows, Row{Section: secFloor, Name: redisScriptsFloor, Note: "error: " + err.Error()})
		return
	}
	b.latency(secFloor, redisScriptsFloor, "", b.c.iterations, func(int) error {
		tok := dlock.NewToken()
		r, err := be.Acquire(ctx, dlock.Request{Key: "bench-raw-scripts", Token: tok, TTL: 30 * time.Second})
		if err != nil {
			return err
		}
		if !r.Acquired {
			return errors.New("not acquired")
		}
		return be.Release(ctx, "bench-raw-scripts", tok)
	})
}

func (b *bench) uncontended(ctx context.Context) {
	const s = secUncontended
	n := b.c.iterations
	// Each backend alone, without the Locker: the Locker's own cost is the
	// difference.
	for _, st := range b.strategies() {
		be := st.make()
		key := "bench/backend/" + st.name
		b.latency(secBackend, st.name+" backend", "", n, func(int) error {
			tok := dlock.NewToken()
			r, err := be.Acquire(ctx, dlock.Request{Key: key, Token: tok, TTL: dlock.DefaultTTL})
			if err != nil {
				return err
			}
			if !r.Acquired {
				return errors.New("not acquired")
			}
			return be.Release(ctx, key, tok)
		})
	}
	for _, st := range b.strategies() {
		l := dlock.New(st.make(), nil)
		key := "bench/uncontended/" + st.name
		b.latency(s, st.name, st.floor, n, func(int) error {
			lk, err := l.TryAcquire(ctx, key)
			if err != nil {
				return err
			}
			return lk.Release(ctx)
		})
		l.Close(ctx)
	}
	if b.c.only != nil {
		return
	}
	bl := bsm.New(b.rdb)
	b.latency(s, "bsm/redislock", "raw SET NX PX + Lua release", n, func(int) error {
		lk, err := bl.Obtain(ctx, "bench-bsm", 30*time.Second, nil)
		if err != nil {
			return err
		}
		return lk.Release(ctx)
	})
	rs := redsync.New(goredis.NewPool(b.rdb))
	m := rs.NewMutex("bench-redsync", redsync.WithExpiry(30*time.Second), redsync.WithTries(1))
	b.latency(s, "go-redsync/redsync", "raw SET NX PX + Lua release", n, func(int) error {
		if err := m.LockContext(ctx); err != nil {
			return err
		}
		_, err := m.UnlockContext(ctx)
		return err
	})
}

const workers = 8

func (b *bench) contended(ctx context.Context) {
	const s = secContended
	for _, st := range b.strategies() {
		lockers := make([]*dlock.Locker, workers)
		for i := range lockers {
			lockers[i] = dlock.New(st.make(), nil)
		}
		stats, err := locktest.Contend(ctx, lockers, "bench/contended/"+st.name, locktest.Contention{Duration: b.c.duration})
		floor := naive
		switch {
		case st.name == mysqlGetLock:
			floor = rawGetLock
		case st.name == pgAdvisory:
			floor = rawPGAdvisory
		case st.name == pgLease:
			floor = naivePG
		case st.name == mysqlRowLock:
			floor = rawForUpdate
		case strings.Contains(st.name, "redis"):
			floor = bsmRetry
		}
		b.addContended(s, st.name, floor, stats, err)
		for _, l := range lockers {
			l.Close(ctx)
		}
	}
	if b.pg != nil && (b.want(rawPGAdvisory) || b.want(naivePG)) {
		b.contendedPG(ctx)
	}
	if b.want(naive) {
		lockers := make([]*dlock.Locker, workers)
		for i := range lockers {
			lockers[i] = dlock.New(b.everyStrategy()[1].make(), nil)
		}
		stats, err := locktest.Contend(ctx, lockers, "bench/contended/naive", locktest.Contention{Duration: b.c.duration, Poll: 100 * time.Millisecond})
		b.addContended(s, naive, "", stats, err)
		for _, l := range lockers {
			l.Close(ctx)
		}
	}
	if b.want(bsmRetry) {
		stats, err := b.peerContend(ctx, func(i int) (func() error, error) {
			lk, err := bsm.New(b.rdb).Obtain(ctx, "bench-bsm-contended", 30*time.Second,
				&bsm.Options{RetryStrategy: bsm.LinearBackoff(10 * time.Millisecond)})
			if err != nil {
				return nil, err
			}
			return func() error { return lk.Release(ctx) }, nil
		})
		b.addContended(s, bsmRetry, "", stats, err)
	}
	if redsyncRow := redsyncDefaults; b.want(redsyncRow) {
		rs := redsync.New(goredis.NewPool(b.rdb))
		stats, err := b.peerContend(ctx, func(i int) (func() error, error) {
			m := rs.NewMutex("bench-redsync-contended")
			if err := m.LockContext(ctx); err != nil {
				return nil, err
			}
			return func() error { _, err := m.UnlockContext(ctx); return err }, nil
		})
		b.addContended(s, redsyncRow, bsmRetry, stats, err)
	}
	b.rawContended(ctx)
}

// rawContended measures the session strategies' floors: the server's own
// blocking waits, each worker on a connection of its own.
func (b *bench) rawContended(ctx context.Context) {
	const s = secContended
	if !b.want(rawGetLock) && !b.want(rawGetLockFenced) && !b.want(rawForUpdate) {
		return
	}
	// The floor of the session strategies: raw GET_LOCK blocking in the
	// server, each worker on a connection of its own.
	conns := make([]*sql.Conn, workers)
	for i := range conns {
		c, err := b.db.Conn(ctx)
		if err != nil {
			b.rows = append(b.rows, Row{Section: s, Name: rawGetLock, Note: "error: " + err.Error()})
			return
		}
		defer c.Close()
		conns[i] = c
	}
	if b.want(rawGetLock) {
		stats, err := b.peerContend(ctx, func(i int) (func() error, error) {
			if err := getLock(ctx, conns[i], "bench-raw-contended"); err != nil {
				return nil, err
			}
			return releaseLock(ctx, conns[i], "bench-raw-contended"), nil
		})
		b.addContended(s, rawGetLock, "", stats, err)
	}
	if b.want(rawForUpdate) {
		stats, err := b.forUpdateContend(ctx, conns)
		b.addContended(s, rawForUpdate, "", stats, err)
	}
	if !b.want(rawGetLockFenced) {
		return
	}
	// The same with the fencing write of a grant, in the session table.
	tok := dlock.NewToken()
	stats, err := b.peerContend(ctx, func(i int) (func() error, error) {
		if err := getLock(ctx, conns[i], "bench-raw-contended-f"); err != nil {
			return nil, err
		}
		if _, err := conns[i].ExecContext(ctx, `INSERT INTO `+b.c.table+`_session (name, token, owner, fence, conn_id, lock_name, acquired_at, metadata)
VALUES ('bench-raw-contended-f', ?, '', 1, CONNECTION_ID(), 'bench-raw-contended-f', UTC_TIMESTAMP(6), '')
ON DUPLICATE KEY UPDATE token = VALUES(token), fence = fence + 1, conn_id = VALUES(conn_id), acquired_at = VALUES(acquired_at)`, tok[:]); err != nil {
			return nil, err
		}
		return releaseLock(ctx, conns[i], "bench-raw-contended-f"), nil
	})
	b.addContended(s, rawGetLockFenced, "", stats, err)
}

// contendedPG adds the PostgreSQL floors: raw pg_advisory_lock blocking in
// the server, each worker on a connection of its own, and the polling
// recipe on pglock's lease row.
func (b *bench) contendedPG(ctx context.Context) {
	const s = secContended
	conns := make([]*pgx.Conn, workers)
	for i := range conns {
		c, err := pgx.Connect(ctx, b.c.pgDSN)
		if err != nil {
			b.rows = append(b.rows, Row{Section: s, Name: rawPGAdvisory, Note: "error: " + err.Error()})
			return
		}
		defer c.Close(ctx)
		conns[i] = c
	}
	// The two-int form on the key's halves, as pglock's advisory strategy
	// locks it.
	k1, k2 := pglock.AdvisoryKeys("bench-raw-contended")
	stats, err := b.peerContend(ctx, func(i int) (func() error, error) {
		if _, err := conns[i].Exec(ctx, "SELECT pg_advisory_lock($1::int4, $2::int4)", k1, k2); err != nil {
			return nil, err
		}
		return func() error {
			var ok bool
			if err := conns[i].QueryRow(ctx, "SELECT pg_advisory_unlock($1::int4, $2::int4)", k1, k2).Scan(&ok); err != nil || !ok {
				return fmt.Errorf("pg_advisory_unlock: %v, %v", ok, err)
			}
			return nil
		}, nil
	})
	b.addContended(s, rawPGAdvisory, "", stats, err)
	// Each worker a process of its own (its own pool), as for MySQL's.
	i := slices.IndexFunc(b.everyStrategy(), func(st strategy) bool { return st.name == pgLease })
	lockers := make([]*dlock.Locker, workers)
	for w := range lockers {
		lockers[w] = dlock.New(b.everyStrategy()[i].make(), nil)
	}
	stats, err = locktest.Contend(ctx, lockers, "bench/contended/naive-pg", locktest.Contention{Duration: b.c.duration, Poll: 100 * time.Millisecond})
	b.addContended(s, naivePG, "", stats, err)
	for _, l := range lockers {
		l.Close(ctx)
	}
}

// Names of the contended floors.
const (
	naive   = "naive recipe: lease row, 100 ms poll"
	naivePG = "naive recipe on PostgreSQL: lease row, 100 ms poll"

	redsyncDefaults = "go-redsync/redsync, defaults"
	// rawPGAdvisory is PostgreSQL's session lock blocking in the server.
	rawPGAdvisory = "raw pg_advisory_lock blocking (no fencing)"
	rawGetLock    = "raw GET_LOCK blocking (no fencing)"
	// rawGetLockFenced adds the durable fence write of every grant.
	rawGetLockFenced = "raw GET_LOCK blocking + fence upsert"
	// rawForUpdate is rowlock's floor: BEGIN; SELECT … FOR UPDATE (a
	// blocking wait on the row lock); COMMIT.
	rawForUpdate = "raw SELECT … FOR UPDATE blocking (no fencing)"
	bsmRetry     = "bsm/redislock, 10 ms linear retry"
)

// getLock takes the named lock on conn, waiting in the server.
func getLock(ctx context.Context, conn *sql.Conn, name string) error {
	var got sql.NullInt64
	if err := conn.QueryRowContext(ctx, "SELECT GET_LOCK(?, 10)", name).Scan(&got); err != nil {
		return err
	}
	if got.Int64 != 1 {
		return fmt.Errorf("GET_LOCK returned %v", got)
	}
	return nil
}

// releaseLock returns a function that releases the named lock on conn.
func releaseLock(ctx context.Context, conn *sql.Conn, name string) func() error {
	return func() error {
		_, err := conn.ExecContext(ctx, "DO RELEASE_LOCK(?)", name)
		return err
	}
}

// forUpdateContend has each worker take one row's lock in a transaction
// (BEGIN; SELECT … FOR UPDATE, waiting in the server) and commit to hand it
// on.
func (b *bench) forUpdateContend(ctx context.Context, conns []*sql.Conn) (locktest.ContentionStats, error) {
	rows := b.c.table + "_rows"
	if _, err := b.db.ExecContext(ctx, "INSERT IGNORE INTO `"+rows+"` (name) VALUES ('bench-raw-contended')"); err != nil {
		return locktest.ContentionStats{}, err
	}
	return b.peerContend(ctx, func(i int) (func() error, error) {
		tx, err := conns[i].BeginTx(ctx, nil)
		if err != nil {
			return nil, err
		}
		var name []byte
		if err := tx.QueryRowContext(ctx, "SELECT name FROM `"+rows+"` WHERE name = 'bench-raw-contended' FOR UPDATE").Scan(&name); err != nil {
			tx.Rollback()
			return nil, err
		}
		return tx.Commit, nil
	})
}

// peerContend runs the contention loop for a peer library: acquire returns
// the release function.
func (b *bench) peerContend(ctx context.Context, acquire func(worker int) (func() error, error)) (locktest.ContentionStats, error) {
	st := locktest.ContentionStats{Shares: make([]int, workers)}
	type ev struct {
		w    int
		wait time.Duration
	}
	evs := make(chan ev, 1024)
	errc := make(chan error, workers)
	deadline := time.Now().Add(b.c.duration)
	for w := range workers {
		go func() {
			for time.Now().Before(deadline) {
				t := time.Now()
				release, err := acquire(w)
				if err != nil {
					if time.Now().Before(deadline) {
						errc <- err
						return
					}
					break
				}
				evs <- ev{w, time.Since(t)}
				if err := release(); err != nil {
					errc <- err
					return
				}
			}
			errc <- nil
		}()
	}
	last, done := -1, 0
	var firstErr error
	for done < workers {
		select {
		case e := <-evs:
			st.Acquisitions++
			st.Shares[e.w]++
			st.Waits = append(st.Waits, e.wait)
			if last != -1 && last != e.w {
				st.Handoffs++
			}
			last = e.w
		case err := <-errc:
			done++
			if firstErr == nil {
				firstErr = err
			}
		}
	}
	for len(evs) > 0 {
		e := <-evs
		st.Acquisitions++
		st.Shares[e.w]++
		if last != -1 && last != e.w {
			st.Handoffs++
		}
		last = e.w
	}
	st.Duration = b.c.duration
	fair := float64(st.Acquisitions) / workers
	st.MinShare = 1
	for _, n := range st.Shares {
		if fair > 0 {
			st.MinShare = min(st.MinShare, float64(n)/fair)
		}
	}
	return st, firstErr
}

func (b *bench) addContended(section, name, floor string, st locktest.ContentionStats, err error) {
	r := Row{Section: section, Name: name, P50us: us(st.WaitPercentile(50)), P99us: us(st.WaitPercentile(99)),
		OpsPerS: st.AcquisitionsPerSec(), Handoffs: st.HandoffsPerSec(), Floor: floor}
	if st.Acquisitions > 0 {
		fair := float64(st.Acquisitions) / float64(len(st.Shares))
		lo, hi := float64(slices.Min(st.Shares))/fair, float64(slices.Max(st.Shares))/fair
		r.Shares, r.MinShare, r.MaxShare = st.Shares, &lo, &hi
	}
	if err != nil {
		r.Note = "error: " + err.Error()
	}
	b.rows = append(b.rows, r)
}

// manySkipped names the strategies the many-locks run leaves out, and why.
var manySkipped = map[string]string{
	mysqlRowLock: "not run: one connection per held lock by design",
	sqliteLease:  "not run: one local file, no server connections or round trips to count",
	etcdStrategy: "not run: a lease per lock, ~3 ms each to acquire",
	zkStrategy:   "not run: a node write per lock and per renewal",
}

// many holds b.c.manyLocks keys at once through one Locker and measures
// connections, heap, goroutines and statements per renewal period.
func (b *bench) many(ctx context.Context) {
	for _, st := range b.strategies() {
		if why, ok := manySkipped[st.name]; ok {
			b.rows = append(b.rows, Row{Section: secMany, Name: st.name, Note: why})
			continue
		}
		b.manyOne(ctx, secMany, st.name, st.make)
	}
}

func (b *bench) manyOne(ctx context.Context, section, name string, newBackend func() dlock.Backend) {
	const (
		ttl     = 6 * time.Second
		periods = 3 // the Locker renews every TTL/3
	)
	runtime.GC()
	var m0, m1 runtime.MemStats
	runtime.ReadMemStats(&m0)
	g0 := runtime.NumGoroutine()
	b.lastProbe = nil
	l := dlock.New(newBackend(), nil)
	defer l.Close(ctx)
	p := b.lastProbe
	var locks []*dlock.Lock
	for i := range b.c.manyLocks {
		lk, err := l.TryAcquire(ctx, "bench/many/"+name+"/"+strconv.Itoa(i), dlock.WithTTL(ttl))
		if err != nil {
			b.rows = append(b.rows, Row{Section: section, Name: name, Note: fmt.Sprintf("error after %d locks: %v", i, err)})
			return
		}
		locks = append(locks, lk)
	}
	runtime.GC()
	runtime.ReadMemStats(&m1)
	g1 := runtime.NumGoroutine()
	var sent0, trips0, evals0 int64
	evalsErr := errors.New("not a Redis client")
	if p != nil {
		sent0 = p.sent.Load()
		if p.trips != nil {
			trips0 = p.trips.Load()
		}
		if p.redis {
			evals0, evalsErr = b.redisEvals(ctx)
		}
	}
	time.Sleep(ttl)
	lost, why := 0, ""
	for _, lk := range locks {
		if err := lk.Err(); err != nil {
			if lost == 0 {
				why = " (" + err.Error() + ")"
			}
			lost++
		}
	}
	m := &Many{Locks: len(locks), HeapPerLock: float64(int64(m1.HeapAlloc)-int64(m0.HeapAlloc)) / float64(len(locks)),
		Goroutines: g1 - g0, Lost: lost}
	note := fmt.Sprintf("%d locks: %.0f B heap per lock, %d goroutines added", m.Locks, m.HeapPerLock, m.Goroutines)
	if p != nil {
		if p.conns != nil {
			conns := p.conns()
			m.Conns = &conns
			note += fmt.Sprintf(", %d connections open", conns)
		}
		per := float64(p.sent.Load()-sent0) / periods
		m.PerPeriod, m.Unit = &per, p.unit
		note += fmt.Sprintf(", %.0f %s per renewal period", per, p.unit)
		if p.trips != nil {
			t := float64(p.trips.Load()-trips0) / periods
			m.TripsPerPeriod = &t
			note += fmt.Sprintf(" in %.0f round trips", t)
		}
		if evalsErr == nil {
			if evals1, err := b.redisEvals(ctx); err == nil {
				e := float64(evals1-evals0) / periods
				m.ServerEvalsPerPeriod = &e
				note += fmt.Sprintf(" (the server counted %.0f EVALSHA/EVAL)", e)
			}
		}
	}
	note += fmt.Sprintf(", %d lost%s", lost, why)
	b.rows = append(b.rows, Row{Section: section, Name: name, Many: m, Note: note})
}

// redisEvals returns the EVALSHA and EVAL calls the Redis server has
// counted since it started (INFO commandstats), from every client.
func (b *bench) redisEvals(ctx context.Context) (int64, error) {
	info, err := b.rdb.Info(ctx, "commandstats").Result()
	if err != nil {
		return 0, err
	}
	var n int64
	for line := range strings.Lines(info) {
		name, stats, _ := strings.Cut(strings.TrimSpace(line), ":")
		if name != "cmdstat_evalsha" && name != "cmdstat_eval" {
			continue
		}
		for kv := range strings.SplitSeq(stats, ",") {
			if v, ok := strings.CutPrefix(kv, "calls="); ok {
				c, err := strconv.ParseInt(v, 10, 64)
				if err != nil {
					return 0, fmt.Errorf("INFO commandstats: %q: %w", line, err)
				}
				n += c
			}
		}
	}
	return n, nil
}

func (b *bench) report(w io.Writer) {
	byName := map[string]Row{}
	for _, r := range b.rows {
		byName[r.Name] = r
	}
	section := ""
	for i, r := range b.rows {
		if r.Section != section {
			section = r.Section
			fmt.Fprintf(w, "\n### %s\n\n", section)
			switch section {
			case secContended:
				fmt.Fprintln(w, "| | acquisitions/s | true handoffs/s | × floor | floor | wait p50 | wait p99 | min share | max share |")
				fmt.Fprintln(w, "|---|---|---|---|---|---|---|---|---|")
			case secMany:
				fmt.Fprintln(w, "| | |")
				fmt.Fprintln(w, "|---|---|")
			default:
				fmt.Fprintln(w, "| | p50 | p99 | ops/s | × floor |")
				fmt.Fprintln(w, "|---|---|---|---|---|")
			}
		}
		ratio := ""
		if f, ok := byName[r.Floor]; ok && r.Floor != r.Name {
			switch {
			case section == secContended && f.Handoffs > 0:
				b.rows[i].Ratio = r.Handoffs / f.Handoffs
				ratio = fmt.Sprintf("%.2f×", b.rows[i].Ratio)
			case f.P50us > 0:
				b.rows[i].Ratio = r.P50us / f.P50us
				ratio = fmt.Sprintf("%.2f (%s)", b.rows[i].Ratio, r.Floor)
			}
		}
		switch {
		case strings.HasPrefix(r.Note, "error") || r.Note != "" && r.OpsPerS == 0 && r.Many == nil:
			fmt.Fprintf(w, "| %s | %s |\n", r.Name, r.Note)
		case section == secContended:
			fmt.Fprintf(w, "| %s | %.0f | %.0f | %s | %s | %s | %s | %s | %s |\n", r.Name, r.OpsPerS, r.Handoffs, ratio,
				r.Floor, dur(r.P50us), dur(r.P99us), share(r.MinShare), share(r.MaxShare))
		case section == secMany:
			fmt.Fprintf(w, "| %s | %s |\n", r.Name, r.Note)
		default:
			fmt.Fprintf(w, "| %s | %s | %s | %.0f | %s |\n", r.Name, dur(r.P50us), dur(r.P99us), r.OpsPerS, ratio)
		}
	}
}

func share(s *float64) string {
	if s == nil {
		return ""
	}
	return fmt.Sprintf("%.2f", *s)
}

func dur(us float64) string {
	return time.Duration(us * 1e3).Round(time.Microsecond).String()
}

// startRedis starts redis-server on a free loopback port and returns its
// address and a function that stops it.
func startRedis() (string, func(), error) {
	bin, err := exec.LookPath("redis-server")
	if err != nil {
		return "", nil, fmt.Errorf("no -redis and %w", err)
	}
	port, err := freePort()
	if err != nil {
		return "", nil, err
	}
	cmd := exec.Command(bin, "--bind", "127.0.0.1", "--port", strconv.Itoa(port), "--save", "", "--appendonly", "no")
	return startAndWait(cmd, net.JoinHostPort("127.0.0.1", strconv.Itoa(port)))
}

// startEtcd starts a one-member etcd on free loopback ports with its data
// in dir, and returns its client address and a function that stops it.
func startEtcd(dir string) (string, func(), error) {
	bin, err := exec.LookPath("etcd")
	if err != nil {
		return "", nil, fmt.Errorf("no -etcd and %w", err)
	}
	client, err := freePort()
	if err != nil {
		return "", nil, err
	}
	peer, err := freePort()
	if err != nil {
		return "", nil, err
	}
	cu := fmt.Sprintf("http://127.0.0.1:%d", client)
	pu := fmt.Sprintf("http://127.0.0.1:%d", peer)
	cmd := exec.Command(bin, "--name", "bench", "--data-dir", filepath.Join(dir, "etcd"),
		"--listen-client-urls", cu, "--advertise-client-urls", cu,
		"--listen-peer-urls", pu, "--initial-advertise-peer-urls", pu, "--initial-cluster", "bench="+pu,
		"--log-level", "error")
	return startAndWait(cmd, fmt.Sprintf("127.0.0.1:%d", client))
}

// startZooKeeper starts a standalone ZooKeeper (Debian's package) on a free
// loopback port with its data in dir, and returns its address and a
// function that stops it.
func startZooKeeper(dir string) (string, func(), error) {
	java, cp, err := testproc.ZooKeeperCommand()
	if err != nil {
		return "", nil, fmt.Errorf("no -zk and no ZooKeeper installed: %w", err)
	}
	port, err := freePort()
	if err != nil {
		return "", nil, err
	}
	conf := filepath.Join(dir, "zoo.cfg")
	cfg := fmt.Sprintf("tickTime=2000\ndataDir=%s\nclientPort=%d\nclientPortAddress=127.0.0.1\n"+
		"admin.enableServer=false\nmaxSessionTimeout=60000\n", filepath.Join(dir, "zk"), port)
	if err := os.WriteFile(conf, []byte(cfg), 0o600); err != nil {
		return "", nil, err
	}
	cmd := exec.Command(java, "-Xmx256m", "-Dzookeeper.admin.enableServer=false", "-cp", cp,
		"org.apache.zookeeper.server.quorum.QuorumPeerMain", conf)
	return startAndWait(cmd, fmt.Sprintf("127.0.0.1:%d", port))
}

// freePort returns a loopback port that is free now.
func freePort() (int, error) {
	l, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		return 0, err
	}
	defer l.Close()
	return l.Addr().(*net.TCPAddr).Port, nil
}

// startAndWait starts cmd (killed if this process dies) and waits up to 10 s
// for addr to accept connections.
func startAndWait(cmd *exec.Cmd, addr string) (string, func(), error) {
	cmd.SysProcAttr = &syscall.SysProcAttr{Pdeathsig: syscall.SIGKILL}
	if err := cmd.Start(); err != nil {
		return "", nil, err
	}
	stop := func() { cmd.Process.Kill(); cmd.Wait() }
	for range 200 {
		if c, err := net.Dial("tcp", addr); err == nil {
			c.Close()
			return addr, stop, nil
		}
		time.Sleep(50 * time.Millisecond)
	}
	stop()
	return "", nil, fmt.Errorf("%s did not start listening on %s", filepath.Base(cmd.Path), addr)
}
