package locktest

import (
	"context"
	"errors"
	"fmt"
	"os"
	"path/filepath"
	"strconv"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/dlock-dev/dlock"
)

// The rules of shared and limited acquisitions (dlock.Sharer) and of
// AcquireAll. A backend that does not grant a mode must refuse it before any
// I/O; its rules are then skipped.

// modeCases are the rules of this file, in Run's order.
func (s *suite) modeCases() []namedCase {
	return []namedCase{
		{"UnsupportedModesAreRefusedWithoutIO", s.unsupportedModes},
		{"SharedHoldersOverlapAndExcludeWriters", s.sharedOverlap},
		{"ExclusiveHolderExcludesShared", s.exclusiveExcludesShared},
		{"WaitingWriterIsNotStarvedByReaders", s.writerNotStarved},
		{"FencesIncreaseAcrossModes", s.fencesAcrossModes},
		{"LimitBoundsHolders", s.limitBounds},
		{"LimitMismatchIsAnError", s.limitMismatch},
		{"LimitHoldsAmongProcesses", s.limitProcesses},
		{"SharedAndLimitedLeasesRenew", s.modesRenew},
		{"KilledLimitedHolderFreesItsSlot", s.killedLimited},
		{"AcquireAllTakesAllOrNone", s.acquireAllOrNone},
		{"AcquireAllWithCrossingKeysCompletes", s.acquireAllCrossing},
		{"GroupLossIsLossOfTheWhole", s.groupLoss},
	}
}

type namedCase struct {
	name string
	fn   func(t *testing.T)
}

// lockers returns n Lockers, each over a fresh backend.
func (s *suite) lockers(t *testing.T, n int) []*dlock.Locker {
	out := make([]*dlock.Locker, n)
	for i := range out {
		out[i], _ = s.locker(t)
	}
	return out
}

// supports skips t unless the backend grants m.
func (s *suite) supports(t *testing.T, m dlock.Mode) {
	t.Helper()
	if sh, ok := s.newBackend(t).(dlock.Sharer); !ok || !sh.SupportsMode(m) {
		t.Skipf("the backend does not grant %s acquisitions", m)
	}
}

func (s *suite) unsupportedModes(t *testing.T) {
	sh, _ := s.newBackend(t).(dlock.Sharer)
	for _, c := range []struct {
		m   dlock.Mode
		opt dlock.AcquireOption
	}{{dlock.ModeShared, dlock.Shared()}, {dlock.ModeLimited, dlock.WithLimit(2)}} {
		if sh != nil && sh.SupportsMode(c.m) {
			continue
		}
		l, f := s.locker(t)
		_, err := l.TryAcquire(ctxT(t, 10*time.Second), key(t, "k"), c.opt)
		if !errors.Is(err, dlock.ErrUnsupported) {
			t.Errorf("rule: a mode the backend does not grant is ErrUnsupported; %s: %v", c.m, err)
		}
		if n := f.acquires.Load(); n != 0 {
			t.Errorf("rule: an unsupported mode is refused before any I/O; %d store calls", n)
		}
	}
}

func (s *suite) sharedOverlap(t *testing.T) {
	s.supports(t, dlock.ModeShared)
	k := key(t, "k")
	ls := s.lockers(t, 3)
	a, b, w := ls[0], ls[1], ls[2]
	ra := mustAcquire(t, a, k, dlock.Shared())
	rb := mustAcquire(t, b, k, dlock.Shared())
	rc := mustAcquire(t, b, k, dlock.Shared()) // a second reader in one Locker
	if ra.Fence() >= rb.Fence() || rb.Fence() >= rc.Fence() {
		t.Errorf("rule: every shared holder gets a larger fence; %d, %d, %d", ra.Fence(), rb.Fence(), rc.Fence())
	}
	if ra.Mode() != dlock.ModeShared {
		t.Errorf("Mode: %s", ra.Mode())
	}
	mustBeHeld(t, w, k)
	for _, r := range []*dlock.Lock{ra, rb} {
		if err := r.Release(context.Background()); err != nil {
			t.Fatal(err)
		}
	}
	mustBeHeld(t, w, k) // one reader left
	if err := rc.Release(context.Background()); err != nil {
		t.Fatal(err)
	}
	if f := mustBeFree(t, w, k); f <= rc.Fence() {
		t.Errorf("rule: fences increase across modes; the writer got %d after the readers' %d", f, rc.Fence())
	}
}

