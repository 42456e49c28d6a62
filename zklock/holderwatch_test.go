package zklock_test

import (
	"context"
	"fmt"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/dlock-dev/dlock"
	"github.com/dlock-dev/dlock/locktest"
	"github.com/dlock-dev/dlock/zklock"
	"github.com/go-zookeeper/zk"
)

// holderWatch starts WatchHolders of key on b and returns the holders it
// reports first and its channel.
func holderWatch(t *testing.T, ctx context.Context, b dlock.Backend, key string) ([]dlock.LockInfo, <-chan []dlock.LockInfo) {
	t.Helper()
	hw, ok := b.(dlock.HolderWatcher)
	if !ok {
		t.Fatalf("%T is not a dlock.HolderWatcher", b)
	}
	now, ch, err := hw.WatchHolders(ctx, key)
	if err != nil {
		t.Fatalf("WatchHolders: %v", err)
	}
	return now, ch
}

// watched returns a key, a watch of its holders through one session
// (which must report nothing at first) and a Backend on another.
func watched(t *testing.T, name string) (string, <-chan []dlock.LockInfo, *zklock.Backend) {
	t.Helper()
	addrs := sharedAddrs(t)
	k := locktest.UniqueKey(name)
	now, ch := holderWatch(t, ctxT(t, 2*time.Minute), newBackend(t, newConn(t, addrs...)), k)
	if len(now) != 0 {
		t.Fatalf("holders of a fresh key: %s", summary(now))
	}
	return k, ch, newBackend(t, newConn(t, addrs...))
}

// summary writes holders as "fence:metadata" in their order.
func summary(hs []dlock.LockInfo) string {
	var s []string
	for _, h := range hs {
		s = append(s, fmt.Sprintf("%d:%s", h.Fence, h.Metadata))
	}
	return "[" + strings.Join(s, " ") + "]"
}

// expect receives from ch until the reports match want, one receive per
// entry, and fails the test at the first that does not.
func expect(t *testing.T, ch <-chan []dlock.LockInfo, what string, want ...string) {
	t.Helper()
	for _, w := range want {
		select {
		case hs, open := <-ch:
			if !open {
				t.Fatalf("%s: channel closed before %s", what, w)
			}
			if got := summary(hs); got != w {
				t.Fatalf("%s: got %s, want %s", what, got, w)
			}
		case <-time.After(seenBound):
			t.Fatalf("%s: %s not reported within %s", what, w, seenBound)
		}
	}
}

