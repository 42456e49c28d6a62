package locktest

import (
	"context"
	"errors"
	"testing"
	"time"

	"github.com/dlock-dev/dlock"
)

// OneStrategyPerKey checks the strategies of one store whose locks do not
// exclude each other (newBackend by strategy name): a key taken with one is
// refused by every other, by TryAcquire, Acquire and ForceRelease, while
// held and after release, with an error matching sentinel and
// dlock.ErrInvalidOption; and its own strategy takes it again.
func OneStrategyPerKey(t *testing.T, newBackend map[string]func(t *testing.T) dlock.Backend, sentinel error) {
	ctx := t.Context()
	for first, newFirst := range newBackend {
		t.Run(first, func(t *testing.T) {
			k := UniqueKey("strategy-" + first)
			fl := dlock.New(newFirst(t), nil)
			defer fl.Close(context.Background())
			lk, err := fl.TryAcquire(ctx, k, dlock.WithTTL(10*time.Second))
			if err != nil {
				t.Fatal(err)
			}
			refused := func(when string) {
				t.Helper()
				for other, newOther := range newBackend {
					if other == first {
						continue
					}
					ol := dlock.New(newOther(t), nil)
					for name, try := range map[string]func() error{
						"TryAcquire":   func() error { _, err := ol.TryAcquire(ctx, k, dlock.WithTTL(10*time.Second)); return err },
						"Acquire":      func() error { _, err := ol.Acquire(ctx, k, dlock.WithTTL(10*time.Second)); return err },
						"ForceRelease": func() error { return ol.ForceRelease(ctx, k) },
					} {
						if err := try(); !errors.Is(err, sentinel) || !errors.Is(err, dlock.ErrInvalidOption) {
							t.Errorf("rule: one strategy per key; %s: %s's %s on a key of %s: %v, want %v", when, other, name, first, err, sentinel)
						}
					}
					ol.Close(context.Background())
				}
			}
			refused("held")
			if err := lk.Release(ctx); err != nil {
				t.Fatal(err)
			}
			refused("released")
			again := dlock.New(newFirst(t), nil)
			defer again.Close(context.Background())
			lk, err = again.TryAcquire(ctx, k, dlock.WithTTL(10*time.Second))
			if err != nil {
				t.Fatalf("%s again: %v", first, err)
			}
			lk.Release(ctx)
		})
	}
}
