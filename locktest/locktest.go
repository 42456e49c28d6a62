// Package locktest is the conformance suite every dlock.Backend runs, in the
// manner of testing/slogtest. Each rule of dlock's semantics is a named
// subtest that gets a fresh backend and unique keys, and checks the rule
// through the public Locker API against the real store.
//
// A backend's test calls Run from an ordinary test function:
//
//	func TestConformance(t *testing.T) {
//		locktest.Run(t, func(t *testing.T) dlock.Backend { return newBackend(t) })
//	}
//
// The multi-process cases re-run the test binary as helper processes
// selecting the same test, so newBackend must work in a fresh process (read
// connection settings from the environment, not from state set up by another
// test).
package locktest

import (
	"context"
	"errors"
	"fmt"
	"os"
	"strings"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/dlock-dev/dlock"
)

// Option changes how Run treats a backend.
type Option func(*suite)

// InProcess declares that the backend's state lives inside one process (an
// in-memory backend), so the cases that need several processes are skipped.
func InProcess() Option { return func(s *suite) { s.inProcess = true } }

// CrashFreesWithin sets how soon after its holder process is killed a lock
// must be free again. The default is the lease TTL plus one second; session
// strategies, whose server ends the session at once, promise less.
func CrashFreesWithin(d time.Duration) Option { return func(s *suite) { s.crashBound = d } }

// NoRemainingHint declares a session strategy, whose failed attempts cannot
// say how long the holder will keep the lock (Result.Remaining is 0). Lease
// backends must report the holder's remaining lease, which the Locker's
// backoff never sleeps past.
func NoRemainingHint() Option { return func(s *suite) { s.noRemaining = true } }

// ttl is the lease used by the suite: the shortest allowed, so that expiry
// cases finish quickly.
const ttl = dlock.MinTTL

// procTTL is the lease of the tests where several processes contend for a
// key and each releases what it takes: nothing in them waits for an
// expiry, and eight processes on a loaded machine can take longer than
// the shortest TTL's margin to get a grant confirmed.
const procTTL = 5 * time.Second

type suite struct {
	newBackend  func(t *testing.T) dlock.Backend
	inProcess   bool
	crashBound  time.Duration
	noRemaining bool
	pool        func(t *testing.T, conns int) dlock.Backend
	stallTarget string
	stallable   func(t *testing.T, addr string) dlock.Backend
}

// Run runs the conformance suite against backends made by newBackend. Each
// call of newBackend must return a new client of the same store (as a new
// process would have), which the suite uses to play other processes.
func Run(t *testing.T, newBackend func(t *testing.T) dlock.Backend, opts ...Option) {
	s := &suite{newBackend: newBackend, crashBound: ttl + time.Second}
	for _, o := range opts {
		o(s)
	}
	if role := os.Getenv(envRole); role != "" && os.Getenv(envSuite) == t.Name() {
		s.helper(t, role) // never returns
	}
	cases := []namedCase{
		{"InvalidInputIsRejectedWithoutIO", s.invalidInput},
		{"TryAcquireExcludesOtherHolders", s.tryExcludes},
		{"ExclusionAmongGoroutines", s.exclusionGoroutines},
		{"ExclusionAmongProcesses", s.exclusionProcesses},
		{"OnlyTheTokenHolderCanReleaseOrExtend", s.ownership},
		{"ExpiredLeaseIsNeverRevived", s.expiredNotRevived},
		{"ReleaseOfUnheldLockIsErrNotHeld", s.releaseTwice},
		{"ArbitraryKeysAreJustKeys", s.arbitraryKeys},
		{"FencingTokensIncreaseStrictly", s.fencing},
		{"ReentrancyIsCountedPerOwner", s.reentrancy},
		{"WaitEndsWithContext", s.waitContext},
		{"LocalReleaseWakesLocalWaiter", s.localWake},
		{"WaiterGetsLockReleasedElsewhere", s.waitAcross},
		{"LongWaitDoesNotWasteTheGrant", s.longWait},
		{"AbandonedLeaseExpires", s.abandoned},
		{"KilledHolderProcessFreesLockWithinTTL", s.killedHolder},
		{"RenewalKeepsLockPastTTL", s.renewalKeeps},
		{"RenewalIsBatched", s.renewalBatched},
		{"RenewalFailureIsReportedBeforeExpiry", s.lossOnRenewalFailure},
		{"ForeignReleaseIsReportedAsLoss", s.lossOnForeignRelease},
		{"UnknownAcquireOutcomeIsResolved", s.unknownOutcome},
		{"StoreErrorIsNotNotAcquired", s.storeError},
		{"DoRunsUnderLockAndReleases", s.doRuns},
		{"DoCancelsContextOnLoss", s.doLoss},
		{"CloseReleasesEverything", s.closeReleases},
		{"ListShowsHolders", s.list},
		{"ListWaitersShowsWhoWaits", s.listWaiters},
		{"ListKeysShowsTheLastHolderOfAFreeKey", s.listKeys},
		{"ForceReleaseFencesOutTheHolder", s.forceRelease},
		{"CallerDeadlineNeverDisturbsOtherLocks", s.callerDeadlines},
		{"AnyPoolSizeWorks", s.anyPoolSize},
		{"DoReleasesWhenFnPanics", s.doPanics},
		{"CloseRacingAcquisitionsLeavesNothingHeld", s.closeRacing},
		{"ErrReportsLossAfterPause", s.pausedHolder},
		{"StoreThatStopsAnsweringIsAnError", s.stalledStore},
		{"ReleaseWithEndedContextStillFrees", s.releaseEndedCtx},
		{"CloseWithEndedContextStillFrees", s.closeEndedCtx},
		{"LockersSharingABackendExclude", s.sharedBackend},
		{"ReleaseWithEndedContextThenCloseStillFrees", s.releaseEndedCtxThenClose},
		{"LongTTLsHoldOrAreRefused", s.longTTLs},
		{"KeysThatNestOrFillTheLimitAreDistinct", s.nestedKeys},
		{"ConcurrentAcquisitionsOfOneOwnerShareTheLock", s.concurrentReentrancy},
		{"MinHoldOutlastsAnEarlyRelease", s.minHold},
		{"LockDelayHoldsALostKey", s.lockDelay},
		{"WatchSeesEveryChange", s.watch},
		{"WatchHoldersSeesEveryChange", s.watchHolders},
		{"SetMetadataOnlyByTheHolder", s.setMetadata},
		{"ElectionHasOneLeaderAtATime", s.electionTerms},
		{"ElectionObserversSeeEveryChange", s.electionObserved},
		{"ElectionObserversSeeEveryTerm", s.electionEveryTerm},
		{"ElectionKilledLeaderIsReplaced", s.electionKilledLeader},
	}
	cases = append(cases, s.modeCases()...)
	for _, c := range cases {
		t.Run(c.name, c.fn)
	}
}

