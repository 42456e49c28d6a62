package pglock_test

import (
	"fmt"
	"testing"

	"github.com/dlock-dev/dlock"
	"github.com/jackc/pgx/v5/pgxpool"
)

func TestAdvConcurrentFirstLimitsNeverCoexist(t *testing.T) {
	bs := make([]dlock.Backend, 6)
	for i := range bs {
		bs[i] = newLease(t, nil)
	}
	advConcurrentFirstLimits(t, bs)
}

func TestAdvWriterGivesUp(t *testing.T) {
	t.Run("lease", func(t *testing.T) {
		advWriterGivesUp(t, newLease(t, nil), newLease(t, nil), newLease(t, nil))
	})
	t.Run("advisory", func(t *testing.T) {
		advWriterGivesUp(t, newAdvisory(t, nil), newAdvisory(t, nil), newAdvisory(t, nil))
	})
}

func TestAdvCrashedReader(t *testing.T) {
	advCrashedReader(t, newLease(t, nil), newLease(t, nil))
}

// Tiny pools: pgxpool MaxConns 1 and 2.
func TestAdvBusyMixTinyPools(t *testing.T) {
	for _, n := range []int32{1, 2} {
		t.Run(fmt.Sprint(n), func(t *testing.T) {
			open(t, "") // migrated
			pool := func() *pgxpool.Pool {
				cfg := openConfig(t)
				cfg.MaxConns = n
				return openWith(t, cfg)
			}
			t.Run("lease", func(t *testing.T) { advBusyMix(t, newLease(t, pool()), newLease(t, pool()), true) })
			t.Run("advisory", func(t *testing.T) { advBusyMix(t, newAdvisory(t, pool()), newAdvisory(t, pool()), false) })
		})
	}
}

func TestAdvWriterWaitsLong(t *testing.T) {
	t.Run("lease", func(t *testing.T) { advWriterWaitsLong(t, newLease(t, nil), newLease(t, nil), newLease(t, nil)) })
	t.Run("advisory", func(t *testing.T) {
		advWriterWaitsLong(t, newAdvisory(t, nil), newAdvisory(t, nil), newAdvisory(t, nil))
	})
}
