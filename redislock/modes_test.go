package redislock_test

import (
	"context"
	"errors"
	"strconv"
	"sync"
	"testing"
	"time"

	"github.com/dlock-dev/dlock"
	"github.com/dlock-dev/dlock/locktest"
	"github.com/dlock-dev/dlock/redislock"
	"github.com/redis/go-redis/v9"
)

// modeReq is a request for key in mode m (limit for ModeLimited).
func modeReq(key string, m dlock.Mode, limit int, ttl time.Duration) dlock.Request {
	return dlock.Request{Key: key, Token: dlock.NewToken(), TTL: ttl, Mode: m, Limit: limit}
}

// fixture starts a server and returns a client of it, a Backend over that
// client, a context for the test and a unique key named after name.
func fixture(t *testing.T, name string) (*redis.Client, *redislock.Backend, context.Context, string) {
	c := startServer(t).client(t)
	return c, newBackend(t, c, nil), ctxT(t, 30*time.Second), locktest.UniqueKey(name)
}

func mustGrant(t *testing.T, b *redislock.Backend, req dlock.Request) uint64 {
	t.Helper()
	res, err := b.Acquire(ctxT(t, 10*time.Second), req)
	if err != nil || !res.Acquired {
		t.Fatalf("Acquire %s %q: %+v %v", req.Mode, req.Key, res, err)
	}
	return res.Fence
}

func mustRefuse(t *testing.T, b *redislock.Backend, req dlock.Request) dlock.Result {
	t.Helper()
	res, err := b.Acquire(ctxT(t, 10*time.Second), req)
	if err != nil || res.Acquired {
		t.Fatalf("Acquire %s %q: %+v %v, want refused", req.Mode, req.Key, res, err)
	}
	return res
}

// TestUpgradeKeepsLocksAndFences writes a lock as the exclusive-only
// version of this package did (the hash and a counter, nothing else):
// the modes see it as an exclusive holder, its token extends and releases
// it, and the next fence of any mode continues its counter.
func TestUpgradeKeepsLocksAndFences(t *testing.T) {
	c, b, ctx, k := fixture(t, "upgrade")
	lock, fence, _ := b.Names(k)
	tok := dlock.NewToken()
	const old = 5_000_000_000_000_000 // above the clock floor (µs): the counter itself must go on
	if err := c.HSet(ctx, lock, "token", tok.String(), "owner", "alice", "fence", strconv.Itoa(old),
		"metadata", "v0", "acquired_us", "1700000000000000").Err(); err != nil {
		t.Fatal(err)
	}
	c.PExpire(ctx, lock, 10*time.Second)
	c.Set(ctx, fence, old, 0)

	for _, m := range []dlock.Mode{dlock.ModeShared, dlock.ModeExclusive} {
		res := mustRefuse(t, b, modeReq(k, m, 0, 5*time.Second))
		if res.Holder.Token != tok || res.Holder.Fence != old || res.Holder.Mode != dlock.ModeExclusive || res.Remaining < 9*time.Second {
			t.Errorf("%s request on an old lock: %+v, want the old holder, exclusive, about 10s left", m, res)
		}
	}
	if _, err := b.Acquire(ctx, modeReq(k, dlock.ModeLimited, 2, 5*time.Second)); !errors.Is(err, dlock.ErrModeMismatch) {
		t.Errorf("limited request on an old lock: %v, want ErrModeMismatch", err)
	}
	if errs, err := b.Extend(ctx, []dlock.Lease{{Key: k, Token: tok, TTL: 20 * time.Second}}); err != nil || errs[0] != nil {
		t.Errorf("Extend of the old lock: %v %v", errs, err)
	}
	if err := b.Release(ctx, k, tok); err != nil {
		t.Fatalf("Release of the old lock: %v", err)
	}
	if f := mustGrant(t, b, modeReq(k, dlock.ModeShared, 0, 5*time.Second)); f != old+1 {
		t.Errorf("rule: fences continue the existing counter; shared fence %d after %d", f, old)
	}
}

