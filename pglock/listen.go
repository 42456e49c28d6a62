package pglock

import (
	"context"
	"encoding/hex"
	"strings"
	"sync"
	"time"

	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgxpool"
)

// listenIdle is how long the LISTEN connection stays up after its last
// waiter left, so that a busy key does not pay for a new LISTEN per wait.
const listenIdle = 10 * time.Second

// listener holds one connection that LISTENs on the Backend's channel, and
// wakes the waiters of the key each NOTIFY names. The connection is opened
// with the pool's configuration but outside the pool, so that it never takes
// one of the user's connections. It starts on the first wait and stops after
// listenIdle without waiters, or on close.
type listener struct {
	pool    *pgxpool.Pool
	channel string

	mu     sync.Mutex
	subs   map[string]map[*sub]struct{} // by hex key
	n      int                          // subscriptions
	run    *listenRun                   // the running connection, or nil
	idle   *time.Timer                  // stops run after listenIdle
	closed bool
	wg     sync.WaitGroup
}

// sub is one waiting acquisition.
type sub struct {
	ch    chan struct{} // receives wake-ups (buffered)
	token string        // hex
	grace time.Duration // the wait before a wake-up meant for another waiter
	later *time.Timer   // a pending delayed wake-up; guarded by listener.mu
}

// listenRun is one connection's life.
type listenRun struct {
	ready  chan struct{} // closed when LISTEN succeeded or failed (err)
	err    error
	cancel context.CancelFunc
}

func newListener(pool *pgxpool.Pool, channel string) *listener {
	return &listener{pool: pool, channel: channel, subs: make(map[string]map[*sub]struct{})}
}

// subscribe returns a channel that receives when key is released (or when
// the listening connection is lost, so that the waiter looks again), and a
// function that ends the subscription. A release that names another waiter
// (the first in the key's queue) wakes this one only after grace.
func (l *listener) subscribe(key string, token [16]byte, grace time.Duration) (<-chan struct{}, func()) {
	hk := hex.EncodeToString([]byte(key))
	s := &sub{ch: make(chan struct{}, 1), token: hex.EncodeToString(token[:]), grace: grace}
	l.mu.Lock()
	if l.subs[hk] == nil {
		l.subs[hk] = make(map[*sub]struct{})
	}
	l.subs[hk][s] = struct{}{}
	l.n++
	if l.idle != nil {
		l.idle.Stop()
	}
	l.mu.Unlock()
	return s.ch, func() {
		l.mu.Lock()
		defer l.mu.Unlock()
		if s.later != nil {
			s.later.Stop()
		}
		delete(l.subs[hk], s)
		if len(l.subs[hk]) == 0 {
			delete(l.subs, hk)
		}
		l.n--
		if l.n == 0 && l.run != nil && !l.closed {
			r := l.run
			if l.idle != nil {
				l.idle.Stop()
			}
			l.idle = time.AfterFunc(listenIdle, func() {
				l.mu.Lock()
				stop := l.n == 0 && l.run == r
				l.mu.Unlock()
				if stop {
					r.cancel()
				}
			})
		}
	}
}

// ensure makes sure that the connection LISTENs, starting it if needed, and
// returns its error if it could not.
func (l *listener) ensure(ctx context.Context) error {
	l.mu.Lock()
	if l.closed {
		l.mu.Unlock()
		return errListenerClosed
	}
	r := l.run
	if r == nil {
		rctx, cancel := context.WithCancel(context.Background())
		r = &listenRun{ready: make(chan struct{}), cancel: cancel}
		l.run = r
		l.wg.Add(1)
		go l.loop(rctx, r)
	}
	l.mu.Unlock()
	select {
	case <-r.ready:
		return r.err
	case <-ctx.Done():
		return ctx.Err()
	}
}

type listenerError string

func (e listenerError) Error() string { return string(e) }

const errListenerClosed = listenerError("pglock: backend closed")

// loop runs one listening connection until it fails or is cancelled.
func (l *listener) loop(ctx context.Context, r *listenRun) {
	defer l.wg.Done()
	defer r.cancel()
	conn, err := dial(ctx, l.pool)
	if err == nil {
		actx, cancel := context.WithTimeout(ctx, 10*time.Second)
		_, err = conn.Exec(actx, "LISTEN "+pgx.Identifier{l.channel}.Sanitize())
		cancel()
	}
	r.err = err
	close(r.ready)
	if err == nil {
		for {
			n, err := conn.WaitForNotification(ctx)
			if err != nil {
				break
			}
			l.dispatch(n.Payload)
		}
	}
	if conn != nil {
		closeConn(conn)
	}
	l.mu.Lock()
	if l.run == r {
		l.run = nil
	}
	// Wake every waiter: they look again and restart the listener.
	for _, m := range l.subs {
		for s := range m {
			notify(s.ch)
		}
	}
	l.mu.Unlock()
}

// dispatch wakes the waiters of the key a notification names: the waiter
// it names (or all if it names none) at once, the others their grace after
// this notification. A wake-up pending from an earlier one is put off: the
// key is kept for the named waiter until this grace ends, and a waiter
// woken before that is refused and sleeps another grace.
func (l *listener) dispatch(payload string) {
	hk, first, _ := strings.Cut(payload, " ")
	l.mu.Lock()
	defer l.mu.Unlock()
	for s := range l.subs[hk] {
		switch {
		case first == "" || s.token == first || s.grace <= 0:
			notify(s.ch)
		case s.later != nil:
			s.later.Reset(s.grace)
		default:
			ch := s.ch
			s.later = time.AfterFunc(s.grace, func() {
				notify(ch)
				l.mu.Lock()
				s.later = nil
				l.mu.Unlock()
			})
		}
	}
}

func notify(ch chan struct{}) {
	select {
	case ch <- struct{}{}:
	default:
	}
}

// close stops the listener for good.
func (l *listener) close() {
	l.mu.Lock()
	l.closed = true
	if l.idle != nil {
		l.idle.Stop()
	}
	r := l.run
	l.mu.Unlock()
	if r != nil {
		r.cancel()
	}
	l.wg.Wait()
}
