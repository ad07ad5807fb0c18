"""The fleet work queue in Redis: many gateways enqueue, many engine nodes claim.

Claim (reclaim expired leases, pick a tier, lease), renew, complete, release
and enqueue are each one Lua script, so two nodes can never lease one item
and a stale holder can never complete an item someone else now holds. The
scripts do only that; everything else (building items, depth, status) is
plain commands.

Keys, all under `{<prefix>}fleet:` (the braces put them in one cluster slot,
which the scripts need since they touch every tier):
  q:<tier>  sorted set, item id -> arrival
  tier, tenant, arrival, attempt, payload   hashes, item id -> field
  holder, node   hashes, item id -> fencing token / node of the live lease
  expiry    sorted set, item id -> lease end
  done      sorted set of ended ids -> when (what refuses a duplicate
            enqueue), trimmed to the retention at each claim
  token     counter of fencing tokens
  affkey    hash, item id -> its affinity key (items that have one)
  bound, bound_at   hash affinity key -> node / sorted set key -> when bound,
            trimmed to the affinity TTL at each claim
  room, seen   hash node -> free slots / sorted set node -> live until
  charge, lane  hashes, item id -> its VTC charge / its member in lane:<tier>
  served    sorted set, tier -> the counter last served there
  lane:<tier>     fair tiers: sorted set of `tenant NUL arrival NUL id`
                  members, all scored 0, so a lexical range is one tenant's
                  items in order (model.lane_key)
  backlog:<tier>  fair tiers: sorted set, backlogged tenant -> counter
  counter:<tier>  sorted set, tenant -> virtual token counter
  work      hash, item id -> tokens it is expected to take
  qwork     hash, tier -> tokens of its queued items
  rate      hash, node -> tokens/s it drains when full, in thousandths
  inflow, inflow_at   hashes, tier -> its arrival-rate sum (written with
            %.17g, which reads back exactly) / the last arrival it counts
Arrivals and lease ends go in and out as Python's `repr` of the float, never
through a Lua number: Redis writes Lua numbers with 14 significant digits,
which would move a wall-clock time by up to a tenth of a millisecond and make
this store disagree with the memory one.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import math
from collections.abc import Callable, Iterable
from typing import Any

import redis.asyncio as aioredis
from redis.asyncio.retry import Retry
from redis.backoff import NoBackoff
from redis.exceptions import ConnectionError as RedisConnectionError
from redis.exceptions import RedisError
from redis.exceptions import TimeoutError as RedisTimeoutError

from .model import Claim, FleetLoad, FleetTiers, Lease, WorkItem, lane_key
from .store import (
    ItemStatus,
    WorkQueue,
    WorkQueueError,
    WorkQueueFull,
    WorkQueueOverloaded,
    milli,
)

log = logging.getLogger(__name__)

_CANCELLED: dict[int, ItemStatus | None] = {0: None, 1: "queued", 2: "leased", 3: "completed"}

RECONNECT_FIRST_S = 0.05
RECONNECT_MAX_S = 5.0
"""Backoff between attempts to subscribe again after losing a pub/sub channel."""

_FIELDS = (
    "tier",
    "tenant",
    "arrival",
    "attempt",
    "payload",
    "holder",
    "node",
    "expiry",
    "done",
    "token",
    "affkey",
    "bound",
    "bound_at",
    "room",
    "seen",
    "charge",
    "lane",
    "served",
    "work",
    "qwork",
    "rate",
    "inflow",
    "inflow_at",
)
# The prelude's K_* constants and F (the per-tier keys follow) assume this.
assert len(_FIELDS) == 23
_PER_TIER = ("q", "lane", "backlog", "counter")

# Every script gets the same KEYS (the fields above, then per tier in
# FleetTiers order its queue, lane, backlog and counter keys, each kind in a
# block of n) and, from some ARGV index, the tier args: n, the names, fair,
# the inflow time constant, then per tier its priority, budget ('' for none),
# delays (1/0) and admission (1/0).
_PRELUDE = r"""
local K_TIER, K_TENANT, K_ARRIVAL, K_ATTEMPT, K_PAYLOAD = 1, 2, 3, 4, 5
local K_HOLDER, K_NODE, K_EXPIRY, K_DONE, K_TOKEN = 6, 7, 8, 9, 10
local K_AFFKEY, K_BOUND, K_BOUND_AT, K_ROOM, K_SEEN = 11, 12, 13, 14, 15
local K_CHARGE, K_LANE, K_SERVED, K_WORK, K_QWORK = 16, 17, 18, 19, 20
local K_RATE, K_INFLOW, K_INFLOW_AT = 21, 22, 23
local F = 23
local T = {}
local function tier_args(at)
  local n = tonumber(ARGV[at])
  T.n, T.names, T.q, T.lane, T.backlog, T.counter = n, {}, {}, {}, {}, {}
  T.prio, T.budget, T.delays, T.admit = {}, {}, {}, {}
  for i = 1, n do
    local name = ARGV[at + i]
    T.names[i] = name
    T.q[name] = KEYS[F + i]
    T.lane[name] = KEYS[F + n + i]
    T.backlog[name] = KEYS[F + 2 * n + i]
    T.counter[name] = KEYS[F + 3 * n + i]
  end
  T.fair = ARGV[at + n + 1] == '1'
  T.tau = tonumber(ARGV[at + n + 2])
  for i = 1, n do
    local name, j = T.names[i], at + n + 3 + 4 * (i - 1)
    T.prio[name] = tonumber(ARGV[j])
    T.budget[name] = tonumber(ARGV[j + 1])
    T.delays[name] = ARGV[j + 2] == '1'
    T.admit[name] = ARGV[j + 3] == '1'
  end
  return at + n + 3 + 4 * n
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
-- Mirrors MemoryWorkQueue._push: queue an item whose fields are set.
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
  end
  redis.call('ZADD', T.lane[tier], 0, redis.call('HGET', KEYS[K_LANE], id))
