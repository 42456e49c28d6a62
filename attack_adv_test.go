package dlock_test

import (
	"context"
	"errors"
	"sync"
	"testing"
	"time"

	"github.com/dlock-dev/dlock"
	"github.com/dlock-dev/dlock/memlock"
)

// readerStream keeps key held shared through l as a busy server's
// independent requests do: four readers, staggered, each taking the key,
// holding it 80 ms, releasing it and coming again, so that at every instant
// some reader holds it. No reader holds the key while it waits for it. It
// stops when stop closes.
func readerStream(ctx context.Context, l *dlock.Locker, key string, stop <-chan struct{}) {
	var wg sync.WaitGroup
	for i := range 4 {
		wg.Go(func() {
			time.Sleep(time.Duration(i) * 20 * time.Millisecond)
			for {
				select {
				case <-stop:
					return
				default:
				}
				r, err := l.Acquire(ctx, key, dlock.Shared())
				if err != nil {
					return
				}
				time.Sleep(80 * time.Millisecond)
				_ = r.Release(context.Background())
			}
		})
	}
	wg.Wait()
}

// A writer must not starve behind a stream of readers (docs/modes.md:
// "once an exclusive waiter is queued, new shared requests queue behind
// it"). With readers and the writer on different Lockers the store's
// writer mark does it; on one Locker (a web server's handlers sharing a
// Locker, the usual set-up) the writer waits for the local readers'
// release and never reaches the store, so it leaves no mark, the readers'
// new acquisitions are granted, and the writer waits for ever.
func TestAdvLocalWriterNotStarvedByLocalReaders(t *testing.T) {
	for _, oneLocker := range []bool{false, true} {
		name := "two Lockers"
		if oneLocker {
			name = "one Locker"
		}
		t.Run(name, func(t *testing.T) {
			ctx := context.Background()
			b := memlock.New()
			rl := dlock.New(b, &dlock.Options{TTL: 5 * time.Second})
			defer rl.Close(ctx)
			wl := rl
			if !oneLocker {
				wl = dlock.New(b, &dlock.Options{TTL: 5 * time.Second})
				defer wl.Close(ctx)
			}
			rctx, rcancel := context.WithTimeout(ctx, 20*time.Second)
			defer rcancel()
			stop := make(chan struct{})
			var wg sync.WaitGroup
			wg.Go(func() { readerStream(rctx, rl, "k", stop) })
			time.Sleep(100 * time.Millisecond)
			wctx, cancel := context.WithTimeout(ctx, 2*dlock.WriterMark)
			defer cancel()
			w, err := wl.Acquire(wctx, "k")
			if err == nil {
				_ = w.Release(ctx)
			}
			close(stop)
			wg.Wait()
			if err != nil {
				t.Fatalf("writer starved by a stream of readers for %s: %v", 2*dlock.WriterMark, err)
			}
		})
	}
}

// An exclusive (or differently limited) acquisition of a key held limited
// fails with ErrModeMismatch (docs/modes.md). It does across Lockers; on
// the Locker that holds the limited lease it is reported as "held" and
// Acquire waits until its context ends, though it can never be granted
// while the semaphore is in use.
func TestAdvLocalModeMismatchIsAnError(t *testing.T) {
	ctx := context.Background()
	b := memlock.New()
	l := dlock.New(b, nil)
	defer l.Close(ctx)
	other := dlock.New(b, nil)
	defer other.Close(ctx)
	if _, err := l.TryAcquire(ctx, "sem", dlock.WithLimit(2)); err != nil {
		t.Fatal(err)
	}
	if _, err := l.TryAcquire(ctx, "x"); err != nil {
		t.Fatal(err)
	}
	for _, c := range []struct {
		name string
		l    *dlock.Locker
		key  string
		opts []dlock.AcquireOption
	}{
		{"other Locker, exclusive on limited", other, "sem", nil},
		{"same Locker, exclusive on limited", l, "sem", nil},
		{"other Locker, limited on exclusive", other, "x", []dlock.AcquireOption{dlock.WithLimit(2)}},
		{"same Locker, limited on exclusive", l, "x", []dlock.AcquireOption{dlock.WithLimit(2)}},
	} {
		t.Run(c.name, func(t *testing.T) {
			if _, err := c.l.TryAcquire(ctx, c.key, c.opts...); !errors.Is(err, dlock.ErrModeMismatch) {
				t.Errorf("TryAcquire: %v, want ErrModeMismatch", err)
			}
			actx, cancel := context.WithTimeout(ctx, 300*time.Millisecond)
			defer cancel()
			if _, err := c.l.Acquire(actx, c.key, c.opts...); !errors.Is(err, dlock.ErrModeMismatch) {
				t.Errorf("Acquire: %v, want ErrModeMismatch", err)
			}
		})
	}
}

