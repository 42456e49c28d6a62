package etcdlock_test

import (
	"context"
	"log"
	"time"

	"github.com/dlock-dev/dlock"
	"github.com/dlock-dev/dlock/etcdlock"
	clientv3 "go.etcd.io/etcd/client/v3"
)

// Example shows a Locker on etcd. The client is the caller's: give it every
// member's endpoint, so that losing one member costs an election, not the
// lock. (It needs a running etcd, so it is compiled but not run.)
func Example() {
	cli, err := clientv3.New(clientv3.Config{
		Endpoints:   []string{"etcd-1:2379", "etcd-2:2379", "etcd-3:2379"},
		DialTimeout: 5 * time.Second,
	})
	if err != nil {
		log.Fatal(err)
	}
	defer cli.Close() // after the Locker: the Backend never closes it

	b, err := etcdlock.New(cli, nil)
	if err != nil {
		log.Fatal(err)
	}
	defer b.Close() // after the Locker, before the client
	locker := dlock.New(b, &dlock.Options{TTL: 10 * time.Second})
	defer locker.Close(context.Background())

	err = locker.Do(context.Background(), "invoice:42", func(ctx context.Context) error {
		// ctx is cancelled if the lock is lost.
		return nil
	})
	if err != nil {
		log.Fatal(err)
	}
}

// ExampleBackend_HeldCmp writes to etcd only while the lock is held: the
// transaction fails, changing nothing, if the lock was lost meanwhile.
func ExampleBackend_HeldCmp() {
	ctx := context.Background()
	cli, err := clientv3.New(clientv3.Config{Endpoints: []string{"localhost:2379"}})
	if err != nil {
		log.Fatal(err)
	}
	defer cli.Close()
	b, err := etcdlock.New(cli, nil)
	if err != nil {
		log.Fatal(err)
	}
	defer b.Close()
	locker := dlock.New(b, nil)
	defer locker.Close(ctx)

	lock, err := locker.Acquire(ctx, "config")
	if err != nil {
		log.Fatal(err)
	}
	defer lock.Release(ctx)
	held, err := b.HeldCmp(ctx, lock.Key(), lock.Fence())
	if err != nil {
		log.Fatal(err) // dlock.ErrNotHeld: lost already
	}
	resp, err := cli.Txn(ctx).If(held).Then(clientv3.OpPut("config/current", "v2")).Commit()
	if err != nil {
		log.Fatal(err)
	}
	if !resp.Succeeded {
		log.Print("lost the lock; nothing written")
	}
}
