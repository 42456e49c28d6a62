-- info.lua describes every live holder of a key. Run after holders.lua.
--
-- KEYS[1]  the lock
-- KEYS[2]  the key's shared and limited holders
-- KEYS[3]  their descriptions
--
-- Returns an array of {pttl, token, owner, fence, metadata, acquired_us[,
-- mode, limit]}, empty if the key is not held.
local out = {}
local h = redis.call('hmget', KEYS[1], 'token', 'owner', 'fence', 'metadata', 'acquired_us')
if h[1] then
  out[1] = {redis.call('pttl', KEYS[1]), h[1], h[2] or '', h[3] or '', h[4] or '', h[5] or ''}
end
if redis.call('exists', KEYS[2]) == 1 then
  local ms = clock()
  local live = redis.call('zrangebyscore', KEYS[2], '(' .. int(ms), '+inf', 'withscores')
  for i = 1, #live, 2 do
    out[#out + 1] = describe(KEYS[3], live[i], tonumber(live[i + 1]) - ms)
  end
end
return out
