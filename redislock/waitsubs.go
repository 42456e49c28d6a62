package redislock

import (
	"context"
	"encoding/hex"
	"strconv"
	"strings"
	"sync"
	"time"

	"github.com/dlock-dev/dlock"
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
	waits map[dlock.Token]*subWait // by the waits' owner tokens
	users int                      // waits using it (under Backend.subsMu)
	idle  *time.Timer              // closes it once unused (under Backend.subsMu)
}

// subWait is one wait's share of a subscription.
type subWait struct {
	// wake receives (without blocking the sender) at every release
	// message and every resubscription, except handoffs to other waits.
	wake chan struct{}
	// handed receives the latest handoff of the key to the wait's token.
	handed chan handoff
}

// handoff is a release's grant of a key to a queued wait (see queue.go).
type handoff struct {
	attempt uint64 // the wait's attempt that the release found queued
	fence   uint64
}

// waitSubs are a Backend's subscriptions of waits, by channel.
type waitSubs struct {
	mu   sync.Mutex
	subs map[string]*waitSub
}

// join returns a subscription to ch for the wait of token, confirmed by the
// server, and the wait's share of it. The wait calls leave when it ends.
func (b *Backend) join(ctx context.Context, ch string, token dlock.Token) (*waitSub, *subWait, error) {
	w := &subWait{wake: make(chan struct{}, 1), handed: make(chan handoff, 1)}
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
			s = &waitSub{ch: ch, ps: ps, waits: make(map[dlock.Token]*subWait)}
			forward(&s.wg, ps, s.deliver)
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
	s.waits[token] = w
	s.mu.Unlock()
	b.waits.mu.Unlock()
	return s, w, nil
}

// subscribed reports whether the Backend's waits hold a subscription to ch
// (in use, or kept for the next wait).
func (b *Backend) subscribed(ch string) bool {
	b.waits.mu.Lock()
	defer b.waits.mu.Unlock()
	return b.waits.subs[ch] != nil
}

// leave ends the use of s by the wait of token; the last one keeps s for
// keepSubscription.
func (b *Backend) leave(s *waitSub, token dlock.Token) {
	s.mu.Lock()
	delete(s.waits, token)
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

// deliver passes a message or resubscription on s to its waits: a handoff
// to the wait it names (other processes' waits are not woken by it), any
// other message to all of them.
func (s *waitSub) deliver(msg any) {
	s.mu.Lock()
	defer s.mu.Unlock()
	if m, ok := msg.(*redis.Message); ok {
		if token, ok := handedTo(m.Payload); ok {
			w := s.waits[token]
			if w == nil {
				return // another process's wait
			}
			if h, ok := parseHandoff(m.Payload); ok {
				// Only the newest handoff counts: replace an unread one.
				select {
				case <-w.handed:
				default:
				}
				w.handed <- h
				return
			}
		}
	}
	for _, w := range s.waits {
		poke(w.wake)
	}
}

// handedTo returns the token that the announcement of a handoff (see
// handoff in release.lua) names, without reading the rest, so that the
// waits of other processes cost little; false for other messages and for
// a handoff it cannot read (which then wakes every wait: each attempts
// again, which finds out).
func handedTo(payload string) (dlock.Token, bool) {
	if !strings.HasPrefix(payload, "handed:") {
		return dlock.Token{}, false
	}
	// "handed:N seq 1 " then the holder's fields, each "len:field":
	// pttl, then the token.
	head := strings.SplitN(payload, " ", 4)
	if len(head) != 4 || head[2] != "1" {
		return dlock.Token{}, false
	}
	rest := head[3]
	for i := range 2 {
		l, after, ok := strings.Cut(rest, ":")
		n, err := strconv.Atoi(l)
		if !ok || err != nil || n < 0 || n > len(after) {
			return dlock.Token{}, false
		}
		if i == 1 {
			var t dlock.Token
			if n != 2*len(t) {
				return dlock.Token{}, false
			}
			if _, err := hex.Decode(t[:], []byte(after[:n])); err != nil {
				return dlock.Token{}, false
			}
			return t, true
		}
		rest = after[n:]
	}
	return dlock.Token{}, false
}

// parseHandoff reads the grant that the announcement of a handoff tells.
func parseHandoff(payload string) (handoff, bool) {
	what, _, _ := strings.Cut(payload, " ")
	attempt, err := strconv.ParseUint(strings.TrimPrefix(what, "handed:"), 10, 64)
	if err != nil {
		return handoff{}, false
	}
	c, err := parseChange("", payload, time.Now())
	if err != nil || len(c.holders) != 1 || c.holders[0].Fence == 0 {
		return handoff{}, false
	}
	return handoff{attempt: attempt, fence: c.holders[0].Fence}, true
}
