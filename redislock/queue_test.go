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

// queued waits until key's queue holds n waits (bounded: 10 s) and returns
// their tokens in queue order.
func queued(t *testing.T, admin *redis.Client, queue string, n int) []string {
	t.Helper()
	var toks []string
	for range 1000 {
		var err error
		if toks, err = admin.ZRange(context.Background(), queue, 0, -1).Result(); err != nil {
			t.Fatal(err)
		}
		if len(toks) == n {
			return toks
		}
		time.Sleep(10 * time.Millisecond)
	}
	t.Fatalf("%d waits queued, want %d", len(toks), n)
	return nil
}

// queueFixture is a key held for 30 s on a server of its own, with the
// names of its queue.
type queueFixture struct {
	s             *server
	admin         *redis.Client
	b             *redislock.Backend
	k             string
	queue, queued string
	holder        *dlock.Locker
	lk            *dlock.Lock
}

func newQueueFixture(t *testing.T, name string) *queueFixture {
	f := &queueFixture{s: startServer(t), k: locktest.UniqueKey(name)}
	f.admin = f.s.client(t)
	f.b = newBackend(t, f.s.client(t), nil)
	f.queue, f.queued = f.b.QueueNames(f.k)
	f.holder = locktest.NewLocker(t, f.b)
	var err error
	if f.lk, err = f.holder.TryAcquire(ctxT(t, 5*time.Second), f.k, dlock.WithTTL(30*time.Second)); err != nil {
		t.Fatal(err)
	}
	return f
}

// waiter is a Locker of a Backend of its own on f's server.
func (f *queueFixture) waiter(t *testing.T) *dlock.Locker {
	return locktest.NewLocker(t, newBackend(t, f.s.client(t), nil))
}

// TestQueuedWaitsAreServedInOrder: exclusive waits are handed the key in
// the order they queued, each release hands it on in its own script (the
// waits run no script to take it), and the releaser cannot take the key
// back from the waits queued before it.
func TestQueuedWaitsAreServedInOrder(t *testing.T) {
	f := newQueueFixture(t, "queue")
	admin, k, holder, lk := f.admin, f.k, f.holder, f.lk
	queue := f.queue
	const n = 5
	type got struct {
		i int
		l *dlock.Lock
	}
	order := make(chan got, n)
	release := make(chan struct{})
	for i := range n {
		w := f.waiter(t)
		go func() {
			l, err := w.Acquire(ctxT(t, 20*time.Second), k, dlock.WithTTL(30*time.Second))
			if err != nil {
				t.Errorf("wait %d: %v", i, err)
				order <- got{i, nil}
				return
			}
			order <- got{i, l}
			<-release
			if err := l.Release(context.Background()); err != nil {
				t.Errorf("release %d: %v", i, err)
			}
		}()
		queued(t, admin, queue, i+1) // wait i queued before wait i+1 starts
	}
	if err := lk.Release(context.Background()); err != nil {
		t.Fatal(err)
	}
	before := evalCalls(t, admin) // the release script is loaded
	var held *dlock.HeldError
	if _, err := holder.TryAcquire(ctxT(t, 5*time.Second), k); !errors.As(err, &held) {
		t.Errorf("rule: a releaser does not take the key back from the queue; TryAcquire: %v", err)
	}
	last := lk.Fence()
	for want := range n {
		g := <-order
		if g.l == nil {
			t.FailNow()
		}
		if g.i != want {
			t.Errorf("rule: queued waits are served in order; got wait %d, want %d", g.i, want)
		}
		if g.l.Fence() <= last {
			t.Errorf("fencing: %d after %d", g.l.Fence(), last)
		}
		last = g.l.Fence()
		release <- struct{}{}
	}
	// Scripts: the refused try and n releases by the waits; none by a
	// wait to take the key.
	time.Sleep(100 * time.Millisecond) // the last release lands
	if d := evalCalls(t, admin) - before; d != n+1 {
		t.Errorf("rule: a handoff costs the release alone; %d scripts after the first handoff, want %d", d, n+1)
	}
}

