// Package claims keeps a key to one strategy in stores that offer several
// whose locks do not exclude each other: the first acquisition of a key
// records its strategy, and the other strategies refuse the key.
package claims

import (
	"context"
	"fmt"
	"sync"

	"github.com/dlock-dev/dlock"
)

// maxKnown bounds the keys a Set remembers; past it the memory starts
// afresh (and each key's claim is read again once).
const maxKnown = 100_000

// A Set checks, once per key, that keys are used with its strategy.
type Set struct {
	strategy string
	sentinel error // the backend's ErrOtherStrategy
	// claim records the strategy for key unless the key has one, and
	// returns the key's strategy.
	claim func(ctx context.Context, key, strategy string) (string, error)
	// query returns the key's strategy, "" if it has none.
	query func(ctx context.Context, key string) (string, error)

	mu    sync.Mutex
	known map[string]struct{} // keys claimed by this strategy
}

// New returns a Set for strategy over the store's claim and query.
func New(strategy string, sentinel error,
	claim func(ctx context.Context, key, strategy string) (string, error),
	query func(ctx context.Context, key string) (string, error)) *Set {
	return &Set{strategy: strategy, sentinel: sentinel, claim: claim, query: query, known: map[string]struct{}{}}
}

// Check returns an error matching the sentinel and dlock.ErrInvalidOption
// if key is used with another strategy, after recording the Set's if the
// key has none.
func (s *Set) Check(ctx context.Context, key string) error {
	s.mu.Lock()
	_, ok := s.known[key]
	s.mu.Unlock()
	if ok {
		return nil
	}
	got, err := s.claim(ctx, key, s.strategy)
	if err != nil {
		return err
	}
	if err := s.other(key, got); err != nil {
		return err
	}
	s.mu.Lock()
	if len(s.known) >= maxKnown {
		clear(s.known)
	}
	s.known[key] = struct{}{}
	s.mu.Unlock()
	return nil
}

// CheckOnly is Check without recording anything.
func (s *Set) CheckOnly(ctx context.Context, key string) error {
	got, err := s.query(ctx, key)
	if err != nil || got == "" {
		return err
	}
	return s.other(key, got)
}

func (s *Set) other(key, got string) error {
	if got == s.strategy {
		return nil
	}
	return fmt.Errorf("%w: %w: %q is used with the %s strategy, not %s (the strategies do not exclude each other)",
		s.sentinel, dlock.ErrInvalidOption, key, got, s.strategy)
}