// TestModeStructuresExpire checks that a key's shared holders vanish from
// Redis with their leases (nothing is left behind by a crashed holder) and
// that the counter, which has no expiry, goes on from their fences.
func TestModeStructuresExpire(t *testing.T) {
	c, b, ctx, k := fixture(t, "expire")
	_, fence, _ := b.Names(k)
	holders, info, _ := b.ModeNames(k)
	mustGrant(t, b, modeReq(k, dlock.ModeShared, 0, 2*time.Second))
	last := mustGrant(t, b, modeReq(k, dlock.ModeShared, 0, time.Second))
	for _, name := range []string{holders, info} {
		if d := c.PTTL(ctx, name).Val(); d <= 1900*time.Millisecond || d > 2*time.Second {
			t.Errorf("%s: PTTL %s, want the longest lease (2s)", name, d)
		}
	}
	time.Sleep(2100 * time.Millisecond)
	if n := c.Exists(ctx, holders, info).Val(); n != 0 {
		t.Errorf("rule: the holders expire with their last lease; %d keys left", n)
	}
	if d := c.TTL(ctx, fence).Val(); d != -1 {
		t.Errorf("the counter has TTL %s, want none", d)
	}
	if f := mustGrant(t, b, modeReq(k, dlock.ModeLimited, 2, time.Second)); f <= last {
		t.Errorf("rule: fences go on after the holders expired; %d after %d", f, last)
	}
}

// TestWriterMark follows the writer mark through the scripts: an exclusive
// attempt on a key held shared leaves it for dlock.WriterMark; it refuses
// new shared requests (reporting its own remaining time), not limited ones
// (those are a mismatch); an exclusive grant deletes it.
func TestWriterMark(t *testing.T) {
	c, b, ctx, k := fixture(t, "mark")
	_, _, writer := b.ModeNames(k)
	reader := modeReq(k, dlock.ModeShared, 0, 10*time.Second)
	reader.Owner, reader.Metadata = "bob", "r1"
	rf := mustGrant(t, b, reader)
	if n := c.Exists(ctx, writer).Val(); n != 0 {
		t.Fatal("a writer mark before any exclusive attempt")
	}
	res := mustRefuse(t, b, modeReq(k, dlock.ModeExclusive, 0, 5*time.Second))
	h := res.Holder
	if h.Mode != dlock.ModeShared || h.Token != reader.Token || h.Owner != "bob" || h.Metadata != "r1" || h.Fence != rf ||
		res.Remaining <= 9*time.Second || res.Remaining > 10*time.Second {
		t.Errorf("exclusive attempt on a shared key: %+v, want the reader's description and lease", res)
	}
	if d := c.PTTL(ctx, writer).Val(); d <= dlock.WriterMark-100*time.Millisecond || d > dlock.WriterMark {
		t.Errorf("rule: the writer mark lasts WriterMark; PTTL %s", d)
	}
	res = mustRefuse(t, b, modeReq(k, dlock.ModeShared, 0, 5*time.Second))
	if res.Holder != (dlock.LockInfo{Key: k}) || res.Remaining <= dlock.WriterMark-time.Second || res.Remaining > dlock.WriterMark {
		t.Errorf("rule: the mark refuses new readers until it ends; %+v", res)
	}
	if _, err := b.Acquire(ctx, modeReq(k, dlock.ModeLimited, 2, 5*time.Second)); !errors.Is(err, dlock.ErrModeMismatch) {
		t.Errorf("limited request on a shared key: %v, want ErrModeMismatch", err)
	}
	if err := b.Release(ctx, k, reader.Token); err != nil {
		t.Fatal(err)
	}
	wf := mustGrant(t, b, modeReq(k, dlock.ModeExclusive, 0, 5*time.Second))
	if wf <= rf {
		t.Errorf("fences: the writer's %d after the reader's %d", wf, rf)
	}
	if n := c.Exists(ctx, writer).Val(); n != 0 {
		t.Error("rule: an exclusive grant clears the writer mark; it is still there")
	}
	res = mustRefuse(t, b, modeReq(k, dlock.ModeShared, 0, 5*time.Second))
	if res.Holder.Mode != dlock.ModeExclusive || res.Holder.Fence != wf {
		t.Errorf("a reader behind the writer: %+v", res)
	}
}

