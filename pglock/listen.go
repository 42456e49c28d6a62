package pglock

import (
	"context"
	"encoding/hex"
	"errors"
	"strings"
	"sync"
	"time"

	"github.com/dlock-dev/dlock/internal/ctxend"

	"github.com/dlock-dev/dlock"
	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgconn"
	"github.com/jackc/pgx/v5/pgxpool"
)

// listenIdle is how long the LISTEN connection stays up after its last
// waiter left, so that a busy key does not pay for a new LISTEN per wait.
const listenIdle = 10 * time.Second

// listener holds one connection that LISTENs on the channels of a table's
// configuration, wakes the waiters of the key each release's NOTIFY names,
// and tells the watches of the key each NOTIFY (of either channel) names.
// The connection is opened with the pool's configuration but outside the
// pool, so that it never takes one of the user's connections. It starts on
// the first wait or watch and stops after listenIdle without either, or on
// close.
type listener struct {
	pool    *pgxpool.Pool
	channel string // releases: wakes waiters and watches
	watch   string // other changes: tells watches only

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
	ch     chan struct{} // receives wake-ups (buffered)
	token  string        // hex
	grace  time.Duration // the wait before a wake-up meant for another waiter
	later  *time.Timer   // a pending delayed wake-up; guarded by listener.mu
	handed bool          // a release granted this waiter the key; guarded by listener.mu
}

// listenRun is one connection's life.
type listenRun struct {
	ready   chan struct{} // closed when LISTEN succeeded or failed (err)
	err     error
	cancel  context.CancelFunc
	watches map[string]map[*watch]struct{} // by hex key; guarded by listener.mu
	feeds   map[string]map[*feed]struct{}  // by hex key; guarded by listener.mu
}

// feed is one WatchHolders: the change records of its key that its run's
// connection receives, in the order the server delivers them.
type feed struct {
	hk      string
	run     *listenRun
	wake    chan struct{} // one buffered signal: records came, or the feed ended
	pending []string      // change records not yet taken; guarded by listener.mu
	ended   bool          // the connection ended or the feed was stopped; guarded by listener.mu
}

// watch is one Watch: it sees what its run's connection sees, and is
// closed when that connection ends.
type watch struct {
	ch     chan struct{}
	hk     string
	run    *listenRun
	done   bool        // closed and counted out; guarded by listener.mu
	unhook func() bool // stops the context's AfterFunc; guarded by listener.mu
}

func newListener(pool *pgxpool.Pool, tb tables) *listener {
	return &listener{pool: pool, channel: tb.channel, watch: tb.watch, subs: make(map[string]map[*sub]struct{})}
}

// subscribe returns a channel that receives when key is released (or when
// the listening connection is lost, so that the waiter looks again), a
// function that reports (once) whether a release since the last call said
// it granted the key to token, and a function that ends the subscription.
// A release that names another waiter (the first in the key's queue) wakes
// this one only after grace, and not at all if it granted that waiter the
// key.
func (l *listener) subscribe(key string, token [16]byte, grace time.Duration) (<-chan struct{}, func() bool, func()) {
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
	handed := func() bool {
		l.mu.Lock()
		defer l.mu.Unlock()
		h := s.handed
		s.handed = false
		return h
	}
	return s.ch, handed, func() {
		l.mu.Lock()
		defer l.mu.Unlock()
		if s.later != nil {
			s.later.Stop()
		}
		delete(l.subs[hk], s)
		if len(l.subs[hk]) == 0 {
			delete(l.subs, hk)
		}
		l.leftLocked()
	}
}

// leftLocked counts out a subscription or a watch, and stops the
// connection listenIdle after the last one left. The caller holds l.mu.
func (l *listener) leftLocked() {
	l.n--
	if l.n == 0 && l.run != nil && !l.closed {
		r := l.run
		if l.idle != nil {
			l.idle.Stop()
		}
		l.idle = time.AfterFunc(listenIdle, func() {
			l.mu.Lock()
			stop := l.n == 0 && l.run == r
			if stop {
				// A subscription that comes now starts a new connection
				// rather than join one that is ending.
				l.run = nil
			}
			l.mu.Unlock()
			if stop {
				r.cancel()
			}
		})
	}
}

