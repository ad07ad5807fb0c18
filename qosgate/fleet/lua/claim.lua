-- ARGV: now, node, max_items, expires_at, interval_s, max_boost, done
-- horizon, affinity horizon, wake channel, drain rate (milli), the node's
-- prompt tokens in prefill, its prefill budget and delay tiers' pace ('' for
-- none), the slots it keeps for the top level's expected arrivals on top of
-- the tiers' reserve (core.arrivals_hold), then the tier args. Returns {leases, held back until ('' for none),
-- 1 if it stopped at the node's reserved slots, 1 if it held work for the
-- prefill budget, 1 if for the pace}, one [id, tier,
-- tenant, arrival, payload, attempt, token, affinity key, charge, where its
-- key was bound (0: nowhere, 1: this node, 2: another), work, prompt] per
-- lease. The tier choice restates core.ordering.pick_tier (with the tiers'
-- share credits), the stop at the node's reserved slots
-- core.ordering.reserve_holds, what waits for a first token
-- core.ordering.prefill_holds, and the rest MemoryWorkQueue.claim
-- (tests/test_fleet_rules_differential.py).
local BACKLOG_PAGE = 8
local now = tonumber(ARGV[1])
local node = ARGV[2]
local max_items = tonumber(ARGV[3])
local expires_at = ARGV[4]
local interval = tonumber(ARGV[5])
local max_boost = tonumber(ARGV[6])
redis.call('ZREMRANGEBYSCORE', KEYS[K_DONE], '-inf', '(' .. ARGV[7])
for _, key in ipairs(redis.call('ZRANGEBYSCORE', KEYS[K_BOUND_AT], '-inf', '(' .. ARGV[8])) do
  redis.call('HDEL', KEYS[K_BOUND], key)
end
redis.call('ZREMRANGEBYSCORE', KEYS[K_BOUND_AT], '-inf', '(' .. ARGV[8])
for _, other in ipairs(redis.call('ZRANGEBYSCORE', KEYS[K_SEEN], '-inf', ARGV[1])) do
  redis.call('HDEL', KEYS[K_ROOM], other)
  redis.call('HDEL', KEYS[K_RATE], other)
  redis.call('HDEL', KEYS[K_PHELD], other)
end
redis.call('ZREMRANGEBYSCORE', KEYS[K_SEEN], '-inf', ARGV[1])
local wake = ARGV[9]
local prefilling = tonumber(ARGV[11])
local prefill_budget, prefill_pace = tonumber(ARGV[12]), tonumber(ARGV[13])
local held_slots = tonumber(ARGV[14])
tier_args(15)
held_slots = held_slots + T.reserve
-- core.ordering.prefill_full
local function prefill_full(limit, prompt)
  return limit ~= nil and prefilling > 0 and prefilling + prompt > limit
end
local held, paced = 0, 0

for _, id in ipairs(redis.call('ZRANGEBYSCORE', KEYS[K_EXPIRY], '-inf', ARGV[1])) do
  requeue(id)
end

-- How many more items each other live node has room for.
local reserve = {}
local rooms = redis.call('HGETALL', KEYS[K_ROOM])
for j = 1, #rooms, 2 do
  local room = tonumber(rooms[j + 1])
  if rooms[j] ~= node and room > 0 then reserve[rooms[j]] = room end
