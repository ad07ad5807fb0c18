-- End one reservation: move its rate windows by what it did not use (or used
-- beyond), and free its concurrency slot.
-- KEYS: one hash per rule that moves, the in-flight set, the tenant's
--   generation key.
-- ARGV: now, request id, the generation the reservation was made in (or
--   carried into), number of rules, then per rule: slot, delta, limit, burst,
--   period_s, ttl_ms.
-- A reservation from a generation the store no longer has moves no window:
-- the gateway that made it carried what it stood at into the new one.
-- A recorded reservation (reserve.lua) adds its record's key after those:
-- it is settled only while its record is there, and the record goes with
-- it, so that settling it again (after a restart) changes nothing.
local function num(x) return string.format('%.17g', x) end
local now = tonumber(ARGV[1])
local rid = ARGV[2]
local made_in = ARGV[3]
local nrules = tonumber(ARGV[4])
if #KEYS == nrules + 3 and redis.call('DEL', KEYS[nrules + 3]) == 0 then
  return 0
end
if redis.call('GET', KEYS[nrules + 2]) == made_in then
  for r = 1, nrules do
    local base = 4 + (r - 1) * 6
    local slot = ARGV[base + 1]
    local delta = tonumber(ARGV[base + 2])
    local limit = tonumber(ARGV[base + 3])
    local burst = tonumber(ARGV[base + 4])
    local period = tonumber(ARGV[base + 5])
    local ttl = tonumber(ARGV[base + 6])
    local key = KEYS[r]
    if redis.call('HEXISTS', key, slot) == 1 then
      local value = redis.call('HINCRBY', key, slot, delta)
      if value <= 0 then redis.call('HDEL', key, slot) end
    end
    if burst < limit then
      local level = tonumber(redis.call('HGET', key, 'lvl') or burst)
      local at = tonumber(redis.call('HGET', key, 'at') or now)
      level = math.min(burst, level + (now - at) * limit / period)
      level = math.min(burst, level - delta)
      redis.call('HSET', key, 'lvl', num(level), 'at', num(now))
      redis.call('PEXPIRE', key, ttl)
    end
  end
end
redis.call('ZREM', KEYS[nrules + 1], rid)
return 1
