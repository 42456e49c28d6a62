package etcdlock_test

import (
	"context"
	"errors"
	"os"
	"strconv"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/dlock-dev/dlock"
	"github.com/dlock-dev/dlock/etcdlock"
	"github.com/dlock-dev/dlock/locktest"
	clientv3 "go.etcd.io/etcd/client/v3"
	"go.uber.org/goleak"
)

func TestMain(m *testing.M) { goleak.VerifyTestMain(m) }

// envEndpoints names the etcd endpoints of a test, set by the test for the
// helper processes the suite starts (or by the user, to use a running
// server: DLOCK_ETCD_ENDPOINTS=localhost:2379).
const envEndpoints = "DLOCK_ETCD_ENDPOINTS"

// endpoints returns the endpoints in the environment, or starts a
// single-member etcd and records its endpoint there for helper processes.
func endpoints(t testing.TB) []string {
	t.Helper()
	if v := os.Getenv(envEndpoints); v != "" {
		return strings.Split(v, ",")
	}
	eps := startCluster(t, 1).endpoints()
	if tt, ok := t.(interface{ Setenv(k, v string) }); ok {
		tt.Setenv(envEndpoints, strings.Join(eps, ","))
	}
	return eps
}

// newBackend returns a Backend over a new client of eps (as a new process
// would have), with a prefix of its own test run.
func newBackend(t testing.TB, eps []string) *etcdlock.Backend {
	t.Helper()
	b, err := etcdlock.New(newClient(t, eps...), nil)
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { b.Close() }) // before the client's (cleanups run last first)
	return b
}

func TestConformance(t *testing.T) {
	eps := endpoints(t)
	locktest.Run(t, func(t *testing.T) dlock.Backend { return newBackend(t, eps) },
		locktest.Stallable(eps[0], func(t *testing.T, addr string) dlock.Backend { return newBackend(t, []string{addr}) }))
}

func TestNewNilClient(t *testing.T) {
	if _, err := etcdlock.New(nil, nil); !errors.Is(err, dlock.ErrInvalidOption) {
		t.Errorf("New(nil): %v, want ErrInvalidOption", err)
	}
}

// entries returns the etcd keys under prefix.
func entries(t *testing.T, c *clientv3.Client, prefix string) []string {
	t.Helper()
	resp, err := c.Get(ctxT(t, 5*time.Second), prefix, clientv3.WithPrefix(), clientv3.WithKeysOnly())
	if err != nil {
		t.Fatal(err)
	}
	var keys []string
	for _, kv := range resp.Kvs {
		keys = append(keys, string(kv.Key))
	}
	return keys
}

// TestWaitersAreServedInArrivalOrder queues three waiters, one at a time,
// behind a holder, keeps them waiting over several of AcquireWait's bounds
// (a third of the TTL each), and checks that they get the key in arrival
// order, each with a larger fence, and that the queue is empty after.
func TestWaitersAreServedInArrivalOrder(t *testing.T) {
	eps := endpoints(t)
	c := newClient(t, eps...)
	k := locktest.UniqueKey("fifo")
	holder := locktest.NewLocker(t, newBackend(t, eps))
	lk, err := holder.TryAcquire(ctxT(t, 5*time.Second), k, dlock.WithTTL(time.Second))
	if err != nil {
		t.Fatal(err)
	}
	const waiters = 3
	var mu sync.Mutex
	var order []int
	var fences []uint64
	var wg sync.WaitGroup
	for i := range waiters {
		l := locktest.NewLocker(t, newBackend(t, eps))
		wg.Go(func() {
			w, err := l.Acquire(ctxT(t, 30*time.Second), k, dlock.WithTTL(time.Second))
			if err != nil {
				t.Errorf("waiter %d: %v", i, err)
				return
			}
			mu.Lock()
			order = append(order, i)
			fences = append(fences, w.Fence())
			mu.Unlock()
			time.Sleep(50 * time.Millisecond)
			if err := w.Release(context.Background()); err != nil {
				t.Errorf("waiter %d release: %v", i, err)
			}
		})
		// Wait until this waiter's entry is queued before starting the next.
		waitFor(t, func() bool {
			return len(entries(t, c, etcdlock.DefaultPrefix+strings.ReplaceAll(k, "/", "%2F")+"/")) == i+2
		})
	}
	time.Sleep(1500 * time.Millisecond) // several bounds: the entries are parked and taken over
	if err := lk.Err(); err != nil {
		t.Fatalf("holder lost the lock while others waited: %v", err)
	}
	if err := lk.Release(context.Background()); err != nil {
		t.Fatal(err)
	}
	wg.Wait()
	for i, got := range order {
		if got != i {
			t.Fatalf("waiters got the key in order %v, want arrival order", order)
		}
	}
	for i := 1; i < len(fences); i++ {
		if fences[i] <= fences[i-1] {
			t.Errorf("fences %v do not increase", fences)
		}
	}
	if left := entries(t, c, etcdlock.DefaultPrefix+strings.ReplaceAll(k, "/", "%2F")+"/"); len(left) != 0 {
		t.Errorf("entries left after everyone released: %v", left)
	}
}

