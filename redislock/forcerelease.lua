-- forcerelease.lua frees every holder of a key, whatever its token and mode,
-- and wakes its waiters. Run after holders.lua.
--
-- KEYS[1]  the lock
-- KEYS[2]  the key's shared and limited holders
-- KEYS[3]  their descriptions
-- KEYS[4]  the key's change counter (see announcement in holders.lua)
-- ARGV[1]  the key's release channel
--
-- Returns 1 if released, 0 if the key had no live holder.
local live = redis.call('del', KEYS[1])
if redis.call('exists', KEYS[2]) == 1 then
  local ms = clock()
  live = live + redis.call('zcount', KEYS[2], '(' .. int(ms), '+inf')
end
redis.call('del', KEYS[2], KEYS[3])
if live == 0 then
  return 0
end
wake(ARGV[1], announcement(KEYS[4], 'released', KEYS[1], KEYS[2], KEYS[3]))
return 1
