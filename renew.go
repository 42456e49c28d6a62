package dlock

// The renewal engine: leases the Locker holds, their renewal in batches,
// their safe deadlines and the report of their loss.

import (
	"context"
	"errors"
	"fmt"
	"time"
)

// register records a lease the backend granted at sent, and schedules its
// renewal and its deadline.
// The store's lease is the holder's TTL plus the lock-delay (req.TTL);
// the holder times its own from the TTL alone (a LockDelayer's session
// times out after the TTL alone too).
func (l *Locker) register(ctx context.Context, req Request, fence uint64, sent time.Time, minHold, delay time.Duration) (*Lock, error) {
	ttl := req.TTL - delay
	margin := l.marginFor(ttl)
	ls := &lease{
		key: req.Key, owner: req.Owner, meta: req.Metadata, token: req.Token, fence: fence,
		mode: req.Mode, limit: req.Limit, ttl: ttl, margin: margin, acquiredAt: sent,
		grantRTT: max(l.clock.Now().Sub(sent), 0), minHold: minHold, delay: delay,
		handles:  make(map[*Lock]struct{}),
		renewAt:  sent.Add(ttl / 3),
		deadline: sent.Add(ttl - margin),
	}
	l.mu.Lock()
	if l.closed || !l.clock.Now().Before(ls.deadline) {
		err := ErrClosed
		if !l.closed {
			err = errTooLate
		}
		l.mu.Unlock()
		l.resolveLater(ctx, req)
		return nil, err
	}
	if old := l.held[req.Key]; old != nil && req.Mode == ModeExclusive {
		// The store granted a key this Locker already holds: a broken
		// backend. Refuse rather than hand out two Locks.
		l.mu.Unlock()
		l.resolveLater(ctx, req)
		return nil, fmt.Errorf("dlock: backend granted %q twice to one Locker", req.Key)
	}
	if _, ok := l.early[req.Token]; ok {
		// The backend reported the grant's session lost before the grant
		// got here: it is not held, whatever the grant said.
		delete(l.early, req.Token)
		l.mu.Unlock()
		l.resolveLater(ctx, req)
		return nil, errLostEarly
	}
	k := l.newHandleLocked(ls)
	ls.timer = l.clock.AfterFunc(ls.deadline.Sub(l.clock.Now()), func() { l.expire(ls) })
	if req.Mode == ModeExclusive {
		l.held[req.Key] = ls
	} else {
		l.shares[req.Key] = append(l.shares[req.Key], ls)
	}
	// The renewal goroutine looks again at wakeAt: wake it only when the
	// new lease falls due before that (every wake-up is a hand-off between
	// goroutines, a fifth of an uncontended Redis acquisition's time).
	poke := !ls.renewAt.After(l.wakeAt)
	if !l.renewing {
		l.renewing, poke = true, false
		l.wg.Add(1)
		go l.renewLoop()
	}
	l.mu.Unlock()
	if poke {
		l.poke()
	}
	return k, nil
}

func (l *Locker) poke() {
	select {
	case l.kick <- struct{}{}:
	default:
	}
}

// checkDeadlineLocked reports the loss of a lease whose safe deadline has
// passed, whether or not its timer has run.
func (l *Locker) checkDeadlineLocked(ls *lease) {
	if !ls.ended && ls.timer != nil && !l.clock.Now().Before(ls.deadline) {
		l.loseLocked(ls, deadlineCause(ls), deadlineLoss(ls), true)
	}
}

// expire runs when a lease's deadline timer fires.
func (l *Locker) expire(ls *lease) {
	defer l.emitLosses()
	l.mu.Lock()
	defer l.mu.Unlock()
	if ls.ended {
		return
	}
	if d := ls.deadline.Sub(l.clock.Now()); d > 0 { // renewed after the timer fired
		ls.timer.Reset(d)
		return
	}
	l.loseLocked(ls, deadlineCause(ls), deadlineLoss(ls), true)
}

// deadlineLoss is the loss of a lease whose renewal was not confirmed by its
// safe deadline (sent + TTL − margin).
func deadlineLoss(ls *lease) error {
	return fmt.Errorf("%w: %q: renewal not confirmed within ttl %s minus margin %s", ErrLockLost, ls.key, ls.ttl, ls.margin)
}