// TestCancelledWaitLeavesTheQueue checks that a waiter whose context ends
// deletes its entry at once, so that the next holder is not held up by it.
func TestCancelledWaitLeavesTheQueue(t *testing.T) {
	eps := endpoints(t)
	c := newClient(t, eps...)
	k := locktest.UniqueKey("cancel")
	dir := etcdlock.DefaultPrefix + strings.ReplaceAll(k, "/", "%2F") + "/"
	a := locktest.NewLocker(t, newBackend(t, eps))
	b := locktest.NewLocker(t, newBackend(t, eps))
	lk, err := a.TryAcquire(ctxT(t, 5*time.Second), k, dlock.WithTTL(30*time.Second))
	if err != nil {
		t.Fatal(err)
	}
	ctx, cancel := context.WithCancel(context.Background())
	done := make(chan error, 1)
	go func() {
		_, err := b.Acquire(ctx, k, dlock.WithTTL(30*time.Second))
		done <- err
	}()
	waitFor(t, func() bool { return len(entries(t, c, dir)) == 2 })
	cancel()
	if err := <-done; !errors.Is(err, dlock.ErrNotAcquired) || !errors.Is(err, context.Canceled) {
		t.Errorf("cancelled Acquire: %v, want ErrNotAcquired and context.Canceled", err)
	}
	// The Locker returns when ctx ends; the backend's call, which it no
	// longer waits for, removes the entry as it ends: well within the
	// entry's 30 s lease.
	for i := 0; len(entries(t, c, dir)) != 1; i++ {
		if i == 250 {
			t.Fatalf("5 s after the waiter gave up the directory holds %v, want only the holder", entries(t, c, dir))
		}
		time.Sleep(20 * time.Millisecond)
	}
	if err := lk.Release(context.Background()); err != nil {
		t.Fatal(err)
	}
	// The key is free at once, not after the waiter's 30 s lease.
	l2, err := b.TryAcquire(ctxT(t, 5*time.Second), k)
	if err != nil {
		t.Fatalf("after the holder released: %v", err)
	}
	l2.Release(context.Background())
}

// TestLeaseIsWholeSecondsRoundedUp checks the lease etcd is given for a TTL
// that is not a whole number of seconds.
func TestLeaseIsWholeSecondsRoundedUp(t *testing.T) {
	eps := endpoints(t)
	c := newClient(t, eps...)
	b := newBackend(t, eps)
	k := locktest.UniqueKey("ttl")
	tok := dlock.NewToken()
	ctx := ctxT(t, 5*time.Second)
	if r, err := b.Acquire(ctx, dlock.Request{Key: k, Token: tok, TTL: 1500 * time.Millisecond}); err != nil || !r.Acquired {
		t.Fatalf("Acquire: %+v %v", r, err)
	}
	defer b.Release(ctx, k, tok)
	resp, err := c.Get(ctx, etcdlock.DefaultPrefix+strings.ReplaceAll(k, "/", "%2F")+"/", clientv3.WithPrefix())
	if err != nil || len(resp.Kvs) != 1 {
		t.Fatalf("entries: %v %v", resp, err)
	}
	ttl, err := c.TimeToLive(ctx, clientv3.LeaseID(resp.Kvs[0].Lease))
	if err != nil {
		t.Fatal(err)
	}
	if ttl.GrantedTTL != 2 {
		t.Errorf("a 1.5 s TTL was granted a %d s lease, want 2 s", ttl.GrantedTTL)
	}
}

