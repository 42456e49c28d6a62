package redislock_test

import (
	"context"
	"errors"
	"testing"
	"time"

	"github.com/dlock-dev/dlock"
	"github.com/dlock-dev/dlock/locktest"
	"github.com/dlock-dev/dlock/redislock"
	"github.com/redis/go-redis/v9"
)

// newRedlock returns a Redlock over new clients of addrs.
func newRedlock(t testing.TB, addrs []string, opts *redislock.RedlockOptions) *redislock.Redlock {
	t.Helper()
	var clients []redislock.Client
	for _, a := range addrs {
		clients = append(clients, newClient(t, a))
	}
	r, err := redislock.NewRedlock(clients, opts)
	if err != nil {
		t.Fatal(err)
	}
	return r
}

func addrsOf(servers []*server) []string {
	var out []string
	for _, s := range servers {
		out = append(out, s.addr())
	}
	return out
}

func startServers(t *testing.T, n int) []*server {
	var out []*server
	for range n {
		out = append(out, startServer(t))
	}
	return out
}

func TestConformanceRedlock(t *testing.T) {
	addrs := serversFromEnv(t, envRedlock, 3, false)
	locktest.Run(t, func(t *testing.T) dlock.Backend { return newRedlock(t, addrs, nil) })
}

// TestRedlockMinorityFailure checks that Redlock keeps working, and keeps a
// held lock, while one server of three is down, and after it comes back
// empty.
func TestRedlockMinorityFailure(t *testing.T) {
	servers := startServers(t, 3)
	addrs := addrsOf(servers)
	l1 := locktest.NewLocker(t, newRedlock(t, addrs, nil))
	l2 := locktest.NewLocker(t, newRedlock(t, addrs, nil))
	ctx := ctxT(t, 60*time.Second)
	k := locktest.UniqueKey("minority")
	lk, err := l1.TryAcquire(ctx, k, dlock.WithTTL(2*time.Second))
	if err != nil {
		t.Fatal(err)
	}
	servers[0].kill()
	time.Sleep(3 * time.Second) // past the TTL: renewals reach a majority
	if err := lk.Err(); err != nil {
		t.Fatalf("rule: a lock survives a minority failure; %v", err)
	}
	if _, err := l2.TryAcquire(ctx, k); !errors.Is(err, dlock.ErrNotAcquired) {
		t.Fatalf("another client with one server down: %v, want ErrNotAcquired", err)
	}
	if infos, err := l2.List(ctx, k); err != nil || len(infos) != 1 || infos[0].Fence != lk.Fence() {
		t.Errorf("List with one server down: %+v %v", infos, err)
	}
	time.AfterFunc(200*time.Millisecond, func() { lk.Release(context.Background()) })
	w, err := l2.Acquire(ctx, k, dlock.WithTTL(2*time.Second))
	if err != nil {
		t.Fatalf("a waiter with one server down: %v", err)
	}
	if w.Fence() <= lk.Fence() {
		t.Errorf("fencing: %d after %d", w.Fence(), lk.Fence())
	}
	// The server comes back without its data; the holder keeps the lock
	// and the next one still counts up.
	servers[0].restart(t)
	time.Sleep(time.Second)
	if err := w.Err(); err != nil {
		t.Fatalf("lock lost when a server came back empty: %v", err)
	}
	if err := w.Release(ctx); err != nil {
		t.Fatal(err)
	}
	w2, err := l1.TryAcquire(ctx, k)
	if err != nil {
		t.Fatal(err)
	}
	defer w2.Release(ctx)
	if w2.Fence() <= w.Fence() {
		t.Errorf("fencing: %d after %d", w2.Fence(), w.Fence())
	}
}

// TestRedlockMajorityFailure checks that with two servers of three down,
// acquisitions fail with ErrNoQuorum, never "not acquired", and a held lock
// is reported lost within its lease.
func TestRedlockMajorityFailure(t *testing.T) {
	servers := startServers(t, 3)
	l := locktest.NewLocker(t, newRedlock(t, addrsOf(servers), nil))
	ctx := ctxT(t, 60*time.Second)
	held, err := l.TryAcquire(ctx, locktest.UniqueKey("held"), dlock.WithTTL(2*time.Second))
	if err != nil {
		t.Fatal(err)
	}
	servers[0].kill()
	servers[1].kill()

	k := locktest.UniqueKey("majority")
	for name, acquire := range map[string]func(context.Context, string, ...dlock.AcquireOption) (*dlock.Lock, error){
		"TryAcquire": l.TryAcquire, "Acquire": l.Acquire,
	} {
		start := time.Now()
		lk, err := acquire(ctxT(t, 10*time.Second), k)
		if lk != nil || !errors.Is(err, redislock.ErrNoQuorum) || errors.Is(err, dlock.ErrNotAcquired) {
			t.Errorf("%s with a majority down: %v, %v; want ErrNoQuorum and not ErrNotAcquired", name, lk, err)
		}
		if d := time.Since(start); d > 5*time.Second {
			t.Errorf("%s took %s to fail", name, d)
		}
	}
	if _, err := l.List(ctx, ""); !errors.Is(err, redislock.ErrNoQuorum) {
		t.Errorf("List with a majority down: %v, want ErrNoQuorum", err)
	}
	select {
	case <-held.Done():
	case <-time.After(3 * time.Second):
		t.Fatal("a lock whose majority is gone was not reported lost within its lease")
	}
	if !errors.Is(held.Err(), dlock.ErrLockLost) {
		t.Errorf("Err = %v, want ErrLockLost", held.Err())
	}
}

