package torture

import (
	"context"
	"errors"
	"fmt"
	"net"
	"regexp"
	"strconv"
	"strings"
	"time"

	"github.com/dlock-dev/dlock"
	"github.com/dlock-dev/dlock/pglock"
	"github.com/jackc/pgx/v5/pgconn"
	"github.com/jackc/pgx/v5/pgxpool"
)

// pgLease is pglock's lease strategy on the PostgreSQL at Env.PGDSN.
//
// An AFTER INSERT OR UPDATE trigger copies every change of a lock row's
// fence, token or expiry into a history table, numbered by a sequence. The
// sequence gives the apply order per key: the trigger runs while the
// statement holds the row's lock, which it keeps until it commits, so the
// next writer of that key (whose trigger takes the next number) can only
// change the row, and number its change, after this one committed. (Across
// keys the numbers say nothing about commit order, and the checker only
// replays per key.) A writer that rolls back takes its history row with it.
//
// The trigger's own clock is not the instant the statement judged the lease
// by: pglock's statements read clock_timestamp() once, at their start, and
// may then wait for the row lock. So each event's instant is derived from
// the row's columns, as for mysql-lease: a grant's acquired_at, an
// extension's expiry minus the TTL, a release's expiry (pglock's release
// keeps the token and sets the expiry to its clock_timestamp(): markReleases
// sees the expiry move back for the same fence). A release that hands the
// key to a queued waiter writes the new grant over the live lease, with
// freed_at equal to the grant's acquired_at (which no acquisition sets): the
// trigger first records the old lease's release at that instant.
var pgLease = &Adapter{
	Name:      "pg-lease",
	Modes:     bothModes,
	Networked: true,
	Pooled:    true,
	Upstream:  pgUpstream,
	Restart:   restartPG,
	Prepare: func(ctx context.Context, env *Env) (string, error) {
		return preparePG(ctx, env, "", `IF TG_OP = 'UPDATE' AND NEW.fence <> OLD.fence AND NEW.freed_at = NEW.acquired_at
    AND OLD.expires_at > NEW.acquired_at THEN
    INSERT INTO %[1]s (name, fence, token, acquired_us, exp_us)
    VALUES (OLD.name, OLD.fence, OLD.token, (extract(epoch FROM OLD.acquired_at) * 1000000)::bigint,
      (extract(epoch FROM NEW.acquired_at) * 1000000)::bigint);
  END IF;
  IF TG_OP = 'INSERT' OR NEW.fence <> OLD.fence OR NEW.token <> OLD.token
    OR NEW.expires_at <> OLD.expires_at THEN
    INSERT INTO %[1]s (name, fence, token, acquired_us, exp_us)
    VALUES (NEW.name, NEW.fence, NEW.token, (extract(epoch FROM NEW.acquired_at) * 1000000)::bigint,
      (extract(epoch FROM NEW.expires_at) * 1000000)::bigint);
  END IF;`)
	},
	Open: func(ctx context.Context, a OpenArgs) (dlock.Backend, func() error, error) {
		return openPG(ctx, a, func(pool *pgxpool.Pool, o *pglock.Options) (pgBackend, error) { return pglock.New(pool, o) })
	},
	History: func(ctx context.Context, env *Env, store string) ([]LeaseEvent, error) {
		pool, err := pgPool(ctx, env)
		if err != nil {
			return nil, err
		}
		defer pool.Close()
		rows, err := pool.Query(ctx, "SELECT seq, name, fence, token, acquired_us, exp_us FROM "+pgIdent(store+"_hist")+" ORDER BY seq")
		if err != nil {
			return nil, err
		}
		defer rows.Close()
		var out []LeaseEvent
		prev := map[string]uint64{}
		for rows.Next() {
			var e LeaseEvent
			var name, token []byte
			var fence, acquiredUs int64
			if err := rows.Scan(&e.Seq, &name, &fence, &token, &acquiredUs, &e.ExpUs); err != nil {
				return nil, err
			}
			e.Key, e.Fence = string(name), uint64(fence)
			copy(e.Token[:], token)
			// The instant the statement used as "now": a grant's
			// acquired_at, an extension's expiry minus the TTL (the workers
			// renew with the run's TTL); markReleases sets a release's
			// (an expiry moved back) to its expiry.
			if f, seen := prev[e.Key]; !seen || f != e.Fence {
				e.AtUs = acquiredUs
			} else {
				e.AtUs = e.ExpUs - env.TTL.Microseconds()
			}
			prev[e.Key] = e.Fence
			out = append(out, e)
		}
		if err := rows.Err(); err != nil {
			return nil, err
		}
		markReleases(out)
		return out, nil
	},
}

