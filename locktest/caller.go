package locktest

import (
	"bufio"
	"context"
	"errors"
	"fmt"
	"math/rand/v2"
	"os"
	"strings"
	"sync"
	"syscall"
	"testing"
	"time"

	"github.com/dlock-dev/dlock"
)

// Rules about what applications do to a lock: deadlines and cancellation at
// every call, small connection pools, panics, pauses, Close at any moment.

// PoolOf gives the suite a way to make backends whose client has at most
// conns connections to the store (database/sql's SetMaxOpenConns, pgxpool's
// MaxConns, go-redis's PoolSize), for the rule that any pool size works.
// Backends without a pool leave it out and the rule is skipped.
func PoolOf(newBackend func(t *testing.T, conns int) dlock.Backend) Option {
	return func(s *suite) { s.pool = newBackend }
}

// longTTL is a lease that no case waits out: a key these cases find free
// was released, not expired.
const longTTL = 30 * time.Second

// deadlines makes Locker calls with contexts that end in 0–5 ms, or have
// already ended, against l, on keys other than the ones the caller holds.
func deadlines(t *testing.T, l, other *dlock.Locker, rounds int) {
	t.Helper()
	busy := key(t, "busy")
	ob := mustAcquire(t, other, busy, dlock.WithTTL(longTTL))
	defer ob.Release(context.Background())
	expired, cancel := context.WithDeadline(context.Background(), time.Now().Add(-time.Second))
	defer cancel()
	short := func() (context.Context, context.CancelFunc) {
		return context.WithTimeout(context.Background(), time.Duration(rand.N(5001))*time.Microsecond)
	}
	for i := range rounds {
		k := key(t, fmt.Sprintf("d%d", i))
		ctx, cancel := short()
		switch i % 4 {
		case 0: // a try with a tiny deadline, released with an expired one
			if lk, err := l.TryAcquire(ctx, k, dlock.WithTTL(ttl)); err == nil {
				_ = lk.Release(expired)
			}
		case 1: // a wait with a tiny deadline on a key held elsewhere
			if lk, err := l.Acquire(ctx, busy, dlock.WithTTL(ttl)); err == nil {
				lk.Release(context.Background())
				t.Errorf("rule: a held key excludes others; acquired %q held by another client", busy)
			}
		case 2: // a held lock released with an expired context
			if lk, err := l.TryAcquire(context.Background(), k, dlock.WithTTL(ttl)); err == nil {
				_ = lk.Release(expired)
			}
		case 3: // an already-expired context everywhere
			_, _ = l.TryAcquire(expired, k, dlock.WithTTL(ttl))
			_, _ = l.Acquire(expired, busy, dlock.WithTTL(ttl))
			_ = l.Do(expired, k, func(context.Context) error { return nil })
		}
		cancel()
	}
}

// callerDeadlines: a caller's deadline ends that caller's call, never
// another lock of the same client.
func (s *suite) callerDeadlines(t *testing.T) {
	b := s.newBackend(t)
	l, other := lockerOver(t, b), lockerOver(t, b)
	observer, _ := s.locker(t)
	long := mustAcquire(t, l, key(t, "long"), dlock.WithTTL(longTTL))
	short := mustAcquire(t, l, key(t, "short"), dlock.WithTTL(ttl)) // renewed every TTL/3 meanwhile
	deadlines(t, l, other, 200)
	deadlines(t, other, l, 100)
	for _, lk := range []*dlock.Lock{long, short} {
		if err := lk.Err(); err != nil {
			t.Errorf("rule: a caller's deadline never disturbs other locks; %q was lost: %v", lk.Key(), err)
			continue
		}
		mustBeHeld(t, observer, lk.Key())
	}
}

