package redislock_test

import (
	"context"
	"errors"
	"fmt"
	"os"
	"slices"
	"strconv"
	"strings"
	"testing"
	"time"

	"github.com/dlock-dev/dlock"
	"github.com/dlock-dev/dlock/locktest"
	"github.com/dlock-dev/dlock/redislock"
	"github.com/redis/go-redis/v9"
	"go.uber.org/goleak"
)

// TestMain checks for leaked goroutines. go-redis's pool redials a dead
// server from a goroutine that sleeps 1 s between attempts and notices the
// pool's Close only when it wakes: it outlives a test that killed servers
// by up to a second, and is not ours.
func TestMain(m *testing.M) {
	goleak.VerifyTestMain(m, goleak.IgnoreAnyFunction("github.com/redis/go-redis/v9/internal/pool.(*ConnPool).tryDial"))
}

// Environment naming the servers of a conformance run, set by the test for
// the helper processes the suite starts (or by the user, to use running
// servers: DLOCK_REDIS_ADDR=localhost:6379).
const (
	envAddr    = "DLOCK_REDIS_ADDR"
	envCluster = "DLOCK_REDIS_TEST_CLUSTER" // comma-separated
	envRedlock = "DLOCK_REDIS_TEST_REDLOCK" // comma-separated
)

// serversFromEnv returns the addresses in env, or starts n servers (a
// cluster if cluster is set) and records their addresses in env for the
// suite's helper processes.
func serversFromEnv(t *testing.T, env string, n int, cluster bool) []string {
	if v := os.Getenv(env); v != "" {
		return strings.Split(v, ",")
	}
	var servers []*server
	if cluster {
		servers = startCluster(t)
	} else {
		for range n {
			servers = append(servers, startServer(t))
		}
	}
	var addrs []string
	for _, s := range servers {
		addrs = append(addrs, s.addr())
	}
	t.Setenv(env, strings.Join(addrs, ","))
	return addrs
}

func newBackend(t testing.TB, c redislock.Client, opts *redislock.Options) *redislock.Backend {
	t.Helper()
	b, err := redislock.New(c, opts)
	if err != nil {
		t.Fatal(err)
	}
	return b
}

func ctxT(t testing.TB, d time.Duration) context.Context {
	ctx, cancel := context.WithTimeout(context.Background(), d)
	t.Cleanup(cancel)
	return ctx
}

func TestConformance(t *testing.T) {
	addr := serversFromEnv(t, envAddr, 1, false)[0]
	locktest.Run(t, func(t *testing.T) dlock.Backend { return newBackend(t, newClient(t, addr), nil) },
		locktest.PoolOf(func(t *testing.T, conns int) dlock.Backend {
			c := redis.NewClient(&redis.Options{Addr: addr, PoolSize: conns})
			t.Cleanup(func() { c.Close() })
			return newBackend(t, c, nil)
		}),
		locktest.Stallable(addr, func(t *testing.T, proxy string) dlock.Backend {
			return newBackend(t, newClient(t, proxy), nil)
		}))
}

func TestConformanceCluster(t *testing.T) {
	addrs := serversFromEnv(t, envCluster, 3, true)
	locktest.Run(t, func(t *testing.T) dlock.Backend {
		c := redis.NewClusterClient(&redis.ClusterOptions{Addrs: addrs})
		t.Cleanup(func() { c.Close() })
		return newBackend(t, c, nil)
	})
}

