package locktest

import (
	"context"
	"errors"
	"fmt"
	"slices"
	"sync"
	"testing"
	"time"

	"github.com/dlock-dev/dlock"
)

// electionTerms checks that an election has one leader at a time: three
// processes campaign in turn, each term's fence is greater than the one
// before, terms never overlap, and Leader names the term while it lasts.
func (s *suite) electionTerms(t *testing.T) {
	k := key(t, "election")
	type term struct {
		from, to time.Time
		fence    uint64
		who      string
	}
	var mu sync.Mutex
	var terms []term
	var wg sync.WaitGroup
	ctx := ctxT(t, 60*time.Second)
	for i := range 3 {
		l, _ := s.locker(t)
		e := dlock.NewElection(l, k)
		who := fmt.Sprintf("node-%d", i)
		wg.Go(func() {
			for range 3 {
				tm, err := e.Campaign(ctx, who, dlock.WithTTL(ttl))
				if err != nil {
					t.Errorf("Campaign: %v", err)
					return
				}
				from := time.Now()
				if ld, err := e.Leader(ctx); err != nil || ld.Fence != tm.Fence() || ld.Value != who {
					t.Errorf("rule: Leader names the current term; got %+v %v, want fence %d value %s", ld, err, tm.Fence(), who)
				}
				time.Sleep(50 * time.Millisecond)
				to := time.Now()
				if err := tm.Resign(ctx); err != nil {
					t.Errorf("Resign: %v", err)
				}
				mu.Lock()
				terms = append(terms, term{from, to, tm.Fence(), who})
				mu.Unlock()
			}
		})
	}
	wg.Wait()
	for i, a := range terms {
		for _, b := range terms[i+1:] {
			if a.fence == b.fence {
				t.Errorf("rule: one leader per fence; %s and %s both led with fence %d", a.who, b.who, a.fence)
			}
			if a.from.Before(b.to) && b.from.Before(a.to) {
				t.Errorf("rule: one leader at a time; %s (fence %d) and %s (fence %d) overlapped", a.who, a.fence, b.who, b.fence)
			}
			if (a.from.Before(b.from)) != (a.fence < b.fence) {
				t.Errorf("rule: a later term has a greater fence; %s fence %d from %s, %s fence %d from %s", a.who, a.fence, a.from.Format(time.StampMilli), b.who, b.fence, b.from.Format(time.StampMilli))
			}
		}
	}
	l, _ := s.locker(t)
	if _, err := dlock.NewElection(l, k).Leader(ctx); !errors.Is(err, dlock.ErrNoLeader) {
		t.Errorf("rule: after every leader resigned, Leader is ErrNoLeader; got %v", err)
	}
	if _, err := dlock.NewElection(l, k).Campaign(ctx, "x", dlock.Shared()); !errors.Is(err, dlock.ErrInvalidOption) {
		t.Errorf("a shared campaign: %v, want ErrInvalidOption", err)
	}
}

// electionObserved checks Observe: an observer sees nobody, then a
// leader, its new value (where the store can change it), nobody again,
// and the next leader with a greater fence, in that order.
func (s *suite) electionObserved(t *testing.T) {
	k := key(t, "observed")
	ol, _ := s.locker(t)
	octx, stop := context.WithCancel(ctxT(t, 60*time.Second))
	defer stop()
	seen := dlock.NewElection(ol, k).Observe(octx)
	next := func(what string, ok func(dlock.Leader) bool) dlock.Leader {
		t.Helper()
		select {
		case ld, open := <-seen:
			if !open {
				t.Fatalf("Observe's channel closed before %s", what)
			}
			if !ok(ld) {
				t.Fatalf("rule: observers see every change in order; want %s, got %+v", what, ld)
			}
			return ld
		case <-time.After(notifyBound):
			t.Fatalf("rule: observers see every change; %s not seen within %s", what, notifyBound)
		}
		return dlock.Leader{}
	}
	next("nobody leading", func(ld dlock.Leader) bool { return ld.Fence == 0 })
	a, _ := s.locker(t)
	ta, err := dlock.NewElection(a, k).Campaign(ctxT(t, 10*time.Second), "a:1", dlock.WithTTL(ttl))
	if err != nil {
		t.Fatal(err)
	}
	next("leader a:1", func(ld dlock.Leader) bool { return ld.Fence == ta.Fence() && ld.Value == "a:1" })
	err = ta.Proclaim(ctxT(t, 10*time.Second), "a:2")
	switch {
	case errors.Is(err, dlock.ErrUnsupported):
	case err != nil:
		t.Fatalf("Proclaim: %v", err)
	default:
		if ta.Value() != "a:2" {
			t.Errorf("Term.Value after Proclaim: %q", ta.Value())
		}
		next("value a:2", func(ld dlock.Leader) bool { return ld.Fence == ta.Fence() && ld.Value == "a:2" })
	}
	if err := ta.Resign(ctxT(t, 10*time.Second)); err != nil {
		t.Fatal(err)
	}
	next("nobody after the resignation", func(ld dlock.Leader) bool { return ld.Fence == 0 })
	if err := ta.Proclaim(ctxT(t, 10*time.Second), "a:3"); !errors.Is(err, dlock.ErrNotHeld) && !errors.Is(err, dlock.ErrUnsupported) {
		t.Errorf("rule: a resigned leader cannot proclaim; got %v", err)
	}
	b, _ := s.locker(t)
	tb, err := dlock.NewElection(b, k).Campaign(ctxT(t, 10*time.Second), "b:1", dlock.WithTTL(ttl))
	if err != nil {
		t.Fatal(err)
	}
	next("leader b:1 with a greater fence", func(ld dlock.Leader) bool {
		return ld.Fence == tb.Fence() && ld.Fence > ta.Fence() && ld.Value == "b:1"
	})
	stop()
	for range seen {
	}
	_ = tb.Resign(context.Background())
}

