package zklock_test

import (
	"context"
	"errors"
	"io"
	"net"
	"sync"
	"testing"
	"time"

	"github.com/dlock-dev/dlock"
	"github.com/dlock-dev/dlock/locktest"
	"github.com/dlock-dev/dlock/zklock"
	"github.com/go-zookeeper/zk"
)

// seenBound is how long a watch may take to report a change or to close:
// generous, since a restarted server needs the client to reconnect.
const seenBound = 30 * time.Second

// nextEvent waits for a receive on ch and reports whether the channel was
// still open; it fails the test if nothing comes within seenBound.
func nextEvent(t *testing.T, ch <-chan struct{}, what string) bool {
	t.Helper()
	select {
	case _, open := <-ch:
		return open
	case <-time.After(seenBound):
		t.Fatalf("watch neither reported %s nor closed within %s", what, seenBound)
		return false
	}
}

// drain drops the receives already queued on ch.
func drain(ch <-chan struct{}) {
	time.Sleep(200 * time.Millisecond)
	for {
		select {
		case <-ch:
			continue
		default:
		}
		return
	}
}

func take(t *testing.T, b *zklock.Backend, r dlock.Request) dlock.Result {
	t.Helper()
	res, err := b.Acquire(ctxT(t, 10*time.Second), r)
	if err != nil || !res.Acquired {
		t.Fatalf("Acquire %s: %+v %v", r.Mode, res, err)
	}
	return res
}

// TestWatchSeesTheEndOfTheHoldersSession: when the holder's session ends,
// ZooKeeper deletes its node, and another session's watch reports it.
func TestWatchSeesTheEndOfTheHoldersSession(t *testing.T) {
	addrs := sharedAddrs(t)
	w := newBackend(t, newConn(t, addrs...))
	hc := newConn(t, addrs...)
	k := locktest.UniqueKey("session")
	take(t, newBackend(t, hc), dlock.Request{Key: k, Token: dlock.NewToken(), TTL: 10 * time.Second})
	ch, err := w.Watch(ctxT(t, time.Minute), k)
	if err != nil {
		t.Fatal(err)
	}
	hc.Close()
	if !nextEvent(t, ch, "the end of the holder's session") {
		t.Fatal("watch closed instead of reporting the holder's end")
	}
	if hs, err := w.List(ctxT(t, 10*time.Second), k); err != nil || len(hs) != 0 {
		t.Errorf("after the reported end List gives %+v %v, want nothing", hs, err)
	}
}

// TestWatchClosesWithItsSession: a watch cannot outlive its own session
// (the Conn closed, or the session expired while the client was cut off):
// its channel is closed.
func TestWatchClosesWithItsSession(t *testing.T) {
	addrs := sharedAddrs(t)
	t.Run("closed", func(t *testing.T) {
		c := newConn(t, addrs...)
		ch, err := newBackend(t, c).Watch(ctxT(t, time.Minute), locktest.UniqueKey("closed"))
		if err != nil {
			t.Fatal(err)
		}
		c.Close()
		for nextEvent(t, ch, "the closed session") {
		}
	})
	t.Run("expired", func(t *testing.T) {
		const session = 2 * time.Second
		p, b := proxiedBackend(t, addrs[0], session)
		k := locktest.UniqueKey("expired")
		ch, err := b.Watch(ctxT(t, time.Minute), k)
		if err != nil {
			t.Fatal(err)
		}
		p.cut(true)
		time.Sleep(3 * session) // the server expires the session
		p.cut(false)
		for nextEvent(t, ch, "the expired session") {
		}
	})
}

