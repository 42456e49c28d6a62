package dlock_test

import (
	"context"
	"errors"
	"fmt"
	"testing"
	"time"

	"github.com/dlock-dev/dlock"
	"github.com/dlock-dev/dlock/memlock"
)

// exclusiveOnly hides memlock's Sharer: a backend of exclusive locks only.
type exclusiveOnly struct{ dlock.Backend }

func TestModeOptionsAreValidated(t *testing.T) {
	ctx := context.Background()
	l := dlock.New(memlock.New(), nil)
	defer l.Close(ctx)
	for name, opts := range map[string][]dlock.AcquireOption{
		"shared and limited": {dlock.Shared(), dlock.WithLimit(2)},
		"limit 0":            {dlock.WithLimit(0)},
		"limit above max":    {dlock.WithLimit(dlock.MaxLimit + 1)},
	} {
		if _, err := l.TryAcquire(ctx, "k", opts...); !errors.Is(err, dlock.ErrInvalidOption) {
			t.Errorf("%s: %v, want ErrInvalidOption", name, err)
		}
	}
	plain := dlock.New(exclusiveOnly{memlock.New()}, nil)
	defer plain.Close(ctx)
	for _, opt := range []dlock.AcquireOption{dlock.Shared(), dlock.WithLimit(2)} {
		if _, err := plain.TryAcquire(ctx, "k", opt); !errors.Is(err, dlock.ErrUnsupported) {
			t.Errorf("a mode the backend does not grant: %v, want ErrUnsupported", err)
		}
	}
	if _, err := l.AcquireAll(ctx, []string{"a", ""}); !errors.Is(err, dlock.ErrInvalidKey) {
		t.Errorf("AcquireAll with an empty key: %v", err)
	}
	many := make([]string, dlock.MaxGroupKeys+1)
	for i := range many {
		many[i] = fmt.Sprint(i)
	}
	if _, err := l.AcquireAll(ctx, many); !errors.Is(err, dlock.ErrInvalidKey) {
		t.Errorf("AcquireAll of %d keys: %v", len(many), err)
	}
}

// One Locker may hold several shared leases of a key; each renews and is
// released on its own, and Close releases them all.
func TestOneLockerHoldsSeveralSharedLeases(t *testing.T) {
	ctx := context.Background()
	store := memlock.New()
	l := dlock.New(store, &dlock.Options{TTL: time.Second})
	other := dlock.New(store, nil)
	defer other.Close(ctx)
	a, err := l.TryAcquire(ctx, "k", dlock.Shared())
	if err != nil {
		t.Fatal(err)
	}
	b, err := l.TryAcquire(ctx, "k", dlock.Shared())
	if err != nil {
		t.Fatal(err)
	}
	if a.Fence() == b.Fence() {
		t.Errorf("two shared leases share fence %d", a.Fence())
	}
	time.Sleep(1500 * time.Millisecond) // past the TTL: both renewed
	if a.Err() != nil || b.Err() != nil {
		t.Fatalf("shared leases not renewed: %v, %v", a.Err(), b.Err())
	}
	if err := a.Release(ctx); err != nil {
		t.Fatal(err)
	}
	if b.Err() != nil {
		t.Fatalf("releasing one shared lease ended the other: %v", b.Err())
	}
	if _, err := other.TryAcquire(ctx, "k"); !errors.Is(err, dlock.ErrNotAcquired) {
		t.Fatalf("a writer while a reader holds: %v", err)
	}
	if err := l.Close(ctx); err != nil {
		t.Fatal(err)
	}
	if !errors.Is(b.Err(), dlock.ErrClosed) {
		t.Errorf("after Close: %v", b.Err())
	}
	lk, err := other.TryAcquire(ctx, "k")
	if err != nil {
		t.Fatalf("Close left a shared lease behind: %v", err)
	}
	lk.Release(ctx)
}

// A reentrant acquisition shares its owner's lease in the same mode, and is
// refused in another.
func TestReentrancyKeepsItsMode(t *testing.T) {
	ctx := context.Background()
	l := dlock.New(memlock.New(), nil)
	defer l.Close(ctx)
	a, err := l.TryAcquire(ctx, "k", dlock.Shared(), dlock.WithOwner("o"))
	if err != nil {
		t.Fatal(err)
	}
	b, err := l.TryAcquire(ctx, "k", dlock.Shared(), dlock.WithOwner("o"))
	if err != nil || b.Fence() != a.Fence() {
		t.Fatalf("reentrant shared: %v, fence %d vs %d", err, b.Fence(), a.Fence())
	}
	for name, opts := range map[string][]dlock.AcquireOption{
		"exclusive": nil,
		"limited":   {dlock.WithLimit(2)},
	} {
		_, err := l.TryAcquire(ctx, "k", append(opts, dlock.WithOwner("o"))...)
		if !errors.Is(err, dlock.ErrModeMismatch) {
			t.Errorf("%s by the owner of a shared hold: %v, want ErrModeMismatch", name, err)
		}
	}
	a.Release(ctx)
	b.Release(ctx)
}

// A writer of the same Locker waits for its readers' release and is woken
// by it.
func TestLocalReadersReleaseWakesWriter(t *testing.T) {
	ctx := context.Background()
	l := dlock.New(memlock.New(), nil)
	defer l.Close(ctx)
	r, err := l.TryAcquire(ctx, "k", dlock.Shared())
	if err != nil {
		t.Fatal(err)
	}
	got := make(chan error, 1)
	go func() {
		w, err := l.Acquire(ctx, "k")
		if err == nil {
			err = w.Release(ctx)
		}
		got <- err
	}()
	select {
	case err := <-got:
		t.Fatalf("the writer got in beside a reader: %v", err)
	case <-time.After(100 * time.Millisecond):
	}
	if err := r.Release(ctx); err != nil {
		t.Fatal(err)
	}
	select {
	case err := <-got:
		if err != nil {
			t.Fatal(err)
		}
	case <-time.After(5 * time.Second):
		t.Fatal("the writer was not woken by the local release")
	}
}

func TestGroupContextEndsWithRelease(t *testing.T) {
	ctx := context.Background()
	l := dlock.New(memlock.New(), nil)
	defer l.Close(ctx)
	g, err := l.AcquireAll(ctx, []string{"b", "a"})
	if err != nil {
		t.Fatal(err)
	}
	if ks := g.Locks(); ks[0].Key() != "a" || ks[1].Key() != "b" {
		t.Errorf("locks not in key order: %s, %s", ks[0].Key(), ks[1].Key())
	}
	gctx, cancel := g.Context(ctx)
	defer cancel()
	if gctx.Err() != nil || g.Err() != nil {
		t.Fatalf("a held group: %v, %v", gctx.Err(), g.Err())
	}
	if err := g.Release(ctx); err != nil {
		t.Fatal(err)
	}
	<-gctx.Done()
	if !errors.Is(context.Cause(gctx), dlock.ErrNotHeld) {
		t.Errorf("cause after Release: %v", context.Cause(gctx))
	}
}
