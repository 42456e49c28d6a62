-- extend.lua renews the leases of a batch of holders, each if its token
-- still holds it (exclusively, or as a shared or limited holder). An expired
-- lease is never revived. One call per lock on Redis Cluster (its keys live
-- in different slots); one call for many locks on a single server. Run after
-- holders.lua.
--
-- KEYS[3i-2]  a lock
-- KEYS[3i-1]  its shared and limited holders
-- KEYS[3i]    their descriptions
-- ARGV[2i-1]  the owner token
-- ARGV[2i]    its lease in milliseconds
--
-- Returns an array: 1 where renewed, 0 where the token does not hold the key.
local out = {}
local ms
for i = 1, #KEYS / 3 do
  local tok, ttl = ARGV[2 * i - 1], ARGV[2 * i]
  local holders = KEYS[3 * i - 1]
  out[i] = 0
  if redis.call('hget', KEYS[3 * i - 2], 'token') == tok then
    redis.call('pexpire', KEYS[3 * i - 2], ttl)
    out[i] = 1
  else
    local s = redis.call('zscore', holders, tok)
    if s then
      ms = ms or clock()
      if tonumber(s) > ms then
        redis.call('zadd', holders, 'xx', int(ms + tonumber(ttl)), tok)
        cover(holders, ttl)
        cover(KEYS[3 * i], ttl)
        out[i] = 1
      end
    end
  end
end
return out