// key returns a key unique to this test run.
func key(t *testing.T, suffix string) string {
	return fmt.Sprintf("locktest/%s/%s/%s", dlock.NewToken().String()[:12], t.Name()[strings.LastIndex(t.Name(), "/")+1:], suffix)
}

// locker returns a Locker over a fresh backend (a new "process"), closed at
// the end of the test.
func (s *suite) locker(t *testing.T) (*dlock.Locker, *faulty) {
	t.Helper()
	f := newFaulty(s.newBackend(t))
	l := dlock.New(f.backend(), nil)
	t.Cleanup(func() {
		if err := l.Close(context.Background()); err != nil {
			t.Errorf("Close: %v", err)
		}
	})
	return l, f
}

func ctxT(t *testing.T, d time.Duration) context.Context {
	ctx, cancel := context.WithTimeout(context.Background(), d)
	t.Cleanup(cancel)
	return ctx
}

func mustAcquire(t *testing.T, l *dlock.Locker, k string, opts ...dlock.AcquireOption) *dlock.Lock {
	t.Helper()
	lk, err := l.TryAcquire(ctxT(t, 10*time.Second), k, append([]dlock.AcquireOption{dlock.WithTTL(ttl)}, opts...)...)
	if err != nil {
		t.Fatalf("TryAcquire(%q): %v", k, err)
	}
	return lk
}

// mustBeHeld checks that another client cannot take k.
func mustBeHeld(t *testing.T, other *dlock.Locker, k string) {
	t.Helper()
	lk, err := other.TryAcquire(ctxT(t, 10*time.Second), k, dlock.WithTTL(ttl))
	if err == nil {
		lk.Release(context.Background())
		t.Fatalf("rule: a held key excludes others; another client took %q", k)
	}
	var he *dlock.HeldError
	if !errors.As(err, &he) || !errors.Is(err, dlock.ErrNotAcquired) {
		t.Fatalf("TryAcquire of a held key: got %v, want a *HeldError matching ErrNotAcquired", err)
	}
}

// mustBeFree checks that another client can take k now, and releases it.
func mustBeFree(t *testing.T, other *dlock.Locker, k string) uint64 {
	t.Helper()
	lk := mustAcquire(t, other, k)
	if err := lk.Release(context.Background()); err != nil {
		t.Fatalf("Release: %v", err)
	}
	return lk.Fence()
}

func waitDone(t *testing.T, lk *dlock.Lock, within time.Duration, rule string) {
	t.Helper()
	select {
	case <-lk.Done():
	case <-time.After(within):
		t.Fatalf("rule: %s; Done did not close within %s", rule, within)
	}
}

func (s *suite) invalidInput(t *testing.T) {
	l, f := s.locker(t)
	ctx := ctxT(t, 10*time.Second)
	long := strings.Repeat("k", dlock.MaxKeyLen+1)
	for _, k := range []string{"", long, "bad\xffutf8", "nul\x00byte"} {
		if _, err := l.TryAcquire(ctx, k); !errors.Is(err, dlock.ErrInvalidKey) {
			t.Errorf("TryAcquire(%q): got %v, want ErrInvalidKey", k, err)
		}
		if _, err := l.Acquire(ctx, k); !errors.Is(err, dlock.ErrInvalidKey) {
			t.Errorf("Acquire(%q): got %v, want ErrInvalidKey", k, err)
		}
		if err := l.Do(ctx, k, func(context.Context) error { t.Error("fn ran"); return nil }); !errors.Is(err, dlock.ErrInvalidKey) {
			t.Errorf("Do(%q): got %v, want ErrInvalidKey", k, err)
		}
	}
	k := key(t, "k")
	for name, opt := range map[string]dlock.AcquireOption{
		"ttl below MinTTL":  dlock.WithTTL(dlock.MinTTL - time.Millisecond),
		"zero ttl":          dlock.WithTTL(0),
		"negative ttl":      dlock.WithTTL(-time.Second),
		"negative min hold": dlock.WithMinHold(-time.Second),
		"long owner":        dlock.WithOwner(strings.Repeat("o", dlock.MaxOwnerLen+1)),
		"bad owner":         dlock.WithOwner("\xff"),
		"long metadata":     dlock.WithMetadata(strings.Repeat("m", dlock.MaxMetadataLen+1)),
	} {
		if _, err := l.TryAcquire(ctx, k, opt); !errors.Is(err, dlock.ErrInvalidOption) {
			t.Errorf("%s: got %v, want ErrInvalidOption", name, err)
		}
	}
	if n := f.acquires.Load() + f.extends.Load() + f.releases.Load(); n != 0 {
		t.Errorf("rule: bad input causes no I/O; the backend was called %d times", n)
	}
	if err := dlock.ValidateKey(strings.Repeat("é", dlock.MaxKeyLen/2)); err != nil {
		t.Errorf("a %d-byte UTF-8 key was refused: %v", dlock.MaxKeyLen/2*2, err)
	}
}