// TestEndedWaitLeavesTheQueue: a wait whose context ends leaves the queue
// before its Locker's Close returns, even when the client is closed right
// after (the usual shutdown), so the next release frees the key instead of
// handing it to nobody.
func TestEndedWaitLeavesTheQueue(t *testing.T) {
	f := newQueueFixture(t, "leave")
	admin, k, holder, lk := f.admin, f.k, f.holder, f.lk
	queue := f.queue
	c := f.s.client(t)
	w := dlock.New(newBackend(t, c, nil), nil)
	ctx, cancel := context.WithCancel(t.Context())
	done := make(chan error, 1)
	go func() {
		_, err := w.Acquire(ctx, k)
		done <- err
	}()
	queued(t, admin, queue, 1)
	cancel()
	if err := <-done; !errors.Is(err, dlock.ErrNotAcquired) {
		t.Fatalf("an ended wait: %v", err)
	}
	if err := w.Close(context.Background()); err != nil {
		t.Fatal(err)
	}
	c.Close()
	if n := admin.ZCard(context.Background(), queue).Val(); n != 0 {
		t.Errorf("rule: an ended wait leaves the queue before Close returns; %d places left", n)
	}
	if err := lk.Release(context.Background()); err != nil {
		t.Fatal(err)
	}
	if l, err := holder.TryAcquire(ctxT(t, 5*time.Second), k); err != nil {
		t.Errorf("the key was handed to an ended wait: %v", err)
	} else {
		l.Release(context.Background())
	}
}

// TestLapsedPlaceIsSkipped: a release skips a queued wait whose place
// lapsed (its waiter stopped attempting: it died) and hands the key to the
// next one.
func TestLapsedPlaceIsSkipped(t *testing.T) {
	f := newQueueFixture(t, "lapsed")
	admin, k, lk := f.admin, f.k, f.lk
	queue := f.queue
	desc := f.queued
	dead := dlock.NewToken().String()
	// First in the queue, with a place that lapsed at the epoch.
	err := admin.Eval(context.Background(), `
redis.call('zadd', KEYS[1], 1, ARGV[1])
redis.call('hset', KEYS[2], ARGV[1], cmsgpack.pack(1, 30000, '', '', '1'))`, []string{queue, desc}, dead).Err()
	if err != nil && err != redis.Nil {
		t.Fatal(err)
	}
	w := f.waiter(t)
	got := make(chan *dlock.Lock, 1)
	go func() {
		l, err := w.Acquire(ctxT(t, 20*time.Second), k)
		if err != nil {
			t.Error(err)
		}
		got <- l
	}()
	queued(t, admin, queue, 2)
	if err := lk.Release(context.Background()); err != nil {
		t.Fatal(err)
	}
	select {
	case l := <-got:
		if l != nil {
			l.Release(context.Background())
		}
	case <-time.After(time.Second):
		t.Fatal("rule: a lapsed place is skipped; the live wait was not handed the key")
	}
	queued(t, admin, queue, 0)
}

// TestStaleHandoffIsNotTrusted: a handoff message naming an earlier attempt
// of the wait (one that came late, after a later attempt was refused) does
// not make the wait report the key as taken: it attempts again, finds the
// key held, and keeps waiting for the real handoff.
func TestStaleHandoffIsNotTrusted(t *testing.T) {
	f := newQueueFixture(t, "stale")
	admin, b, k, lk := f.admin, f.b, f.k, f.lk
	queue := f.queue
	desc := f.queued
	_, _, channel := b.Names(k)
	w := f.waiter(t)
	got := make(chan *dlock.Lock, 1)
	go func() {
		l, err := w.Acquire(ctxT(t, 30*time.Second), k)
		if err != nil {
			t.Error(err)
		}
		got <- l
	}()
	tok := queued(t, admin, queue, 1)[0]
	// Wait until the wait attempted again to keep its place (attempt 2).
	attempt := func() int {
		v, err := admin.Eval(context.Background(), `
local raw = redis.call('hget', KEYS[1], ARGV[1])
if not raw then return 0 end
local _, _, _, _, attempt = cmsgpack.unpack(raw)
return tonumber(attempt)`, []string{desc}, tok).Int()
		if err != nil {
			t.Fatal(err)
		}
		return v
	}
	for i := 0; attempt() < 2; i++ {
		if i == 1000 {
			t.Fatal("the wait did not attempt again to keep its place")
		}
		time.Sleep(10 * time.Millisecond)
	}
	// A handoff of attempt 1, as the release channel carries it.
	field := func(f string) string { return strconv.Itoa(len(f)) + ":" + f }
	msg := "handed:1 999999 1 " + field("30000") + field(tok) + field("") + field("7") + field("") +
		field(strconv.FormatInt(time.Now().UnixMicro(), 10)) + field("0") + field("0")
	if err := admin.SPublish(context.Background(), channel, msg).Err(); err != nil {
		t.Fatal(err)
	}
	select {
	case l := <-got:
		t.Fatalf("rule: a stale handoff is not trusted; the wait took the key with fence %d while it was held", l.Fence())
	case <-time.After(500 * time.Millisecond):
	}
	lock, _, _ := b.Names(k)
	if f, err := admin.HGet(context.Background(), lock, "fence").Uint64(); err != nil || f != lk.Fence() {
		t.Fatalf("the holder lost the key: fence %d, %v", f, err)
	}
	if err := lk.Release(context.Background()); err != nil {
		t.Fatal(err)
	}
	select {
	case l := <-got:
		if l == nil {
			t.FailNow()
		}
		if l.Fence() <= lk.Fence() {
			t.Errorf("fencing: %d after %d", l.Fence(), lk.Fence())
		}
		l.Release(context.Background())
	case <-time.After(5 * time.Second):
		t.Fatal("the wait was not handed the key after the holder's release")
	}
}