// TestWatchAcrossRestart: a watch across a restart of the server (within
// the session timeout, so the session survives) either goes on reporting
// (the client sets its watches again) or closes; it never goes silent.
func TestWatchAcrossRestart(t *testing.T) {
	srv := startEnsemble(t, 1)[0]
	b := newBackend(t, newConn(t, srv.addr()))
	k := locktest.UniqueKey("restart")
	ch, err := b.Watch(ctxT(t, 2*time.Minute), k)
	if err != nil {
		t.Fatal(err)
	}
	srv.kill()
	if err := srv.start(); err != nil {
		t.Fatal(err)
	}
	if err := srv.waitServing(60 * time.Second); err != nil {
		t.Fatal(err)
	}
	other := newBackend(t, newConn(t, srv.addr()))
	var res dlock.Result
	for range 100 {
		if res, err = other.Acquire(ctxT(t, 10*time.Second), dlock.Request{Key: k, Token: dlock.NewToken(), TTL: 10 * time.Second}); err == nil {
			break
		}
		time.Sleep(100 * time.Millisecond)
	}
	if err != nil || !res.Acquired {
		t.Fatalf("Acquire after the restart: %+v %v", res, err)
	}
	if !nextEvent(t, ch, "the grant after the restart") {
		t.Log("watch closed by the restart (allowed)")
	}
}

// TestRenewalKeepsTheNewMetadata: a renewal rewrites the holder's node,
// and must write the metadata SetMetadata set, not the acquisition's.
func TestRenewalKeepsTheNewMetadata(t *testing.T) {
	b := newBackend(t, newConn(t, sharedAddrs(t)...))
	k := locktest.UniqueKey("renew")
	r := dlock.Request{Key: k, Token: dlock.NewToken(), TTL: 10 * time.Second, Metadata: "v1"}
	take(t, b, r)
	if err := b.SetMetadata(ctxT(t, 10*time.Second), k, r.Token, "v2"); err != nil {
		t.Fatal(err)
	}
	for range 2 {
		errs, err := b.Extend(ctxT(t, 10*time.Second), []dlock.Lease{{Key: k, Token: r.Token, TTL: r.TTL}})
		if err != nil || errs[0] != nil {
			t.Fatalf("Extend: %v %v", errs, err)
		}
	}
	hs, err := b.List(ctxT(t, 10*time.Second), k)
	if err != nil || len(hs) != 1 || hs[0].Metadata != "v2" {
		t.Fatalf("List after renewals: %+v %v, want metadata v2", hs, err)
	}
}

// TestSetMetadataDoesNotReviveAnExpiredLease: a holder's node whose lease
// ran out (nobody deleted it yet) is not held; a write to it would start
// its lease again in the store.
func TestSetMetadataDoesNotReviveAnExpiredLease(t *testing.T) {
	addrs := sharedAddrs(t)
	b := newBackend(t, newConn(t, addrs...))
	k := locktest.UniqueKey("expired")
	r := dlock.Request{Key: k, Token: dlock.NewToken(), TTL: time.Second}
	take(t, b, r)
	time.Sleep(1500 * time.Millisecond)
	if err := b.SetMetadata(ctxT(t, 10*time.Second), k, r.Token, "late"); !errors.Is(err, dlock.ErrNotHeld) {
		t.Fatalf("SetMetadata after the lease ran out: %v, want ErrNotHeld", err)
	}
	res, err := newBackend(t, newConn(t, addrs...)).Acquire(ctxT(t, 10*time.Second), dlock.Request{Key: k, Token: dlock.NewToken(), TTL: time.Second})
	if err != nil || !res.Acquired {
		t.Fatalf("the key is not free after its lease ran out: %+v %v", res, err)
	}
}

