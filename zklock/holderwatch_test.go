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

// heldConn is a Conn whose reads wait while the test holds it.
type heldConn struct {
	*zk.Conn
	mu   sync.Mutex
	gate chan struct{} // closed when the hold ends; nil when not held
}

func (c *heldConn) hold() {
	c.mu.Lock()
	defer c.mu.Unlock()
	c.gate = make(chan struct{})
}

func (c *heldConn) let() {
	c.mu.Lock()
	defer c.mu.Unlock()
	close(c.gate)
	c.gate = nil
}

func (c *heldConn) wait() {
	c.mu.Lock()
	g := c.gate
	c.mu.Unlock()
	if g != nil {
		<-g
	}
}

func (c *heldConn) Children(p string) ([]string, *zk.Stat, error) {
	c.wait()
	return c.Conn.Children(p)
}

func (c *heldConn) ChildrenW(p string) ([]string, *zk.Stat, <-chan zk.Event, error) {
	c.wait()
	return c.Conn.ChildrenW(p)
}

func (c *heldConn) Get(p string) ([]byte, *zk.Stat, error) {
	c.wait()
	return c.Conn.Get(p)
}

func (c *heldConn) GetW(p string) ([]byte, *zk.Stat, <-chan zk.Event, error) {
	c.wait()
	return c.Conn.GetW(p)
}

func (c *heldConn) ExistsW(p string) (bool, *zk.Stat, <-chan zk.Event, error) {
	c.wait()
	return c.Conn.ExistsW(p)
}

// TestWatchHoldersReportsEarlierReadersFirst: a watcher that first reads
// the journal when it tells of a change to a reader it has not seen
// granted reports the grant of each reader that held the key before that
// one and holds it still, before that reader's grant: the holders after
// each report are holders the key had.
func TestWatchHoldersReportsEarlierReadersFirst(t *testing.T) {
	addrs := sharedAddrs(t)
	k := locktest.UniqueKey("earlier")
	wc := &heldConn{Conn: newConn(t, addrs...)}
	now, ch := holderWatch(t, ctxT(t, time.Minute), newBackend(t, wc), k)
	if len(now) != 0 {
		t.Fatalf("holders of a fresh key: %s", summary(now))
	}
	b := newBackend(t, newConn(t, addrs...))
	ctx := ctxT(t, time.Minute)
	f := func(r dlock.Result) string { return fmt.Sprint(r.Fence) }

	wc.hold() // the watcher wakes at the first grant and waits
	r1 := dlock.Request{Key: k, Token: dlock.NewToken(), TTL: 10 * time.Second, Mode: dlock.ModeShared, Metadata: "r1"}
	r2 := dlock.Request{Key: k, Token: dlock.NewToken(), TTL: 10 * time.Second, Mode: dlock.ModeShared, Metadata: "r2"}
	g1 := take(t, b, r1)
	g2 := take(t, b, r2)
	err := b.SetMetadata(ctx, k, r2.Token, "r2'")
	wc.let()
	if err != nil {
		t.Fatal(err)
	}
	expect(t, ch, "two readers, the second's metadata changed",
		"["+f(g1)+":r1]", "["+f(g1)+":r1 "+f(g2)+":r2]", "["+f(g1)+":r1 "+f(g2)+":r2']")
}