// TestModeMismatchChangesNothing checks that a refused mismatch neither
// counts a fence nor leaves a writer mark nor takes a slot.
func TestModeMismatchChangesNothing(t *testing.T) {
	c, b, ctx, k := fixture(t, "mismatch")
	_, fence, _ := b.Names(k)
	holders, _, writer := b.ModeNames(k)
	mustGrant(t, b, modeReq(k, dlock.ModeLimited, 3, 10*time.Second))
	before := c.Get(ctx, fence).Val()
	for _, req := range []dlock.Request{
		modeReq(k, dlock.ModeLimited, 2, time.Second),
		modeReq(k, dlock.ModeExclusive, 0, time.Second),
		modeReq(k, dlock.ModeShared, 0, time.Second),
	} {
		_, err := b.Acquire(ctx, req)
		if !errors.Is(err, dlock.ErrModeMismatch) {
			t.Errorf("%s (limit %d) on a key limited to 3: %v, want ErrModeMismatch", req.Mode, req.Limit, err)
		}
	}
	if after := c.Get(ctx, fence).Val(); after != before {
		t.Errorf("rule: a mismatch changes nothing; the counter went from %s to %s", before, after)
	}
	if n := c.ZCard(ctx, holders).Val(); n != 1 {
		t.Errorf("rule: a mismatch changes nothing; %d holders", n)
	}
	if n := c.Exists(ctx, writer).Val(); n != 0 {
		t.Error("rule: a mismatch changes nothing; an exclusive mismatch left a writer mark")
	}
	// A limited request on a key held exclusively is a mismatch too.
	k2 := locktest.UniqueKey("mismatch")
	mustGrant(t, b, modeReq(k2, dlock.ModeExclusive, 0, 10*time.Second))
	if _, err := b.Acquire(ctx, modeReq(k2, dlock.ModeLimited, 2, time.Second)); !errors.Is(err, dlock.ErrModeMismatch) {
		t.Errorf("limited request on an exclusive key: %v, want ErrModeMismatch", err)
	}
	if _, err := b.Acquire(ctx, modeReq(k2, dlock.ModeLimited, 0, time.Second)); !errors.Is(err, dlock.ErrInvalidOption) {
		t.Errorf("limit 0: %v, want ErrInvalidOption", err)
	}
}

// TestModeHoldersDescribed checks what a refused limited request, a
// retried grant and List report of shared and limited holders.
func TestModeHoldersDescribed(t *testing.T) {
	_, b, ctx, k := fixture(t, "describe")
	var reqs []dlock.Request
	var fences []uint64
	for i, ttl := range []time.Duration{8 * time.Second, 6 * time.Second} {
		req := modeReq(k, dlock.ModeLimited, 2, ttl)
		req.Owner, req.Metadata = "owner"+strconv.Itoa(i), "job="+strconv.Itoa(i)
		reqs = append(reqs, req)
		fences = append(fences, mustGrant(t, b, req))
	}
	// A call that go-redis retries after the script ran finds its own
	// token: a success with the same fence, not a second slot.
	if f := mustGrant(t, b, reqs[0]); f != fences[0] {
		t.Errorf("repeated Acquire with a holder's token: fence %d, want %d", f, fences[0])
	}
	res := mustRefuse(t, b, modeReq(k, dlock.ModeLimited, 2, time.Second))
	h := res.Holder
	if h.Token != reqs[1].Token || h.Owner != "owner1" || h.Metadata != "job=1" || h.Fence != fences[1] ||
		h.Mode != dlock.ModeLimited || h.Limit != 2 || res.Remaining <= 5*time.Second || res.Remaining > 6*time.Second {
		t.Errorf("refused limited request: %+v, want the holder whose lease ends first", res)
	}
	infos, err := b.List(ctx, k)
	if err != nil || len(infos) != 2 {
		t.Fatalf("List: %+v %v", infos, err)
	}
	for i, info := range infos {
		if info.Key != k || info.Token != reqs[i].Token || info.Fence != fences[i] || info.Owner != reqs[i].Owner ||
			info.Mode != dlock.ModeLimited || info.Limit != 2 || info.AcquiredAt.IsZero() {
			t.Errorf("List[%d] = %+v, want holder %d in fence order", i, info, i)
		}
	}
	if err := b.ForceRelease(ctx, k); err != nil {
		t.Fatal(err)
	}
	if err := b.ForceRelease(ctx, k); !errors.Is(err, dlock.ErrNotHeld) {
		t.Errorf("second ForceRelease: %v, want ErrNotHeld", err)
	}
	if infos, err := b.List(ctx, k); err != nil || len(infos) != 0 {
		t.Errorf("List after ForceRelease: %+v %v", infos, err)
	}
}

