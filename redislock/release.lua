-- release.lua frees a key's exclusive lock or one of its shared or limited
-- leases if the token holds it. An exclusive release hands the lock to the
-- first wait in the key's queue whose place is kept, unless a wait that
-- does not queue (shared, limited, or of a client with MinReplicas) marked
-- the key as raced for; otherwise a release
-- wakes the key's waiters or, when it helps none, tells its watches. A
-- token that holds nothing leaves the queue. Run after holders.lua.
--
-- KEYS[1]  the lock
-- KEYS[2]  the key's shared and limited holders
-- KEYS[3]  their descriptions
-- KEYS[4]  the key's change counter (see announcement in holders.lua)
-- KEYS[5]  the key's fencing counter
-- KEYS[6]  the writer mark
-- KEYS[7]  the key's queue of exclusive waits (see enqueue in holders.lua)
-- KEYS[8]  their descriptions
-- KEYS[9]  the racing mark (see acquireshared.lua)
-- ARGV[1]  owner token
-- ARGV[2]  the key's release channel
-- ARGV[3]  the key's change channel
-- ARGV[4]  as acquire.lua's ARGV[5]
--
-- Returns 1 if released, 0 if the token does not hold the key.

-- handoff grants the lock to the first wait whose place is kept, dropping
-- the lapsed ones before it, and returns the announcement of the grant
-- ('handed:' and the wait's attempt), or nil when no wait is queued.
local function handoff()
  if redis.call('exists', KEYS[7]) == 0 or redis.call('exists', KEYS[9]) == 1 then
    return nil
  end
  local ms, us = clock()
  while true do
    local tok = redis.call('zrange', KEYS[7], 0, 0)[1]
    if not tok then
      return nil
    end
    local raw = redis.call('hget', KEYS[8], tok)
    redis.call('zrem', KEYS[7], tok)
    redis.call('hdel', KEYS[8], tok)
    if raw then
      local till, lease, owner, metadata, attempt = cmsgpack.unpack(raw)
      if till > ms then
        redis.call('del', KEYS[6])
        grant(KEYS[1], KEYS[5], tok, lease, owner, metadata, us, ARGV[4])
        return announcement(KEYS[4], 'handed:' .. attempt, KEYS[1], KEYS[2], KEYS[3])
      end
    end
  end
end

if redis.call('hget', KEYS[1], 'token') == ARGV[1] then
  redis.call('del', KEYS[1])
  -- The waits and watches read a handoff on the release channel.
  wake(ARGV[2], handoff() or announcement(KEYS[4], 'released', KEYS[1], KEYS[2], KEYS[3]))
  return 1
end
if redis.call('zrem', KEYS[7], ARGV[1]) == 1 then
  redis.call('hdel', KEYS[8], ARGV[1])
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
