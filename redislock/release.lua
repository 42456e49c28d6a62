-- release.lua frees a key's exclusive lock or one of its shared or limited
-- leases if the token holds it, and wakes the key's waiters or, when the
-- release helps none, tells its watches. Run after holders.lua.
--
-- KEYS[1]  the lock
-- KEYS[2]  the key's shared and limited holders
-- KEYS[3]  their descriptions
-- KEYS[4]  the key's change counter (see announcement in holders.lua)
-- ARGV[1]  owner token
-- ARGV[2]  the key's release channel
-- ARGV[3]  the key's change channel
--
-- Returns 1 if released, 0 if the token does not hold the key.
if redis.call('hget', KEYS[1], 'token') == ARGV[1] then
  redis.call('del', KEYS[1])
  wake(ARGV[2], announcement(KEYS[4], 'released', KEYS[1], KEYS[2], KEYS[3]))
  return 1
end
local s = redis.call('zscore', KEYS[2], ARGV[1])
if not s then
  return 0
end
local ms = clock()
if tonumber(s) <= ms then
  return 0
end
local raw = redis.call('hget', KEYS[3], ARGV[1])
redis.call('zrem', KEYS[2], ARGV[1])
redis.call('hdel', KEYS[3], ARGV[1])
-- A shared release helps a waiter only when it was the last live holder
-- (exclusive requests wait for all of them; shared ones are refused only by
-- an exclusive holder or a writer mark); a limited release frees a slot.
if (raw and cmsgpack.unpack(raw) == 2) or redis.call('zcount', KEYS[2], '(' .. int(ms), '+inf') == 0 then
  wake(ARGV[2], announcement(KEYS[4], 'released', KEYS[1], KEYS[2], KEYS[3]))
else
  changed(ARGV[3], announcement(KEYS[4], 'released', KEYS[1], KEYS[2], KEYS[3]))
end
return 1