// TestClusterKeyNames checks that every Redis name of a key (its lock,
// counter, channels and the names of its shared holders) shares a cluster
// slot whatever braces the key contains, and that such keys work
// end to end on a cluster (a slot mismatch fails the scripts with CROSSSLOT).
func TestClusterKeyNames(t *testing.T) {
	nodes := startCluster(t)
	c := redis.NewClusterClient(&redis.ClusterOptions{Addrs: []string{nodes[0].addr()}})
	t.Cleanup(func() { c.Close() })
	b := newBackend(t, c, nil)
	l1, l2 := locktest.NewLocker(t, b), locktest.NewLocker(t, newBackend(t, c, nil))
	ctx := ctxT(t, 30*time.Second)
	node := nodes[0].client(t)
	base := locktest.UniqueKey("braces")
	slots := map[int64]bool{}
	for _, k := range []string{"}" + base, "{" + base, base + "{x}", "{}" + base, "a{b}c" + base, base + "%7B%", "plain" + base} {
		lock, fence, channel := b.Names(k)
		holders, info, writer := b.ModeNames(k)
		changed, changes := b.WatchChannel(k), b.ChangesKey(k)
		var got []int64
		for _, name := range []string{lock, fence, channel, holders, info, writer, changed, changes} {
			slot, err := node.ClusterKeySlot(ctx, name).Result()
			if err != nil {
				t.Fatal(err)
			}
			got = append(got, slot)
		}
		if slices.Min(got) != slices.Max(got) {
			t.Errorf("key %q: lock %q, counter %q, channel %q, holders %q, descriptions %q, writer mark %q, change channel %q and change counter %q are in slots %v",
				k, lock, fence, channel, holders, info, writer, changed, changes, got)
		}
		slots[got[0]] = true

		lk, err := l1.TryAcquire(ctx, k)
		if err != nil {
			t.Fatalf("TryAcquire(%q): %v", k, err)
		}
		woken := make(chan error, 1)
		go func() {
			w, err := l2.Acquire(ctx, k)
			if err == nil {
				err = w.Release(ctx)
			}
			woken <- err
		}()
		time.Sleep(50 * time.Millisecond)
		infos, err := l1.List(ctx, k)
		if err != nil || len(infos) != 1 || infos[0].Key != k {
			t.Errorf("List(%q) = %+v, %v", k, infos, err)
		}
		if err := lk.Release(ctx); err != nil {
			t.Fatal(err)
		}
		if err := <-woken; err != nil {
			t.Errorf("waiter for %q: %v", k, err)
		}
		for _, opt := range []dlock.AcquireOption{dlock.Shared(), dlock.WithLimit(2)} {
			lk, err := l1.TryAcquire(ctx, k, opt)
			if err != nil {
				t.Fatalf("TryAcquire(%q) in a mode: %v", k, err)
			}
			if err := lk.Release(ctx); err != nil {
				t.Fatal(err)
			}
		}
	}
	if len(slots) < 2 {
		t.Errorf("all keys landed in one slot %v: the hash tag is not per key", slots)
	}
}

// TestSentinel runs a holder, a waiter woken by pub/sub, readers and List
// through Sentinel-discovered clients.
func TestSentinel(t *testing.T) {
	_, sentinel := startSentinel(t)
	failover := func() *redis.Client {
		c := redis.NewFailoverClient(&redis.FailoverOptions{MasterName: "primary", SentinelAddrs: []string{sentinel.addr()}})
		t.Cleanup(func() { c.Close() })
		return c
	}
	l1 := locktest.NewLocker(t, newBackend(t, failover(), nil))
	l2 := locktest.NewLocker(t, newBackend(t, failover(), nil))
	ctx := ctxT(t, 30*time.Second)
	k := locktest.UniqueKey("sentinel")
	lk, err := l1.TryAcquire(ctx, k, dlock.WithTTL(10*time.Second), dlock.WithOwner("alice"))
	if err != nil {
		t.Fatal(err)
	}
	if _, err := l2.TryAcquire(ctx, k); !errors.Is(err, dlock.ErrNotAcquired) {
		t.Fatalf("second holder: %v", err)
	}
	infos, err := l2.List(ctx, k)
	if err != nil || len(infos) != 1 || infos[0].Owner != "alice" || infos[0].Fence != lk.Fence() {
		t.Errorf("List = %+v, %v", infos, err)
	}
	time.AfterFunc(200*time.Millisecond, func() { lk.Release(context.Background()) })
	start := time.Now()
	w, err := l2.Acquire(ctx, k)
	if err != nil {
		t.Fatal(err)
	}
	if d := time.Since(start); d > 3*time.Second {
		t.Errorf("the waiter took %s to get a key released after 200ms of a 10s lease", d)
	}
	if err := w.Release(ctx); err != nil {
		t.Fatal(err)
	}
	// Readers through Sentinel share the key.
	for _, l := range []*dlock.Locker{l1, l2} {
		r, err := l.TryAcquire(ctx, k, dlock.Shared())
		if err != nil {
			t.Fatalf("a reader: %v", err)
		}
		defer r.Release(ctx)
	}
	if infos, err := l1.List(ctx, k); err != nil || len(infos) != 2 || infos[0].Mode != dlock.ModeShared {
		t.Errorf("List of two readers = %+v, %v", infos, err)
	}
}

