package sqlitelock_test

import (
	"context"
	"os"
	"testing"
	"time"

	"github.com/dlock-dev/dlock"
	"github.com/dlock-dev/dlock/locktest"
)

func advOpen(t *testing.T) dlock.Backend {
	path := os.Getenv(envDB)
	b := sqliteOpen(t, path)
	if err := b.Migrate(context.Background()); err != nil {
		t.Fatal(err)
	}
	return b
}

func TestAdvConcurrentFirstLimitsNeverCoexist(t *testing.T) {
	bs := make([]dlock.Backend, 6)
	for i := range bs {
		bs[i] = advOpen(t)
	}
	locktest.LimitsAgreeUnderRace(t, bs)
}

func TestAdvWriterGivesUp(t *testing.T) {
	locktest.WriterThatGivesUp(t, advOpen(t), advOpen(t), advOpen(t))
}

func TestAdvCrashedReader(t *testing.T) {
	locktest.CrashedReader(t, advOpen(t), advOpen(t))
}

func TestAdvBusyMixTinyPools(t *testing.T) {
	advOpen(t)
	path := os.Getenv(envDB)
	locktest.BusyMix(t, pooled(t, path, 1), pooled(t, path, 1), true)
}

func TestAdvWriterWaitsLong(t *testing.T) {
	locktest.WriterWaitsLong(t, advOpen(t), advOpen(t), advOpen(t))
}

// SQLite polls: the hand-over is bounded by the backoff's 1 s step.
func TestAdvWriterWokenByLastReader(t *testing.T) {
	locktest.WriterWokenByLastReader(t, advOpen(t), advOpen(t), 1200*time.Millisecond)
}
