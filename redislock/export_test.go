package redislock

// Names returns the Redis names the Backend uses for key: the lock hash, the
// fencing counter and the release channel.
func (b *Backend) Names(key string) (lock, fence, channel string) {
	return b.lockKey(key), b.fenceKey(key), b.channel(key)
}