// TestRestartLosesLock restarts the server without persistence while a lock
// is held: the next renewal finds the key gone, Done closes before the
// lease's deadline, and the next fence is still larger although the
// counter was lost too (it is kept at least the server's clock).
func TestRestartLosesLock(t *testing.T) {
	s := startServer(t)
	l := locktest.NewLocker(t, newBackend(t, s.client(t), nil))
	k := locktest.UniqueKey("restart")
	lk, err := l.TryAcquire(ctxT(t, 5*time.Second), k, dlock.WithTTL(3*time.Second))
	if err != nil {
		t.Fatal(err)
	}
	s.restart(t)
	deadline := lk.Deadline()
	select {
	case <-lk.Done():
	case <-time.After(10 * time.Second):
		t.Fatal("Done did not close after the server lost the lock")
	}
	if lost := time.Now(); lost.After(deadline) {
		t.Errorf("loss reported at the deadline (%s late), not by the renewal that found the key gone", lost.Sub(deadline))
	}
	// The core wraps the backend's refusal, so the loss matches both.
	if err := lk.Err(); !errors.Is(err, dlock.ErrLockLost) || !errors.Is(err, dlock.ErrNotHeld) {
		t.Errorf("Err = %v, want ErrLockLost from a renewal refused with ErrNotHeld", err)
	}
	lk2, err := l.TryAcquire(ctxT(t, 5*time.Second), k)
	if err != nil {
		t.Fatal(err)
	}
	defer lk2.Release(context.Background())
	if lk2.Fence() <= lk.Fence() {
		t.Errorf("fence %d after the restart, not above %d", lk2.Fence(), lk.Fence())
	}
}

// TestRestartWithAppendFsyncKeepsLock is the contrast: with appendfsync
// always the lock and its counter survive a crash and restart.
func TestRestartWithAppendFsyncKeepsLock(t *testing.T) {
	s := startServer(t, "--appendonly", "yes", "--appendfsync", "always")
	l := locktest.NewLocker(t, newBackend(t, s.client(t), nil))
	k := locktest.UniqueKey("aof")
	lk, err := l.TryAcquire(ctxT(t, 5*time.Second), k, dlock.WithTTL(3*time.Second))
	if err != nil {
		t.Fatal(err)
	}
	s.restart(t)
	time.Sleep(3 * time.Second) // renewals run across the restart
	if err := lk.Err(); err != nil {
		t.Fatalf("lock lost across a restart with appendfsync always: %v", err)
	}
	other := locktest.NewLocker(t, newBackend(t, s.client(t), nil))
	if _, err := other.TryAcquire(ctxT(t, 5*time.Second), k); !errors.Is(err, dlock.ErrNotAcquired) {
		t.Errorf("another client: %v, want ErrNotAcquired", err)
	}
	if err := lk.Release(context.Background()); err != nil {
		t.Fatal(err)
	}
}

// evalCalls returns how many scripts the server has run.
func evalCalls(t *testing.T, c *redis.Client) int {
	t.Helper()
	info, err := c.Info(context.Background(), "commandstats").Result()
	if err != nil {
		t.Fatal(err)
	}
	n := 0
	for _, line := range strings.Split(info, "\n") {
		name, stats, ok := strings.Cut(strings.TrimSpace(line), ":")
		if !ok || (name != "cmdstat_eval" && name != "cmdstat_evalsha") {
			continue
		}
		calls, _, _ := strings.Cut(strings.TrimPrefix(stats, "calls="), ",")
		v, _ := strconv.Atoi(calls)
		n += v
	}
	return n
}

