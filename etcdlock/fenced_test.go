package etcdlock_test

import (
	"context"
	"errors"
	"fmt"
	"math"
	"strconv"
	"strings"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/dlock-dev/dlock"
	"github.com/dlock-dev/dlock/etcdlock"
	"github.com/dlock-dev/dlock/locktest"
	clientv3 "go.etcd.io/etcd/client/v3"
)

// backendOver returns a Backend over c.
func backendOver(t *testing.T, c *clientv3.Client) *etcdlock.Backend {
	t.Helper()
	b, err := etcdlock.New(c, nil)
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { b.Close() })
	return b
}

// guardedPut puts data=v in a transaction guarded by cmp, reporting
// whether it committed.
func guardedPut(t *testing.T, c *clientv3.Client, cmp clientv3.Cmp, data, v string) bool {
	t.Helper()
	resp, err := c.Txn(ctxT(t, 10*time.Second)).If(cmp).Then(clientv3.OpPut(data, v)).Commit()
	if err != nil {
		t.Fatal(err)
	}
	return resp.Succeeded
}

func value(t *testing.T, c *clientv3.Client, k string) string {
	t.Helper()
	resp, err := c.Get(ctxT(t, 10*time.Second), k)
	if err != nil {
		t.Fatal(err)
	}
	if len(resp.Kvs) == 0 {
		return ""
	}
	return string(resp.Kvs[0].Value)
}

// TestHeldCmpHoldsWhileTheLockIsHeld follows one key through a holder, a
// waiter queued behind it, the release, and the waiter's turn.
func TestHeldCmpHoldsWhileTheLockIsHeld(t *testing.T) {
	eps := endpoints(t)
	c := newClient(t, eps...)
	b1, b2 := backendOver(t, c), backendOver(t, newClient(t, eps...))
	l1, l2 := locktest.NewLocker(t, b1), locktest.NewLocker(t, b2)
	ctx := ctxT(t, 60*time.Second)
	key := locktest.UniqueKey("heldcmp")
	data := "data/" + key

	lock, err := l1.Acquire(ctx, key, dlock.WithTTL(2*time.Second))
	if err != nil {
		t.Fatal(err)
	}
	cmp, err := b1.HeldCmp(ctx, lock.Key(), lock.Fence())
	if err != nil {
		t.Fatal(err)
	}
	if !guardedPut(t, c, cmp, data, "first") {
		t.Fatal("a transaction guarded by a held lock did not commit")
	}
	if _, err := b1.HeldCmp(ctx, key, lock.Fence()+1); !errors.Is(err, dlock.ErrNotHeld) {
		t.Fatalf("HeldCmp of a fence nobody holds: err = %v, want ErrNotHeld", err)
	}

	// A waiter queues an entry of its own, which is not the holder's.
	type acquired struct {
		lock *dlock.Lock
		err  error
	}
	got := make(chan acquired, 1)
	go func() {
		next, err := l2.Acquire(ctx, key, dlock.WithTTL(2*time.Second))
		got <- acquired{next, err}
	}()
	waiter := waitForEntries(t, c, key, 2)[1]
	if _, err := b2.HeldCmp(ctx, key, uint64(waiter)); !errors.Is(err, dlock.ErrNotHeld) {
		t.Fatalf("HeldCmp of a waiting entry: err = %v, want ErrNotHeld", err)
	}
	if !guardedPut(t, c, cmp, data, "second") {
		t.Fatal("a waiter queued behind the holder broke its comparison")
	}

	if err := lock.Release(ctx); err != nil {
		t.Fatal(err)
	}
	if guardedPut(t, c, cmp, data, "after release") {
		t.Fatal("a transaction guarded by a released lock committed")
	}
	if _, err := b1.HeldCmp(ctx, key, lock.Fence()); !errors.Is(err, dlock.ErrNotHeld) {
		t.Fatalf("HeldCmp after the release: err = %v, want ErrNotHeld", err)
	}

	a := <-got
	if a.err != nil {
		t.Fatal(a.err)
	}
	next := a.lock
	defer next.Release(ctx)
	if next.Fence() != uint64(waiter) {
		t.Fatalf("the waiter's fence is %d, its entry's create revision %d", next.Fence(), waiter)
	}
	if guardedPut(t, c, cmp, data, "old holder") {
		t.Fatal("the old holder's transaction committed while another holds the key")
	}
	cmp2, err := b2.HeldCmp(ctx, key, next.Fence())
	if err != nil {
		t.Fatal(err)
	}
	if !guardedPut(t, c, cmp2, data, "third") {
		t.Fatal("the new holder's transaction did not commit")
	}
	if v := value(t, c, data); v != "third" {
		t.Fatalf("data = %q, want %q", v, "third")
	}
}