// AcquireAll whose context ends on a later key releases the keys it took,
// even though the same context bounds the release; an already-ended context
// takes nothing.
func TestAdvAcquireAllCutMidwayLeavesNothing(t *testing.T) {
	ctx := context.Background()
	b := memlock.New()
	l := dlock.New(b, nil)
	defer l.Close(ctx)
	other := dlock.New(b, nil)
	defer other.Close(ctx)
	blocker, err := other.TryAcquire(ctx, "c")
	if err != nil {
		t.Fatal(err)
	}
	defer blocker.Release(ctx)
	for _, opts := range [][]dlock.AcquireOption{nil, {dlock.Shared()}} {
		actx, cancel := context.WithTimeout(ctx, 200*time.Millisecond)
		_, err := l.AcquireAll(actx, []string{"c", "a", "b", "a"}, opts...)
		cancel()
		if !errors.Is(err, dlock.ErrNotAcquired) {
			t.Fatalf("AcquireAll: %v, want ErrNotAcquired", err)
		}
		dead, cancel := context.WithCancel(ctx)
		cancel()
		if _, err := l.AcquireAll(dead, []string{"a", "b"}, opts...); err == nil {
			t.Fatal("AcquireAll with an ended context succeeded")
		}
		ls, err := l.List(ctx, "")
		if err != nil {
			t.Fatal(err)
		}
		for _, h := range ls {
			if h.Key != "c" {
				t.Errorf("AcquireAll that failed left %q held (%s)", h.Key, h.Mode)
			}
		}
	}
}

// An owner that holds one key of an AcquireAll in another mode makes it
// fail with ErrModeMismatch, and the keys taken before it are released.
func TestAdvAcquireAllOwnerModeMismatchReleasesEarlierKeys(t *testing.T) {
	ctx := context.Background()
	b := memlock.New()
	l := dlock.New(b, nil)
	defer l.Close(ctx)
	r, err := l.TryAcquire(ctx, "b", dlock.Shared(), dlock.WithOwner("job"))
	if err != nil {
		t.Fatal(err)
	}
	defer r.Release(ctx)
	if _, err := l.AcquireAll(ctx, []string{"b", "a"}, dlock.WithOwner("job")); !errors.Is(err, dlock.ErrModeMismatch) {
		t.Fatalf("AcquireAll: %v, want ErrModeMismatch", err)
	}
	other := dlock.New(b, nil)
	defer other.Close(ctx)
	k, err := other.TryAcquire(ctx, "a")
	if err != nil {
		t.Fatalf("the key taken before the mismatch is still held: %v", err)
	}
	_ = k.Release(ctx)
}

// Close racing shared and limited acquisitions leaves nothing held in the
// store once it has returned.
func TestAdvCloseRacingSharedAcquisitionsLeavesNothing(t *testing.T) {
	ctx := context.Background()
	b := memlock.New()
	for round := range 20 {
		l := dlock.New(b, nil)
		var wg sync.WaitGroup
		for i := range 16 {
			wg.Go(func() {
				opts := []dlock.AcquireOption{dlock.Shared()}
				if i%2 == 1 {
					opts = []dlock.AcquireOption{dlock.WithLimit(20)}
				}
				for {
					k, err := l.Acquire(ctx, []string{"r", "s"}[i%2], opts...)
					if err != nil {
						return
					}
					if i%4 < 2 {
						_ = k.Release(ctx)
					}
				}
			})
		}
		time.Sleep(time.Duration(round%5) * time.Millisecond)
		if err := l.Close(ctx); err != nil {
			t.Fatal(err)
		}
		wg.Wait()
		ls, err := b.List(ctx, "")
		if err != nil {
			t.Fatal(err)
		}
		if len(ls) > 0 {
			t.Fatalf("round %d: %d holders left after Close, first %+v", round, len(ls), ls[0])
		}
	}
}

