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
	name    string // URL without password, for messages
	backend dlock.Backend
	migrate func(context.Context) error
	schema  string
	close   func() error
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

// openStore opens the store named by --db, else $DLOCK_DB, else the embedded
// default. The embedded SQLite store creates its table on open; a MySQL store
// must be migrated once with `dlock migrate`.
func (a *app) openStore(ctx context.Context, forMigrate bool) (*store, error) {
	raw := a.db
	if raw == "" {
		raw = os.Getenv("DLOCK_DB")
	}
	if raw == "" {
		// A path, not a URL: a state directory may contain '#', '?' or '%'.
		path, err := embeddedPath()
		if err != nil {
			return nil, usageError("%w", err)
		}
		return openSQLite(ctx, path, forMigrate)
	}
	u, err := url.Parse(raw)
	if err != nil {
		return nil, usageError("bad store URL: %v (want mysql://user:pass@host:3306/db or sqlite:///path/file.db)", redactErr(err))
	}
	if u.Opaque != "" {
		// scheme:user:pass@host/db parses as a scheme and an opaque part,
		// which Redacted does not hide: show the scheme alone.
		return nil, usageError("bad store URL %s:… (the rest is not shown: it may hold a password): write %s://… as in mysql://user:pass@host:3306/db", u.Scheme, u.Scheme)
	}
	switch u.Scheme {
	case "sqlite":
		path := u.Path
		if u.Host != "" { // sqlite://relative/path
			path = filepath.Join(u.Host, u.Path)
		}
		return openSQLite(ctx, path, forMigrate)
	case "mysql":
		return openMySQL(u)
	case "redis", "rediss":
		return openRedis(raw, u)
	case "postgres", "postgresql":
		return openPostgres(ctx, u)
	case "etcd":
		return openEtcd(u)
	case "zk", "zookeeper":
		return openZooKeeper(u)
	default:
		return nil, usageError("unknown store %q in %s (want mysql://, postgres://, redis://, etcd://, zk:// or sqlite://)", u.Scheme, redacted(u))
	}
}

// openSQLite opens the SQLite store in the file path, creating its table
// unless this is for `dlock migrate`.
func openSQLite(ctx context.Context, path string, forMigrate bool) (*store, error) {
	b, err := sqlitelock.Open(path)
	if err != nil {
		return nil, failure(err)
	}
	s := &store{name: "sqlite://" + path, backend: b, migrate: b.Migrate, schema: sqlitelock.Schema(), close: b.Close}
	if !forMigrate {
		if err := b.Migrate(ctx); err != nil {
			b.Close()
			return nil, failure(fmt.Errorf("embedded store %s: %w", path, err))
		}
	}
	return s, nil
}

func openMySQL(u *url.URL) (*store, error) {
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
	q := u.Query()
	opts := &mysqllock.Options{Table: q.Get("table")}
	for k := range q {
		if k != "table" && k != "strategy" {
			return nil, usageError("unknown parameter %q in %s (known: strategy, table)", k, redacted(u))
		}
	}
	strategy := q.Get("strategy")
	switch strategy {
	case "", "lease", "getlock", "rowlock":
	default:
		return nil, usageError("unknown strategy %q (want lease, getlock or rowlock)", strategy)
	}
	if cfg.DBName == "" {
		return nil, usageError("no database in %s (want mysql://user:pass@host:3306/db)", redacted(u))
	}
	connector, err := mysql.NewConnector(cfg)
	if err != nil {
		return nil, usageError("%s: %v", redacted(u), err)
	}
	db := sql.OpenDB(connector)
	lease, err := mysqllock.New(db, opts)
	if err != nil {
		db.Close()
		return nil, usageError("%w", err)
	}
	var backend interface {
		dlock.Backend
		Close() error
	} = lease
	switch strategy {
	case "getlock":
		backend, err = mysqllock.NewGetLock(db, opts)
	case "rowlock":
		backend, err = mysqllock.NewRowLock(db, opts)
	}
	if err != nil {
		db.Close()
		return nil, usageError("%w", err)
	}
	schema, _ := mysqllock.Schema(opts.Table)
	closeAll := func() error { return errors.Join(backend.Close(), lease.Close(), db.Close()) }
	return &store{name: redacted(u), backend: backend, migrate: lease.Migrate, schema: schema, close: closeAll}, nil
}