func (s *suite) exclusiveExcludesShared(t *testing.T) {
	s.supports(t, dlock.ModeShared)
	k := key(t, "k")
	a, _ := s.locker(t)
	b, _ := s.locker(t)
	wr := mustAcquire(t, a, k)
	_, err := b.TryAcquire(ctxT(t, 10*time.Second), k, dlock.WithTTL(ttl), dlock.Shared())
	var he *dlock.HeldError
	if !errors.As(err, &he) {
		t.Fatalf("rule: an exclusive holder excludes readers; TryAcquire shared: %v", err)
	}
	// A reader of the same Locker waits for the local release.
	got := make(chan error, 1)
	go func() {
		r, err := a.Acquire(ctxT(t, 10*time.Second), k, dlock.WithTTL(ttl), dlock.Shared())
		if err == nil {
			err = r.Release(context.Background())
		}
		got <- err
	}()
	select {
	case err := <-got:
		t.Fatalf("rule: an exclusive holder excludes readers of its own Locker; got %v", err)
	case <-time.After(200 * time.Millisecond):
	}
	if err := wr.Release(context.Background()); err != nil {
		t.Fatal(err)
	}
	if err := <-got; err != nil {
		t.Fatalf("the waiting reader: %v", err)
	}
}

func (s *suite) writerNotStarved(t *testing.T) {
	s.supports(t, dlock.ModeShared)
	k := key(t, "k")
	ls := s.lockers(t, 3)
	r1, wl, r2 := ls[0], ls[1], ls[2]
	first := mustAcquire(t, r1, k, dlock.Shared())
	queued := make(chan struct{})
	var once sync.Once
	got := make(chan *dlock.Lock, 1)
	errc := make(chan error, 1)
	go func() {
		lk, err := wl.Acquire(ctxT(t, 20*time.Second), k, dlock.WithTTL(ttl),
			dlock.WithWaitFunc(func(dlock.LockInfo) { once.Do(func() { close(queued) }) }))
		if err != nil {
			errc <- err
			return
		}
		got <- lk
	}()
	select {
	case <-queued:
	case err := <-errc:
		t.Fatalf("writer: %v", err)
	case <-time.After(10 * time.Second):
		t.Fatal("the writer never found the key held")
	}
	// A new reader now queues behind the writer.
	if lk, err := r2.TryAcquire(ctxT(t, 10*time.Second), k, dlock.WithTTL(ttl), dlock.Shared()); err == nil {
		lk.Release(context.Background())
		t.Fatal("rule: once a writer waits, new readers wait behind it; a reader got in")
	} else if !errors.Is(err, dlock.ErrNotAcquired) {
		t.Fatalf("TryAcquire shared: %v", err)
	}
	if err := first.Release(context.Background()); err != nil {
		t.Fatal(err)
	}
	select {
	case lk := <-got:
		if lk.Fence() <= first.Fence() {
			t.Errorf("fences: the writer's %d after the reader's %d", lk.Fence(), first.Fence())
		}
		lk.Release(context.Background())
	case err := <-errc:
		t.Fatalf("rule: the writer gets the key when the readers leave; %v", err)
	}
	// The writer gone, readers get in again.
	mustAcquire(t, r2, k, dlock.Shared()).Release(context.Background())
}

func (s *suite) fencesAcrossModes(t *testing.T) {
	s.supports(t, dlock.ModeShared)
	k := key(t, "k")
	l, _ := s.locker(t)
	var last uint64
	for i := range 30 {
		var opts []dlock.AcquireOption
		if i%3 != 0 {
			opts = append(opts, dlock.Shared())
		}
		lk := mustAcquire(t, l, k, opts...)
		if lk.Fence() <= last {
			t.Fatalf("rule: fences strictly increase across modes; %d after %d", lk.Fence(), last)
		}
		last = lk.Fence()
		if err := lk.Release(context.Background()); err != nil {
			t.Fatal(err)
		}
	}
}

