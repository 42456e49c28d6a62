package pglock_test

import (
	"context"
	"errors"
	"flag"
	"fmt"
	"net"
	"os"
	"strconv"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/dlock-dev/dlock"
	"github.com/dlock-dev/dlock/locktest"
	"github.com/dlock-dev/dlock/pglock"
	"github.com/jackc/pgx/v5/pgconn"
	"github.com/jackc/pgx/v5/pgxpool"
	"go.uber.org/goleak"
)

// envTable names the table of this test run; helper processes that locktest
// starts inherit it, so that they share the parent's tables.
const envTable = "DLOCK_PGLOCK_TEST_TABLE"

var update = flag.Bool("update", false, "rewrite testdata/*.golden")

// TestMain picks a table unique to this run (so that concurrent runs do not
// collide), drops it afterwards, and checks for leaked goroutines.
func TestMain(m *testing.M) {
	owner := os.Getenv(envTable) == ""
	if owner {
		os.Setenv(envTable, fmt.Sprintf("dlock_test_%d_%s", os.Getpid(), dlock.NewToken().String()[:8]))
	}
	code := m.Run()
	if owner {
		dropTables()
	}
	if code == 0 {
		if err := goleak.Find(); err != nil {
			fmt.Fprintf(os.Stderr, "goleak: %v\n", err)
			code = 1
		}
	}
	os.Exit(code)
}

func testTable() string { return os.Getenv(envTable) }

func dropTables() {
	ctx, cancel := context.WithTimeout(context.Background(), 10*time.Second)
	defer cancel()
	pool, err := pgxpool.New(ctx, dsn())
	if err != nil {
		return
	}
	defer pool.Close()
	dropTablesOf(ctx, pool, testTable())
}

// dropTablesOf drops the tables of table's configuration.
func dropTablesOf(ctx context.Context, pool *pgxpool.Pool, table string) {
	var names []string
	for _, suffix := range []string{"", "_waiters", "_holders", "_session", "_readers", "_epochs", "_epoch_now", "_claims"} {
		names = append(names, `"`+table+suffix+`"`)
	}
	_, _ = pool.Exec(ctx, "DROP TABLE IF EXISTS "+strings.Join(names, ", "))
}

// dsn returns the test server's DSN: $DLOCK_PG_DSN or the local PostgreSQL.
func dsn() string {
	if d := os.Getenv("DLOCK_PG_DSN"); d != "" {
		return d
	}
	return "postgres://postgres@127.0.0.1:5432/test?sslmode=disable"
}

// needServer skips the test (or fails it under CI=true) when there is no
// server, before the conformance suite starts helper processes, which would
// skip on their own and leave the suite waiting for their reports.
func needServer(t *testing.T) {
	t.Helper()
	open(t, "")
}

// openConfig returns the pool configuration of the test server.
func openConfig(t testing.TB) *pgxpool.Config {
	t.Helper()
	if testing.Short() {
		t.Skip("-short: needs a PostgreSQL server")
	}
	cfg, err := pgxpool.ParseConfig(dsn())
	if err != nil {
		t.Fatal(err)
	}
	return cfg
}

// openWith returns a new pool with cfg, closed when the test ends.
func openWith(t testing.TB, cfg *pgxpool.Config) *pgxpool.Pool {
	t.Helper()
	pool, err := pgxpool.NewWithConfig(context.Background(), cfg)
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(pool.Close)
	return pool
}

// open returns a new pool on the test server; appName, if set, names its
// connections in pg_stat_activity. Without a server the test fails under
// CI=true and is skipped otherwise.
func open(t testing.TB, appName string) *pgxpool.Pool {
	t.Helper()
	cfg := openConfig(t)
	if appName != "" {
		cfg.ConnConfig.RuntimeParams["application_name"] = appName
	}
	pool := openWith(t, cfg)
	ctx, cancel := context.WithTimeout(context.Background(), 5*time.Second)
	defer cancel()
	if err := pool.Ping(ctx); err != nil {
		if os.Getenv("CI") == "true" {
			t.Fatalf("PostgreSQL at %s is required (CI=true): %v", dsn(), err)
		}
		t.Skipf("SKIPPING: no PostgreSQL at %s (set DLOCK_PG_DSN): %v", dsn(), err)
	}
	migrateOnce.Do(func() {
		b, _ := pglock.New(pool, &pglock.Options{Table: testTable()})
		migrateErr = b.Migrate(ctx)
	})
	if migrateErr != nil {
		t.Fatal(migrateErr)
	}
	return pool
}

