-- watchholders.lua reads a key's holders and the number of the last change
-- of them, for a holder watch subscribed to the key's channels. Run after
-- holders.lua.
--
-- KEYS     as info.lua, then
-- KEYS[4]  the key's change counter (see announcement in holders.lua)
--
-- Returns {counter, holders}: the counter ('0' if no change was counted)
-- and the holders as info.lua returns them.
return {redis.call('get', KEYS[4]) or '0', live(KEYS[1], KEYS[2], KEYS[3])}
