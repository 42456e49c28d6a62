-- fenced.lua runs a write only with the newest fence of its resource.
--
-- KEYS[1]  the resource's fence record: the newest fence, in decimal, that
--          never expires
-- KEYS[2…] the keys the commands touch (declared for Redis Cluster)
-- ARGV[1]  the fence, in decimal without leading zeros
-- ARGV[2]  the number of commands, then for each: its number of arguments
--          and the arguments, the command's name first
--
-- Returns {0, newest} (changing nothing) when the record holds a newer
-- fence; otherwise raises the record to the fence, runs the commands and
-- returns {1, {reply, …}}. A command that fails ends the script with its
-- error; the writes before it stay (Redis does not undo a script).
local cur = redis.call('get', KEYS[1])
if cur then
  if not string.match(cur, '^[1-9][0-9]*$') or #cur > 20 then
    return redis.error_reply('fence record ' .. KEYS[1] .. ' holds ' .. cur .. ', not a fence')
  end
  -- Compared as decimal strings: Lua's numbers lose uint64 precision.
  if #cur > #ARGV[1] or (#cur == #ARGV[1] and cur > ARGV[1]) then
    return {0, cur}
  end
end
if cur ~= ARGV[1] then
  redis.call('set', KEYS[1], ARGV[1])
end
local replies = {}
local i = 3
for c = 1, tonumber(ARGV[2]) do
  local n = tonumber(ARGV[i])
  replies[c] = redis.call(unpack(ARGV, i + 1, i + n))
  i = i + n + 1
end
return {1, replies}