var (
	migrateOnce sync.Once
	migrateErr  error
)

func newLease(t testing.TB, pool *pgxpool.Pool) *pglock.Backend {
	t.Helper()
	if pool == nil {
		pool = open(t, "")
	}
	b, err := pglock.New(pool, &pglock.Options{Table: testTable()})
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { b.Close() })
	return b
}

func newAdvisory(t testing.TB, pool *pgxpool.Pool) *pglock.Advisory {
	t.Helper()
	if pool == nil {
		pool = open(t, "")
	}
	a, err := pglock.NewAdvisory(pool, &pglock.Options{Table: testTable()})
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { a.Close() })
	return a
}

func TestConformanceLease(t *testing.T) {
	needServer(t)
	locktest.Run(t, func(t *testing.T) dlock.Backend { return newLease(t, nil) },
		locktest.PoolOf(func(t *testing.T, conns int) dlock.Backend { return newLease(t, smallPool(t, conns)) }),
		proxied(t, func(t *testing.T, pool *pgxpool.Pool) dlock.Backend { return newLease(t, pool) }))
}

// proxied gives locktest.Stallable the test server's address and a way to
// build a backend whose every connection goes to another address.
func proxied(t *testing.T, build func(t *testing.T, pool *pgxpool.Pool) dlock.Backend) locktest.Option {
	cfg := openConfig(t)
	target := net.JoinHostPort(cfg.ConnConfig.Host, strconv.Itoa(int(cfg.ConnConfig.Port)))
	return locktest.Stallable(target, func(t *testing.T, addr string) dlock.Backend {
		host, port, err := net.SplitHostPort(addr)
		if err != nil {
			t.Fatal(err)
		}
		p, err := strconv.ParseUint(port, 10, 16)
		if err != nil {
			t.Fatal(err)
		}
		c := openConfig(t)
		c.ConnConfig.Host, c.ConnConfig.Port, c.ConnConfig.Fallbacks = host, uint16(p), nil
		return build(t, openWith(t, c))
	})
}

// smallPool returns a pool of at most conns connections on the test server.
func smallPool(t testing.TB, conns int) *pgxpool.Pool {
	cfg := openConfig(t)
	cfg.MaxConns = int32(conns)
	return openWith(t, cfg)
}

func TestConformanceAdvisory(t *testing.T) {
	needServer(t)
	locktest.Run(t, func(t *testing.T) dlock.Backend { return newAdvisory(t, nil) }, locktest.CrashFreesWithin(time.Second), locktest.NoRemainingHint(),
		locktest.PoolOf(func(t *testing.T, conns int) dlock.Backend { return newAdvisory(t, smallPool(t, conns)) }),
		proxied(t, func(t *testing.T, pool *pgxpool.Pool) dlock.Backend { return newAdvisory(t, pool) }))
}

// The fair-share tests run 8 processes on one key for 3 s each: no process
// may get less than half of its fair share.
func TestFairShareLease(t *testing.T) {
	needServer(t)
	locktest.FairShare(t, func(t *testing.T) dlock.Backend { return newLease(t, nil) }, 8, 3*time.Second)
}

func TestFairShareAdvisory(t *testing.T) {
	needServer(t)
	locktest.FairShare(t, func(t *testing.T) dlock.Backend { return newAdvisory(t, nil) }, 8, 3*time.Second)
}

// openTZ returns a pool whose sessions use time zone tz.
func openTZ(t *testing.T, tz string) *pgxpool.Pool {
	t.Helper()
	open(t, "") // skips without a server; migrated
	cfg, err := pgxpool.ParseConfig(dsn())
	if err != nil {
		t.Fatal(err)
	}
	cfg.ConnConfig.RuntimeParams["timezone"] = tz
	pool, err := pgxpool.NewWithConfig(context.Background(), cfg)
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(pool.Close)
	return pool
}