end
local held_until = nil
local at_reserve = 0
-- Items held back so far per lane (a tier, or a tier's tenant when fair):
-- always the first ones of their lane.
local skipped = {}
local passed = {}

local out = {}
while #out < max_items do
  local best, best_owed, best_level, best_prio, best_head
  -- the same order without shares, which holds while a tier with a latency
  -- objective has work here (core.ordering.pick_tier)
  local plain, plain_level, plain_prio, plain_head
  local latency_waiting = false
  for i = 1, T.n do
    local name = T.names[i]
    local head = (not passed[name]) and redis.call('ZRANGE', T.q[name], 0, 0)[1]
    if head then
      local arrival = tonumber(redis.call('HGET', KEYS[K_ARRIVAL], head))
      local prio, budget = T.prio[name], T.budget[name]
      local boost = 0
      if max_boost > 0 and T.delays[name] and budget then
        local over = now - arrival - budget
        if over >= interval then
          boost = math.floor(over / interval)
          if boost > max_boost then boost = max_boost end
        end
      end
      -- core.ordering.tier_level, share_owed and pick_tier's order
      local level = prio - boost
      if level < T.floor[name] then level = T.floor[name] end
      local credit = tonumber(redis.call('HGET', KEYS[K_CREDIT], name) or '0')
      local owed = credit > 0 and credit >= tonumber(redis.call('HGET', KEYS[K_WORK], head))
      if best == nil or (owed and not best_owed) or (owed == best_owed and (level < best_level
          or (level == best_level and (arrival < best_head
              or (arrival == best_head and prio < best_prio))))) then
        best, best_owed, best_level, best_prio, best_head = i, owed, level, prio, arrival
      end
      if plain == nil or level < plain_level or (level == plain_level and (arrival < plain_head
          or (arrival == plain_head and prio < plain_prio))) then
        plain, plain_level, plain_prio, plain_head = i, level, prio, arrival
      end
      if budget and not T.delays[name] then latency_waiting = true end
    end
  end
  if best == nil then break end
  if latency_waiting then best, best_level = plain, plain_level end
  -- core.ordering.reserve_holds: the node's last free slots are for the top level
  if best_level > T.top and max_items - #out <= held_slots then
    at_reserve = 1
    break
  end
  local tier = T.names[best]
  local id, lane
  if T.fair and not T.door[tier] then
    -- A page of backlogged tenants at a time, least served first: the first
    -- one almost always has an item to take, and reading the whole backlog
    -- for every item would cost a claim O(tenants) per item.
    local from = 0
    repeat
      local page = redis.call('ZRANGE', T.backlog[tier], from, from + BACKLOG_PAGE - 1)
      for _, tenant in ipairs(page) do
        lane = tier .. '\0' .. tenant
        local member = lane_head(tier, tenant, skipped[lane] or 0)
        if member then
          id = string.sub(member, #tenant + 19)
          break
        end
      end
      from = from + BACKLOG_PAGE
    until id or #page < BACKLOG_PAGE
  else
    -- By arrival (a door tier's counters act at its door).
    lane = tier
    id = redis.call('ZRANGE', T.q[tier], skipped[lane] or 0, skipped[lane] or 0)[1]
  end
  if not id then
    passed[tier] = true
  else
    local key = redis.call('HGET', KEYS[K_AFFKEY], id)
    local owner = key and redis.call('HGET', KEYS[K_BOUND], key)
    if owner and owner ~= node and (reserve[owner] or 0) > 0 then
      reserve[owner] = reserve[owner] - 1
      skipped[lane] = (skipped[lane] or 0) + 1
      local live_until = redis.call('ZSCORE', KEYS[K_SEEN], owner)
      if held_until == nil or tonumber(live_until) < tonumber(held_until) then
        held_until = live_until
      end
    else
      local prompt = tonumber(redis.call('HGET', KEYS[K_PROMPT], id) or '0')
      local latency = T.budget[tier] and not T.delays[tier]
      -- core.ordering.prefill_holds
      if best_level > T.top and (held == 1 or prefill_full(prefill_budget, prompt)) then
        held = 1
        passed[tier] = true
      elseif not latency and (paced == 1 or prefill_full(prefill_pace, prompt)) then
        paced = 1
        passed[tier] = true
      else
        prefilling = prefilling + prompt
        unqueue(id, tier)
        settle_shares(tier, tonumber(redis.call('HGET', KEYS[K_WORK], id)))
        local charge = redis.call('HGET', KEYS[K_CHARGE], id)
        if T.fair then
          local counter = add_service(tier, redis.call('HGET', KEYS[K_TENANT], id), charge)
          redis.call('ZADD', KEYS[K_SERVED], counter, tier)
        end
        local bound = 0
        if owner then
          bound = 2
          if owner == node then bound = 1 end
        end
        if key then
          if not (owner and redis.call('ZSCORE', KEYS[K_SEEN], owner)) then owner = node end
          redis.call('HSET', KEYS[K_BOUND], key, owner)
          redis.call('ZADD', KEYS[K_BOUND_AT], ARGV[1], key)
        end
        local token = redis.call('INCR', KEYS[K_TOKEN])
        redis.call('HSET', KEYS[K_HOLDER], id, token)
        redis.call('HSET', KEYS[K_NODE], id, node)
        redis.call('ZADD', KEYS[K_EXPIRY], expires_at, id)
        out[#out + 1] = {id, tier, redis.call('HGET', KEYS[K_TENANT], id),
                         redis.call('HGET', KEYS[K_ARRIVAL], id),
                         redis.call('HGET', KEYS[K_PAYLOAD], id),
                         redis.call('HGET', KEYS[K_ATTEMPT], id), token, key or '', charge, bound,
                         redis.call('HGET', KEYS[K_WORK], id), prompt}
      end
    end
  end
end
set_room(node, max_items - #out, expires_at, ARGV[10], wake)
-- Held back below the top level, for the prefill budget or at the reserved
-- slots: the node's room is the top level's only (MemoryWorkQueue._top_only).
if held == 1 or at_reserve == 1 then
  redis.call('HSET', KEYS[K_PHELD], node, 1)
else
  redis.call('HDEL', KEYS[K_PHELD], node)
end
return {out, held_until or '', at_reserve, held, paced}
