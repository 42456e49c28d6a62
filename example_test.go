package dlock_test

import (
	"context"
	"errors"
	"fmt"
	"testing"
	"time"

	"github.com/dlock-dev/dlock"
	"github.com/dlock-dev/dlock/memlock"
	"go.uber.org/goleak"
)

func TestMain(m *testing.M) { goleak.VerifyTestMain(m) }

// The examples use the in-memory backend; with MySQL the only change is
// the backend: b, err := mysqllock.New(db, nil).

func ExampleLocker_Do() {
	ctx := context.Background()
	locker := dlock.New(memlock.New(), nil)
	defer locker.Close(ctx)

	err := locker.Do(ctx, "invoice:42", func(ctx context.Context) error {
		// Only one process runs this at a time. ctx is cancelled if the
		// lock is lost; stop writing when it is.
		fmt.Println("sending invoice 42")
		return ctx.Err()
	}, dlock.WithTTL(15*time.Second))
	fmt.Println("err:", err)
	// Output:
	// sending invoice 42
	// err: <nil>
}

func ExampleLocker_TryAcquire() {
	ctx := context.Background()
	store := memlock.New()
	a := dlock.New(store, nil) // two Lockers on one store play two processes
	b := dlock.New(store, nil)
	defer a.Close(ctx)
	defer b.Close(ctx)

	lk, err := a.TryAcquire(ctx, "cron:nightly-report")
	if err != nil {
		panic(err)
	}
	_, err = b.TryAcquire(ctx, "cron:nightly-report")
	fmt.Println("second:", errors.Is(err, dlock.ErrNotAcquired))

	lk.Release(ctx)
	lk2, err := b.TryAcquire(ctx, "cron:nightly-report")
	fmt.Println("after release:", err == nil, lk2.Fence() > lk.Fence())
	lk2.Release(ctx)
	// Output:
	// second: true
	// after release: true true
}

func ExampleLocker_Acquire() {
	ctx := context.Background()
	locker := dlock.New(memlock.New(), nil)
	defer locker.Close(ctx)

	lk, err := locker.Acquire(ctx, "stock:sku-1", dlock.WithTTL(10*time.Second))
	if err != nil {
		panic(err)
	}
	defer lk.Release(context.Background())

	// A waiter gives up when its context ends; the error says both why.
	wctx, cancel := context.WithTimeout(ctx, 50*time.Millisecond)
	defer cancel()
	_, err = locker.Acquire(wctx, "stock:sku-1")
	fmt.Println(errors.Is(err, dlock.ErrNotAcquired), errors.Is(err, context.DeadlineExceeded))

	select {
	case <-lk.Done():
		fmt.Println("lost:", lk.Err())
	default:
		fmt.Println("still held, fence", lk.Fence())
	}
	// Output:
	// true true
	// still held, fence 1
}

func ExampleWithOwner() {
	ctx := context.Background()
	locker := dlock.New(memlock.New(), nil)
	defer locker.Close(ctx)

	outer, _ := locker.Acquire(ctx, "product:create", dlock.WithOwner("request-7"))
	inner, _ := locker.Acquire(ctx, "product:create", dlock.WithOwner("request-7")) // reentrant
	fmt.Println(outer.Fence() == inner.Fence())
	inner.Release(ctx)
	fmt.Println(outer.Err()) // still held by the outer acquisition
	outer.Release(ctx)
	fmt.Println(errors.Is(outer.Err(), dlock.ErrNotHeld))
	// Output:
	// true
	// <nil>
	// true
}

func ExampleLock_Context() {
	ctx := context.Background()
	locker := dlock.New(memlock.New(), nil)
	defer locker.Close(ctx)

	lk, _ := locker.Acquire(ctx, "report")
	work, cancel := lk.Context(ctx) // cancelled if the lock is lost or released
	defer cancel()
	lk.Release(ctx)
	<-work.Done()
	fmt.Println(errors.Is(context.Cause(work), dlock.ErrNotHeld))
	// Output:
	// true
}
