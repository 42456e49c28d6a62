package etcdlock_test

import (
	"context"
	"errors"
	"slices"
	"strings"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/dlock-dev/dlock"
	"github.com/dlock-dev/dlock/etcdlock"
	"github.com/dlock-dev/dlock/locktest"
	clientv3 "go.etcd.io/etcd/client/v3"
)

// hookClient is a client that counts its transactions and can run a
// function just before the first transaction that writes a key commits,
// or make its watches silent.
type hookClient struct {
	*clientv3.Client
	txns        atomic.Int64
	beforeWrite func() // run once
	silent      bool   // watches never report anything
	once        sync.Once
}

func (c *hookClient) Txn(ctx context.Context) clientv3.Txn {
	return &hookTxn{Txn: c.Client.Txn(ctx), c: c}
}

func (c *hookClient) Watch(ctx context.Context, key string, opts ...clientv3.OpOption) clientv3.WatchChan {
	if c.silent {
		return make(chan clientv3.WatchResponse) // never closed: the caller's ctx ends the wait
	}
	return c.Client.Watch(ctx, key, opts...)
}

type hookTxn struct {
	clientv3.Txn
	c      *hookClient
	writes bool
}

func (t *hookTxn) If(cs ...clientv3.Cmp) clientv3.Txn { t.Txn = t.Txn.If(cs...); return t }
func (t *hookTxn) Else(ops ...clientv3.Op) clientv3.Txn {
	t.Txn = t.Txn.Else(ops...)
	return t
}

func (t *hookTxn) Then(ops ...clientv3.Op) clientv3.Txn {
	for _, op := range ops {
		t.writes = t.writes || op.IsPut()
	}
	t.Txn = t.Txn.Then(ops...)
	return t
}

func (t *hookTxn) Commit() (*clientv3.TxnResponse, error) {
	t.c.txns.Add(1)
	if t.writes && t.c.beforeWrite != nil {
		t.c.once.Do(t.c.beforeWrite)
	}
	return t.Txn.Commit()
}

// hooked returns a Backend over a hookClient of eps.
func hooked(t *testing.T, eps []string) (*etcdlock.Backend, *hookClient) {
	t.Helper()
	hc := &hookClient{Client: newClient(t, eps...)}
	b, err := etcdlock.New(hc, nil)
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { b.Close() })
	return b, hc
}

func dirOf(k string) string { return etcdlock.DefaultPrefix + strings.ReplaceAll(k, "/", "%2F") + "/" }

func req(k string, m dlock.Mode, limit int, ttl time.Duration) dlock.Request {
	return dlock.Request{Key: k, Token: dlock.NewToken(), TTL: ttl, Mode: m, Limit: limit}
}

func mustTake(t *testing.T, b *etcdlock.Backend, r dlock.Request) dlock.Result {
	t.Helper()
	res, err := b.Acquire(ctxT(t, 10*time.Second), r)
	if err != nil || !res.Acquired {
		t.Fatalf("Acquire %s: %+v %v", r.Mode, res, err)
	}
	return res
}

// TestSharedGrantIsDecidedAtTheEntrysRevision: a shared or limited
// acquisition that read a free queue, then finds on writing its entry that
// another acquisition got in between (a writer, another semaphore holder,
// or a writer that left its mark while the key was held shared), is
// refused and leaves nothing behind: the decision is taken on the queue as
// it is when the entry is written, not as it was read.
func TestSharedGrantIsDecidedAtTheEntrysRevision(t *testing.T) {
	eps := endpoints(t)
	cl := newClient(t, eps...)
	for _, c := range []struct {
		name    string
		mode    dlock.Mode
		limit   int
		holder  *dlock.Request // holds the key before the read
		between dlock.Request  // acquired between the read and the write
		left    int            // entries left after
	}{
		{name: "writer", mode: dlock.ModeShared, between: req("", dlock.ModeExclusive, 0, 10*time.Second), left: 1},
		{name: "limit", mode: dlock.ModeLimited, limit: 1, between: req("", dlock.ModeLimited, 1, 10*time.Second), left: 1},
		{name: "mark", mode: dlock.ModeShared, holder: &dlock.Request{Mode: dlock.ModeShared}, between: req("", dlock.ModeExclusive, 0, 10*time.Second), left: 1},
	} {
		t.Run(c.name, func(t *testing.T) {
			k := locktest.UniqueKey("atomic")
			b, hc := hooked(t, eps)
			other := newBackend(t, eps)
			if c.holder != nil {
				mustTake(t, other, req(k, c.holder.Mode, c.holder.Limit, 10*time.Second))
			}
			between := c.between
			between.Key = k
			var got dlock.Result
			hc.beforeWrite = func() {
				var err error
				if got, err = other.Acquire(ctxT(t, 10*time.Second), between); err != nil {
					t.Errorf("the acquisition in between: %v", err)
				}
			}
			res, err := b.Acquire(ctxT(t, 10*time.Second), req(k, c.mode, c.limit, 10*time.Second))
			if err != nil {
				t.Fatal(err)
			}
			if c.holder == nil && !got.Acquired {
				t.Fatalf("the acquisition in between did not get the key: %+v", got)
			}
			if res.Acquired {
				t.Fatalf("rule: a %s grant is decided on the queue it joins; granted although a %s attempt came between its read and its write", c.mode, between.Mode)
			}
			if n := len(entries(t, cl, dirOf(k))); n != c.left {
				t.Errorf("%d entries left, want %d: the refused entry must go", n, c.left)
			}
		})
	}
}

