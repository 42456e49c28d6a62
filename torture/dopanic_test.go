package torture

import (
	"bufio"
	"context"
	"io"
	"log/slog"
	"math/rand/v2"
	"path/filepath"
	"testing"
	"time"

	"github.com/dlock-dev/dlock"
	"github.com/dlock-dev/dlock/memlock"
)

// lostOnRenewal is a store that grants and never renews: every lease is
// lost at its first renewal.
type lostOnRenewal struct{ *memlock.Backend }

func (b lostOnRenewal) Extend(ctx context.Context, leases []dlock.Lease) ([]error, error) {
	errs := make([]error, len(leases))
	for i := range errs {
		errs[i] = dlock.ErrNotHeld
	}
	return errs, nil
}

// testResource is the resource of the workers of a test, on key "k", in
// tables named by tag, dropped at the test's end.
func testResource(t *testing.T, tag string) *Resource {
	_, db := testDSN(t)
	if err := setupResource(context.Background(), db, tag, []string{"k"}); err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() {
		res, log := resourceTables(tag)
		db.Exec("DROP TABLE IF EXISTS " + res + ", " + log)
	})
	return newResource(db, tag, false)
}

// A lock lost while a Do's function runs is told through the function's
// context: the worker records that instant as the hold's notice ("done"),
// before the panic that ends the hold, as it does for a Lock's Done.
func TestDoPanicRecordsLoss(t *testing.T) {
	ctx := context.Background()
	res := testResource(t, "dopanictest")
	ttl := time.Second
	// A seed whose hold outlasts the first renewal (at about TTL/6) well.
	seed := uint64(0)
	for ; ; seed++ {
		r := rand.New(rand.NewPCG(seed, 0))
		r.Float64()
		if time.Duration(r.Int64N(int64(2*ttl))) > ttl/2 {
			break
		}
	}
	events := filepath.Join(t.TempDir(), "w.jsonl")
	rec, err := newRecorder(events)
	if err != nil {
		t.Fatal(err)
	}
	defer rec.close()
	w := &worker{
		cfg: workerConfig{ID: "w0.1", Keys: []string{"k"}, TTL: ttl, LongFrac: 1, ClientFaults: []string{ClientDoPanic}},
		rec: rec,
		res: res,
		out: bufio.NewWriter(io.Discard),
	}
	w.locker = dlock.New(newTimedBackend(lostOnRenewal{memlock.New()}, rec, ttl, &w.grants),
		&dlock.Options{TTL: ttl, Logger: slog.New(slog.DiscardHandler)})
	defer w.locker.Close(ctx)
	wctx, cancel := context.WithCancel(ctx)
	defer cancel()
	w.restart = cancel
	l := &lane{w: w, rng: rand.New(rand.NewPCG(seed, 0))}
	l.doPanic(wctx, "k")

	evs, _, err := readEvents(events)
	if err != nil {
		t.Fatal(err)
	}
	var acq, done, rel *Event
	for i, e := range evs {
		switch {
		case e.Ev == "acq" && e.Cf == ClientDoPanic && acq == nil:
			acq = &evs[i]
		case acq != nil && e.Ev == "done" && e.F == acq.F && done == nil:
			done = &evs[i]
		case acq != nil && e.Ev == "rel" && e.F == acq.F && rel == nil:
			rel = &evs[i]
		}
	}
	if acq == nil || rel == nil {
		t.Fatalf("no Do hold with its panic in the record: %+v", evs)
	}
	if done == nil || !done.OK {
		t.Fatalf("rule: a Do hold's loss is recorded when fn's context ends; got %+v (events %+v)", done, evs)
	}
	if done.T > rel.T0 {
		t.Errorf("loss recorded at %d, after the panic at %d", done.T, rel.T0)
	}
}

// An Observer that panics when told of a grant, or as a release starts:
// the worker recovers and finds its Locker let the key go, recorded as a
// "dofree" of the obspanic fault.
func TestObserverPanicLetsGo(t *testing.T) {
	ctx := context.Background()
	res := testResource(t, "obspanictest")
	events := filepath.Join(t.TempDir(), "w.jsonl")
	rec, err := newRecorder(events)
	if err != nil {
		t.Fatal(err)
	}
	defer rec.close()
	ttl := time.Second
	w := &worker{
		cfg: workerConfig{ID: "w0.1", Keys: []string{"k"}, TTL: ttl, ClientFaults: []string{ClientObsPanic}},
		rec: rec,
		res: res,
		out: bufio.NewWriter(io.Discard),
	}
	w.locker = dlock.New(newTimedBackend(memlock.New(), rec, ttl, &w.grants),
		&dlock.Options{TTL: ttl, Logger: slog.New(slog.DiscardHandler), Observer: panicObserver{}})
	defer w.locker.Close(ctx)
	wctx, cancel := context.WithCancel(ctx)
	defer cancel()
	w.restart = cancel
	l := &lane{w: w, rng: rand.New(rand.NewPCG(1, 0))}
	l.obsPanicGrant(wctx, "k")
	lk, err := w.locker.TryAcquire(ctx, "k")
	if err != nil {
		t.Fatalf("after the grant's panic: %v", err)
	}
	fence, panicked := recoverObsPanic(func() { lk.Release(panicking(ctx)) })
	if !panicked || fence != lk.Fence() {
		t.Fatalf("the release's Observer panic: %v, fence %d", panicked, fence)
	}
	l.letGoCheck(wctx, "k", fence, Mono(), ClientObsPanic)
	rec.close()
	evs, _, err := readEvents(events)
	if err != nil {
		t.Fatal(err)
	}
	freed := 0
	for _, e := range evs {
		if e.Ev == "dofree" {
			if e.Cf != ClientObsPanic || !e.OK {
				t.Errorf("rule: the Locker lets a key go after an Observer's panic; %+v", e)
			}
			freed++
		}
	}
	if freed < 2 { // the holds after each check may draw the fault too
		t.Errorf("%d dofree events, want at least 2 (the grant's panic, the release's): %+v", freed, evs)
	}
}