func (s *suite) tryExcludes(t *testing.T) {
	a, _ := s.locker(t)
	b, _ := s.locker(t)
	k := key(t, "k")
	lk := mustAcquire(t, a, k, dlock.WithOwner("alice"), dlock.WithMetadata("job=1"))
	if lk.Fence() == 0 {
		t.Error("fence is 0")
	}
	if lk.Key() != k || lk.Owner() != "alice" || lk.Err() != nil {
		t.Errorf("Lock: key %q owner %q err %v", lk.Key(), lk.Owner(), lk.Err())
	}
	mustBeHeld(t, b, k)
	// Another acquisition on the same Locker without the owner identity is
	// another owner.
	mustBeHeld(t, a, k)
	if _, err := a.TryAcquire(ctxT(t, 5*time.Second), k, dlock.WithOwner("bob")); !errors.Is(err, dlock.ErrNotAcquired) {
		t.Errorf("different owner on the same Locker: got %v, want ErrNotAcquired", err)
	}
	_, err := b.TryAcquire(ctxT(t, 5*time.Second), k)
	var he *dlock.HeldError
	if errors.As(err, &he) && he.Holder.Key != k {
		t.Errorf("HeldError names key %q, want %q", he.Holder.Key, k)
	}
	if err := lk.Release(context.Background()); err != nil {
		t.Fatal(err)
	}
	select {
	case <-lk.Done():
	default:
		t.Error("Done not closed after Release")
	}
	if t2 := mustBeFree(t, b, k); t2 <= lk.Fence() {
		t.Errorf("rule: fencing increases; next token %d after %d", t2, lk.Fence())
	}
}

// exclusionGoroutines runs goroutines on two shared Lockers and on Lockers of
// their own against one key and checks that critical sections never overlap.
func (s *suite) exclusionGoroutines(t *testing.T) {
	k := key(t, "k")
	shared1, _ := s.locker(t)
	shared2, _ := s.locker(t)
	const workers, rounds = 8, 15
	var inside, overlaps, total atomic.Int64
	var wg sync.WaitGroup
	errc := make(chan error, workers)
	for w := range workers {
		l := shared1
		switch w % 4 {
		case 1:
			l = shared2
		case 2, 3:
			l, _ = s.locker(t)
		}
		wg.Add(1)
		go func() {
			defer wg.Done()
			for range rounds {
				err := l.Do(ctxT(t, 60*time.Second), k, func(ctx context.Context) error {
					if inside.Add(1) > 1 {
						overlaps.Add(1)
					}
					time.Sleep(time.Millisecond)
					inside.Add(-1)
					total.Add(1)
					return nil
				}, dlock.WithTTL(ttl))
				if err != nil {
					errc <- err
					return
				}
			}
		}()
	}
	wg.Wait()
	close(errc)
	for err := range errc {
		t.Errorf("Do: %v", err)
	}
	if n := overlaps.Load(); n != 0 {
		t.Errorf("rule: mutual exclusion; %d critical sections began while another was running", n)
	}
	if n := total.Load(); n != workers*rounds {
		t.Errorf("%d critical sections ran, want %d", n, workers*rounds)
	}
}

func (s *suite) ownership(t *testing.T) {
	b := s.newBackend(t)
	ctx := ctxT(t, 10*time.Second)
	k := key(t, "k")
	mine, theirs := dlock.NewToken(), dlock.NewToken()
	res, err := b.Acquire(ctx, dlock.Request{Key: k, Token: mine, TTL: ttl})
	if err != nil || !res.Acquired {
		t.Fatalf("Acquire: %+v %v", res, err)
	}
	res2, err := b.Acquire(ctx, dlock.Request{Key: k, Token: theirs, TTL: ttl})
	if err != nil || res2.Acquired {
		t.Fatalf("rule: exclusion at the backend; second Acquire: %+v %v", res2, err)
	}
	switch {
	case s.noRemaining && res2.Remaining != 0:
		t.Errorf("Remaining hint %s from a session strategy, want 0 (unknown)", res2.Remaining)
	case !s.noRemaining && (res2.Remaining <= 0 || res2.Remaining > ttl):
		t.Errorf("rule: a failed attempt reports the holder's remaining lease; Remaining %s, want in (0, %s]", res2.Remaining, ttl)
	}
	if err := b.Release(ctx, k, theirs); !errors.Is(err, dlock.ErrNotHeld) {
		t.Errorf("rule: only the holder releases; Release by another token: %v, want ErrNotHeld", err)
	}
	errs, err := b.Extend(ctx, []dlock.Lease{{Key: k, Token: theirs, TTL: ttl}, {Key: k, Token: mine, TTL: ttl}})
	if err != nil || len(errs) != 2 {
		t.Fatalf("Extend: %v %v", errs, err)
	}
	if !errors.Is(errs[0], dlock.ErrNotHeld) {
		t.Errorf("rule: only the holder extends; Extend by another token: %v, want ErrNotHeld", errs[0])
	}
	if errs[1] != nil {
		t.Errorf("Extend by the holder: %v", errs[1])
	}
	if r, err := b.Acquire(ctx, dlock.Request{Key: k, Token: theirs, TTL: ttl}); err != nil || r.Acquired {
		t.Fatalf("rule: failed release/extend by others change nothing; key taken: %+v %v", r, err)
	}
	if err := b.Release(ctx, k, mine); err != nil {
		t.Fatalf("Release by the holder: %v", err)
	}
	if err := b.Release(ctx, k, mine); !errors.Is(err, dlock.ErrNotHeld) {
		t.Errorf("second Release: %v, want ErrNotHeld", err)
	}
	if r, err := b.Acquire(ctx, dlock.Request{Key: k, Token: theirs, TTL: ttl}); err != nil || !r.Acquired || r.Fence <= res.Fence {
		t.Fatalf("after release: %+v %v, want acquired with fence > %d", r, err, res.Fence)
	}
}