// TestMismatchedWaiterLeavesTheQueue: a waiting acquisition whose entry
// finds one in another mode or with another limit ahead of it fails with
// ErrModeMismatch and deletes its entry before it returns.
func TestMismatchedWaiterLeavesTheQueue(t *testing.T) {
	eps := endpoints(t)
	cl := newClient(t, eps...)
	holder, waiter := newBackend(t, eps), newBackend(t, eps)
	for _, c := range []struct {
		name         string
		held, waited dlock.Request
	}{
		{"other limit", req("", dlock.ModeLimited, 3, 10*time.Second), req("", dlock.ModeLimited, 2, 10*time.Second)},
		{"exclusive on limited", req("", dlock.ModeLimited, 3, 10*time.Second), req("", dlock.ModeExclusive, 0, 10*time.Second)},
		{"shared on limited", req("", dlock.ModeLimited, 3, 10*time.Second), req("", dlock.ModeShared, 0, 10*time.Second)},
		{"limited on shared", req("", dlock.ModeShared, 0, 10*time.Second), req("", dlock.ModeLimited, 3, 10*time.Second)},
		{"limited on exclusive", req("", dlock.ModeExclusive, 0, 10*time.Second), req("", dlock.ModeLimited, 3, 10*time.Second)},
	} {
		t.Run(c.name, func(t *testing.T) {
			k := locktest.UniqueKey("mismatch")
			c.held.Key, c.waited.Key = k, k
			mustTake(t, holder, c.held)
			_, err := waiter.AcquireWait(ctxT(t, 10*time.Second), c.waited)
			if !errors.Is(err, dlock.ErrModeMismatch) {
				t.Fatalf("AcquireWait %s: %v, want ErrModeMismatch", c.name, err)
			}
			if got := entries(t, cl, dirOf(k)); len(got) != 1 {
				t.Errorf("rule: a refused mismatch leaves nothing behind; directory %v", got)
			}
		})
	}
}

// TestWriterMark: an exclusive attempt that finds the key held shared keeps
// new readers out for at most dlock.WriterMark, and an exclusive grant lets
// them in at once.
func TestWriterMark(t *testing.T) {
	eps := endpoints(t)
	reader, writer, other := newBackend(t, eps), newBackend(t, eps), newBackend(t, eps)
	t.Run("expires", func(t *testing.T) {
		k := locktest.UniqueKey("mark")
		mustTake(t, reader, req(k, dlock.ModeShared, 0, 10*time.Second))
		attempt := time.Now()
		if res, err := writer.Acquire(ctxT(t, 10*time.Second), req(k, dlock.ModeExclusive, 0, 10*time.Second)); err != nil || res.Acquired {
			t.Fatalf("exclusive attempt on a key held shared: %+v %v", res, err)
		}
		res, err := other.Acquire(ctxT(t, 10*time.Second), req(k, dlock.ModeShared, 0, 10*time.Second))
		if err != nil || res.Acquired {
			t.Fatalf("rule: a writer's attempt keeps new readers out; %+v %v", res, err)
		}
		if res.Remaining <= 0 || res.Remaining > dlock.WriterMark {
			t.Errorf("a reader kept out by the mark: Remaining %s, want the mark's, at most %s", res.Remaining, dlock.WriterMark)
		}
		for {
			res, err := other.Acquire(ctxT(t, 10*time.Second), req(k, dlock.ModeShared, 0, 10*time.Second))
			if err != nil {
				t.Fatal(err)
			}
			if res.Acquired {
				break
			}
			if time.Since(attempt) > dlock.WriterMark {
				t.Fatalf("rule: a writer that gave up holds readers back for at most %s; still refused after %s", dlock.WriterMark, time.Since(attempt))
			}
			time.Sleep(50 * time.Millisecond)
		}
	})
	t.Run("cleared by an exclusive grant", func(t *testing.T) {
		k := locktest.UniqueKey("mark")
		r := req(k, dlock.ModeShared, 0, 10*time.Second)
		mustTake(t, reader, r)
		if res, err := writer.Acquire(ctxT(t, 10*time.Second), req(k, dlock.ModeExclusive, 0, 10*time.Second)); err != nil || res.Acquired {
			t.Fatalf("exclusive attempt on a key held shared: %+v %v", res, err)
		}
		if err := reader.Release(ctxT(t, 10*time.Second), k, r.Token); err != nil {
			t.Fatal(err)
		}
		w := req(k, dlock.ModeExclusive, 0, 10*time.Second)
		mustTake(t, writer, w)
		if err := writer.Release(ctxT(t, 10*time.Second), k, w.Token); err != nil {
			t.Fatal(err)
		}
		if res, err := other.Acquire(ctxT(t, 10*time.Second), req(k, dlock.ModeShared, 0, 10*time.Second)); err != nil || !res.Acquired {
			t.Errorf("rule: an exclusive grant clears the writer mark; a reader after it: %+v %v", res, err)
		}
	})
}