// TestWatchHoldersReportsEveryChange: every kind of change of a key's
// holders is reported, one receive each, in order: a grant, a metadata
// change, a release, an expired holder deleted by another client, the
// end of a holder's session, a forced release, and shared holders.
func TestWatchHoldersReportsEveryChange(t *testing.T) {
	addrs := sharedAddrs(t)
	k, ch, b := watched(t, "every")
	f := func(r dlock.Result) string { return fmt.Sprint(r.Fence) }
	ctx := ctxT(t, time.Minute)

	// A grant, a metadata change, a release.
	ra := dlock.Request{Key: k, Token: dlock.NewToken(), TTL: 10 * time.Second, Metadata: "a"}
	a := take(t, b, ra)
	expect(t, ch, "grant", "["+f(a)+":a]")
	if err := b.SetMetadata(ctx, k, ra.Token, "a2"); err != nil {
		t.Fatal(err)
	}
	expect(t, ch, "metadata", "["+f(a)+":a2]")
	if err := b.Release(ctx, k, ra.Token); err != nil {
		t.Fatal(err)
	}
	expect(t, ch, "release", "[]")

	// A holder whose lease ran out, deleted by the next contender.
	rd := dlock.Request{Key: k, Token: dlock.NewToken(), TTL: time.Second, Metadata: "d"}
	d := take(t, b, rd)
	expect(t, ch, "grant of the holder that will expire", "["+f(d)+":d]")
	time.Sleep(1500 * time.Millisecond)
	re := dlock.Request{Key: k, Token: dlock.NewToken(), TTL: 10 * time.Second, Metadata: "e"}
	e := take(t, newBackend(t, newConn(t, addrs...)), re)
	expect(t, ch, "expired holder, then the next grant", "[]", "["+f(e)+":e]")
	if err := newBackend(t, newConn(t, addrs...)).ForceRelease(ctx, k); err != nil {
		t.Fatal(err)
	}
	expect(t, ch, "forced release", "[]")

	// The end of the holder's session: the server deletes its node.
	const session = 2 * time.Second
	p, hb := proxiedBackend(t, addrs[0], session)
	rs := dlock.Request{Key: k, Token: dlock.NewToken(), TTL: session, Metadata: "s"}
	s := take(t, hb, rs)
	expect(t, ch, "grant to the session that will expire", "["+f(s)+":s]")
	p.cut(true)
	expect(t, ch, "expired session", "[]")
	p.cut(false)

	// Shared holders: each grant and each end on its own.
	r1 := dlock.Request{Key: k, Token: dlock.NewToken(), TTL: 10 * time.Second, Mode: dlock.ModeShared, Metadata: "r1"}
	r2 := dlock.Request{Key: k, Token: dlock.NewToken(), TTL: 10 * time.Second, Mode: dlock.ModeShared, Metadata: "r2"}
	g1 := take(t, b, r1)
	expect(t, ch, "first reader", "["+f(g1)+":r1]")
	g2 := take(t, b, r2)
	expect(t, ch, "second reader", "["+f(g1)+":r1 "+f(g2)+":r2]")
	if err := b.SetMetadata(ctx, k, r2.Token, "r2'"); err != nil {
		t.Fatal(err)
	}
	expect(t, ch, "reader's metadata", "["+f(g1)+":r1 "+f(g2)+":r2']")
	if err := b.Release(ctx, k, r1.Token); err != nil {
		t.Fatal(err)
	}
	expect(t, ch, "first reader's release", "["+f(g2)+":r2']")
	if err := b.Release(ctx, k, r2.Token); err != nil {
		t.Fatal(err)
	}
	expect(t, ch, "second reader's release", "[]")
}

// TestWatchHoldersSeesShortTerms: terms that begin, change their metadata
// and end before the watcher reads are reported from the journal, each
// grant with its first metadata, in fence order.
func TestWatchHoldersSeesShortTerms(t *testing.T) {
	k, ch, b := watched(t, "short")
	ctx := ctxT(t, time.Minute)
	var want []string
	for i := range 5 {
		r := dlock.Request{Key: k, Token: dlock.NewToken(), TTL: 10 * time.Second, Metadata: fmt.Sprint("v", i)}
		g := take(t, b, r)
		if err := b.SetMetadata(ctx, k, r.Token, fmt.Sprint("w", i)); err != nil {
			t.Fatal(err)
		}
		if err := b.Release(ctx, k, r.Token); err != nil {
			t.Fatal(err)
		}
		want = append(want, fmt.Sprintf("[%d:v%d]", g.Fence, i), fmt.Sprintf("[%d:w%d]", g.Fence, i), "[]")
	}
	expect(t, ch, "short terms", want...)
}

// TestWatchHoldersClosesWhenBehind: a reader that does not receive while
// the journal is pruned past its position finds its channel closed.
func TestWatchHoldersClosesWhenBehind(t *testing.T) {
	k, ch, b := watched(t, "behind")
	b.SetJournalKeep(4)
	ctx := ctxT(t, time.Minute)
	const terms = 20
	for range terms {
		r := dlock.Request{Key: k, Token: dlock.NewToken(), TTL: 10 * time.Second}
		take(t, b, r)
		if err := b.SetMetadata(ctx, k, r.Token, "x"); err != nil {
			t.Fatal(err)
		}
		if err := b.Release(ctx, k, r.Token); err != nil {
			t.Fatal(err)
		}
	}
	n := 0
	for {
		select {
		case _, open := <-ch:
			if !open {
				if n >= 3*terms {
					t.Fatalf("closed after all %d changes", n)
				}
				return
			}
			n++
		case <-time.After(seenBound):
			t.Fatalf("after %d reports, neither closed nor reported within %s", n, seenBound)
		}
	}
}

