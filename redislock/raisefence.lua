-- raisefence.lua is Redlock's second step when the granting nodes' counters
-- differ: it raises this node's counter to the fence the client computed (the
-- largest of them), so that every later majority, which shares a node with
-- this one, counts past it.
--
-- KEYS[1]  the lock
-- KEYS[2]  the key's fencing counter
-- ARGV[1]  owner token
-- ARGV[2]  the fence
--
-- Returns 1 if done, 0 if the token no longer holds the lock here.
if redis.call('hget', KEYS[1], 'token') ~= ARGV[1] then
  return 0
end
if tonumber(redis.call('get', KEYS[2]) or '0') < tonumber(ARGV[2]) then
  redis.call('set', KEYS[2], ARGV[2])
end
redis.call('hset', KEYS[1], 'fence', ARGV[2])
return 1