end
local function unqueue(id, tier)
  redis.call('ZREM', T.q[tier], id)
  -- 0 - x, not -x: Lua writes -0 as '-0', which HINCRBY refuses.
  redis.call('HINCRBY', KEYS[K_QWORK], tier, 0 - tonumber(redis.call('HGET', KEYS[K_WORK], id)))
  if not T.fair then return end
  redis.call('ZREM', T.lane[tier], redis.call('HGET', KEYS[K_LANE], id))
  local tenant = redis.call('HGET', KEYS[K_TENANT], id)
  if not lane_head(tier, tenant, 0) then redis.call('ZREM', T.backlog[tier], tenant) end
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
                      K_AFFKEY, K_CHARGE, K_LANE, K_WORK}) do
    redis.call('HDEL', KEYS[k], id)
  end
  redis.call('ZREM', KEYS[K_EXPIRY], id)
end
local function holds(id, token)
  return redis.call('HGET', KEYS[K_HOLDER], id) == token
end
-- Mirrors MemoryWorkQueue._set_room / _wake_if_full.
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
-- Mirrors core.admission.ArrivalRate, operation for operation; `now` is a
-- repr string. The sum is stored with %.17g, which reads back exactly.
local function inflow_rate(tier, now)
  local last = redis.call('HGET', KEYS[K_INFLOW_AT], tier)
  if not last then return 0.0 end
  local sum = tonumber(redis.call('HGET', KEYS[K_INFLOW], tier))
  last, now = tonumber(last), tonumber(now)
  if now > last then sum = sum * math.exp((last - now) / T.tau) end
  return sum / T.tau