// checkWakeUp holds a key with a 30s lease and checks that a waiter on
// another client subscribes, does not poll while it waits, and is handed the
// key as soon as it is released. Holder and waiter acquire with opts.
func checkWakeUp(t *testing.T, s *server, sharded bool, opts ...dlock.AcquireOption) {
	admin := s.client(t)
	b := newBackend(t, s.client(t), nil)
	holder := locktest.NewLocker(t, b)
	waiter := locktest.NewLocker(t, newBackend(t, s.client(t), nil))
	k := locktest.UniqueKey("wake")
	_, _, channel := b.Names(k)
	lk, err := holder.TryAcquire(ctxT(t, 5*time.Second), k, append(opts, dlock.WithTTL(30*time.Second))...)
	if err != nil {
		t.Fatal(err)
	}
	got := make(chan *dlock.Lock, 1)
	go func() {
		w, err := waiter.Acquire(ctxT(t, 20*time.Second), k, opts...)
		if err != nil {
			t.Error(err)
		}
		got <- w
	}()
	var subs int64
	for range 100 { // bounded: 5s
		var m map[string]int64
		if sharded {
			m, err = admin.PubSubShardNumSub(context.Background(), channel).Result()
		} else {
			m, err = admin.PubSubNumSub(context.Background(), channel).Result()
		}
		if err != nil {
			t.Fatal(err)
		}
		if subs = m[channel]; subs > 0 {
			break
		}
		time.Sleep(50 * time.Millisecond)
	}
	if subs != 1 {
		t.Fatalf("the waiter is not subscribed to %q (sharded %v): %d subscribers", channel, sharded, subs)
	}
	before := evalCalls(t, admin)
	time.Sleep(time.Second)
	if n := evalCalls(t, admin) - before; n != 0 {
		t.Errorf("rule: a waiter does not poll; %d scripts ran in a second while the key was held", n)
	}
	released := time.Now()
	if err := lk.Release(context.Background()); err != nil {
		t.Fatal(err)
	}
	w := <-got
	if w == nil {
		return
	}
	defer w.Release(context.Background())
	if d := time.Since(released); d > time.Second {
		t.Errorf("the waiter got the key %s after its release (the lease had 28s left)", d)
	}
	if w.Fence() <= lk.Fence() {
		t.Errorf("fencing: %d after %d", w.Fence(), lk.Fence())
	}
}

func TestWaiterIsWokenByRelease(t *testing.T) {
	checkWakeUp(t, startServer(t), true)
}

// TestLimitedWaiterIsWokenByRelease: the release of a limited holder wakes
// a waiter for its slot.
func TestLimitedWaiterIsWokenByRelease(t *testing.T) {
	checkWakeUp(t, startServer(t), true, dlock.WithLimit(1))
}

// TestClassicPubSubFallback runs the wake-up on a server without sharded
// pub/sub (as before Redis 7): releases and waiters fall back to classic
// PUBLISH/SUBSCRIBE.
func TestClassicPubSubFallback(t *testing.T) {
	s := startServer(t, "--rename-command", "SPUBLISH", "", "--rename-command", "SSUBSCRIBE", "")
	checkWakeUp(t, s, false)
}

// TestForceReleaseWakesWaiter checks that an administrator's release also
// publishes.
func TestForceReleaseWakesWaiter(t *testing.T) {
	s := startServer(t)
	holder := locktest.NewLocker(t, newBackend(t, s.client(t), nil))
	waiter := locktest.NewLocker(t, newBackend(t, s.client(t), nil))
	k := locktest.UniqueKey("force")
	lk, err := holder.TryAcquire(ctxT(t, 5*time.Second), k, dlock.WithTTL(30*time.Second))
	if err != nil {
		t.Fatal(err)
	}
	time.AfterFunc(300*time.Millisecond, func() { waiter.ForceRelease(context.Background(), k) })
	start := time.Now()
	w, err := waiter.Acquire(ctxT(t, 10*time.Second), k)
	if err != nil {
		t.Fatal(err)
	}
	defer w.Release(context.Background())
	if d := time.Since(start); d > 2*time.Second {
		t.Errorf("the waiter took %s to get a key force-released after 300ms", d)
	}
	if w.Fence() <= lk.Fence() {
		t.Errorf("fencing: %d after %d", w.Fence(), lk.Fence())
	}
}

