// Package refusals remembers the keys whose tries were refused lately. A
// backend whose blocking waits take a session of their own, where its
// tries share one, tries a key first unless a try found it held lately:
// under contention that try would be refused, and it costs a statement
// before every wait.
package refusals

import (
	"context"
	"sync"
	"time"

	"github.com/dlock-dev/dlock/internal/ctxend"

	"github.com/dlock-dev/dlock"
)

// For is how long a refusal counts.
const For = time.Second

// Max bounds the keys remembered: at Max, the lapsed refusals are dropped,
// and all of them if none has lapsed.
const Max = 1024

// Set is the refusals of one backend. Its zero value is empty and ready.
type Set struct {
	mu sync.Mutex
	at map[string]time.Time
}

// Refused notes that a try for key sent at t was refused.
func (s *Set) Refused(key string, t time.Time) {
	s.mu.Lock()
	defer s.mu.Unlock()
	if s.at == nil {
		s.at = make(map[string]time.Time)
	}
	if _, ok := s.at[key]; !ok && len(s.at) >= Max {
		for k, at := range s.at {
			if time.Since(at) >= For {
				delete(s.at, k)
			}
		}
		if len(s.at) >= Max {
			clear(s.at)
		}
	}
	s.at[key] = t
}

// Lately reports whether a try for key was refused within For.
func (s *Set) Lately(key string) bool {
	s.mu.Lock()
	defer s.mu.Unlock()
	at, ok := s.at[key]
	if ok && time.Since(at) >= For {
		delete(s.at, key)
		return false
	}
	return ok
}

// TryFirst is a blocking acquisition's first step: unless skip allows it
// and a try for req.Key was refused lately, it tries with try (req with
// NoHolder: a wait follows a refusal) and reports done, with that try's
// outcome, when the try took the key or failed, or ctx has ended.
func (s *Set) TryFirst(ctx context.Context, req dlock.Request, skip bool, try func(context.Context, dlock.Request) (dlock.Result, error)) (res dlock.Result, done bool, err error) {
	if skip && s.Lately(req.Key) {
		return dlock.Result{}, false, nil
	}
	req.NoHolder = true
	res, err = try(ctx, req)
	return res, err != nil || res.Acquired || ctxend.Err(ctx) != nil, err
}