end
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
-- The live nodes' drain rate (tokens/s) and free slots, summed.
local function live_load(now)
  local drain, room = 0, 0
  for _, node in ipairs(redis.call('ZRANGEBYSCORE', KEYS[K_SEEN], '(' .. now, '+inf')) do
    drain = drain + tonumber(redis.call('HGET', KEYS[K_RATE], node) or '0')
    room = room + tonumber(redis.call('HGET', KEYS[K_ROOM], node) or '0')
  end
  return drain / 1000.0, room
end
-- Mirrors model.predicted_wait (nil: no live node reports a drain rate).
local function predicted_wait(tier, work, now, interval, max_boost)
  local drain, room = live_load(now)
  if drain <= 0 then return nil end
  local mine = T.prio[tier]
  local ahead = 0.0
  if room <= 0 then ahead = work end
  local inflow = 0.0
  for i = 1, T.n do
    local name = T.names[i]
    if T.prio[name] <= mine then
      ahead = ahead + tonumber(redis.call('HGET', KEYS[K_QWORK], name) or '0')
      if T.prio[name] < mine then inflow = inflow + inflow_rate(name, now) end
    elseif T.delays[name] and max_boost > 0 and T.budget[name] then
      -- Mirrors model._aged_work and core.scheduler.aged_work.
      local climb = T.prio[name] - mine
      local head = redis.call('ZRANGE', T.q[name], 0, 0, 'WITHSCORES')[2]
      if head and climb <= max_boost then
        local oldest, at = tonumber(head), tonumber(now)
        local threshold = at - T.budget[name] - climb * interval
        local span = at - oldest
        if not (oldest > threshold or span <= 0) then
          local rate = tonumber(redis.call('HGET', KEYS[K_QWORK], name) or '0') / span
          local aged = threshold - oldest
          if span < aged then aged = span end
          ahead = ahead + rate * aged
          inflow = inflow + rate
        end
      end
    end
  end
  if room > 0 then
    ahead = ahead - room * work
    if ahead < 0 then ahead = 0.0 end
  end
  if ahead <= 0 then return 0.0 end
  drain = drain - inflow
  if drain > 0 then return ahead / drain end
  return math.huge
end
"""

# ARGV: id, tier, tenant, arrival, payload, attempt, max_queued (0: no cap),
# wake channel, affinity key ('' for none), charge, lane member, work,
# interval_s, max_boost, then the tier args. Returns 1, 0 (duplicate), -1 (full) or {-2, the predicted
# wait} (refused by admission).
_ENQUEUE = (
    _PRELUDE
    + """
local id = ARGV[1]
tier_args(15)
if redis.call('HEXISTS', KEYS[K_TIER], id) == 1
    or redis.call('ZSCORE', KEYS[K_DONE], id) then
  return 0
end
local cap = tonumber(ARGV[7])
if cap > 0 and redis.call('ZCARD', T.q[ARGV[2]]) >= cap then
  return -1
end
local work = tonumber(ARGV[12])
if T.admit[ARGV[2]] and T.budget[ARGV[2]] then
  local predicted = predicted_wait(ARGV[2], work, ARGV[4], tonumber(ARGV[13]),
                                   tonumber(ARGV[14]))
  if predicted and predicted > T.budget[ARGV[2]] then
    return {-2, string.format('%.17g', predicted)}
  end