// TestWaitersReadOnlyWhenTheirTurnMayHaveCome: a release makes only the
// waiters read whose turn it may have brought: the queue of a semaphore
// (limit 2: two holders, three waiters) and of a reader-writer lock (a
// writer holding; then a reader, a writer, a reader waiting: the last
// reader waits for the writer just ahead of it, not for the first one).
// Counted: the transactions of each waiter's client after the queue
// settled. It also checks that each gets the key in its turn.
func TestWaitersReadOnlyWhenTheirTurnMayHaveCome(t *testing.T) {
	eps := endpoints(t)
	cl := newClient(t, eps...)
	const ttl = 90 * time.Second // no AcquireWait call ends by its bound during the test
	type waiter struct {
		hc     *hookClient
		got    chan *dlock.Lock
		served bool
	}
	// queue starts waiters for k with opts, one after the other, behind
	// held holders.
	queue := func(t *testing.T, k string, held int, opts ...[]dlock.AcquireOption) []*waiter {
		var ws []*waiter
		for i, o := range opts {
			b, hc := hooked(t, eps)
			w := &waiter{hc: hc, got: make(chan *dlock.Lock, 1)}
			l := locktest.NewLocker(t, b)
			go func() {
				lk, err := l.Acquire(ctxT(t, ttl), k, append(o, dlock.WithTTL(ttl))...)
				if err != nil {
					t.Errorf("waiter %d: %v", i, err)
					close(w.got)
					return
				}
				w.got <- lk
			}()
			waitFor(t, func() bool { return len(entries(t, cl, dirOf(k))) == held+i+1 })
			ws = append(ws, w)
		}
		// Settled: no waiter reads for 200 ms (the last one has made its
		// first check).
		for range 50 {
			quiet := true
			for _, w := range ws {
				quiet = w.hc.txns.Swap(0) == 0 && quiet
			}
			if quiet {
				return ws
			}
			time.Sleep(200 * time.Millisecond)
		}
		t.Fatal("the waiters kept reading")
		return nil
	}
	// step releases lk and checks that waiter next gets the key, and that
	// the others still waiting did not read.
	step := func(t *testing.T, lk *dlock.Lock, ws []*waiter, next int) *dlock.Lock {
		t.Helper()
		if err := lk.Release(context.Background()); err != nil {
			t.Fatal(err)
		}
		var got *dlock.Lock
		select {
		case got = <-ws[next].got:
			if got == nil {
				t.FailNow()
			}
			ws[next].served = true
		case <-time.After(10 * time.Second):
			t.Fatalf("waiter %d did not get the key in its turn", next)
		}
		time.Sleep(200 * time.Millisecond)
		for i, w := range ws {
			if n := w.hc.txns.Swap(0); i != next && !w.served && n != 0 {
				t.Errorf("rule: no herd; waiter %d, whose turn had not come, read %d times", i, n)
			}
			if !w.served && len(w.got) > 0 {
				t.Errorf("waiter %d got the key out of turn", i)
			}
		}
		return got
	}
	t.Run("limited", func(t *testing.T) {
		k := locktest.UniqueKey("herd")
		l := locktest.NewLocker(t, newBackend(t, eps))
		lim := []dlock.AcquireOption{dlock.WithLimit(2)}
		h1, h2 := mustLock(t, l, k, lim...), mustLock(t, l, k, lim...)
		ws := queue(t, k, 2, lim, lim, lim)
		w0 := step(t, h1, ws, 0)
		w1 := step(t, h2, ws, 1)
		w2 := step(t, w0, ws, 2)
		w1.Release(context.Background())
		w2.Release(context.Background())
	})
	t.Run("reader-writer", func(t *testing.T) {
		k := locktest.UniqueKey("herd")
		l := locktest.NewLocker(t, newBackend(t, eps))
		sh := []dlock.AcquireOption{dlock.Shared()}
		w := mustLock(t, l, k)
		ws := queue(t, k, 1, sh, nil, sh)
		r0 := step(t, w, ws, 0)
		w1 := step(t, r0, ws, 1)
		step(t, w1, ws, 2).Release(context.Background())
	})
}

