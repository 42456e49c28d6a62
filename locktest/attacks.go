package locktest

// Checks of the shared and limited modes that a backend's tests call with
// backends of their own choosing (several clients, tiny pools), beside the
// rules that Run applies to every backend.

import (
	"context"
	"errors"
	"sync"
	"testing"
	"time"

	"github.com/dlock-dev/dlock"
)

// LimitsAgreeUnderRace checks that clients that disagree on the limit of a free
// key, at the same moment, never both hold it (no two semaphores on one
// key), and no limit is exceeded.
func LimitsAgreeUnderRace(t *testing.T, bs []dlock.Backend) {
	ctx, cancel := context.WithTimeout(context.Background(), 60*time.Second)
	defer cancel()
	for round := range 15 {
		k := UniqueKey("adv-limits")
		type grant struct {
			limit int
			token dlock.Token
			b     dlock.Backend
		}
		var mu sync.Mutex
		var got []grant
		var wg sync.WaitGroup
		start := make(chan struct{})
		for i, b := range bs {
			wg.Go(func() {
				limit := 1 + i%2*2 // 1 or 3
				r := dlock.Request{Key: k, Token: dlock.NewToken(), TTL: 10 * time.Second, Mode: dlock.ModeLimited, Limit: limit}
				<-start
				res, err := b.Acquire(ctx, r)
				if err != nil && !errors.Is(err, dlock.ErrModeMismatch) {
					t.Error(err)
				}
				if err == nil && res.Acquired {
					mu.Lock()
					got = append(got, grant{limit, r.Token, b})
					mu.Unlock()
				}
			})
		}
		close(start)
		wg.Wait()
		limits := map[int]int{}
		for _, g := range got {
			limits[g.limit]++
		}
		if len(limits) > 1 || limits[1] > 1 || limits[3] > 3 {
			t.Errorf("round %d: holders by limit %v", round, limits)
		}
		for _, g := range got {
			_ = g.b.Release(context.Background(), k, g.token)
		}
	}
}

// WriterThatGivesUp checks that a writer whose context ends while readers hold keeps
// new readers out for at most dlock.WriterMark after it gave up.
func WriterThatGivesUp(t *testing.T, reader, writer, late dlock.Backend) {
	ctx, cancel := context.WithTimeout(context.Background(), 60*time.Second)
	defer cancel()
	k := UniqueKey("adv-giveup")
	rl, wl, ll := lockerOver(t, reader), lockerOver(t, writer), lockerOver(t, late)
	r, err := rl.TryAcquire(ctx, k, dlock.Shared(), dlock.WithTTL(20*time.Second))
	if err != nil {
		t.Fatal(err)
	}
	defer r.Release(context.Background())
	wctx, wcancel := context.WithTimeout(ctx, 1500*time.Millisecond)
	_, err = wl.Acquire(wctx, k, dlock.WithTTL(6*time.Second))
	wcancel()
	if !errors.Is(err, dlock.ErrNotAcquired) {
		t.Fatalf("writer: %v, want ErrNotAcquired", err)
	}
	gaveUp := time.Now()
	for {
		lk, err := ll.TryAcquire(ctx, k, dlock.Shared())
		if err == nil {
			_ = lk.Release(context.Background())
			t.Logf("readers held back %s after the writer gave up", time.Since(gaveUp).Round(time.Millisecond))
			return
		}
		if !errors.Is(err, dlock.ErrNotAcquired) {
			t.Fatal(err)
		}
		if d := time.Since(gaveUp); d > dlock.WriterMark+time.Second {
			t.Fatalf("a writer that gave up %s ago still keeps readers out: %v", d.Round(time.Millisecond), err)
		}
		time.Sleep(50 * time.Millisecond)
	}
}

// CrashedReader checks that a reader that stops renewing (crashed, paused) frees
// the key for a writer within its TTL, and the writer's fence is larger.
func CrashedReader(t *testing.T, b, wb dlock.Backend) {
	ctx, cancel := context.WithTimeout(context.Background(), 30*time.Second)
	defer cancel()
	k := UniqueKey("adv-crashed-reader")
	req := dlock.Request{Key: k, Token: dlock.NewToken(), TTL: 2 * time.Second, Mode: dlock.ModeShared}
	res, err := b.Acquire(ctx, req)
	if err != nil || !res.Acquired {
		t.Fatalf("reader: %+v %v", res, err)
	}
	taken := time.Now()
	wl := dlock.New(wb, nil)
	defer wl.Close(context.Background())
	actx, acancel := context.WithTimeout(ctx, 2*time.Second+3*time.Second)
	defer acancel()
	w, err := wl.Acquire(actx, k, dlock.WithTTL(5*time.Second))
	if err != nil {
		t.Fatalf("writer after a crashed reader (ttl 2s): %v", err)
	}
	defer w.Release(context.Background())
	if time.Since(taken) < 2*time.Second-200*time.Millisecond {
		t.Errorf("writer got in %s after a reader with a 2 s lease", time.Since(taken))
	}
	if w.Fence() <= res.Fence {
		t.Errorf("writer's fence %d is not above the reader's %d", w.Fence(), res.Fence)
	}
}