// TestHolderInfo checks what a refused acquisition reports of the holder.
func TestHolderInfo(t *testing.T) {
	s := startServer(t)
	b := newBackend(t, s.client(t), nil)
	ctx := ctxT(t, 10*time.Second)
	k := locktest.UniqueKey("holder")
	tok := dlock.NewToken()
	before := time.Now()
	r, err := b.Acquire(ctx, dlock.Request{Key: k, Token: tok, Owner: "alice", TTL: 10 * time.Second, Metadata: "job=7"})
	if err != nil || !r.Acquired {
		t.Fatalf("Acquire: %+v %v", r, err)
	}
	r2, err := b.Acquire(ctx, dlock.Request{Key: k, Token: dlock.NewToken(), TTL: time.Second})
	if err != nil || r2.Acquired {
		t.Fatalf("second Acquire: %+v %v", r2, err)
	}
	h := r2.Holder
	if h.Key != k || h.Owner != "alice" || h.Token != tok || h.Fence != r.Fence || h.Metadata != "job=7" {
		t.Errorf("holder %+v, want key %q owner alice token %s fence %d metadata job=7", h, k, tok, r.Fence)
	}
	if r2.Remaining <= 9*time.Second || r2.Remaining > 10*time.Second {
		t.Errorf("Remaining %s, want the holder's PTTL (about 10s)", r2.Remaining)
	}
	if h.AcquiredAt.Before(before.Add(-time.Second)) || h.AcquiredAt.After(time.Now().Add(time.Second)) {
		t.Errorf("AcquiredAt %v is not the server's time of acquisition", h.AcquiredAt)
	}
	// A call that go-redis retries after the script ran (a lost reply) finds
	// the lock held by its own token: that is a success with the same fence.
	r3, err := b.Acquire(ctx, dlock.Request{Key: k, Token: tok, TTL: 10 * time.Second})
	if err != nil || !r3.Acquired || r3.Fence != r.Fence {
		t.Errorf("repeated Acquire with the holder's token: %+v %v, want acquired with fence %d", r3, err, r.Fence)
	}
	if err := b.Release(ctx, k, tok); err != nil {
		t.Fatal(err)
	}
}

// TestLeaseIsTheServers checks that the lease is the key's expiry in Redis,
// in milliseconds, and that the counter has none.
func TestLeaseIsTheServers(t *testing.T) {
	s := startServer(t)
	c := s.client(t)
	b := newBackend(t, c, nil)
	ctx := ctxT(t, 10*time.Second)
	k := locktest.UniqueKey("pttl")
	tok := dlock.NewToken()
	if r, err := b.Acquire(ctx, dlock.Request{Key: k, Token: tok, TTL: 7 * time.Second}); err != nil || !r.Acquired {
		t.Fatalf("Acquire: %+v %v", r, err)
	}
	lock, fence, _ := b.Names(k)
	if lock != "dlock:{"+k+"}" || fence != "dlock:{"+k+"}:fence" {
		t.Errorf("names %q %q", lock, fence)
	}
	if d := c.PTTL(ctx, lock).Val(); d <= 6900*time.Millisecond || d > 7*time.Second {
		t.Errorf("PTTL of the lock %s, want 7s", d)
	}
	if errs, err := b.Extend(ctx, []dlock.Lease{{Key: k, Token: tok, TTL: 20 * time.Second}}); err != nil || errs[0] != nil {
		t.Fatalf("Extend: %v %v", errs, err)
	}
	if d := c.PTTL(ctx, lock).Val(); d <= 19900*time.Millisecond {
		t.Errorf("PTTL after extending to 20s: %s", d)
	}
	if err := b.Release(ctx, k, tok); err != nil {
		t.Fatal(err)
	}
	if n := c.Exists(ctx, lock).Val(); n != 0 {
		t.Error("the lock key survived its release")
	}
	if d := c.TTL(ctx, fence).Val(); d != -1 {
		t.Errorf("the counter has TTL %s, want none", d)
	}
}

