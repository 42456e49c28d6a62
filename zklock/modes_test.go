package zklock_test

import (
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/dlock-dev/dlock"
	"github.com/dlock-dev/dlock/locktest"
	"github.com/go-zookeeper/zk"
)

// TestRequestIsCheckedBeforeIO: modes and limits out of range are refused
// before any I/O (the Conn is never dialled).
func TestRequestIsCheckedBeforeIO(t *testing.T) {
	var c *zk.Conn
	b := newBackend(t, c)
	for _, m := range []dlock.Mode{dlock.ModeExclusive, dlock.ModeShared, dlock.ModeLimited} {
		if !b.SupportsMode(m) {
			t.Errorf("SupportsMode(%s) = false", m)
		}
	}
	if b.SupportsMode(dlock.Mode(9)) {
		t.Error("SupportsMode of an unknown mode = true")
	}
	for _, r := range []struct {
		m     dlock.Mode
		limit int
	}{
		{dlock.ModeLimited, 0}, {dlock.ModeLimited, dlock.MaxLimit + 1}, {dlock.ModeExclusive, 2}, {dlock.ModeShared, 1}, {dlock.Mode(9), 0},
	} {
		req := dlock.Request{Key: "k", Token: dlock.NewToken(), TTL: time.Second, Mode: r.m, Limit: r.limit}
		if _, err := b.Acquire(context.Background(), req); !errors.Is(err, dlock.ErrInvalidOption) {
			t.Errorf("Acquire %s limit %d: %v, want ErrInvalidOption", r.m, r.limit, err)
		}
		if _, err := b.AcquireWait(context.Background(), req); !errors.Is(err, dlock.ErrInvalidOption) {
			t.Errorf("AcquireWait %s limit %d: %v, want ErrInvalidOption", r.m, r.limit, err)
		}
	}
}

// TestWriterMarkEndsWithItsLease: an exclusive TryAcquire that finds
// readers leaves a writer mark that refuses new readers; if its process
// stalls (the mark is never taken up nor deleted by it), the mark holds
// readers back for at most dlock.WriterMark.
func TestWriterMarkEndsWithItsLease(t *testing.T) {
	addrs := sharedAddrs(t)
	ctx := ctxT(t, 30*time.Second)
	k := locktest.UniqueKey("mark")
	reader := locktest.NewLocker(t, newBackend(t, newConn(t, addrs...)))
	wb := newBackend(t, newConn(t, addrs...))
	writer := locktest.NewLocker(t, wb)
	late := locktest.NewLocker(t, newBackend(t, newConn(t, addrs...)))
	r, err := reader.TryAcquire(ctx, k, dlock.Shared(), dlock.WithTTL(10*time.Second))
	if err != nil {
		t.Fatal(err)
	}
	defer r.Release(context.Background())
	if _, err := writer.TryAcquire(ctx, k); !errors.Is(err, dlock.ErrNotAcquired) {
		t.Fatalf("writer's TryAcquire with a reader holding: %v", err)
	}
	marked := time.Now()
	wb.StallParked(k) // as in a stalled process
	if lk, err := late.TryAcquire(ctx, k, dlock.Shared()); err == nil {
		lk.Release(context.Background())
		t.Fatal("rule: an exclusive attempt that finds readers keeps new readers out; a reader got in")
	} else if !errors.Is(err, dlock.ErrNotAcquired) {
		t.Fatalf("TryAcquire shared: %v", err)
	}
	for {
		lk, err := late.TryAcquire(ctx, k, dlock.Shared())
		if err == nil {
			lk.Release(context.Background())
			break
		}
		if !errors.Is(err, dlock.ErrNotAcquired) {
			t.Fatal(err)
		}
		if time.Since(marked) > dlock.WriterMark+2*time.Second {
			t.Fatalf("rule: a writer that gives up holds readers back for at most %s; still refused: %v", dlock.WriterMark, err)
		}
		time.Sleep(100 * time.Millisecond)
	}
	t.Logf("readers held back for %s", time.Since(marked))
	if d := time.Since(marked); d < dlock.WriterMark-500*time.Millisecond {
		t.Errorf("the mark held readers back for %s only", d)
	}
}

// nodeData is the data of a queue node as another client writes it.
func nodeData(t *testing.T, ttl time.Duration) []byte {
	t.Helper()
	v, err := json.Marshal(map[string]any{"token": dlock.NewToken().String(), "acquired_us": time.Now().UnixMicro(), "ttl_ms": ttl.Milliseconds()})
	if err != nil {
		t.Fatal(err)
	}
	return v
}

