package pglock_test

import (
	"context"
	"errors"
	"fmt"
	"net"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/dlock-dev/dlock"
	"github.com/dlock-dev/dlock/pglock"
	"github.com/jackc/pgx/v5/pgxpool"
)

// stillHeld fails the test unless lk is still held: its Err is nil and
// another Advisory (its own sessions) cannot take the key.
func stillHeld(t *testing.T, lk *dlock.Lock, what string) {
	t.Helper()
	if err := lk.Err(); err != nil {
		t.Fatalf("%s: the held lock reports %v", what, err)
	}
	other := dlock.New(newAdvisory(t, nil), nil)
	defer other.Close(context.Background())
	if lk2, err := other.TryAcquire(context.Background(), lk.Key()); err == nil {
		lk2.Release(context.Background())
		t.Fatalf("%s: another client took the key of a lock whose holder still believes it holds it", what)
	} else if !errors.Is(err, dlock.ErrNotAcquired) {
		t.Fatalf("%s: %v", what, err)
	}
}

// TestAdvisoryExpiredReleaseKeepsOthers releases one lock with a context
// that has already ended while another lock of the same Advisory (the same
// server session) is held: the other lock must stay held.
func TestAdvisoryExpiredReleaseKeepsOthers(t *testing.T) {
	ctx := context.Background()
	l := dlock.New(newAdvisory(t, nil), nil)
	defer l.Close(ctx)
	base := fmt.Sprintf("expiredrelease/%d", time.Now().UnixNano())
	keep, err := l.TryAcquire(ctx, base+"/keep", dlock.WithTTL(time.Minute))
	if err != nil {
		t.Fatal(err)
	}
	defer keep.Release(ctx)
	for i := range 20 {
		lk, err := l.TryAcquire(ctx, fmt.Sprintf("%s/%d", base, i), dlock.WithTTL(time.Minute))
		if err != nil {
			t.Fatal(err)
		}
		dead, cancel := context.WithDeadline(ctx, time.Now().Add(-time.Second))
		lk.Release(dead)
		cancel()
		// The lock released with an ended context is freed all the same
		// (an advisory lock has no TTL that would end it otherwise).
		other := dlock.New(newAdvisory(t, nil), nil)
		wctx, wcancel := context.WithTimeout(ctx, 10*time.Second)
		lk2, err := other.Acquire(wctx, lk.Key())
		wcancel()
		if err != nil {
			t.Fatalf("a lock released with an ended context stayed held: %v", err)
		}
		lk2.Release(ctx)
		other.Close(ctx)
	}
	stillHeld(t, keep, "after releases with ended contexts")
}

// TestAdvisoryShortDeadlinesKeepOthers makes hundreds of acquisitions with
// deadlines of 1–5 ms, on keys free and held, while a lock of the same
// Advisory is held: none of them may end the session that holds it.
func TestAdvisoryShortDeadlinesKeepOthers(t *testing.T) {
	ctx := context.Background()
	a := newAdvisory(t, nil)
	l := dlock.New(a, nil)
	defer l.Close(ctx)
	other := dlock.New(newAdvisory(t, nil), nil)
	defer other.Close(ctx)
	base := fmt.Sprintf("shortdeadline/%d", time.Now().UnixNano())
	keep, err := l.TryAcquire(ctx, base+"/keep", dlock.WithTTL(time.Minute))
	if err != nil {
		t.Fatal(err)
	}
	defer keep.Release(ctx)
	busy, err := other.TryAcquire(ctx, base+"/busy", dlock.WithTTL(time.Minute))
	if err != nil {
		t.Fatal(err)
	}
	defer busy.Release(ctx)
	var wg sync.WaitGroup
	var got atomic.Int64
	for w := range 4 {
		wg.Add(1)
		go func() {
			defer wg.Done()
			for i := range 60 {
				d := time.Duration(1+(i+w)%5) * time.Millisecond
				cctx, cancel := context.WithTimeout(ctx, d)
				key := fmt.Sprintf("%s/%d/%d", base, w, i%3)
				if i%4 == 0 {
					key = base + "/busy"
				}
				var lk *dlock.Lock
				var err error
				if i%2 == 0 {
					lk, err = l.TryAcquire(cctx, key)
				} else {
					lk, err = l.Acquire(cctx, key)
				}
				if err == nil {
					got.Add(1)
					rctx, rcancel := context.WithTimeout(ctx, d)
					lk.Release(rctx)
					rcancel()
				}
				cancel()
			}
		}()
	}
	wg.Wait()
	t.Logf("%d of 240 short-deadline acquisitions succeeded", got.Load())
	stillHeld(t, keep, "after acquisitions with 1–5 ms deadlines")
}