// TestExtendModes renews a batch of an exclusive, a shared and a limited
// lease with a stranger's token and an expired shared lease: each gets its
// own answer, and the renewed holders' keys outlive their new lease.
func TestExtendModes(t *testing.T) {
	c, b, ctx, ks := fixture(t, "extend")
	kl, kx := locktest.UniqueKey("extend"), locktest.UniqueKey("extend")
	shared := modeReq(ks, dlock.ModeShared, 0, 5*time.Second)
	expired := modeReq(ks, dlock.ModeShared, 0, time.Second)
	limited := modeReq(kl, dlock.ModeLimited, 4, 5*time.Second)
	excl := modeReq(kx, dlock.ModeExclusive, 0, 5*time.Second)
	for _, r := range []dlock.Request{shared, expired, limited, excl} {
		mustGrant(t, b, r)
	}
	time.Sleep(1100 * time.Millisecond)
	leases := []dlock.Lease{
		{Key: ks, Token: shared.Token, TTL: 20 * time.Second},
		{Key: ks, Token: expired.Token, TTL: 20 * time.Second},
		{Key: ks, Token: dlock.NewToken(), TTL: 20 * time.Second},
		{Key: kl, Token: limited.Token, TTL: 20 * time.Second},
		{Key: kx, Token: excl.Token, TTL: 20 * time.Second},
	}
	errs, err := b.Extend(ctx, leases)
	if err != nil {
		t.Fatal(err)
	}
	for i, want := range []error{nil, dlock.ErrNotHeld, dlock.ErrNotHeld, nil, nil} {
		if !errors.Is(errs[i], want) || (want == nil) != (errs[i] == nil) {
			t.Errorf("lease %d: %v, want %v", i, errs[i], want)
		}
	}
	for _, k := range []string{ks, kl} {
		holders, info, _ := b.ModeNames(k)
		for _, name := range []string{holders, info} {
			if d := c.PTTL(ctx, name).Val(); d <= 19*time.Second {
				t.Errorf("%s: PTTL %s after a renewal to 20s", name, d)
			}
		}
	}
	if err := b.Release(ctx, ks, expired.Token); !errors.Is(err, dlock.ErrNotHeld) {
		t.Errorf("rule: an expired lease is not revived; Release: %v", err)
	}
	infos, err := b.List(ctx, ks)
	if err != nil || len(infos) != 1 || infos[0].Token != shared.Token || time.Until(infos[0].ExpiresAt) <= 19*time.Second {
		t.Errorf("List after the renewal: %+v %v, want the renewed reader alone", infos, err)
	}
}

// TestModeRace starts many acquisitions of one key at once in several
// modes: the checks and grants are one script, so the outcome is always a
// legal set of holders.
func TestModeRace(t *testing.T) {
	_, b, _, _ := fixture(t, "race")
	const n, limit = 24, 3
	for round := range 10 {
		k := locktest.UniqueKey("race")
		reqs := make([]dlock.Request, n)
		for i := range reqs {
			if round%2 == 0 {
				reqs[i] = modeReq(k, dlock.ModeLimited, limit, 10*time.Second)
			} else if i%2 == 0 {
				reqs[i] = modeReq(k, dlock.ModeShared, 0, 10*time.Second)
			} else {
				reqs[i] = modeReq(k, dlock.ModeExclusive, 0, 10*time.Second)
			}
		}
		granted := make([]bool, n)
		var wg sync.WaitGroup
		start := make(chan struct{})
		for i := range reqs {
			wg.Go(func() {
				<-start
				res, err := b.Acquire(ctxT(t, 10*time.Second), reqs[i])
				if err != nil {
					t.Error(err)
				}
				granted[i] = res.Acquired
			})
		}
		close(start)
		wg.Wait()
		count := map[dlock.Mode]int{}
		for i, g := range granted {
			if g {
				count[reqs[i].Mode]++
			}
		}
		switch {
		case round%2 == 0 && count[dlock.ModeLimited] != limit:
			t.Errorf("round %d: %d limited holders granted, want %d", round, count[dlock.ModeLimited], limit)
		case count[dlock.ModeExclusive] > 1 || count[dlock.ModeExclusive] == 1 && count[dlock.ModeShared] > 0:
			t.Errorf("round %d: rule: one writer or readers, never both; granted %v", round, count)
		}
		if err := b.ForceRelease(ctxT(t, 10*time.Second), k); err != nil {
			t.Fatal(err)
		}
	}
}

