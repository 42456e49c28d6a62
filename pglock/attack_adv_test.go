package pglock_test

import (
	"context"
	"errors"
	"fmt"
	"os"
	"os/exec"
	"syscall"
	"testing"
	"time"

	"github.com/dlock-dev/dlock"
	"github.com/dlock-dev/dlock/locktest"
	"github.com/jackc/pgx/v5/pgxpool"
)

func TestAdvConcurrentFirstLimitsNeverCoexist(t *testing.T) {
	bs := make([]dlock.Backend, 6)
	for i := range bs {
		bs[i] = newLease(t, nil)
	}
	locktest.LimitsAgreeUnderRace(t, bs)
}

func TestAdvWriterGivesUp(t *testing.T) {
	t.Run("lease", func(t *testing.T) {
		locktest.WriterThatGivesUp(t, newLease(t, nil), newLease(t, nil), newLease(t, nil))
	})
	t.Run("advisory", func(t *testing.T) {
		locktest.WriterThatGivesUp(t, newAdvisory(t, nil), newAdvisory(t, nil), newAdvisory(t, nil))
	})
}

func TestAdvCrashedReader(t *testing.T) {
	locktest.CrashedReader(t, newLease(t, nil), newLease(t, nil))
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
			t.Run("lease", func(t *testing.T) { locktest.BusyMix(t, newLease(t, pool()), newLease(t, pool()), true) })
			t.Run("advisory", func(t *testing.T) { locktest.BusyMix(t, newAdvisory(t, pool()), newAdvisory(t, pool()), false) })
		})
	}
}

func TestAdvWriterWaitsLong(t *testing.T) {
	t.Run("lease", func(t *testing.T) { locktest.WriterWaitsLong(t, newLease(t, nil), newLease(t, nil), newLease(t, nil)) })
	t.Run("advisory", func(t *testing.T) {
		locktest.WriterWaitsLong(t, newAdvisory(t, nil), newAdvisory(t, nil), newAdvisory(t, nil))
	})
}

// A writer process that freezes (SIGSTOP, a debugger, a VM pause) while it
// waits in pg_advisory_lock must hold new readers back for a bounded time,
// as a writer that gives up does (dlock.WriterMark), not for as long as the
// current readers hold: its session is not idle, so idle_session_timeout
// does not end it, and its frozen client cannot cancel the wait. The writer
// is a helper process (TestAdvFrozenWriterHelper) stopped once it waits in
// the server.
func TestAdvFrozenAdvisoryWriterHoldsReadersBack(t *testing.T) {
	ctx, cancel := context.WithTimeout(context.Background(), 60*time.Second)
	defer cancel()
	k := locktest.UniqueKey("adv-frozen-writer")
	rl := dlock.New(newAdvisory(t, nil), nil)
	defer rl.Close(context.Background())
	ll := dlock.New(newAdvisory(t, nil), nil)
	defer ll.Close(context.Background())
	r, err := rl.TryAcquire(ctx, k, dlock.Shared(), dlock.WithTTL(30*time.Second))
	if err != nil {
		t.Fatal(err)
	}
	defer r.Release(context.Background())
	cmd := exec.Command(os.Args[0], "-test.run=^TestAdvFrozenWriterHelper$", "-test.count=1")
	cmd.Env = append(os.Environ(), envFrozenWriter+"="+k)
	cmd.Stdout, cmd.Stderr = os.Stderr, os.Stderr
	if err := cmd.Start(); err != nil {
		t.Fatal(err)
	}
	defer func() {
		_ = cmd.Process.Kill()
		_ = cmd.Wait()
	}()
	waitsInServer(t, k)
	if err := cmd.Process.Signal(syscall.SIGSTOP); err != nil {
		t.Fatal(err)
	}
	froze := time.Now()
	const bound = 10 * time.Second // past the mark (3 s), with room for a loaded machine
	for {
		lk, err := ll.TryAcquire(ctx, k, dlock.Shared())
		if err == nil {
			_ = lk.Release(context.Background())
			t.Logf("a new reader got in %s after the writer froze", time.Since(froze).Round(time.Millisecond))
			break
		}
		if !errors.Is(err, dlock.ErrNotAcquired) {
			t.Fatal(err)
		}
		if d := time.Since(froze); d > bound {
			t.Fatalf("a frozen waiting writer has kept new readers out for %s (and does until it thaws or the readers leave)", d.Round(time.Millisecond))
		}
		time.Sleep(200 * time.Millisecond)
	}
}

// envFrozenWriter names the key that TestAdvFrozenWriterHelper waits for.
const envFrozenWriter = "DLOCK_PGLOCK_FROZEN_WRITER"

// TestAdvFrozenWriterHelper is the writer process of
// TestAdvFrozenAdvisoryWriterHoldsReadersBack: it waits for the key
// exclusively, through a Locker over the advisory strategy, until stopped.
func TestAdvFrozenWriterHelper(t *testing.T) {
	k := os.Getenv(envFrozenWriter)
	if k == "" {
		t.Skip("the helper process of TestAdvFrozenAdvisoryWriterHoldsReadersBack")
	}
	ctx, cancel := context.WithTimeout(context.Background(), time.Minute)
	defer cancel()
	l := dlock.New(newAdvisory(t, nil), nil)
	defer l.Close(context.Background())
	lk, err := l.Acquire(ctx, k, dlock.WithTTL(10*time.Second))
	if err != nil {
		t.Fatal(err)
	}
	_ = lk.Release(context.Background())
}

func TestAdvWriterWokenByLastReader(t *testing.T) {
	t.Run("lease", func(t *testing.T) {
		locktest.WriterWokenByLastReader(t, newLease(t, nil), newLease(t, nil), 300*time.Millisecond)
	})
	t.Run("advisory", func(t *testing.T) {
		locktest.WriterWokenByLastReader(t, newAdvisory(t, nil), newAdvisory(t, nil), 300*time.Millisecond)
	})
}