// deadlineCause is why a lease whose safe deadline passed was lost: its
// last renewals failed, or none was confirmed in time.
func deadlineCause(ls *lease) LossCause {
	if ls.tries > 0 {
		return LossStoreError
	}
	return LossExpired
}

// loseLocked ends a lease that is no longer held, for the Observer's why.
// If the store may still hold it for us, it is released in the background
// so that others need not wait for its TTL. The caller defers emitLosses.
func (l *Locker) loseLocked(ls *lease, why LossCause, cause error, release bool) {
	l.log.Warn("dlock: lock lost", "key", ls.key, "fence", ls.fence, "err", cause)
	l.queueLossLocked(ls, why, cause)
	l.endLocked(ls, cause)
	// A minimum hold keeps the lease to its end, and so does a lock-delay:
	// the key stays from others for the delay after the holder is told. A
	// LockDelayer keeps the delay itself: its lock is abandoned, not
	// released (a session lock would otherwise stay held by a session
	// that other locks keep alive).
	if !release || l.closed || l.keepFor(ls) > 0 {
		return
	}
	end := l.b.Release
	if ls.delay > 0 {
		d, ok := l.b.(LockDelayer)
		if !ok {
			return
		}
		end = d.Abandon
	}
	l.wg.Add(1)
	go func() {
		defer l.wg.Done()
		ctx, cancel := context.WithTimeout(l.bg, cleanupTimeout)
		defer cancel()
		_ = end(ctx, ls.key, ls.token)
	}()
}

// endLocked ends a lease and all its Locks with err.
func (l *Locker) endLocked(ls *lease, err error) {
	ls.ended = true
	if ls.timer != nil {
		ls.timer.Stop()
	}
	for k := range ls.handles {
		k.endLocked(err)
	}
	clear(ls.handles)
	l.dropLocked(ls)
	l.wakeLocked(ls.key)
}

// maxBatch bounds the leases renewed by one Backend.Extend call, unless
// the backend sets its own bound (BatchExtender).
const maxBatch = 1000

// extendBatch is the bound on the leases of one Extend call to b.
func extendBatch(b Backend) int {
	if be, ok := b.(BatchExtender); ok && be.ExtendBatch() > 0 {
		return be.ExtendBatch()
	}
	return maxBatch
}

// renewLinger is how long the renewal goroutine stays once the Locker holds
// nothing, so that a Locker that acquires and releases in turn does not
// start one per acquisition.
const renewLinger = 10 * time.Second

// renewLoop renews due leases in batches. It runs while the Locker holds
// anything, and exits when it is closed or has held nothing for
// l.linger.
func (l *Locker) renewLoop() {
	defer l.wg.Done()
	t := l.clock.AfterFunc(time.Hour, l.poke)
	defer t.Stop()
	var idleSince time.Time
	for {
		l.mu.Lock()
		now := l.clock.Now()
		next := now.Add(time.Hour)
		if l.holdsNothingLocked() {
			if idleSince.IsZero() {
				idleSince = now
			}
			next = idleSince.Add(l.linger)
		} else {
			idleSince = time.Time{}
		}
		if l.closed || !idleSince.IsZero() && !now.Before(next) {
			l.renewing, l.wakeAt = false, time.Time{}
			l.mu.Unlock()
			return
		}
		// Renew what falls due soon together with what is due now, so
		// that leases taken at similar times share a round trip; only
		// when something is due now: a look made for another reason (a
		// renewal's answer, a new lease) would otherwise take the few
		// leases that just came within the window, and renewals would
		// split into ever smaller calls. A lease retrying after a failed
		// renewal waits for its own instant: the window would turn its
		// backoff into a burst.
		dueNow := false
		for ls := range l.eachLeaseLocked {
			if !ls.inflight && !ls.renewAt.After(now) {
				dueNow = true
				break
			}
		}
		var batch []*lease
		for ls := range l.eachLeaseLocked {
			if ls.inflight {
				continue
			}
			due := dueNow && ls.renewAt.Sub(now) <= ls.ttl/6
			if ls.tries > 0 {
				due = !ls.renewAt.After(now)
			}
			if due {
				ls.inflight, ls.renewed = true, make(chan struct{})
				batch = append(batch, ls)
				if len(batch) == l.batch {
					l.wg.Add(1)
					go l.renew(batch)
					batch = nil
				}
			} else if ls.renewAt.Before(next) {
				next = ls.renewAt
			}
		}
		if len(batch) > 0 {
			l.wg.Add(1)
			go l.renew(batch)
		}
		l.wakeAt = next
		l.mu.Unlock()

		t.Reset(next.Sub(l.clock.Now()))
		select {
		case <-l.kick:
		case <-l.closing:
		}
	}
}

