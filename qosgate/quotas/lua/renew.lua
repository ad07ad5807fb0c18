-- Renew the concurrency lease of every running request named, all tenants in
-- one call, and check that the store still has each tenant's generation.
-- KEYS: per tenant, its in-flight set then its generation key.
-- ARGV: now, lease_s, generation ttl_ms, then per tenant: the generation the
--   caller knows, how many ids, the ids.
-- Returns JSON: {lost = per tenant, the ids whose lease had ended (not taken
--   back); stale = the 1-based tenants whose generation changed: the store
--   lost their data, so nothing of theirs is renewed and the caller carries
--   its own back}.
local now = tonumber(ARGV[1])
local lease = tonumber(ARGV[2])
local gen_ttl = tonumber(ARGV[3])
local until_ = string.format('%.17g', now + lease)
local ttl = math.ceil(lease * 1000)
local at = 4
local lost, stale = {}, {}
for t = 1, #KEYS / 2 do
  local key, gkey = KEYS[2 * t - 1], KEYS[2 * t]
  local known = ARGV[at]
  local n = tonumber(ARGV[at + 1])
  local gone = {}
  if redis.call('GET', gkey) ~= known then
    stale[#stale + 1] = t
  else
    if redis.call('PTTL', gkey) < gen_ttl then redis.call('PEXPIRE', gkey, gen_ttl) end
    if n > 0 then
      redis.call('ZREMRANGEBYSCORE', key, '-inf', now)
      for i = at + 2, at + 1 + n do
        local held = redis.call('ZSCORE', key, ARGV[i])
        if held then
          if tonumber(held) < now + lease then redis.call('ZADD', key, 'XX', until_, ARGV[i]) end
        else
          gone[#gone + 1] = ARGV[i]
        end
      end
      if redis.call('PTTL', key) < ttl then redis.call('PEXPIRE', key, ttl) end
    end
  end
  lost[t] = gone
  at = at + n + 2
end
return cjson.encode({lost = lost, stale = stale})