// TestSetMetadataOfAReaderBehindTheHead: a shared holder that is not the
// head of the queue, and that another Backend of the session recorded,
// sets its metadata; a watch and List see it; a waiting writer's token
// is not a holder's.
func TestSetMetadataOfAReaderBehindTheHead(t *testing.T) {
	addrs := sharedAddrs(t)
	c := newConn(t, addrs...)
	b := newBackend(t, c)
	k := locktest.UniqueKey("reader")
	take(t, b, dlock.Request{Key: k, Token: dlock.NewToken(), TTL: 10 * time.Second, Mode: dlock.ModeShared})
	second := dlock.Request{Key: k, Token: dlock.NewToken(), TTL: 10 * time.Second, Mode: dlock.ModeShared}
	take(t, b, second)
	other := newBackend(t, c) // knows nothing of b's nodes
	ch, err := other.Watch(ctxT(t, time.Minute), k)
	if err != nil {
		t.Fatal(err)
	}
	if err := other.SetMetadata(ctxT(t, 10*time.Second), k, second.Token, "second"); err != nil {
		t.Fatalf("SetMetadata of the second reader: %v", err)
	}
	if !nextEvent(t, ch, "the metadata change") {
		t.Fatal("watch closed")
	}
	hs, err := b.List(ctxT(t, 10*time.Second), k)
	if err != nil || len(hs) != 2 || hs[1].Token != second.Token || hs[1].Metadata != "second" || hs[0].Metadata != "" {
		t.Fatalf("List: %+v %v, want the second reader with metadata \"second\"", hs, err)
	}
	drain(ch)

	writer := dlock.Request{Key: k, Token: dlock.NewToken(), TTL: 10 * time.Second}
	wctx, cancel := context.WithCancel(context.Background())
	var wg sync.WaitGroup
	wg.Go(func() { _, _ = b.AcquireWait(wctx, writer) })
	defer func() { cancel(); wg.Wait() }()
	if !nextEvent(t, ch, "the writer queueing") {
		t.Fatal("watch closed")
	}
	names, st, err := c.Children(b.Dir(k))
	names = withoutJournal(names)
	if err != nil || len(names) != 3 {
		t.Fatalf("queue %v %v, want two readers and a writer", names, err)
	}
	if err := b.SetMetadata(ctxT(t, 10*time.Second), k, writer.Token, "writer"); !errors.Is(err, dlock.ErrNotHeld) {
		t.Errorf("SetMetadata by a waiting writer: %v, want ErrNotHeld", err)
	}
	if _, st2, err := c.Get(b.Dir(k)); err != nil || st2.Mzxid != st.Mzxid {
		t.Errorf("a refused SetMetadata touched the queue: %v", err)
	}
}

// cutProxy forwards TCP connections to a target until cut, which closes
// them and refuses new ones until it is undone.
type cutProxy struct {
	ln     net.Listener
	target string
	mu     sync.Mutex
	down   bool
	conns  []net.Conn
	wg     sync.WaitGroup
}

func newCutProxy(t *testing.T, target string) *cutProxy {
	t.Helper()
	ln, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	p := &cutProxy{ln: ln, target: target}
	p.wg.Go(p.serve)
	t.Cleanup(func() {
		ln.Close()
		p.cut(true)
		p.wg.Wait()
	})
	return p
}

func (p *cutProxy) addr() string { return p.ln.Addr().String() }

// proxiedBackend returns a Backend whose session, with the given timeout,
// goes through a cutProxy to addr, and the proxy.
func proxiedBackend(t *testing.T, addr string, session time.Duration) (*cutProxy, *zklock.Backend) {
	t.Helper()
	p := newCutProxy(t, addr)
	c, _, err := zk.Connect([]string{p.addr()}, session, zk.WithLogger(nopLogger{}), zk.WithLogInfo(false))
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(c.Close)
	b, err := zklock.New(c, &zklock.Options{SessionTimeout: session})
	if err != nil {
		t.Fatal(err)
	}
	return p, b
}

func (p *cutProxy) serve() {
	for {
		c, err := p.ln.Accept()
		if err != nil {
			return
		}
		p.mu.Lock()
		if p.down {
			p.mu.Unlock()
			c.Close()
			continue
		}
		s, err := net.Dial("tcp", p.target)
		if err != nil {
			p.mu.Unlock()
			c.Close()
			continue
		}
		p.conns = append(p.conns, c, s)
		p.mu.Unlock()
		p.wg.Go(func() { _, _ = io.Copy(s, c); s.Close(); c.Close() })
		p.wg.Go(func() { _, _ = io.Copy(c, s); s.Close(); c.Close() })
	}
}

func (p *cutProxy) cut(down bool) {
	p.mu.Lock()
	defer p.mu.Unlock()
	p.down = down
	if down {
		for _, c := range p.conns {
			c.Close()
		}
		p.conns = nil
	}
}