// watchKey returns a channel that receives after every NOTIFY naming key
// that the server sends once watchKey has returned, closed when ctx ends or
// when the connection ends (it may have missed one). It returns once the
// connection LISTENs, or with an error if it cannot.
func (l *listener) watchKey(ctx context.Context, key string) (<-chan struct{}, error) {
	var w *watch
	err := l.join(ctx, func(r *listenRun) {
		w = &watch{ch: make(chan struct{}, 1), hk: hex.EncodeToString([]byte(key)), run: r}
		if r.watches[w.hk] == nil {
			r.watches[w.hk] = make(map[*watch]struct{})
		}
		r.watches[w.hk][w] = struct{}{}
	})
	if w == nil {
		return nil, err
	}
	l.mu.Lock()
	defer l.mu.Unlock()
	if err != nil {
		l.unwatchLocked(w)
		return nil, err
	}
	if !w.done {
		w.unhook = context.AfterFunc(ctx, func() {
			l.mu.Lock()
			l.unwatchLocked(w)
			l.mu.Unlock()
		})
	}
	return w.ch, nil
}

// unwatchLocked ends w, once. The caller holds l.mu.
func (l *listener) unwatchLocked(w *watch) {
	if w.done {
		return
	}
	w.done = true
	if w.unhook != nil {
		w.unhook()
	}
	ws := w.run.watches[w.hk]
	delete(ws, w)
	if len(ws) == 0 {
		delete(w.run.watches, w.hk)
	}
	close(w.ch)
	l.leftLocked()
}

// feedKey returns a feed of the change records of key that the server
// delivers once feedKey has returned (and maybe some before), ended when ctx
// ends or the connection ends. It returns once the connection LISTENs, or
// with an error if it cannot.
func (l *listener) feedKey(ctx context.Context, key string) (*feed, error) {
	var f *feed
	err := l.join(ctx, func(r *listenRun) {
		f = &feed{hk: hex.EncodeToString([]byte(key)), run: r, wake: make(chan struct{}, 1)}
		if r.feeds[f.hk] == nil {
			r.feeds[f.hk] = make(map[*feed]struct{})
		}
		r.feeds[f.hk][f] = struct{}{}
	})
	if f == nil {
		return nil, err
	}
	if err != nil {
		l.stopFeed(f)
		return nil, err
	}
	return f, nil
}

// join registers a subscriber on the listening connection (starting
// it if needed) with add, called under l.mu, and waits until the
// connection LISTENs or ctx ends. add is not called when ctx has ended or
// the listener is closed. An error after add means the caller must remove
// what add registered.
func (l *listener) join(ctx context.Context, add func(r *listenRun)) error {
	if err := ctxend.Err(ctx); err != nil {
		return err
	}
	l.mu.Lock()
	if l.closed {
		l.mu.Unlock()
		return dlock.ErrClosed
	}
	r := l.startLocked()
	add(r)
	l.n++
	if l.idle != nil {
		l.idle.Stop()
	}
	l.mu.Unlock()
	select {
	case <-r.ready:
		// r.err is written before ready closes: read it only after.
		if r.err != nil {
			return r.err
		}
		return ctxend.Err(ctx)
	case <-ctx.Done():
		return ctx.Err()
	}
}

// take returns f's pending records, and whether f has ended.
func (l *listener) take(f *feed) ([]string, bool) {
	l.mu.Lock()
	defer l.mu.Unlock()
	recs := f.pending
	f.pending = nil
	return recs, f.ended
}

// stopFeed ends f, once.
func (l *listener) stopFeed(f *feed) {
	l.mu.Lock()
	l.unfeedLocked(f)
	l.mu.Unlock()
}

// unfeedLocked ends f, once. The caller holds l.mu.
func (l *listener) unfeedLocked(f *feed) {
	if f.ended {
		return
	}
	f.ended = true
	fs := f.run.feeds[f.hk]
	delete(fs, f)
	if len(fs) == 0 {
		delete(f.run.feeds, f.hk)
	}
	notify(f.wake)
	l.leftLocked()
}

