package mysqllock_test

import (
	"context"
	"errors"
	"testing"
	"time"

	"github.com/dlock-dev/dlock"
	"github.com/dlock-dev/dlock/locktest"
	"github.com/dlock-dev/dlock/mysqllock"
)

// TestGaleraRefusesSessionStrategies runs each strategy on a one-node
// Galera cluster that the test starts. InnoDB row locks and named locks are
// local to a Galera node, so rowlock and getlock must refuse with ErrGalera
// (on a real cluster two clients on two nodes would both hold a key); the
// lease strategy, whose grants are replicated writes, must work.
func TestGaleraRefusesSessionStrategies(t *testing.T) {
	db := openDSN(t, startGalera(t))
	ctx := t.Context()
	var on string
	if err := db.QueryRowContext(ctx, "SELECT @@wsrep_on").Scan(&on); err != nil || on != "1" {
		t.Fatalf("the test server is not a Galera node: wsrep_on=%q, %v", on, err)
	}
	table := scoped("dlock_galera")
	lease, err := mysqllock.New(db, &mysqllock.Options{Table: table, NoDoorbell: true})
	if err != nil {
		t.Fatal(err)
	}
	defer lease.Close()
	if err := lease.Migrate(ctx); err != nil {
		t.Fatal(err)
	}
	req := func() dlock.Request {
		return dlock.Request{Key: locktest.UniqueKey("galera"), Token: dlock.NewToken(), TTL: 5 * time.Second}
	}

	// Doorbells are named locks: the lease strategy with them refuses
	// Galera instead of silently going without.
	bells, err := mysqllock.New(db, &mysqllock.Options{Table: table})
	if err != nil {
		t.Fatal(err)
	}
	defer bells.Close()
	if res, err := bells.Acquire(ctx, req()); !errors.Is(err, mysqllock.ErrGalera) || !errors.Is(err, dlock.ErrInvalidOption) {
		t.Errorf("lease with doorbells on Galera: %+v, %v; want ErrGalera and ErrInvalidOption", res, err)
	}

	row, err := mysqllock.NewRowLock(db, &mysqllock.Options{Table: table})
	if err != nil {
		t.Fatal(err)
	}
	defer row.Close()
	if res, err := row.Acquire(ctx, req()); !errors.Is(err, mysqllock.ErrGalera) {
		t.Errorf("rowlock Acquire on Galera: %+v, %v; want ErrGalera", res, err)
	}
	wctx, cancel := context.WithTimeout(ctx, 5*time.Second)
	defer cancel()
	if res, err := row.AcquireWait(wctx, req()); !errors.Is(err, mysqllock.ErrGalera) {
		t.Errorf("rowlock AcquireWait on Galera: %+v, %v; want ErrGalera", res, err)
	}

	get, err := mysqllock.NewGetLock(db, &mysqllock.Options{Table: table})
	if err != nil {
		t.Fatal(err)
	}
	defer get.Close()
	if res, err := get.Acquire(ctx, req()); !errors.Is(err, mysqllock.ErrGalera) {
		t.Errorf("getlock Acquire on Galera: %+v, %v; want ErrGalera", res, err)
	}

	for name, c := range map[string]checker{"rowlock": row, "getlock": get, "lease": lease} {
		fs, err := c.Check(ctx)
		if err != nil {
			t.Fatalf("%s: Check: %v", name, err)
		}
		found := false
		for _, f := range fs {
			found = found || f.Setting == "wsrep_on"
		}
		if want := name != "lease"; found != want {
			t.Errorf("%s: Check on Galera found %v; want a wsrep_on finding: %v", name, fs, want)
		}
	}

	l := dlock.New(lease, nil)
	defer l.Close(ctx)
	key := locktest.UniqueKey("galera-lease")
	var last uint64
	for i := range 3 {
		lk, err := l.Acquire(ctx, key, dlock.WithTTL(5*time.Second))
		if err != nil {
			t.Fatalf("lease acquisition %d on Galera: %v", i, err)
		}
		if lk.Fence() <= last {
			t.Errorf("lease fence %d after %d", lk.Fence(), last)
		}
		last = lk.Fence()
		if _, err := l.TryAcquire(ctx, key); !errors.Is(err, dlock.ErrNotAcquired) {
			t.Errorf("a second lease holder on Galera: %v", err)
		}
		if err := lk.Release(ctx); err != nil {
			t.Fatal(err)
		}
	}

	// Shared and limited holds are transactions that write the key's row,
	// which Galera certifies as it does the exclusive statement.
	sk := locktest.UniqueKey("galera-shared")
	r1, r2 := request(sk, dlock.ModeShared, 0, 5*time.Second), request(sk, dlock.ModeShared, 0, 5*time.Second)
	f1, f2 := mustGrant(t, lease, r1), mustGrant(t, lease, r2)
	if f2 <= f1 {
		t.Errorf("shared fences on Galera: %d after %d", f2, f1)
	}
	mustRefuse(t, lease, request(sk, dlock.ModeExclusive, 0, 5*time.Second))
	if _, err := lease.Acquire(ctx, request(sk, dlock.ModeLimited, 2, 5*time.Second)); !errors.Is(err, dlock.ErrModeMismatch) {
		t.Errorf("a limited request for a shared key on Galera: %v; want ErrModeMismatch", err)
	}
	if errs, err := lease.Extend(ctx, []dlock.Lease{{Key: sk, Token: r1.Token, TTL: 5 * time.Second}}); err != nil || errs[0] != nil {
		t.Errorf("Extend of a shared hold on Galera: %v, %v", errs, err)
	}
	for _, r := range []dlock.Request{r1, r2} {
		if err := lease.Release(ctx, sk, r.Token); err != nil {
			t.Fatal(err)
		}
	}
	if f := mustGrant(t, lease, request(sk, dlock.ModeExclusive, 0, 5*time.Second)); f <= f2 {
		t.Errorf("the writer's fence on Galera: %d after the readers' %d", f, f2)
	}
	if err := lease.ForceRelease(ctx, sk); err != nil {
		t.Errorf("ForceRelease on Galera: %v", err)
	}
}