// TestWaitOnASubscribedKeyCostsOneScript: a blocking acquisition of a held
// key that a wait of the same Backend already subscribes to costs one
// script before its wait (no separate try), and is served in turn.
func TestWaitOnASubscribedKeyCostsOneScript(t *testing.T) {
	f := newQueueFixture(t, "direct")
	w := f.waiter(t)
	got := make(chan *dlock.Lock, 2)
	wait := func() {
		l, err := w.Acquire(ctxT(t, 20*time.Second), f.k)
		if err != nil {
			t.Error(err)
		}
		got <- l
	}
	go wait()
	queued(t, f.admin, f.queue, 1)
	before := evalCalls(t, f.admin)
	go wait()
	queued(t, f.admin, f.queue, 2)
	if d := evalCalls(t, f.admin) - before; d != 1 {
		t.Errorf("rule: a wait on a subscribed key costs one script before it waits; %d ran", d)
	}
	if err := f.lk.Release(context.Background()); err != nil {
		t.Fatal(err)
	}
	for range 2 {
		l := <-got
		if l == nil {
			t.FailNow()
		}
		if err := l.Release(context.Background()); err != nil {
			t.Error(err)
		}
	}
}

// TestSharedWaitIsNotStarvedByTheQueue: while exclusive waits keep the
// queue full and every release hands the key to the next of them, a shared
// wait (which does not queue) still gets the key.
func TestSharedWaitIsNotStarvedByTheQueue(t *testing.T) {
	f := newQueueFixture(t, "starve")
	if err := f.lk.Release(context.Background()); err != nil {
		t.Fatal(err)
	}
	ctx, cancel := context.WithCancel(t.Context())
	defer cancel()
	var wg sync.WaitGroup
	defer wg.Wait()
	defer cancel()
	for range 3 {
		w := f.waiter(t)
		wg.Go(func() {
			for ctx.Err() == nil {
				l, err := w.Acquire(ctx, f.k)
				if err != nil {
					return
				}
				time.Sleep(20 * time.Millisecond)
				l.Release(context.Background())
			}
		})
	}
	queued(t, f.admin, f.queue, 2) // the writers keep the queue busy
	r := f.waiter(t)
	l, err := r.Acquire(ctxT(t, 6*time.Second), f.k, dlock.Shared())
	if err != nil {
		t.Fatalf("rule: queued exclusive waits do not starve a shared one: %v", err)
	}
	l.Release(context.Background())
}

// A queued wait whose context is cancelled as its attempt is sent (the
// script may run and queue its token after the client gave up on the
// reply) leaves the queue before it returns: the holder's release must not
// hand the key to a wait that has gone.
func TestQueuedWaitCutAsItStartsLeavesTheQueue(t *testing.T) {
	b := newBackend(t, newClient(t, advAddr()), nil)
	holder := newBackend(t, newClient(t, advAddr()), nil)
	k := locktest.UniqueKey("cut-wait")
	for i := range 150 {
		hold := dlock.Request{Key: k, Token: dlock.NewToken(), TTL: 30 * time.Second}
		if res, err := holder.Acquire(ctxT(t, 5*time.Second), hold); err != nil || !res.Acquired {
			t.Fatalf("holder: %+v %v", res, err)
		}
		ctx, cancel := context.WithCancel(context.Background())
		after := time.Duration(i%12) * 50 * time.Microsecond
		time.AfterFunc(after, cancel)
		res, _ := b.AcquireWait(ctx, dlock.Request{Key: k, Token: dlock.NewToken(), TTL: 30 * time.Second})
		cancel()
		if res.Acquired {
			t.Fatalf("round %d: acquired a held key", i)
		}
		if err := holder.Release(ctxT(t, 5*time.Second), k, hold.Token); err != nil {
			t.Fatalf("holder release: %v", err)
		}
		probe := dlock.Request{Key: k, Token: dlock.NewToken(), TTL: 30 * time.Second}
		if res, err := holder.Acquire(ctxT(t, 5*time.Second), probe); err != nil || !res.Acquired {
			t.Fatalf("round %d (cancelled %s in): the key is not free after the holder released: %+v, %v", i, after, res, err)
		}
		if err := holder.Release(ctxT(t, 5*time.Second), k, probe.Token); err != nil {
			t.Fatal(err)
		}
	}
}
