package redislock

import (
	"context"
	"errors"
	"fmt"
	"time"

	"github.com/dlock-dev/dlock"
	"github.com/dlock-dev/dlock/internal/ctxend"
)

// Exclusive waits queue in the store.
//
// An exclusive wait that finds the key held takes a place in the key's
// queue (acquire.lua), and an exclusive release grants the lock to the
// first wait whose place is kept, in the release's own script, and
// announces the handoff on the key's release channel (release.lua). The
// wait learns of its grant from that message: a handoff takes no round
// trip of the waiter and wakes no other wait, and the releaser cannot take
// the key back before the waits queued before it.
//
// A wait keeps its place by attempting again at least every queueLife/3;
// a place not renewed for queueLife lapses, so that a waiter that died
// while queued is skipped (one that dies within queueLife of its last
// attempt may still be handed the lock, which then stays held until its
// lease ends, as a dead holder's does). A wait that ends leaves the queue
// with a release of its token, which also frees a grant it was handed
// meanwhile; if that release fails, the Locker keeps releasing the token
// (it resolves the acquisition).
//
// Timing: a handoff happens after the server ran the wait's latest attempt,
// so after that attempt was sent; a lease handed to it is timed from that
// sending. Each attempt is numbered and the release announces the number it
// found queued: a handoff to an earlier attempt (whose message came late,
// after a later attempt was refused) is not trusted, nor one that arrives
// more than quickShare of the lease after the attempt was sent. The wait
// attempts again instead, which finds the token holding the lock and
// starts its lease anew, or takes its place again.

// queueLife is how long a wait keeps its place in the queue without
// attempting again.
const queueLife = 6 * time.Second

// quickShare: a handoff is trusted when it arrives within TTL/quickShare of
// the attempt it answers.
const quickShare = 5

// leaveTimeout bounds the release by which a wait that ended leaves the
// queue.
const leaveTimeout = 5 * time.Second

// queuedWait is AcquireWait for an exclusive request: it waits in the
// key's queue for a handoff, and also attempts again when woken by another
// release message, when the holder's lease runs out, and to keep its place.
func (b *Backend) queuedWait(ctx context.Context, req dlock.Request, w *subWait) (dlock.Result, error) {
	t := time.NewTimer(time.Hour)
	defer t.Stop()
	began := time.Now()
	for attempt := uint64(1); ; attempt++ {
		sending := time.Now()
		res, err := b.acquireWith(ctx, req, queueLife.Milliseconds(), attempt)
		if err != nil && ctxend.Err(ctx) != nil {
			// Cut by ctx: the script may have run and queued the
			// token, where a release would hand it the key. Leave the
			// queue at once; the error still makes the Locker resolve
			// the attempt, in case the script lands after the leave.
			if lerr := b.leaveQueue(ctx, req); lerr != nil {
				err = dlock.Join(err, lerr)
			}
			return dlock.Result{}, err
		}
		if err != nil || res.Acquired {
			res.SentAfter = sending.Sub(began)
			return res, err
		}
		t.Reset(min(retryAfter(req, res), queueLife/3))
		select {
		case h := <-w.handed:
			if h.attempt == attempt && time.Since(sending) <= req.TTL/quickShare {
				return dlock.Result{Acquired: true, Fence: h.fence, SentAfter: sending.Sub(began)}, nil
			}
		case <-w.wake:
		case <-t.C:
		case <-ctx.Done():
			if err := b.leaveQueue(ctx, req); err != nil {
				return dlock.Result{}, err
			}
			return dlock.Result{Holder: res.Holder}, nil
		}
	}
}

// leaveQueue takes the wait of req out of its key's queue once the wait's
// ctx has ended, releasing a grant it was handed meanwhile, bounded by
// leaveTimeout. It runs before AcquireWait returns: the Locker has already
// answered its caller, and its Close waits for this call. An error means
// the place may be left: AcquireWait returns it, and the Locker resolves
// the acquisition by releasing its token until that succeeds.
func (b *Backend) leaveQueue(ctx context.Context, req dlock.Request) error {
	ctx, cancel := context.WithTimeout(context.WithoutCancel(ctx), leaveTimeout)
	defer cancel()
	if err := b.Release(ctx, req.Key, req.Token); err != nil && !errors.Is(err, dlock.ErrNotHeld) {
		return fmt.Errorf("redislock: leave the queue of %q: %w", req.Key, err)
	}
	return nil
}
