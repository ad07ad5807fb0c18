-- Shared by every fleet script (qosgate/fleet/redis_store.py prepends it).
-- Every script gets the same KEYS (the fields in redis_store._FIELDS, then
-- per tier in FleetTiers order its queue, lane, backlog, counter and qcharge
-- keys, each kind in a block of n) and, from some ARGV index, the tier args:
-- n, the names, fair, the inflow time constant, the reserved slots, then per
-- tier its priority, budget ('' for none), delays (1/0), min_share, age
-- floor and door (1/0: a fair tier that admits by prediction, FleetTiers.doors).
-- T.top is the top level (the least priority value).
local K_TIER, K_TENANT, K_ARRIVAL, K_ATTEMPT, K_PAYLOAD = 1, 2, 3, 4, 5
local K_HOLDER, K_NODE, K_EXPIRY, K_DONE, K_TOKEN = 6, 7, 8, 9, 10
local K_AFFKEY, K_BOUND, K_BOUND_AT, K_ROOM, K_SEEN = 11, 12, 13, 14, 15
local K_CHARGE, K_LANE, K_SERVED, K_WORK, K_QWORK = 16, 17, 18, 19, 20
local K_RATE, K_INFLOW, K_INFLOW_AT, K_CREDIT, K_PROMPT = 21, 22, 23, 24, 25
local K_PHELD = 26
local F = 26
local T = {}
local function tier_args(at)
  local n = tonumber(ARGV[at])
  T.n, T.names, T.q, T.lane, T.backlog, T.counter, T.qcharge = n, {}, {}, {}, {}, {}, {}
  T.prio, T.budget, T.delays, T.share, T.floor, T.door = {}, {}, {}, {}, {}, {}
  for i = 1, n do
    local name = ARGV[at + i]
    T.names[i] = name
    T.q[name] = KEYS[F + i]
    T.lane[name] = KEYS[F + n + i]
    T.backlog[name] = KEYS[F + 2 * n + i]
    T.counter[name] = KEYS[F + 3 * n + i]
    T.qcharge[name] = KEYS[F + 4 * n + i]
  end
  T.fair = ARGV[at + n + 1] == '1'
  T.tau = tonumber(ARGV[at + n + 2])
  T.reserve = tonumber(ARGV[at + n + 3])
  for i = 1, n do
    local name, j = T.names[i], at + n + 4 + 6 * (i - 1)
    T.prio[name] = tonumber(ARGV[j])
    if T.top == nil or T.prio[name] < T.top then T.top = T.prio[name] end
    T.budget[name] = tonumber(ARGV[j + 1])
    T.delays[name] = ARGV[j + 2] == '1'
    T.share[name] = tonumber(ARGV[j + 3])
    T.floor[name] = tonumber(ARGV[j + 4])
    T.door[name] = ARGV[j + 5] == '1'
  end
  return at + n + 4 + 6 * n
end
-- A tenant's items in a fair tier's lane set: members `tenant \0 hex \0 id`,
-- all scored 0, so they sort by tenant, then arrival, then id.
local function lane_head(tier, tenant, skip)
  return redis.call('ZRANGEBYLEX', T.lane[tier], '[' .. tenant .. '\0', '(' .. tenant .. '\1',
                    'LIMIT', skip, 1)[1]
end
-- Amounts are strings (Python's repr): ZINCRBY adds them as doubles, exactly
-- as the memory store does; a Lua number would lose digits.
local function add_service(tier, tenant, amount)
  local counter = redis.call('ZINCRBY', T.counter[tier], amount, tenant)
  if redis.call('ZSCORE', T.backlog[tier], tenant) then
    redis.call('ZADD', T.backlog[tier], counter, tenant)
  end
  return counter
end
local function negated(amount)
  if string.sub(amount, 1, 1) == '-' then return string.sub(amount, 2) end
  return '-' .. amount
end
-- As MemoryWorkQueue._push: queue an item whose fields are set; a tenant
-- newly backlogged is lifted as core.fairness.lifted says. A door tier sums
-- each backlogged tenant's queued charges (from 0 when it becomes
-- backlogged), which its door reads.
local function push(id)
  local tier = redis.call('HGET', KEYS[K_TIER], id)
  redis.call('ZADD', T.q[tier], redis.call('HGET', KEYS[K_ARRIVAL], id), id)
  redis.call('HINCRBY', KEYS[K_QWORK], tier, redis.call('HGET', KEYS[K_WORK], id))
  if not T.fair then return end
  local tenant = redis.call('HGET', KEYS[K_TENANT], id)
  if not redis.call('ZSCORE', T.backlog[tier], tenant) then
    local floor = redis.call('ZRANGE', T.backlog[tier], 0, 0, 'WITHSCORES')[2]
      or redis.call('ZSCORE', KEYS[K_SERVED], tier) or '0'
    local counter = redis.call('ZSCORE', T.counter[tier], tenant) or '0'
    if tonumber(counter) < tonumber(floor) then counter = floor end
    redis.call('ZADD', T.counter[tier], counter, tenant)
    redis.call('ZADD', T.backlog[tier], counter, tenant)
    if T.door[tier] then redis.call('ZADD', T.qcharge[tier], 0, tenant) end
  end
  redis.call('ZADD', T.lane[tier], 0, redis.call('HGET', KEYS[K_LANE], id))
  if T.door[tier] then
    redis.call('ZINCRBY', T.qcharge[tier], redis.call('HGET', KEYS[K_CHARGE], id), tenant)
  end
