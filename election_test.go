package dlock_test

import (
	"context"
	"errors"
	"testing"
	"time"

	"github.com/dlock-dev/dlock"
	"github.com/dlock-dev/dlock/memlock"
)

// listOnly is a backend that lists holders but can neither watch nor set
// metadata: observers look again after a backoff, Proclaim is unsupported.
type listOnly struct{ *memlock.Backend }

func (b listOnly) Watch()       {} // not dlock.Watcher's signature
func (b listOnly) SetMetadata() {} // not dlock.MetadataSetter's

// TestObserveWithoutWatcher checks that on a store that cannot notify,
// observers still see each change (by looking again), and that Proclaim
// says it cannot change the value rather than pretending to.
func TestObserveWithoutWatcher(t *testing.T) {
	ctx, cancel := context.WithTimeout(context.Background(), 30*time.Second)
	defer cancel()
	b := listOnly{memlock.New()}
	var _ dlock.Lister = b
	if _, ok := any(b).(dlock.Watcher); ok {
		t.Fatal("listOnly must not be a Watcher")
	}
	l := dlock.New(b, nil)
	defer l.Close(ctx)
	e := dlock.NewElection(l, "poll")
	seen := e.Observe(ctx)
	if ld := <-seen; ld.Fence != 0 {
		t.Fatalf("first report: %+v, want nobody", ld)
	}
	term, err := e.Campaign(ctx, "a")
	if err != nil {
		t.Fatal(err)
	}
	if ld := <-seen; ld.Fence != term.Fence() || ld.Value != "a" {
		t.Fatalf("report of the leader: %+v", ld)
	}
	if err := term.Proclaim(ctx, "b"); !errors.Is(err, dlock.ErrUnsupported) {
		t.Errorf("Proclaim without MetadataSetter: %v, want ErrUnsupported", err)
	}
	if err := term.Resign(ctx); err != nil {
		t.Fatal(err)
	}
	if ld := <-seen; ld.Fence != 0 {
		t.Fatalf("report after the resignation: %+v, want nobody", ld)
	}
	if err := term.Proclaim(ctx, "c"); !errors.Is(err, dlock.ErrUnsupported) && !errors.Is(err, dlock.ErrNotHeld) {
		t.Errorf("Proclaim after Resign: %v", err)
	}
	cancel()
	for range seen {
	}
}

// TestElectionInputIsChecked checks the election's refusals before any
// store call: a bad key, a bad value, a mode other than exclusive.
func TestElectionInputIsChecked(t *testing.T) {
	ctx := context.Background()
	l := dlock.New(memlock.New(), nil)
	defer l.Close(ctx)
	if _, err := dlock.NewElection(l, "").Campaign(ctx, "v"); !errors.Is(err, dlock.ErrInvalidKey) {
		t.Errorf("empty key: %v", err)
	}
	if _, err := dlock.NewElection(l, "").Leader(ctx); !errors.Is(err, dlock.ErrInvalidKey) {
		t.Errorf("Leader of an empty key: %v", err)
	}
	if _, err := dlock.NewElection(l, "k").Campaign(ctx, "a\x00b"); !errors.Is(err, dlock.ErrInvalidOption) {
		t.Errorf("value with NUL: %v", err)
	}
	if _, err := dlock.NewElection(l, "k").Campaign(ctx, "v", dlock.WithLimit(2)); !errors.Is(err, dlock.ErrInvalidOption) {
		t.Errorf("limited campaign: %v", err)
	}
	term, err := dlock.NewElection(l, "k").Campaign(ctx, "v")
	if err != nil {
		t.Fatal(err)
	}
	if err := term.Proclaim(ctx, string(make([]byte, dlock.MaxMetadataLen+1))); !errors.Is(err, dlock.ErrInvalidOption) {
		t.Errorf("long value: %v", err)
	}
	if term.Value() != "v" {
		t.Errorf("Value after a refused Proclaim: %q", term.Value())
	}
}