// pgAdvisory is pglock's advisory strategy: session-level advisory locks,
// whose fencing counter lives in the "_session" table. The same kind of
// trigger records each grant there (a new fence); a lock ends with an unlock
// or its session, which leaves no row, so the history has grants only.
var pgAdvisory = &Adapter{
	Name:        "pg-advisory",
	Networked:   true,
	Pooled:      true,
	Upstream:    pgUpstream,
	Restart:     restartPG,
	SessionHeld: true,
	Known:       sessionEnds, // as for mysql-getlock
	Modes:       []dlock.Mode{dlock.ModeShared},
	Prepare: func(ctx context.Context, env *Env) (string, error) {
		return preparePG(ctx, env, "_session", `IF TG_OP = 'INSERT' OR NEW.fence <> OLD.fence THEN
    INSERT INTO %[1]s (name, fence, token, acquired_us, exp_us)
    VALUES (NEW.name, NEW.fence, NEW.token, (extract(epoch FROM NEW.acquired_at) * 1000000)::bigint, 0);
  END IF;`)
	},
	Open: func(ctx context.Context, a OpenArgs) (dlock.Backend, func() error, error) {
		return openPG(ctx, a, func(pool *pgxpool.Pool, o *pglock.Options) (pgBackend, error) { return pglock.NewAdvisory(pool, o) })
	},
	History: func(ctx context.Context, env *Env, store string) ([]LeaseEvent, error) {
		pool, err := pgPool(ctx, env)
		if err != nil {
			return nil, err
		}
		defer pool.Close()
		rows, err := pool.Query(ctx, "SELECT seq, name, fence, token, acquired_us FROM "+pgIdent(store+"_session_hist")+" ORDER BY seq")
		if err != nil {
			return nil, err
		}
		defer rows.Close()
		var out []LeaseEvent
		for rows.Next() {
			e := LeaseEvent{Open: true}
			var name, token []byte
			var fence int64
			if err := rows.Scan(&e.Seq, &name, &fence, &token, &e.AtUs); err != nil {
				return nil, err
			}
			e.Key, e.Fence = string(name), uint64(fence)
			copy(e.Token[:], token)
			out = append(out, e)
		}
		return out, rows.Err()
	},
}

// pgBackend is what both pglock strategies offer the harness.
type pgBackend interface {
	dlock.Backend
	Migrate(ctx context.Context) error
	Close() error
}

var pgTagRE = regexp.MustCompile(`^[a-z0-9]{1,24}$`)

// pgTable returns the lock table for a run tag (an identifier that needs no
// quoting, well within pglock's 50 bytes).
func pgTable(tag string) (string, error) {
	if !pgTagRE.MatchString(tag) {
		return "", fmt.Errorf("run tag %q is not 1-24 of [a-z0-9]", tag)
	}
	return "torture_" + tag + "_locks", nil
}

// pgIdent quotes a name made by pgTable (and suffixes).
func pgIdent(name string) string { return `"` + name + `"` }

// preparePG drops and recreates pglock's tables for env's tag (Migrate
// creates those of both strategies), and instruments the one named by
// suffix ("" for the lease table, "_session") with a history table filled
// by a trigger whose PL/pgSQL body is body, with %[1]s for the history table
// (not when env.Unrecorded).
func preparePG(ctx context.Context, env *Env, suffix, body string) (string, error) {
	locks, err := pgTable(env.Tag)
	if err != nil {
		return "", err
	}
	pool, err := pgPool(ctx, env)
	if err != nil {
		return "", err
	}
	defer pool.Close()
	b, err := pglock.New(pool, &pglock.Options{Table: locks})
	if err != nil {
		return "", err
	}
	defer b.Close()
	t := locks + suffix
	var drop []string
	for _, s := range []string{"", "_waiters", "_holders", "_session", "_readers", "_epochs", "_epoch_now", "_claims", "_hist", "_session_hist"} {
		drop = append(drop, pgIdent(locks+s))
	}
	if _, err := pool.Exec(ctx, "DROP TABLE IF EXISTS "+strings.Join(drop, ", ")); err != nil {
		return "", fmt.Errorf("prepare: %w", err)
	}
	if err := b.Migrate(ctx); err != nil {
		return "", err
	}
	if env.Unrecorded {
		return locks, nil
	}
	hist, fn := pgIdent(t+"_hist"), pgIdent(t+"_hist_fn")
	for _, s := range []string{
		"CREATE TABLE " + hist + ` (
  seq         bigserial PRIMARY KEY, -- apply order per key (see pgLease)
  name        bytea  NOT NULL,
  fence       bigint NOT NULL,
  token       bytea  NOT NULL,
  acquired_us bigint NOT NULL,
  exp_us      bigint NOT NULL
)`,
		"CREATE OR REPLACE FUNCTION " + fn + "() RETURNS trigger LANGUAGE plpgsql AS $$\nBEGIN\n  " +
			fmt.Sprintf(body, hist) + "\n  RETURN NULL;\nEND\n$$",
		"CREATE TRIGGER torture_hist AFTER INSERT OR UPDATE ON " + pgIdent(t) + " FOR EACH ROW EXECUTE FUNCTION " + fn + "()",
	} {
		if _, err := pool.Exec(ctx, s); err != nil {
			return "", fmt.Errorf("prepare: instrument %s: %w", t, err)
		}
	}
	return locks, nil
}