// TestPrefix checks that backends with different prefixes do not see each
// other's locks.
func TestPrefix(t *testing.T) {
	eps := endpoints(t)
	c := newClient(t, eps...)
	a, err := etcdlock.New(c, &etcdlock.Options{Prefix: "app-a/"})
	if err != nil {
		t.Fatal(err)
	}
	b, err := etcdlock.New(c, &etcdlock.Options{Prefix: "app-b/"})
	if err != nil {
		t.Fatal(err)
	}
	k := locktest.UniqueKey("prefix")
	la, lb := locktest.NewLocker(t, a), locktest.NewLocker(t, b)
	x, err := la.TryAcquire(ctxT(t, 5*time.Second), k)
	if err != nil {
		t.Fatal(err)
	}
	defer x.Release(context.Background())
	y, err := lb.TryAcquire(ctxT(t, 5*time.Second), k)
	if err != nil {
		t.Fatalf("a lock under another prefix excluded this one: %v", err)
	}
	defer y.Release(context.Background())
	if got := entries(t, c, "app-a/"); len(got) != 1 {
		t.Errorf("app-a/ holds %v, want one entry", got)
	}
}

// waitFor polls cond (a condition on etcd that no watch reports, for test
// set-up only) every 20 ms for up to 10 s.
func waitFor(t *testing.T, cond func() bool) {
	t.Helper()
	for range 500 {
		if cond() {
			return
		}
		time.Sleep(20 * time.Millisecond)
	}
	t.Fatal("condition not met within 10 s")
}

// TestFencingSurvivesRestart restarts etcd (from its data directory) between
// two acquisitions of a key: the second fence is still larger, and a
// lock taken before the restart and renewed across it stays held.
func TestFencingSurvivesRestart(t *testing.T) {
	c := startCluster(t, 1)
	eps := c.endpoints()
	l := locktest.NewLocker(t, newBackend(t, eps))
	k, held := locktest.UniqueKey("restart"), locktest.UniqueKey("restart-held")
	first, err := l.TryAcquire(ctxT(t, 5*time.Second), k)
	if err != nil {
		t.Fatal(err)
	}
	if err := first.Release(context.Background()); err != nil {
		t.Fatal(err)
	}
	lk, err := l.TryAcquire(ctxT(t, 5*time.Second), held, dlock.WithTTL(10*time.Second))
	if err != nil {
		t.Fatal(err)
	}
	c.members[0].restart(t)
	next, err := l.TryAcquire(ctxT(t, 15*time.Second), k)
	if err != nil {
		t.Fatalf("after the restart: %v", err)
	}
	defer next.Release(context.Background())
	if next.Fence() <= first.Fence() {
		t.Errorf("rule: fencing increases across store restarts; %d after %d", next.Fence(), first.Fence())
	}
	if err := lk.Err(); err != nil {
		t.Errorf("a lock held across the restart was lost: %v", err)
	}
	if _, err := locktest.NewLocker(t, newBackend(t, eps)).TryAcquire(ctxT(t, 5*time.Second), held); !errors.Is(err, dlock.ErrNotAcquired) {
		t.Errorf("a lock held across the restart was free to others: %v", err)
	}
	if err := lk.Release(context.Background()); err != nil {
		t.Errorf("release after the restart: %v", err)
	}
}

