package pglock_test

import (
	"context"
	"errors"
	"syscall"
	"testing"
	"time"

	"github.com/dlock-dev/dlock"
	"github.com/dlock-dev/dlock/pglock"
	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgxpool"
)

// startAdvisoryServer starts a server of the test's own (see startOwnServer)
// and returns it, a pool on it and a context that ends after d or with the
// test. It skips the test with -short.
func startAdvisoryServer(t *testing.T, d time.Duration) (*ownServer, *pgxpool.Pool, context.Context) {
	t.Helper()
	if testing.Short() {
		t.Skip("starts a PostgreSQL server")
	}
	srv := startOwnServer(t, "")
	ctx, cancel := context.WithTimeout(context.Background(), d)
	t.Cleanup(cancel)
	return srv, srv.pool(t, 0), ctx
}

// migratedAdvisory returns an Advisory of table over pool, after Migrate,
// closed when the test ends.
func migratedAdvisory(t *testing.T, ctx context.Context, pool *pgxpool.Pool, table string) *pglock.Advisory {
	t.Helper()
	a, err := pglock.NewAdvisory(pool, &pglock.Options{Table: table})
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { a.Close() })
	if err := a.Migrate(ctx); err != nil {
		t.Fatal(err)
	}
	return a
}

// acquireRetrying takes key on a new Advisory of table over pool, asking
// again while the calls meet the connections that a restart ended, and
// releases it. It returns the grant's fence.
func acquireRetrying(t *testing.T, ctx context.Context, pool *pgxpool.Pool, table, key string, opts ...dlock.AcquireOption) uint64 {
	t.Helper()
	var last error
	for try := 0; try < 50; try++ {
		a, err := pglock.NewAdvisory(pool, &pglock.Options{Table: table})
		if err != nil {
			t.Fatal(err)
		}
		l := dlock.New(a, nil)
		actx, cancel := context.WithTimeout(ctx, 10*time.Second)
		lk, err := l.Acquire(actx, key, opts...)
		cancel()
		if err == nil {
			f := lk.Fence()
			if err := lk.Release(ctx); err != nil {
				t.Fatalf("release: %v", err)
			}
			l.Close(ctx)
			a.Close()
			return f
		}
		l.Close(ctx)
		a.Close()
		last = err
		time.Sleep(100 * time.Millisecond)
	}
	t.Fatalf("acquire %q: %v", key, last)
	return 0
}

// TestAdvisoryFencesAcrossRestarts restarts a server of the test's own in
// each way a server ends: a clean restart (the unlogged tables are kept), a
// crash of a backend (the postmaster stays up, but recovers and empties the
// unlogged tables) and an immediate shutdown of the postmaster (the same
// recovery at the next start). Each key's fences, exclusive and shared,
// must strictly increase across all of them.
func TestAdvisoryFencesAcrossRestarts(t *testing.T) {
	srv, pool, ctx := startAdvisoryServer(t, 4*time.Minute)
	const table = "restarts"
	migratedAdvisory(t, ctx, pool, table).Close()
	last := map[string]uint64{}
	grants := func(when string) {
		for _, key := range []string{"x", "s"} {
			for range 3 {
				var opts []dlock.AcquireOption
				if key == "s" {
					opts = append(opts, dlock.Shared())
				}
				f := acquireRetrying(t, ctx, pool, table, key, opts...)
				if f <= last[key] {
					t.Fatalf("%s: key %q granted fence %#x after %#x: fences must strictly increase", when, key, f, last[key])
				}
				last[key] = f
			}
		}
		t.Logf("%s: fences %#x %#x", when, last["x"], last["s"])
	}
	grants("first run")
	srv.stop()
	if err := srv.start(); err != nil {
		t.Fatal(err)
	}
	grants("after a clean restart")
	srv.crashPooled(ctx, pool)
	grants("after a backend's crash")
	if err := srv.cmd.Process.Signal(syscall.SIGQUIT); err != nil { // immediate shutdown
		t.Fatal(err)
	}
	<-srv.done
	if err := srv.start(); err != nil {
		t.Fatal(err)
	}
	grants("after an immediate shutdown")
}