func mustLock(t *testing.T, l *dlock.Locker, k string, opts ...dlock.AcquireOption) *dlock.Lock {
	t.Helper()
	lk, err := l.TryAcquire(ctxT(t, 10*time.Second), k, append(opts, dlock.WithTTL(30*time.Second))...)
	if err != nil {
		t.Fatal(err)
	}
	return lk
}

// TestParkedReaderWhoseTurnCameIsNotTakenOver: a shared entry parked
// between two AcquireWait calls whose turn comes while it is parked (here
// its watch is kept silent, so it is not removed) is not taken over by the
// next call: a reader queued behind it may have got the key meanwhile with
// a larger fence, and the next call must get a larger one still.
func TestParkedReaderWhoseTurnCameIsNotTakenOver(t *testing.T) {
	eps := endpoints(t)
	writer, reader := newBackend(t, eps), newBackend(t, eps)
	parker, hc := hooked(t, eps)
	parker.SetParkTimeout(time.Hour)
	hc.silent = true
	k := locktest.UniqueKey("parked")
	w := req(k, dlock.ModeExclusive, 0, 10*time.Second)
	mustTake(t, writer, w)
	r := req(k, dlock.ModeShared, 0, 3*time.Second)
	if res, err := parker.AcquireWait(ctxT(t, 10*time.Second), r); err != nil || res.Acquired {
		t.Fatalf("AcquireWait behind a writer: %+v %v, want a parked entry", res, err)
	}
	if err := writer.Release(ctxT(t, 10*time.Second), k, w.Token); err != nil {
		t.Fatal(err)
	}
	other := mustTake(t, reader, req(k, dlock.ModeShared, 0, 10*time.Second))
	r.Token = dlock.NewToken()
	res, err := parker.AcquireWait(ctxT(t, 10*time.Second), r)
	if err != nil || !res.Acquired {
		t.Fatalf("AcquireWait after the writer left: %+v %v", res, err)
	}
	if res.Fence <= other.Fence {
		t.Errorf("rule: fences increase in grant order; the reader after got %d, after %d", res.Fence, other.Fence)
	}
}

// TestListAndForceReleaseSeeEveryHolder: List shows every holder of a
// shared or limited key, with its mode and limit, and not the waiters;
// ForceRelease frees them all.
func TestListAndForceReleaseSeeEveryHolder(t *testing.T) {
	eps := endpoints(t)
	a, b := newBackend(t, eps), newBackend(t, eps)
	for _, c := range []struct {
		name    string
		mode    dlock.Mode
		limit   int
		holders int
		waiter  dlock.Request
	}{
		{"shared", dlock.ModeShared, 0, 3, req("", dlock.ModeExclusive, 0, 10*time.Second)},
		{"limited", dlock.ModeLimited, 2, 2, req("", dlock.ModeLimited, 2, 10*time.Second)},
	} {
		t.Run(c.name, func(t *testing.T) {
			k := locktest.UniqueKey("list")
			var fences []uint64
			for range c.holders {
				fences = append(fences, mustTake(t, a, req(k, c.mode, c.limit, 10*time.Second)).Fence)
			}
			// A waiter parks its entry: it waits, it does not hold.
			c.waiter.Key, c.waiter.TTL = k, 30*time.Millisecond
			if res, err := b.AcquireWait(ctxT(t, 10*time.Second), c.waiter); err != nil || res.Acquired {
				t.Fatalf("AcquireWait: %+v %v, want a parked entry", res, err)
			}
			got, err := a.List(ctxT(t, 10*time.Second), k)
			if err != nil {
				t.Fatal(err)
			}
			if len(got) != c.holders {
				t.Fatalf("rule: List shows every holder, not the waiters; %d locks %+v, want the %d holders", len(got), got, c.holders)
			}
			for i, h := range got {
				if h.Key != k || h.Mode != c.mode || h.Limit != c.limit || h.Fence != fences[i] {
					t.Errorf("List[%d] = key %q mode %s limit %d fence %d, want %q %s %d %d", i, h.Key, h.Mode, h.Limit, h.Fence, k, c.mode, c.limit, fences[i])
				}
			}
			if err := a.ForceRelease(ctxT(t, 10*time.Second), k); err != nil {
				t.Fatal(err)
			}
			// The parked waiter's turn has come: it may show until it goes.
			got, err = a.List(ctxT(t, 10*time.Second), k)
			if err != nil {
				t.Fatal(err)
			}
			for _, h := range got {
				if slices.Contains(fences, h.Fence) {
					t.Errorf("rule: ForceRelease frees every holder; holder %d is still there", h.Fence)
				}
			}
		})
	}
}

