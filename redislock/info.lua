-- info.lua describes a lock's holder.
--
-- KEYS[1]  the lock
--
-- Returns {pttl, token, owner, fence, metadata, acquired_us}, or {} if the
-- lock is not held.
local h = redis.call('hmget', KEYS[1], 'token', 'owner', 'fence', 'metadata', 'acquired_us')
if not h[1] then
  return {}
end
return {redis.call('pttl', KEYS[1]), h[1], h[2] or '', h[3] or '', h[4] or '', h[5] or ''}
