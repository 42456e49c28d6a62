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

// observing starts an Election of key on a Locker over b, and an
// observer whose first report, nobody leading, it checks.
func observing(t *testing.T, ctx context.Context, b dlock.Backend, key string) (*dlock.Election, <-chan dlock.Leader) {
	t.Helper()
	l := dlock.New(b, nil)
	t.Cleanup(func() { l.Close(context.Background()) })
	e := dlock.NewElection(l, key)
	seen := e.Observe(ctx)
	if ld := <-seen; ld.Fence != 0 {
		t.Fatalf("first report: %+v, want nobody", ld)
	}
	return e, seen
}

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
	e, seen := observing(t, ctx, b, "poll")
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

// slowWatch is memlock whose holder watch delivers its first change at
// once and the rest only when gate is closed: a watch that lags behind
// the store, as a journal read after a backoff does.
type slowWatch struct {
	*memlock.Backend
	gate chan struct{}
}

func (b slowWatch) WatchHolders(ctx context.Context, key string) ([]dlock.LockInfo, <-chan []dlock.LockInfo, error) {
	now, ch, err := b.Backend.WatchHolders(ctx, key)
	if err != nil {
		return nil, nil, err
	}
	out := make(chan []dlock.LockInfo)
	go func() {
		defer close(out)
		first := true
		for hs := range ch {
			if !first {
				select {
				case <-b.gate:
				case <-ctx.Done():
					return
				}
			}
			first = false
			select {
			case out <- hs:
			case <-ctx.Done():
				return
			}
		}
	}()
	return now, out, nil
}

// TestObserveLaggingWatchMissesNoTerm: when a leader's lease has passed,
// the observer reads the key; a listing that shows a later term than the
// watch has delivered must not make the observer skip the terms between,
// which the watch delivers later.
func TestObserveLaggingWatchMissesNoTerm(t *testing.T) {
	ctx, cancel := context.WithTimeout(context.Background(), 30*time.Second)
	defer cancel()
	b := slowWatch{memlock.New(), make(chan struct{})}
	e, seen := observing(t, ctx, b, "lagging")
	var fences []uint64
	for _, v := range []string{"a", "b", "c"} {
		term, err := e.Campaign(ctx, v, dlock.WithTTL(time.Second))
		if err != nil {
			t.Fatal(err)
		}
		fences = append(fences, term.Fence())
		if v == "a" {
			if ld := <-seen; ld.Fence != term.Fence() {
				t.Fatalf("report of the first leader: %+v", ld)
			}
		}
		if v != "c" {
			if err := term.Resign(ctx); err != nil {
				t.Fatal(err)
			}
		}
	}
	time.Sleep(1500 * time.Millisecond) // past a's lease: the observer reads the key
	close(b.gate)
	var got []uint64
	for len(got) < 2 {
		select {
		case ld := <-seen:
			if ld.Fence != 0 {
				got = append(got, ld.Fence)
			}
		case <-ctx.Done():
			t.Fatalf("reports after the first leader: %v", got)
		}
	}
	if got[0] != fences[1] || got[1] != fences[2] {
		t.Errorf("rule: observers see every term; after %d saw %v, want %v", fences[0], got, fences[1:])
	}
}

// An Observe that can never report (an invalid key, a store that cannot
// list holders) closes its channel at once instead of retrying forever.
func TestObserveThatCannotReportCloses(t *testing.T) {
	ctx, cancel := context.WithTimeout(context.Background(), 30*time.Second)
	defer cancel()
	l := dlock.New(memlock.New(), nil)
	defer l.Close(context.Background())
	nl := dlock.New(noList{memlock.New()}, nil)
	defer nl.Close(context.Background())
	for name, e := range map[string]*dlock.Election{
		"invalid key":     dlock.NewElection(l, ""),
		"store no Lister": dlock.NewElection(nl, "e"),
	} {
		select {
		case ld, ok := <-e.Observe(ctx):
			if ok {
				t.Errorf("%s: Observe reported %+v, want the channel closed", name, ld)
			}
		case <-time.After(5 * time.Second):
			t.Errorf("%s: Observe neither reported nor closed its channel", name)
		}
	}
}

// noList is a store that cannot list holders (nor watch them).
type noList struct{ dlock.Backend }

// A Campaign that joins its owner's term (WithOwner) publishes nothing, and
// its Term's Value is the value the store publishes.
func TestReentrantCampaignSharesTheTermsValue(t *testing.T) {
	ctx := context.Background()
	l := dlock.New(memlock.New(), nil)
	defer l.Close(ctx)
	e := dlock.NewElection(l, "reentrant")
	t1, err := e.Campaign(ctx, "a", dlock.WithOwner("svc"))
	if err != nil {
		t.Fatal(err)
	}
	t2, err := e.Campaign(ctx, "b", dlock.WithOwner("svc"))
	if err != nil {
		t.Fatal(err)
	}
	ld, err := e.Leader(ctx)
	if err != nil {
		t.Fatal(err)
	}
	if t1.Value() != ld.Value || t2.Value() != ld.Value {
		t.Errorf("the terms' values %q and %q, the store publishes %q", t1.Value(), t2.Value(), ld.Value)
	}
	if err := t2.Proclaim(ctx, "c"); err != nil {
		t.Fatal(err)
	}
	if t1.Value() != "c" {
		t.Errorf("after the other Term's Proclaim: %q, want c", t1.Value())
	}
}