// TestServerClock checks that leases are timed by the server, whatever the
// session time zones of the clients.
func TestServerClock(t *testing.T) {
	ctx := context.Background()
	east := dlock.New(newLease(t, openTZ(t, "Pacific/Kiritimati")), nil) // UTC+14
	defer east.Close(ctx)
	west := dlock.New(newLease(t, openTZ(t, "Etc/GMT+12")), nil) // UTC-12
	defer west.Close(ctx)
	key := fmt.Sprintf("serverclock/%d", time.Now().UnixNano())
	lk, err := east.TryAcquire(ctx, key, dlock.WithTTL(7*time.Second))
	if err != nil {
		t.Fatal(err)
	}
	defer lk.Release(ctx)
	if _, err := west.TryAcquire(ctx, key); !errors.Is(err, dlock.ErrNotAcquired) {
		t.Fatalf("a client 26 hours of time zone away took a held lock: %v", err)
	}
	var lease, skew float64
	err = open(t, "").QueryRow(ctx, `SELECT extract(epoch FROM expires_at - acquired_at),
  abs(extract(epoch FROM acquired_at - clock_timestamp())) FROM "`+testTable()+`" WHERE name = $1`, []byte(key)).Scan(&lease, &skew)
	if err != nil {
		t.Fatal(err)
	}
	if lease != 7 {
		t.Errorf("stored lease %gs, want exactly the TTL computed by the server", lease)
	}
	if skew > 5 {
		t.Errorf("acquired_at is %gs away from the server's clock", skew)
	}
	infos, err := west.List(ctx, key)
	if err != nil || len(infos) != 1 {
		t.Fatalf("List: %v %v", infos, err)
	}
	if d := time.Until(infos[0].ExpiresAt); d <= 0 || d > 7*time.Second+time.Second {
		t.Errorf("ExpiresAt is %s away, want within the 7s lease", d)
	}
}

func TestInvalidTable(t *testing.T) {
	for _, name := range []string{"", "a;b", "a b", `"x"`, "a.b.c", "1abc", strings.Repeat("t", 51), "t-1", "ü", "a.", ".a", "x$"} {
		if name == "" {
			continue
		}
		// A nil pool: any I/O would panic.
		if _, err := pglock.New(nil, &pglock.Options{Table: name}); !errors.Is(err, dlock.ErrInvalidOption) {
			t.Errorf("New(table %q): %v, want ErrInvalidOption", name, err)
		}
		if _, err := pglock.NewAdvisory(nil, &pglock.Options{Table: name}); !errors.Is(err, dlock.ErrInvalidOption) {
			t.Errorf("NewAdvisory(table %q): %v, want ErrInvalidOption", name, err)
		}
		if _, err := pglock.Schema(name); !errors.Is(err, dlock.ErrInvalidOption) {
			t.Errorf("Schema(%q): %v, want ErrInvalidOption", name, err)
		}
	}
	if _, err := pglock.New(nil, nil); !errors.Is(err, dlock.ErrInvalidOption) {
		t.Errorf("New(nil pool): %v, want ErrInvalidOption", err)
	}
	for _, name := range []string{"locks", "app.locks", "T_1", strings.Repeat("s", 63) + "." + strings.Repeat("t", 50)} {
		if _, err := pglock.Schema(name); err != nil {
			t.Errorf("Schema(%q): %v", name, err)
		}
	}
}

func TestSchemaGolden(t *testing.T) {
	got, err := pglock.Schema("app.locks")
	if err != nil {
		t.Fatal(err)
	}
	const golden = "testdata/schema_app_locks.golden"
	if *update {
		if err := os.WriteFile(golden, []byte(got), 0o644); err != nil {
			t.Fatal(err)
		}
	}
	want, err := os.ReadFile(golden)
	if err != nil {
		t.Fatal(err)
	}
	if got != string(want) {
		t.Errorf("Schema(app.locks) differs from %s (run go test -run SchemaGolden -update):\n%s", golden, got)
	}
	def, _ := pglock.Schema("")
	file, _ := os.ReadFile("schema.sql")
	if def != string(file) {
		t.Error(`Schema("") differs from schema.sql`)
	}
}