// BusyMix checks that many readers, two writers and a semaphore's holders of one
// process on two Lockers over tiny pools all get through, and exclusion
// holds: a writer is never in with a reader, and the semaphore never has
// more than its limit.
func BusyMix(t *testing.T, readers, writers dlock.Backend, withLimited bool) {
	ctx, cancel := context.WithTimeout(context.Background(), 60*time.Second)
	defer cancel()
	rl := dlock.New(readers, &dlock.Options{TTL: 3 * time.Second})
	defer rl.Close(context.Background())
	wl := dlock.New(writers, &dlock.Options{TTL: 3 * time.Second})
	defer wl.Close(context.Background())
	k, sem := UniqueKey("adv-mix"), UniqueKey("adv-mix-sem")
	var mu sync.Mutex
	in, writing, semIn := 0, 0, 0
	var wg sync.WaitGroup
	fail := func(format string, args ...any) {
		t.Errorf(format, args...)
	}
	for i := range 12 {
		wg.Go(func() {
			for range 5 {
				lk, err := rl.Acquire(ctx, k, dlock.Shared())
				if err != nil {
					fail("reader %d: %v", i, err)
					return
				}
				mu.Lock()
				in++
				if writing > 0 {
					fail("a reader is in with a writer")
				}
				mu.Unlock()
				time.Sleep(30 * time.Millisecond)
				mu.Lock()
				in--
				mu.Unlock()
				if err := lk.Release(ctx); err != nil {
					fail("reader release: %v", err)
				}
			}
		})
	}
	for i := range 2 {
		wg.Go(func() {
			for range 3 {
				lk, err := wl.Acquire(ctx, k)
				if err != nil {
					fail("writer %d: %v", i, err)
					return
				}
				mu.Lock()
				writing++
				if in > 0 || writing > 1 {
					fail("a writer is in with %d readers and %d writers", in, writing-1)
				}
				mu.Unlock()
				time.Sleep(10 * time.Millisecond)
				mu.Lock()
				writing--
				mu.Unlock()
				if err := lk.Release(ctx); err != nil {
					fail("writer release: %v", err)
				}
			}
		})
	}
	if withLimited {
		for i := range 4 {
			wg.Go(func() {
				l := rl
				if i%2 == 1 {
					l = wl
				}
				for range 4 {
					lk, err := l.Acquire(ctx, sem, dlock.WithLimit(2))
					if err != nil {
						fail("limited %d: %v", i, err)
						return
					}
					mu.Lock()
					if semIn++; semIn > 2 {
						fail("%d holders of a semaphore of 2", semIn)
					}
					mu.Unlock()
					time.Sleep(20 * time.Millisecond)
					mu.Lock()
					semIn--
					mu.Unlock()
					if err := lk.Release(ctx); err != nil {
						fail("limited release: %v", err)
					}
				}
			})
		}
	}
	wg.Wait()
}

// WriterWaitsLong checks that a writer that waits in the store longer than
// dlock.WriterMark behind a reader keeps new readers out for its whole
// wait, not only for the first mark's life.
func WriterWaitsLong(t *testing.T, reader, writer, late dlock.Backend) {
	ctx, cancel := context.WithTimeout(context.Background(), 60*time.Second)
	defer cancel()
	k := UniqueKey("adv-long-writer")
	rl, wl, ll := lockerOver(t, reader), lockerOver(t, writer), lockerOver(t, late)
	r, err := rl.TryAcquire(ctx, k, dlock.Shared(), dlock.WithTTL(30*time.Second))
	if err != nil {
		t.Fatal(err)
	}
	got := make(chan error, 1)
	go func() {
		w, err := wl.Acquire(ctx, k, dlock.WithTTL(30*time.Second))
		if err == nil {
			err = w.Release(context.Background())
		}
		got <- err
	}()
	began := time.Now()
	for time.Since(began) < 3*dlock.WriterMark {
		time.Sleep(250 * time.Millisecond)
		if lk, err := ll.TryAcquire(ctx, k, dlock.Shared()); err == nil {
			_ = lk.Release(context.Background())
			t.Fatalf("a reader got in %s into a writer's wait", time.Since(began).Round(time.Millisecond))
		} else if !errors.Is(err, dlock.ErrNotAcquired) {
			t.Fatal(err)
		}
	}
	_ = r.Release(context.Background())
	select {
	case err := <-got:
		if err != nil {
			t.Fatal(err)
		}
	case <-time.After(10 * time.Second):
		t.Fatal("the writer did not get the key within 10 s of the reader's release")
	}
}

// WriterWokenByLastReader checks that a writer waiting in the store is handed the
// key soon after the last reader releases it (docs/modes.md: a release
// wakes waiters on the stores that can notify), not at its next look.
func WriterWokenByLastReader(t *testing.T, reader, writer dlock.Backend, within time.Duration) {
	ctx, cancel := context.WithTimeout(context.Background(), 60*time.Second)
	defer cancel()
	rl := dlock.New(reader, nil)
	defer rl.Close(context.Background())
	wl := dlock.New(writer, nil)
	defer wl.Close(context.Background())
	var worst time.Duration
	for range 5 {
		k := UniqueKey("adv-wake-writer")
		r, err := rl.TryAcquire(ctx, k, dlock.Shared(), dlock.WithTTL(30*time.Second))
		if err != nil {
			t.Fatal(err)
		}
		got := make(chan time.Time, 1)
		go func() {
			w, err := wl.Acquire(ctx, k, dlock.WithTTL(30*time.Second))
			at := time.Now()
			if err != nil {
				t.Error(err)
			} else {
				_ = w.Release(context.Background())
			}
			got <- at
		}()
		time.Sleep(1300 * time.Millisecond) // the writer waits in the store
		released := time.Now()
		if err := r.Release(ctx); err != nil {
			t.Fatal(err)
		}
		worst = max(worst, (<-got).Sub(released))
	}
	t.Logf("worst hand-over to the writer after the last reader's release: %s", worst.Round(time.Millisecond))
	if worst > within {
		t.Errorf("the writer got the key %s after the last reader left (want within %s)", worst.Round(time.Millisecond), within)
	}
}
