package torture

import (
	"context"
	"os/exec"
	"strings"
	"testing"
	"time"

	"github.com/dlock-dev/dlock"
	"github.com/dlock-dev/dlock/internal/testproc"
	"github.com/dlock-dev/dlock/pglock"
	"github.com/jackc/pgx/v5/pgconn"
	"github.com/jackc/pgx/v5/pgxpool"
)

// needPGPrograms fails the test under CI=true, and skips it otherwise,
// without the PostgreSQL programs the clusters run.
func needPGPrograms(t *testing.T) {
	t.Helper()
	if _, err := exec.LookPath(pgBin("initdb")); err != nil {
		testproc.Missing(t, "PostgreSQL's initdb", "apt-get install postgresql-15, or set DLOCK_PG_BIN", err)
	}
}

// TestFailoverPGSync runs pg-lease on a pg-sync cluster failed over every
// 6 s: with a synchronous standby a failover loses no grant, so the run
// passes. It needs the MariaDB of the resource (see testDSN).
func TestFailoverPGSync(t *testing.T) {
	testproc.Short(t, "a MariaDB server and PostgreSQL clusters of its own")
	needPGPrograms(t)
	t.Parallel()
	wantPass(t, runFailover(t, "pg-sync", 15*time.Second, 6*time.Second, func(cfg *Config) {
		cfg.Strategies = []string{pgLease.Name}
		cfg.Faults, cfg.FaultEvery = []string{FaultKill, FaultStop}, 2*time.Second
	}))
}

// openAdvisory opens a Locker on pglock's advisory strategy through the
// cluster's Front.
func openAdvisory(t *testing.T, dsn string) (*dlock.Locker, *pglock.Advisory) {
	t.Helper()
	pool, err := pgxpool.New(context.Background(), dsn)
	if err != nil {
		t.Fatal(err)
	}
	adv, err := pglock.NewAdvisory(pool, nil)
	if err != nil {
		t.Fatal(err)
	}
	l := dlock.New(adv, nil)
	t.Cleanup(func() { l.Close(context.Background()); adv.Close(); pool.Close() })
	return l, adv
}

// An advisory fence granted before a failover to the synchronous standby
// is below every fence of that key granted after it, even when the grant
// that began the fence's epoch had its wait for the standby cut short by
// its caller's deadline.
func TestPGSyncAdvisoryEpochCancelledWait(t *testing.T) {
	testproc.Short(t, "PostgreSQL clusters of its own")
	t.Parallel()
	var log strings.Builder
	needPGPrograms(t)
	c := startClusterT(t, "pg-sync", &log)
	pc := c.(*pgCluster)
	var cfg Config
	c.Configure(&cfg)
	ctx := context.Background()
	l, adv := openAdvisory(t, cfg.PGDSN)
	if err := adv.Migrate(ctx); err != nil {
		t.Fatal(err)
	}
	for _, k := range []string{"a", "b"} { // each key's claim, and epoch 1
		lk, err := l.Acquire(ctx, k)
		if err != nil {
			t.Fatal(err)
		}
		if err := lk.Release(ctx); err != nil {
			t.Fatal(err)
		}
	}
	// The new primary begins an epoch at its first grant. The Locker
	// lives on, as an application does, its claims of the keys known.
	if _, _, err := c.Failover(ctx, &log); err != nil {
		t.Fatalf("failover: %v\n%s", err, log.String())
	}
	// The standby receives nothing more: commits wait for it.
	if _, err := pc.link.Toxics.AddToxicJson(strings.NewReader(`{"name":"hold","type":"timeout","stream":"downstream","attributes":{"timeout":0}}`)); err != nil {
		t.Fatal(err)
	}
	actx, cancel := context.WithTimeout(ctx, 300*time.Millisecond)
	_, err := l.Acquire(actx, "a")
	cancel()
	t.Logf("the grant that begins the epoch, with a 300 ms deadline: %v", err)
	// Its commit becomes visible on the primary once the cancel request
	// that the deadline sent arrives: the wait for the standby was
	// cancelled, not the transaction.
	conn, err := pgconn.Connect(ctx, pc.primary.dsn())
	if err != nil {
		t.Fatal(err)
	}
	defer conn.Close(ctx)
	for try := 0; ; try++ {
		res := conn.ExecParams(ctx, "SELECT epoch FROM "+pglock.DefaultTable+"_epoch_now", nil, nil, nil, nil).Read()
		if res.Err == nil && len(res.Rows) == 1 {
			break
		}
		if try == 100 {
			t.Fatalf("the epoch begun while the standby receives nothing is not visible on the primary: %v %q", res.Err, res.Rows)
		}
		time.Sleep(50 * time.Millisecond)
	}
	bctx, cancel := context.WithTimeout(ctx, 3*time.Second)
	before, err := l.Acquire(bctx, "b")
	cancel()
	if err != nil {
		t.Logf("no grant while the standby receives nothing: %v", err)
	} else {
		t.Logf("granted b fence %#x while the standby receives nothing", before.Fence())
	}
	if _, _, err := c.Failover(ctx, &log); err != nil {
		t.Fatalf("failover: %v\n%s", err, log.String())
	}
	actx, cancel = context.WithTimeout(ctx, 10*time.Second)
	after, err := l.Acquire(actx, "b")
	cancel()
	if err != nil {
		t.Fatal(err)
	}
	t.Logf("b fence %#x after the failover", after.Fence())
	if before != nil && after.Fence() <= before.Fence() {
		t.Errorf("b: fence %#x granted after the failover, %#x before it: fences must increase", after.Fence(), before.Fence())
	}
}