// TestMissingColumn: tables of an earlier version, not migrated, fail
// acquisitions with ErrNoSchema.
func TestMissingColumn(t *testing.T) {
	ctx := context.Background()
	pool := open(t, "")
	table := testTable() + "_oldcols"
	b, err := pglock.New(pool, &pglock.Options{Table: table})
	if err != nil {
		t.Fatal(err)
	}
	defer b.Close()
	defer dropTablesOf(ctx, pool, table)
	if err := b.Migrate(ctx); err != nil {
		t.Fatal(err)
	}
	if _, err := pool.Exec(ctx, `ALTER TABLE "`+table+`_waiters" DROP COLUMN ttl_us`); err != nil {
		t.Fatal(err)
	}
	l := dlock.New(b, nil)
	defer l.Close(ctx)
	_, err = l.TryAcquire(ctx, "k")
	var pe *pgconn.PgError
	if !errors.Is(err, dlock.ErrNoSchema) || !errors.As(err, &pe) {
		t.Errorf("acquire on tables that lack a column: %v, want ErrNoSchema wrapping the server's error", err)
	}
}

// TestMigrateQualified runs the DDL for a schema-qualified table, twice and
// concurrently.
func TestMigrateQualified(t *testing.T) {
	ctx := context.Background()
	pool := open(t, "")
	schema := testTable() + "_schema"
	if _, err := pool.Exec(ctx, `CREATE SCHEMA IF NOT EXISTS "`+schema+`"`); err != nil {
		t.Fatal(err)
	}
	defer pool.Exec(ctx, `DROP SCHEMA "`+schema+`" CASCADE`)
	b, err := pglock.New(pool, &pglock.Options{Table: schema + ".Locks"})
	if err != nil {
		t.Fatal(err)
	}
	defer b.Close()
	var wg sync.WaitGroup
	errs := make([]error, 4)
	for i := range errs {
		wg.Add(1)
		go func() { defer wg.Done(); errs[i] = b.Migrate(ctx) }()
	}
	wg.Wait()
	if err := errors.Join(errs...); err != nil {
		t.Fatal(err)
	}
	l := dlock.New(b, nil)
	defer l.Close(ctx)
	lk, err := l.TryAcquire(ctx, "k")
	if err != nil {
		t.Fatal(err)
	}
	lk.Release(ctx)
}

func TestMissingTable(t *testing.T) {
	pool := open(t, "")
	opts := &pglock.Options{Table: "dlock_no_such_table"}
	b, _ := pglock.New(pool, opts)
	defer b.Close()
	a, _ := pglock.NewAdvisory(pool, opts)
	defer a.Close()
	for name, be := range map[string]dlock.Backend{"lease": b, "advisory": a} {
		l := dlock.New(be, nil)
		_, err := l.TryAcquire(context.Background(), "k")
		var pe *pgconn.PgError
		if !errors.Is(err, dlock.ErrNoSchema) || !errors.As(err, &pe) || errors.Is(err, dlock.ErrNotAcquired) {
			t.Errorf("%s: acquire on a missing table: %v, want ErrNoSchema wrapping the server's error", name, err)
		}
		l.Close(context.Background())
	}
}

// TestDatabaseDown checks that an unreachable server is an error that wraps
// the driver's, never "acquired" or "not acquired".
func TestDatabaseDown(t *testing.T) {
	pool, err := pgxpool.New(context.Background(), "postgres://postgres@127.0.0.1:1/test?sslmode=disable&connect_timeout=1")
	if err != nil {
		t.Fatal(err)
	}
	defer pool.Close()
	b, _ := pglock.New(pool, &pglock.Options{Table: testTable()})
	defer b.Close()
	a, _ := pglock.NewAdvisory(pool, &pglock.Options{Table: testTable()})
	defer a.Close()
	for name, be := range map[string]dlock.Backend{"lease": b, "advisory": a} {
		l := dlock.New(be, nil)
		ctx, cancel := context.WithTimeout(context.Background(), 10*time.Second)
		for _, acquire := range []func(context.Context, string, ...dlock.AcquireOption) (*dlock.Lock, error){l.TryAcquire, l.Acquire} {
			lk, err := acquire(ctx, "down")
			if lk != nil || err == nil || errors.Is(err, dlock.ErrNotAcquired) || !strings.Contains(err.Error(), "connect") {
				t.Errorf("%s: database down: %v, %v; want the driver's connection error", name, lk, err)
			}
		}
		cancel()
		l.Close(context.Background())
	}
}

// terminate ends every server session of the pool named app.
func terminate(t *testing.T, admin *pgxpool.Pool, app string) int {
	t.Helper()
	var n int
	err := admin.QueryRow(context.Background(),
		"SELECT count(*) FROM (SELECT pg_terminate_backend(pid, 5000) FROM pg_stat_activity WHERE application_name = $1) x", app).Scan(&n)
	if err != nil {
		t.Fatal(err)
	}
	return n
}

