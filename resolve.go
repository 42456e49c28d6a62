package dlock

import (
	"context"
	"errors"
	"time"
)

// An acquisition of unknown outcome (the store call failed, or its caller
// left before it answered) may have taken a lease that nobody holds. The
// statement that failed for the caller may still be on its way to the store
// (a cut connection, a proxy): a release that finds nothing does not prove
// it will never land. So the Locker releases the acquisition's token, and
// looks again with a growing backoff, until the lease it could have
// started has run out, or the Locker closes (then it looks once more). One
// goroutine serves every such acquisition, with at most maxResolving
// releases in flight, so that a burst of cancelled calls costs an entry
// each, not a goroutine and a poll each for a whole TTL.

// unresolved is an acquisition of unknown outcome.
type unresolved struct {
	req   Request
	until time.Time     // when the lease it could have started has run out
	next  time.Time     // when to look next
	wait  time.Duration // the backoff after the next look
	busy  bool          // its release is in flight
}

// maxResolving bounds the releases of unresolved acquisitions in flight.
const maxResolving = 8

// resolveBackoff is the longest wait between two looks at an acquisition
// of ttl: the backoff doubles from 50 ms up to it.
func resolveBackoff(ttl time.Duration) time.Duration { return max(time.Second, ttl/8) }

// resolve queues req for release (see above) and starts the resolver if it
// is not running. Its caller holds l.wg, so Close waits for the resolver.
// A granted req (known to be held for nobody) goes to the front of the
// queue, which the resolver serves in order: a backlog of acquisitions of
// unknown outcome (a burst of cut calls) does not delay its release.
func (l *Locker) resolve(req Request, granted bool) {
	now := time.Now()
	u := &unresolved{req: req, until: now.Add(req.TTL), next: now, wait: 50 * time.Millisecond}
	l.mu.Lock()
	if granted {
		l.unresolved = append([]*unresolved{u}, l.unresolved...)
	} else {
		l.unresolved = append(l.unresolved, u)
	}
	start := !l.resolving
	if start {
		l.resolving = true
		l.wg.Add(1)
	}
	l.mu.Unlock()
	if start {
		go l.resolveLoop()
		return
	}
	select {
	case l.resolveKick <- struct{}{}:
	default:
	}
}

// resolved is the outcome of one look at an unresolved acquisition.
type resolved struct {
	u   *unresolved
	err error
}

// resolveLoop releases the unresolved acquisitions' tokens until none is
// left.
func (l *Locker) resolveLoop() {
	defer l.wg.Done()
	results := make(chan resolved, maxResolving)
	inFlight := 0
	closing := l.closing
	t := time.NewTimer(time.Hour)
	defer t.Stop()
	for {
		now := time.Now()
		l.mu.Lock()
		if closing == nil { // closed: one more look at each, then stop
			for _, u := range l.unresolved {
				u.until, u.next = now, now
			}
		}
		next := time.Time{}
		for _, u := range l.unresolved {
			switch {
			case u.busy:
			case !u.next.After(now):
				if inFlight == maxResolving {
					break // a result frees a slot
				}
				u.busy = true
				inFlight++
				go func() {
					ctx, cancel := context.WithTimeout(context.Background(), cleanupTimeout)
					err := l.b.Release(ctx, u.req.Key, u.req.Token)
					cancel()
					results <- resolved{u, err}
				}()
			case next.IsZero() || u.next.Before(next):
				next = u.next
			}
		}
		if len(l.unresolved) == 0 {
			l.resolving = false
			l.mu.Unlock()
			return
		}
		l.mu.Unlock()
		if !next.IsZero() {
			t.Reset(max(time.Until(next), 0))
		}
		select {
		case r := <-results:
			inFlight--
			l.settleUnresolved(r)
		case <-t.C:
		case <-l.resolveKick:
		case <-closing:
			closing = nil
		}
		if !t.Stop() {
			select {
			case <-t.C:
			default:
			}
		}
	}
}

// settleUnresolved records the outcome of a look at an unresolved acquisition: done
// once its token is released, or once the lease it could have started has
// run out; else it is looked at again after its backoff.
func (l *Locker) settleUnresolved(r resolved) {
	u, now := r.u, time.Now()
	done := true
	switch {
	case r.err == nil:
		l.log.Warn("dlock: released a lease taken by an acquisition that reported an error", "key", u.req.Key)
	case !now.Before(u.until):
		if !errors.Is(r.err, ErrNotHeld) {
			l.log.Warn("dlock: could not resolve an acquisition of unknown outcome; it expires with its TTL",
				"key", u.req.Key, "ttl", u.req.TTL, "err", r.err)
		}
	default:
		if !errors.Is(r.err, ErrNotHeld) {
			l.log.Debug("dlock: could not yet resolve an acquisition of unknown outcome", "key", u.req.Key, "err", r.err)
		}
		done = false
	}
	l.mu.Lock()
	defer l.mu.Unlock()
	u.busy = false
	if !done {
		u.next = now.Add(min(u.wait, u.until.Sub(now)))
		u.wait = min(2*u.wait, resolveBackoff(u.req.TTL))
		return
	}
	for i, v := range l.unresolved {
		if v == u {
			l.unresolved = append(l.unresolved[:i], l.unresolved[i+1:]...)
			break
		}
	}
}