// TestAdvisoryGrantWritesNoWAL makes every commit that wrote WAL wait
// forever (synchronous_standby_names names a standby that never comes): a
// grant, a handoff to a waiter, a shared grant and their releases must
// still complete, because they write only unlogged tables. The first grant
// of an epoch writes the logged "_epochs" table, and the first acquisition
// of a key its claim, so those come before.
func TestAdvisoryGrantWritesNoWAL(t *testing.T) {
	srv, pool, ctx := startAdvisoryServer(t, 2*time.Minute)
	a := migratedAdvisory(t, ctx, pool, "nowal")
	l := dlock.New(a, nil)
	defer l.Close(ctx)
	for _, k := range []string{"a", "b"} {
		lk, err := l.Acquire(ctx, k)
		if err != nil {
			t.Fatal(err)
		}
		if err := lk.Release(ctx); err != nil {
			t.Fatal(err)
		}
	}
	for _, stmt := range []string{"CREATE TABLE probe (n int)", "ALTER SYSTEM SET synchronous_standby_names = 'dlock_nobody'", "SELECT pg_reload_conf()"} {
		if _, err := pool.Exec(ctx, stmt); err != nil {
			t.Fatalf("%s: %v", stmt, err)
		}
	}
	waitSyncRep(t, ctx, srv, pool)

	wctx, wcancel := context.WithTimeout(ctx, 20*time.Second)
	defer wcancel()
	held, err := l.TryAcquire(wctx, "a")
	if err != nil {
		t.Fatalf("grant waited for the standby (its commit wrote WAL): %v", err)
	}
	got := make(chan error, 1)
	go func() {
		lk, err := l.Acquire(wctx, "a")
		if err == nil {
			if lk.Fence() <= held.Fence() {
				err = errors.New("the waiter's fence is not greater")
			} else {
				err = lk.Release(wctx)
			}
		}
		got <- err
	}()
	time.Sleep(200 * time.Millisecond) // let the waiter queue in the server
	if err := held.Release(wctx); err != nil {
		t.Fatalf("release: %v", err)
	}
	if err := <-got; err != nil {
		t.Fatalf("handoff waited for the standby: %v", err)
	}
	sh, err := l.Acquire(wctx, "b", dlock.Shared())
	if err != nil {
		t.Fatalf("shared grant waited for the standby: %v", err)
	}
	if err := sh.Release(wctx); err != nil {
		t.Fatalf("shared release: %v", err)
	}
}

// waitSyncRep waits until a commit that wrote WAL waits for a synchronous
// standby on srv (the checkpointer applies a reloaded
// synchronous_standby_names): until a logged insert into the table probe
// shows in pg_stat_activity as waiting for it (then it is cancelled, which
// ends the wait).
func waitSyncRep(t *testing.T, ctx context.Context, srv *ownServer, pool *pgxpool.Pool) {
	t.Helper()
	c, err := pgx.Connect(ctx, srv.dsn())
	if err != nil {
		t.Fatal(err)
	}
	defer c.Close(context.Background())
	var pid uint32
	if err := c.QueryRow(ctx, "SELECT pg_backend_pid()").Scan(&pid); err != nil {
		t.Fatal(err)
	}
probe:
	for {
		done := make(chan error, 1)
		go func() {
			_, err := c.Exec(ctx, "INSERT INTO probe VALUES (1)")
			done <- err
		}()
		for waiting := false; !waiting; {
			select {
			case err := <-done:
				if err != nil {
					t.Fatal(err)
				}
				time.Sleep(50 * time.Millisecond)
				continue probe
			case <-time.After(20 * time.Millisecond):
			}
			if err := pool.QueryRow(ctx, "SELECT EXISTS (SELECT FROM pg_stat_activity WHERE pid = $1 AND wait_event = 'SyncRep')", pid).Scan(&waiting); err != nil {
				t.Fatal(err)
			}
		}
		if _, err := pool.Exec(ctx, "SELECT pg_cancel_backend($1)", pid); err != nil {
			t.Fatal(err)
		}
		if err := <-done; err != nil {
			t.Fatal(err)
		}
		return
	}
}

