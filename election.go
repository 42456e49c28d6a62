package dlock

import (
	"context"
	"errors"
	"fmt"
	"time"
)

// ErrNoLeader is returned by Election.Leader when nobody leads.
var ErrNoLeader = errors.New("dlock: no leader")

// An Election chooses one leader at a time among the processes that
// campaign on its key, each through its own Locker. A term is an exclusive
// lock of the key: it has the lock's lease, renewal, loss notice and fence,
// so a term's fence is strictly greater than every earlier term's, and a
// resource that checks fences refuses a deposed leader. The leader's value
// (an address, say) is the lock's metadata, which every process can read
// (Leader) and follow (Observe). Its methods are safe for concurrent use.
type Election struct {
	l   *Locker
	key string
}

// NewElection returns the election held on key through l. The key is
// checked at each call (ErrInvalidKey).
func NewElection(l *Locker, key string) *Election { return &Election{l: l, key: key} }

// Leader describes a term: who leads, as far as the store tells.
type Leader struct {
	Value     string    // the value the leader published (Campaign, Proclaim)
	Fence     uint64    // the term's fence; 0 in Observe's report that nobody leads
	Since     time.Time // when the term began, as the store reports it
	ExpiresAt time.Time // the end of the leader's current lease, if the store has one
}

// A Term is one leadership: the Lock of the election's key (Fence, Done,
// Err, Context and Deadline mean what they mean for a Lock; Release ends
// the term, as Resign does).
type Term struct {
	*Lock
}

// Campaign waits until this process leads, or ctx ends (then an error
// matching ErrNotAcquired), and returns the term. value is published as
// the leader's value (except by a Campaign that joins the term its owner
// holds, see Term.Value): at most MaxMetadataLen bytes of UTF-8 without
// NUL. opts may set the lease (WithTTL), an owner or a minimum hold; a mode
// other than exclusive is ErrInvalidOption. Waiting is the Locker's: woken
// by the store's release where it can tell.
func (e *Election) Campaign(ctx context.Context, value string, opts ...AcquireOption) (*Term, error) {
	var asked acquireConfig
	for _, o := range opts {
		o(&asked)
	}
	if asked.mode() != ModeExclusive {
		return nil, fmt.Errorf("%w: an election's terms are exclusive", ErrInvalidOption)
	}
	if _, err := e.l.config(e.key, opts); err != nil {
		return nil, err
	}
	if err := validateText("value", value, MaxMetadataLen); err != nil {
		return nil, err
	}
	lk, err := e.l.Acquire(ctx, e.key, append(opts[:len(opts):len(opts)], WithMetadata(value))...)
	if err != nil {
		return nil, err
	}
	return &Term{Lock: lk}, nil
}

// Resign ends the term (Lock.Release).
func (t *Term) Resign(ctx context.Context) error { return t.Release(ctx) }

// Value returns the value the term last published: Campaign's, or the
// last Proclaim's. A Campaign that joined a term its owner held already
// (WithOwner) publishes nothing: its Term shares the term's value.
func (t *Term) Value() string {
	t.l.mu.Lock()
	defer t.l.mu.Unlock()
	return t.ls.meta
}

// Proclaim publishes value as the leader's value while the term lasts. It
// returns an error matching ErrNotHeld if the term has ended (nothing is
// changed), ErrUnsupported if the store cannot change a lease's metadata
// (dlock.MetadataSetter), ErrInvalidOption for a value Campaign would
// refuse, or the store's error (the value may or may not have changed).
func (t *Term) Proclaim(ctx context.Context, value string) error {
	ms, ok := t.l.b.(MetadataSetter)
	if !ok {
		return fmt.Errorf("%w: the store cannot change a leader's value", ErrUnsupported)
	}
	if err := validateText("value", value, MaxMetadataLen); err != nil {
		return err
	}
	if err := t.Err(); err != nil {
		return fmt.Errorf("%w: %w", ErrNotHeld, err)
	}
	_, err := storeCall(t.l, ctx, func() (struct{}, error) {
		return struct{}{}, ms.SetMetadata(ctx, t.ls.key, t.ls.token, value)
	})
	if err != nil {
		return fmt.Errorf("dlock: proclaim %q: %w", t.ls.key, err)
	}
	t.l.mu.Lock()
	t.ls.meta = value
	t.l.mu.Unlock()
	return nil
}

// Leader returns the current leader, or ErrNoLeader. It needs a store that
// lists holders (dlock.Lister; otherwise ErrUnsupported).
func (e *Election) Leader(ctx context.Context) (Leader, error) {
	if err := ValidateKey(e.key); err != nil {
		return Leader{}, err
	}
	lister, ok := e.l.b.(Lister)
	if !ok {
		return Leader{}, fmt.Errorf("%w: the store cannot list holders", ErrUnsupported)
	}
	infos, err := storeCall(e.l, ctx, func() ([]LockInfo, error) { return lister.List(ctx, e.key) })
	if err != nil {
		return Leader{}, fmt.Errorf("dlock: leader of %q: %w", e.key, err)
	}
	ld := e.leaderOf(infos)
	if ld.Fence == 0 {
		return Leader{}, ErrNoLeader
	}
	return ld, nil
}