// anyPoolSize: a client with a pool of one, two or three connections can
// hold several locks, wait, hand over and release.
func (s *suite) anyPoolSize(t *testing.T) {
	if s.pool == nil {
		t.Skip("the backend has no connection pool to size (no PoolOf option)")
	}
	for conns := 1; conns <= 3; conns++ {
		t.Run(fmt.Sprintf("conns=%d", conns), func(t *testing.T) {
			b1, b2 := s.pool(t, conns), s.pool(t, conns)
			l1, l2, l3 := lockerOver(t, b1), lockerOver(t, b1), lockerOver(t, b2)
			ctx := ctxT(t, 60*time.Second)
			k1, k2 := key(t, "k1"), key(t, "k2")
			h1, err := l1.TryAcquire(ctx, k1, dlock.WithTTL(longTTL))
			if err != nil {
				t.Fatalf("TryAcquire on a pool of %d: %v", conns, err)
			}
			h2, err := l1.TryAcquire(ctx, k2, dlock.WithTTL(longTTL))
			if err != nil {
				t.Fatalf("a second lock on a pool of %d: %v", conns, err)
			}
			if _, err := l2.TryAcquire(ctx, k1, dlock.WithTTL(longTTL)); !errors.Is(err, dlock.ErrNotAcquired) {
				t.Fatalf("TryAcquire of a held key on a pool of %d: got %v, want ErrNotAcquired", conns, err)
			}
			var wg sync.WaitGroup
			got := make(chan error, 3)
			for _, w := range []*dlock.Locker{l2, l3, l3} {
				wg.Add(1)
				go func() {
					defer wg.Done()
					lk, err := w.Acquire(ctx, k1, dlock.WithTTL(longTTL))
					if err == nil {
						time.Sleep(20 * time.Millisecond)
						err = lk.Release(ctx)
					}
					got <- err
				}()
			}
			time.Sleep(300 * time.Millisecond)
			if err := h1.Release(ctx); err != nil {
				t.Fatalf("Release on a pool of %d: %v", conns, err)
			}
			wg.Wait()
			close(got)
			for err := range got {
				if err != nil {
					t.Errorf("rule: any pool size works; a waiter on a pool of %d (key released long before its %s TTL): %v", conns, longTTL, err)
				}
			}
			if err := h2.Release(ctx); err != nil {
				t.Errorf("Release on a pool of %d: %v", conns, err)
			}
		})
	}
}

// doPanics: a panic in Do's fn, recovered by the caller, releases the lock.
func (s *suite) doPanics(t *testing.T) {
	l, _ := s.locker(t)
	other, _ := s.locker(t)
	k := key(t, "k")
	func() {
		defer func() {
			if r := recover(); r != "boom" {
				t.Errorf("recovered %v, want fn's panic", r)
			}
		}()
		_ = l.Do(ctxT(t, 10*time.Second), k, func(context.Context) error { panic("boom") }, dlock.WithTTL(longTTL))
	}()
	if _, err := other.TryAcquire(ctxT(t, 10*time.Second), k, dlock.WithTTL(ttl)); err != nil {
		t.Errorf("rule: Do releases the lock when fn panics; %v", err)
	}
}

// closeRacing: Close at any moment of in-flight acquisitions leaves no key
// held by nobody.
func (s *suite) closeRacing(t *testing.T) {
	other, _ := s.locker(t)
	for round := range 5 {
		b := s.newBackend(t)
		l := dlock.New(b, nil)
		var keys []string
		var wg sync.WaitGroup
		for i := range 6 {
			k := key(t, fmt.Sprintf("r%d-%d", round, i))
			keys = append(keys, k)
			wg.Add(1)
			go func() {
				defer wg.Done()
				ctx, cancel := context.WithTimeout(context.Background(), 10*time.Second)
				defer cancel()
				if i%2 == 0 {
					_, _ = l.TryAcquire(ctx, k, dlock.WithTTL(longTTL))
				} else {
					_, _ = l.Acquire(ctx, k, dlock.WithTTL(longTTL))
				}
			}()
		}
		time.Sleep(time.Duration(rand.N(20000)) * time.Microsecond)
		if err := l.Close(context.Background()); err != nil {
			t.Logf("Close: %v", err)
		}
		wg.Wait()
		closeBackend(b)
		for _, k := range keys {
			// Well within the 30 s lease: a key left to its TTL fails.
			lk, err := other.Acquire(ctxT(t, 5*time.Second), k, dlock.WithTTL(ttl))
			if err != nil {
				t.Fatalf("rule: Close racing acquisitions leaves nothing held; %q: %v", k, err)
			}
			lk.Release(context.Background())
		}
	}
}

