package main

import (
	"context"
	"database/sql"
	"errors"
	"fmt"
	"net"
	"net/url"
	"os"
	"path/filepath"
	"strconv"
	"time"

	"github.com/dlock-dev/dlock"
	"github.com/dlock-dev/dlock/mysqllock"
	"github.com/dlock-dev/dlock/pglock"
	"github.com/dlock-dev/dlock/redislock"
	"github.com/dlock-dev/dlock/sqlitelock"
	"github.com/go-sql-driver/mysql"
	"github.com/jackc/pgx/v5/pgxpool"
	"github.com/redis/go-redis/v9"
)

// store is an opened lock store.
type store struct {
	name     string // URL without password, for messages
	embedded bool   // this host's embedded store
	backend  dlock.Backend
	guard    *guard // bounds backend's calls; nil until openStore wraps it
	migrate  func(context.Context) error
	schema   string
	exists   tableExists // nil for stores without tables
	doctor   doctorFunc
	strategy string
	close    func() error
}

// embeddedPath returns the file of the embedded default store.
func embeddedPath() (string, error) {
	dir := os.Getenv("XDG_STATE_HOME")
	if dir == "" {
		home, err := os.UserHomeDir()
		if err != nil {
			return "", fmt.Errorf("no --db, no $DLOCK_DB, and no home directory for the embedded store: %w", err)
		}
		dir = filepath.Join(home, ".local", "state")
	}
	return filepath.Join(dir, "dlock", "locks.db"), nil
}

// storeSource returns the store URL and where it came from: --db, else
// $DLOCK_DB, else "" (the embedded default).
func (a *app) storeSource() (raw, source string) {
	if a.dbSet {
		return a.db, "--db"
	}
	if v, ok := os.LookupEnv("DLOCK_DB"); ok {
		return v, "$DLOCK_DB"
	}
	return "", ""
}

// openStore opens the store named by --db, else $DLOCK_DB, else the embedded
// default. The embedded SQLite store creates its table on open; a MySQL store
// must be migrated once with `dlock migrate`. Every call to the store's
// Backend and its migration is bounded by --timeout.
func (a *app) openStore(ctx context.Context, forMigrate bool) (*store, error) {
	raw, source := a.storeSource()
	spec, err := parseStore(raw, source)
	if err != nil {
		return nil, err
	}
	a.secrets = append(a.secrets, spec.secrets...)
	if a.beforeIO != nil {
		return nil, a.beforeIO(spec)
	}
	var s *store
	switch spec.scheme {
	case "sqlite":
		path := spec.path
		if spec.embedded {
			// A path, not a URL: a state directory may contain '#', '?' or '%'.
			if path, err = embeddedPath(); err != nil {
				return nil, usageError("%w", err)
			}
		}
		s, err = openSQLite(path, spec.embedded)
	case "mysql":
		s, err = openMySQL(spec)
	case "redis", "rediss":
		s, err = openRedis(spec)
	case "postgres":
		s, err = openPostgres(ctx, spec)
	case "etcd":
		s, err = openEtcd(spec, a.log.With("driver", "etcd"))
	case "zk":
		s, err = openZooKeeper(spec, a.log.With("driver", "zookeeper"))
	}
	if err != nil {
		return nil, err
	}
	s.strategy = spec.strategy()
	var g *guard
	s.backend, g = newGuard(s.backend, a.timeout)
	s.guard = g
	migrate := s.migrate
	s.migrate = func(ctx context.Context) error { return g.call(ctx, "the migration", migrate) }
	if spec.scheme == "sqlite" && !forMigrate {
		// A SQLite store creates its table on open.
		if err := s.migrate(ctx); err != nil {
			s.close()
			return nil, failure(fmt.Errorf("store %s: %w", s.name, err))
		}
	}
	return s, nil
}

// openSQLite opens the SQLite store in the file path. The embedded store
// creates its table on open, and its state directory if need be; a path
// given in a URL must be in a directory that exists (a typo would otherwise
// make a new, empty store that excludes nobody).
func openSQLite(path string, embedded bool) (*store, error) {
	if !embedded {
		dir := filepath.Dir(path)
		if fi, err := os.Stat(dir); err != nil || !fi.IsDir() {
			return nil, usageError("sqlite://%s: the directory %s does not exist: create it, or correct the path", path, dir)
		}
	}
	b, err := sqlitelock.Open(path)
	if err != nil {
		return nil, failure(err)
	}
	return &store{name: "sqlite://" + path, embedded: embedded, backend: b, migrate: b.Migrate,
		schema: sqlitelock.Schema(), exists: sqliteTableExists(path), doctor: sqliteDoctor(path), close: b.Close}, nil
}