// electionEveryTerm checks Observe on a store that delivers every change
// in order (dlock.HolderWatcher): ten terms that each begin, change their
// value and end without waiting for the observer are all reported, each
// with both its values, in fence order.
func (s *suite) electionEveryTerm(t *testing.T) {
	if _, ok := s.newBackend(t).(dlock.HolderWatcher); !ok {
		t.Skip("the store does not deliver every change (dlock.HolderWatcher)")
	}
	k := key(t, "terms")
	ol, _ := s.locker(t)
	octx, stop := context.WithCancel(ctxT(t, 60*time.Second))
	defer stop()
	seen := dlock.NewElection(ol, k).Observe(octx)
	select {
	case ld := <-seen:
		if ld.Fence != 0 {
			t.Fatalf("first report: %+v, want nobody leading", ld)
		}
	case <-time.After(notifyBound):
		t.Fatalf("no first report within %s", notifyBound)
	}
	l, _ := s.locker(t)
	e := dlock.NewElection(l, k)
	type report struct {
		fence uint64
		value string
	}
	var want []report
	for i := range 10 {
		term, err := e.Campaign(ctxT(t, 10*time.Second), fmt.Sprintf("t%d", i), dlock.WithTTL(ttl))
		if err != nil {
			t.Fatal(err)
		}
		want = append(want, report{term.Fence(), fmt.Sprintf("t%d", i)})
		switch err := term.Proclaim(ctxT(t, 10*time.Second), fmt.Sprintf("t%d'", i)); {
		case errors.Is(err, dlock.ErrUnsupported):
		case err != nil:
			t.Fatal(err)
		default:
			want = append(want, report{term.Fence(), fmt.Sprintf("t%d'", i)})
		}
		if err := term.Resign(ctxT(t, 10*time.Second)); err != nil {
			t.Fatal(err)
		}
	}
	var got []report
	for len(got) < len(want) {
		select {
		case ld := <-seen:
			if ld.Fence != 0 {
				got = append(got, report{ld.Fence, ld.Value})
			}
		case <-time.After(notifyBound):
			t.Fatalf("rule: observers see every term; after %d terms saw %v, want %v", 10, got, want)
		}
	}
	if !slices.Equal(got, want) {
		t.Errorf("rule: observers see every term and value in fence order; saw %v, want %v", got, want)
	}
}

// electionKilledLeader checks that a leader whose process is killed is
// replaced within the crash bound: another campaign wins with a greater
// fence, and Leader names it.
func (s *suite) electionKilledLeader(t *testing.T) {
	if s.inProcess {
		t.Skip("in-process backend: state is not shared between processes")
	}
	k := key(t, "killed")
	led := s.spawnHolder(t, k, "lead")
	l, _ := s.locker(t)
	e := dlock.NewElection(l, k)
	if ld, err := e.Leader(ctxT(t, 10*time.Second)); err != nil || ld.Fence != led.fence {
		t.Fatalf("Leader while the helper leads: %+v %v, want fence %d", ld, err, led.fence)
	}
	led.kill(t)
	term, err := e.Campaign(ctxT(t, s.crashBound), "next", dlock.WithTTL(ttl))
	if err != nil {
		t.Fatalf("rule: a killed leader is replaced within %s; %v", s.crashBound, err)
	}
	defer term.Resign(context.Background())
	if term.Fence() <= led.fence {
		t.Errorf("rule: the next term's fence is greater; %d after the killed leader's %d", term.Fence(), led.fence)
	}
	if ld, err := e.Leader(ctxT(t, 10*time.Second)); err != nil || ld.Fence != term.Fence() || ld.Value != "next" {
		t.Errorf("rule: Leader names the new term; got %+v %v", ld, err)
	}
}