// TestAdvisoryMigratesLoggedTables turns the advisory strategy's tables
// back into what earlier versions made (logged, without epochs), with
// fences of earlier versions (a plain counter, and one beyond 2^40), and
// checks that Migrate makes them unlogged and that each key's next fence is
// greater than its old one.
func TestAdvisoryMigratesLoggedTables(t *testing.T) {
	pool := open(t, "")
	ctx, cancel := context.WithTimeout(context.Background(), 30*time.Second)
	defer cancel()
	table := testTable() + "_mig"
	t.Cleanup(func() { dropTablesOf(context.Background(), pool, table) })
	a := migratedAdvisory(t, ctx, pool, table)
	plain, huge := table+"/plain", table+"/huge"
	old := map[string]uint64{plain: 1234, huge: 3<<40 + 7}
	for k := range old {
		acquireRetrying(t, ctx, pool, table, k)
	}
	q := func(name string) string { return `"` + table + name + `"` }
	for _, stmt := range []string{
		"ALTER TABLE " + q("_session") + " SET LOGGED",
		"ALTER TABLE " + q("_readers") + " SET LOGGED",
		"DROP TABLE IF EXISTS " + q("_epochs") + ", " + q("_epoch_now"),
		"UPDATE " + q("_session") + " SET fence = CASE name WHEN '" + plain + "'::bytea THEN 1234 ELSE 3::bigint << 40 | 7 END",
	} {
		if _, err := pool.Exec(ctx, stmt); err != nil {
			t.Fatalf("%s: %v", stmt, err)
		}
	}
	if err := a.Migrate(ctx); err != nil {
		t.Fatal(err)
	}
	for _, name := range []string{"_session", "_readers", "_epoch_now"} {
		var p string
		if err := pool.QueryRow(ctx, "SELECT relpersistence FROM pg_class WHERE oid = to_regclass($1)", q(name)).Scan(&p); err != nil {
			t.Fatal(err)
		}
		if p != "u" {
			t.Errorf("table %s has relpersistence %q after Migrate, want unlogged (u)", name, p)
		}
	}
	for k, f := range old {
		if got := acquireRetrying(t, ctx, pool, table, k); got <= f {
			t.Errorf("key %q: fence %#x after Migrate, not above its old %#x", k, got, f)
		}
	}
}

// TestAdvisoryFenceCounterLimit checks that a key whose counter reached
// 2^40-1 in its epoch is refused (and left unlocked) until a new epoch
// begins.
func TestAdvisoryFenceCounterLimit(t *testing.T) {
	pool := open(t, "")
	ctx, cancel := context.WithTimeout(context.Background(), 30*time.Second)
	defer cancel()
	table := testTable() + "_lim"
	t.Cleanup(func() { dropTablesOf(context.Background(), pool, table) })
	a := migratedAdvisory(t, ctx, pool, table)
	key := table + "/k" // advisory locks of one database are shared by every table
	f := acquireRetrying(t, ctx, pool, table, key)
	epoch := f >> 40
	session := `"` + table + `_session"`
	if _, err := pool.Exec(ctx, "UPDATE "+session+" SET fence = $1", int64(epoch<<40+1<<40-2)); err != nil {
		t.Fatal(err)
	}
	if got, want := acquireRetrying(t, ctx, pool, table, key), epoch<<40+1<<40-1; got != want {
		t.Fatalf("last fence of the epoch: %#x, want %#x", got, want)
	}
	l := dlock.New(a, nil)
	defer l.Close(ctx)
	_, err := l.TryAcquire(ctx, key)
	if !errors.Is(err, pglock.ErrFencesExhausted) {
		t.Fatalf("grant past 2^40-1 in an epoch: %v, want pglock.ErrFencesExhausted", err)
	}
	// Held by a live session (a closed Advisory's backend may still be
	// exiting, and its locks go with it).
	var holders int
	k1, k2 := pglock.AdvisoryKeys(key)
	if err := pool.QueryRow(ctx, `SELECT count(*) FROM pg_locks l JOIN pg_stat_activity a ON a.pid = l.pid
  WHERE l.locktype = 'advisory' AND l.objsubid = 2 AND l.granted
  AND l.database = (SELECT oid FROM pg_database WHERE datname = current_database())
  AND l.classid = $1::int4::oid AND l.objid = $2::int4::oid`, k1, k2).Scan(&holders); err != nil {
		t.Fatal(err)
	}
	if holders > 0 {
		t.Fatal("the refused grant left the key locked")
	}
	if _, err := pool.Exec(ctx, `TRUNCATE "`+table+`_epoch_now"`); err != nil {
		t.Fatal(err)
	}
	if got, want := acquireRetrying(t, ctx, pool, table, key), (epoch+1)<<40+1; got != want {
		t.Fatalf("first fence of the next epoch: %#x, want %#x", got, want)
	}
}