end
local function unqueue(id, tier)
  redis.call('ZREM', T.q[tier], id)
  -- An emptied tier's share credit starts again from 0 (model.settle_shares).
  if redis.call('ZCARD', T.q[tier]) == 0 then redis.call('HDEL', KEYS[K_CREDIT], tier) end
  -- 0 - x, not -x: Lua writes -0 as '-0', which HINCRBY refuses.
  redis.call('HINCRBY', KEYS[K_QWORK], tier, 0 - tonumber(redis.call('HGET', KEYS[K_WORK], id)))
  if not T.fair then return end
  redis.call('ZREM', T.lane[tier], redis.call('HGET', KEYS[K_LANE], id))
  local tenant = redis.call('HGET', KEYS[K_TENANT], id)
  if not lane_head(tier, tenant, 0) then
    redis.call('ZREM', T.backlog[tier], tenant)
    -- Emptied: what is left of the sum is rounding.
    if T.door[tier] then redis.call('ZREM', T.qcharge[tier], tenant) end
  elseif T.door[tier] then
    redis.call('ZINCRBY', T.qcharge[tier], negated(redis.call('HGET', KEYS[K_CHARGE], id)), tenant)
  end
end
-- model.settle_shares (core.ordering.share_credit for each tier with a
-- share and work queued) after `work` tokens of `taken` went to a node;
-- none for a tier with a latency objective (core.ordering.settles_shares).
local function settle_shares(taken, work)
  if T.budget[taken] and not T.delays[taken] then return end
  for i = 1, T.n do
    local name = T.names[i]
    local share = T.share[name]
    if share > 0 and redis.call('ZCARD', T.q[name]) > 0 then
      local credit = tonumber(redis.call('HGET', KEYS[K_CREDIT], name) or '0')
      if name ~= taken then
        credit = credit + share * work
      else
        credit = credit + share * work - work
        if not (credit > 0) then credit = 0 end
      end
      redis.call('HSET', KEYS[K_CREDIT], name, string.format('%.17g', credit))
    end
  end
end
local function requeue(id)
  redis.call('HDEL', KEYS[K_HOLDER], id)
  redis.call('HDEL', KEYS[K_NODE], id)
  redis.call('ZREM', KEYS[K_EXPIRY], id)
  redis.call('HINCRBY', KEYS[K_ATTEMPT], id, 1)
  if T.fair then
    -- The lost run's charge is refunded, as the in-process scheduler does.
    add_service(redis.call('HGET', KEYS[K_TIER], id), redis.call('HGET', KEYS[K_TENANT], id),
                negated(redis.call('HGET', KEYS[K_CHARGE], id)))
  end
  push(id)
end
local function forget(id)
  for _, k in ipairs({K_TIER, K_TENANT, K_ARRIVAL, K_ATTEMPT, K_PAYLOAD, K_HOLDER, K_NODE,
                      K_AFFKEY, K_CHARGE, K_LANE, K_WORK, K_PROMPT}) do
    redis.call('HDEL', KEYS[k], id)
  end
  redis.call('ZREM', KEYS[K_EXPIRY], id)
end
local function holds(id, token)
  return redis.call('HGET', KEYS[K_HOLDER], id) == token
end
-- As MemoryWorkQueue._set_room / _wake_if_full.
local function anything_queued()
  for i = 1, T.n do
    if redis.call('ZCARD', T.q[T.names[i]]) > 0 then return true end
  end
  return false
end
local function wake_if_full(before, room, wake)
  if before > 0 and room <= 0 and anything_queued() then
    redis.call('PUBLISH', wake, '1')
  end
end
-- A run's slot is free again: its node's record says so at once.
local function give_slot_back(holder)
  if redis.call('HEXISTS', KEYS[K_ROOM], holder) == 1 then
    redis.call('HINCRBY', KEYS[K_ROOM], holder, 1)
  end
end
local function set_room(node, room, live_until, rate, wake)
  local before = tonumber(redis.call('HGET', KEYS[K_ROOM], node) or '0')
  redis.call('HSET', KEYS[K_ROOM], node, room)
  redis.call('HSET', KEYS[K_RATE], node, rate)
  redis.call('ZADD', KEYS[K_SEEN], live_until, node)
  wake_if_full(before, room, wake)
end
-- core.admission.ArrivalRate.add, operation for operation (atomic with the
-- enqueue, so that no arrival is lost); `now` is a repr string. The sum is
-- stored with %.17g, which reads back exactly.
local function inflow_add(tier, tokens, now)
  local last = redis.call('HGET', KEYS[K_INFLOW_AT], tier)
  local sum = tonumber(redis.call('HGET', KEYS[K_INFLOW], tier) or '0')
  if not last then
    redis.call('HSET', KEYS[K_INFLOW_AT], tier, now)
  elseif tonumber(now) > tonumber(last) then
    sum = sum * math.exp((tonumber(last) - tonumber(now)) / T.tau)
    redis.call('HSET', KEYS[K_INFLOW_AT], tier, now)
  end
  redis.call('HSET', KEYS[K_INFLOW], tier, string.format('%.17g', sum + tokens))
end