// waitForEntries waits until key has n entries and returns their create
// revisions in queue order.
func waitForEntries(t *testing.T, c *clientv3.Client, key string, n int) []int64 {
	t.Helper()
	dir := etcdlock.DefaultPrefix + strings.ReplaceAll(key, "/", "%2F") + "/"
	deadline := time.Now().Add(30 * time.Second)
	for {
		resp, err := c.Get(ctxT(t, 10*time.Second), dir, clientv3.WithPrefix(), clientv3.WithSort(clientv3.SortByCreateRevision, clientv3.SortAscend))
		if err != nil {
			t.Fatal(err)
		}
		if len(resp.Kvs) >= n {
			var revs []int64
			for _, kv := range resp.Kvs {
				revs = append(revs, kv.CreateRevision)
			}
			return revs
		}
		if time.Now().After(deadline) {
			t.Fatalf("%q has %d entries, want %d", key, len(resp.Kvs), n)
		}
		time.Sleep(20 * time.Millisecond)
	}
}

// TestHeldCmpFailsAfterTheLeaseExpired takes a lease that nobody renews:
// once etcd revokes it and another Locker takes the key, the first
// holder's comparison is false.
func TestHeldCmpFailsAfterTheLeaseExpired(t *testing.T) {
	eps := endpoints(t)
	c := newClient(t, eps...)
	b := backendOver(t, c)
	ctx := ctxT(t, 60*time.Second)
	key := locktest.UniqueKey("heldcmp")
	data := "data/" + key

	res, err := b.Acquire(ctx, dlock.Request{Key: key, Token: dlock.NewToken(), TTL: time.Second})
	if err != nil || !res.Acquired {
		t.Fatalf("Acquire: %+v %v", res, err)
	}
	cmp, err := b.HeldCmp(ctx, key, res.Fence)
	if err != nil {
		t.Fatal(err)
	}
	if !guardedPut(t, c, cmp, data, "first") {
		t.Fatal("a transaction guarded by a held lock did not commit")
	}

	next, err := locktest.NewLocker(t, backendOver(t, newClient(t, eps...))).Acquire(ctx, key, dlock.WithTTL(2*time.Second))
	if err != nil {
		t.Fatal(err)
	}
	defer next.Release(ctx)
	if guardedPut(t, c, cmp, data, "expired") {
		t.Fatal("a transaction guarded by an expired lease committed")
	}
	if _, err := b.HeldCmp(ctx, key, res.Fence); !errors.Is(err, dlock.ErrNotHeld) {
		t.Fatalf("HeldCmp of the expired lease: err = %v, want ErrNotHeld", err)
	}
	if v := value(t, c, data); v != "first" {
		t.Fatalf("data = %q, want %q", v, "first")
	}
}

// TestHeldCmpShared checks that every shared holder's comparison holds,
// and a writer's queued behind them is refused.
func TestHeldCmpShared(t *testing.T) {
	eps := endpoints(t)
	c := newClient(t, eps...)
	b := backendOver(t, c)
	ctx := ctxT(t, 60*time.Second)
	key := locktest.UniqueKey("heldcmp")
	var cmps []clientv3.Cmp
	for range 2 {
		r, err := locktest.NewLocker(t, b).Acquire(ctx, key, dlock.Shared(), dlock.WithTTL(2*time.Second))
		if err != nil {
			t.Fatal(err)
		}
		defer r.Release(ctx)
		cmp, err := b.HeldCmp(ctx, key, r.Fence())
		if err != nil {
			t.Fatal(err)
		}
		cmps = append(cmps, cmp)
	}
	// A writer queues behind the readers.
	wctx, stop := context.WithCancel(ctx)
	done := make(chan error, 1)
	go func() {
		_, err := locktest.NewLocker(t, backendOver(t, newClient(t, eps...))).Acquire(wctx, key, dlock.WithTTL(2*time.Second))
		done <- err
	}()
	writer := waitForEntries(t, c, key, 3)[2]
	if _, err := b.HeldCmp(ctx, key, uint64(writer)); !errors.Is(err, dlock.ErrNotHeld) {
		t.Errorf("HeldCmp of a queued writer: err = %v, want ErrNotHeld", err)
	}
	for i, cmp := range cmps {
		if !guardedPut(t, c, cmp, "data/"+key, strconv.Itoa(i)) {
			t.Errorf("reader %d's transaction did not commit", i)
		}
	}
	stop()
	if err := <-done; !errors.Is(err, dlock.ErrNotAcquired) {
		t.Errorf("the writer's wait ended with %v, want ErrNotAcquired", err)
	}
}