// TestPruneManyExpired lets more holders expire at once than Lua's stack
// can unpack: the next acquisition still prunes them all.
func TestPruneManyExpired(t *testing.T) {
	c, b, ctx, k := fixture(t, "prune")
	const n, limit = 9000, 10000
	if err := redislock.AcquireSharedScript.Load(ctx, c).Err(); err != nil {
		t.Fatal(err)
	}
	pipe := c.Pipeline()
	for range n {
		keys, argv := redislock.AcquireArgs(b, modeReq(k, dlock.ModeLimited, limit, time.Second))
		redislock.AcquireSharedScript.EvalSha(ctx, pipe, keys, argv...)
	}
	if _, err := pipe.Exec(ctx); err != nil {
		t.Fatal(err)
	}
	holders, info, _ := b.ModeNames(k)
	long := modeReq(k, dlock.ModeLimited, limit, 10*time.Second)
	mustGrant(t, b, long) // keeps the keys alive past the others' expiry
	time.Sleep(1100 * time.Millisecond)
	mustGrant(t, b, modeReq(k, dlock.ModeLimited, limit, 10*time.Second))
	if h, i := c.ZCard(ctx, holders).Val(), c.HLen(ctx, info).Val(); h != 2 || i != 2 {
		t.Errorf("after %d leases expired: %d holders, %d descriptions, want 2", n, h, i)
	}
}

// TestModeReleasesWake checks which releases publish on the key's channel:
// a limited holder's, and the last shared holder's, not a shared holder's
// that leaves others holding the key.
func TestModeReleasesWake(t *testing.T) {
	c, b, ctx, k := fixture(t, "wakes")
	_, _, channel := b.Names(k)
	ps := c.SSubscribe(ctx, channel)
	defer ps.Close()
	if _, err := ps.Receive(ctx); err != nil {
		t.Fatal(err)
	}
	msgs := ps.Channel()
	published := func() bool {
		select {
		case <-msgs:
			return true
		case <-time.After(200 * time.Millisecond):
			return false
		}
	}
	r1, r2 := modeReq(k, dlock.ModeShared, 0, 10*time.Second), modeReq(k, dlock.ModeShared, 0, 10*time.Second)
	mustGrant(t, b, r1)
	mustGrant(t, b, r2)
	for i, c := range []struct {
		tok  dlock.Token
		want bool
	}{{r1.Token, false}, {r2.Token, true}} {
		if err := b.Release(ctx, k, c.tok); err != nil {
			t.Fatal(err)
		}
		if got := published(); got != c.want {
			t.Errorf("shared release %d: published %v, want %v", i, got, c.want)
		}
	}
	l1, l2 := modeReq(k, dlock.ModeLimited, 2, 10*time.Second), modeReq(k, dlock.ModeLimited, 2, 10*time.Second)
	mustGrant(t, b, l1)
	mustGrant(t, b, l2)
	if err := b.Release(ctx, k, l1.Token); err != nil {
		t.Fatal(err)
	}
	if !published() {
		t.Error("rule: a limited release frees a slot and wakes waiters; nothing published")
	}
}

// TestWaitingWriterRenewsMark waits for a key held shared for longer than
// dlock.WriterMark: the waiting exclusive acquisition keeps new readers out
// the whole time.
func TestWaitingWriterRenewsMark(t *testing.T) {
	_, b, _, k := fixture(t, "renewmark")
	mustGrant(t, b, modeReq(k, dlock.ModeShared, 0, 10*time.Second))
	ctx, cancel := context.WithCancel(context.Background())
	defer cancel()
	done := make(chan struct{})
	go func() {
		defer close(done)
		res, err := b.AcquireWait(ctx, modeReq(k, dlock.ModeExclusive, 0, 5*time.Second))
		if err != nil || res.Acquired {
			t.Errorf("AcquireWait: %+v %v", res, err)
		}
	}()
	time.Sleep(dlock.WriterMark + 1500*time.Millisecond)
	res := mustRefuse(t, b, modeReq(k, dlock.ModeShared, 0, 5*time.Second))
	if res.Holder.Token != (dlock.Token{}) {
		t.Errorf("a reader after %s of a writer's wait: %+v, want refused by the writer mark", dlock.WriterMark+1500*time.Millisecond, res)
	}
	cancel()
	<-done
}
