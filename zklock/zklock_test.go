package zklock_test

import (
	"context"
	"errors"
	"fmt"
	"os"
	"slices"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/dlock-dev/dlock"
	"github.com/dlock-dev/dlock/locktest"
	"github.com/dlock-dev/dlock/zklock"
	"github.com/go-zookeeper/zk"
	"go.uber.org/goleak"
)

func TestMain(m *testing.M) {
	code := m.Run()
	stopShared() // before the leak check: its process has a waiting goroutine
	if code == 0 {
		if err := goleak.Find(); err != nil {
			fmt.Fprintf(os.Stderr, "goleak: %v\n", err)
			code = 1
		}
	}
	os.Exit(code)
}

func newBackend(t testing.TB, c zklock.Conn) *zklock.Backend {
	t.Helper()
	b, err := zklock.New(c, &zklock.Options{SessionTimeout: sessionTimeout})
	if err != nil {
		t.Fatal(err)
	}
	return b
}

func TestConformance(t *testing.T) {
	addrs := sharedAddrs(t)
	locktest.Run(t, func(t *testing.T) dlock.Backend { return newBackend(t, newConn(t, addrs...)) },
		locktest.Stallable(addrs[0], func(t *testing.T, addr string) dlock.Backend { return newBackend(t, newConn(t, addr)) }))
}

func TestNewValidatesOptions(t *testing.T) {
	var c *zk.Conn // never dialled: New does no I/O
	if _, err := zklock.New(nil, &zklock.Options{SessionTimeout: time.Second}); !errors.Is(err, dlock.ErrInvalidOption) {
		t.Errorf("nil Conn: %v", err)
	}
	if _, err := zklock.New(c, nil); !errors.Is(err, dlock.ErrInvalidOption) {
		t.Errorf("no SessionTimeout: %v", err)
	}
	for _, root := range []string{"dlock", "/", "/a/", "/a//b", "/a/./b", "/a/..", "/zookeeper", "/zookeeper/x", "/a\x00b", "/a\x01"} {
		if _, err := zklock.New(c, &zklock.Options{SessionTimeout: time.Second, Root: root}); !errors.Is(err, dlock.ErrInvalidOption) {
			t.Errorf("root %q: %v, want ErrInvalidOption", root, err)
		}
	}
	for _, root := range []string{"/dlock", "/apps/locks", "/ключи", "/a.b/c-d"} {
		if _, err := zklock.New(c, &zklock.Options{SessionTimeout: time.Second, Root: root}); err != nil {
			t.Errorf("root %q: %v", root, err)
		}
	}
}

// TestTTLAboveSessionTimeoutIsRefused: a lease the session cannot cover is
// an error, before any I/O.
func TestTTLAboveSessionTimeoutIsRefused(t *testing.T) {
	var c *zk.Conn
	b, err := zklock.New(c, &zklock.Options{SessionTimeout: 10 * time.Second})
	if err != nil {
		t.Fatal(err)
	}
	req := dlock.Request{Key: "k", Token: dlock.NewToken(), TTL: 11 * time.Second}
	if _, err := b.Acquire(context.Background(), req); !errors.Is(err, dlock.ErrInvalidOption) {
		t.Errorf("Acquire: %v, want ErrInvalidOption", err)
	}
	if _, err := b.AcquireWait(context.Background(), req); !errors.Is(err, dlock.ErrInvalidOption) {
		t.Errorf("AcquireWait: %v, want ErrInvalidOption", err)
	}
}

