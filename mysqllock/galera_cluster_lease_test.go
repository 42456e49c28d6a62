package mysqllock_test

import (
	"context"
	"database/sql"
	"errors"
	"fmt"
	"os"
	"strings"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/dlock-dev/dlock"
	"github.com/dlock-dev/dlock/locktest"
	"github.com/dlock-dev/dlock/mysqllock"
)

// TestGaleraClusterLease runs the lease strategy (NoDoorbell) on a 3-node
// Galera cluster with clients on different nodes: the lease row is a
// replicated write, so exclusion, fence order, release and expiry hold
// across nodes. Last, a node that has lost its quorum must answer with
// ErrGaleraUnavailable, never with a grant or a refusal.
func TestGaleraClusterLease(t *testing.T) {
	nodes := startGaleraCluster(t, 3)
	ctx := t.Context()
	const table = "dlock_galera3"
	backends := make([]*mysqllock.Backend, len(nodes))
	for i, n := range nodes {
		// See TestGaleraClusterConformance for wsrep_sync_wait.
		b, err := mysqllock.New(openDSN(t, n.dsn+"?wsrep_sync_wait=15"), &mysqllock.Options{Table: table, NoDoorbell: true})
		if err != nil {
			t.Fatal(err)
		}
		t.Cleanup(func() { b.Close() })
		backends[i] = b
	}
	// The table is created on one node; DDL replicates to all of them.
	if err := backends[0].Migrate(ctx); err != nil {
		t.Fatal(err)
	}
	lockers := make([]*dlock.Locker, len(nodes))
	for i, b := range backends {
		lockers[i] = dlock.New(b, nil)
		t.Cleanup(func() { lockers[i].Close(context.Background()) })
	}

	t.Run("TryAcquireExcludesHoldersOnOtherNodes", func(t *testing.T) {
		key := locktest.UniqueKey("galera-try")
		var last uint64
		for i := range nodes {
			lk, err := lockers[i].TryAcquire(ctx, key)
			if err != nil {
				t.Fatalf("node %d: TryAcquire of a free key: %v", i, err)
			}
			if lk.Fence() <= last {
				t.Errorf("node %d: fence %d after %d from another node", i, lk.Fence(), last)
			}
			last = lk.Fence()
			for j := range nodes {
				if _, err := lockers[j].TryAcquire(ctx, key); !errors.Is(err, dlock.ErrNotAcquired) {
					t.Errorf("node %d held the key; TryAcquire on node %d: %v, want ErrNotAcquired", i, j, err)
				}
			}
			if err := lk.Release(ctx); err != nil {
				t.Fatal(err)
			}
		}
	})

	t.Run("ExclusionAndFenceOrderAcrossNodes", func(t *testing.T) {
		key := locktest.UniqueKey("galera-excl")
		const rounds = 10
		var (
			holding atomic.Int32
			mu      sync.Mutex
			last    uint64
			wg      sync.WaitGroup
		)
		for i := range nodes {
			wg.Add(1)
			go func() {
				defer wg.Done()
				for range rounds {
					actx, cancel := context.WithTimeout(ctx, 30*time.Second)
					lk, err := lockers[i].Acquire(actx, key, dlock.WithTTL(5*time.Second))
					cancel()
					if err != nil {
						t.Errorf("node %d: Acquire: %v", i, err)
						return
					}
					if h := holding.Add(1); h != 1 {
						t.Errorf("node %d: %d holders at once", i, h)
					}
					mu.Lock()
					if lk.Fence() <= last {
						t.Errorf("node %d: fence %d after %d", i, lk.Fence(), last)
					}
					last = lk.Fence()
					mu.Unlock()
					time.Sleep(5 * time.Millisecond)
					holding.Add(-1)
					if err := lk.Release(ctx); err != nil {
						t.Errorf("node %d: Release: %v", i, err)
						return
					}
				}
			}()
		}
		wg.Wait()
	})

	t.Run("ReleaseWakesWaiterOnAnotherNode", func(t *testing.T) {
		key := locktest.UniqueKey("galera-wake")
		held, err := lockers[0].TryAcquire(ctx, key, dlock.WithTTL(30*time.Second))
		if err != nil {
			t.Fatal(err)
		}
		got := make(chan *dlock.Lock, 1)
		go func() {
			wctx, cancel := context.WithTimeout(ctx, 15*time.Second)
			defer cancel()
			lk, err := lockers[1].Acquire(wctx, key)
			if err != nil {
				t.Errorf("waiter on node 1: %v", err)
			}
			got <- lk
		}()
		time.Sleep(300 * time.Millisecond)
		select {
		case <-got:
			t.Fatal("the waiter on node 1 acquired a key held on node 0")
		default:
		}
		if err := held.Release(ctx); err != nil {
			t.Fatal(err)
		}
		if lk := <-got; lk != nil {
			if lk.Fence() <= held.Fence() {
				t.Errorf("waiter's fence %d after the holder's %d", lk.Fence(), held.Fence())
			}
			lk.Release(ctx)
		}
	})

	// With Options.Connector on one node for every client, the lease
	// strategy keeps its doorbells on Galera: a waiter whose statements go
	// to another node than the holder's blocks on that node's named lock
	// and is woken by the release, rather than polling the lease.
	t.Run("DoorbellsOnOneNodeWakeWaitersOnOtherNodes", func(t *testing.T) {
		bells := galeraConfigs(t, table, nodes[0].dsn)[1].opts
		belled := func(i int) *dlock.Locker {
			b, err := mysqllock.New(openDSN(t, nodes[i].dsn+"?wsrep_sync_wait=15"), &bells)
			if err != nil {
				t.Fatal(err)
			}
			l := dlock.New(b, nil)
			t.Cleanup(func() { l.Close(context.Background()); b.Close() })
			return l
		}
		holder, waiter := belled(2), belled(1)
		key := locktest.UniqueKey("galera-bell")
		held, err := holder.TryAcquire(ctx, key, dlock.WithTTL(30*time.Second))
		if err != nil {
			t.Fatalf("TryAcquire with doorbells on node 0, lease on node 2: %v", err)
		}
		node0, node1 := openDSN(t, nodes[0].dsn), openDSN(t, nodes[1].dsn)
		inserts := func() int64 {
			var name string
			var n int64
			if err := node1.QueryRowContext(ctx, "SHOW GLOBAL STATUS LIKE 'Com_insert'").Scan(&name, &n); err != nil {
				t.Fatal(err)
			}
			return n
		}
		got := make(chan *dlock.Lock, 1)
		go func() {
			wctx, cancel := context.WithTimeout(ctx, 30*time.Second)
			defer cancel()
			// recheck is a quarter of the TTL: 5 s.
			lk, err := waiter.Acquire(wctx, key, dlock.WithTTL(20*time.Second))
			if err != nil {
				t.Errorf("waiter on node 1: %v", err)
			}
			got <- lk
		}()
		// The waiter comes to block in GET_LOCK on node 0 (bounded).
		inBell := func() bool {
			var n int
			if err := node0.QueryRowContext(ctx, "SELECT COUNT(*) FROM information_schema.PROCESSLIST WHERE STATE = 'User lock'").Scan(&n); err != nil {
				t.Fatal(err)
			}
			return n == 1
		}
		for i := 0; !inBell(); i++ {
			if i == 200 {
				t.Fatal("no waiter blocked on the doorbell on node 0 after 10 s")
			}
			time.Sleep(50 * time.Millisecond)
		}
		// While it blocks there, it sends node 1 no lease statement (a
		// poll would send one every bellPoll, 50 ms).
		before := inserts()
		time.Sleep(time.Second)
		if n := inserts() - before; n != 0 || !inBell() {
			t.Errorf("in a second of the hold, the waiter made %d statements on node 1; still blocked on node 0: %v", n, inBell())
		}
		select {
		case <-got:
			t.Fatal("the waiter on node 1 acquired a key held on node 2")
		default:
		}
		if err := held.Release(ctx); err != nil {
			t.Fatal(err)
		}
		lk := <-got
		if lk == nil {
			return
		}
		defer lk.Release(ctx)
		if lk.Fence() <= held.Fence() {
			t.Errorf("waiter's fence %d after the holder's %d", lk.Fence(), held.Fence())
		}
	})

	t.Run("ExpiredLeaseIsTakenOverOnAnotherNode", func(t *testing.T) {
		key := locktest.UniqueKey("galera-expiry")
		old := dlock.Request{Key: key, Token: dlock.NewToken(), TTL: dlock.MinTTL}
		fence := mustGrant(t, backends[0], old)
		mustRefuse(t, backends[2], dlock.Request{Key: key, Token: dlock.NewToken(), TTL: dlock.MinTTL})
		time.Sleep(dlock.MinTTL + 200*time.Millisecond)
		next := dlock.Request{Key: key, Token: dlock.NewToken(), TTL: 5 * time.Second}
		if f := mustGrant(t, backends[2], next); f <= fence {
			t.Errorf("takeover fence %d after the expired %d", f, fence)
		}
		errs, err := backends[0].Extend(ctx, []dlock.Lease{{Key: key, Token: old.Token, TTL: 5 * time.Second}})
		if err != nil || !errors.Is(errs[0], dlock.ErrNotHeld) {
			t.Errorf("extending the expired lease on node 0: %v, %v; want ErrNotHeld", errs, err)
		}
		if err := backends[2].Release(ctx, key, next.Token); err != nil {
			t.Fatal(err)
		}
	})

	t.Run("ListAndForceReleaseFromAnotherNode", func(t *testing.T) {
		key := locktest.UniqueKey("galera-list")
		lk, err := lockers[0].TryAcquire(ctx, key, dlock.WithOwner("node0"))
		if err != nil {
			t.Fatal(err)
		}
		ls, err := lockers[2].List(ctx, key)
		if err != nil || len(ls) != 1 || ls[0].Owner != "node0" || ls[0].Fence != lk.Fence() {
			t.Fatalf("List on node 2 of a key held on node 0: %+v, %v", ls, err)
		}
		if err := lockers[1].ForceRelease(ctx, key); err != nil {
			t.Fatal(err)
		}
		next, err := lockers[2].TryAcquire(ctx, key)
		if err != nil {
			t.Fatalf("node 2 after a forced release on node 1: %v", err)
		}
		next.Release(ctx)
		if err := lk.Release(ctx); !errors.Is(err, dlock.ErrNotHeld) && !errors.Is(err, dlock.ErrLockLost) {
			t.Errorf("releasing the forced lease on node 0: %v; want ErrNotHeld", err)
		}
	})

	t.Run("SessionStrategiesAreRefusedBeforeClaimingTheKey", func(t *testing.T) {
		db := openDSN(t, nodes[1].dsn)
		req := dlock.Request{Key: locktest.UniqueKey("galera-session"), Token: dlock.NewToken(), TTL: 5 * time.Second}
		get, err := mysqllock.NewGetLock(db, &mysqllock.Options{Table: table})
		if err != nil {
			t.Fatal(err)
		}
		defer get.Close()
		if res, err := get.Acquire(ctx, req); !errors.Is(err, mysqllock.ErrGalera) || res.Acquired {
			t.Errorf("getlock on a Galera joiner: %+v, %v; want ErrGalera", res, err)
		}
		row, err := mysqllock.NewRowLock(db, &mysqllock.Options{Table: table})
		if err != nil {
			t.Fatal(err)
		}
		defer row.Close()
		if res, err := row.Acquire(ctx, req); !errors.Is(err, mysqllock.ErrGalera) || res.Acquired {
			t.Errorf("rowlock on a Galera joiner: %+v, %v; want ErrGalera", res, err)
		}
		// A refused strategy leaves no claim on the key: the lease
		// strategy may take it.
		mustGrant(t, backends[1], dlock.Request{Key: req.Key, Token: dlock.NewToken(), TTL: 5 * time.Second})
	})

	// Last: this breaks the cluster.
	t.Run("NodeWithoutQuorumIsUnavailable", func(t *testing.T) {
		key := locktest.UniqueKey("galera-quorum")
		held := dlock.Request{Key: key, Token: dlock.NewToken(), TTL: 30 * time.Second}
		mustGrant(t, backends[0], held)
		for _, n := range nodes[1:] {
			if err := n.proc.Kill(); err != nil {
				t.Fatal(err)
			}
		}
		if err := waitNonPrimary(ctx, nodes[0]); err != nil {
			t.Fatal(err)
		}
		// With wsrep_sync_wait, the node answers 1205 (its wait for the
		// cluster times out): an error, never a grant or a refusal.
		res, err := backends[0].Acquire(ctx, dlock.Request{Key: key, Token: dlock.NewToken(), TTL: 5 * time.Second})
		if err == nil || res.Acquired {
			t.Errorf("Acquire (wsrep_sync_wait=15) on a node without quorum: %+v, %v; want an error", res, err)
		}
		b, err := mysqllock.New(openDSN(t, nodes[0].dsn), &mysqllock.Options{Table: table, NoDoorbell: true})
		if err != nil {
			t.Fatal(err)
		}
		defer b.Close()
		res, err = b.Acquire(ctx, dlock.Request{Key: locktest.UniqueKey("galera-quorum"), Token: dlock.NewToken(), TTL: 5 * time.Second})
		if !errors.Is(err, mysqllock.ErrGaleraUnavailable) || res.Acquired {
			t.Errorf("Acquire of a free key on a node without quorum: %+v, %v; want ErrGaleraUnavailable", res, err)
		}
		res, err = b.Acquire(ctx, dlock.Request{Key: key, Token: dlock.NewToken(), TTL: 5 * time.Second})
		if !errors.Is(err, mysqllock.ErrGaleraUnavailable) || res.Acquired {
			t.Errorf("Acquire of a held key on a node without quorum: %+v, %v; want ErrGaleraUnavailable", res, err)
		}
		errs, err := b.Extend(ctx, []dlock.Lease{{Key: key, Token: held.Token, TTL: 30 * time.Second}})
		if !errors.Is(err, mysqllock.ErrGaleraUnavailable) {
			t.Errorf("Extend on a node without quorum: %v, %v; want ErrGaleraUnavailable", errs, err)
		}
		if err := b.Release(ctx, key, held.Token); !errors.Is(err, mysqllock.ErrGaleraUnavailable) {
			t.Errorf("Release on a node without quorum: %v; want ErrGaleraUnavailable", err)
		}
		l := dlock.New(b, nil)
		defer l.Close(context.Background())
		if _, err := l.TryAcquire(ctx, key); !errors.Is(err, mysqllock.ErrGaleraUnavailable) || errors.Is(err, dlock.ErrNotAcquired) {
			t.Errorf("Locker.TryAcquire on a node without quorum: %v; want ErrGaleraUnavailable", err)
		}
	})
}

