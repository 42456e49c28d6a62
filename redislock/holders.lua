-- holders.lua is the prelude of the scripts that see every holder of a key.
--
-- An exclusive holder is the lock hash (see acquire.lua). Shared and limited
-- holders live in two keys next to it, in the same hash slot:
--   holders  a sorted set of owner tokens scored by the expiry of each
--            lease, in milliseconds of the server's clock (TIME)
--   info     a hash from owner token to
--            cmsgpack(mode, limit, fence, acquired_us, owner, metadata)
-- Both keys expire with their longest lease. A holder is live while its
-- score is above the server's clock; every script that counts holders
-- first removes the expired ones. All live holders of a key share one mode
-- and one limit: the scripts refuse any other.

-- clock returns the server's time in milliseconds and in microseconds (a
-- string, as a fence floor).
local function clock()
  local t = redis.call('time')
  return tonumber(t[1]) * 1000 + math.floor(tonumber(t[2]) / 1000),
    t[1] .. string.format('%06d', tonumber(t[2]))
end

-- Numbers are formatted here: Lua would print a large one with 14 digits.
local function int(n)
  return string.format('%.0f', n)
end

-- prune removes the holders whose lease ended at ms or before.
local function prune(holders, info, ms)
  local gone = redis.call('zrangebyscore', holders, '-inf', int(ms))
  if #gone == 0 then
    return
  end
  -- unpack is bounded by Lua's stack: delete in chunks.
  for i = 1, #gone, 1000 do
    redis.call('hdel', info, unpack(gone, i, math.min(i + 999, #gone)))
  end
  redis.call('zremrangebyscore', holders, '-inf', int(ms))
end

-- describe returns {remaining ms, token, owner, fence, metadata,
-- acquired_us, mode, limit} of holder tok.
local function describe(info, tok, remaining)
  local raw = redis.call('hget', info, tok)
  if not raw then
    return {remaining, tok, '', '', '', '', 0, 0}
  end
  local mode, limit, fence, acquired, owner, metadata = cmsgpack.unpack(raw)
  return {remaining, tok, owner, fence, metadata, acquired, mode, limit}
end

-- first describes the holder whose lease ends first, or returns nil.
local function first(holders, info, ms)
  local f = redis.call('zrange', holders, 0, 0, 'withscores')
  if not f[1] then
    return nil
  end
  return describe(info, f[1], tonumber(f[2]) - ms)
end

-- cover makes key last at least ms milliseconds.
local function cover(key, ms)
  if redis.call('pttl', key) < tonumber(ms) then
    redis.call('pexpire', key, ms)
  end
end

-- nextFence counts the key's fencing counter up, and, if floor is '1', to
-- at least the server's clock in microseconds (us), so that it keeps
-- increasing if the counter is lost.
local function nextFence(counter, us, floor)
  local fence = redis.call('incr', counter)
  if floor == '1' and fence < tonumber(us) then
    redis.call('set', counter, us)
    fence = tonumber(us)
  end
  return fence
end

-- grant makes tok the exclusive holder of lock with a lease of lease
-- milliseconds and the key's next fence, which it returns.
local function grant(lock, counter, tok, lease, owner, metadata, us, floor)
  local fence = nextFence(counter, us, floor)
  redis.call('hset', lock, 'token', tok, 'owner', owner, 'fence', int(fence),
    'metadata', metadata, 'acquired_us', us)
  redis.call('pexpire', lock, lease)
  return fence
end

-- Exclusive waits queue in two keys next to the lock, in the same hash slot:
--   queue   a sorted set of owner tokens scored by arrival, in microseconds
--           of the server's clock
--   queued  a hash from owner token to
--           cmsgpack(until_ms, lease_ms, owner, metadata, attempt)
-- A wait keeps its place while it attempts again before until_ms (the
-- server's clock, in milliseconds); attempt numbers its attempts, so that
-- the waiter tells a handoff to its latest one from an older one. A release
-- hands the lock to the first wait whose place is kept (see release.lua).
-- Both keys expire with their latest place.

-- enqueue keeps tok's place in the queue, or gives it the last one, for
-- life milliseconds from ms.
local function enqueue(queue, queued, ms, us, tok, lease, owner, metadata, life, attempt)
  redis.call('zadd', queue, 'nx', us, tok)
  redis.call('hset', queued, tok, cmsgpack.pack(ms + tonumber(life), lease, owner, metadata, attempt))
  cover(queue, life)
  cover(queued, life)
end

-- mark sets the racing mark of a refused wait outside the queue until
-- slack milliseconds after the refusing holder's remaining lease (or
-- mark), unless it lasts longer already: the wait attempts again at a
-- release or at that lease's end, and each refusal sets it again.
local function mark(racing, remaining, slack)
  local px = math.max(tonumber(remaining) or 0, 0) + tonumber(slack)
  if redis.call('pttl', racing) < px then
    redis.call('set', racing, '1', 'px', px)
  end
end

-- live describes every live holder of a key, as first does.
local function live(lock, holders, info)
  local out = {}
  local h = redis.call('hmget', lock, 'token', 'owner', 'fence', 'metadata', 'acquired_us')
  if h[1] then
    out[1] = {redis.call('pttl', lock), h[1], h[2] or '', h[3] or '', h[4] or '', h[5] or '', 0, 0}
  end
  if redis.call('exists', holders) == 1 then
    local ms = clock()
    local l = redis.call('zrangebyscore', holders, '(' .. int(ms), '+inf', 'withscores')
    for i = 1, #l, 2 do
      out[#out + 1] = describe(info, l[i], tonumber(l[i + 1]) - ms)
    end
  end
  return out
end

-- maxCarried is the most holders a change's message describes: a key with
-- more is announced without them, and its holder watches end.
local maxCarried = 100

-- announcement counts a change of a key's holders on the key's change
-- counter (a string that never expires) and returns the message that tells
-- of it: what, the counter's new value and the number of live holders after
-- the change (-1 for more than maxCarried), separated by spaces, then each
-- holder's fields as live gives them, each written as its length, ':' and
-- the field. A holder watch applies the changes in the counter's order and
-- ends at a gap.
local function announcement(counter, what, lock, holders, info)
  local seq = redis.call('incr', counter)
  local n = redis.call('exists', lock)
  if n == 0 and redis.call('exists', holders) == 1 then
    n = redis.call('zcount', holders, '(' .. int(clock()), '+inf')
  end
  if n > maxCarried then
    return what .. ' ' .. int(seq) .. ' -1 '
  end
  local hs = live(lock, holders, info)
  local parts = {what .. ' ' .. int(seq) .. ' ' .. #hs .. ' '}
  for _, h in ipairs(hs) do
    for _, f in ipairs(h) do
      if type(f) == 'number' then
        f = int(f)
      end
      parts[#parts + 1] = #f .. ':' .. f
    end
  end
  return table.concat(parts)
end

-- publish sends msg on channel ch. Sharded pub/sub keeps the message on the
-- key's shard in a cluster; servers before 7.0 lack SPUBLISH and get a
-- classic PUBLISH (their subscribers use SUBSCRIBE). A failure to publish
-- (an ACL without channel rights) must not fail the change, which has
-- happened: waiters then wait out the lease, and watches cannot start.
local function publish(ch, msg)
  local r = redis.pcall('spublish', ch, msg)
  if type(r) == 'table' and r.err then
    redis.pcall('publish', ch, msg)
  end
end

-- wake publishes a release (an announcement) on the key's release channel
-- ch, which its waiters and its watches subscribe to.
local function wake(ch, msg)
  publish(ch, msg)
end

-- changed publishes a change that helps no waiter (a grant, a metadata
-- change, a shared release that leaves other readers; an announcement) on
-- the key's change channel ch, which only its watches subscribe to: waiters
-- are not woken to race for a key that was just taken.
local function changed(ch, msg)
  publish(ch, msg)
end
