package redislock

import (
	"context"
	"sync"
	"time"

	"github.com/redis/go-redis/v9"
)

// Waits reuse their subscriptions.
//
// A wait subscribes to its key's release channel on a pub/sub connection
// of its own (go-redis dials one per PubSub). A client that waits for a key
// again and again, as contenders of one key do, would dial a connection
// per wait. A subscription that its last wait leaves is kept for
// keepSubscription instead, and the next wait on the channel takes it over;
// waits of one Backend on one channel share it meanwhile. A kept
// subscription that no wait takes over is closed.

// keepSubscription is how long a subscription outlives its last wait.
const keepSubscription = 250 * time.Millisecond

// waitSub is a subscription to one channel that waits share.
type waitSub struct {
	ch    string
	ps    *redis.PubSub
	wg    sync.WaitGroup // the forwarding goroutine
	mu    sync.Mutex
	wakes map[chan struct{}]struct{} // the waits' wake-ups
	users int                        // waits using it (under Backend.subsMu)
	idle  *time.Timer                // closes it once unused (under Backend.subsMu)
}

// waitSubs are a Backend's subscriptions of waits, by channel.
type waitSubs struct {
	mu   sync.Mutex
	subs map[string]*waitSub
}

// join returns a subscription to ch for a wait, confirmed by the server,
// and the wait's wake-up channel, which receives (without blocking the
// sender) at every message and every resubscription. The wait calls leave
// when it ends.
func (b *Backend) join(ctx context.Context, ch string) (*waitSub, chan struct{}, error) {
	wake := make(chan struct{}, 1)
	b.waits.mu.Lock()
	s := b.waits.subs[ch]
	if s == nil {
		b.waits.mu.Unlock()
		ps, err := b.subscribe(ctx, ch)
		if err != nil {
			return nil, nil, err
		}
		b.waits.mu.Lock()
		if s = b.waits.subs[ch]; s == nil { // no other wait subscribed meanwhile
			s = &waitSub{ch: ch, ps: ps, wakes: make(map[chan struct{}]struct{})}
			forward(&s.wg, ps, s.wakeAll)
			if b.waits.subs == nil {
				b.waits.subs = make(map[string]*waitSub)
			}
			b.waits.subs[ch] = s
		} else {
			defer ps.Close()
		}
	}
	s.users++
	if s.idle != nil {
		// If its timer has fired already, the close waits for mu and
		// then finds the subscription in use.
		s.idle.Stop()
	}
	s.mu.Lock()
	s.wakes[wake] = struct{}{}
	s.mu.Unlock()
	b.waits.mu.Unlock()
	return s, wake, nil
}

// leave ends a wait's use of s; the last one keeps s for keepSubscription.
func (b *Backend) leave(s *waitSub, wake chan struct{}) {
	s.mu.Lock()
	delete(s.wakes, wake)
	s.mu.Unlock()
	b.waits.mu.Lock()
	defer b.waits.mu.Unlock()
	if s.users--; s.users > 0 {
		return
	}
	if s.idle == nil {
		s.idle = time.AfterFunc(keepSubscription, func() { b.dropIdle(s) })
	} else {
		s.idle.Reset(keepSubscription)
	}
}

// dropIdle closes s if no wait took it over.
func (b *Backend) dropIdle(s *waitSub) {
	b.waits.mu.Lock()
	if s.users > 0 || b.waits.subs[s.ch] != s {
		b.waits.mu.Unlock()
		return
	}
	delete(b.waits.subs, s.ch)
	b.waits.mu.Unlock()
	s.ps.Close() // ends the forwarding goroutine
	s.wg.Wait()
}

// wakeAll wakes every wait of s.
func (s *waitSub) wakeAll() {
	s.mu.Lock()
	defer s.mu.Unlock()
	for w := range s.wakes {
		poke(w)
	}
}