// waitNonPrimary waits until node has left the primary component (its
// peers gone, it lost its quorum).
func waitNonPrimary(ctx context.Context, node *galeraNode) error {
	db, err := sql.Open("mysql", node.dsn)
	if err != nil {
		return err
	}
	defer db.Close()
	var status string
	for range 300 {
		var name string
		qctx, cancel := context.WithTimeout(ctx, time.Second)
		err = db.QueryRowContext(qctx, "SHOW STATUS LIKE 'wsrep_cluster_status'").Scan(&name, &status)
		cancel()
		if err == nil && status != "Primary" {
			return nil
		}
		time.Sleep(100 * time.Millisecond)
	}
	return fmt.Errorf("node still in the primary component after 30 s: %q, %v", status, err)
}

// TestGaleraClusterConformance runs the whole conformance suite for the
// lease strategy (NoDoorbell) on a 3-node Galera cluster, each new backend
// on the next node, so that a case's contending clients sit on different
// nodes. It takes minutes, so it runs only with DLOCK_GALERA_LONG=1 (see
// docs/replication.md). The suite's helper processes inherit the nodes'
// DSNs from galeraDSNsEnv instead of starting a cluster of their own.
func TestGaleraClusterConformance(t *testing.T) {
	if os.Getenv("DLOCK_GALERA_LONG") == "" {
		t.Skip("the full suite on a 3-node Galera cluster runs with DLOCK_GALERA_LONG=1")
	}
	const table = "dlock_galera_conf"
	dsns := galeraDSNs(t, table)
	for _, c := range galeraConfigs(t, table, dsns[0]) {
		t.Run(c.name, func(t *testing.T) {
			var next atomic.Int32
			locktest.Run(t, func(t *testing.T) dlock.Backend {
				// Statements on one node may run before it has applied a
				// write certified on another (a release elsewhere, then
				// ListKeys or an acquisition here); wsrep_sync_wait=15
				// makes them wait for it, as docs/replication.md advises.
				dsn := dsns[int(next.Add(1)-1)%len(dsns)] + "?wsrep_sync_wait=15"
				b, err := mysqllock.New(openDSN(t, dsn), &c.opts)
				if err != nil {
					t.Fatal(err)
				}
				t.Cleanup(func() { b.Close() })
				return b
			})
		})
	}
}

