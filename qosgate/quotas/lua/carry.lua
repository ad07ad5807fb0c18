-- Add to one tenant's windows and in-flight set what a gateway admitted that
-- the store does not have: all it holds, when the store lost its data ('whole'),
-- or what it admitted on its own limiter while the store was unreachable
-- ('add').
-- A whole carry also holds the tenant's reservations back for a moment
-- (until the time in the recovery key), so that the other gateways holding some of its windows,
-- which see the loss at their next call, carry theirs in before anyone
-- reserves on a window that lacks them.
-- KEYS: the generation key, the in-flight set, the recovery key, then one
--   hash per rule.
-- ARGV: mode ('whole'/'add'), the generation the caller knows, a fresh
--   generation to start if there is none, the generation's ttl_ms, lease end,
--   lease ttl_ms, the end of the recovery (0: none), number of ids, the ids,
--   then per rule: ttl_ms,
--   number of pairs, slot, amount, ...
-- Returns JSON: {gen}, or {stale = 1} when an 'add' finds the store lost its
--   data (the caller then carries the whole).
local gkey, ckey = KEYS[1], KEYS[2]
local gen = redis.call('GET', gkey)
if ARGV[1] == 'add' and gen ~= ARGV[2] then
  return cjson.encode({stale = 1})
end
if not gen then
  gen = ARGV[3]
  redis.call('SET', gkey, gen, 'PX', tonumber(ARGV[4]))
elseif redis.call('PTTL', gkey) < tonumber(ARGV[4]) then
  redis.call('PEXPIRE', gkey, tonumber(ARGV[4]))
end
local recover_until = tonumber(ARGV[7])
if ARGV[1] == 'whole' and recover_until > 0 then
  local current = tonumber(redis.call('GET', KEYS[3]) or '0')
  if recover_until > current then
    -- The expiry only tidies up: the end is read against the caller's clock.
    redis.call('SET', KEYS[3], ARGV[7], 'PX', 60000)
  end
end
local at = 9
local nids = tonumber(ARGV[8])
for i = at, at + nids - 1 do
  redis.call('ZADD', ckey, ARGV[5], ARGV[i])
end
if nids > 0 and redis.call('PTTL', ckey) < tonumber(ARGV[6]) then
  redis.call('PEXPIRE', ckey, tonumber(ARGV[6]))
end
at = at + nids
for r = 4, #KEYS do
  local ttl = tonumber(ARGV[at])
  local n = tonumber(ARGV[at + 1])
  for i = at + 2, at + 2 * n, 2 do
    -- A refund of what an earlier carry brought can come as a negative amount.
    if redis.call('HINCRBY', KEYS[r], ARGV[i], ARGV[i + 1]) <= 0 then
      redis.call('HDEL', KEYS[r], ARGV[i])
    end
  end
  if n > 0 and redis.call('PTTL', KEYS[r]) < ttl then redis.call('PEXPIRE', KEYS[r], ttl) end
  at = at + 2 + 2 * n
end
return cjson.encode({gen = gen})