// leaderOf returns the leader among infos (the exclusive holder of the
// election's key with the greatest fence), or a Leader with Fence 0.
func (e *Election) leaderOf(infos []LockInfo) Leader {
	var best *LockInfo
	for i, in := range infos {
		if in.Key == e.key && in.Mode == ModeExclusive && (best == nil || in.Fence > best.Fence) {
			best = &infos[i]
		}
	}
	if best == nil {
		return Leader{}
	}
	return Leader{Value: best.Metadata, Fence: best.Fence, Since: best.AcquiredAt, ExpiresAt: best.ExpiresAt}
}

// Observe reports the election's leader on the returned channel: first the
// current one (a Leader with Fence 0 when nobody leads), then every change
// it sees of the leader or its value, until ctx ends or the Locker closes
// (then the channel is closed). For an invalid key, or on a store that
// cannot list holders (dlock.Lister), the channel is closed at once. A new
// term is reported only with a fence greater than every term reported
// before, so a report never goes back to an earlier leader.
// On a store that delivers every change in order (dlock.HolderWatcher:
// etcd, PostgreSQL, Redis except Redlock, MySQL's lease strategy, SQLite
// and ZooKeeper through a change journal, and memlock) every term and
// every value is reported, however short, while the store's watch lasts
// (a broken watch is started again, and what changed meanwhile is seen as
// at that instant). Elsewhere Observe
// reads again when the store notifies a change (dlock.Watcher) or, on a
// store that cannot notify, after a backoff of up to a second, and when the
// leader's lease is due to end: terms that begin and end between two reads
// are not seen, and of values changed in quick succession the last is.
// Store errors are retried with backoff. The channel is unbuffered: a slow
// reader delays the next read.
func (e *Election) Observe(ctx context.Context) <-chan Leader {
	out := make(chan Leader)
	go e.observe(ctx, out)
	return out
}

// observed is what an Observe has reported.
type observed struct {
	out       chan<- Leader
	lastFence uint64 // of the newest term reported
	lastValue string
	none      bool // the last report said nobody leads
	sent      bool
}

// report sends cur if it is news: the first report, a newer term, a new
// value of the reported term, or that nobody leads after a leader. It
// returns whether it sent, and false for ok when ctx ended first.
func (o *observed) report(ctx context.Context, cur Leader) (sent, ok bool) {
	var news bool
	switch {
	case !o.sent:
		news = true
	case cur.Fence == 0:
		news = !o.none
	case cur.Fence > o.lastFence:
		news = true
	case cur.Fence == o.lastFence:
		news = !o.none && cur.Value != o.lastValue
	}
	if !news {
		return false, true
	}
	select {
	case o.out <- cur:
	case <-ctx.Done():
		return false, false
	}
	o.sent, o.none = true, cur.Fence == 0
	if !o.none {
		o.lastFence, o.lastValue = cur.Fence, cur.Value
	}
	return true, true
}

func (e *Election) observe(ctx context.Context, out chan<- Leader) {
	defer close(out)
	if ValidateKey(e.key) != nil {
		return
	}
	o := &observed{out: out}
	if hw, ok := e.l.b.(HolderWatcher); ok {
		if !e.followChanges(ctx, o, hw) {
			return
		}
	}
	watcher, canWatch := e.l.b.(Watcher)
	var (
		changes <-chan struct{}
		stop    = func() {}
		bo      Backoff
		poll    = 50 * time.Millisecond
	)
	defer func() { stop() }()
	for ctx.Err() == nil {
		if canWatch && changes == nil {
			stop()
			wctx, cancel := context.WithCancel(ctx)
			stop = cancel
			ch, err := watcher.Watch(wctx, e.key)
			switch {
			case errors.Is(err, ErrUnsupported):
				canWatch = false
			case err != nil:
				// Read all the same, and look again after a backoff.
				e.l.log.Debug("dlock: watch of an election failed", "key", e.key, "err", err)
			default:
				changes = ch
			}
		}
		cur, err := e.read(ctx, &bo)
		if errors.Is(err, ErrClosed) || errors.Is(err, ErrUnsupported) || ctx.Err() != nil {
			return
		}
		if err != nil {
			continue
		}
		sent, ok := o.report(ctx, cur)
		if !ok {
			return
		}
		if sent {
			poll = 50 * time.Millisecond
		}
		if !e.waitChange(ctx, cur, &changes, poll) {
			return
		}
		poll = min(2*poll, time.Second)
	}
}