func TestKeyEscaping(t *testing.T) {
	keys := []string{"a", "A", "a/b", "..", ".", "%", "%25", "a b", "ключ/キー/🔒", "x'; DROP", "tab\tnl\n", "\xff\xfe", strings.Repeat("z", 255)}
	seen := map[string]string{}
	for _, k := range keys {
		e := zklock.Escape(k)
		if strings.ContainsAny(e, "/\x00") || e == "." || e == ".." || !strings.HasPrefix(e, "k") {
			t.Errorf("Escape(%q) = %q is not one znode name", k, e)
		}
		for _, r := range e[1:] {
			if r > 0x7e || r < 0x21 {
				t.Errorf("Escape(%q) = %q contains %q", k, e, r)
			}
		}
		if other, ok := seen[e]; ok {
			t.Errorf("%q and %q both escape to %q", k, other, e)
		}
		seen[e] = k
		if got, ok := zklock.Unescape(e); !ok || got != k {
			t.Errorf("Unescape(Escape(%q)) = %q, %v", k, got, ok)
		}
		for i := range len(k) {
			if !strings.HasPrefix(e, zklock.Escape(k[:i+1])) {
				t.Errorf("the escape of prefix %q of %q is not a prefix of %q", k[:i+1], k, e)
			}
		}
	}
	for _, bad := range []string{"", "k", "x", "k%", "k%2", "k%zz", "k%2f", "ka b", "k/"} {
		if k, ok := zklock.Unescape(bad); ok {
			t.Errorf("Unescape(%q) = %q, want not a key name", bad, k)
		}
	}
}

// queueNodes returns the names of key's queue nodes: the children of its
// directory but the journal.
func queueNodes(c *zk.Conn, b *zklock.Backend, key string) ([]string, error) {
	names, _, err := c.Children(b.Dir(key))
	return withoutJournal(names), err
}

func withoutJournal(names []string) []string {
	return slices.DeleteFunc(names, func(nm string) bool { return nm == zklock.JournalNode })
}

// queueLen returns the number of nodes in key's queue.
func queueLen(t *testing.T, c *zk.Conn, b *zklock.Backend, key string) int {
	t.Helper()
	names, err := queueNodes(c, b, key)
	if errors.Is(err, zk.ErrNoNode) {
		return 0
	}
	if err != nil {
		t.Fatal(err)
	}
	return len(names)
}

// waitQueueLen waits, with a children watch, until key's queue has n nodes.
func waitQueueLen(t *testing.T, c *zk.Conn, b *zklock.Backend, key string, n int, within time.Duration) {
	t.Helper()
	deadline := time.After(within)
	for {
		names, _, ch, err := c.ChildrenW(b.Dir(key))
		if err != nil {
			t.Fatal(err)
		}
		names = withoutJournal(names)
		if len(names) == n {
			// A failed attempt without waiting makes a node and deletes
			// it: the count must hold still before it says who is queued.
			select {
			case <-ch:
				continue
			case <-time.After(300 * time.Millisecond):
				return
			}
		}
		select {
		case <-ch:
		case <-deadline:
			t.Fatalf("queue of %q has %d nodes after %s, want %d", key, len(names), within, n)
		}
	}
}

// TestQueueIsFIFOWithoutHerd queues three waiters (separate sessions) behind
// a holder and checks that each node is watched by one session at most (its
// successor's) and that the waiters get the lock in arrival order.
func TestQueueIsFIFOWithoutHerd(t *testing.T) {
	addrs := sharedAddrs(t)
	admin := newConn(t, addrs...)
	b := newBackend(t, newConn(t, addrs...))
	holder := locktest.NewLocker(t, b)
	k := locktest.UniqueKey("fifo")
	lk, err := holder.TryAcquire(ctxT(t, 5*time.Second), k, dlock.WithTTL(10*time.Second))
	if err != nil {
		t.Fatal(err)
	}
	var mu sync.Mutex
	var order []int
	var wg sync.WaitGroup
	for i := range 3 {
		w := locktest.NewLocker(t, newBackend(t, newConn(t, addrs...)))
		wg.Go(func() {
			wl, err := w.Acquire(ctxT(t, 30*time.Second), k, dlock.WithTTL(10*time.Second))
			if err != nil {
				t.Error(err)
				return
			}
			mu.Lock()
			order = append(order, i)
			mu.Unlock()
			wl.Release(context.Background())
		})
		waitQueueLen(t, admin, b, k, i+2, 10*time.Second)
	}
	time.Sleep(200 * time.Millisecond) // let the last waiter set its watch
	ws := watchers(addrs[0], b.Dir(k))
	if len(ws) == 0 {
		t.Error("no watches on the queue (wchp shows none)")
	}
	for p, n := range ws {
		if n > 1 || p == b.Dir(k) {
			t.Errorf("rule: each waiter watches only its predecessor; %s has %d watching sessions", p, n)
		}
	}
	if err := lk.Release(context.Background()); err != nil {
		t.Fatal(err)
	}
	wg.Wait()
	if fmt.Sprint(order) != "[0 1 2]" {
		t.Errorf("rule: waiters are served in arrival order; got %v", order)
	}
}