// running reports whether the listening connection is up or starting.
func (l *listener) running() bool {
	l.mu.Lock()
	defer l.mu.Unlock()
	return l.run != nil
}

// ensure makes sure that the connection LISTENs, starting it if needed, and
// returns its error if it could not.
func (l *listener) ensure(ctx context.Context) error {
	l.mu.Lock()
	if l.closed {
		l.mu.Unlock()
		return errListenerClosed
	}
	r := l.startLocked()
	l.mu.Unlock()
	select {
	case <-r.ready:
		return r.err
	case <-ctx.Done():
		return ctx.Err()
	}
}

// startLocked returns the running connection, starting one if there is
// none. The caller holds l.mu.
func (l *listener) startLocked() *listenRun {
	r := l.run
	if r == nil {
		rctx, cancel := context.WithCancel(context.Background())
		r = &listenRun{ready: make(chan struct{}), cancel: cancel, watches: make(map[string]map[*watch]struct{}),
			feeds: make(map[string]map[*feed]struct{})}
		l.run = r
		l.wg.Add(1)
		go l.loop(rctx, r)
	}
	return r
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
		// The connection is idle between notifications: the server must
		// not end it for that (servers before 14 lack the setting).
		_, err = conn.Exec(actx, "SET idle_session_timeout = 0")
		var pe *pgconn.PgError
		if errors.As(err, &pe) && pe.Code == "42704" { // unrecognized configuration parameter
			err = nil
		}
		if err == nil {
			// No arguments: the simple protocol, which runs both statements.
			_, err = conn.Exec(actx, "LISTEN "+pgx.Identifier{l.channel}.Sanitize()+"; LISTEN "+pgx.Identifier{l.watch}.Sanitize())
		}
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
			l.dispatch(r, n.Channel, n.Payload)
		}
	}
	if conn != nil {
		closeConn(conn)
	}
	l.mu.Lock()
	if l.run == r {
		l.run = nil
	}
	// Wake every waiter: they look again and restart the listener. Close
	// every watch of this connection: it may have missed a change.
	for _, m := range l.subs {
		for s := range m {
			notify(s.ch)
		}
	}
	for _, m := range r.watches {
		for w := range m {
			l.unwatchLocked(w)
		}
	}
	for _, m := range r.feeds {
		for f := range m {
			l.unfeedLocked(f)
		}
	}
	l.mu.Unlock()
}

// dispatch wakes the waiters of the key a notification names: the waiter
// it names (or all if it names none) at once, the others their grace after
// this notification. A wake-up pending from an earlier one is put off: the
// key is kept for the named waiter until this grace ends, and a waiter
// woken before that is refused and sleeps another grace.
//
// A notification of either channel tells the key's watches of run r (the
// connection it came on).
//
// A payload is the key in hex, then, for a release, a space and the waiter
// it names (if any), then, for a change of the key's holders, "/" and the
// change's record (see watchholders.go). A release whose record is a grant
// handed the key to the waiter it names. A notification of the watch
// channel without a record is one the key's feeds cannot apply: they get
// an empty record, which ends them.
func (l *listener) dispatch(r *listenRun, channel, payload string) {
	head, change, isChange := strings.Cut(payload, "/")
	hk, first, _ := strings.Cut(head, " ")
	l.mu.Lock()
	defer l.mu.Unlock()
	if r != nil {
		for w := range r.watches[hk] {
			notify(w.ch)
		}
		if isChange || channel != l.channel {
			for f := range r.feeds[hk] {
				f.pending = append(f.pending, change)
				notify(f.wake)
			}
		}
	}
	if channel != l.channel {
		return
	}
	// A release that granted the key to the waiter it names (a grant
	// record) leaves nothing for the key's other waiters.
	_, kind, _ := strings.Cut(change, " ")
	handoff := first != "" && isChange && strings.HasPrefix(kind, "g ")
	for s := range l.subs[hk] {
		switch {
		case handoff && s.token != first:
		case handoff:
			s.handed = true
			notify(s.ch)
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
