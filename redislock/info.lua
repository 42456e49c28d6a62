-- info.lua describes every live holder of a key. Run after holders.lua.
--
-- KEYS[1]  the lock
-- KEYS[2]  the key's shared and limited holders
-- KEYS[3]  their descriptions
--
-- Returns an array of {pttl, token, owner, fence, metadata, acquired_us,
-- mode, limit}, empty if the key is not held.
return live(KEYS[1], KEYS[2], KEYS[3])