// pausedHolder: a holder process stopped past its lease is told of the loss
// by the first Err it calls after resuming.
func (s *suite) pausedHolder(t *testing.T) {
	if s.inProcess {
		t.Skip("in-process backend: state is not shared between processes")
	}
	k := key(t, "k")
	cmd := s.spawn(t, suiteName(t), "pause", k, t.TempDir(), 0)
	in, r := startWithPipes(t, cmd)
	if line, err := r.ReadString('\n'); err != nil || line != "HELD\n" {
		t.Fatalf("helper did not report holding the lock: %q %v", line, err)
	}
	if err := cmd.Process.Signal(syscall.SIGSTOP); err != nil {
		t.Fatal(err)
	}
	time.Sleep(3 * ttl)
	if err := cmd.Process.Signal(syscall.SIGCONT); err != nil {
		t.Fatal(err)
	}
	fmt.Fprintln(in, "Err?")
	line, err := r.ReadString('\n')
	switch {
	case err != nil:
		t.Fatalf("helper: %v", err)
	case strings.HasPrefix(line, "HELD"):
		t.Errorf("rule: Err reports a lease whose deadline passed during a pause of %s; the first Err after resuming was nil (%s)", 3*ttl, strings.TrimSpace(line))
	case line != "LOST\n":
		t.Errorf("helper said %q", line)
	}
}

// pauseHelper holds key, says HELD, and spins, noting the longest gap
// between two turns of its loop, until a line on its stdin asks what Err
// says; it answers with the first Err it calls then.
func pauseHelper(l *dlock.Locker, k string) error {
	lk, err := l.TryAcquire(context.Background(), k, dlock.WithTTL(ttl))
	if err != nil {
		return err
	}
	fmt.Println("HELD")
	asked := make(chan struct{})
	go func() {
		bufio.NewReader(os.Stdin).ReadString('\n')
		close(asked)
	}()
	var gap time.Duration
	for last := time.Now(); ; {
		select {
		case <-asked:
			if lk.Err() == nil {
				fmt.Printf("HELD after a gap of %s\n", gap)
			} else {
				fmt.Println("LOST")
			}
			return nil
		default:
		}
		now := time.Now()
		gap = max(gap, now.Sub(last))
		last = now
		time.Sleep(time.Millisecond)
	}
}

// lockerOver returns a Locker over b, closed at the end of the test.
func lockerOver(t *testing.T, b dlock.Backend) *dlock.Locker {
	l := dlock.New(b, nil)
	t.Cleanup(func() { l.Close(context.Background()) })
	return l
}

// closeBackend closes b if it has a Close method (the pinned sessions of
// session strategies).
func closeBackend(b dlock.Backend) {
	if c, ok := b.(interface{ Close() error }); ok {
		_ = c.Close()
	}
}

// releaseEndedCtx: a Release whose context has already ended (an HTTP
// handler's, after the response) still frees the key, well before its TTL.
func (s *suite) releaseEndedCtx(t *testing.T) {
	l, _ := s.locker(t)
	other, _ := s.locker(t)
	k := key(t, "k")
	lk, err := l.TryAcquire(ctxT(t, 10*time.Second), k, dlock.WithTTL(longTTL))
	if err != nil {
		t.Fatal(err)
	}
	ctx, cancel := context.WithCancel(context.Background())
	cancel()
	_ = lk.Release(ctx)
	// Well within the 30 s lease: a key left to its TTL fails.
	olk, err := other.Acquire(ctxT(t, 10*time.Second), k, dlock.WithTTL(ttl))
	if err != nil {
		t.Fatalf("rule: a release with an ended context still frees the key; %v", err)
	}
	olk.Release(context.Background())
}

// closeEndedCtx: a program that closes its Locker with the context its
// shutdown signal cancelled (signal.NotifyContext) still frees what it
// held, as Release with an ended context does, well before the TTL.
func (s *suite) closeEndedCtx(t *testing.T) {
	l := dlock.New(s.newBackend(t), nil)
	other, _ := s.locker(t)
	k := key(t, "k")
	if _, err := l.TryAcquire(ctxT(t, 10*time.Second), k, dlock.WithTTL(longTTL)); err != nil {
		t.Fatal(err)
	}
	ctx, cancel := context.WithCancel(context.Background())
	cancel()
	t.Logf("Close with an ended context: %v", l.Close(ctx))
	// Well within the 30 s lease: a key left to its TTL fails.
	olk, err := other.Acquire(ctxT(t, 10*time.Second), k, dlock.WithTTL(ttl))
	if err != nil {
		t.Fatalf("rule: Close with an ended context still frees what the Locker held; %v", err)
	}
	olk.Release(context.Background())
}