// TestNodeOfAnotherClassAheadIsWaitedFor: a request of another limit whose
// node is in the queue but has not withdrawn yet (it will find the
// mismatch, or hold the key if the holders ahead of it leave first) keeps
// later requests from holding the key alongside it: once the holders
// leave, it heads the queue, and a request of the first limit is then a
// mismatch, not a second semaphore.
func TestNodeOfAnotherClassAheadIsWaitedFor(t *testing.T) {
	addrs := sharedAddrs(t)
	admin := newConn(t, addrs...)
	b := newBackend(t, newConn(t, addrs...))
	ctx := ctxT(t, 20*time.Second)
	k := locktest.UniqueKey("class")
	req := func(limit int) dlock.Request {
		return dlock.Request{Key: k, Token: dlock.NewToken(), TTL: 10 * time.Second, Mode: dlock.ModeLimited, Limit: limit}
	}
	a := req(3)
	if r, err := b.Acquire(ctx, a); err != nil || !r.Acquired {
		t.Fatalf("Acquire: %+v %v", r, err)
	}
	other, err := admin.Create(b.Dir(k)+"/l2-", nodeData(t, 10*time.Second), zk.FlagEphemeralSequential, zk.WorldACL(zk.PermAll))
	if err != nil {
		t.Fatal(err)
	}
	c := req(3)
	r, err := b.Acquire(ctx, c)
	if err != nil {
		t.Fatal(err)
	}
	if r.Acquired {
		t.Fatal("rule: a node never holds the key while a live node of another class is ahead of it; granted")
	}
	if n := queueLen(t, admin, b, k); n != 2 {
		t.Errorf("the refused request left its node: %d nodes", n)
	}
	if err := b.Release(ctx, k, a.Token); err != nil {
		t.Fatal(err)
	}
	// The other limit's node heads the queue: the key is held limited to 2.
	if _, err := b.Acquire(ctx, req(3)); !errors.Is(err, dlock.ErrModeMismatch) {
		t.Errorf("rule: a request whose first live node ahead is of another class is a mismatch; %v", err)
	}
	for _, m := range []dlock.Mode{dlock.ModeExclusive, dlock.ModeShared} {
		if _, err := b.Acquire(ctx, dlock.Request{Key: k, Token: dlock.NewToken(), TTL: time.Second, Mode: m}); !errors.Is(err, dlock.ErrModeMismatch) {
			t.Errorf("rule: a %s request for a key held limited is a mismatch; %v", m, err)
		}
	}
	if _, err := b.AcquireWait(ctx, req(3)); !errors.Is(err, dlock.ErrModeMismatch) {
		t.Errorf("rule: a waiting request whose first live node ahead is of another class is a mismatch; %v", err)
	}
	if n := queueLen(t, admin, b, k); n != 1 {
		t.Errorf("rule: a mismatch changes nothing; %d nodes", n)
	}
	if err := admin.Delete(other, -1); err != nil {
		t.Fatal(err)
	}
	if r, err := b.Acquire(ctx, c); err != nil || !r.Acquired {
		t.Fatalf("Acquire once the other node is gone: %+v %v", r, err)
	}
}

// TestListAndForceReleaseSeeEveryHolder: List reports every holder of a
// key with its mode and limit, and ForceRelease frees them all.
func TestListAndForceReleaseSeeEveryHolder(t *testing.T) {
	addrs := sharedAddrs(t)
	b := newBackend(t, newConn(t, addrs...))
	l := locktest.NewLocker(t, b)
	other := locktest.NewLocker(t, newBackend(t, newConn(t, addrs...)))
	ctx := ctxT(t, 20*time.Second)
	base := locktest.UniqueKey("list")
	rw, sem := base+"/rw", base+"/sem"
	var locks []*dlock.Lock
	for _, c := range []struct {
		k   string
		opt dlock.AcquireOption
	}{{rw, dlock.Shared()}, {rw, dlock.Shared()}, {sem, dlock.WithLimit(3)}, {sem, dlock.WithLimit(3)}} {
		lk, err := l.TryAcquire(ctx, c.k, c.opt, dlock.WithTTL(10*time.Second))
		if err != nil {
			t.Fatal(err)
		}
		defer lk.Release(context.Background())
		locks = append(locks, lk)
	}
	infos, err := b.List(ctx, base)
	if err != nil {
		t.Fatal(err)
	}
	if len(infos) != len(locks) {
		t.Fatalf("rule: List shows every holder; %d holders: %+v", len(infos), infos)
	}
	for i, h := range infos {
		lk := locks[i]
		if h.Key != lk.Key() || h.Fence != lk.Fence() || h.Mode != lk.Mode() || h.Mode == dlock.ModeLimited && h.Limit != 3 {
			t.Errorf("holder %d: %s %s limit %d fence %d, want %s %s fence %d", i, h.Key, h.Mode, h.Limit, h.Fence, lk.Key(), lk.Mode(), lk.Fence())
		}
	}
	if err := b.ForceRelease(ctx, rw); err != nil {
		t.Fatal(err)
	}
	w, err := other.TryAcquire(ctx, rw)
	if err != nil {
		t.Fatalf("rule: ForceRelease frees every holder; a writer then: %v", err)
	}
	w.Release(context.Background())
	if err := b.ForceRelease(ctx, rw); !errors.Is(err, dlock.ErrNotHeld) {
		t.Errorf("ForceRelease of a free key: %v", err)
	}
}