// galeraDSNsEnv passes the DSNs of TestGaleraClusterConformance's nodes
// (space-separated) to the suite's helper processes.
const galeraDSNsEnv = "DLOCK_GALERA_DSNS"

// TestGaleraFairShareDoorbellsOnOneNode runs 8 processes on one key, each
// with its lease statements on a node of a 3-node Galera cluster and its
// doorbells on the first node: no process gets less than half its fair
// share, so a releasing client on one node does not barge ahead of the
// waiter woken on another.
func TestGaleraFairShareDoorbellsOnOneNode(t *testing.T) {
	const table = "dlock_galera_fair"
	dsns := galeraDSNs(t, table)
	opts := galeraConfigs(t, table, dsns[0])[1].opts
	locktest.FairShare(t, func(t *testing.T) dlock.Backend {
		// Each process is a helper of its own: its pid picks its node.
		dsn := dsns[os.Getpid()%len(dsns)] + "?wsrep_sync_wait=15"
		b, err := mysqllock.New(openDSN(t, dsn), &opts)
		if err != nil {
			t.Fatal(err)
		}
		t.Cleanup(func() { b.Close() })
		return b
	}, 8, 3*time.Second)
}

// galeraDSNs returns the DSNs of the nodes of a 3-node Galera cluster with
// table migrated: those of galeraDSNsEnv in a suite's helper process, else
// of a cluster it starts, which it hands its helpers through the variable.
func galeraDSNs(t *testing.T, table string) []string {
	t.Helper()
	dsns := strings.Fields(os.Getenv(galeraDSNsEnv))
	if len(dsns) > 0 {
		return dsns
	}
	for _, n := range startGaleraCluster(t, 3) {
		dsns = append(dsns, n.dsn)
	}
	b, err := mysqllock.New(openDSN(t, dsns[0]), &mysqllock.Options{Table: table, NoDoorbell: true})
	if err != nil {
		t.Fatal(err)
	}
	defer b.Close()
	if err := b.Migrate(t.Context()); err != nil {
		t.Fatal(err)
	}
	t.Setenv(galeraDSNsEnv, strings.Join(dsns, " "))
	return dsns
}
