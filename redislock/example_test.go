package redislock_test

import (
	"context"
	"errors"
	"fmt"
	"time"

	"github.com/dlock-dev/dlock"
	"github.com/dlock-dev/dlock/redislock"
	"github.com/redis/go-redis/v9"
)

// The examples need a Redis server, so they are compiled but not run.

func Example() {
	ctx := context.Background()
	rdb := redis.NewClient(&redis.Options{Addr: "localhost:6379"})
	defer rdb.Close() // the caller owns the client; the Backend never closes it

	b, err := redislock.New(rdb, nil)
	if err != nil {
		panic(err)
	}
	locker := dlock.New(b, nil)
	defer locker.Close(ctx)

	err = locker.Do(ctx, "invoice:42", func(ctx context.Context) error {
		// Only one process runs this at a time; ctx is cancelled if the
		// lock is lost.
		return nil
	}, dlock.WithTTL(15*time.Second))
	fmt.Println(err)
}

func ExampleNewRedlock() {
	ctx := context.Background()
	var clients []redislock.Client
	for _, addr := range []string{"redis-a:6379", "redis-b:6379", "redis-c:6379"} {
		c := redis.NewClient(&redis.Options{Addr: addr})
		defer c.Close()
		clients = append(clients, c)
	}
	b, err := redislock.NewRedlock(clients, nil)
	if err != nil {
		panic(err)
	}
	locker := dlock.New(b, nil)
	defer locker.Close(ctx)

	lk, err := locker.Acquire(ctx, "report:daily")
	if err != nil {
		panic(err) // errors.Is(err, redislock.ErrNoQuorum) when most servers are down
	}
	defer lk.Release(ctx)
	fmt.Println("fence", lk.Fence()) // pass it to the storage you write to
}

func ExampleNew_cluster() {
	rdb := redis.NewClusterClient(&redis.ClusterOptions{Addrs: []string{"node-1:6379", "node-2:6379", "node-3:6379"}})
	defer rdb.Close()
	b, err := redislock.New(rdb, &redislock.Options{Prefix: "billing:"})
	if err != nil {
		panic(err)
	}
	locker := dlock.New(b, nil)
	defer locker.Close(context.Background())
}

func ExampleFencedSet() {
	ctx := context.Background()
	rdb := redis.NewClient(&redis.Options{Addr: "localhost:6379"})
	defer rdb.Close()
	b, err := redislock.New(rdb, nil)
	if err != nil {
		panic(err)
	}
	locker := dlock.New(b, nil)
	defer locker.Close(ctx)

	lock, err := locker.Acquire(ctx, "report")
	if err != nil {
		panic(err)
	}
	defer lock.Release(ctx)
	// The hash tag {report} keeps the record and the data in one slot of
	// a cluster. A holder that lost the lock to a newer one gets
	// ErrStaleFence here, and the value stays the newer holder's.
	err = redislock.FencedSet(ctx, rdb, "{report}", lock.Fence(), "{report}:latest", "v2", 0)
	if errors.Is(err, redislock.ErrStaleFence) {
		fmt.Println("lost the lock; nothing written")
	}
}

func ExampleFenced() {
	ctx := context.Background()
	rdb := redis.NewClient(&redis.Options{Addr: "localhost:6379"})
	defer rdb.Close()
	var fence uint64 = 42 // lock.Fence() of the lock guarding {orders}
	replies, err := redislock.Fenced(ctx, rdb, "{orders}", fence,
		[]string{"{orders}:total", "{orders}:log"},
		redislock.Cmd{"INCRBY", "{orders}:total", 3},
		redislock.Cmd{"RPUSH", "{orders}:log", "added 3"})
	fmt.Println(replies, err)
}