func (s *suite) limitBounds(t *testing.T) {
	s.supports(t, dlock.ModeLimited)
	k := key(t, "k")
	const n = 3
	var held []*dlock.Lock
	var last uint64
	for range n {
		l, _ := s.locker(t)
		lk := mustAcquire(t, l, k, dlock.WithLimit(n))
		if lk.Fence() <= last {
			t.Errorf("rule: every holder gets a larger fence; %d after %d", lk.Fence(), last)
		}
		last = lk.Fence()
		held = append(held, lk)
	}
	other, _ := s.locker(t)
	_, err := other.TryAcquire(ctxT(t, 10*time.Second), k, dlock.WithTTL(ttl), dlock.WithLimit(n))
	var he *dlock.HeldError
	if !errors.As(err, &he) {
		t.Fatalf("rule: at most %d holders; the %dth TryAcquire: %v", n, n+1, err)
	}
	// A waiter gets the slot that a release frees.
	got := make(chan error, 1)
	go func() {
		lk, err := other.Acquire(ctxT(t, 10*time.Second), k, dlock.WithTTL(ttl), dlock.WithLimit(n))
		if err == nil {
			if lk.Fence() <= last {
				err = fmt.Errorf("rule: fences increase; %d after %d", lk.Fence(), last)
			}
			err = dlock.Join(err, lk.Release(context.Background()))
		}
		got <- err
	}()
	time.Sleep(100 * time.Millisecond)
	if err := held[1].Release(context.Background()); err != nil {
		t.Fatal(err)
	}
	if err := <-got; err != nil {
		t.Fatalf("the waiter for a freed slot: %v", err)
	}
	for _, lk := range []*dlock.Lock{held[0], held[2]} {
		if err := lk.Release(context.Background()); err != nil {
			t.Fatal(err)
		}
	}
}

func (s *suite) limitMismatch(t *testing.T) {
	s.supports(t, dlock.ModeLimited)
	k := key(t, "k")
	a, _ := s.locker(t)
	b, fb := s.locker(t)
	lk := mustAcquire(t, a, k, dlock.WithLimit(3))
	defer lk.Release(context.Background())
	for name, opts := range map[string][]dlock.AcquireOption{
		"another limit": {dlock.WithLimit(2)},
		"exclusive":     nil,
		"shared":        {dlock.Shared()},
	} {
		if name == "shared" {
			if sh, _ := s.newBackend(t).(dlock.Sharer); !sh.SupportsMode(dlock.ModeShared) {
				continue
			}
		}
		_, err := b.TryAcquire(ctxT(t, 10*time.Second), k, append(opts, dlock.WithTTL(ttl))...)
		if !errors.Is(err, dlock.ErrModeMismatch) {
			t.Errorf("rule: every holder of a limited key uses its limit; %s: %v, want ErrModeMismatch", name, err)
		}
	}
	if fb.releases.Load() != 0 {
		t.Errorf("a refused mismatch was resolved as an unknown outcome (%d releases)", fb.releases.Load())
	}
	// The refused requests took nothing: the two free slots are there.
	mustAcquire(t, b, k, dlock.WithLimit(3)).Release(context.Background())
}

// limitHelper is the "limited" helper role: rounds acquisitions of k with
// a limit of limitN, each inside a critical section of limitN slots.
func limitHelper(ctx context.Context, l *dlock.Locker, k, dir string, rounds int) error {
	for range rounds {
		lk, err := l.Acquire(ctx, k, dlock.WithTTL(procTTL), dlock.WithLimit(limitN))
		if err != nil {
			return err
		}
		err = limitedSection(dir, lk.Fence())
		if err := dlock.Join(err, lk.Err(), lk.Release(context.Background())); err != nil {
			return err
		}
	}
	return nil
}

const limitN = 2

// limitedSection takes one of limitN slot files, failing if none is free.
func limitedSection(dir string, fence uint64) error {
	for i := range limitN {
		slot := filepath.Join(dir, "slot"+strconv.Itoa(i))
		f, err := os.OpenFile(slot, os.O_CREATE|os.O_EXCL|os.O_WRONLY, 0o600)
		if errors.Is(err, os.ErrExist) {
			continue
		}
		if err != nil {
			return err
		}
		f.Close()
		time.Sleep(2 * time.Millisecond)
		return os.Remove(slot)
	}
	return fmt.Errorf("rule: at most %d holders among processes; fence %d found every slot taken", limitN, fence)
}

func (s *suite) limitProcesses(t *testing.T) {
	s.supports(t, dlock.ModeLimited)
	if s.inProcess {
		t.Skip("in-process backend: state is not shared between processes")
	}
	k, dir := key(t, "k"), t.TempDir()
	const procs, rounds = 4, 15
	wait := s.spawnAll(t, procs, "limited", k, dir, func(int) int { return rounds })
	l, _ := s.locker(t)
	if err := limitHelper(ctxT(t, 90*time.Second), l, k, dir, rounds); err != nil {
		t.Error(err)
	}
	wait()
}

// spawnAll starts procs helper processes in role, the ith with
// rounds(i) in envRounds, and returns the function that waits for them all
// (failing t for each that failed).
func (s *suite) spawnAll(t *testing.T, procs int, role, k, dir string, rounds func(i int) int) (wait func()) {
	t.Helper()
	var wg sync.WaitGroup
	for i := range procs {
		cmd := s.spawn(t, suiteName(t), role, k, dir, rounds(i))
		if err := cmd.Start(); err != nil {
			t.Fatal(err)
		}
		wg.Add(1)
		go func() {
			defer wg.Done()
			if err := cmd.Wait(); err != nil {
				t.Errorf("helper %d: %v", cmd.Process.Pid, err)
			}
		}()
	}
	return wg.Wait
}

