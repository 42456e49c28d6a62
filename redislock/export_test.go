package redislock

import (
	"context"

	"github.com/dlock-dev/dlock"
)

// Names returns the Redis names the Backend uses for key: the lock hash, the
// fencing counter and the release channel.
func (b *Backend) Names(key string) (lock, fence, channel string) {
	return b.lockKey(key), b.fenceKey(key), b.channel(key)
}

// WatchChannel returns the name of the channel on which key's changes that
// wake no waiter are published.
func (b *Backend) WatchChannel(key string) string { return b.watchChannel(key) }

// ModeNames returns the Redis names of key's shared and limited holders,
// their descriptions and its writer mark.
func (b *Backend) ModeNames(key string) (holders, info, writer string) {
	return b.holdersKey(key), b.infoKey(key), b.writerKey(key)
}

// AcquireSharedScript is the script of shared and limited acquisitions.
var AcquireSharedScript = acquireSharedScript

// AcquireArgs returns the keys and arguments of req's acquisition script.
func AcquireArgs(b *Backend, req dlock.Request) ([]string, []any) {
	_, args, _ := b.acquireCall(req)
	return b.acquireKeys(req.Key), args
}

// ChangesKey returns the name of key's change counter.
func (b *Backend) ChangesKey(key string) string { return b.changesKey(key) }

// QueueNames returns the Redis names of key's queue of exclusive waits and
// of their descriptions.
func (b *Backend) QueueNames(key string) (queue, queued string) {
	return b.queueKey(key), b.queuedKey(key)
}

// RawAcquireRelease runs the acquisition and release scripts of req once
// each, as Acquire and Release send them, without the Locker.
func RawAcquireRelease(ctx context.Context, b *Backend, req dlock.Request) error {
	script, args, err := b.acquireCall(req)
	if err != nil {
		return err
	}
	if err := script.Run(ctx, b.c, b.acquireKeys(req.Key), args...).Err(); err != nil {
		return err
	}
	return b.runRelease(ctx, req.Key, req.Token).Err()
}