// sharedBackend: two Lockers over one Backend (two libraries of a program
// handed the same backend), with the same owner id or none, exclude each
// other, and a waiter on one gets the key when the other releases it.
func (s *suite) sharedBackend(t *testing.T) {
	b := s.newBackend(t)
	l1, l2 := lockerOver(t, b), lockerOver(t, b)
	for _, owner := range []string{"", "worker"} {
		k := key(t, owner)
		lk := mustAcquire(t, l1, k, dlock.WithOwner(owner))
		if lk2, err := l2.TryAcquire(ctxT(t, 10*time.Second), k, dlock.WithTTL(ttl), dlock.WithOwner(owner)); err == nil {
			lk2.Release(context.Background())
			t.Fatalf("rule: Lockers sharing a Backend exclude each other; owner %q: both hold %q (fences %d, %d)", owner, k, lk.Fence(), lk2.Fence())
		} else if !errors.Is(err, dlock.ErrNotAcquired) {
			t.Fatalf("owner %q: TryAcquire of a key held through the same Backend: %v", owner, err)
		}
		got := make(chan error, 1)
		go func() {
			lk2, err := l2.Acquire(ctxT(t, 10*time.Second), k, dlock.WithTTL(ttl), dlock.WithOwner(owner))
			if err == nil {
				err = lk2.Release(context.Background())
			}
			got <- err
		}()
		time.Sleep(100 * time.Millisecond)
		if err := lk.Release(context.Background()); err != nil {
			t.Fatal(err)
		}
		if err := <-got; err != nil {
			t.Errorf("owner %q: a waiter on the other Locker of the Backend, after the release: %v", owner, err)
		}
	}
}

// releaseEndedCtxThenClose: a program that releases with an ended context
// (a request's, at shutdown) and then closes its Locker still frees the
// key, well before its TTL: the background release of the first is not
// dropped by the second.
func (s *suite) releaseEndedCtxThenClose(t *testing.T) {
	other, _ := s.locker(t)
	for i := range 10 {
		l := dlock.New(s.newBackend(t), nil)
		k := key(t, fmt.Sprint(i))
		lk, err := l.TryAcquire(ctxT(t, 10*time.Second), k, dlock.WithTTL(longTTL))
		if err != nil {
			t.Fatal(err)
		}
		ctx, cancel := context.WithCancel(context.Background())
		cancel()
		_ = lk.Release(ctx)
		if err := l.Close(context.Background()); err != nil {
			t.Errorf("Close: %v", err)
		}
		// Well within the 30 s lease: a key left to its TTL fails.
		olk, err := other.Acquire(ctxT(t, 10*time.Second), k, dlock.WithTTL(ttl))
		if err != nil {
			t.Fatalf("rule: a Release with an ended context, then Close, frees the key; round %d: %v", i, err)
		}
		olk.Release(context.Background())
	}
}

// longTTLs: a long lease (a day, a year, a century)
// either holds the key like any other or is refused
// with ErrInvalidOption and changes nothing.
func (s *suite) longTTLs(t *testing.T) {
	l, _ := s.locker(t)
	other, _ := s.locker(t)
	for _, d := range []time.Duration{24 * time.Hour, 366 * 24 * time.Hour, 100 * 366 * 24 * time.Hour} {
		k := key(t, d.String())
		lk, err := l.TryAcquire(ctxT(t, 10*time.Second), k, dlock.WithTTL(d))
		if err != nil {
			if !errors.Is(err, dlock.ErrInvalidOption) {
				t.Errorf("rule: a TTL the store cannot keep is ErrInvalidOption; ttl %s: %v", d, err)
			}
			mustBeFree(t, other, k)
			continue
		}
		if err := lk.Err(); err != nil {
			t.Errorf("ttl %s: lost at once: %v", d, err)
		}
		if olk, err := other.TryAcquire(ctxT(t, 10*time.Second), k, dlock.WithTTL(ttl)); err == nil {
			olk.Release(context.Background())
			t.Errorf("rule: a held key excludes others; ttl %s: another client took it", d)
		} else if !errors.Is(err, dlock.ErrNotAcquired) {
			t.Errorf("ttl %s: another client's TryAcquire: %v", d, err)
		}
		if err := lk.Release(ctxT(t, 10*time.Second)); err != nil {
			t.Errorf("ttl %s: Release: %v", d, err)
		}
		mustBeFree(t, other, k)
	}
}

