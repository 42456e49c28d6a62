package zklock_test

import (
	"context"
	"testing"
	"time"

	"github.com/dlock-dev/dlock"
	"github.com/dlock-dev/dlock/locktest"
)

// A writer that gives up holds readers back for at most dlock.WriterMark
// (the Sharer contract), also when it gives up between two AcquireWait
// calls: an exclusive AcquireWait that ends by its own bound (a third of
// the TTL) parks its node for the Locker's next call, which never comes
// when the caller's context ends in between.
func TestAdvParkedWriterHoldsReadersBackPastWriterMark(t *testing.T) {
	addrs := sharedAddrs(t)
	ctx := ctxT(t, 60*time.Second)
	k := locktest.UniqueKey("adv-parked-writer")
	rb := newBackend(t, newConn(t, addrs...))
	wb := newBackend(t, newConn(t, addrs...))
	lb := newBackend(t, newConn(t, addrs...))
	reader := dlock.Request{Key: k, Token: dlock.NewToken(), TTL: 30 * time.Second, Mode: dlock.ModeShared}
	if res, err := rb.Acquire(ctx, reader); err != nil || !res.Acquired {
		t.Fatalf("reader: %+v %v", res, err)
	}
	defer rb.Release(context.Background(), k, reader.Token)
	writer := dlock.Request{Key: k, Token: dlock.NewToken(), TTL: 15 * time.Second}
	res, err := wb.AcquireWait(ctx, writer) // returns after TTL/3, parked
	if err != nil || res.Acquired {
		t.Fatalf("writer: %+v %v", res, err)
	}
	gaveUp := time.Now()
	for {
		r := dlock.Request{Key: k, Token: dlock.NewToken(), TTL: 5 * time.Second, Mode: dlock.ModeShared}
		res, err := lb.Acquire(ctx, r)
		if err != nil {
			t.Fatal(err)
		}
		if res.Acquired {
			_ = lb.Release(context.Background(), k, r.Token)
			t.Logf("readers held back for %s after the writer's last call", time.Since(gaveUp).Round(time.Millisecond))
			return
		}
		if d := time.Since(gaveUp); d > dlock.WriterMark+time.Second {
			t.Fatalf("a writer that stopped asking %s ago still keeps readers out (WriterMark is %s)", d.Round(time.Millisecond), dlock.WriterMark)
		}
		time.Sleep(100 * time.Millisecond)
	}
}

// A limited waiter that gives up between two AcquireWait calls must not
// keep a slot: when the holder leaves, the semaphore is free for others.
func TestAdvParkedLimitedWaiterKeepsNoSlot(t *testing.T) {
	addrs := sharedAddrs(t)
	ctx := ctxT(t, 60*time.Second)
	k := locktest.UniqueKey("adv-parked-sem")
	hb := newBackend(t, newConn(t, addrs...))
	wb := newBackend(t, newConn(t, addrs...))
	ob := newBackend(t, newConn(t, addrs...))
	h := dlock.Request{Key: k, Token: dlock.NewToken(), TTL: 30 * time.Second, Mode: dlock.ModeLimited, Limit: 1}
	if res, err := hb.Acquire(ctx, h); err != nil || !res.Acquired {
		t.Fatalf("holder: %+v %v", res, err)
	}
	w := dlock.Request{Key: k, Token: dlock.NewToken(), TTL: 15 * time.Second, Mode: dlock.ModeLimited, Limit: 1}
	if res, err := wb.AcquireWait(ctx, w); err != nil || res.Acquired {
		t.Fatalf("waiter: %+v %v", res, err)
	}
	if err := hb.Release(ctx, k, h.Token); err != nil {
		t.Fatal(err)
	}
	freed := time.Now()
	for {
		o := dlock.Request{Key: k, Token: dlock.NewToken(), TTL: 5 * time.Second, Mode: dlock.ModeLimited, Limit: 1}
		res, err := ob.Acquire(ctx, o)
		if err != nil {
			t.Fatal(err)
		}
		if res.Acquired {
			_ = ob.Release(context.Background(), k, o.Token)
			return
		}
		if d := time.Since(freed); d > 2*time.Second {
			t.Fatalf("the only holder left %s ago, and the slot is still taken by a waiter that stopped asking", d.Round(time.Millisecond))
		}
		time.Sleep(100 * time.Millisecond)
	}
}

func TestAdvConcurrentFirstLimitsNeverCoexist(t *testing.T) {
	addrs := sharedAddrs(t)
	bs := make([]dlock.Backend, 6)
	for i := range bs {
		bs[i] = newBackend(t, newConn(t, addrs...))
	}
	locktest.LimitsAgreeUnderRace(t, bs)
}

func TestAdvWriterGivesUp(t *testing.T) {
	addrs := sharedAddrs(t)
	locktest.WriterThatGivesUp(t, newBackend(t, newConn(t, addrs...)), newBackend(t, newConn(t, addrs...)), newBackend(t, newConn(t, addrs...)))
}

func TestAdvCrashedReader(t *testing.T) {
	addrs := sharedAddrs(t)
	locktest.CrashedReader(t, newBackend(t, newConn(t, addrs...)), newBackend(t, newConn(t, addrs...)))
}

func TestAdvBusyMix(t *testing.T) {
	addrs := sharedAddrs(t)
	locktest.BusyMix(t, newBackend(t, newConn(t, addrs...)), newBackend(t, newConn(t, addrs...)), true)
}

func TestAdvWriterWaitsLong(t *testing.T) {
	addrs := sharedAddrs(t)
	locktest.WriterWaitsLong(t, newBackend(t, newConn(t, addrs...)), newBackend(t, newConn(t, addrs...)), newBackend(t, newConn(t, addrs...)))
}

func TestAdvWriterWokenByLastReader(t *testing.T) {
	addrs := sharedAddrs(t)
	locktest.WriterWokenByLastReader(t, newBackend(t, newConn(t, addrs...)), newBackend(t, newConn(t, addrs...)), 300*time.Millisecond)
}