func openMySQL(spec *storeSpec) (*store, error) {
	u := spec.u
	cfg := mysql.NewConfig()
	cfg.Net = "tcp"
	cfg.Addr = u.Host
	if u.Port() == "" {
		cfg.Addr = net.JoinHostPort(u.Hostname(), "3306")
	}
	cfg.User = u.User.Username()
	cfg.Passwd, _ = u.User.Password()
	cfg.DBName = trimSlash(u.Path)
	cfg.Timeout = 5 * time.Second
	cfg.InterpolateParams = true
	opts := &mysqllock.Options{Table: spec.params.Get("table")}
	connector, err := mysql.NewConnector(cfg)
	if err != nil {
		return nil, usageError("%s: %s", spec.name, spec.scrub(err.Error()))
	}
	// doorbell=off: none; doorbell=host:port: the lease strategy's
	// doorbells on that server (one node of a Galera cluster, the same for
	// every client), with the store's credentials and database.
	switch bell := spec.params.Get("doorbell"); bell {
	case "":
	case "off":
		opts.NoDoorbell = true
	default:
		bc := cfg.Clone()
		bc.Addr = bell
		if opts.Connector, err = mysql.NewConnector(bc); err != nil {
			return nil, usageError("%s: %s", spec.name, spec.scrub(err.Error()))
		}
	}
	db := sql.OpenDB(connector)
	var backend interface {
		dlock.Backend
		Migrate(context.Context) error
		Close() error
	}
	switch spec.strategy() {
	case "getlock":
		backend, err = mysqllock.NewGetLock(db, opts)
	case "rowlock":
		backend, err = mysqllock.NewRowLock(db, opts)
	default:
		backend, err = mysqllock.New(db, opts)
	}
	if err != nil {
		db.Close()
		return nil, usageError("%w", err)
	}
	schema, _ := mysqllock.Schema(opts.Table)
	closeAll := func() error { return dlock.Join(backend.Close(), db.Close()) }
	checker, _ := backend.(interface {
		Check(context.Context) ([]mysqllock.Finding, error)
	})
	return &store{name: spec.name, backend: backend, migrate: backend.Migrate, schema: schema,
		exists: mysqlTableExists(db), doctor: mysqlDoctor(db, checker), close: closeAll}, nil
}

// explain turns store errors into messages that name the fix.
func (s *store) explain(err error) error {
	switch {
	case errors.Is(err, dlock.ErrNoSchema):
		return fmt.Errorf("%s has no lock table: run `dlock migrate` once (%w)", s.name, err)
	case errors.Is(err, dlock.ErrInvalidKey), errors.Is(err, dlock.ErrInvalidOption):
		return usageError("%w", err)
	case errors.Is(err, errNoAnswer):
		return fmt.Errorf("%s: %w", s.name, err)
	}
	var ne net.Error
	if errors.As(err, &ne) {
		return fmt.Errorf("cannot reach %s: is the server running and the address right? (%w)", s.name, err)
	}
	return fmt.Errorf("%s: %w", s.name, err)
}

// openRedis opens
// redis://[user:pass@]host:6379/db[?prefix=dlock:&min_replicas=N] (go-redis
// URL options are accepted too). parseStore has checked min_replicas.
func openRedis(spec *storeSpec) (*store, error) {
	opts, err := redis.ParseURL(goRedisURL(spec.u, spec.params))
	if err != nil {
		return nil, usageError("%s: %s", spec.name, spec.scrub(redactErr(err).Error()))
	}
	minReplicas, _ := strconv.Atoi(spec.params.Get("min_replicas"))
	c := redis.NewClient(opts)
	b, err := redislock.New(c, &redislock.Options{Prefix: spec.params.Get("prefix"), MinReplicas: minReplicas})
	if err != nil {
		c.Close()
		return nil, usageError("%w", err)
	}
	ping := func(ctx context.Context) error { return c.Ping(ctx).Err() }
	return &store{name: spec.name, backend: b, migrate: ping,
		schema: "-- Redis needs no schema.", doctor: redisDoctor(c, minReplicas), close: c.Close}, nil
}

// openPostgres opens postgres://user:pass@host:5432/db[?strategy=lease|advisory&table=…]
// (pgx's connection parameters are accepted too: sslmode, connect_timeout, …).
func openPostgres(ctx context.Context, spec *storeSpec) (*store, error) {
	opts := &pglock.Options{Table: spec.params.Get("table")}
	q := url.Values{}
	for k, v := range spec.params {
		if k != "table" && k != "strategy" {
			q[k] = v
		}
	}
	if !q.Has("connect_timeout") {
		q.Set("connect_timeout", "5")
	}
	u2 := *spec.u
	u2.RawQuery = q.Encode()
	cfg, err := pgxpool.ParseConfig(u2.String())
	if err != nil {
		return nil, usageError("%s: %s", spec.name, spec.scrub(redactErr(err).Error()))
	}
	pool, err := pgxpool.NewWithConfig(ctx, cfg)
	if err != nil {
		return nil, usageError("%s: %s", spec.name, spec.scrub(redactErr(err).Error()))
	}
	var backend interface {
		dlock.Backend
		Migrate(context.Context) error
		Close() error
	}
	if spec.strategy() == "advisory" {
		backend, err = pglock.NewAdvisory(pool, opts)
	} else {
		backend, err = pglock.New(pool, opts)
	}
	if err != nil {
		pool.Close()
		return nil, usageError("%w", err)
	}
	schema, _ := pglock.Schema(opts.Table)
	closeAll := func() error {
		err := backend.Close()
		pool.Close()
		return err
	}
	return &store{name: spec.name, backend: backend, migrate: backend.Migrate, schema: schema,
		exists: pgTableExists(pool), doctor: pgDoctor(pool), close: closeAll}, nil
}