// TestLeaseConnectionsTerminated cuts every connection of a client from the
// server side while it holds a lease: renewal goes on over new connections,
// and the lock is kept.
func TestLeaseConnectionsTerminated(t *testing.T) {
	ctx := context.Background()
	admin := open(t, "")
	app := "dlock_victim_" + dlock.NewToken().String()[:8]
	l := dlock.New(newLease(t, open(t, app)), nil)
	defer l.Close(ctx)
	key := fmt.Sprintf("terminated/%d", time.Now().UnixNano())
	lk, err := l.TryAcquire(ctx, key, dlock.WithTTL(time.Second))
	if err != nil {
		t.Fatal(err)
	}
	killed := 0
	for range 6 {
		killed += terminate(t, admin, app)
		time.Sleep(250 * time.Millisecond)
	}
	if killed == 0 {
		t.Fatal("found no connection to terminate")
	}
	if err := lk.Err(); err != nil {
		t.Errorf("lease lost after its connections were cut (%d terminated): %v", killed, err)
	}
	if err := lk.Release(ctx); err != nil {
		t.Errorf("release after cut connections: %v", err)
	}
}

// TestAdvisorySessionTerminated terminates the holder's session: the lock is
// free at once and the holder is told.
func TestAdvisorySessionTerminated(t *testing.T) {
	ctx := context.Background()
	admin := open(t, "")
	app := "dlock_victim_" + dlock.NewToken().String()[:8]
	l := dlock.New(newAdvisory(t, open(t, app)), nil)
	defer l.Close(ctx)
	other := dlock.New(newAdvisory(t, nil), nil)
	defer other.Close(ctx)
	key := fmt.Sprintf("terminated/%d", time.Now().UnixNano())
	lk, err := l.TryAcquire(ctx, key, dlock.WithTTL(3*time.Second))
	if err != nil {
		t.Fatal(err)
	}
	if n := terminate(t, admin, app); n == 0 {
		t.Fatal("found no connection to terminate")
	}
	lk2, err := other.TryAcquire(ctx, key)
	if err != nil {
		t.Fatalf("the terminated holder's lock is not free: %v", err)
	}
	defer lk2.Release(ctx)
	select {
	case <-lk.Done():
	case <-time.After(3 * time.Second):
		t.Fatal("the holder was not told that its session was terminated")
	}
	if !errors.Is(lk.Err(), dlock.ErrLockLost) {
		t.Errorf("Err: %v, want ErrLockLost", lk.Err())
	}
	// The Locker recovers on a new session.
	k2 := key + "/2"
	lk3, err := l.TryAcquire(ctx, k2)
	if err != nil {
		t.Fatalf("no recovery after the session was terminated: %v", err)
	}
	lk3.Release(ctx)
}

// TestAdvisoryGrantOnLostSession: an acquisition picked the main session,
// and a renewal on that session found it lost and discarded it before the
// acquisition ran its statement. The grant must fail as a lost session (and
// Acquire then retry on a new one), not dereference the discarded
// connection. Found by the torture harness (pg-advisory: a holder resumed
// after SIGSTOP, its renewal found the session ended by
// idle_session_timeout while its next Acquire had picked that session; the
// worker panicked in grant).
func TestAdvisoryGrantOnLostSession(t *testing.T) {
	ctx := context.Background()
	a := newAdvisory(t, nil)
	req := dlock.Request{Key: fmt.Sprintf("lostsession/%d", time.Now().UnixNano()), Token: dlock.NewToken(), TTL: time.Second}
	ok, _, err := pglock.GrantAfterSessionLoss(ctx, a, req)
	if ok || err == nil {
		t.Fatalf("grant on a discarded session: ok %v, err %v; want an error", ok, err)
	}
	res, err := a.Acquire(ctx, req)
	if err != nil || !res.Acquired {
		t.Fatalf("no recovery on a new session: %+v, %v", res, err)
	}
	if err := a.Release(ctx, req.Key, req.Token); err != nil {
		t.Fatal(err)
	}
}

