package pglock_test

import (
	"context"
	"errors"
	"fmt"
	"io"
	"net"
	"sync"
	"testing"
	"time"

	"github.com/dlock-dev/dlock"
	"github.com/dlock-dev/dlock/pglock"
)

// gateProxy forwards TCP connections to upstream; while closed it holds
// back what the server sends (the client reads nothing, as if it were
// paused or its replies were stuck in the network), and lets it through
// once opened again.
type gateProxy struct {
	ln   net.Listener
	mu   sync.Mutex
	open chan struct{} // closed while the gate is open
}

func newGateProxy(t *testing.T, upstream string) *gateProxy {
	t.Helper()
	ln, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	p := &gateProxy{ln: ln, open: make(chan struct{})}
	close(p.open)
	var conns sync.WaitGroup
	t.Cleanup(func() { ln.Close(); p.release(); conns.Wait() })
	go func() {
		for {
			c, err := ln.Accept()
			if err != nil {
				return
			}
			u, err := net.Dial("tcp", upstream)
			if err != nil {
				c.Close()
				continue
			}
			conns.Add(2)
			go func() { defer conns.Done(); _, _ = io.Copy(u, c); u.Close() }()
			go func() {
				defer conns.Done()
				defer c.Close()
				buf := make([]byte, 32<<10)
				for {
					n, err := u.Read(buf)
					if n > 0 {
						p.mu.Lock()
						gate := p.open
						p.mu.Unlock()
						<-gate
						if _, werr := c.Write(buf[:n]); werr != nil {
							return
						}
					}
					if err != nil {
						return
					}
				}
			}()
		}
	}()
	return p
}

func (p *gateProxy) hold() {
	p.mu.Lock()
	p.open = make(chan struct{})
	p.mu.Unlock()
}

func (p *gateProxy) release() {
	p.mu.Lock()
	select {
	case <-p.open:
	default:
		close(p.open)
	}
	p.mu.Unlock()
}

// TestAdvisoryLateGrantReplyIsNotTrusted: a waiter's grant reaches the
// client only after the server ended its session for idleness (a paused
// process, a reply held up in the network) and another client took the
// key. The Locker must not hand out that grant as held: the lease counts
// from a statement sent after the reply came, not from the reply's
// arrival.
func TestAdvisoryLateGrantReplyIsNotTrusted(t *testing.T) {
	ctx := context.Background()
	direct := open(t, "")
	holder := newAdvisory(t, direct)
	cfg := openConfig(t)
	proxy := newGateProxy(t, fmt.Sprintf("%s:%d", cfg.ConnConfig.Host, cfg.ConnConfig.Port))
	host, port, _ := net.SplitHostPort(proxy.ln.Addr().String())
	cfg.ConnConfig.Host = host
	fmt.Sscan(port, &cfg.ConnConfig.Port)
	waiter := newAdvisory(t, openWith(t, cfg))
	lk := dlock.New(waiter, &dlock.Options{TTL: time.Second})
	t.Cleanup(func() { lk.Close(context.Background()) })

	key := fmt.Sprintf("lategrant/%d", time.Now().UnixNano())
	held := dlock.Request{Key: key, Token: dlock.NewToken(), TTL: time.Second}
	if res, err := holder.Acquire(ctx, held); err != nil || !res.Acquired {
		t.Fatalf("acquire: %+v, %v", res, err)
	}
	type outcome struct {
		lock *dlock.Lock
		err  error
	}
	got := make(chan outcome, 1)
	wctx, cancel := context.WithTimeout(ctx, 20*time.Second)
	defer cancel()
	go func() {
		l, err := lk.Acquire(wctx, key)
		got <- outcome{l, err}
	}()
	k1, k2 := pglock.AdvisoryKeys(key)
	for i := 0; ; i++ {
		var n int
		err := direct.QueryRow(ctx, `SELECT count(*) FROM pg_locks WHERE locktype = 'advisory' AND NOT granted
  AND objsubid = 2 AND classid = $1::int4::oid AND objid = $2::int4::oid`, k1, k2).Scan(&n)
		if err != nil {
			t.Fatal(err)
		}
		if n == 1 {
			break
		}
		if i == 1000 {
			t.Fatal("the waiter never waited in the server")
		}
		time.Sleep(10 * time.Millisecond)
	}
	proxy.hold()
	if err := holder.Release(ctx, key, held.Token); err != nil {
		t.Fatalf("release: %v", err)
	}
	// The server grants the key to the waiter's session, whose reply is
	// held back; the session goes idle, the server ends it after its
	// idle_session_timeout (1 s), and the key is free again.
	other := newAdvisory(t, direct)
	took := dlock.Request{Key: key, Token: dlock.NewToken(), TTL: time.Minute}
	deadline := time.Now().Add(15 * time.Second)
	for {
		res, err := other.Acquire(ctx, took)
		if err != nil {
			t.Fatal(err)
		}
		if res.Acquired {
			break
		}
		if time.Now().After(deadline) {
			t.Fatal("the waiter's idle session was never ended by the server")
		}
		time.Sleep(50 * time.Millisecond)
	}
	defer other.Release(ctx, key, took.Token)
	proxy.release()
	select {
	case o := <-got:
		if o.err != nil {
			if !errors.Is(o.err, context.DeadlineExceeded) {
				t.Fatalf("acquire: %v", o.err)
			}
			return
		}
		if err := o.lock.Err(); err == nil {
			t.Fatalf("Acquire returned the late grant (fence %d) as held while another client holds the key", o.lock.Fence())
		}
	case <-time.After(3 * time.Second):
		// Still waiting, in the server, behind the new holder: right.
	}
}