func TestHeldCmpRejectsBadInputBeforeIO(t *testing.T) {
	b := newBackend(t, endpoints(t))
	ctx, cancel := context.WithCancel(context.Background())
	cancel() // I/O would fail with the context's error
	for _, tc := range []struct {
		key   string
		fence uint64
		want  error
	}{
		{"", 1, dlock.ErrInvalidKey},
		{"a\x00b", 1, dlock.ErrInvalidKey},
		{"k", 0, dlock.ErrInvalidOption},
		{"k", math.MaxInt64 + 1, dlock.ErrInvalidOption},
	} {
		if _, err := b.HeldCmp(ctx, tc.key, tc.fence); !errors.Is(err, tc.want) {
			t.Errorf("HeldCmp(%q, %d): err = %v, want %v", tc.key, tc.fence, err, tc.want)
		}
	}
}

func TestFencedTxnAcceptsEqualAndHigherRefusesLower(t *testing.T) {
	c := newClient(t, endpoints(t)...)
	ctx := ctxT(t, 30*time.Second)
	res := locktest.UniqueKey("fenced")
	data := "data/" + res

	for _, step := range []struct {
		fence uint64
		value string
		stale bool
	}{
		{5, "a", false},
		{5, "b", false},
		{700, "c", false}, // more digits: compared as numbers, not as text
		{69, "d", true},
		{1, "e", true},
		{700, "f", false},
		{math.MaxUint64, "g", false},
		{math.MaxUint64 - 1, "h", true},
	} {
		resps, err := etcdlock.FencedTxn(ctx, c, res, step.fence, clientv3.OpPut(data, step.value), clientv3.OpGet(data))
		if step.stale != errors.Is(err, etcdlock.ErrStaleFence) || (!step.stale && err != nil) {
			t.Fatalf("fence %d: err = %v, want stale=%v", step.fence, err, step.stale)
		}
		if !step.stale {
			if len(resps) != 2 || string(resps[1].GetResponseRange().GetKvs()[0].Value) != step.value {
				t.Fatalf("fence %d: responses %v, want the put's and the get's", step.fence, resps)
			}
		}
	}
	if v := value(t, c, data); v != "g" {
		t.Fatalf("data = %q, want %q: a refused write changed it", v, "g")
	}
}

// TestFencedTxnConcurrentWritesNeverDecrease has 8 writers present fences
// drawn from one counter, each writing a log entry in a fenced
// transaction: in commit order, the entries' fences never decrease.
func TestFencedTxnConcurrentWritesNeverDecrease(t *testing.T) {
	c := newClient(t, endpoints(t)...)
	ctx := ctxT(t, 2*time.Minute)
	res := locktest.UniqueKey("fenced")
	log := "log/" + res + "/"

	const writers, perWriter = 8, 100
	var next atomic.Uint64
	var accepted, refused atomic.Int64
	var wg sync.WaitGroup
	for w := range writers {
		wg.Go(func() {
			for i := range perWriter {
				fence := next.Add(1)
				for j := range 2 { // a holder writes many times
					_, err := etcdlock.FencedTxn(ctx, c, res, fence, clientv3.OpPut(fmt.Sprintf("%s%d-%d-%d", log, w, i, j), strconv.FormatUint(fence, 10)))
					switch {
					case errors.Is(err, etcdlock.ErrStaleFence):
						refused.Add(1)
					case err != nil:
						t.Error(err)
						return
					default:
						accepted.Add(1)
					}
				}
			}
		})
	}
	wg.Wait()
	if t.Failed() {
		return
	}
	resp, err := c.Get(ctx, log, clientv3.WithPrefix(), clientv3.WithSort(clientv3.SortByCreateRevision, clientv3.SortAscend))
	if err != nil {
		t.Fatal(err)
	}
	var prev uint64
	for _, kv := range resp.Kvs {
		f, err := strconv.ParseUint(string(kv.Value), 10, 64)
		if err != nil {
			t.Fatal(err)
		}
		if f < prev {
			t.Fatalf("%s = %d committed after %d: a stale write was applied (%d accepted, %d refused)", kv.Key, f, prev, accepted.Load(), refused.Load())
		}
		prev = f
	}
	if int64(len(resp.Kvs)) != accepted.Load() {
		t.Fatalf("%d entries, %d writes accepted", len(resp.Kvs), accepted.Load())
	}
	if refused.Load() == 0 {
		t.Fatal("no write was refused: the writers did not interleave, the test proves nothing")
	}
	t.Logf("%d writes accepted, %d refused", accepted.Load(), refused.Load())
}

func TestFencedTxnRejectsBadInputBeforeIO(t *testing.T) {
	c := newClient(t, endpoints(t)...)
	ctx, cancel := context.WithCancel(context.Background())
	cancel()
	if _, err := etcdlock.FencedTxn(ctx, c, "", 1); !errors.Is(err, dlock.ErrInvalidKey) {
		t.Errorf("empty resource: err = %v", err)
	}
	if _, err := etcdlock.FencedTxn(ctx, c, "r", 0); !errors.Is(err, dlock.ErrInvalidOption) {
		t.Errorf("fence 0: err = %v", err)
	}
}