func (s *suite) modesRenew(t *testing.T) {
	for _, c := range []struct {
		m   dlock.Mode
		opt dlock.AcquireOption
	}{{dlock.ModeShared, dlock.Shared()}, {dlock.ModeLimited, dlock.WithLimit(2)}} {
		t.Run(c.m.String(), func(t *testing.T) {
			s.supports(t, c.m)
			k := key(t, "k")
			l, _ := s.locker(t)
			other, _ := s.locker(t)
			lk := mustAcquire(t, l, k, c.opt)
			time.Sleep(2*ttl + ttl/2)
			if err := lk.Err(); err != nil {
				t.Fatalf("rule: a %s lease is renewed while held; %v", c.m, err)
			}
			// Another holder gets in beside it; with the limit of 2 reached,
			// a third is refused; and a writer is refused by a renewed
			// shared lease.
			o := mustAcquire(t, other, k, c.opt)
			if c.m == dlock.ModeLimited {
				_, err := other.TryAcquire(ctxT(t, 10*time.Second), k, dlock.WithTTL(ttl), c.opt)
				if !errors.Is(err, dlock.ErrNotAcquired) {
					t.Errorf("rule: the renewed lease keeps its slot; %v", err)
				}
			}
			o.Release(context.Background())
			if c.m == dlock.ModeShared {
				mustBeHeld(t, other, k)
			}
			if err := lk.Release(context.Background()); err != nil {
				t.Fatal(err)
			}
		})
	}
}

func (s *suite) killedLimited(t *testing.T) {
	s.supports(t, dlock.ModeLimited)
	if s.inProcess {
		t.Skip("in-process backend: state is not shared between processes")
	}
	k := key(t, "k")
	held := s.spawnHolder(t, k, "hold-limited")
	l, _ := s.locker(t)
	_, err := l.TryAcquire(ctxT(t, 10*time.Second), k, dlock.WithTTL(ttl), dlock.WithLimit(1))
	if !errors.Is(err, dlock.ErrNotAcquired) {
		t.Fatalf("the helper's slot: %v", err)
	}
	held.kill(t)
	lk, err := l.Acquire(ctxT(t, s.crashBound), k, dlock.WithTTL(ttl), dlock.WithLimit(1))
	if err != nil {
		t.Fatalf("rule: a killed holder's slot is free again within %s; %v", s.crashBound, err)
	}
	defer lk.Release(context.Background())
	if lk.Fence() <= held.fence {
		t.Errorf("fencing: %d after the killed holder's %d", lk.Fence(), held.fence)
	}
}

func (s *suite) acquireAllOrNone(t *testing.T) {
	ls := s.lockers(t, 3)
	a, b, c := ls[0], ls[1], ls[2]
	k1, k2, k3 := key(t, "1"), key(t, "2"), key(t, "3")
	mid := mustAcquire(t, a, k2)
	_, err := b.TryAcquireAll(ctxT(t, 10*time.Second), []string{k3, k1, k2}, dlock.WithTTL(ttl))
	var he *dlock.HeldError
	if !errors.As(err, &he) || he.Holder.Key != k2 {
		t.Fatalf("TryAcquireAll with one key held: %v, want a *HeldError for %q", err, k2)
	}
	mustBeFree(t, c, k1) // rule: all or none
	ctx, cancel := context.WithTimeout(context.Background(), 300*time.Millisecond)
	defer cancel()
	if _, err := b.AcquireAll(ctx, []string{k1, k2, k3}, dlock.WithTTL(ttl)); !errors.Is(err, dlock.ErrNotAcquired) {
		t.Fatalf("AcquireAll whose ctx ends: %v", err)
	}
	mustBeFree(t, c, k1)
	mustBeFree(t, c, k3)
	if err := mid.Release(context.Background()); err != nil {
		t.Fatal(err)
	}
	g, err := b.AcquireAll(ctxT(t, 10*time.Second), []string{k3, k1, k2, k1}, dlock.WithTTL(ttl))
	if err != nil {
		t.Fatal(err)
	}
	if n := len(g.Locks()); n != 3 {
		t.Errorf("duplicate keys count once: %d locks", n)
	}
	for _, k := range []string{k1, k2, k3} {
		mustBeHeld(t, c, k)
		if g.Lock(k) == nil || g.Lock(k).Key() != k {
			t.Errorf("Group.Lock(%q): %v", k, g.Lock(k))
		}
	}
	if err := g.Release(context.Background()); err != nil {
		t.Fatal(err)
	}
	<-g.Done()
	for _, k := range []string{k1, k2, k3} {
		mustBeFree(t, c, k)
	}
	if _, err := b.AcquireAll(ctxT(t, time.Second), nil); !errors.Is(err, dlock.ErrInvalidKey) {
		t.Errorf("AcquireAll of no keys: %v", err)
	}
}

