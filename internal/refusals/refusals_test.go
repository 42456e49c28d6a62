package refusals

import (
	"context"
	"strconv"
	"testing"
	"time"

	"github.com/dlock-dev/dlock"
)

func TestRefusalsLapse(t *testing.T) {
	var s Set
	if s.Lately("k") {
		t.Fatal("an empty set has a refusal")
	}
	s.Refused("k", time.Now())
	if !s.Lately("k") || s.Lately("other") {
		t.Fatal("a refusal just made does not count, or counts for another key")
	}
	s.Refused("old", time.Now().Add(-For))
	if s.Lately("old") {
		t.Fatal("a refusal older than For counts")
	}
	if size(&s) != 1 {
		t.Fatalf("%d keys remembered after one lapsed, want 1", size(&s))
	}
}

func TestRefusalsBounded(t *testing.T) {
	var s Set
	for i := range Max - 1 {
		s.Refused(strconv.Itoa(i), time.Now().Add(-For))
	}
	s.Refused("fresh", time.Now())
	s.Refused("one more", time.Now()) // at Max: the lapsed ones go
	if size(&s) != 2 || !s.Lately("fresh") || !s.Lately("one more") {
		t.Fatalf("after dropping the lapsed: %d keys, want the 2 fresh ones", size(&s))
	}
	for i := range Max + 10 {
		s.Refused("new "+strconv.Itoa(i), time.Now())
		if size(&s) > Max {
			t.Fatalf("%d keys remembered, over Max", size(&s))
		}
	}
	if !s.Lately("new " + strconv.Itoa(Max+9)) {
		t.Fatal("the last refusal is forgotten")
	}
}

func TestTryFirst(t *testing.T) {
	var s Set
	tries := 0
	try := func(_ context.Context, req dlock.Request) (dlock.Result, error) {
		tries++
		if !req.NoHolder {
			t.Error("the try was asked for the holder")
		}
		return dlock.Result{}, nil
	}
	req := dlock.Request{Key: "k"}
	if _, done, err := s.TryFirst(t.Context(), req, true, try); err != nil || done || tries != 1 {
		t.Fatalf("a refused try: done %v, err %v, %d tries; want a wait to follow one try", done, err, tries)
	}
	s.Refused("k", time.Now())
	if _, done, _ := s.TryFirst(t.Context(), req, true, try); done || tries != 1 {
		t.Fatalf("a key refused lately: done %v, %d tries; want no try", done, tries)
	}
	if _, done, _ := s.TryFirst(t.Context(), req, false, try); done || tries != 2 {
		t.Fatalf("a key refused lately, no skipping: done %v, %d tries; want a try", done, tries)
	}
	ctx, cancel := context.WithCancel(t.Context())
	cancel()
	if _, done, _ := s.TryFirst(ctx, dlock.Request{Key: "other"}, true, try); !done {
		t.Fatal("a refused try after ctx ended: not done")
	}
	took := func(context.Context, dlock.Request) (dlock.Result, error) { return dlock.Result{Acquired: true}, nil }
	if res, done, _ := s.TryFirst(t.Context(), dlock.Request{Key: "free"}, true, took); !done || !res.Acquired {
		t.Fatal("a try that took the key: not done")
	}
}

// size is the number of keys s remembers.
func size(s *Set) int {
	s.mu.Lock()
	defer s.mu.Unlock()
	return len(s.at)
}
