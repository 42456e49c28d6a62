package zklock_test

import (
	"context"
	"errors"
	"testing"
	"time"

	"github.com/dlock-dev/dlock"
	"github.com/dlock-dev/dlock/locktest"
)

// TestEnsembleSurvivesLossOfOneMember kills the member a holder's session
// is connected to: the client moves to another member within the session
// timeout, renewals go on, and the lock is neither lost nor taken.
func TestEnsembleSurvivesLossOfOneMember(t *testing.T) {
	ss := startEnsemble(t, 3)
	addrs := []string{ss[0].addr(), ss[1].addr(), ss[2].addr()}
	conn := newConn(t, addrs...)
	l := locktest.NewLocker(t, newBackend(t, conn))
	other := locktest.NewLocker(t, newBackend(t, newConn(t, addrs...)))
	k := locktest.UniqueKey("ensemble")
	lk, err := l.TryAcquire(ctxT(t, 20*time.Second), k, dlock.WithTTL(5*time.Second))
	if err != nil {
		t.Fatal(err)
	}
	var victim *server
	for _, s := range ss {
		if s.addr() == conn.Server() {
			victim = s
		}
	}
	if victim == nil {
		t.Fatalf("the holder's connection %q is to none of %v", conn.Server(), addrs)
	}
	t.Logf("killing member %d (%s), the holder's server", victim.id, victim.mode())
	victim.kill()
	time.Sleep(7 * time.Second) // past the TTL: renewals must have gone through another member
	if err := lk.Err(); err != nil {
		t.Fatalf("rule: losing one member of three keeps locks; lost: %v", err)
	}
	if _, err := other.TryAcquire(ctxT(t, 20*time.Second), k); !errors.Is(err, dlock.ErrNotAcquired) {
		t.Errorf("another client: %v, want ErrNotAcquired", err)
	}
	if err := lk.Release(ctxT(t, 20*time.Second)); err != nil {
		t.Fatal(err)
	}
	next, err := other.Acquire(ctxT(t, 20*time.Second), k)
	if err != nil {
		t.Fatal(err)
	}
	if next.Fence() <= lk.Fence() {
		t.Errorf("fencing: %d after %d", next.Fence(), lk.Fence())
	}
	next.Release(context.Background())
}

// TestPartitionedHolderIsToldOfLoss freezes (SIGSTOP) the only member a
// holder can reach: the holder cannot renew, so its Locker reports the loss;
// a client of the other members then gets the lock once the lease has run
// out by the leader's clock, with a larger fence, and not before
// the holder was told.
func TestPartitionedHolderIsToldOfLoss(t *testing.T) {
	ss := startEnsemble(t, 3)
	var frozen *server
	var rest []string
	for _, s := range ss {
		if frozen == nil && s.mode() == "follower" {
			frozen = s
		} else {
			rest = append(rest, s.addr())
		}
	}
	if frozen == nil {
		t.Fatal("no follower found")
	}
	holder := locktest.NewLocker(t, newBackend(t, newConn(t, frozen.addr())))
	waiter := locktest.NewLocker(t, newBackend(t, newConn(t, rest...)))
	k := locktest.UniqueKey("partition")
	const ttl = 3 * time.Second
	lk, err := holder.TryAcquire(ctxT(t, 10*time.Second), k, dlock.WithTTL(ttl))
	if err != nil {
		t.Fatal(err)
	}
	frozen.stop(t)
	defer frozen.cont(t) // lets the clients' sessions close

	lost := make(chan time.Time, 1)
	go func() {
		<-lk.Done()
		lost <- time.Now()
	}()
	w, err := waiter.Acquire(ctxT(t, 30*time.Second), k, dlock.WithTTL(ttl))
	if err != nil {
		t.Fatalf("the lock of a partitioned holder never became free: %v", err)
	}
	got := time.Now()
	defer w.Release(context.Background())
	if w.Fence() <= lk.Fence() {
		t.Errorf("rule: the next holder gets a larger fence; %d after %d", w.Fence(), lk.Fence())
	}
	select {
	case at := <-lost:
		if at.After(got) {
			t.Errorf("rule: the holder is told before anyone else gets the lock; told %s after the next grant", at.Sub(got))
		}
	case <-time.After(10 * time.Second):
		t.Fatal("the partitioned holder was never told of the loss")
	}
	if !errors.Is(lk.Err(), dlock.ErrLockLost) {
		t.Errorf("holder Err = %v, want ErrLockLost", lk.Err())
	}
}
