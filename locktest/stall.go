package locktest

import (
	"context"
	"errors"
	"net"
	"sync"
	"testing"
	"time"

	"github.com/dlock-dev/dlock"
)

// Stallable gives the suite backends whose store traffic passes through a
// TCP proxy in the test process, for the rule that a store that stops
// answering (connections accepted, requests never answered) is an error
// within each caller's deadline and a loss told before the store lets
// anyone else in. target is the store's address (host:port); newBackend
// must return a new client of the same store that connects to addr
// instead, for every connection it opens. Backends without a network store
// leave it out and the rule is skipped.
func Stallable(target string, newBackend func(t *testing.T, addr string) dlock.Backend) Option {
	return func(s *suite) { s.stallTarget, s.stallable = target, newBackend }
}

// stallSlack is how long past its deadline a call on a stalled store may
// return: time to notice the deadline and tear a connection down, far below
// the 30 s of a driver's own timeouts.
const stallSlack = 2 * time.Second

// stalledStore: a store that stops answering makes every call return an
// error by its caller's deadline (never "not acquired" and never a hang);
// the holder is told of its loss before anyone else gets the key; and when
// the store answers again, the requests that reach it late leave nothing
// held, and the same Locker works again.
func (s *suite) stalledStore(t *testing.T) {
	if s.stallable == nil {
		t.Skip("no proxied backend (locktest.Stallable)")
	}
	p := newStallProxy(t, s.stallTarget)
	b := s.stallable(t, p.addr())
	l := lockerOver(t, b)
	t.Cleanup(p.resume) // before l's Close (cleanups run last-in first-out)
	other, _ := s.locker(t)
	held, tried, waited := key(t, "held"), key(t, "tried"), key(t, "waited")
	lk := mustAcquire(t, l, held)

	p.stall()
	// Another client takes the held key as soon as the store lets it go;
	// by then the holder must know.
	taken := make(chan error, 1)
	go func() {
		olk, err := other.Acquire(ctxT(t, ttl+15*time.Second), held, dlock.WithTTL(ttl))
		if err == nil {
			if lk.Err() == nil {
				err = errors.New("the holder's Err() was nil when another client got the key")
			}
			olk.Release(context.Background())
		}
		taken <- err
	}()

	calls := []namedCall{
		{"TryAcquire", func(ctx context.Context) error {
			_, err := l.TryAcquire(ctx, tried, dlock.WithTTL(ttl))
			return err
		}},
		{"Acquire", func(ctx context.Context) error {
			_, err := l.Acquire(ctx, waited, dlock.WithTTL(ttl))
			return err
		}},
		{"Do", func(ctx context.Context) error {
			return l.Do(ctx, waited, func(context.Context) error { return nil }, dlock.WithTTL(ttl))
		}},
		{"Release", func(ctx context.Context) error { return lk.Release(ctx) }},
	}
	// The administrative calls too, where the store has them.
	if _, ok := b.(dlock.Lister); ok {
		calls = append(calls, namedCall{"List", func(ctx context.Context) error { _, err := l.List(ctx, held); return err }})
	}
	if _, ok := b.(dlock.KeyLister); ok {
		calls = append(calls, namedCall{"ListKeys", func(ctx context.Context) error { _, err := l.ListKeys(ctx, held); return err }})
	}
	if _, ok := b.(dlock.WaiterLister); ok {
		calls = append(calls, namedCall{"ListWaiters", func(ctx context.Context) error { _, err := l.ListWaiters(ctx, held); return err }})
	}
	if _, ok := b.(dlock.ForceReleaser); ok {
		// A key nobody holds: a force that reaches the store late frees nothing.
		calls = append(calls, namedCall{"ForceRelease", func(ctx context.Context) error { return l.ForceRelease(ctx, key(t, "forced")) }})
	}
	for _, c := range calls {
		d := 300 * time.Millisecond
		ctx, cancel := context.WithTimeout(context.Background(), d)
		began := time.Now()
		err := c.call(ctx)
		took := time.Since(began)
		cancel()
		var he *dlock.HeldError
		switch {
		case took > d+stallSlack:
			t.Errorf("rule: a store that stops answering is an error by the caller's deadline; %s with a %s deadline returned after %s", c.name, d, took.Round(time.Millisecond))
		case err == nil:
			t.Errorf("rule: a store that stops answering is an error; %s succeeded", c.name)
		case errors.As(err, &he):
			t.Errorf("rule: an outage is never \"not acquired\"; %s: %v", c.name, err)
		}
	}
	if err := <-taken; err != nil {
		t.Errorf("rule: the holder is told of the loss before another client gets the key; %v", err)
	}
	select {
	case <-lk.Done():
	default:
		t.Errorf("rule: the holder is told of the loss; Done is open and Err is %v", lk.Err())
	}

	// The store answers again: what the stalled calls sent arrives late.
	p.resume()
	lk2, err := l.Acquire(ctxT(t, 20*time.Second), key(t, "after"), dlock.WithTTL(ttl))
	if err != nil {
		t.Fatalf("rule: the Locker works again once the store answers; %v", err)
	}
	lk2.Release(context.Background())
	for _, k := range []string{tried, waited} {
		// Within a lease of its late arrival: what it took was released,
		// or expires with its TTL.
		olk, err := other.Acquire(ctxT(t, ttl+stallSlack+5*time.Second), k, dlock.WithTTL(ttl))
		if err != nil {
			t.Errorf("rule: requests that reach the store late leave nothing held; %q: %v", k, err)
			continue
		}
		olk.Release(context.Background())
	}
}

