-- extend.lua renews a lease if the token still holds it. An expired lease is
-- gone from Redis, so it is never revived.
--
-- KEYS[1]  the lock
-- ARGV[1]  owner token
-- ARGV[2]  lease in milliseconds
--
-- Returns 1 if renewed, 0 if the token does not hold the lock.
if redis.call('hget', KEYS[1], 'token') == ARGV[1] then
  redis.call('pexpire', KEYS[1], ARGV[2])
  return 1
end
return 0