func (s *suite) expiredNotRevived(t *testing.T) {
	b := s.newBackend(t)
	ctx := ctxT(t, 10*time.Second)
	k := key(t, "k")
	tok := dlock.NewToken()
	if r, err := b.Acquire(ctx, dlock.Request{Key: k, Token: tok, TTL: ttl}); err != nil || !r.Acquired {
		t.Fatalf("Acquire: %+v %v", r, err)
	}
	time.Sleep(ttl + 200*time.Millisecond)
	errs, err := b.Extend(ctx, []dlock.Lease{{Key: k, Token: tok, TTL: ttl}})
	if err != nil {
		t.Fatal(err)
	}
	if !errors.Is(errs[0], dlock.ErrNotHeld) {
		t.Errorf("rule: a lost lease is never silently re-taken; Extend after expiry: %v", errs[0])
	}
	if err := b.Release(ctx, k, tok); !errors.Is(err, dlock.ErrNotHeld) {
		t.Errorf("Release after expiry: %v, want ErrNotHeld", err)
	}
}

func (s *suite) releaseTwice(t *testing.T) {
	l, f := s.locker(t)
	k := key(t, "k")
	lk := mustAcquire(t, l, k)
	if err := lk.Release(context.Background()); err != nil {
		t.Fatal(err)
	}
	n := f.releases.Load()
	if err := lk.Release(context.Background()); !errors.Is(err, dlock.ErrNotHeld) {
		t.Errorf("second Release: %v, want ErrNotHeld", err)
	}
	if f.releases.Load() != n {
		t.Error("second Release reached the store")
	}
	if !errors.Is(lk.Err(), dlock.ErrNotHeld) {
		t.Errorf("Err after Release: %v, want ErrNotHeld", lk.Err())
	}
}