// TestJournalEntriesEnd: a Backend deletes the journal entries it wrote
// once they are older than the journal's age, so that a key's directory
// does not outlive its use; a watcher that far behind is closed.
func TestJournalEntriesEnd(t *testing.T) {
	addrs := sharedAddrs(t)
	c := newConn(t, addrs...)
	b := newBackend(t, c)
	b.SetJournalAge(300 * time.Millisecond)
	k := locktest.UniqueKey("age")
	ctx := ctxT(t, time.Minute)
	r := dlock.Request{Key: k, Token: dlock.NewToken(), TTL: 10 * time.Second}
	take(t, b, r)
	if err := b.Release(ctx, k, r.Token); err != nil {
		t.Fatal(err)
	}
	entries := func() []string {
		names, _, err := c.Children(b.Dir(k) + "/" + zklock.JournalNode)
		if err != nil && err != zk.ErrNoNode {
			t.Fatal(err)
		}
		return names
	}
	if n := entries(); len(n) != 1 {
		t.Fatalf("journal after a release: %v, want one entry", n)
	}
	deadline := time.Now().Add(seenBound)
	for len(entries()) > 0 {
		if time.Now().After(deadline) {
			t.Fatalf("journal entries still there after %s: %v", seenBound, entries())
		}
		time.Sleep(100 * time.Millisecond)
	}
}

// TestWatchHoldersEndsWithItsContext: the channel closes when ctx ends.
func TestWatchHoldersEndsWithItsContext(t *testing.T) {
	w := newBackend(t, newConn(t, sharedAddrs(t)...))
	ctx, cancel := context.WithCancel(context.Background())
	_, ch := holderWatch(t, ctx, w, locktest.UniqueKey("ctx"))
	cancel()
	select {
	case _, open := <-ch:
		if open {
			t.Fatal("a report after ctx ended on an unchanged key")
		}
	case <-time.After(seenBound):
		t.Fatalf("channel still open %s after ctx ended", seenBound)
	}
	if _, _, err := w.WatchHolders(ctx, "k"); err == nil {
		t.Error("WatchHolders with an ended ctx: nil error")
	}
}

// heldConn is a Conn whose reads wait while the test holds them: every
// read, or those of one path.
type heldConn struct {
	*zk.Conn
	mu      sync.Mutex
	gate    chan struct{} // closed when the hold ends; nil when not held
	only    string        // the path held, or "" for every path
	arrived chan struct{} // receives when a read starts to wait
}

func newHeldConn(c *zk.Conn) *heldConn { return &heldConn{Conn: c, arrived: make(chan struct{}, 1)} }

// hold makes the reads of path ("" for every path) wait until let.
func (c *heldConn) hold(path string) {
	c.mu.Lock()
	defer c.mu.Unlock()
	c.gate, c.only = make(chan struct{}), path
}

func (c *heldConn) let() {
	c.mu.Lock()
	defer c.mu.Unlock()
	close(c.gate)
	c.gate = nil
}

func (c *heldConn) wait(path string) {
	c.mu.Lock()
	g := c.gate
	if c.only != "" && c.only != path {
		g = nil
	}
	c.mu.Unlock()
	if g != nil {
		select {
		case c.arrived <- struct{}{}:
		default:
		}
		<-g
	}
}

func (c *heldConn) Children(p string) ([]string, *zk.Stat, error) {
	c.wait(p)
	return c.Conn.Children(p)
}

func (c *heldConn) ChildrenW(p string) ([]string, *zk.Stat, <-chan zk.Event, error) {
	c.wait(p)
	return c.Conn.ChildrenW(p)
}

func (c *heldConn) Get(p string) ([]byte, *zk.Stat, error) {
	c.wait(p)
	return c.Conn.Get(p)
}

func (c *heldConn) GetW(p string) ([]byte, *zk.Stat, <-chan zk.Event, error) {
	c.wait(p)
	return c.Conn.GetW(p)
}

func (c *heldConn) ExistsW(p string) (bool, *zk.Stat, <-chan zk.Event, error) {
	c.wait(p)
	return c.Conn.ExistsW(p)
}