// TestAcquireWaitKeepsItsBoundOnAFrozenServer freezes the only member while
// a waiter calls AcquireWait. The call must come back (not acquired, no
// error: the Locker calls again) after about its bound, TTL/3 plus one
// request's timeout, not after the retries of its requests have run out
// (about 5.5 s): the fault harness saw waiters' calls of 5.5 and 8.5 s.
func TestAcquireWaitKeepsItsBoundOnAFrozenServer(t *testing.T) {
	c := startCluster(t, 1)
	eps := c.endpoints()
	b := newBackend(t, eps)
	k := locktest.UniqueKey("frozen")
	ctx := ctxT(t, 30*time.Second)
	if res, err := b.Acquire(ctx, dlock.Request{Key: k, Token: dlock.NewToken(), TTL: 5 * time.Second}); err != nil || !res.Acquired {
		t.Fatalf("Acquire: %+v %v", res, err)
	}
	c.members[0].stop()
	start := time.Now()
	res, err := b.AcquireWait(ctxT(t, 20*time.Second), dlock.Request{Key: k, Token: dlock.NewToken(), TTL: time.Second})
	took := time.Since(start)
	c.members[0].cont()
	if err != nil || res.Acquired {
		t.Errorf("AcquireWait against a frozen server: %+v %v, want not acquired and no error", res, err)
	}
	// The bound is 333 ms + 250 ms; the retries alone would take ~5.5 s.
	if took > 3*time.Second {
		t.Errorf("AcquireWait took %s against a frozen server; its bound is TTL/3 plus one request's timeout", took)
	}
}

// TestGivenUpWaitReturnsOnAFrozenServer: a waiter whose context ends while
// the only member is frozen returns within one request's timeout. Its
// entry's revocation cannot reach the member; it runs on in the background
// instead of holding the caller for up to its 5 s clean-up bound (a timed
// acquisition overran its deadline by 5 s), and removes the entry once the
// member is back.
func TestGivenUpWaitReturnsOnAFrozenServer(t *testing.T) {
	c := startCluster(t, 1)
	eps := c.endpoints()
	b := newBackend(t, eps)
	k := locktest.UniqueKey("giveup")
	if res, err := b.Acquire(ctxT(t, 10*time.Second), dlock.Request{Key: k, Token: dlock.NewToken(), TTL: 10 * time.Second}); err != nil || !res.Acquired {
		t.Fatalf("Acquire: %+v %v", res, err)
	}
	dir := etcdlock.DefaultPrefix + strings.ReplaceAll(k, "/", "%2F") + "/"
	ctx, cancel := context.WithCancel(context.Background())
	defer cancel()
	done := make(chan time.Time, 1)
	go func() {
		_, _ = b.AcquireWait(ctx, dlock.Request{Key: k, Token: dlock.NewToken(), TTL: 30 * time.Second})
		done <- time.Now()
	}()
	cl := newClient(t, eps...)
	waitFor(t, func() bool { return len(entries(t, cl, dir)) == 2 })
	c.members[0].stop()
	cancel()
	gaveUp := time.Now()
	select {
	case at := <-done:
		// The bound: one request's timeout (1 s), not the clean-up's 5 s.
		if d := at.Sub(gaveUp); d > 3*time.Second {
			c.members[0].cont()
			t.Fatalf("AcquireWait returned %s after its context ended", d)
		}
	case <-time.After(20 * time.Second):
		c.members[0].cont()
		t.Fatal("AcquireWait did not return after its context ended")
	}
	// The revocation went on in the background: once the member is back,
	// the waiter's entry goes, well before its 30 s lease would end.
	c.members[0].cont()
	waitFor(t, func() bool { return len(entries(t, cl, dir)) == 1 })
}