// TestPrefix checks that Backends with different prefixes do not see each
// other's locks, and that prefixes are validated.
func TestPrefix(t *testing.T) {
	s := startServer(t)
	a := locktest.NewLocker(t, newBackend(t, s.client(t), &redislock.Options{Prefix: "app-a:"}))
	b := locktest.NewLocker(t, newBackend(t, s.client(t), &redislock.Options{Prefix: "app-b:"}))
	ctx := ctxT(t, 10*time.Second)
	k := locktest.UniqueKey("prefix")
	la, err := a.TryAcquire(ctx, k)
	if err != nil {
		t.Fatal(err)
	}
	defer la.Release(ctx)
	lb, err := b.TryAcquire(ctx, k)
	if err != nil {
		t.Fatalf("a lock under another prefix excluded this one: %v", err)
	}
	defer lb.Release(ctx)
	if infos, err := b.List(ctx, ""); err != nil || len(infos) != 1 || infos[0].Fence != lb.Fence() {
		t.Errorf("List under app-b: %+v %v", infos, err)
	}
	for _, p := range []string{"a{", "}b", "{x}"} {
		if _, err := redislock.New(s.client(t), &redislock.Options{Prefix: p}); !errors.Is(err, dlock.ErrInvalidOption) {
			t.Errorf("prefix %q: %v, want ErrInvalidOption", p, err)
		}
	}
	if _, err := redislock.New(nil, nil); !errors.Is(err, dlock.ErrInvalidOption) {
		t.Errorf("nil client: %v, want ErrInvalidOption", err)
	}
}

// TestServerDown checks that an unreachable server is an error carrying
// go-redis's, never "not acquired", for both trying and waiting.
func TestServerDown(t *testing.T) {
	s := startServer(t)
	c := s.client(t)
	l := locktest.NewLocker(t, newBackend(t, c, nil))
	s.kill()
	ctx := ctxT(t, 20*time.Second)
	for _, acquire := range []func(context.Context, string, ...dlock.AcquireOption) (*dlock.Lock, error){l.TryAcquire, l.Acquire} {
		lk, err := acquire(ctx, "down")
		if lk != nil || err == nil || errors.Is(err, dlock.ErrNotAcquired) || !strings.Contains(err.Error(), "connect") {
			t.Errorf("server down: %v, %v; want go-redis's connection error", lk, err)
		}
	}
}

// TestNoChannelPermission runs with an ACL user that may not use pub/sub:
// releases still succeed (publishing is best effort), AcquireWait declines
// with ErrUnsupported, and a waiting Acquire falls back to backing off.
func TestNoChannelPermission(t *testing.T) {
	s := startServer(t)
	ctx := ctxT(t, 30*time.Second)
	if err := s.client(t).Do(ctx, "ACL", "SETUSER", "nochannels", "on", ">secret", "~*", "+@all", "resetchannels").Err(); err != nil {
		t.Fatal(err)
	}
	limited := func() *redis.Client {
		c := redis.NewClient(&redis.Options{Addr: s.addr(), Username: "nochannels", Password: "secret"})
		t.Cleanup(func() { c.Close() })
		return c
	}
	b := newBackend(t, limited(), nil)
	holder := locktest.NewLocker(t, b)
	waiter := locktest.NewLocker(t, newBackend(t, limited(), nil))
	k := locktest.UniqueKey("acl")
	lk, err := holder.TryAcquire(ctx, k, dlock.WithTTL(30*time.Second))
	if err != nil {
		t.Fatal(err)
	}
	if _, err := b.AcquireWait(ctx, dlock.Request{Key: k, Token: dlock.NewToken(), TTL: time.Second}); !errors.Is(err, dlock.ErrUnsupported) {
		t.Errorf("AcquireWait without channel rights: %v, want ErrUnsupported", err)
	}
	time.AfterFunc(300*time.Millisecond, func() {
		if err := lk.Release(context.Background()); err != nil {
			t.Errorf("Release without channel rights: %v", err)
		}
	})
	start := time.Now()
	w, err := waiter.Acquire(ctx, k)
	if err != nil {
		t.Fatalf("a waiter without channel rights: %v", err)
	}
	defer w.Release(ctx)
	if d := time.Since(start); d > 3*time.Second {
		t.Errorf("the waiter took %s to get a key released after 300ms", d)
	}
}