// TestTryAcquireDoesNotQueue checks that failed TryAcquires leave no node,
// and that a cancelled wait removes its node.
func TestTryAcquireDoesNotQueue(t *testing.T) {
	addrs := sharedAddrs(t)
	admin := newConn(t, addrs...)
	b := newBackend(t, newConn(t, addrs...))
	holder := locktest.NewLocker(t, b)
	other := locktest.NewLocker(t, newBackend(t, newConn(t, addrs...)))
	k := locktest.UniqueKey("try")
	lk, err := holder.TryAcquire(ctxT(t, 5*time.Second), k, dlock.WithTTL(10*time.Second))
	if err != nil {
		t.Fatal(err)
	}
	defer lk.Release(context.Background())
	for range 5 {
		if _, err := other.TryAcquire(ctxT(t, 5*time.Second), k); !errors.Is(err, dlock.ErrNotAcquired) {
			t.Fatalf("TryAcquire of a held key: %v", err)
		}
	}
	if n := queueLen(t, admin, b, k); n != 1 {
		t.Errorf("rule: TryAcquire never leaves a node; the queue has %d nodes", n)
	}
	ctx, cancel := context.WithCancel(context.Background())
	done := make(chan error, 1)
	go func() {
		_, err := other.Acquire(ctx, k, dlock.WithTTL(10*time.Second))
		done <- err
	}()
	waitQueueLen(t, admin, b, k, 2, 10*time.Second)
	cancel()
	if err := <-done; !errors.Is(err, dlock.ErrNotAcquired) || !errors.Is(err, context.Canceled) {
		t.Errorf("cancelled Acquire: %v", err)
	}
	waitQueueLen(t, admin, b, k, 1, 5*time.Second)
}

// TestParkedNodeIsDeleted: a waiting node that no AcquireWait takes up
// again is removed within its TTL.
func TestParkedNodeIsDeleted(t *testing.T) {
	addrs := sharedAddrs(t)
	admin := newConn(t, addrs...)
	b := newBackend(t, newConn(t, addrs...))
	holder := locktest.NewLocker(t, b)
	k := locktest.UniqueKey("park")
	lk, err := holder.TryAcquire(ctxT(t, 5*time.Second), k, dlock.WithTTL(10*time.Second))
	if err != nil {
		t.Fatal(err)
	}
	defer lk.Release(context.Background())
	w := newBackend(t, newConn(t, addrs...))
	res, err := w.AcquireWait(ctxT(t, 10*time.Second), dlock.Request{Key: k, Token: dlock.NewToken(), TTL: time.Second})
	if err != nil || res.Acquired {
		t.Fatalf("AcquireWait: %+v %v", res, err)
	}
	if res.Holder.Fence != lk.Fence() {
		t.Errorf("AcquireWait's holder has fence %d, want %d", res.Holder.Fence, lk.Fence())
	}
	if n := queueLen(t, admin, b, k); n != 2 {
		t.Errorf("the waiting node is not kept for the next call: queue has %d nodes", n)
	}
	waitQueueLen(t, admin, b, k, 1, 5*time.Second)
}

