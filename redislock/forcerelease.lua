-- forcerelease.lua frees a lock whatever token holds it, and wakes its
-- waiters.
--
-- KEYS[1]  the lock
-- ARGV[1]  the key's release channel
--
-- Returns 1 if released, 0 if the lock was not held.
if redis.call('del', KEYS[1]) == 0 then
  return 0
end
local r = redis.pcall('spublish', ARGV[1], 'released')
if type(r) == 'table' and r.err then
  redis.pcall('publish', ARGV[1], 'released')
end
return 1