// TestRedlockFencingAfterDivergence makes the servers' counters differ and
// checks that a later majority without the most advanced server still hands
// out a larger token: the granting majority's lagging counters were raised.
func TestRedlockFencingAfterDivergence(t *testing.T) {
	servers := startServers(t, 3)
	a, b := servers[0], servers[1]
	ctx := ctxT(t, 30*time.Second)
	k := locktest.UniqueKey("diverge")
	_, fenceKey, _ := newBackend(t, a.client(t), nil).Names(k)
	// A counted acquisitions the others missed.
	if err := a.client(t).Set(ctx, fenceKey, 100, 0).Err(); err != nil {
		t.Fatal(err)
	}
	servers[2].kill()
	r := newRedlock(t, addrsOf(servers), nil)
	tok := dlock.NewToken()
	res, err := r.Acquire(ctx, dlock.Request{Key: k, Token: tok, TTL: 5 * time.Second})
	if err != nil || !res.Acquired || res.Fence != 101 {
		t.Fatalf("Acquire over A and B: %+v %v, want fence 101", res, err)
	}
	if got, _ := b.client(t).Get(ctx, fenceKey).Int64(); got != 101 {
		t.Errorf("B's counter is %d, want raised to 101", got)
	}
	if err := r.Release(ctx, k, tok); err != nil {
		t.Fatal(err)
	}
	servers[2].restart(t)
	a.kill()
	tok = dlock.NewToken()
	res2, err := r.Acquire(ctx, dlock.Request{Key: k, Token: tok, TTL: 5 * time.Second})
	if err != nil || !res2.Acquired {
		t.Fatalf("Acquire over B and C: %+v %v", res2, err)
	}
	if res2.Fence <= res.Fence {
		t.Errorf("rule: fencing increases across majorities; %d after %d", res2.Fence, res.Fence)
	}
	r.Release(ctx, k, tok)
}

// TestRedlockSplitVote checks that a key held by others on a majority is
// "not acquired", and that the attempt leaves nothing behind on the servers
// it did get.
func TestRedlockSplitVote(t *testing.T) {
	servers := startServers(t, 3)
	r := newRedlock(t, addrsOf(servers), nil)
	ctx := ctxT(t, 30*time.Second)
	k := locktest.UniqueKey("split")
	// Others hold the key on two servers (as a single-server lock each).
	for _, s := range servers[:2] {
		b := newBackend(t, s.client(t), nil)
		if res, err := b.Acquire(ctx, dlock.Request{Key: k, Token: dlock.NewToken(), Owner: "other", TTL: 10 * time.Second}); err != nil || !res.Acquired {
			t.Fatalf("%+v %v", res, err)
		}
	}
	res, err := r.Acquire(ctx, dlock.Request{Key: k, Token: dlock.NewToken(), TTL: 5 * time.Second})
	if err != nil || res.Acquired {
		t.Fatalf("Acquire against a majority held by others: %+v %v, want not acquired", res, err)
	}
	if res.Holder.Owner != "other" || res.Remaining <= 0 || res.Remaining > 10*time.Second {
		t.Errorf("holder %+v remaining %s", res.Holder, res.Remaining)
	}
	lock, _, _ := newBackend(t, servers[2].client(t), nil).Names(k)
	if n := servers[2].client(t).Exists(ctx, lock).Val(); n != 0 {
		t.Error("the failed attempt left its lock on the third server")
	}
}

func TestRedlockOptions(t *testing.T) {
	c := redis.NewClient(&redis.Options{Addr: "127.0.0.1:1"})
	defer c.Close()
	for name, tc := range map[string]struct {
		clients []redislock.Client
		opts    *redislock.RedlockOptions
	}{
		"no clients":       {nil, nil},
		"nil client":       {[]redislock.Client{c, nil, c}, nil},
		"negative drift":   {[]redislock.Client{c}, &redislock.RedlockOptions{DriftFactor: -0.1}},
		"drift too large":  {[]redislock.Client{c}, &redislock.RedlockOptions{DriftFactor: 0.5}},
		"negative timeout": {[]redislock.Client{c}, &redislock.RedlockOptions{NodeTimeout: -time.Second}},
		"brace in prefix":  {[]redislock.Client{c}, &redislock.RedlockOptions{Prefix: "x{"}},
	} {
		if _, err := redislock.NewRedlock(tc.clients, tc.opts); !errors.Is(err, dlock.ErrInvalidOption) {
			t.Errorf("%s: %v, want ErrInvalidOption", name, err)
		}
	}
}

// TestRedlockWatchMinority checks Redlock's Watch with one server of three
// down: it starts, reports a grant, and closes when a second server goes
// (fewer than the servers that must see every grant are left).
func TestRedlockWatchMinority(t *testing.T) {
	servers := startServers(t, 3)
	r := newRedlock(t, addrsOf(servers), nil)
	servers[0].kill()
	k := locktest.UniqueKey("watched")
	ctx := ctxT(t, 60*time.Second)
	ch, err := r.Watch(ctx, k)
	if err != nil {
		t.Fatalf("Watch with one server of three down: %v", err)
	}
	l := locktest.NewLocker(t, newRedlock(t, addrsOf(servers), nil))
	lk, err := l.TryAcquire(ctx, k, dlock.WithTTL(5*time.Second))
	if err != nil {
		t.Fatal(err)
	}
	defer lk.Release(context.Background())
	select {
	case _, open := <-ch:
		if !open {
			t.Fatal("the watch closed with two servers of three up")
		}
	case <-time.After(10 * time.Second):
		t.Fatal("a grant was not reported within 10 s")
	}
	servers[1].kill()
	deadline := time.After(30 * time.Second)
	for {
		select {
		case _, open := <-ch:
			if !open {
				return
			}
			continue
		case <-deadline:
			t.Fatal("the watch stayed open with one server of three up")
		}
		break
	}
}
