-- acquire.lua takes a lock if it is free.
--
-- KEYS[1]  the lock: a hash (token, owner, fence, metadata, acquired_us) whose
--          expiry is the lease
-- KEYS[2]  the key's fencing counter: a string that never expires
-- ARGV[1]  owner token (hex)
-- ARGV[2]  lease in milliseconds
-- ARGV[3]  owner identity
-- ARGV[4]  metadata
-- ARGV[5]  "1" to keep the counter at least the server's clock in
--          microseconds, so that it keeps increasing if the counter is lost
--
-- Returns {1, fence} when the token holds the lock, or
-- {0, pttl, token, owner, fence, metadata, acquired_us} describing the holder.
local h = redis.call('hmget', KEYS[1], 'token', 'owner', 'fence', 'metadata', 'acquired_us')
if h[1] then
  if h[1] == ARGV[1] then
    -- A retried call whose first run took the lock.
    return {1, tonumber(h[3])}
  end
  return {0, redis.call('pttl', KEYS[1]), h[1], h[2] or '', h[3] or '', h[4] or '', h[5] or ''}
end

local t = redis.call('time')
local now = t[1] .. string.format('%06d', tonumber(t[2]))
local fence = redis.call('incr', KEYS[2])
if ARGV[5] == '1' and fence < tonumber(now) then
  redis.call('set', KEYS[2], now)
  fence = tonumber(now)
end
-- Numbers are formatted here: Lua would print a large one with 14 digits.
redis.call('hset', KEYS[1], 'token', ARGV[1], 'owner', ARGV[3],
  'fence', string.format('%.0f', fence), 'metadata', ARGV[4], 'acquired_us', now)
redis.call('pexpire', KEYS[1], ARGV[2])
return {1, fence}
