-- acquireshared.lua takes a shared or limited lease of a key. Run after
-- holders.lua.
--
-- KEYS     as acquire.lua
-- ARGV     ARGV[1] to ARGV[6] as acquire.lua, then
-- ARGV[7]  the mode: 1 shared, 2 limited
-- ARGV[8]  the limit (0 for shared)
-- ARGV[9]  for a wait, how long the racing mark (KEYS[9]) that its refusal
--          sets outlasts the refusing lease, in milliseconds (see mark in
--          holders.lua): exclusive releases then wake every wait instead of
--          handing the key to a queued one
--
-- A shared request is granted when the key has no exclusive holder, no
-- limited holders and no writer mark; a limited one when the key has no
-- exclusive or shared holder and fewer than limit holders, all with this
-- limit. Returns {1, fence} when the token holds a lease; {0, pttl[, token,
-- owner, fence, metadata, acquired_us, mode, limit]} describing the holder
-- whose lease ends first (only pttl, that of the mark, for a writer mark);
-- or {2, mode, limit} of the key's holders for a mode mismatch, changing
-- nothing.
local mode, limit = tonumber(ARGV[7]), tonumber(ARGV[8])
-- race marks a wait's refusal.
local function race(remaining)
  if ARGV[9] then
    mark(KEYS[9], remaining, ARGV[9])
  end
end
local h = redis.call('hmget', KEYS[1], 'token', 'owner', 'fence', 'metadata', 'acquired_us')
if h[1] then
  if mode == 2 then
    return {2, 0, 0}
  end
  local pttl = redis.call('pttl', KEYS[1])
  race(pttl)
  return {0, pttl, h[1], h[2] or '', h[3] or '', h[4] or '', h[5] or ''}
end

local ms, us = clock()
prune(KEYS[3], KEYS[4], ms)
local mine = redis.call('hget', KEYS[4], ARGV[1])
if mine then
  -- A retried call whose first run took the lease.
  local _, _, fence = cmsgpack.unpack(mine)
  return {1, tonumber(fence)}
end
local n = redis.call('zcard', KEYS[3])
if n > 0 then
  local d = first(KEYS[3], KEYS[4], ms)
  if (d[7] == 2 or mode == 2) and (d[7] ~= mode or d[8] ~= limit) then
    return {2, d[7], d[8]}
  end
  if mode == 2 and n >= limit then
    race(d[1])
    return {0, unpack(d)}
  end
end
if mode == 1 then
  local w = redis.call('pttl', KEYS[5])
  if w ~= -2 then
    race(w)
    return {0, w}
  end
end

local fence = nextFence(KEYS[2], us, ARGV[5])
redis.call('zadd', KEYS[3], int(ms + tonumber(ARGV[2])), ARGV[1])
redis.call('hset', KEYS[4], ARGV[1], cmsgpack.pack(mode, limit, int(fence), us, ARGV[3], ARGV[4]))
cover(KEYS[3], ARGV[2])
cover(KEYS[4], ARGV[2])
changed(ARGV[6], announcement(KEYS[6], 'granted', KEYS[1], KEYS[3], KEYS[4]))
return {1, fence}
