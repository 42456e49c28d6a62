-- setmetadata.lua replaces the metadata of a key's exclusive lock or of one
-- of its shared or limited leases if the token holds it and its lease has
-- not ended, and tells the key's watches. Run after holders.lua.
--
-- KEYS[1]  the lock
-- KEYS[2]  the key's shared and limited holders
-- KEYS[3]  their descriptions
-- KEYS[4]  the key's change counter (see announcement in holders.lua)
-- ARGV[1]  owner token
-- ARGV[2]  the new metadata
-- ARGV[3]  the key's change channel
--
-- Returns 1 if replaced, 0 if the token does not hold the key.
if redis.call('hget', KEYS[1], 'token') == ARGV[1] then
  redis.call('hset', KEYS[1], 'metadata', ARGV[2])
  changed(ARGV[3], announcement(KEYS[4], 'metadata', KEYS[1], KEYS[2], KEYS[3]))
  return 1
end
local s = redis.call('zscore', KEYS[2], ARGV[1])
if not s or tonumber(s) <= clock() then
  return 0
end
local raw = redis.call('hget', KEYS[3], ARGV[1])
if not raw then
  return 0
end
local mode, limit, fence, acquired, owner = cmsgpack.unpack(raw)
redis.call('hset', KEYS[3], ARGV[1], cmsgpack.pack(mode, limit, fence, acquired, owner, ARGV[2]))
changed(ARGV[3], announcement(KEYS[4], 'metadata', KEYS[1], KEYS[2], KEYS[3]))
return 1