// TestAdvisoryWaiterGrantedDuringRelease: Release unlocks at the server,
// then updates its books; a goroutine of the same Advisory waiting in the
// server for the key is granted in between. The grant is valid (the server
// freed the lock) and must be taken, not refused as "granted twice in one
// process"; the releasing hold's bookkeeping must not touch the new one.
// (Found by the conformance suite's ExclusionAmongGoroutines, now and then.)
func TestAdvisoryWaiterGrantedDuringRelease(t *testing.T) {
	ctx := context.Background()
	a := newAdvisory(t, nil)
	key := fmt.Sprintf("releasing/%d", time.Now().UnixNano())
	held := dlock.Request{Key: key, Token: dlock.NewToken(), TTL: time.Second}
	if res, err := a.Acquire(ctx, held); err != nil || !res.Acquired {
		t.Fatalf("acquire: %+v, %v", res, err)
	}
	waiter := dlock.Request{Key: key, Token: dlock.NewToken(), TTL: time.Second}
	type outcome struct {
		res dlock.Result
		err error
	}
	got := make(chan outcome, 1)
	go func() {
		wctx, cancel := context.WithTimeout(ctx, 10*time.Second)
		defer cancel()
		res, err := a.AcquireWait(wctx, waiter)
		got <- outcome{res, err}
	}()
	// The waiter must be waiting in the server before the release.
	admin := open(t, "")
	k1, k2 := pglock.AdvisoryKeys(key)
	for i := 0; ; i++ {
		var n int
		err := admin.QueryRow(ctx, `SELECT count(*) FROM pg_locks WHERE locktype = 'advisory' AND NOT granted
  AND objsubid = 2 AND classid = $1::int4::oid AND objid = $2::int4::oid`, k1, k2).Scan(&n)
		if err != nil {
			t.Fatal(err)
		}
		if n == 1 {
			break
		}
		if i == 500 {
			t.Fatal("the waiter never waited in the server")
		}
		time.Sleep(10 * time.Millisecond)
	}
	var during outcome
	pglock.SetAfterUnlock(a, func() { during = <-got })
	if err := a.Release(ctx, key, held.Token); err != nil {
		t.Fatalf("release: %v", err)
	}
	pglock.SetAfterUnlock(a, nil)
	if during.err != nil || !during.res.Acquired {
		t.Fatalf("waiter granted by the server between the holder's unlock and its bookkeeping: %+v, %v; want acquired", during.res, during.err)
	}
	// The waiter holds it, on the books and at the server.
	if err := a.Release(ctx, key, held.Token); !errors.Is(err, dlock.ErrNotHeld) {
		t.Errorf("second release of the old hold: %v, want ErrNotHeld", err)
	}
	if res, err := a.Acquire(ctx, dlock.Request{Key: key, Token: dlock.NewToken(), TTL: time.Second}); err != nil || res.Acquired {
		t.Errorf("key taken again while the waiter holds it: %+v, %v", res, err)
	}
	if err := a.Release(ctx, key, waiter.Token); err != nil {
		t.Fatalf("waiter's release: %v", err)
	}
	counts, n := pglock.SessionCounts(a)
	for _, c := range counts {
		if c != 0 {
			t.Errorf("a session still counts %d holds after every release (all: %v)", c, counts)
		}
	}
	if n != 0 {
		t.Errorf("%d holds left on the books", n)
	}
}

// TestWaiterWokenByRelease checks that a waiter gets a key released by
// another client long before the holder's lease would have run out (the
// lease strategy's NOTIFY; the advisory strategy's server-side wait).
func TestWaiterWokenByRelease(t *testing.T) {
	for name, nb := range map[string]func(t *testing.T) dlock.Backend{
		"lease":    func(t *testing.T) dlock.Backend { return newLease(t, nil) },
		"advisory": func(t *testing.T) dlock.Backend { return newAdvisory(t, nil) },
	} {
		t.Run(name, func(t *testing.T) {
			ctx := context.Background()
			a := dlock.New(nb(t), nil)
			defer a.Close(ctx)
			b := dlock.New(nb(t), nil)
			defer b.Close(ctx)
			key := fmt.Sprintf("wake/%s/%d", name, time.Now().UnixNano())
			lk, err := a.TryAcquire(ctx, key, dlock.WithTTL(60*time.Second))
			if err != nil {
				t.Fatal(err)
			}
			time.AfterFunc(500*time.Millisecond, func() { lk.Release(ctx) })
			wctx, cancel := context.WithTimeout(ctx, 20*time.Second)
			defer cancel()
			w, err := b.Acquire(wctx, key)
			if err != nil {
				t.Fatalf("the waiter was not handed the released key (its holder's lease had 60s left): %v", err)
			}
			w.Release(ctx)
		})
	}
}

