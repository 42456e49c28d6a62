package redislock_test

import (
	"context"
	"errors"
	"strconv"
	"strings"
	"testing"
	"time"

	"github.com/dlock-dev/dlock"
	"github.com/dlock-dev/dlock/redislock"
	"github.com/redis/go-redis/v9"
)

// startReplicated starts a primary and a replica of it, and waits until the
// primary counts the replica as connected and in sync.
func startReplicated(t *testing.T) (primary, replica *server) {
	t.Helper()
	// No delay before the first full sync (the default waits 5 s for
	// more replicas to join).
	primary = startServer(t, "--repl-diskless-sync-delay", "0")
	replica = startServer(t, "--replicaof", "127.0.0.1", strconv.Itoa(primary.port))
	waitReplicas(t, primary.client(t), 1)
	return primary, replica
}

// waitReplicas waits (bounded) until c's INFO reports n connected replicas
// in the online state and n replicas acknowledge a write (the primary marks
// a replica online when it has sent the data set, which the replica may
// still be loading: it acknowledges nothing until it is done).
func waitReplicas(t *testing.T, c *redis.Client, n int) {
	t.Helper()
	ctx := ctxT(t, 30*time.Second)
	for {
		info, err := c.Info(ctx, "replication").Result()
		if err == nil && onlineReplicas(info) == n {
			break
		}
		if ctx.Err() != nil {
			t.Fatalf("%d replicas never came online: %v\n%s", n, err, info)
		}
		time.Sleep(20 * time.Millisecond)
	}
	for {
		err := c.Set(ctx, "replicas-ready", 1, 0).Err()
		var acked int64
		if err == nil {
			acked, err = c.Wait(ctx, n, 100*time.Millisecond).Result()
		}
		if err == nil && acked >= int64(n) {
			return
		}
		if ctx.Err() != nil {
			t.Fatalf("%d replicas online, %d acknowledged a write: %v", n, acked, err)
		}
	}
}

// onlineReplicas counts the "slaveN:…state=online…" lines of INFO replication.
func onlineReplicas(info string) int {
	n := 0
	for _, line := range strings.Split(info, "\n") {
		if strings.HasPrefix(line, "slave") && strings.Contains(line, "state=online") {
			n++
		}
	}
	return n
}

func replicaRequest(key string, ttl time.Duration) dlock.Request {
	return dlock.Request{Key: key, Token: dlock.NewToken(), TTL: ttl}
}

func TestMinReplicasInvalid(t *testing.T) {
	c := redis.NewClient(&redis.Options{Addr: "127.0.0.1:1"})
	defer c.Close()
	if _, err := redislock.New(c, &redislock.Options{MinReplicas: -1}); !errors.Is(err, dlock.ErrInvalidOption) {
		t.Fatalf("MinReplicas -1: got %v, want ErrInvalidOption", err)
	}
	cc := redis.NewClusterClient(&redis.ClusterOptions{Addrs: []string{"127.0.0.1:1"}})
	defer cc.Close()
	if _, err := redislock.New(cc, &redislock.Options{MinReplicas: 1}); !errors.Is(err, dlock.ErrInvalidOption) {
		t.Fatalf("MinReplicas on a cluster client: got %v, want ErrInvalidOption", err)
	}
	b, err := redislock.New(c, &redislock.Options{MinReplicas: 2})
	if err != nil || b.MinReplicas() != 2 {
		t.Fatalf("MinReplicas 2: got %v, %v", b, err)
	}
}

// With a replica in sync, a grant and its extensions are acknowledged by it:
// the replica holds the lease when Acquire returns.
func TestMinReplicasGranted(t *testing.T) {
	primary, replica := startReplicated(t)
	b := newBackend(t, primary.client(t), &redislock.Options{MinReplicas: 1})
	ctx := ctxT(t, 30*time.Second)
	req := replicaRequest("repl-ok", 10*time.Second)
	res, err := b.Acquire(ctx, req)
	if err != nil || !res.Acquired {
		t.Fatalf("acquire: %+v, %v", res, err)
	}
	lock, _, _ := b.Names(req.Key)
	// Replicas acknowledge what they have applied: the lease is there.
	if tok, err := replica.client(t).HGet(ctx, lock, "token").Result(); err != nil || tok != req.Token.String() {
		t.Fatalf("replica's lease token: %q, %v; want %s", tok, err, req.Token)
	}
	errs, err := b.Extend(ctx, []dlock.Lease{{Key: req.Key, Token: req.Token, TTL: 10 * time.Second}})
	if err != nil || errs[0] != nil {
		t.Fatalf("extend: %v, %v", errs, err)
	}
	if err := b.Release(ctx, req.Key, req.Token); err != nil {
		t.Fatal(err)
	}
}