// acquireAllCrossing runs 8 processes (this one and 7 helpers) taking
// crossing pairs of 4 keys with AcquireAll, in opposite orders: all must
// finish, and no two may hold a key at once.
func (s *suite) acquireAllCrossing(t *testing.T) {
	if s.inProcess {
		t.Skip("in-process backend: state is not shared between processes")
	}
	base, dir := key(t, "k"), t.TempDir()
	const procs, rounds = 7, 6
	wait := s.spawnAll(t, procs, "all", base, dir, func(i int) int { return rounds*100 + i })
	l, _ := s.locker(t)
	if err := allHelper(ctxT(t, 90*time.Second), l, base, dir, rounds, procs); err != nil {
		t.Error(err)
	}
	wait()
}

// allHelper is the "all" helper role: rounds AcquireAll calls of two of
// four keys under base, the pair and its order chosen by i, each key's
// critical section exclusive across processes.
func allHelper(ctx context.Context, l *dlock.Locker, base, dir string, rounds, i int) error {
	pairs := [][2]int{{0, 1}, {1, 0}, {1, 2}, {2, 1}, {2, 3}, {3, 0}, {0, 2}, {3, 1}}
	p := pairs[i%len(pairs)]
	keys := []string{fmt.Sprintf("%s/%d", base, p[0]), fmt.Sprintf("%s/%d", base, p[1])}
	for range rounds {
		g, err := l.AcquireAll(ctx, keys, dlock.WithTTL(procTTL))
		if err != nil {
			return err
		}
		var errs []error
		for _, lk := range g.Locks() {
			errs = append(errs, enter(dir, lk.Key()))
		}
		time.Sleep(2 * time.Millisecond)
		for _, lk := range g.Locks() {
			errs = append(errs, leave(dir, lk.Key()))
		}
		errs = append(errs, g.Err(), g.Release(context.Background()))
		if err := dlock.Join(errs...); err != nil {
			return err
		}
	}
	return nil
}

func markerOf(dir, k string) string {
	return filepath.Join(dir, strings.ReplaceAll(k[strings.LastIndex(k, "/")+1:], "/", "_"))
}

func enter(dir, k string) error {
	f, err := os.OpenFile(markerOf(dir, k), os.O_CREATE|os.O_EXCL|os.O_WRONLY, 0o600)
	if errors.Is(err, os.ErrExist) {
		return fmt.Errorf("rule: AcquireAll excludes per key; %s was held by another process", k)
	}
	if err != nil {
		return err
	}
	return f.Close()
}

func leave(dir, k string) error { return os.Remove(markerOf(dir, k)) }

func (s *suite) groupLoss(t *testing.T) {
	if _, ok := s.newBackend(t).(dlock.ForceReleaser); !ok {
		t.Skip("the backend cannot force a release")
	}
	l, _ := s.locker(t)
	admin, _ := s.locker(t)
	k1, k2 := key(t, "1"), key(t, "2")
	g, err := l.AcquireAll(ctxT(t, 10*time.Second), []string{k1, k2}, dlock.WithTTL(ttl))
	if err != nil {
		t.Fatal(err)
	}
	gctx, cancel := g.Context(context.Background())
	defer cancel()
	if err := admin.ForceRelease(ctxT(t, 10*time.Second), k2); err != nil {
		t.Fatal(err)
	}
	select {
	case <-g.Done():
	case <-time.After(3 * ttl):
		t.Fatal("rule: the loss of one key is the loss of the group; Done stayed open")
	}
	<-gctx.Done()
	if err := g.Err(); !errors.Is(err, dlock.ErrLockLost) {
		t.Errorf("Group.Err: %v, want ErrLockLost", err)
	}
	if !errors.Is(context.Cause(gctx), dlock.ErrLockLost) {
		t.Errorf("the group context's cause: %v", context.Cause(gctx))
	}
	if err := g.Release(context.Background()); !errors.Is(err, dlock.ErrNotHeld) {
		t.Errorf("Release of a group with a lost lock: %v, want ErrNotHeld for it", err)
	}
	mustBeFree(t, admin, k1) // the rest was released
}
