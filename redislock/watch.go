package redislock

import (
	"context"
	_ "embed"
	"fmt"
	"time"

	"github.com/dlock-dev/dlock"
	"github.com/redis/go-redis/v9"
)

var (
	//go:embed setmetadata.lua
	setMetadataLua string

	setMetadataScript = redis.NewScript(holdersLua + setMetadataLua)
)

// SetMetadata implements dlock.MetadataSetter with one script call, which
// also tells the key's watches.
func (b *Backend) SetMetadata(ctx context.Context, key string, token dlock.Token, metadata string) error {
	n, err := setMetadataScript.Run(ctx, b.c, b.changeKeys(key), token.String(), metadata, b.watchChannel(key)).Int64()
	if err != nil {
		return fmt.Errorf("redislock: set metadata of %q: %w", key, err)
	}
	if n == 0 {
		return dlock.ErrNotHeld
	}
	return nil
}

// watchPing is how long a watch's connection may stay silent before the
// watch pings the server; a ping unanswered for as long again ends it.
const watchPing = 3 * time.Second

// Watch implements dlock.Watcher. It subscribes, on a pub/sub connection of
// its own (not one of the client's pool), to the key's release channel,
// which every release that can wake a waiter publishes on, and to its
// change channel, on which grants, metadata changes and the other releases
// publish; it returns once the server has confirmed both subscriptions.
// Expiries are not reported: Redis notices them only through keyspace
// notifications, which need the server's configuration.
//
// The channel is closed when ctx ends and at the first sign that messages
// may have been lost: a broken connection (go-redis would resubscribe, but
// not replay what was published meanwhile, such as a restart's loss of
// every lock), a ping on a silent connection unanswered for 3 s (a
// partition that drops packets), or the server ending the subscription (a
// cluster slot that moved to another shard). Watch returns an error when it
// cannot subscribe (an ACL without channel rights, an unreachable server)
// or when ctx ends first.
func (b *Backend) Watch(ctx context.Context, key string) (<-chan struct{}, error) {
	ps, err := b.subscribe(ctx, b.channel(key), b.watchChannel(key))
	if err != nil {
		if ctx.Err() != nil {
			err = ctx.Err()
		}
		return nil, fmt.Errorf("redislock: watch %q: %w", key, err)
	}
	out := make(chan struct{}, 1)
	listen(ctx, ps, func(*redis.Message) bool {
		select {
		case out <- struct{}{}:
		default:
		}
		return true
	}, func() { close(out) })
	return out, nil
}

// listen reads ps in a goroutine of its own, passing each message to
// onMessage, until ctx ends, onMessage returns false, the connection breaks
// or stays silent (healthCheck), or the server ends or renews the
// subscription (a resubscription after a reconnect, which go-redis makes by
// itself, means messages may have been lost); then it closes ps and calls
// end.
func listen(ctx context.Context, ps *redis.PubSub, onMessage func(*redis.Message) bool, end func()) {
	alive := make(chan struct{}, 1) // a message or a pong arrived
	done := make(chan struct{})
	stop := context.AfterFunc(ctx, func() { ps.Close() })
	go func() {
		defer end()
		defer stop()
		defer close(done)
		defer ps.Close()
		for {
			msg, err := ps.Receive(context.Background())
			if err != nil {
				return // closed by ctx or the health check, or broken
			}
			select {
			case alive <- struct{}{}:
			default:
			}
			switch m := msg.(type) {
			case *redis.Message:
				if !onMessage(m) {
					return
				}
			case *redis.Pong:
			default: // a resubscription or the server's unsubscription
				return
			}
		}
	}()
	go healthCheck(ps, alive, done)
}

// healthCheck pings ps after watchPing without a message, and closes ps
// when a ping fails or stays unanswered for watchPing, until done closes:
// a partition that drops packets breaks no connection by itself for as
// long as TCP retransmits (many minutes).
func healthCheck(ps *redis.PubSub, alive <-chan struct{}, done <-chan struct{}) {
	t := time.NewTimer(watchPing)
	defer t.Stop()
	pinged := false
	for {
		select {
		case <-done:
			return
		case <-alive:
			pinged = false
		case <-t.C:
			if pinged {
				ps.Close()
				return
			}
			ctx, cancel := context.WithTimeout(context.Background(), watchPing)
			err := ps.Ping(ctx)
			cancel()
			if err != nil {
				ps.Close()
				return
			}
			pinged = true
		}
		t.Reset(watchPing) // since Go 1.23, Reset drops a stale expiry
	}
}