// TestHolderInfo checks what a refused acquisition reports of the holder.
func TestHolderInfo(t *testing.T) {
	addrs := sharedAddrs(t)
	b := newBackend(t, newConn(t, addrs...))
	ctx := ctxT(t, 10*time.Second)
	k := locktest.UniqueKey("holder")
	tok := dlock.NewToken()
	r, err := b.Acquire(ctx, dlock.Request{Key: k, Token: tok, Owner: "alice", TTL: 10 * time.Second, Metadata: "job=7"})
	if err != nil || !r.Acquired {
		t.Fatalf("Acquire: %+v %v", r, err)
	}
	r2, err := newBackend(t, newConn(t, addrs...)).Acquire(ctx, dlock.Request{Key: k, Token: dlock.NewToken(), TTL: time.Second})
	if err != nil || r2.Acquired {
		t.Fatalf("second Acquire: %+v %v", r2, err)
	}
	h := r2.Holder
	if h.Key != k || h.Owner != "alice" || h.Token != tok || h.Fence != r.Fence || h.Metadata != "job=7" {
		t.Errorf("holder %+v, want key %q owner alice token %s fence %d metadata job=7", h, k, tok, r.Fence)
	}
	if r2.Remaining <= 5*time.Second || r2.Remaining > 10*time.Second {
		t.Errorf("Remaining %s, want about 10s", r2.Remaining)
	}
	if err := b.Release(ctx, k, tok); err != nil {
		t.Fatal(err)
	}
}

// TestParkedHeadIsNotRevived: a parked node that reaches the head and is
// taken up only after its lease ran out (a Locker that calls late: a pause,
// a slow network) had held the key by the store's rules until then; the
// next AcquireWait must not hold it again under the same fence.
func TestParkedHeadIsNotRevived(t *testing.T) {
	addrs := sharedAddrs(t)
	b := newBackend(t, newConn(t, addrs...))
	k := locktest.UniqueKey("revive")
	ctx := ctxT(t, 20*time.Second)
	hold := dlock.Request{Key: k, Token: dlock.NewToken(), TTL: 10 * time.Second}
	if r, err := b.Acquire(ctx, hold); err != nil || !r.Acquired {
		t.Fatalf("Acquire: %+v %v", r, err)
	}
	w := newBackend(t, newConn(t, addrs...))
	ttl := time.Second
	res, err := w.AcquireWait(ctx, dlock.Request{Key: k, Token: dlock.NewToken(), TTL: ttl})
	if err != nil || res.Acquired {
		t.Fatalf("AcquireWait: %+v %v", res, err)
	}
	w.StallParked(k)
	// The parked node's fence: its czxid.
	admin := newConn(t, addrs...)
	names, err := queueNodes(admin, b, k)
	if err != nil || len(names) != 2 {
		t.Fatalf("queue: %v %v", names, err)
	}
	slices.Sort(names)
	_, st, err := admin.Get(b.Dir(k) + "/" + names[1])
	if err != nil {
		t.Fatal(err)
	}
	parked := uint64(st.Czxid)
	if err := b.Release(ctx, k, hold.Token); err != nil { // the parked node is the head now
		t.Fatal(err)
	}
	time.Sleep(ttl + 200*time.Millisecond) // its lease runs out, nobody takes it
	for {
		res, err = w.AcquireWait(ctx, dlock.Request{Key: k, Token: dlock.NewToken(), TTL: ttl})
		if err != nil || res.Acquired {
			break
		}
	}
	if err != nil {
		t.Fatal(err)
	}
	if res.Fence == parked {
		t.Errorf("rule: a node whose lease ran out is never granted again; granted with its fence %d", parked)
	}
}

