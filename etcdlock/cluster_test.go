package etcdlock_test

import (
	"context"
	"errors"
	"testing"
	"time"

	"github.com/dlock-dev/dlock"
	"github.com/dlock-dev/dlock/locktest"
	clientv3 "go.etcd.io/etcd/client/v3"
)

// leader returns the index of the cluster's leader, asking every member that
// is not stopped.
func (c *cluster) leader(t *testing.T) int {
	t.Helper()
	cli := newClient(t, c.endpoints()...)
	for range 100 { // an election may be under way
		for i, m := range c.members {
			if m.proc.Stopped() {
				continue
			}
			ctx, cancel := context.WithTimeout(context.Background(), time.Second)
			st, err := cli.Status(ctx, m.endpoint())
			cancel()
			if err == nil && st.Leader != 0 && st.Leader == st.Header.MemberId {
				return i
			}
		}
		time.Sleep(50 * time.Millisecond)
	}
	t.Fatal("no leader found")
	return -1
}

// TestClusterMemberLoss kills one member of a three-member cluster while a
// lock is held by a client that knows every member: the lock stays held
// (renewal goes on through the others), and other clients can still take
// free keys and wait for held ones.
func TestClusterMemberLoss(t *testing.T) {
	for _, victim := range []string{"follower", "leader"} {
		t.Run(victim, func(t *testing.T) {
			c := startCluster(t, 3)
			eps := c.endpoints()
			const ttl = 4 * time.Second // outlasts an election and a request timeout
			a := locktest.NewLocker(t, newBackend(t, eps))
			b := locktest.NewLocker(t, newBackend(t, eps))
			k := locktest.UniqueKey("member-loss")
			lk, err := a.TryAcquire(ctxT(t, 10*time.Second), k, dlock.WithTTL(ttl))
			if err != nil {
				t.Fatal(err)
			}
			ld := c.leader(t)
			i := ld
			if victim == "follower" {
				i = (ld + 1) % len(c.members)
			}
			killed := time.Now()
			c.members[i].kill()
			t.Logf("killed %s %s", victim, c.members[i].name)

			// A free key can be taken through the surviving members.
			ko := locktest.UniqueKey("member-loss-other")
			other, err := b.TryAcquire(ctxT(t, 15*time.Second), ko, dlock.WithTTL(ttl))
			if err != nil {
				resp, gerr := newClient(t, eps...).Get(ctxT(t, 5*time.Second), "dlock/", clientv3.WithPrefix())
				if gerr == nil {
					for _, kv := range resp.Kvs {
						t.Logf("%s cr=%d mr=%d lease=%x %s", kv.Key, kv.CreateRevision, kv.ModRevision, kv.Lease, kv.Value)
					}
				}
				t.Fatalf("acquisition after the %s was killed: %v", victim, err)
			}
			other.Release(context.Background())

			// The held lock survives more than a TTL, so it was renewed
			// after the kill.
			select {
			case <-lk.Done():
				t.Fatalf("the lock was lost after the %s was killed: %v", victim, lk.Err())
			case <-time.After(time.Until(killed.Add(ttl + time.Second))):
			}
			if !lk.Deadline().After(killed.Add(ttl / 2)) {
				t.Errorf("no renewal since the kill: deadline %s after it", lk.Deadline().Sub(killed))
			}
			if _, err := b.TryAcquire(ctxT(t, 10*time.Second), k, dlock.WithTTL(ttl)); !errors.Is(err, dlock.ErrNotAcquired) {
				t.Errorf("the held key was not held: %v", err)
			}

			// A waiter is handed the key when it is released.
			got := make(chan *dlock.Lock, 1)
			go func() {
				w, err := b.Acquire(ctxT(t, 20*time.Second), k, dlock.WithTTL(ttl))
				if err != nil {
					t.Errorf("waiter: %v", err)
				}
				got <- w
			}()
			time.Sleep(200 * time.Millisecond)
			if err := lk.Release(ctxT(t, 10*time.Second)); err != nil {
				t.Fatalf("release: %v", err)
			}
			w := <-got
			if w == nil {
				return
			}
			if w.Fence() <= lk.Fence() {
				t.Errorf("fencing: %d after %d", w.Fence(), lk.Fence())
			}
			w.Release(context.Background())
		})
	}
}

// TestClusterPartitionedHolder stops (SIGSTOP) the member that the holder's
// client is pinned to: the holder cannot renew and is told of the loss, and
// a waiter on the other members gets the key once the lease expires, with a
// larger fence, never before the holder was told.
func TestClusterPartitionedHolder(t *testing.T) {
	for _, victim := range []string{"follower", "leader"} {
		t.Run(victim, func(t *testing.T) {
			c := startCluster(t, 3)
			ld := c.leader(t)
			i := ld
			if victim == "follower" {
				i = (ld + 1) % len(c.members)
			}
			pinned := c.members[i]
			var rest []string
			for j, m := range c.members {
				if j != i {
					rest = append(rest, m.endpoint())
				}
			}
			const ttl = 2 * time.Second
			a := locktest.NewLocker(t, newBackend(t, []string{pinned.endpoint()}))
			b := locktest.NewLocker(t, newBackend(t, rest))
			t.Cleanup(pinned.cont) // before the clients close
			k := locktest.UniqueKey("partition")
			lk, err := a.TryAcquire(ctxT(t, 10*time.Second), k, dlock.WithTTL(ttl))
			if err != nil {
				t.Fatal(err)
			}
			got := make(chan *dlock.Lock, 1)
			go func() {
				w, err := b.Acquire(ctxT(t, 30*time.Second), k, dlock.WithTTL(ttl))
				if err != nil {
					t.Errorf("waiter: %v", err)
				}
				select {
				case <-lk.Done():
				default:
					t.Error("rule: a holder is told of the loss first; the waiter got the key before the old holder's Done closed")
				}
				got <- w
			}()
			time.Sleep(300 * time.Millisecond)
			pinned.stop()
			t.Logf("stopped %s %s", victim, pinned.name)

			select {
			case <-lk.Done():
			case <-time.After(2 * ttl):
				t.Fatalf("the cut-off holder was not told of the loss within %s", 2*ttl)
			}
			if !errors.Is(lk.Err(), dlock.ErrLockLost) {
				t.Errorf("holder Err: %v, want ErrLockLost", lk.Err())
			}
			w := <-got
			if w == nil {
				return
			}
			defer w.Release(context.Background())
			if w.Fence() <= lk.Fence() {
				t.Errorf("fencing: the next holder got %d after %d", w.Fence(), lk.Fence())
			}
			pinned.cont()
		})
	}
}