// TestWaiterSurvivesRestart restarts the server while a waiter waits on a
// 30s lease: the waiter's pub/sub connection comes back, and its
// resubscription wakes it to find the key gone, long before the lease.
func TestWaiterSurvivesRestart(t *testing.T) {
	s := startServer(t)
	holder := locktest.NewLocker(t, newBackend(t, s.client(t), nil))
	waiter := locktest.NewLocker(t, newBackend(t, s.client(t), nil))
	k := locktest.UniqueKey("waitrestart")
	if _, err := holder.TryAcquire(ctxT(t, 5*time.Second), k, dlock.WithTTL(30*time.Second)); err != nil {
		t.Fatal(err)
	}
	got := make(chan error, 1)
	go func() {
		w, err := waiter.Acquire(ctxT(t, 20*time.Second), k)
		if err == nil {
			w.Release(context.Background())
		}
		got <- err
	}()
	time.Sleep(300 * time.Millisecond)
	s.restart(t)
	restarted := time.Now()
	select {
	case err := <-got:
		if err != nil {
			t.Fatalf("waiter: %v", err)
		}
		if d := time.Since(restarted); d > 5*time.Second {
			t.Errorf("the waiter took %s after the restart", d)
		}
	case <-time.After(15 * time.Second):
		t.Fatal("the waiter was not woken by its resubscription after a restart")
	}
}

// TestExtendBatchOnOneServer renews 2,500 leases, some of them not ours, on
// a single server: each lease gets its own answer across the 1,000-lease
// script chunks, only ours are renewed, and the whole batch costs a handful
// of script calls rather than one per lease.
func TestExtendBatchOnOneServer(t *testing.T) {
	srv := startServer(t)
	c := newClient(t, srv.addr())
	b := newBackend(t, c, nil)
	ctx := ctxT(t, 60*time.Second)
	const n = 2500
	base := locktest.UniqueKey("batch")
	leases := make([]dlock.Lease, n)
	for i := range leases {
		leases[i] = dlock.Lease{Key: fmt.Sprintf("%s-%d", base, i), Token: dlock.NewToken(), TTL: 20 * time.Second}
		res, err := b.Acquire(ctx, dlock.Request{Key: leases[i].Key, Token: leases[i].Token, TTL: 5 * time.Second})
		if err != nil || !res.Acquired {
			t.Fatalf("Acquire %d: %+v %v", i, res, err)
		}
		if i%7 == 0 {
			leases[i].Token = dlock.NewToken() // not the holder's
		}
	}
	calls := func() int64 {
		var total int64
		for _, cmd := range []string{"evalsha", "eval"} {
			s, err := c.Do(ctx, "INFO", "commandstats").Text()
			if err != nil {
				t.Fatal(err)
			}
			if _, rest, ok := strings.Cut(s, "cmdstat_"+cmd+":calls="); ok {
				v, _, _ := strings.Cut(rest, ",")
				x, _ := strconv.ParseInt(v, 10, 64)
				total += x
			}
		}
		return total
	}
	before := calls()
	errs, err := b.Extend(ctx, leases)
	if err != nil || len(errs) != n {
		t.Fatalf("Extend: %d results, %v", len(errs), err)
	}
	if d := calls() - before; d > 6 { // 3 chunks, each possibly resent once after NOSCRIPT
		t.Errorf("%d script calls to renew %d leases, want ≤ 6 (one per 1,000)", d, n)
	}
	for i, l := range leases {
		pttl, err := c.PTTL(ctx, "dlock:{"+l.Key+"}").Result()
		if err != nil {
			t.Fatal(err)
		}
		switch {
		case i%7 == 0 && !errors.Is(errs[i], dlock.ErrNotHeld):
			t.Errorf("lease %d (not ours): %v, want ErrNotHeld", i, errs[i])
		case i%7 == 0 && pttl > 5*time.Second:
			t.Errorf("lease %d (not ours) was renewed: pttl %s", i, pttl)
		case i%7 != 0 && errs[i] != nil:
			t.Errorf("lease %d: %v", i, errs[i])
		case i%7 != 0 && pttl <= 5*time.Second:
			t.Errorf("lease %d not renewed: pttl %s", i, pttl)
		}
	}
}