end
redis.call('HSET', KEYS[K_TIER], id, ARGV[2])
redis.call('HSET', KEYS[K_TENANT], id, ARGV[3])
redis.call('HSET', KEYS[K_ARRIVAL], id, ARGV[4])
redis.call('HSET', KEYS[K_PAYLOAD], id, ARGV[5])
redis.call('HSET', KEYS[K_ATTEMPT], id, ARGV[6])
if ARGV[9] ~= '' then redis.call('HSET', KEYS[K_AFFKEY], id, ARGV[9]) end
redis.call('HSET', KEYS[K_CHARGE], id, ARGV[10])
redis.call('HSET', KEYS[K_LANE], id, ARGV[11])
redis.call('HSET', KEYS[K_WORK], id, ARGV[12])
push(id)
inflow_add(ARGV[2], work, ARGV[4])
-- Names the tier, so that a full node can tell whether to preempt for it.
redis.call('PUBLISH', ARGV[8], 'q:' .. ARGV[2])
return 1
"""
)

# ARGV: now, node, max_items, expires_at, interval_s, max_boost, done horizon,
# affinity horizon, wake channel, drain rate (milli), then the tier args.
# Returns {leases, held back until ('' for none)}, one [id, tier,
# tenant, arrival, payload, attempt, token, affinity key, charge, where its
# key was bound (0: nowhere, 1: this node, 2: another), work] per lease.
# The tier choice is model.pick_tier and the rest MemoryWorkQueue.claim:
# change them together.
_CLAIM = (
    _PRELUDE
    + """
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
end
redis.call('ZREMRANGEBYSCORE', KEYS[K_SEEN], '-inf', ARGV[1])
local wake = ARGV[9]
tier_args(11)

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
-- Items held back so far per lane (a tier, or a tier's tenant when fair):
-- always the first ones of their lane.
local skipped = {}
local passed = {}

local out = {}
while #out < max_items do
  local best, best_level, best_prio, best_head
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
      local level = prio - boost
      if level < 0 then level = 0 end
      if best == nil or level < best_level
          or (level == best_level and (arrival < best_head
              or (arrival == best_head and prio < best_prio))) then
        best, best_level, best_prio, best_head = i, level, prio, arrival
      end
    end
  end
  if best == nil then break end
  local tier = T.names[best]
  local id, lane
  if T.fair then
    -- A page of backlogged tenants at a time, least served first: the first
    -- one almost always has an item to take, and reading the whole backlog
    -- for every item would cost a claim O(tenants) per item.
    local from = 0
    repeat
      local page = redis.call('ZRANGE', T.backlog[tier], from, from + BACKLOG_PAGE - 1)
      for _, tenant in ipairs(page) do
        lane = tier .. '\\0' .. tenant
        local member = lane_head(tier, tenant, skipped[lane] or 0)
        if member then
          id = string.sub(member, #tenant + 19)
          break
        end
      end
      from = from + BACKLOG_PAGE
    until id or #page < BACKLOG_PAGE
  else
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
      unqueue(id, tier)
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
                       redis.call('HGET', KEYS[K_WORK], id)}
    end
  end
end
set_room(node, max_items - #out, expires_at, ARGV[10], wake)
return {out, held_until or ''}
"""
)

# ARGV: node, room, live until, wake channel, drain rate (milli), then the
# tier args.
_HEARTBEAT = (
    _PRELUDE
    + """
tier_args(6)
set_room(ARGV[1], tonumber(ARGV[2]), ARGV[3], ARGV[5], ARGV[4])
"""
)

# ARGV: node, wake channel, then the tier args.
_LEAVE = (
    _PRELUDE
    + """
tier_args(3)
local before = tonumber(redis.call('HGET', KEYS[K_ROOM], ARGV[1]) or '0')
redis.call('HDEL', KEYS[K_ROOM], ARGV[1])
redis.call('HDEL', KEYS[K_RATE], ARGV[1])
redis.call('ZREM', KEYS[K_SEEN], ARGV[1])
wake_if_full(before, 0, ARGV[2])
"""
)

# ARGV: id, token, expires_at, then the tier args.
_RENEW = (
    _PRELUDE
    + """
if not holds(ARGV[1], ARGV[2]) then return 0 end
redis.call('ZADD', KEYS[K_EXPIRY], 'XX', ARGV[3], ARGV[1])
return 1
"""
)

# ARGV: id, token, reply channel ('' for none), reply message, correction of
# the tenant's counter ('' for none), then the tier args.
_COMPLETE = (
    _PRELUDE
    + """
local id = ARGV[1]
tier_args(6)
if not holds(id, ARGV[2]) then return 0 end
-- Before the gateway hears of the end (and perhaps sends the session's
-- next turn).
give_slot_back(redis.call('HGET', KEYS[K_NODE], id))
if T.fair and ARGV[5] ~= '' then
  add_service(redis.call('HGET', KEYS[K_TIER], id), redis.call('HGET', KEYS[K_TENANT], id),
              ARGV[5])
end
local ended = redis.call('ZSCORE', KEYS[K_EXPIRY], id)
forget(id)
redis.call('ZADD', KEYS[K_DONE], ended, id)
if ARGV[3] ~= '' then redis.call('PUBLISH', ARGV[3], ARGV[4]) end
return 1
"""
)

# ARGV: id, now, only_queued (1/0), then the tier args. Returns 1 (was
# queued), 2 (leased), 3 (completed) or 0 (unknown).
_CANCEL = (
    _PRELUDE
    + """
local id = ARGV[1]
tier_args(4)
local tier = redis.call('HGET', KEYS[K_TIER], id)
if tier then
  local was = 1
  if redis.call('HEXISTS', KEYS[K_HOLDER], id) == 1 then
    if ARGV[3] == '1' then return 2 end
    was = 2
  else
    unqueue(id, tier)
  end
  forget(id)
  redis.call('ZADD', KEYS[K_DONE], ARGV[2], id)
  return was
end
if redis.call('ZSCORE', KEYS[K_DONE], id) then return 3 end
return 0
"""
)

# ARGV: id, token, now, then the tier args. Mirrors MemoryWorkQueue.preempt.
_PREEMPT = (
    _PRELUDE
    + """
local id = ARGV[1]
tier_args(4)
if not holds(id, ARGV[2]) then return 0 end
local mine = T.prio[redis.call('HGET', KEYS[K_TIER], id)]
local urgent = 0
for i = 1, T.n do
  if T.prio[T.names[i]] < mine then urgent = urgent + redis.call('ZCARD', T.q[T.names[i]]) end
end
local _, room = live_load(ARGV[3])
if urgent <= room then return 0 end
local holder = redis.call('HGET', KEYS[K_NODE], id)
requeue(id)
give_slot_back(holder)
return 1
"""
)

# ARGV: id, token, then the tier args.
_RELEASE = (
    _PRELUDE
    + """
tier_args(3)
if not holds(ARGV[1], ARGV[2]) then return 0 end
requeue(ARGV[1])
return 1
"""
)


class RedisWorkQueue(WorkQueue):
    """Queues in Redis, shared by every gateway and engine node pointed at it."""

    name = "redis"

    def __init__(
        self,
        url: str,
        tiers: FleetTiers,
        *,
        key_prefix: str = "qosgate:",
        socket_timeout_s: float = 0.5,
        client: aioredis.Redis | None = None,
        done_retention_s: float = 86_400.0,
        affinity_ttl_s: float = 600.0,
    ) -> None:
        super().__init__(
            tiers, done_retention_s=done_retention_s, affinity_ttl_s=affinity_ttl_s
        )
        if client is None:
            # One retry on a fresh connection, so that a pooled connection the
            # server dropped (a restart) is not taken for an outage, as the
            # quota store does. A script that had in fact run before its
            # connection broke is refused the second time (an id enqueued
            # twice) or harmless (a claim's extra leases run out and go back).
            client = aioredis.Redis.from_url(
                url,
                socket_timeout=socket_timeout_s,
                socket_connect_timeout=socket_timeout_s,
                retry=Retry(NoBackoff(), retries=1),
                retry_on_error=[RedisConnectionError],
            )
        self._redis = client
        base = f"{{{key_prefix}}}fleet:"
        self.base = base
        """What every fleet key and channel name starts with."""
        self.wake_channel = base + "wake"
        """Published on every enqueue (`q:<tier>`), and when a node fills up
        while work is queued: idle engine nodes claim on it."""
        self._field = {name: base + name for name in _FIELDS}
        self._queue = {tier: f"{base}q:{tier}" for tier in tiers.names()}
        self._keys = [self._field[name] for name in _FIELDS]
        self._keys += [f"{base}{kind}:{tier}" for kind in _PER_TIER for tier in tiers.names()]
        self._counter = {tier: f"{base}counter:{tier}" for tier in tiers.names()}
        self._tier_args: list[Any] = [
            len(tiers.tiers), *tiers.names(), 1 if tiers.fair else 0, repr(tiers.inflow_tau_s),
        ]  # fmt: skip
        for tier in tiers.tiers:
            budget = "" if tier.budget_s is None else repr(tier.budget_s)
            self._tier_args += [tier.priority, budget, int(tier.delays), int(tier.admission)]
        self._enqueue = self._redis.register_script(_ENQUEUE)
        self._claim = self._redis.register_script(_CLAIM)
        self._renew = self._redis.register_script(_RENEW)
        self._complete = self._redis.register_script(_COMPLETE)
        self._release = self._redis.register_script(_RELEASE)
        self._preempt = self._redis.register_script(_PREEMPT)
        self._cancel = self._redis.register_script(_CANCEL)
        self._heartbeat = self._redis.register_script(_HEARTBEAT)
        self._leave = self._redis.register_script(_LEAVE)

    @property
    def redis(self) -> aioredis.Redis:
        """The client, for the fleet's pub/sub (which shares its pool)."""
        return self._redis

    async def subscribe(self, *channels: str) -> Any:
        """A pub/sub connection subscribed to `channels`; closed again if the
        subscription fails (a `Subscription` retries it with backoff)."""
        pubsub = self._redis.pubsub()
        try:
            await pubsub.subscribe(*channels)
        except BaseException:
            with contextlib.suppress(RedisError, OSError):
                await pubsub.aclose()
            raise
        return pubsub

    async def subscribers(self, channels: Iterable[str]) -> dict[str, int]:
        """How many connections subscribe to each channel now (PUBSUB NUMSUB):
        0 on a gateway's reply channel means nobody waits for its replies."""
        names = list(channels)
        if not names:
            return {}
        counts = await self._guard(self._redis.pubsub_numsub(*names))
        return {
            (name.decode() if isinstance(name, bytes) else name): int(count)
            for name, count in counts
        }

    async def _guard(self, call: Any) -> Any:
        try:
            return await call
        except (RedisConnectionError, RedisTimeoutError, OSError) as exc:
            raise WorkQueueError(f"redis unreachable: {exc}") from exc
        except RedisError as exc:
            raise WorkQueueError(f"redis failed: {exc}") from exc

    async def _run(self, script: Any, args: list[Any]) -> Any:
        return await self._guard(script(keys=self._keys, args=args))

    async def enqueue(self, item: WorkItem, *, max_queued: int | None = None) -> None:
        self._check_tier(item)
        args = [
            item.id, item.tier, item.tenant, repr(item.arrival), item.payload, item.attempt,
            max_queued or 0, self.wake_channel, item.affinity, repr(item.charge), lane_key(item),
            item.work, repr(self.tiers.interval_s), self.tiers.max_boost,
        ]  # fmt: skip
        result = await self._run(self._enqueue, [*args, *self._tier_args])
        if isinstance(result, list):
            budget = self.tiers.tier(item.tier).budget_s
            assert budget is not None
            raise WorkQueueOverloaded(item.tier, float(result[1]), budget)
        if result == 0:
            raise ValueError(f"duplicate work item id {item.id!r}")
        if result < 0:
            raise WorkQueueFull(f"tier {item.tier!r} holds {max_queued} queued items")

    async def cancel(
        self, item_id: str, now: float, *, only_queued: bool = False
    ) -> ItemStatus | None:
        args = [item_id, repr(now), 1 if only_queued else 0, *self._tier_args]
        was = await self._run(self._cancel, args)
        return _CANCELLED[int(was)]

    async def next_expiry(self) -> float | None:
        first = await self._guard(self._redis.zrange(self._field["expiry"], 0, 0, withscores=True))
        return float(first[0][1]) if first else None

    async def claim(
        self, node: str, max_items: int, now: float, lease_s: float, *, drain_rate: float = 0.0
    ) -> Claim:
        expires_at = now + lease_s
        args: list[Any] = [
            repr(now), node, max_items, repr(expires_at),
            repr(self.tiers.interval_s), self.tiers.max_boost,
            repr(now - self.done_retention_s), repr(now - self.affinity_ttl_s), self.wake_channel,
            milli(drain_rate), *self._tier_args,
        ]  # fmt: skip
        rows, held_until = await self._run(self._claim, args)
        leases = []
        home, away = set(), set()
        for row in rows:
            item_id, tier, tenant, arrival, payload, attempt, token, affinity, charge, bound, work = row
            item = WorkItem(
                id=item_id.decode(),
                tier=tier.decode(),
                tenant=tenant.decode(),
                arrival=float(arrival),
                payload=bytes(payload),
                attempt=int(attempt),
                affinity=affinity.decode(),
                charge=float(charge),
                work=int(work),
            )
            leases.append(Lease(item, node, int(token), expires_at))
            if bound:
                (home if bound == 1 else away).add(item.id)
        held_back_until = float(held_until) if held_until else None
        return Claim(leases, held_back_until, frozenset(home), frozenset(away))

    async def heartbeat(
        self, node: str, room: int, now: float, ttl_s: float, *, drain_rate: float = 0.0
    ) -> None:
        args = [
            node, max(0, room), repr(now + ttl_s), self.wake_channel, milli(drain_rate),
            *self._tier_args,
        ]  # fmt: skip
        await self._run(self._heartbeat, args)

    async def leave(self, node: str) -> None:
        await self._run(self._leave, [node, self.wake_channel, *self._tier_args])

    async def bound_node(self, key: str) -> str | None:
        node = await self._guard(self._redis.hget(self._field["bound"], key))
        return node.decode() if node is not None else None

    async def renew(self, lease: Lease, now: float, lease_s: float) -> Lease | None:
        expires_at = now + lease_s
        args = [lease.item.id, lease.token, repr(expires_at), *self._tier_args]
        if not await self._run(self._renew, args):
            return None
        return Lease(lease.item, lease.node, lease.token, expires_at)

    async def complete(
        self, lease: Lease, reply: tuple[str, bytes] | None = None, *, used: float | None = None
    ) -> bool:
        channel, message = reply if reply is not None else ("", b"")
        correction = "" if used is None else repr(used - lease.item.charge)
        args = [lease.item.id, lease.token, channel, message, correction, *self._tier_args]
        return bool(await self._run(self._complete, args))

    async def release(self, lease: Lease) -> bool:
        args = [lease.item.id, lease.token, *self._tier_args]
        return bool(await self._run(self._release, args))

    async def preempt(self, lease: Lease, now: float) -> bool:
        args = [lease.item.id, lease.token, repr(now), *self._tier_args]
        return bool(await self._run(self._preempt, args))

    async def counters(self, tier: str) -> dict[str, float]:
        rows = await self._guard(self._redis.zrange(self._counter[tier], 0, -1, withscores=True))
        return {tenant.decode(): float(score) for tenant, score in rows}

    async def load(self, now: float) -> FleetLoad:
        tiers = self.tiers.names()
        async with self._redis.pipeline(transaction=True) as pipe:
            pipe.hgetall(self._field["qwork"])
            pipe.hgetall(self._field["inflow"])
            pipe.hgetall(self._field["inflow_at"])
            pipe.zrangebyscore(self._field["seen"], f"({now!r}", "+inf")
            pipe.hgetall(self._field["rate"])
            pipe.hgetall(self._field["room"])
            for tier in tiers:
                pipe.zrange(self._queue[tier], 0, 0, withscores=True)
            work, sums, lasts, live, rates, rooms, *heads = await self._guard(pipe.execute())
        tau = self.tiers.inflow_tau_s
        inflow: dict[str, float] = {}
        for tier in tiers:
            last = lasts.get(tier.encode())
            if last is None:
                inflow[tier] = 0.0
                continue
            # As ArrivalRate.rate, on the stored sum.
            total, at = float(sums[tier.encode()]), float(last)
            inflow[tier] = (total * math.exp((at - now) / tau) if now > at else total) / tau
        return FleetLoad(
            queued_work={tier: int(work.get(tier.encode(), 0)) for tier in tiers},
            inflow=inflow,
            drain=sum(int(rates.get(node, 0)) for node in live) / 1000.0,
            room=sum(int(rooms.get(node, 0)) for node in live),
            oldest={tier: float(head[0][1]) for tier, head in zip(tiers, heads) if head},
        )

    async def depth(self) -> dict[str, int]:
        async with self._redis.pipeline(transaction=False) as pipe:
            for key in self._queue.values():
                pipe.zcard(key)
            counts = await self._guard(pipe.execute())
        return dict(zip(self._queue, map(int, counts)))

    async def leased(self) -> int:
        return int(await self._guard(self._redis.hlen(self._field["holder"])))

    async def status(self, item_id: str) -> ItemStatus | None:
        async with self._redis.pipeline(transaction=True) as pipe:
            pipe.hexists(self._field["holder"], item_id)
            pipe.hexists(self._field["tier"], item_id)
            pipe.zscore(self._field["done"], item_id)
            held, known, done = await self._guard(pipe.execute())
        if held:
            return "leased"
        if known:
            return "queued"
        return "completed" if done is not None else None

    async def close(self) -> None:
        await self._redis.aclose()


class Subscription:
    """A pub/sub subscription that outlives its connection. `run` hands every
    message to `handle`; when the connection is lost (Redis restarts, the
    network breaks) it calls `on_lost` once, subscribes again with backoff
    (RECONNECT_FIRST_S, doubling to RECONNECT_MAX_S) and, once subscribed,
    calls `on_back`. The retry of a lost connection, not a poll: it stops as
    soon as the subscription is back."""

    def __init__(self, store: RedisWorkQueue, *channels: str, what: str) -> None:
        self._store = store
        self._channels = channels
        self._what = what
        self.pubsub: Any = None
        """The live connection; None while lost."""

    async def open(self) -> None:
        self.pubsub = await self._store.subscribe(*self._channels)

    async def run(
        self,
        handle: Callable[[dict[str, Any]], None],
        *,
        on_lost: Callable[[Exception], None] = lambda exc: None,
        on_back: Callable[[], None] = lambda: None,
    ) -> None:
        backoff = RECONNECT_FIRST_S
        while True:
            try:
                if self.pubsub is None:
                    await self.open()
                    log.warning("the fleet's %s is back", self._what)
                    backoff = RECONNECT_FIRST_S
                    on_back()
                async for message in self.pubsub.listen():
                    if message.get("type") == "message":
                        handle(message)
                raise ConnectionError(f"the {self._what} ended")
            except asyncio.CancelledError:
                raise
            except Exception as exc:  # noqa: BLE001 - whatever broke it, subscribe again
                if self.pubsub is not None:
                    log.error("lost the fleet's %s: %r; reconnecting", self._what, exc)
                    on_lost(exc)
                await self.close()
                await asyncio.sleep(backoff)
                backoff = min(2 * backoff, RECONNECT_MAX_S)

    async def close(self) -> None:
        pubsub, self.pubsub = self.pubsub, None
        if pubsub is not None:
            with contextlib.suppress(RedisError, OSError):
                await pubsub.aclose()
