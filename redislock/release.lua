-- release.lua frees a lock if the token holds it, and wakes its waiters.
--
-- KEYS[1]  the lock
-- ARGV[1]  owner token
-- ARGV[2]  the key's release channel
--
-- Returns 1 if released, 0 if the token does not hold the lock.
if redis.call('hget', KEYS[1], 'token') ~= ARGV[1] then
  return 0
end
redis.call('del', KEYS[1])
-- Sharded pub/sub keeps the message on the key's shard in a cluster; servers
-- before 7.0 lack SPUBLISH and get a classic PUBLISH (their waiters use
-- SUBSCRIBE). A failure to publish (an ACL without channel rights) must not
-- fail the release, which has happened: waiters then wait out the lease.
local r = redis.pcall('spublish', ARGV[2], 'released')
if type(r) == 'table' and r.err then
  redis.pcall('publish', ARGV[2], 'released')
end
return 1