// nestedKeys: keys that are prefixes or path-like extensions of one another,
// path elements a tree store reserves, and keys that fill MaxKeyLen with
// multi-byte characters (differing in their last byte only) are distinct
// locks: each is taken while the others are held, in both orders.
func (s *suite) nestedKeys(t *testing.T) {
	base := key(t, "")
	fill := func(tail string) string { // MaxKeyLen bytes, mostly 4-byte runes
		k := base
		for len(k)+len("🔒")+len(tail) <= dlock.MaxKeyLen {
			k += "🔒"
		}
		return k + strings.Repeat("-", dlock.MaxKeyLen-len(k)-len(tail)) + tail
	}
	keys := []string{
		base + "x", base + "x/", base + "x/y", base + "x/y/", base + "x//y", base + "x%2Fy", base + "x\\y",
		base + ".", base + "..", base + "zookeeper", base + "x*", base + "x?",
		fill("é"), fill("è"), fill("a"),
	}
	for _, k := range keys {
		if len(k) > dlock.MaxKeyLen {
			t.Fatalf("test key of %d bytes", len(k))
		}
	}
	for _, order := range [][]string{keys, reversed(keys)} {
		l, _ := s.locker(t)
		other, _ := s.locker(t)
		var locks []*dlock.Lock
		for _, k := range order {
			lk, err := l.TryAcquire(ctxT(t, 10*time.Second), k, dlock.WithTTL(ttl))
			if err != nil {
				t.Fatalf("rule: distinct keys are distinct locks; %q (%d bytes) with %d others held: %v", k, len(k), len(locks), err)
			}
			locks = append(locks, lk)
		}
		for _, k := range order {
			mustBeHeld(t, other, k)
		}
		for _, lk := range locks {
			if err := lk.Release(context.Background()); err != nil {
				t.Errorf("Release(%q): %v", lk.Key(), err)
			}
		}
	}
}

func reversed(s []string) []string {
	r := make([]string, len(s))
	for i, v := range s {
		r[len(s)-1-i] = v
	}
	return r
}

// concurrentReentrancy: goroutines of one job that take the job's key at
// the same moment with the job's owner id (a parent task and the subtasks
// it waits for) all get the lock, sharing its fence, while any of them
// holds it: none of them waits for the lock its own owner holds.
func (s *suite) concurrentReentrancy(t *testing.T) {
	l, _ := s.locker(t)
	const n = 4
	for round := range 5 {
		k := key(t, fmt.Sprint(round))
		start := make(chan struct{})
		locks := make(chan *dlock.Lock, n)
		var wg sync.WaitGroup
		for i := range n {
			wg.Go(func() {
				<-start
				// Far longer than any round trip; shorter than the store-side
				// waits (a lease's TTL/4 and more).
				lk, err := l.Acquire(ctxT(t, 3*time.Second), k, dlock.WithTTL(longTTL), dlock.WithOwner("job"))
				if err != nil {
					t.Errorf("round %d, goroutine %d: rule: the same Locker and owner get a held lock at once; %v", round, i, err)
					return
				}
				locks <- lk
			})
		}
		close(start)
		wg.Wait() // every handle is held until all are in
		close(locks)
		var fence uint64
		for lk := range locks {
			if fence != 0 && lk.Fence() != fence {
				t.Errorf("round %d: one owner's concurrent acquisitions got fences %d and %d", round, fence, lk.Fence())
			}
			fence = lk.Fence()
			lk.Release(context.Background())
		}
	}
}