// A panic in Do, recovered by the caller, releases a shared hold at once.
func TestAdvDoPanicReleasesSharedHold(t *testing.T) {
	ctx := context.Background()
	b := memlock.New()
	l := dlock.New(b, nil)
	defer l.Close(ctx)
	func() {
		defer func() { _ = recover() }()
		_ = l.Do(ctx, "k", func(context.Context) error { panic("boom") }, dlock.Shared())
	}()
	other := dlock.New(b, nil)
	defer other.Close(ctx)
	w, err := other.TryAcquire(ctx, "k")
	if err != nil {
		t.Fatalf("a panicking reader's hold was kept: %v", err)
	}
	_ = w.Release(ctx)
}

// An AcquireAll that shares a key reentrantly with a lock the owner already
// holds releases only its own hold of that key.
func TestAdvGroupReleaseKeepsTheOwnersOtherHold(t *testing.T) {
	ctx := context.Background()
	b := memlock.New()
	l := dlock.New(b, nil)
	defer l.Close(ctx)
	a, err := l.TryAcquire(ctx, "a", dlock.Shared(), dlock.WithOwner("job"))
	if err != nil {
		t.Fatal(err)
	}
	g, err := l.AcquireAll(ctx, []string{"b", "a"}, dlock.Shared(), dlock.WithOwner("job"))
	if err != nil {
		t.Fatal(err)
	}
	if g.Lock("a").Fence() != a.Fence() {
		t.Errorf("the group's lock of a has fence %d, the owner's %d", g.Lock("a").Fence(), a.Fence())
	}
	if err := g.Release(ctx); err != nil {
		t.Fatal(err)
	}
	if err := a.Err(); err != nil {
		t.Fatalf("the owner's own hold of a ended with the group: %v", err)
	}
	other := dlock.New(b, nil)
	defer other.Close(ctx)
	if w, err := other.TryAcquire(ctx, "a"); err == nil {
		_ = w.Release(ctx)
		t.Fatal("a writer got a while the owner still holds it shared")
	}
	_ = a.Release(ctx)
}

// A key of an AcquireAll lost while it waits for a later key (forced free
// and taken by another Locker) is not returned in the Group: AcquireAll
// lets the rest go and waits for every key again.
func TestAcquireAllLosingAKeyMidwayStartsOver(t *testing.T) {
	ctx := context.Background()
	b := memlock.New()
	l := dlock.New(b, &dlock.Options{TTL: time.Second})
	defer l.Close(ctx)
	other := dlock.New(b, nil)
	defer other.Close(ctx)
	hb, err := other.TryAcquire(ctx, "b")
	if err != nil {
		t.Fatal(err)
	}
	type outcome struct {
		g   *dlock.Group
		err error
	}
	done := make(chan outcome, 1)
	go func() {
		g, err := l.AcquireAll(ctx, []string{"a", "b"})
		done <- outcome{g, err}
	}()
	for deadline := time.Now().Add(10 * time.Second); ; time.Sleep(5 * time.Millisecond) {
		if ls, _ := other.List(ctx, "a"); len(ls) == 1 {
			break
		}
		if time.Now().After(deadline) {
			t.Fatal("AcquireAll did not take a")
		}
	}
	if err := other.ForceRelease(ctx, "a"); err != nil {
		t.Fatal(err)
	}
	ha, err := other.TryAcquire(ctx, "a")
	if err != nil {
		t.Fatal(err)
	}
	time.Sleep(1500 * time.Millisecond) // past l's lease of a: it knows of the loss
	if err := hb.Release(ctx); err != nil {
		t.Fatal(err)
	}
	select {
	case o := <-done:
		if o.err == nil {
			t.Fatalf("rule: AcquireAll is all or none; it returned a Group while another Locker holds a (the Group's Err: %v)", o.g.Err())
		}
		t.Fatalf("AcquireAll: %v, want it to wait for a", o.err)
	case <-time.After(300 * time.Millisecond):
	}
	if err := ha.Release(ctx); err != nil {
		t.Fatal(err)
	}
	select {
	case o := <-done:
		if o.err != nil {
			t.Fatal(o.err)
		}
		if err := o.g.Err(); err != nil {
			t.Errorf("the Group returned once every key was free again: %v", err)
		}
		o.g.Release(ctx)
	case <-time.After(10 * time.Second):
		t.Fatal("AcquireAll did not take the keys once they were free")
	}
}