// TestParkedNodeWhoseTurnCameIsDeleted: a waiting node parked between two
// AcquireWait calls whose turn comes before a call takes it up (its waiter
// gave up between two calls) is deleted at once, in every mode, so that
// the next waiter gets the key (or the slot) while the parked node's lease
// still runs, not when it runs out.
func TestParkedNodeWhoseTurnCameIsDeleted(t *testing.T) {
	addrs := sharedAddrs(t)
	admin := newConn(t, addrs...)
	for _, c := range []struct {
		name                   string
		holder, parked, waiter dlock.Mode
		limit                  int
	}{
		{"exclusive", dlock.ModeExclusive, dlock.ModeExclusive, dlock.ModeExclusive, 0},
		{"shared", dlock.ModeExclusive, dlock.ModeShared, dlock.ModeExclusive, 0},
		{"limited", dlock.ModeLimited, dlock.ModeLimited, dlock.ModeLimited, 1},
	} {
		t.Run(c.name, func(t *testing.T) {
			limit := func(m dlock.Mode) int {
				if m == dlock.ModeLimited {
					return c.limit
				}
				return 0
			}
			holder, parker, waiter := newBackend(t, newConn(t, addrs...)), newBackend(t, newConn(t, addrs...)), newBackend(t, newConn(t, addrs...))
			parker.SetParkTimeout(time.Hour) // only its turn may delete the node
			k := locktest.UniqueKey("parkturn")
			ctx := ctxT(t, 30*time.Second)
			hold := dlock.Request{Key: k, Token: dlock.NewToken(), TTL: 10 * time.Second, Mode: c.holder, Limit: limit(c.holder)}
			if r, err := holder.Acquire(ctx, hold); err != nil || !r.Acquired {
				t.Fatalf("Acquire: %+v %v", r, err)
			}
			// A third of the TTL: the call parks its node and returns.
			pr := dlock.Request{Key: k, Token: dlock.NewToken(), TTL: 6 * time.Second, Mode: c.parked, Limit: limit(c.parked)}
			if res, err := parker.AcquireWait(ctx, pr); err != nil || res.Acquired {
				t.Fatalf("AcquireWait: %+v %v, want a parked node", res, err)
			}
			names, err := queueNodes(admin, parker, k)
			if err != nil || len(names) != 2 {
				t.Fatalf("queue: %v %v, want the holder and the parked node", names, err)
			}
			slices.SortFunc(names, func(a, b string) int { return strings.Compare(a[len(a)-10:], b[len(b)-10:]) })
			_, st, err := admin.Get(parker.Dir(k) + "/" + names[1])
			if err != nil {
				t.Fatal(err)
			}
			parkedEnd := st.Mtime + pr.TTL.Milliseconds() // its lease, on the leader's clock
			got := make(chan dlock.Request, 1)
			go func() {
				defer close(got)
				for ctx.Err() == nil {
					w := dlock.Request{Key: k, Token: dlock.NewToken(), TTL: 6 * time.Second, Mode: c.waiter, Limit: limit(c.waiter)}
					res, err := waiter.AcquireWait(ctx, w)
					if err != nil {
						t.Error(err)
						return
					}
					if res.Acquired {
						got <- w
						return
					}
				}
			}()
			waitQueueLen(t, admin, parker, k, 3, 10*time.Second)
			if err := holder.Release(ctx, k, hold.Token); err != nil {
				t.Fatal(err)
			}
			w, ok := <-got
			if !ok {
				t.Fatalf("rule: a parked node whose turn came does not hold the key; the next waiter never got it")
			}
			defer waiter.Release(context.Background(), k, w.Token)
			names, err = queueNodes(admin, parker, k)
			if err != nil || len(names) != 1 {
				t.Fatalf("queue: %v %v, want the waiter's node alone", names, err)
			}
			// The waiter's grant renewed its node: the leader's time of it.
			_, st, err = admin.Get(parker.Dir(k) + "/" + names[0])
			if err != nil {
				t.Fatal(err)
			}
			if st.Mtime >= parkedEnd {
				t.Errorf("rule: a parked node whose turn came is deleted at once; the next waiter got the key %d ms after the parked node's lease ended", st.Mtime-parkedEnd)
			}
		})
	}
}