// pgPool opens a small pool on env's PostgreSQL, for the harness itself.
func pgPool(ctx context.Context, env *Env) (*pgxpool.Pool, error) {
	cfg, err := pgxpool.ParseConfig(env.PGDSN)
	if err != nil {
		return nil, err
	}
	cfg.MaxConns = 2
	if cfg.ConnConfig.ConnectTimeout == 0 {
		cfg.ConnConfig.ConnectTimeout = 5 * time.Second
	}
	pool, err := pgxpool.NewWithConfig(ctx, cfg)
	if err != nil {
		return nil, err
	}
	if err := pool.Ping(ctx); err != nil {
		pool.Close()
		return nil, fmt.Errorf("%w: PostgreSQL at %s: %v", ErrNoServer, env.PGDSN, err)
	}
	return pool, nil
}

// openPG opens a pool on the worker's proxy (every connection, fallbacks
// included) and a backend on it.
func openPG(ctx context.Context, a OpenArgs, newB func(*pgxpool.Pool, *pglock.Options) (pgBackend, error)) (dlock.Backend, func() error, error) {
	cfg, err := pgxpool.ParseConfig(a.PGDSN)
	if err != nil {
		return nil, nil, err
	}
	if a.Addr != "" {
		host, p, err := net.SplitHostPort(a.Addr)
		if err != nil {
			return nil, nil, err
		}
		port, err := strconv.ParseUint(p, 10, 16)
		if err != nil {
			return nil, nil, err
		}
		cfg.ConnConfig.Host, cfg.ConnConfig.Port = host, uint16(port)
		for _, fb := range cfg.ConnConfig.Fallbacks {
			fb.Host, fb.Port = host, uint16(port)
		}
	}
	if cfg.ConnConfig.ConnectTimeout == 0 {
		cfg.ConnConfig.ConnectTimeout = 2 * time.Second
	}
	// One worker holds one lock at a time: the lease needs a connection for
	// its statements and one for LISTEN, the advisory strategy its main
	// session, a waiting session and a spare for reading the holder.
	cfg.MaxConns = 4
	if a.PoolSize > 0 {
		cfg.MaxConns = int32(a.PoolSize)
	}
	pool, err := pgxpool.NewWithConfig(ctx, cfg)
	if err != nil {
		return nil, nil, err
	}
	b, err := newB(pool, &pglock.Options{Table: a.Store})
	if err != nil {
		pool.Close()
		return nil, nil, err
	}
	closeAll := func() error {
		err := b.Close()
		pool.Close()
		return err
	}
	return b, closeAll, nil
}

// restartPG kills the PostgreSQL server of the pg strategies (the postmaster
// listening on the DSN's address) with SIGKILL, waits for its backends to
// exit, starts the same command again as the same user (see
// restartListener), and waits (bounded) until it answers queries: crash
// recovery replays its WAL, so committed lock rows, fencing counters and the
// trigger's history survive.
func restartPG(ctx context.Context, env *Env) (killed, ready int64, err error) {
	addr, err := pgUpstream(env)
	if err != nil {
		return 0, 0, err
	}
	return restartListener(ctx, env, addr, func(ctx context.Context) error {
		c, err := pgconn.Connect(ctx, env.PGDSN)
		if err != nil {
			return err
		}
		defer c.Close(context.Background())
		return c.Ping(ctx)
	}, nil)
}

// pgUpstream is the TCP address of the PostgreSQL in env.PGDSN.
func pgUpstream(env *Env) (string, error) {
	if env.PGDSN == "" {
		return "", errors.New("no PostgreSQL DSN (Config.PGDSN)")
	}
	cfg, err := pgconn.ParseConfig(env.PGDSN)
	if err != nil {
		return "", err
	}
	if strings.HasPrefix(cfg.Host, "/") {
		return "", fmt.Errorf("the PostgreSQL DSN must use TCP to put a proxy in the path, not the socket in %s", cfg.Host)
	}
	return net.JoinHostPort(cfg.Host, strconv.Itoa(int(cfg.Port))), nil
}