// twoHolders is a key watched through a heldConn whose reads are held
// while two holders of one mode take the key and the second changes its
// metadata, and the watcher has woken and waits to read.
type twoHolders struct {
	k      string
	ch     <-chan []dlock.LockInfo
	wc     *heldConn
	wb, b  *zklock.Backend // the watcher's and the holders'
	r1, r2 dlock.Request
	g1, g2 string // their fences
}

func newTwoHolders(t *testing.T, name string, mode dlock.Mode, limit int) *twoHolders {
	t.Helper()
	addrs := sharedAddrs(t)
	h := &twoHolders{k: locktest.UniqueKey(name), wc: newHeldConn(newConn(t, addrs...))}
	h.wb, h.b = newBackend(t, h.wc), newBackend(t, newConn(t, addrs...))
	var now []dlock.LockInfo
	now, h.ch = holderWatch(t, ctxT(t, time.Minute), h.wb, h.k)
	if len(now) != 0 {
		t.Fatalf("holders of a fresh key: %s", summary(now))
	}
	h.wc.hold("")
	h.r1 = dlock.Request{Key: h.k, Token: dlock.NewToken(), TTL: 10 * time.Second, Mode: mode, Limit: limit, Metadata: "r1"}
	h.r2 = dlock.Request{Key: h.k, Token: dlock.NewToken(), TTL: 10 * time.Second, Mode: mode, Limit: limit, Metadata: "r2"}
	h.g1, h.g2 = fmt.Sprint(take(t, h.b, h.r1).Fence), fmt.Sprint(take(t, h.b, h.r2).Fence)
	if err := h.b.SetMetadata(ctxT(t, 10*time.Second), h.k, h.r2.Token, "r2'"); err != nil {
		t.Fatal(err)
	}
	h.waitReader(t)
	return h
}

// waitReader waits for the watcher to wait for a held read.
func (h *twoHolders) waitReader(t *testing.T) {
	t.Helper()
	select {
	case <-h.wc.arrived:
	case <-time.After(seenBound):
		t.Fatal("the watcher did not read")
	}
}

// TestWatchHoldersReportsEarlierReadersFirst: a watcher that first reads
// the journal when it tells of a change to a holder it has not seen
// granted (a reader, or a holder of a semaphore) reports the grant of each
// compatible holder that held the key before that one and holds it still,
// before that holder's grant: the holders after each report are holders
// the key had.
func TestWatchHoldersReportsEarlierReadersFirst(t *testing.T) {
	for _, c := range []struct {
		mode  dlock.Mode
		limit int
	}{{dlock.ModeShared, 0}, {dlock.ModeLimited, 2}} {
		t.Run(dlock.DescribeMode(c.mode, c.limit), func(t *testing.T) {
			h := newTwoHolders(t, "earlier", c.mode, c.limit)
			h.wc.let()
			expect(t, h.ch, "two holders, the second's metadata changed",
				"["+h.g1+":r1]", "["+h.g1+":r1 "+h.g2+":r2]", "["+h.g1+":r1 "+h.g2+":r2']")
		})
	}
}

// TestWatchHoldersSeesAReaderThatEndsDuringItsRead: a reader granted
// before another, unseen by the watcher, and released while the watcher
// reads the key's holders after reading the journal, is reported granted
// before the other reader, then released.
func TestWatchHoldersSeesAReaderThatEndsDuringItsRead(t *testing.T) {
	h := newTwoHolders(t, "ends-during-read", dlock.ModeShared, 0)
	h.wc.let()
	h.wc.hold(h.wb.Dir(h.k)) // it reads the journal, then waits to read the holders
	h.waitReader(t)
	if err := h.b.Release(ctxT(t, 10*time.Second), h.k, h.r1.Token); err != nil {
		t.Fatal(err)
	}
	h.wc.let()
	expect(t, h.ch, "a reader released while the watcher read",
		"["+h.g1+":r1]", "["+h.g1+":r1 "+h.g2+":r2]", "["+h.g1+":r1 "+h.g2+":r2']", "["+h.g2+":r2']")
}