// TestAdvisoryStuckGrantKeepsSession makes a grant statement on the shared
// session wait for its fencing row (locked by another transaction) beyond
// the caller's deadline and beyond 10 s: the caller must get its error at
// its deadline, the session and its other locks must survive, and the grant
// that completes after the caller left must be undone.
func TestAdvisoryStuckGrantKeepsSession(t *testing.T) {
	if testing.Short() {
		t.Skip("blocks for 12 s")
	}
	ctx := context.Background()
	pool := open(t, "")
	l := dlock.New(newAdvisory(t, nil), nil)
	defer l.Close(ctx)
	base := fmt.Sprintf("stuckgrant/%d", time.Now().UnixNano())
	keep, err := l.TryAcquire(ctx, base+"/keep", dlock.WithTTL(time.Minute))
	if err != nil {
		t.Fatal(err)
	}
	defer keep.Release(ctx)
	stuck := base + "/stuck"
	lk, err := l.TryAcquire(ctx, stuck) // creates the fencing row
	if err != nil {
		t.Fatal(err)
	}
	lk.Release(ctx)
	tx, err := pool.Begin(ctx)
	if err != nil {
		t.Fatal(err)
	}
	defer tx.Rollback(ctx)
	if _, err := tx.Exec(ctx, `SELECT FROM "`+testTable()+`_session" WHERE name = $1 FOR UPDATE`, []byte(stuck)); err != nil {
		t.Fatal(err)
	}
	cctx, cancel := context.WithTimeout(ctx, 500*time.Millisecond)
	began := time.Now()
	_, err = l.TryAcquire(cctx, stuck)
	returned := time.Since(began)
	cancel()
	if err == nil {
		t.Fatal("acquired a key whose fencing row could not be written")
	}
	if returned > 5*time.Second {
		t.Errorf("TryAcquire with a 500ms deadline returned after %s (%v)", returned, err)
	}
	time.Sleep(12*time.Second - time.Since(began))
	stillHeld(t, keep, "while a grant statement was stuck past its caller's deadline")
	if err := tx.Rollback(ctx); err != nil {
		t.Fatal(err)
	}
	// The grant completes now, for nobody: it must be undone.
	other := dlock.New(newAdvisory(t, nil), nil)
	defer other.Close(ctx)
	wctx, wcancel := context.WithTimeout(ctx, 10*time.Second)
	defer wcancel()
	lk2, err := other.Acquire(wctx, stuck)
	if err != nil {
		t.Fatalf("the grant that completed after its caller left still holds the key: %v", err)
	}
	lk2.Release(ctx)
	stillHeld(t, keep, "after the stuck grant completed")
}

// TestAdvisoryTerminatedSessionReportsAll ends the server session that holds
// several locks: every one of them must be reported lost at once, not at
// its next renewal (a minute's TTL renews every 20 s).
func TestAdvisoryTerminatedSessionReportsAll(t *testing.T) {
	ctx := context.Background()
	admin := open(t, "")
	app := "dlock_victim_" + dlock.NewToken().String()[:8]
	l := dlock.New(newAdvisory(t, open(t, app)), nil)
	defer l.Close(ctx)
	base := fmt.Sprintf("terminateall/%d", time.Now().UnixNano())
	var locks []*dlock.Lock
	for i := range 5 {
		lk, err := l.TryAcquire(ctx, fmt.Sprintf("%s/%d", base, i), dlock.WithTTL(time.Minute))
		if err != nil {
			t.Fatal(err)
		}
		locks = append(locks, lk)
	}
	if n := terminate(t, admin, app); n == 0 {
		t.Fatal("found no session to terminate")
	}
	deadline := time.After(10 * time.Second)
	for _, lk := range locks {
		select {
		case <-lk.Done():
		case <-deadline:
			t.Fatalf("%s: not told within 10 s that its session was terminated (Err %v)", lk.Key(), lk.Err())
		}
		if !errors.Is(lk.Err(), dlock.ErrLockLost) {
			t.Errorf("%s: Err %v, want ErrLockLost", lk.Key(), lk.Err())
		}
	}
}

