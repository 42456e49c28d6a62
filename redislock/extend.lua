-- extend.lua renews the leases of a batch of locks, each if its token still
-- holds it. An expired lease is gone from Redis, so it is never revived.
-- One call per lock on Redis Cluster (its keys live in different slots); one
-- call for many locks on a single server.
--
-- KEYS[i]      a lock
-- ARGV[2i-1]   its owner token
-- ARGV[2i]     its lease in milliseconds
--
-- Returns an array: 1 where renewed, 0 where the token does not hold the lock.
local out = {}
for i, key in ipairs(KEYS) do
  if redis.call('hget', key, 'token') == ARGV[2 * i - 1] then
    redis.call('pexpire', key, ARGV[2 * i])
    out[i] = 1
  else
    out[i] = 0
  end
end
return out