// watchers returns, for each watched path under dir, the number of sessions
// watching it (wchp lists each watched path, then the sessions watching it,
// indented).
func watchers(addr, dir string) map[string]int {
	out := map[string]int{}
	var path string
	for _, line := range strings.Split(fourLetter(addr, "wchp"), "\n") {
		if strings.HasPrefix(line, "/") {
			path = line
		} else if strings.TrimSpace(line) != "" && strings.HasPrefix(path, dir) {
			out[path]++
		}
	}
	return out
}

// TestLimitedWaitersWithoutHerd queues three waiters (separate sessions)
// for a semaphore of 2 that two holders fill: the first waiter watches the
// holders, each later one only its predecessor, and the slots go to the
// waiters in arrival order.
func TestLimitedWaitersWithoutHerd(t *testing.T) {
	addrs := sharedAddrs(t)
	admin := newConn(t, addrs...)
	b := newBackend(t, newConn(t, addrs...))
	k := locktest.UniqueKey("semherd")
	opts := []dlock.AcquireOption{dlock.WithLimit(2), dlock.WithTTL(10 * time.Second)}
	var holders []*dlock.Lock
	for range 2 {
		lk, err := locktest.NewLocker(t, newBackend(t, newConn(t, addrs...))).TryAcquire(ctxT(t, 5*time.Second), k, opts...)
		if err != nil {
			t.Fatal(err)
		}
		holders = append(holders, lk)
	}
	var mu sync.Mutex
	var order []int
	var wg sync.WaitGroup
	release := make(chan struct{})
	for i := range 3 {
		w := locktest.NewLocker(t, newBackend(t, newConn(t, addrs...)))
		wg.Go(func() {
			wl, err := w.Acquire(ctxT(t, 30*time.Second), k, opts...)
			if err != nil {
				t.Error(err)
				return
			}
			mu.Lock()
			order = append(order, i)
			mu.Unlock()
			<-release
			wl.Release(context.Background())
		})
		waitQueueLen(t, admin, b, k, i+3, 10*time.Second)
	}
	time.Sleep(200 * time.Millisecond) // let the last waiter set its watch
	ws := watchers(addrs[0], b.Dir(k))
	if len(ws) != 4 {
		t.Errorf("watched nodes: %v, want the 2 holders and the first 2 waiters", ws)
	}
	for p, n := range ws {
		if n > 1 {
			t.Errorf("rule: each waiter watches only what blocks it; %s has %d watching sessions", p, n)
		}
	}
	for _, lk := range holders {
		if err := lk.Release(context.Background()); err != nil {
			t.Fatal(err)
		}
		time.Sleep(300 * time.Millisecond)
	}
	close(release)
	wg.Wait()
	if fmt.Sprint(order[:2]) != "[0 1]" {
		t.Errorf("rule: slots go to waiters in arrival order; got %v", order)
	}
}

// TestReadersAndWritersUnderContention: six clients (separate sessions),
// two writers and four readers, take one key again and again. A writer
// never overlaps anyone, its fence is larger than every fence granted
// before it, a reader's is larger than the last writer's, and writers are
// not starved.
func TestReadersAndWritersUnderContention(t *testing.T) {
	addrs := sharedAddrs(t)
	k := locktest.UniqueKey("rwmix")
	var (
		mu                      sync.Mutex
		readers, writers        int
		maxFence, lastWrite     uint64
		readGrants, writeGrants int
	)
	deadline := time.Now().Add(3 * time.Second)
	var wg sync.WaitGroup
	for i := range 6 {
		l := locktest.NewLocker(t, newBackend(t, newConn(t, addrs...)))
		write := i%3 == 0
		wg.Go(func() {
			for time.Now().Before(deadline) {
				opts := []dlock.AcquireOption{dlock.WithTTL(5 * time.Second)}
				if !write {
					opts = append(opts, dlock.Shared())
				}
				lk, err := l.Acquire(ctxT(t, 20*time.Second), k, opts...)
				if err != nil {
					t.Error(err)
					return
				}
				f := lk.Fence()
				mu.Lock()
				switch {
				case write && (readers > 0 || writers > 0):
					t.Errorf("rule: a writer excludes everyone; granted with %d readers and %d writers", readers, writers)
				case write && f <= maxFence:
					t.Errorf("rule: a writer's fence exceeds every fence before; %d after %d", f, maxFence)
				case !write && writers > 0:
					t.Error("rule: a reader never overlaps a writer")
				case !write && f <= lastWrite:
					t.Errorf("rule: a reader's fence exceeds the last writer's; %d after %d", f, lastWrite)
				}
				if write {
					writers++
					writeGrants++
					lastWrite = f
				} else {
					readers++
					readGrants++
				}
				maxFence = max(maxFence, f)
				mu.Unlock()
				time.Sleep(time.Millisecond)
				mu.Lock()
				if write {
					writers--
				} else {
					readers--
				}
				mu.Unlock()
				if err := lk.Release(context.Background()); err != nil {
					t.Error(err)
					return
				}
			}
		})
	}
	wg.Wait()
	t.Logf("%d read grants, %d write grants", readGrants, writeGrants)
	if writeGrants < 4 {
		t.Errorf("rule: readers do not starve writers; %d write grants in 3s", writeGrants)
	}
}