// TestSmallPools runs both strategies over pools of 1, 2 and 3 connections:
// acquisition, release, contention and handoffs among three waiters must
// all complete.
func TestSmallPools(t *testing.T) {
	open(t, "") // skips without a server; migrated
	for _, size := range []int{1, 2, 3} {
		for name, nb := range map[string]func(t *testing.T, p *pgxpool.Pool) dlock.Backend{
			"lease":    func(t *testing.T, p *pgxpool.Pool) dlock.Backend { return newLease(t, p) },
			"advisory": func(t *testing.T, p *pgxpool.Pool) dlock.Backend { return newAdvisory(t, p) },
		} {
			t.Run(fmt.Sprintf("%s/%d", name, size), func(t *testing.T) {
				ctx, cancel := context.WithTimeout(context.Background(), 60*time.Second)
				defer cancel()
				cfg, err := pgxpool.ParseConfig(dsn())
				if err != nil {
					t.Fatal(err)
				}
				cfg.MaxConns = int32(size)
				pool, err := pgxpool.NewWithConfig(ctx, cfg)
				if err != nil {
					t.Fatal(err)
				}
				defer func() {
					// Close waits for every connection to come back.
					closed := make(chan struct{})
					go func() { pool.Close(); close(closed) }()
					select {
					case <-closed:
					case <-time.After(10 * time.Second):
						t.Error("a connection of the pool stayed checked out after every lock was released")
					}
				}()
				l := dlock.New(nb(t, pool), nil)
				defer l.Close(context.Background())
				key := fmt.Sprintf("smallpool/%s/%d/%d", name, size, time.Now().UnixNano())
				lk, err := l.TryAcquire(ctx, key, dlock.WithTTL(5*time.Second))
				if err != nil {
					t.Fatalf("acquire: %v", err)
				}
				if _, err := l.TryAcquire(ctx, key, dlock.WithOwner("x")); !errors.Is(err, dlock.ErrNotAcquired) {
					t.Fatalf("contention: %v", err)
				}
				if err := lk.Release(ctx); err != nil {
					t.Fatalf("release: %v", err)
				}
				// Three waiters on Lockers of their own over the same pool,
				// each holding the key briefly: every one gets it.
				hold, err := l.TryAcquire(ctx, key, dlock.WithTTL(5*time.Second))
				if err != nil {
					t.Fatal(err)
				}
				var wg sync.WaitGroup
				var inside, handoffs atomic.Int32
				errs := make(chan error, 3)
				for range 3 {
					wl := dlock.New(nb(t, pool), nil)
					defer wl.Close(context.Background())
					wg.Add(1)
					go func() {
						defer wg.Done()
						w, err := wl.Acquire(ctx, key, dlock.WithTTL(5*time.Second))
						if err != nil {
							errs <- err
							return
						}
						if inside.Add(1) != 1 {
							errs <- errors.New("two holders at once")
						}
						time.Sleep(20 * time.Millisecond)
						inside.Add(-1)
						handoffs.Add(1)
						if err := w.Release(ctx); err != nil {
							errs <- err
						}
					}()
				}
				time.Sleep(200 * time.Millisecond)
				if err := hold.Release(ctx); err != nil {
					t.Fatal(err)
				}
				wg.Wait()
				close(errs)
				for err := range errs {
					t.Errorf("waiter: %v", err)
				}
				if handoffs.Load() != 3 {
					t.Errorf("%d of 3 waiters got the key", handoffs.Load())
				}
			})
		}
	}
}

// TestAdvisoryLongTTL takes advisory locks with TTLs beyond what
// idle_session_timeout (int milliseconds, at most 24.8 days) can express:
// any TTL dlock accepts works, on both strategies.
func TestAdvisoryLongTTL(t *testing.T) {
	ctx, cancel := context.WithTimeout(context.Background(), 30*time.Second)
	defer cancel()
	l := dlock.New(newAdvisory(t, nil), nil)
	defer l.Close(ctx)
	for _, ttl := range []time.Duration{24 * time.Hour * 24, 25 * 24 * time.Hour, 365 * 24 * time.Hour, 100 * 365 * 24 * time.Hour} {
		key := fmt.Sprintf("longttl/%d/%s", time.Now().UnixNano(), ttl)
		lk, err := l.TryAcquire(ctx, key, dlock.WithTTL(ttl))
		if err != nil {
			t.Errorf("TTL %s: %v", ttl, err)
			continue
		}
		stillHeld(t, lk, "TTL "+ttl.String())
		if err := lk.Release(ctx); err != nil {
			t.Errorf("TTL %s: release: %v", ttl, err)
		}
	}
	// The lease strategy takes them too.
	ll := dlock.New(newLease(t, nil), nil)
	defer ll.Close(ctx)
	lk, err := ll.TryAcquire(ctx, fmt.Sprintf("longttl/%d/lease", time.Now().UnixNano()), dlock.WithTTL(100*365*24*time.Hour))
	if err != nil {
		t.Fatalf("lease, TTL of 100 years: %v", err)
	}
	if err := lk.Release(ctx); err != nil {
		t.Errorf("lease, TTL of 100 years: release: %v", err)
	}
}