func (s *suite) arbitraryKeys(t *testing.T) {
	l, _ := s.locker(t)
	other, _ := s.locker(t)
	base := key(t, "")
	keys := []string{
		base + `it's "quoted"`,
		base + `x'; DROP TABLE dlock_locks; --`,
		base + `%_*?[]\`,
		base + "ключ/キー/🔒",
		base + "a",
		base + "A",
		base + "a ",
		base + " a",
		base + "tab\tnewline\n",
		base + strings.Repeat("z", dlock.MaxKeyLen-len(base)),
	}
	var locks []*dlock.Lock
	for _, k := range keys {
		locks = append(locks, mustAcquire(t, l, k)) // distinct keys do not collide
	}
	for _, k := range keys {
		mustBeHeld(t, other, k)
	}
	if lister, ok := s.newBackend(t).(dlock.Lister); ok {
		got, err := lister.List(ctxT(t, 10*time.Second), base)
		if err != nil {
			t.Fatal(err)
		}
		seen := map[string]bool{}
		for _, info := range got {
			seen[info.Key] = true
		}
		for _, k := range keys {
			if !seen[k] {
				t.Errorf("List does not show key %q byte for byte", k)
			}
		}
	}
	for _, lk := range locks {
		if err := lk.Release(context.Background()); err != nil {
			t.Errorf("Release(%q): %v", lk.Key(), err)
		}
	}
	for _, k := range keys {
		mustBeFree(t, other, k)
	}
}

// fencing takes one key 1,000 times through releases, expiries and new
// clients, and checks that every fence is larger than the last.
func (s *suite) fencing(t *testing.T) {
	k := key(t, "k")
	var last uint64
	check := func(tok uint64, how string) {
		t.Helper()
		if tok <= last {
			t.Fatalf("rule: fences strictly increase; %s gave %d after %d", how, tok, last)
		}
		last = tok
	}
	const n = 1000
	// The Locker's acquisitions take longTTL: this case is about fences,
	// and a thousand grants on a 1 s lease would fail whenever one round
	// trip of a loaded machine outlasts the lease's safe deadline.
	l, _ := s.locker(t)
	for i := range n {
		if i%250 == 0 && i > 0 { // a new client, as after a restart of the process
			l, _ = s.locker(t)
		}
		switch {
		case i == n/2 || i == n-1: // expiry instead of release
			b := s.newBackend(t)
			r, err := b.Acquire(ctxT(t, 10*time.Second), dlock.Request{Key: k, Token: dlock.NewToken(), TTL: ttl})
			if err != nil || !r.Acquired {
				t.Fatalf("Acquire: %+v %v", r, err)
			}
			check(r.Fence, "a backend acquisition")
			lk, err := l.Acquire(ctxT(t, ttl+5*time.Second), k, dlock.WithTTL(longTTL))
			if err != nil {
				t.Fatalf("Acquire after expiry: %v", err)
			}
			check(lk.Fence(), "an acquisition after expiry")
			lk.Release(context.Background())
			continue
		}
		lk := mustAcquire(t, l, k, dlock.WithTTL(longTTL))
		check(lk.Fence(), "an acquisition after release")
		if err := lk.Release(context.Background()); err != nil {
			t.Fatal(err)
		}
	}
}

func (s *suite) reentrancy(t *testing.T) {
	l, f := s.locker(t)
	other, _ := s.locker(t)
	k := key(t, "k")
	a := mustAcquire(t, l, k, dlock.WithOwner("worker-1"))
	n := f.acquires.Load()
	b := mustAcquire(t, l, k, dlock.WithOwner("worker-1"))
	c, err := l.Acquire(ctxT(t, 5*time.Second), k, dlock.WithOwner("worker-1"))
	if err != nil {
		t.Fatal(err)
	}
	if f.acquires.Load() != n {
		t.Error("a reentrant acquisition went to the store")
	}
	if a.Fence() != b.Fence() || b.Fence() != c.Fence() {
		t.Errorf("rule: reentrant acquisitions share the fence; got %d %d %d", a.Fence(), b.Fence(), c.Fence())
	}
	for i, lk := range []*dlock.Lock{c, a} {
		if err := lk.Release(context.Background()); err != nil {
			t.Fatalf("release %d: %v", i, err)
		}
		mustBeHeld(t, other, k) // still held while one acquisition remains
	}
	select {
	case <-b.Done():
		t.Fatal("releasing other acquisitions closed this one's Done")
	default:
	}
	if err := b.Release(context.Background()); err != nil {
		t.Fatal(err)
	}
	if err := a.Release(context.Background()); !errors.Is(err, dlock.ErrNotHeld) {
		t.Errorf("releasing a released acquisition: %v, want ErrNotHeld", err)
	}
	mustBeFree(t, other, k)
}

func (s *suite) waitContext(t *testing.T) {
	l, _ := s.locker(t)
	other, _ := s.locker(t)
	k := key(t, "k")
	lk := mustAcquire(t, l, k)
	defer lk.Release(context.Background())

	ctx, cancel := context.WithTimeout(context.Background(), 300*time.Millisecond)
	defer cancel()
	_, err := other.Acquire(ctx, k, dlock.WithTTL(ttl))
	if !errors.Is(err, dlock.ErrNotAcquired) || !errors.Is(err, context.DeadlineExceeded) {
		t.Errorf("rule: a wait ended by its context matches ErrNotAcquired and ctx.Err(); got %v", err)
	}
	ctx, cancel = context.WithCancel(context.Background())
	time.AfterFunc(200*time.Millisecond, cancel)
	_, err = other.Acquire(ctx, k, dlock.WithTTL(ttl))
	if !errors.Is(err, dlock.ErrNotAcquired) || !errors.Is(err, context.Canceled) {
		t.Errorf("cancelled wait: got %v", err)
	}
	// The same for a waiter of the holder's own Locker.
	ctx, cancel = context.WithTimeout(context.Background(), 200*time.Millisecond)
	defer cancel()
	if _, err := l.Acquire(ctx, k, dlock.WithTTL(ttl)); !errors.Is(err, dlock.ErrNotAcquired) || !errors.Is(err, context.DeadlineExceeded) {
		t.Errorf("local wait: got %v", err)
	}
}

// localWake checks that a waiter sharing the holder's Locker waits without
// asking the store and is handed the key by the local release.
func (s *suite) localWake(t *testing.T) {
	l, f := s.locker(t)
	k := key(t, "k")
	lk, err := l.Acquire(ctxT(t, 5*time.Second), k, dlock.WithTTL(30*time.Second))
	if err != nil {
		t.Fatal(err)
	}
	got := make(chan *dlock.Lock, 1)
	go func() {
		w, err := l.Acquire(ctxT(t, 20*time.Second), k, dlock.WithTTL(30*time.Second))
		if err != nil {
			t.Error(err)
		}
		got <- w
	}()
	time.Sleep(500 * time.Millisecond)
	before := f.acquires.Load()
	if err := lk.Release(context.Background()); err != nil {
		t.Fatal(err)
	}
	w := <-got
	if w == nil {
		return
	}
	defer w.Release(context.Background())
	if n := f.acquires.Load() - before; n != 1 {
		t.Errorf("rule: a local waiter is woken by the local release; it asked the store %d times after the release, want 1", n)
	}
	if before != 1 {
		t.Errorf("a local waiter polled the store while the key was held locally (%d calls)", before-1)
	}
	if w.Fence() <= lk.Fence() {
		t.Errorf("fencing: %d after %d", w.Fence(), lk.Fence())
	}
}

func (s *suite) waitAcross(t *testing.T) {
	a, _ := s.locker(t)
	b, _ := s.locker(t)
	k := key(t, "k")
	lk := mustAcquire(t, a, k)
	time.AfterFunc(300*time.Millisecond, func() { lk.Release(context.Background()) })
	var waits atomic.Int64
	w, err := b.Acquire(ctxT(t, 10*time.Second), k, dlock.WithTTL(ttl), dlock.WithWaitFunc(func(h dlock.LockInfo) {
		if h.Key != k {
			t.Errorf("WithWaitFunc got holder of %q, want %q", h.Key, k)
		}
		waits.Add(1)
	}))
	if err != nil {
		t.Fatalf("rule: a waiter gets the key once released; %v", err)
	}
	if waits.Load() == 0 {
		t.Error("WithWaitFunc was never called while waiting")
	}
	defer w.Release(context.Background())
	if !errors.Is(lk.Err(), dlock.ErrNotHeld) {
		t.Errorf("the waiter got the key before the holder released it (holder Err %v)", lk.Err())
	}
	if w.Fence() <= lk.Fence() {
		t.Errorf("fencing: %d after %d", w.Fence(), lk.Fence())
	}
}

// longWait: a waiter that waits longer than a whole lease (the holder keeps
// renewing) gets the key when it is released and keeps it with a full lease:
// the wait must not count against the new lease, or the grant would be
// thrown away as too late and the key churned.
func (s *suite) longWait(t *testing.T) {
	a, _ := s.locker(t)
	b, fb := s.locker(t)
	k := key(t, "k")
	lk := mustAcquire(t, a, k)
	const hold = 3 * ttl
	time.AfterFunc(hold, func() { lk.Release(context.Background()) })
	start := time.Now()
	w, err := b.Acquire(ctxT(t, hold+10*time.Second), k, dlock.WithTTL(ttl))
	if err != nil {
		t.Fatalf("rule: a waiter gets the key once released, however long it waited; %v", err)
	}
	defer w.Release(context.Background())
	if waited := time.Since(start); waited < hold-100*time.Millisecond {
		t.Fatalf("got the key after %s, before its holder released it (holder Err %v)", waited, lk.Err())
	}
	if n := fb.releases.Load(); n != 0 {
		t.Errorf("rule: a grant after a long wait is kept; the waiter released %d grant(s) while waiting (timed from the wait's start, they looked expired)", n)
	}
	if left := time.Until(w.Deadline()); left < ttl/2 {
		t.Errorf("rule: the lease is timed from the grant, not from the start of the wait; %s left of %s right after the grant", left, ttl)
	}
	time.Sleep(ttl)
	if err := w.Err(); err != nil {
		t.Errorf("the lock taken after a long wait was lost: %v", err)
	}
}

// abandoned: a lease whose holder stopped renewing (a crash) is taken by a
// waiter once it expires.
func (s *suite) abandoned(t *testing.T) {
	b := s.newBackend(t)
	l, _ := s.locker(t)
	k := key(t, "k")
	r, err := b.Acquire(ctxT(t, 5*time.Second), dlock.Request{Key: k, Token: dlock.NewToken(), TTL: ttl})
	if err != nil || !r.Acquired {
		t.Fatalf("Acquire: %+v %v", r, err)
	}
	start := time.Now()
	lk, err := l.Acquire(ctxT(t, ttl+time.Second), k, dlock.WithTTL(ttl))
	if err != nil {
		t.Fatalf("rule: an abandoned lease is free within its TTL (+1s); %v", err)
	}
	defer lk.Release(context.Background())
	if time.Since(start) < ttl/2 {
		t.Errorf("rule: an unexpired lease excludes others; taken after %s of a %s lease", time.Since(start), ttl)
	}
	if lk.Fence() <= r.Fence {
		t.Errorf("fencing: %d after %d", lk.Fence(), r.Fence)
	}
}

func (s *suite) renewalKeeps(t *testing.T) {
	l, _ := s.locker(t)
	other, _ := s.locker(t)
	k := key(t, "k")
	lk := mustAcquire(t, l, k)
	d0 := lk.Deadline()
	for range 5 {
		time.Sleep(ttl / 2)
		mustBeHeld(t, other, k)
	}
	if err := lk.Err(); err != nil {
		t.Fatalf("rule: renewal keeps a held lock; Err after %s: %v", 5*ttl/2, err)
	}
	if !lk.Deadline().After(d0.Add(ttl)) {
		t.Errorf("Deadline did not move forward: %v then %v", d0, lk.Deadline())
	}
	if err := lk.Release(context.Background()); err != nil {
		t.Fatal(err)
	}
}

func (s *suite) renewalBatched(t *testing.T) {
	l, f := s.locker(t)
	base := key(t, "")
	var locks []*dlock.Lock
	for i := range 20 {
		locks = append(locks, mustAcquire(t, l, fmt.Sprintf("%s%d", base, i)))
	}
	time.Sleep(ttl)
	if f.maxBatch.Load() < 2 {
		t.Errorf("rule: renewal is batched per Locker; the largest Extend call carried %d leases (%d calls for %d locks)",
			f.maxBatch.Load(), f.extends.Load(), len(locks))
	}
	for _, lk := range locks {
		if err := lk.Err(); err != nil {
			t.Errorf("%s: %v", lk.Key(), err)
		}
		lk.Release(context.Background())
	}
}

// defaultMargin is dlock.Options.Margin's default for ttl: the store's
// lease ends at least this long after the Locker's deadline for it.
const defaultMargin = ttl/10 + 100*time.Millisecond

func (s *suite) lossOnRenewalFailure(t *testing.T) {
	l, f := s.locker(t)
	other, _ := s.locker(t)
	var lk *dlock.Lock
	var k string
	var ctx context.Context
	// The store must still hold the lease when the holder is told: another
	// client's try is refused. A try that returns more than defaultMargin
	// after the holder's deadline cannot tell (the store's lease may have
	// ended by then: a loaded machine), and the scenario runs again.
	for try := 1; ; try++ {
		k = key(t, fmt.Sprintf("k%d", try))
		lk = mustAcquire(t, l, k)
		var cancel context.CancelFunc
		ctx, cancel = lk.Context(context.Background())
		defer cancel()
		f.failExtend.Store(true)
		f.failRelease.Store(true) // the store stays unreachable for this client
		waitDone(t, lk, 2*ttl, "a lease that cannot be renewed is reported lost")
		w, err := other.TryAcquire(ctxT(t, 10*time.Second), k, dlock.WithTTL(ttl))
		late := time.Since(lk.Deadline()) - defaultMargin
		if err == nil {
			w.Release(context.Background())
			if late <= 0 {
				t.Fatalf("rule: a lease that cannot be renewed is reported lost before it ends; another client took %q %s after the holder's deadline",
					k, late+defaultMargin)
			}
			if try == 3 {
				t.Fatalf("three checks came too late to tell whether the holder was told before its lease ended (the last %s after the store's earliest expiry)", late)
			}
			t.Logf("the check came %s after the store's earliest expiry: running again", late)
			f.failExtend.Store(false)
			f.failRelease.Store(false)
			continue
		}
		var he *dlock.HeldError
		if !errors.As(err, &he) || !errors.Is(err, dlock.ErrNotAcquired) {
			t.Fatalf("TryAcquire of a held key: got %v, want a *HeldError matching ErrNotAcquired", err)
		}
		break
	}
	if !errors.Is(lk.Err(), dlock.ErrLockLost) {
		t.Errorf("Err: %v, want ErrLockLost", lk.Err())
	}
	if ctx.Err() == nil || !errors.Is(context.Cause(ctx), dlock.ErrLockLost) {
		t.Errorf("Lock.Context: err %v cause %v, want cancelled with ErrLockLost", ctx.Err(), context.Cause(ctx))
	}
	if time.Now().Before(lk.Deadline()) {
		t.Errorf("reported lost %s before its own deadline", time.Until(lk.Deadline()))
	}
	f.failExtend.Store(false)
	f.failRelease.Store(false)
	time.Sleep(ttl / 2)
	if !errors.Is(lk.Err(), dlock.ErrLockLost) {
		t.Errorf("rule: a lost lock is never silently re-taken; Err became %v", lk.Err())
	}
	if err := lk.Release(context.Background()); !errors.Is(err, dlock.ErrNotHeld) {
		t.Errorf("Release of a lost lock: %v, want ErrNotHeld", err)
	}
	w, err := other.Acquire(ctxT(t, ttl+time.Second), k, dlock.WithTTL(ttl))
	if err != nil {
		t.Fatalf("the lost lease did not expire: %v", err)
	}
	w.Release(context.Background())
}

func (s *suite) lossOnForeignRelease(t *testing.T) {
	l, f := s.locker(t)
	k := key(t, "k")
	lk := mustAcquire(t, l, k)
	// An administrator (or a bug) frees the key behind the holder's back:
	// with the holder's token, or where the lock lives in the holder's
	// session, with ForceRelease.
	other := s.newBackend(t)
	err := other.Release(ctxT(t, 5*time.Second), k, f.token(k))
	if fr, ok := other.(dlock.ForceReleaser); ok && errors.Is(err, dlock.ErrNotHeld) {
		err = fr.ForceRelease(ctxT(t, 5*time.Second), k)
	}
	if err != nil {
		t.Fatal(err)
	}
	waitDone(t, lk, ttl, "a lease the store no longer holds is reported lost at the next renewal")
	if !errors.Is(lk.Err(), dlock.ErrLockLost) {
		t.Errorf("Err: %v, want ErrLockLost", lk.Err())
	}
}

func (s *suite) unknownOutcome(t *testing.T) {
	l, f := s.locker(t)
	other, _ := s.locker(t)
	k := key(t, "k")
	f.failAcquireAfter.Store(true) // the store applied it, the reply was lost
	_, err := l.TryAcquire(ctxT(t, 5*time.Second), k, dlock.WithTTL(30*time.Second))
	if !errors.Is(err, errInjected) || errors.Is(err, dlock.ErrNotAcquired) {
		t.Fatalf("got %v, want the store's error and not ErrNotAcquired", err)
	}
	mustBeFree(t, other, k) // resolved: not left until its 30s TTL
}

func (s *suite) storeError(t *testing.T) {
	l, f := s.locker(t)
	k := key(t, "k")
	f.failAcquireBefore.Store(true)
	for _, acquire := range []func(context.Context, string, ...dlock.AcquireOption) (*dlock.Lock, error){l.TryAcquire, l.Acquire} {
		lk, err := acquire(ctxT(t, 5*time.Second), k, dlock.WithTTL(ttl))
		if lk != nil || !errors.Is(err, errInjected) || errors.Is(err, dlock.ErrNotAcquired) {
			t.Errorf("rule: an outage is an error, not 'acquired' or 'not acquired'; got %v, %v", lk, err)
		}
	}
	f.failAcquireBefore.Store(false)
	mustBeFree(t, l, k) // the Locker recovers when the store does
}

func (s *suite) doRuns(t *testing.T) {
	l, _ := s.locker(t)
	other, _ := s.locker(t)
	k := key(t, "k")
	ran := false
	boom := errors.New("boom")
	err := l.Do(ctxT(t, 10*time.Second), k, func(ctx context.Context) error {
		ran = true
		mustBeHeld(t, other, k)
		return boom
	}, dlock.WithTTL(ttl))
	if !ran || !errors.Is(err, boom) {
		t.Errorf("Do: ran %v err %v, want fn's error", ran, err)
	}
	mustBeFree(t, other, k)
	if err := l.Do(ctxT(t, 10*time.Second), k, func(context.Context) error { return nil }); err != nil {
		t.Errorf("Do: %v", err)
	}
}

func (s *suite) doLoss(t *testing.T) {
	l, f := s.locker(t)
	k := key(t, "k")
	err := l.Do(ctxT(t, 10*time.Second), k, func(ctx context.Context) error {
		f.failExtend.Store(true)
		select {
		case <-ctx.Done():
			if !errors.Is(context.Cause(ctx), dlock.ErrLockLost) {
				t.Errorf("cause %v, want ErrLockLost", context.Cause(ctx))
			}
		case <-time.After(3 * ttl):
			t.Error("rule: Do's context is cancelled when the lock is lost; it was not")
		}
		return nil
	}, dlock.WithTTL(ttl))
	if !errors.Is(err, dlock.ErrLockLost) {
		t.Errorf("Do after a loss: %v, want ErrLockLost even though fn returned nil", err)
	}
}

func (s *suite) closeReleases(t *testing.T) {
	f := newFaulty(s.newBackend(t))
	l := dlock.New(f.backend(), nil)
	other, _ := s.locker(t)
	k1, k2 := key(t, "1"), key(t, "2")
	a := mustAcquire(t, l, k1)
	b := mustAcquire(t, l, k2)
	waited := make(chan error, 1)
	go func() {
		_, err := l.Acquire(ctxT(t, 20*time.Second), k1)
		waited <- err
	}()
	time.Sleep(100 * time.Millisecond)
	if err := l.Close(ctxT(t, 10*time.Second)); err != nil {
		t.Fatalf("Close: %v", err)
	}
	for _, lk := range []*dlock.Lock{a, b} {
		select {
		case <-lk.Done():
		default:
			t.Errorf("%s: Done open after Close", lk.Key())
		}
		if !errors.Is(lk.Err(), dlock.ErrClosed) {
			t.Errorf("Err after Close: %v", lk.Err())
		}
	}
	if err := <-waited; !errors.Is(err, dlock.ErrClosed) {
		t.Errorf("a waiting Acquire after Close: %v, want ErrClosed", err)
	}
	mustBeFree(t, other, k1)
	mustBeFree(t, other, k2)
	if _, err := l.TryAcquire(ctxT(t, time.Second), k1); !errors.Is(err, dlock.ErrClosed) {
		t.Errorf("TryAcquire after Close: %v, want ErrClosed", err)
	}
	if err := l.Close(context.Background()); err != nil {
		t.Errorf("second Close: %v", err)
	}
}

func (s *suite) list(t *testing.T) {
	lister, ok := s.newBackend(t).(dlock.Lister)
	if !ok {
		t.Skip("backend does not implement dlock.Lister")
	}
	l, _ := s.locker(t)
	base := key(t, "")
	before := time.Now()
	a := mustAcquire(t, l, base+"a", dlock.WithOwner("alice"), dlock.WithMetadata("job=nightly"))
	b := mustAcquire(t, l, base+"b")
	elsewhere := key(t, "elsewhere")
	mustAcquire(t, l, elsewhere)
	if err := b.Release(context.Background()); err != nil {
		t.Fatal(err)
	}
	got, err := l.List(ctxT(t, 5*time.Second), base)
	if err != nil {
		t.Fatal(err)
	}
	if len(got) != 1 {
		t.Fatalf("List(%q) = %+v, want only the held key %q", base, got, base+"a")
	}
	g := got[0]
	if g.Key != base+"a" || g.Owner != "alice" || g.Metadata != "job=nightly" || g.Fence != a.Fence() {
		t.Errorf("List entry %+v does not match the lock (owner alice, metadata job=nightly, fence %d)", g, a.Fence())
	}
	if !g.ExpiresAt.IsZero() && (g.ExpiresAt.Before(time.Now()) || g.ExpiresAt.After(time.Now().Add(ttl+time.Second))) { // zero: no lease (session locks)
		t.Errorf("ExpiresAt %v is not within the lease", g.ExpiresAt)
	}
	if g.AcquiredAt.Before(before.Add(-time.Second)) || g.AcquiredAt.After(time.Now().Add(time.Second)) {
		t.Errorf("AcquiredAt %v is not around now", g.AcquiredAt)
	}
	all, err := lister.List(ctxT(t, 5*time.Second), elsewhere)
	if err != nil || len(all) != 1 {
		t.Fatalf("List: %v %v", all, err)
	}
	if want := fmt.Sprintf("pid=%d", os.Getpid()); !strings.Contains(all[0].Metadata, want) {
		t.Errorf("default metadata %q does not name %s", all[0].Metadata, want)
	}
}

func (s *suite) forceRelease(t *testing.T) {
	l, _ := s.locker(t)
	if _, ok := s.newBackend(t).(dlock.ForceReleaser); !ok {
		t.Skip("backend does not implement dlock.ForceReleaser")
	}
	admin, _ := s.locker(t)
	k := key(t, "k")
	if err := admin.ForceRelease(ctxT(t, 5*time.Second), k); !errors.Is(err, dlock.ErrNotHeld) {
		t.Errorf("ForceRelease of a free key: %v, want ErrNotHeld", err)
	}
	if err := admin.ForceRelease(ctxT(t, 5*time.Second), ""); !errors.Is(err, dlock.ErrInvalidKey) {
		t.Errorf("ForceRelease of an invalid key: %v, want ErrInvalidKey", err)
	}
	lk := mustAcquire(t, l, k)
	if err := admin.ForceRelease(ctxT(t, 5*time.Second), k); err != nil {
		t.Fatalf("ForceRelease: %v", err)
	}
	next := mustAcquire(t, admin, k)
	if next.Fence() <= lk.Fence() {
		t.Errorf("rule: a forced release fences out the old holder; new token %d after %d", next.Fence(), lk.Fence())
	}
	waitDone(t, lk, ttl, "a force-released holder is told at its next renewal")
	if !errors.Is(lk.Err(), dlock.ErrLockLost) {
		t.Errorf("Err: %v, want ErrLockLost", lk.Err())
	}
	if err := next.Err(); err != nil {
		t.Errorf("the new holder was disturbed by the old one: %v", err)
	}
	next.Release(context.Background())
}

// NewLocker returns a Locker over b with the default options, closed when
// the test ends: for a backend's own tests beside the suite.
func NewLocker(t testing.TB, b dlock.Backend) *dlock.Locker {
	l := dlock.New(b, nil)
	t.Cleanup(func() { l.Close(context.Background()) })
	return l
}

// UniqueKey returns name with a random suffix: a key that no other test or
// earlier run on the same server uses.
func UniqueKey(name string) string {
	return fmt.Sprintf("%s/%s", name, dlock.NewToken().String()[:8])
}