// TestCancelledWaitLeavesNoGrant races a wait's cancellation with the
// holder's release: whichever wins (and whether the release handed the key
// to the wait), the key is free soon after, not held for the wait's TTL.
func TestCancelledWaitLeavesNoGrant(t *testing.T) {
	type waiter interface {
		dlock.Backend
		dlock.Waiter
	}
	for name, nb := range map[string]func(t *testing.T) waiter{
		"lease":    func(t *testing.T) waiter { return newLease(t, nil) },
		"advisory": func(t *testing.T) waiter { return newAdvisory(t, nil) },
	} {
		t.Run(name, func(t *testing.T) {
			ctx := context.Background()
			holder, waiter := nb(t), nb(t)
			third := dlock.New(nb(t), nil)
			defer third.Close(ctx)
			key := fmt.Sprintf("cancelwait/%s/%d", name, time.Now().UnixNano())
			for i := range 8 {
				tok := dlock.NewToken()
				r, err := holder.Acquire(ctx, dlock.Request{Key: key, Token: tok, TTL: time.Minute})
				if err != nil || !r.Acquired {
					t.Fatalf("holder: %+v %v", r, err)
				}
				wctx, cancel := context.WithCancel(ctx)
				done := make(chan dlock.Result, 1)
				wtok := dlock.NewToken()
				go func() {
					r, err := waiter.AcquireWait(wctx, dlock.Request{Key: key, Token: wtok, TTL: time.Minute})
					if err != nil {
						t.Error(err)
					}
					done <- r
				}()
				time.Sleep(100 * time.Millisecond)
				time.AfterFunc(time.Duration(i)*time.Millisecond, cancel)
				if err := holder.Release(ctx, key, tok); err != nil {
					t.Fatal(err)
				}
				if r := <-done; r.Acquired { // the release won: a proper grant
					if err := waiter.Release(ctx, key, wtok); err != nil {
						t.Fatal(err)
					}
				}
				cancel()
				// The key is free (a closed session's lock is freed as the
				// server notices, within moments).
				tctx, tcancel := context.WithTimeout(ctx, 5*time.Second)
				lk, err := third.Acquire(tctx, key)
				tcancel()
				if err != nil {
					t.Fatalf("round %d: a cancelled wait left the key held: %v", i, err)
				}
				if err := lk.Release(ctx); err != nil {
					t.Fatal(err)
				}
			}
		})
	}
}

// TestAdvisoryKeys pins the key hashing, which other tools may rely on to
// find dlock's locks in pg_locks.
func TestAdvisoryKeys(t *testing.T) {
	a1, b1 := pglock.AdvisoryKeys("invoice:42")
	a2, b2 := pglock.AdvisoryKeys("invoice:42")
	a3, b3 := pglock.AdvisoryKeys("invoice:43")
	if a1 != a2 || b1 != b2 {
		t.Error("AdvisoryKeys is not deterministic")
	}
	if a1 == a3 && b1 == b3 {
		t.Error("distinct keys hash alike")
	}
}