// renewGrace is how long a renewal call may run past the earliest deadline
// of its batch, so that the deadline timer reports the loss before the
// call's context ends. Ending the call at the deadline itself raced the
// timer: a session strategy's driver closes the connection when a
// statement's context ends, the server then frees the lock at once, and a
// waiter could hold it before Done closed (the fault harness saw a holder
// told 0.1 ms late). The timer runs on the Locker's Clock and the call's
// bound on real time: with the real clock the holder is told a quarter of
// the margin before the call can end; a test Clock must drift less than that
// over a lease. A late renewal cannot revive a lease: backends extend only
// unexpired leases, and the Locker ignores the answer once it reported the
// loss. Leases renewed in one call on one session (getlock) share the call's
// bound: when the earliest one's deadline ends it, the others' session may
// end too, before their own deadlines tell them (the session strategies'
// documented gap).
func renewGrace(margin time.Duration) time.Duration { return max(margin/4, 10*time.Millisecond) }

// renew extends a batch of leases in one backend call, bounded by the
// earliest deadline among them plus renewGrace.
func (l *Locker) renew(batch []*lease) {
	defer l.wg.Done()
	leases := make([]Lease, len(batch))
	l.mu.Lock()
	deadline, margin := batch[0].deadline, batch[0].margin
	for i, ls := range batch {
		leases[i] = Lease{Key: ls.key, Token: ls.token, TTL: ls.ttl + ls.delay}
		if ls.deadline.Before(deadline) {
			deadline, margin = ls.deadline, ls.margin
		}
	}
	l.mu.Unlock()

	sent := l.clock.Now()
	ctx, cancel := context.WithTimeout(l.bg, deadline.Sub(sent)+renewGrace(margin))
	errs, err := l.b.Extend(ctx, leases)
	cancel()
	if err == nil && len(errs) != len(leases) {
		err = fmt.Errorf("dlock: backend returned %d results for %d leases", len(errs), len(leases))
	}

	defer l.emitLosses()
	var renewed []Renewal // for the Observer, told once mu is released
	l.mu.Lock()
	now := l.clock.Now()
	for i, ls := range batch {
		ls.inflight = false
		close(ls.renewed)
		ls.renewed = nil
		if ls.ended {
			continue
		}
		switch {
		case err == nil && errs[i] == nil && !now.Before(ls.deadline):
			// Confirmed after the deadline: the holder has been (or is
			// about to be) told of the loss; a late answer never revives.
			l.loseLocked(ls, LossExpired, deadlineLoss(ls), true)
		case err == nil && errs[i] == nil:
			if l.obs != nil {
				renewed = append(renewed, Renewal{Key: ls.key, Mode: ls.mode, Fence: ls.fence, Lead: ls.deadline.Sub(now)})
			}
			ls.tries = 0
			ls.renewAt = sent.Add(ls.ttl / 3)
			ls.deadline = sent.Add(ls.ttl - ls.margin)
			ls.timer.Reset(ls.deadline.Sub(now))
		case err == nil && errors.Is(errs[i], ErrNotHeld):
			l.loseLocked(ls, LossNotHeld, fmt.Errorf("%w: %q: the store no longer holds it for us: %w", ErrLockLost, ls.key, errs[i]), false)
		default:
			cause := err
			if cause == nil {
				cause = errs[i]
			}
			if !now.Before(ls.deadline) { // no time left to retry in
				l.loseLocked(ls, LossStoreError, fmt.Errorf("%w: %w", deadlineLoss(ls), cause), true)
				continue
			}
			// Retry soon, but keep trying until the deadline timer gives up.
			ls.tries++
			wait := max(10*time.Millisecond, min(50*time.Millisecond<<min(ls.tries, 5), ls.deadline.Sub(now)/3))
			ls.renewAt = now.Add(wait)
			l.log.Warn("dlock: renewal failed; retrying until the lease's safe deadline",
				"key", ls.key, "deadline_in", ls.deadline.Sub(now), "err", cause)
		}
	}
	l.mu.Unlock()
	for _, e := range renewed {
		l.obs.Renewed(e)
	}
	l.poke()
}
