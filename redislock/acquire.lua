-- acquire.lua takes a lock exclusively if the key has no live holder of any
-- mode. Run after holders.lua.
--
-- KEYS[1]  the lock: a hash (token, owner, fence, metadata, acquired_us) whose
--          expiry is the lease
-- KEYS[2]  the key's fencing counter: a string that never expires
-- KEYS[3]  the key's shared and limited holders (see holders.lua)
-- KEYS[4]  their descriptions
-- KEYS[5]  the writer mark: while it exists, shared requests are refused
-- KEYS[6]  the key's change counter (see announcement in holders.lua)
-- KEYS[7]  the key's queue of exclusive waits (see queue in holders.lua)
-- KEYS[8]  their descriptions
-- KEYS[9]  the racing mark: while it exists, releases hand nothing over
-- ARGV[1]  owner token (hex)
-- ARGV[2]  lease in milliseconds
-- ARGV[3]  owner identity
-- ARGV[4]  metadata
-- ARGV[5]  "1" to keep the counter at least the server's clock in
--          microseconds, so that it keeps increasing if the counter is lost
-- ARGV[6]  the key's change channel, told of a grant
-- ARGV[7]  how long the writer mark lasts, in milliseconds
-- ARGV[8]  for a wait, how long its place in the queue lasts unless it
--          attempts again, in milliseconds; absent or "0" for a try, which
--          takes no place
-- ARGV[9]  for a wait, the number of this attempt, which a handoff tells
-- ARGV[10] for a wait that does not queue (ARGV[8] is then "0"), how long
--          the racing mark its refusal sets outlasts the refusing lease, in
--          milliseconds (see mark in holders.lua)
--
-- Returns {1, fence} when the token holds the lock (its lease starting
-- now); {0, pttl, token, owner, fence, metadata, acquired_us[, mode,
-- limit]} describing the holder whose lease ends first, the wait's place
-- kept; or {2, mode, limit} when the key is held limited (a mode mismatch,
-- changing nothing).
local wait = ARGV[8] and ARGV[8] ~= '0'
-- queue keeps a wait's place, or takes one at the end of the queue; a
-- wait that does not queue sets the racing mark instead.
local function queue(ms, us, remaining)
  if wait then
    enqueue(KEYS[7], KEYS[8], ms, us, ARGV[1], ARGV[2], ARGV[3], ARGV[4], ARGV[8], ARGV[9])
  elseif ARGV[10] then
    mark(KEYS[9], remaining, ARGV[10])
  end
end
local h = redis.call('hmget', KEYS[1], 'token', 'owner', 'fence', 'metadata', 'acquired_us')
if h[1] then
  if h[1] == ARGV[1] then
    -- A retried call whose first run took the lock, or a wait that a
    -- release handed the lock to: either way the lease starts now.
    redis.call('pexpire', KEYS[1], ARGV[2])
    return {1, tonumber(h[3])}
  end
  local ms, us = clock()
  local pttl = redis.call('pttl', KEYS[1])
  queue(ms, us, pttl)
  return {0, pttl, h[1], h[2] or '', h[3] or '', h[4] or '', h[5] or ''}
end

local ms, us = clock()
if redis.call('exists', KEYS[3]) == 1 then
  prune(KEYS[3], KEYS[4], ms)
  local d = first(KEYS[3], KEYS[4], ms)
  if d then
    if d[7] == 2 then
      return {2, d[7], d[8]}
    end
    -- Shared holders: new shared requests wait behind this writer.
    redis.call('set', KEYS[5], '1', 'px', ARGV[7])
    queue(ms, us, d[1])
    return {0, unpack(d)}
  end
end

redis.call('del', KEYS[5])
if wait then
  redis.call('zrem', KEYS[7], ARGV[1])
  redis.call('hdel', KEYS[8], ARGV[1])
end
local fence = grant(KEYS[1], KEYS[2], ARGV[1], ARGV[2], ARGV[3], ARGV[4], us, ARGV[5])
changed(ARGV[6], announcement(KEYS[6], 'granted', KEYS[1], KEYS[3], KEYS[4]))
return {1, fence}