// TestParkedReaderWhoseTurnCameIsNotTakenUp: a shared node parked between
// two AcquireWait calls whose turn comes while it is parked (here its
// watch is stopped, as in a stalled process) is not taken up by the next
// call: a reader queued behind it got the key meanwhile with a larger
// fence, and the next call must get a larger one still.
func TestParkedReaderWhoseTurnCameIsNotTakenUp(t *testing.T) {
	addrs := sharedAddrs(t)
	writer, reader, parker := newBackend(t, newConn(t, addrs...)), newBackend(t, newConn(t, addrs...)), newBackend(t, newConn(t, addrs...))
	k := locktest.UniqueKey("parkedreader")
	ctx := ctxT(t, 20*time.Second)
	w := dlock.Request{Key: k, Token: dlock.NewToken(), TTL: 10 * time.Second}
	if r, err := writer.Acquire(ctx, w); err != nil || !r.Acquired {
		t.Fatalf("Acquire: %+v %v", r, err)
	}
	r := dlock.Request{Key: k, Token: dlock.NewToken(), TTL: 6 * time.Second, Mode: dlock.ModeShared}
	if res, err := parker.AcquireWait(ctx, r); err != nil || res.Acquired {
		t.Fatalf("AcquireWait behind a writer: %+v %v, want a parked node", res, err)
	}
	parker.StallParked(k)
	if err := writer.Release(ctx, k, w.Token); err != nil {
		t.Fatal(err)
	}
	o := dlock.Request{Key: k, Token: dlock.NewToken(), TTL: 10 * time.Second, Mode: dlock.ModeShared}
	other, err := reader.Acquire(ctx, o)
	if err != nil || !other.Acquired {
		t.Fatalf("reader's Acquire after the writer left: %+v %v", other, err)
	}
	defer reader.Release(context.Background(), k, o.Token)
	r.Token = dlock.NewToken()
	res, err := parker.AcquireWait(ctx, r)
	if err != nil || !res.Acquired {
		t.Fatalf("AcquireWait after the writer left: %+v %v", res, err)
	}
	defer parker.Release(context.Background(), k, r.Token)
	if res.Fence <= other.Fence {
		t.Errorf("rule: fences increase in grant order; the reader after got %d, after %d", res.Fence, other.Fence)
	}
}

// TestStalledWaiterDoesNotHoldUpTheQueue: a waiter whose process stalls
// (paused, partitioned) with its node next in line keeps its session, and
// its node outlives the holder's lease; the waiter behind it must not wait
// for that session to end. Once the stalled node's lease has run out too,
// the next waiter deletes it and takes the key.
func TestStalledWaiterDoesNotHoldUpTheQueue(t *testing.T) {
	addrs := sharedAddrs(t)
	holder, stalled, waiter := newBackend(t, newConn(t, addrs...)), newBackend(t, newConn(t, addrs...)), newBackend(t, newConn(t, addrs...))
	k := locktest.UniqueKey("stalled")
	ctx := ctxT(t, 20*time.Second)
	ttl := time.Second
	// A holder that stops renewing.
	if r, err := holder.Acquire(ctx, dlock.Request{Key: k, Token: dlock.NewToken(), TTL: ttl}); err != nil || !r.Acquired {
		t.Fatalf("Acquire: %+v %v", r, err)
	}
	// A waiter that queues and is never heard of again (its Backend's timers
	// stopped, as in a paused process).
	if res, err := stalled.AcquireWait(ctx, dlock.Request{Key: k, Token: dlock.NewToken(), TTL: ttl}); err != nil || res.Acquired {
		t.Fatalf("AcquireWait: %+v %v", res, err)
	}
	stalled.StallParked(k)
	wctx, cancel := context.WithTimeout(ctx, 10*time.Second)
	defer cancel()
	for {
		res, err := waiter.AcquireWait(wctx, dlock.Request{Key: k, Token: dlock.NewToken(), TTL: ttl})
		if err != nil {
			t.Fatal(err)
		}
		if res.Acquired {
			return
		}
		if wctx.Err() != nil {
			t.Fatal("rule: a waiter whose node's lease ran out does not hold up the queue; the next waiter never got the key")
		}
	}
}