// namedCall is a call of the suite's, named for its messages.
type namedCall struct {
	name string
	call func(ctx context.Context) error
}

// stallProxy forwards TCP connections to a target until stall; then it
// accepts connections and reads requests but forwards nothing, in either
// direction, until resume, when what it held is delivered late.
type stallProxy struct {
	target string
	ln     net.Listener

	mu      sync.Mutex
	resumed chan struct{} // closed while not stalled
	conns   map[net.Conn]struct{}
	closed  bool
}

func newStallProxy(t *testing.T, target string) *stallProxy {
	t.Helper()
	ln, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	p := &stallProxy{target: target, ln: ln, resumed: make(chan struct{}), conns: map[net.Conn]struct{}{}}
	close(p.resumed)
	go p.serve()
	t.Cleanup(p.close)
	return p
}

func (p *stallProxy) addr() string { return p.ln.Addr().String() }

func (p *stallProxy) stall() {
	p.mu.Lock()
	defer p.mu.Unlock()
	select {
	case <-p.resumed:
		p.resumed = make(chan struct{})
	default:
	}
}

func (p *stallProxy) resume() {
	p.mu.Lock()
	defer p.mu.Unlock()
	select {
	case <-p.resumed:
	default:
		close(p.resumed)
	}
}

// gate returns once the proxy is not stalled.
func (p *stallProxy) gate() {
	p.mu.Lock()
	ch := p.resumed
	p.mu.Unlock()
	<-ch
}

func (p *stallProxy) track(c net.Conn) bool {
	p.mu.Lock()
	defer p.mu.Unlock()
	if p.closed {
		c.Close()
		return false
	}
	p.conns[c] = struct{}{}
	return true
}

func (p *stallProxy) serve() {
	for {
		c, err := p.ln.Accept()
		if err != nil {
			return
		}
		if !p.track(c) {
			return
		}
		go func() {
			p.gate()
			up, err := net.DialTimeout("tcp", p.target, 5*time.Second)
			if err != nil || !p.track(up) {
				c.Close()
				return
			}
			go p.pipe(c, up)
			go p.pipe(up, c)
		}()
	}
}

// pipe copies src to dst, holding each chunk while the proxy is stalled.
func (p *stallProxy) pipe(src, dst net.Conn) {
	defer src.Close()
	defer dst.Close()
	buf := make([]byte, 32<<10)
	for {
		n, err := src.Read(buf)
		if n > 0 {
			p.gate()
			if _, werr := dst.Write(buf[:n]); werr != nil {
				return
			}
		}
		if err != nil {
			return
		}
	}
}

func (p *stallProxy) close() {
	p.mu.Lock()
	p.closed = true
	conns := p.conns
	p.conns = map[net.Conn]struct{}{}
	p.mu.Unlock()
	p.resume()
	p.ln.Close()
	for c := range conns {
		c.Close()
	}
}