// TestHolderBehindTheHeadRenewsAndReleases: a shared holder whose entry is
// not the first of the queue renews its lease (over several TTLs) and
// releases it.
func TestHolderBehindTheHeadRenewsAndReleases(t *testing.T) {
	eps := endpoints(t)
	cl := newClient(t, eps...)
	k := locktest.UniqueKey("behind")
	first := locktest.NewLocker(t, newBackend(t, eps))
	second := locktest.NewLocker(t, newBackend(t, eps))
	a, err := first.TryAcquire(ctxT(t, 10*time.Second), k, dlock.Shared(), dlock.WithTTL(time.Second))
	if err != nil {
		t.Fatal(err)
	}
	defer a.Release(context.Background())
	b, err := second.TryAcquire(ctxT(t, 10*time.Second), k, dlock.Shared(), dlock.WithTTL(time.Second))
	if err != nil {
		t.Fatal(err)
	}
	time.Sleep(3 * time.Second)
	if err := b.Err(); err != nil {
		t.Fatalf("rule: a holder behind the head is renewed; %v", err)
	}
	if err := b.Release(context.Background()); err != nil {
		t.Fatalf("release of a holder behind the head: %v", err)
	}
	if got := entries(t, cl, dirOf(k)); len(got) != 1 {
		t.Errorf("after the release the directory holds %v, want the first holder only", got)
	}
}

// TestMarkKey: the writer mark's name is told apart from entries, and from
// other keys' marks.
func TestMarkKey(t *testing.T) {
	for name, want := range map[string]string{
		"dlock/a%writer":           "a",
		"dlock/a%2Fb%writer":       "a/b",
		"dlock/a%25w%writer":       "a%w",
		"dlock/a/0000000000000001": "",
		"dlock/%writer":            "",
		"other/a%writer":           "",
	} {
		k, ok := etcdlock.MarkKey(etcdlock.DefaultPrefix, name)
		if ok != (want != "") || k != want {
			t.Errorf("MarkKey(%q) = %q, %v; want %q", name, k, ok, want)
		}
		if _, ok := etcdlock.EntryKey(etcdlock.DefaultPrefix, name); ok && want != "" {
			t.Errorf("EntryKey takes the mark %q for an entry", name)
		}
	}
}

// TestHolding: which entries of a queue hold the lock, in each mode.
func TestHolding(t *testing.T) {
	const (
		x  = `{"token":"01"}`
		s  = `{"token":"02","mode":"shared"}`
		l2 = `{"token":"03","mode":"limited","limit":2}`
		l3 = `{"token":"04","mode":"limited","limit":3}`
	)
	for _, c := range []struct {
		queue []string
		want  []bool
	}{
		{[]string{x, x}, []bool{true, false}},
		{[]string{s, s, x, s}, []bool{true, true, false, false}},
		{[]string{x, s, s}, []bool{true, false, false}},
		{[]string{l2, l2, l2}, []bool{true, true, false}},
		{[]string{l2, l3, l2}, []bool{true, false, false}}, // behind another limit
		{[]string{s, l2}, []bool{true, false}},
		{[]string{`{"token":"05","mode":"later"}`, s}, []bool{true, false}}, // an unknown mode excludes
	} {
		var vs [][]byte
		for _, v := range c.queue {
			vs = append(vs, []byte(v))
		}
		if got := etcdlock.Holding(vs); !slices.Equal(got, c.want) {
			t.Errorf("Holding(%v) = %v, want %v", c.queue, got, c.want)
		}
	}
}