// assertFree checks that another client takes key at once.
func assertFree(t *testing.T, c redislock.Client, key string) {
	t.Helper()
	other := newBackend(t, c, nil)
	res, err := other.Acquire(ctxT(t, 10*time.Second), replicaRequest(key, 10*time.Second))
	if err != nil || !res.Acquired {
		t.Fatalf("the key was left held after a grant that was not replicated: %+v, %v", res, err)
	}
}

// A grant that too few replicas acknowledge in time does not count: it is
// released, and Acquire reports ErrNotReplicated.
func TestMinReplicasNotReplicated(t *testing.T) {
	t.Run("replica stopped", func(t *testing.T) {
		primary, replica := startReplicated(t)
		// SIGSTOP: the primary still counts the replica as connected, but
		// it acknowledges nothing.
		if err := replica.proc.Stop(); err != nil {
			t.Fatal(err)
		}
		t.Cleanup(func() { replica.proc.Cont() })
		checkNotReplicated(t, primary, 1)
	})
	t.Run("replica killed", func(t *testing.T) {
		primary, replica := startReplicated(t)
		replica.kill()
		checkNotReplicated(t, primary, 1)
	})
	t.Run("more replicas than there are", func(t *testing.T) {
		primary, _ := startReplicated(t)
		checkNotReplicated(t, primary, 2)
	})
}

func checkNotReplicated(t *testing.T, primary *server, min int) {
	t.Helper()
	c := primary.client(t)
	b := newBackend(t, c, &redislock.Options{MinReplicas: min})
	const ttl = 2 * time.Second
	for _, mode := range []dlock.Mode{dlock.ModeExclusive, dlock.ModeShared} {
		req := replicaRequest("repl-lost-"+mode.String(), ttl)
		req.Mode = mode
		res, err := b.Acquire(ctxT(t, 30*time.Second), req)
		if !errors.Is(err, redislock.ErrNotReplicated) || res.Acquired {
			t.Fatalf("%s acquire with %d replicas wanted: %+v, %v; want ErrNotReplicated", mode, min, res, err)
		}
		assertFree(t, c, req.Key)
	}

	// Through a Locker: the caller is told, and nothing stays held.
	l := dlock.New(b, nil)
	defer l.Close(context.Background())
	_, err := l.TryAcquire(ctxT(t, 30*time.Second), "repl-locker", dlock.WithTTL(ttl))
	if !errors.Is(err, redislock.ErrNotReplicated) {
		t.Fatalf("Locker.TryAcquire: %v; want ErrNotReplicated", err)
	}
	assertFree(t, c, "repl-locker")

	// The caller's deadline bounds the wait, even below the lease's share.
	ctx, cancel := context.WithTimeout(context.Background(), 200*time.Millisecond)
	defer cancel()
	_, err = b.Acquire(ctx, replicaRequest("repl-deadline", time.Minute))
	if err == nil {
		t.Fatal("acquire under a short deadline succeeded without replicas")
	}
	assertFree(t, c, "repl-deadline")
}

// An extension that too few replicas acknowledge is an error, not
// ErrNotHeld: the lease may still be held, and the Locker retries it until
// its safe deadline, then reports the lock lost.
func TestMinReplicasExtendNotReplicated(t *testing.T) {
	primary, replica := startReplicated(t)
	c := primary.client(t)
	b := newBackend(t, c, &redislock.Options{MinReplicas: 1})
	ctx := ctxT(t, 30*time.Second)
	// A long lease: WAIT is bounded by a quarter of it, room enough for a
	// replica on a loaded machine.
	req := replicaRequest("repl-extend", 8*time.Second)
	if res, err := b.Acquire(ctx, req); err != nil || !res.Acquired {
		t.Fatalf("acquire: %+v, %v", res, err)
	}
	replica.kill()
	errs, err := b.Extend(ctx, []dlock.Lease{{Key: req.Key, Token: req.Token, TTL: 8 * time.Second}})
	if err == nil && len(errs) == 1 {
		err = errs[0]
	}
	if !errors.Is(err, redislock.ErrNotReplicated) || errors.Is(err, dlock.ErrNotHeld) {
		t.Fatalf("extend without replicas: %v, %v; want ErrNotReplicated", errs, err)
	}

	// The Locker's lease ends by its deadline.
	primary2, replica2 := startReplicated(t)
	l := dlock.New(newBackend(t, primary2.client(t), &redislock.Options{MinReplicas: 1}), nil)
	defer l.Close(context.Background())
	k, err := l.TryAcquire(ctx, "repl-extend-locker", dlock.WithTTL(2*time.Second))
	if err != nil {
		t.Fatal(err)
	}
	replica2.kill()
	select {
	case <-k.Done():
		if !errors.Is(k.Err(), dlock.ErrLockLost) {
			t.Fatalf("lock ended with %v; want ErrLockLost", k.Err())
		}
	case <-ctx.Done():
		t.Fatal("the lock was kept without its renewals reaching a replica")
	}
}