// TestLongestTableName migrates and uses the longest table name accepted:
// every derived name must fit PostgreSQL's identifier limit.
func TestLongestTableName(t *testing.T) {
	ctx := context.Background()
	pool := open(t, "")
	table := testTable()
	name := table + "_" + string(make([]byte, 0))
	for len(name) < 50 {
		name += "x"
	}
	name = name[:50]
	opts := &pglock.Options{Table: name}
	b, err := pglock.New(pool, opts)
	if err != nil {
		t.Fatal(err)
	}
	defer b.Close()
	defer dropTablesOf(ctx, pool, name)
	if err := b.Migrate(ctx); err != nil {
		t.Fatal(err)
	}
	a, _ := pglock.NewAdvisory(pool, opts)
	defer a.Close()
	for i, be := range []dlock.Backend{b, a} {
		l := dlock.New(be, nil)
		lk, err := l.TryAcquire(ctx, fmt.Sprint("k", i)) // a key per strategy
		if err != nil {
			t.Fatal(err)
		}
		lk.Release(ctx)
		l.Close(ctx)
	}
}

// TestLeaseAbandonedAcquireLeavesKeyFree makes an acquisition statement wait
// for its row (locked by another transaction) past its caller's deadline,
// on a network where no new connection gets through (so that a cancel
// request cannot reach the server). When the row is unlocked the statement
// could still take the lease, after its caller was told it failed and after
// the Locker's resolution found nothing to release: the key would then be
// held by nobody until its TTL. It must end free.
func TestLeaseAbandonedAcquireLeavesKeyFree(t *testing.T) {
	ctx := context.Background()
	pool := open(t, "")
	cfg := openConfig(t)
	var cut atomic.Bool
	dialer := &net.Dialer{KeepAlive: time.Minute}
	cfg.ConnConfig.DialFunc = func(ctx context.Context, network, addr string) (net.Conn, error) {
		if cut.Load() {
			return nil, errors.New("test: no new connections")
		}
		return dialer.DialContext(ctx, network, addr)
	}
	cfg.MinConns = 3
	victim := openWith(t, cfg)
	for i := 0; victim.Stat().IdleConns() < 3; i++ { // connections for the statement and the resolution
		if i == 500 {
			t.Fatal("the pool did not open its connections")
		}
		time.Sleep(10 * time.Millisecond)
	}
	l := dlock.New(newLease(t, victim), nil)
	defer l.Close(ctx)
	key := fmt.Sprintf("abandoned/%d", time.Now().UnixNano())
	lk, err := l.TryAcquire(ctx, key) // creates the row
	if err != nil {
		t.Fatal(err)
	}
	lk.Release(ctx)
	tx, err := pool.Begin(ctx)
	if err != nil {
		t.Fatal(err)
	}
	defer tx.Rollback(ctx)
	if _, err := tx.Exec(ctx, `SELECT FROM "`+testTable()+`" WHERE name = $1 FOR UPDATE`, []byte(key)); err != nil {
		t.Fatal(err)
	}
	cut.Store(true)
	cctx, cancel := context.WithTimeout(ctx, 300*time.Millisecond)
	_, err = l.TryAcquire(cctx, key, dlock.WithTTL(time.Minute))
	cancel()
	if err == nil {
		t.Fatal("acquired a key whose row was locked")
	}
	time.Sleep(200 * time.Millisecond) // the Locker's resolution has run
	if err := tx.Rollback(ctx); err != nil {
		t.Fatal(err)
	}
	cut.Store(false)
	other := dlock.New(newLease(t, nil), nil)
	defer other.Close(ctx)
	wctx, wcancel := context.WithTimeout(ctx, 5*time.Second)
	defer wcancel()
	lk2, err := other.Acquire(wctx, key)
	if err != nil {
		t.Fatalf("an acquisition its caller gave up on holds the key: %v", err)
	}
	lk2.Release(ctx)
}