// TestReleaseWakesWaitersOfEveryMode: a waiter of each mode is handed the
// key when the holder that blocks it releases, not when its wait's own
// bound (a third of the TTL) comes round.
func TestReleaseWakesWaitersOfEveryMode(t *testing.T) {
	addrs := sharedAddrs(t)
	const ttl = 15 * time.Second // a wait returns by itself after 5s
	for _, c := range []struct {
		name         string
		holder, wait []dlock.AcquireOption
	}{
		{"shared behind a writer", nil, []dlock.AcquireOption{dlock.Shared()}},
		{"writer behind a reader", []dlock.AcquireOption{dlock.Shared()}, nil},
		{"limited", []dlock.AcquireOption{dlock.WithLimit(1)}, []dlock.AcquireOption{dlock.WithLimit(1)}},
	} {
		t.Run(c.name, func(t *testing.T) {
			admin := newConn(t, addrs...)
			b := newBackend(t, newConn(t, addrs...))
			k := locktest.UniqueKey("wake")
			lk, err := locktest.NewLocker(t, b).TryAcquire(ctxT(t, 5*time.Second), k, append(c.holder, dlock.WithTTL(ttl))...)
			if err != nil {
				t.Fatal(err)
			}
			w := locktest.NewLocker(t, newBackend(t, newConn(t, addrs...)))
			got := make(chan time.Time, 1)
			go func() {
				wl, err := w.Acquire(ctxT(t, 20*time.Second), k, append(c.wait, dlock.WithTTL(ttl))...)
				if err != nil {
					t.Error(err)
					close(got)
					return
				}
				got <- time.Now()
				wl.Release(context.Background())
			}()
			waitQueueLen(t, admin, b, k, 2, 10*time.Second)
			released := time.Now()
			if err := lk.Release(context.Background()); err != nil {
				t.Fatal(err)
			}
			at, ok := <-got
			if !ok {
				return
			}
			if d := at.Sub(released); d > 2*time.Second {
				t.Errorf("rule: a release wakes the waiter; it got the key %s later", d)
			}
		})
	}
}

// TestWriterMarkIsRenewedNotRepeated: repeated exclusive attempts of one
// Backend that find readers keep one writer mark (renewed by each), not
// one per attempt; and once the readers leave, another writer passes the
// mark at once.
func TestWriterMarkIsRenewedNotRepeated(t *testing.T) {
	addrs := sharedAddrs(t)
	admin := newConn(t, addrs...)
	ctx := ctxT(t, 20*time.Second)
	k := locktest.UniqueKey("remark")
	rb := newBackend(t, newConn(t, addrs...))
	r, err := locktest.NewLocker(t, rb).TryAcquire(ctx, k, dlock.Shared(), dlock.WithTTL(10*time.Second))
	if err != nil {
		t.Fatal(err)
	}
	writer := locktest.NewLocker(t, newBackend(t, newConn(t, addrs...)))
	for range 5 {
		if _, err := writer.TryAcquire(ctx, k); !errors.Is(err, dlock.ErrNotAcquired) {
			t.Fatalf("writer's TryAcquire with a reader holding: %v", err)
		}
	}
	if n := queueLen(t, admin, rb, k); n != 2 {
		t.Errorf("rule: one Backend's attempts keep one writer mark; the queue has %d nodes", n)
	}
	if err := r.Release(ctx); err != nil {
		t.Fatal(err)
	}
	other := locktest.NewLocker(t, newBackend(t, newConn(t, addrs...)))
	w, err := other.TryAcquire(ctx, k)
	if err != nil {
		t.Fatalf("rule: a writer mark does not hold writers back; %v", err)
	}
	if err := w.Release(ctx); err != nil {
		t.Fatal(err)
	}
}