// read returns the current leader (Fence 0 when nobody leads). After a
// store error other than ErrClosed it sleeps a backoff (or until ctx
// ends) and returns the error.
func (e *Election) read(ctx context.Context, bo *Backoff) (Leader, error) {
	cur, err := e.Leader(ctx)
	switch {
	case errors.Is(err, ErrNoLeader):
		return Leader{}, nil
	case errors.Is(err, ErrClosed), errors.Is(err, ErrUnsupported):
		return Leader{}, err
	case err != nil:
		e.l.log.Debug("dlock: election leader read failed", "key", e.key, "err", err)
		_ = e.l.sleep(ctx, bo.Next(0), nil)
		return Leader{}, err
	}
	*bo = Backoff{}
	return cur, nil
}

// followChanges observes through hw's ordered changes until ctx ends (false)
// or hw turns out not to watch (true: the caller observes otherwise).
func (e *Election) followChanges(ctx context.Context, o *observed, hw HolderWatcher) bool {
	var bo Backoff
	for ctx.Err() == nil {
		if e.l.isClosed() {
			return false
		}
		wctx, cancel := context.WithCancel(ctx)
		now, ch, err := hw.WatchHolders(wctx, e.key)
		switch {
		case errors.Is(err, ErrUnsupported):
			cancel()
			return true
		case err != nil:
			cancel()
			e.l.log.Debug("dlock: watch of an election failed", "key", e.key, "err", err)
			if e.l.sleep(ctx, bo.Next(0), nil) != nil {
				return false
			}
			continue
		}
		bo = Backoff{}
		ok := e.follow(wctx, o, e.leaderOf(now), ch)
		cancel()
		if !ok {
			return false
		}
	}
	return false
}

// follow reports cur and then the leader after each change ch delivers,
// until ch closes (true: watch anew) or ctx ends (false). A store that does
// not report expiries gives leases an ExpiresAt: when it passes, the key is
// read again.
func (e *Election) follow(ctx context.Context, o *observed, cur Leader, ch <-chan []LockInfo) bool {
	poll := 50 * time.Millisecond
	var bo Backoff
	timer := time.NewTimer(time.Hour)
	defer timer.Stop()
	for {
		sent, ok := o.report(ctx, cur)
		if !ok {
			return false
		}
		if sent {
			poll = 50 * time.Millisecond
		}
		var due <-chan time.Time
		if !cur.ExpiresAt.IsZero() {
			timer.Reset(max(time.Until(cur.ExpiresAt)+50*time.Millisecond, poll))
			due = timer.C
		}
		select {
		case infos, open := <-ch:
			if !open {
				return ctx.Err() == nil
			}
			cur = e.leaderOf(infos)
		case <-due:
			read, err := e.read(ctx, &bo)
			if errors.Is(err, ErrClosed) || ctx.Err() != nil {
				return false
			}
			// The read tells whether cur's lease ended (and what it was
			// extended to). A later term it shows is left to ch, which
			// delivers it after the terms between, unreported so far.
			if err == nil && read.Fence <= cur.Fence {
				cur = read
			}
			poll = min(2*poll, time.Second)
		case <-ctx.Done():
			return false
		}
		timer.Stop()
	}
}

// waitChange waits for the store's notice of a change (a closed watch
// clears *changes), the end of cur's lease (not sooner than poll, which
// grows while nothing changes, so that a listing whose expiry stays in the
// past does not make a busy loop), a poll of poll when there is no watch,
// or ctx; it reports whether ctx is still live.
func (e *Election) waitChange(ctx context.Context, cur Leader, changes *<-chan struct{}, poll time.Duration) bool {
	var due, tick <-chan time.Time
	if !cur.ExpiresAt.IsZero() {
		t := time.NewTimer(max(time.Until(cur.ExpiresAt)+50*time.Millisecond, poll))
		defer t.Stop()
		due = t.C
	}
	if *changes == nil {
		t := time.NewTimer(poll)
		defer t.Stop()
		tick = t.C
	}
	select {
	case _, open := <-*changes:
		if !open {
			*changes = nil
		}
	case <-due:
	case <-tick:
	case <-ctx.Done():
		return false
	}
	return true
}

// storeCall runs call as await does, counted by Close: it returns by ctx's
// end whatever the store does, and ErrClosed after Close.
func storeCall[T any](l *Locker, ctx context.Context, call func() (T, error)) (T, error) {
	l.mu.Lock()
	if l.closed {
		l.mu.Unlock()
		var zero T
		return zero, ErrClosed
	}
	l.wg.Add(1)
	l.mu.Unlock()
	v, err := await(l, ctx, call, nil)
	if errors.Is(err, errAbandoned) {
		err = ctx.Err()
	}
	return v, err
}