// TestCloseRemovesParkedEntries: an entry parked between two AcquireWait
// calls goes at Close, not a second later or with its lease.
func TestCloseRemovesParkedEntries(t *testing.T) {
	eps := endpoints(t)
	cl := newClient(t, eps...)
	b := newBackend(t, eps)
	k := locktest.UniqueKey("close")
	dir := etcdlock.DefaultPrefix + strings.ReplaceAll(k, "/", "%2F") + "/"
	ctx := ctxT(t, 10*time.Second)
	if res, err := b.Acquire(ctx, dlock.Request{Key: k, Token: dlock.NewToken(), TTL: 10 * time.Second}); err != nil || !res.Acquired {
		t.Fatalf("Acquire: %+v %v", res, err)
	}
	// A third of the TTL: the call parks its entry and returns.
	res, err := b.AcquireWait(ctx, dlock.Request{Key: k, Token: dlock.NewToken(), TTL: 30 * time.Millisecond})
	if err != nil || res.Acquired {
		t.Fatalf("AcquireWait: %+v %v, want a parked entry", res, err)
	}
	if got := entries(t, cl, dir); len(got) != 2 {
		t.Fatalf("directory %v, want the holder and the parked entry", got)
	}
	if err := b.Close(); err != nil {
		t.Fatal(err)
	}
	if got := entries(t, cl, dir); len(got) != 1 {
		t.Errorf("after Close the directory holds %v, want only the holder", got)
	}
}

// TestParkedEntryAtTheHeadIsRemoved: an entry parked between two
// AcquireWait calls that reaches the head before a call takes it over (its
// waiter gave up between two calls, or was slow to call again) is removed
// at once, so that the key goes to the next waiter, not to nobody until the
// park times out or the entry's lease runs out.
func TestParkedEntryAtTheHeadIsRemoved(t *testing.T) {
	eps := endpoints(t)
	cl := newClient(t, eps...)
	holder, parker, waiter := newBackend(t, eps), newBackend(t, eps), newBackend(t, eps)
	parker.SetParkTimeout(time.Hour) // only reaching the head may remove the entry
	k := locktest.UniqueKey("parkhead")
	dir := etcdlock.DefaultPrefix + strings.ReplaceAll(k, "/", "%2F") + "/"
	ctx := ctxT(t, 20*time.Second)
	hold := dlock.Request{Key: k, Token: dlock.NewToken(), TTL: 10 * time.Second}
	if res, err := holder.Acquire(ctx, hold); err != nil || !res.Acquired {
		t.Fatalf("Acquire: %+v %v", res, err)
	}
	// A third of the TTL: the call parks its entry and returns.
	res, err := parker.AcquireWait(ctx, dlock.Request{Key: k, Token: dlock.NewToken(), TTL: 30 * time.Millisecond})
	if err != nil || res.Acquired {
		t.Fatalf("AcquireWait: %+v %v, want a parked entry", res, err)
	}
	// Keep the parked entry's lease alive, so that only a revocation ends it.
	resp, err := cl.Get(ctx, dir, clientv3.WithPrefix(), clientv3.WithSort(clientv3.SortByCreateRevision, clientv3.SortAscend))
	if err != nil || len(resp.Kvs) != 2 {
		t.Fatalf("directory: %v %v, want the holder and the parked entry", resp, err)
	}
	parked := string(resp.Kvs[1].Key)
	id, err := strconv.ParseUint(parked[strings.LastIndexByte(parked, '/')+1:], 16, 64)
	if err != nil {
		t.Fatal(err)
	}
	kctx, stop := context.WithCancel(context.Background())
	defer stop()
	alive, err := cl.KeepAlive(kctx, clientv3.LeaseID(id))
	if err != nil {
		t.Fatal(err)
	}
	go func() {
		for range alive {
		}
	}()
	if err := holder.Release(ctx, k, hold.Token); err != nil {
		t.Fatal(err)
	}
	for {
		res, err := waiter.AcquireWait(ctx, dlock.Request{Key: k, Token: dlock.NewToken(), TTL: 30 * time.Millisecond})
		if err != nil {
			t.Fatal(err)
		}
		if res.Acquired {
			break
		}
		if ctx.Err() != nil {
			t.Fatalf("rule: a parked entry that reaches the head does not hold the key; the next waiter never got it (directory %v)", entries(t, cl, dir))
		}
	}
}
