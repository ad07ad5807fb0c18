-- Check every limit of one tenant and reserve under all of them, or nothing.
-- KEYS: one hash per rate rule (in ARGV's order), the in-flight set, the
--   tenant's generation key, its recovery key.
-- ARGV: now, request id, lease_s, slots, number of rules, max_concurrency
--   (0: none), write (1: reserve, 0: only read), the generation the caller
--   knows ('' if none), a fresh generation to start if there is none, whether
--   the caller holds admissions of this tenant that a store which lost its
--   data would not have (1/0), the generation key's ttl_ms, then per rule:
--   need, limit, burst, period_s, ttl_ms. A caller that must be able to
--   settle the reservation after a restart adds one more key (the
--   reservation's record) and, after the rules, what to record and its ttl_ms:
--   the record holds that and the generation, until it is settled.
-- Returns JSON: {ok, failed (1-based rule, -1 for concurrency, 0 none),
--   rules: [[slot, amount, ...], level], inflight, gen}, or {stale = 1} when
--   the store lost this tenant's data and the caller must carry its own back
--   first, or {recovering = seconds left} while the gateways carry theirs back after a
--   loss (nothing is written then).
local function num(x) return string.format('%.17g', x) end
local now = tonumber(ARGV[1])
local rid = ARGV[2]
local lease = tonumber(ARGV[3])
local nslots = tonumber(ARGV[4])
local nrules = tonumber(ARGV[5])
local conc_max = tonumber(ARGV[6])
local write = ARGV[7] == '1'
local known = ARGV[8]
local fresh = ARGV[9]
local holding = ARGV[10] == '1'
local gen_ttl = tonumber(ARGV[11])
local ckey = KEYS[nrules + 1]
local gkey = KEYS[nrules + 2]
local rkey = KEYS[nrules + 3]

local gen = redis.call('GET', gkey)
if write then
  if gen ~= known and holding then
    return cjson.encode({stale = 1})
  end
  local recover_until = tonumber(redis.call('GET', rkey) or '0')
  if recover_until > now then
    return cjson.encode({recovering = recover_until - now})
  end
  if not gen then
    gen = fresh
    redis.call('SET', gkey, gen, 'PX', gen_ttl)
  end
end

local rules = {}
local failed = 0
for r = 1, nrules do
  local base = 11 + (r - 1) * 5
  local need = tonumber(ARGV[base + 1])
  local limit = tonumber(ARGV[base + 2])
  local burst = tonumber(ARGV[base + 3])
  local period = tonumber(ARGV[base + 4])
  local ttl = tonumber(ARGV[base + 5])
  local key = KEYS[r]
  local width = period / nslots
  local slot = math.floor(now / width)
  local oldest = slot - nslots
  local flat = redis.call('HGETALL', key)
  local used, pairs_, level, level_at = 0, {}, nil, now
  for i = 1, #flat, 2 do
    local f, v = flat[i], tonumber(flat[i + 1])
    if f == 'lvl' then level = v
    elseif f == 'at' then level_at = v
    else
      local k = tonumber(f)
      if k < oldest then
        if write then redis.call('HDEL', key, f) end
      else
        used = used + v
        pairs_[#pairs_ + 1] = k
        pairs_[#pairs_ + 1] = v
      end
    end
  end
  if level == nil then level = burst
  else level = math.min(burst, level + (now - level_at) * limit / period) end
  local bucketed = burst < limit
  if failed == 0 and (used + need > limit or (bucketed and level < need)) then
    failed = r
  end
  rules[r] = {key = key, need = need, slot = slot, used = used, pairs_ = pairs_,
              level = level, bucketed = bucketed, ttl = ttl}
end

local inflight = 0
if conc_max > 0 then
  if write then redis.call('ZREMRANGEBYSCORE', ckey, '-inf', now) end
  inflight = redis.call('ZCOUNT', ckey, '(' .. now, '+inf')
  if failed == 0 and inflight >= conc_max then failed = -1 end
end

local ok = 0
if write and failed == 0 then
  ok = 1
  for r = 1, nrules do
    local rule = rules[r]
    redis.call('HINCRBY', rule.key, num(rule.slot), rule.need)
    local merged = false
    for i = 1, #rule.pairs_, 2 do
      if rule.pairs_[i] == rule.slot then
        rule.pairs_[i + 1] = rule.pairs_[i + 1] + rule.need
        merged = true
      end
    end
    if not merged then
      rule.pairs_[#rule.pairs_ + 1] = rule.slot
      rule.pairs_[#rule.pairs_ + 1] = rule.need
    end
    rule.used = rule.used + rule.need
    if rule.bucketed then
      rule.level = rule.level - rule.need
      redis.call('HSET', rule.key, 'lvl', num(rule.level), 'at', num(now))
    end
    redis.call('PEXPIRE', rule.key, rule.ttl)
  end
  if conc_max > 0 then
    redis.call('ZADD', ckey, now + lease, rid)
    redis.call('PEXPIRE', ckey, math.ceil(lease * 1000))
    inflight = inflight + 1
  end
  if #KEYS == nrules + 4 then
    redis.call('SET', KEYS[nrules + 4], ARGV[#ARGV - 1] .. ' ' .. gen, 'PX', tonumber(ARGV[#ARGV]))
  end
  -- The generation outlives every key of the tenant it marks.
  if redis.call('PTTL', gkey) < gen_ttl then redis.call('PEXPIRE', gkey, gen_ttl) end
end

local out = {}
for r = 1, nrules do
  out[r] = {rules[r].pairs_, num(rules[r].level)}
end
return cjson.encode({ok = ok, failed = failed, rules = out, inflight = inflight,
                     gen = gen or ''})