// TestExtendRacingReleaseDoesNotRevive: a renewal of two leases starts,
// then waits for the first one's row (held by another transaction); the
// second lease is released meanwhile, at an instant later than the
// renewal's start. When the renewal reaches the second row it must see the
// release: a renewal that rechecked "still live" against its own start time
// found the released lease live and renewed it for a holder that had let it
// go (the fault harness's long run saw it once: "expired lease extended").
func TestExtendRacingReleaseDoesNotRevive(t *testing.T) {
	ctx, cancel := context.WithTimeout(context.Background(), 30*time.Second)
	defer cancel()
	pool := open(t, "")
	b := newLease(t, pool)
	base := fmt.Sprintf("revive/%d", time.Now().UnixNano())
	leases := []dlock.Lease{
		{Key: base + "/a", Token: dlock.NewToken(), TTL: 10 * time.Second},
		{Key: base + "/b", Token: dlock.NewToken(), TTL: 10 * time.Second},
	}
	for _, l := range leases {
		if res, err := b.Acquire(ctx, dlock.Request{Key: l.Key, Token: l.Token, TTL: l.TTL}); err != nil || !res.Acquired {
			t.Fatalf("Acquire: %+v %v", res, err)
		}
	}
	table := `"` + testTable() + `"`
	tx, err := pool.Begin(ctx)
	if err != nil {
		t.Fatal(err)
	}
	defer tx.Rollback(ctx)
	if _, err := tx.Exec(ctx, `SELECT FROM `+table+` WHERE name = $1 FOR UPDATE`, []byte(leases[0].Key)); err != nil {
		t.Fatal(err)
	}
	type extended struct {
		errs []error
		err  error
	}
	renewed := make(chan extended, 1)
	go func() {
		errs, err := b.Extend(ctx, leases)
		renewed <- extended{errs, err}
	}()
	for i := 0; ; i++ { // until the renewal waits for the first row
		var n int
		if err := pool.QueryRow(ctx, `SELECT count(*) FROM pg_stat_activity
WHERE wait_event_type = 'Lock' AND datname = current_database() AND query LIKE '%' || $1 || '%'`, table).Scan(&n); err != nil {
			t.Fatal(err)
		}
		if n > 0 {
			break
		}
		if i == 500 {
			t.Fatal("the renewal never waited for the row")
		}
		time.Sleep(10 * time.Millisecond)
	}
	if err := b.Release(ctx, leases[1].Key, leases[1].Token); err != nil {
		t.Fatalf("Release: %v", err)
	}
	if err := tx.Commit(ctx); err != nil {
		t.Fatal(err)
	}
	r := <-renewed
	if r.err != nil || len(r.errs) != 2 || r.errs[0] != nil || !errors.Is(r.errs[1], dlock.ErrNotHeld) {
		t.Errorf("renewal of a held lease and of one released while it waited: %v %v, want [nil ErrNotHeld]", r.errs, r.err)
	}
	var live bool
	if err := pool.QueryRow(ctx, `SELECT expires_at > clock_timestamp() FROM `+table+` WHERE name = $1`, []byte(leases[1].Key)).Scan(&live); err != nil {
		t.Fatal(err)
	}
	if live {
		t.Error("the released lease is live again")
	}
}

// TestAbandonedWaitLeavesTheQueue: a waiter whose caller leaves while its
// acquisition statement runs (a caller's deadline of a few milliseconds)
// must not stay in the key's waiter queue: a live entry ahead of the real
// waiters is named by every release, and they wait out the grace period
// each time, for as long as the entry lives (waitStep + waitSlack).
func TestAbandonedWaitLeavesTheQueue(t *testing.T) {
	ctx := t.Context()
	pool := open(t, "")
	b := newLease(t, pool)
	if err := b.Migrate(ctx); err != nil {
		t.Fatal(err)
	}
	key := locktest.UniqueKey("abandoned-wait")
	holder := locktest.NewLocker(t, b)
	lk, err := holder.Acquire(ctx, key, dlock.WithTTL(30*time.Second))
	if err != nil {
		t.Fatal(err)
	}
	defer lk.Release(context.Background())
	waiter := locktest.NewLocker(t, newLease(t, nil))
	for i := range 200 {
		wctx, cancel := context.WithTimeout(ctx, time.Duration(i%6)*time.Millisecond)
		if _, err := waiter.Acquire(wctx, key, dlock.WithTTL(30*time.Second)); !errors.Is(err, dlock.ErrNotAcquired) {
			t.Fatalf("Acquire of a held key with a short deadline: %v", err)
		}
		cancel()
	}
	live := func() (n int) {
		t.Helper()
		err := pool.QueryRow(ctx, fmt.Sprintf(`SELECT count(*) FROM "%s_waiters" WHERE name = $1 AND until > clock_timestamp()`, testTable()),
			[]byte(key)).Scan(&n)
		if err != nil {
			t.Fatal(err)
		}
		return n
	}
	// What the callers left behind is settled once their statements end.
	n := live()
	for deadline := time.Now().Add(3 * time.Second); n > 0 && time.Now().Before(deadline); n = live() {
		time.Sleep(50 * time.Millisecond)
	}
	if n > 0 {
		t.Errorf("rule: a waiter that left is not in the queue; %d entries of callers that left are still live", n)
	}
}