func trimSlash(p string) string {
	for len(p) > 0 && p[0] == '/' {
		p = p[1:]
	}
	return p
}

// redacted is u for messages, without the password of its user info or of
// the password and sslpassword parameters (which pgx accepts).
func redacted(u *url.URL) string {
	q := u.Query()
	u2 := *u
	for _, k := range []string{"password", "sslpassword"} {
		if q.Has(k) {
			q.Set(k, "xxxxx")
			u2.RawQuery = q.Encode()
		}
	}
	return u2.Redacted()
}

// redactErr drops a *url.Error's URL, which may carry a password.
func redactErr(err error) error {
	var ue *url.Error
	if errors.As(err, &ue) {
		return ue.Err
	}
	return err
}

// explain turns store errors into messages that name the fix.
func (s *store) explain(err error) error {
	switch {
	case errors.Is(err, dlock.ErrNoSchema):
		return fmt.Errorf("%s has no lock table: run `dlock migrate` once (%w)", s.name, err)
	case errors.Is(err, dlock.ErrInvalidKey), errors.Is(err, dlock.ErrInvalidOption):
		return usageError("%w", err)
	}
	var ne net.Error
	if errors.As(err, &ne) {
		return fmt.Errorf("cannot reach %s: is the server running and the address right? (%w)", s.name, err)
	}
	return fmt.Errorf("%s: %w", s.name, err)
}

// openRedis opens redis://[user:pass@]host:6379/db[?prefix=dlock:] (go-redis
// URL options are accepted too).
func openRedis(raw string, u *url.URL) (*store, error) {
	q := u.Query()
	prefix := q.Get("prefix")
	q.Del("prefix")
	u2 := *u
	u2.RawQuery = q.Encode()
	opts, err := redis.ParseURL(u2.String())
	if err != nil {
		return nil, usageError("%s: %v", redacted(u), redactErr(err))
	}
	c := redis.NewClient(opts)
	b, err := redislock.New(c, &redislock.Options{Prefix: prefix})
	if err != nil {
		c.Close()
		return nil, usageError("%w", err)
	}
	return &store{name: redacted(u), backend: b, migrate: noMigrate,
		schema: "-- Redis needs no schema.", close: c.Close}, nil
}

// noMigrate is the migration of stores without a schema.
func noMigrate(context.Context) error { return nil }

// openPostgres opens postgres://user:pass@host:5432/db[?strategy=lease|advisory&table=…]
// (other parameters go to pgx: sslmode, connect_timeout, …).
func openPostgres(ctx context.Context, u *url.URL) (*store, error) {
	q := u.Query()
	opts := &pglock.Options{Table: q.Get("table")}
	strategy := q.Get("strategy")
	q.Del("table")
	q.Del("strategy")
	switch strategy {
	case "", "lease", "advisory":
	default:
		return nil, usageError("unknown strategy %q (want lease or advisory)", strategy)
	}
	if !q.Has("connect_timeout") {
		q.Set("connect_timeout", "5")
	}
	u2 := *u
	u2.RawQuery = q.Encode()
	cfg, err := pgxpool.ParseConfig(u2.String())
	if err != nil {
		return nil, usageError("%s: %v", redacted(u), redactErr(err))
	}
	pool, err := pgxpool.NewWithConfig(ctx, cfg)
	if err != nil {
		return nil, usageError("%s: %v", redacted(u), redactErr(err))
	}
	lease, err := pglock.New(pool, opts)
	if err != nil {
		pool.Close()
		return nil, usageError("%w", err)
	}
	var backend interface {
		dlock.Backend
		Close() error
	} = lease
	if strategy == "advisory" {
		if backend, err = pglock.NewAdvisory(pool, opts); err != nil {
			pool.Close()
			return nil, usageError("%w", err)
		}
	}
	schema, _ := pglock.Schema(opts.Table)
	closeAll := func() error {
		err := errors.Join(backend.Close(), lease.Close())
		pool.Close()
		return err
	}
	return &store{name: redacted(u), backend: backend, migrate: lease.Migrate, schema: schema, close: closeAll}, nil
}
