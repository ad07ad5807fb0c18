"""`quota_store.kind: redis`: gateway replicas share one budget per tenant.

Check-and-reserve, settle and the renewal of every running request's
concurrency lease (all tenants at once) are each one Lua script, so two replicas can
never both take the last of a window. The scripts do only what must be atomic
(prune, compare, write) and hand back the window's slots; the waits, resets
and remainders are worked out in Python by the same functions the memory
store uses (qosgate/quotas/local.py), so both stores answer alike.

Keys, per tenant and limit: `<prefix>quota:{<tenant>}:tpm|tpd|rpm` (a hash:
slot index -> amount, plus `lvl`/`at` for the bucket) and `...:conc` (a sorted
set: request id -> lease end). The braces keep one tenant's keys in one
cluster slot; every write renews the key's expiry to its period, so idle
tenants cost nothing.
"""

from __future__ import annotations

import math
from collections.abc import Collection, Mapping
from typing import Any

import orjson
import redis.asyncio as aioredis
from redis.asyncio.retry import Retry
from redis.backoff import NoBackoff
from redis.exceptions import ConnectionError as RedisConnectionError
from redis.exceptions import RedisError
from redis.exceptions import TimeoutError as RedisTimeoutError

from .local import (
    CONCURRENCY_RETRY_S,
    concurrency_state,
    evaluate,
    limit_state,
    mark_settled,
    refusal,
    settle_deltas,
)
from .model import (
    KEY_SUFFIX,
    SLOTS,
    LimitState,
    QuotaDecision,
    RateRule,
    Reservation,
    TenantLimits,
    refusal_reason,
)
from .store import QuotaStore, QuotaStoreError

# KEYS: one hash per rate rule, in ARGV's order, then the in-flight set.
# ARGV: now, request id, lease_s, slots, number of rules, max_concurrency (0:
#   none), write (1: reserve, 0: only read), then per rule: need, limit,
#   burst, period_s, ttl_ms.
# Returns JSON: {ok, failed (1-based rule, or -1 for concurrency, 0 none),
#   rules: [[slot, amount, ...], level], inflight}.
_RESERVE = """
local function num(x) return string.format('%.17g', x) end
local now = tonumber(ARGV[1])
local rid = ARGV[2]
local lease = tonumber(ARGV[3])
local nslots = tonumber(ARGV[4])
local nrules = tonumber(ARGV[5])
local conc_max = tonumber(ARGV[6])
local write = ARGV[7] == '1'

local rules = {}
local failed = 0
for r = 1, nrules do
  local base = 7 + (r - 1) * 5
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
local ckey = KEYS[nrules + 1]
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
end

local out = {}
for r = 1, nrules do
  out[r] = {rules[r].pairs_, num(rules[r].level)}
end
return cjson.encode({ok = ok, failed = failed, rules = out, inflight = inflight})
"""

# KEYS: one hash per rule that moves, then the in-flight set.
# ARGV: now, request id, number of rules, then per rule: slot, delta, limit,
#   burst, period_s, ttl_ms.
_SETTLE = """
local function num(x) return string.format('%.17g', x) end
local now = tonumber(ARGV[1])
local rid = ARGV[2]
local nrules = tonumber(ARGV[3])
for r = 1, nrules do
  local base = 3 + (r - 1) * 6
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
redis.call('ZREM', KEYS[nrules + 1], rid)
return 1
"""

# KEYS: the in-flight set of each tenant named.
# ARGV: now, lease_s, then per key: how many ids, then the ids.
# Returns JSON: per key, the ids whose lease had ended (not taken back).
_RENEW = """
local now = tonumber(ARGV[1])
local lease = tonumber(ARGV[2])
local until_ = string.format('%.17g', now + lease)
local ttl = math.ceil(lease * 1000)
local at = 3
local lost = {}
for k = 1, #KEYS do
  local key = KEYS[k]
  local n = tonumber(ARGV[at])
  local gone = {}
  redis.call('ZREMRANGEBYSCORE', key, '-inf', now)
  for i = at + 1, at + n do
    local held = redis.call('ZSCORE', key, ARGV[i])
    if held then
      if tonumber(held) < now + lease then redis.call('ZADD', key, 'XX', until_, ARGV[i]) end
    else
      gone[#gone + 1] = ARGV[i]
    end
  end
  if redis.call('PTTL', key) < ttl then redis.call('PEXPIRE', key, ttl) end
  lost[k] = gone
  at = at + n + 1
end
return cjson.encode(lost)
"""


def _ttl_ms(rule: RateRule) -> int:
    # The window plus the slot it may still overlap, and one more for slack.
    return math.ceil((rule.period_s + 2 * rule.width_s) * 1000)


class RedisQuotaStore(QuotaStore):
    """Counters in Redis, shared by every gateway pointed at it."""

    name = "redis"

    def __init__(
        self,
        url: str,
        *,
        key_prefix: str = "qosgate:",
        socket_timeout_s: float = 0.5,
        max_connections: int = 64,
        client: aioredis.Redis | None = None,
    ) -> None:
        self._prefix = key_prefix
        if client is None:
            pool = aioredis.BlockingConnectionPool.from_url(
                url,
                # Beyond this many calls at once, a call waits for a connection
                # (up to `timeout`) rather than failing.
                max_connections=max_connections,
                timeout=max(1.0, 4 * socket_timeout_s),
                socket_timeout=socket_timeout_s,
                socket_connect_timeout=socket_timeout_s,
            )
            # One retry on a fresh connection, so that a pooled connection the
            # server dropped (a restart) is not taken for an outage; more would
            # only delay what the gateway does about a real one. A retried
            # reservation that had in fact run holds its tokens twice until
            # its window passes: too strict, never too lax.
            client = aioredis.Redis(
                connection_pool=pool,
                retry=Retry(NoBackoff(), retries=1),
                retry_on_error=[RedisConnectionError],
            )
        self._redis = client
        self._reserve = self._redis.register_script(_RESERVE)
        self._settle = self._redis.register_script(_SETTLE)
        self._renew = self._redis.register_script(_RENEW)

    def key(self, tenant: str, kind: str) -> str:
        return f"{self._prefix}quota:{{{tenant}}}:{KEY_SUFFIX[kind]}"

    async def _run(self, script: Any, keys: list[str], args: list[Any]) -> Any:
        try:
            return await script(keys=keys, args=args)
        except (RedisConnectionError, RedisTimeoutError, OSError) as exc:
            raise QuotaStoreError(f"redis unreachable: {exc}") from exc
        except RedisError as exc:
            raise QuotaStoreError(f"redis failed: {exc}") from exc

    async def _call(
        self,
        tenant: str,
        limits: TenantLimits,
        tokens: int,
        request_id: str,
        now: float,
        lease_s: float,
        write: bool,
    ) -> dict[str, Any]:
        keys = [self.key(tenant, rule.kind) for rule in limits.rates]
        keys.append(self.key(tenant, "max_concurrency"))
        args: list[Any] = [
            repr(now), request_id, repr(lease_s), SLOTS, len(limits.rates),
            limits.max_concurrency or 0, 1 if write else 0,
        ]  # fmt: skip
        for rule in limits.rates:
            need = 1 if rule.counts_requests else tokens
            args += [need, rule.limit, rule.burst, repr(rule.period_s), _ttl_ms(rule)]
        raw = await self._run(self._reserve, keys, args)
        return orjson.loads(raw)

    def _states(
        self, limits: TenantLimits, result: dict[str, Any], now: float
    ) -> tuple[tuple[LimitState, ...], list[tuple[dict[int, int], int, float]]]:
        views = []
        states = []
        for rule, (flat, level) in zip(limits.rates, result["rules"]):
            # cjson writes an empty table as {}; a filled one as a list.
            pairs = flat if isinstance(flat, list) else []
            slots = {int(pairs[i]): int(pairs[i + 1]) for i in range(0, len(pairs), 2)}
            used = sum(slots.values())
            views.append((slots, used, float(level)))
            states.append(limit_state(rule, slots, used, float(level), now))
        if limits.max_concurrency is not None:
            states.append(concurrency_state(limits.max_concurrency, int(result["inflight"])))
        return tuple(states), views

    async def reserve(
        self,
        tenant: str,
        limits: TenantLimits,
        tokens: int,
        request_id: str,
        now: float,
        *,
        lease_s: float,
    ) -> QuotaDecision:
        result = await self._call(tenant, limits, tokens, request_id, now, lease_s, True)
        states, views = self._states(limits, result, now)
        if result["ok"] == 1:
            reservation = Reservation(tenant, request_id, tokens, now, limits, store=self.name)
            return QuotaDecision(admitted=True, reservation=reservation, states=states)
        failed = int(result["failed"])
        if failed == -1:
            assert limits.max_concurrency is not None
            kind, limit, need, wait = (
                "max_concurrency", limits.max_concurrency, 1, CONCURRENCY_RETRY_S
            )  # fmt: skip
        else:
            rule = limits.rates[failed - 1]
            slots, used, level = views[failed - 1]
            need = 1 if rule.counts_requests else tokens
            _, wait = evaluate(rule, slots, used, level, need, now)
            kind, limit, need, wait = refusal(rule, need, wait)
        return QuotaDecision(
            admitted=False,
            exceeded=kind,
            retry_after_s=wait,
            reason=refusal_reason(kind, limit, need, wait),
            states=states,
        )

    async def settle(self, reservation: Reservation, charged: int, served: bool, now: float) -> None:
        changes = settle_deltas(reservation, charged, served)
        limits = reservation.limits
        if changes or limits.max_concurrency is not None:
            keys = [self.key(reservation.tenant, rule.kind) for rule, _, _ in changes]
            keys.append(self.key(reservation.tenant, "max_concurrency"))
            args: list[Any] = [repr(now), reservation.request_id, len(changes)]
            for rule, delta, slot in changes:
                args += [slot, delta, rule.limit, rule.burst, repr(rule.period_s), _ttl_ms(rule)]
            await self._run(self._settle, keys, args)
        # Only once the store has it: a settlement that failed can be retried.
        mark_settled(reservation, charged)

    async def renew(
        self, leases: Mapping[str, Collection[str]], now: float, *, lease_s: float
    ) -> set[tuple[str, str]]:
        tenants = [tenant for tenant, ids in leases.items() if ids]
        if not tenants:
            return set()
        keys = [self.key(tenant, "max_concurrency") for tenant in tenants]
        args: list[Any] = [repr(now), repr(lease_s)]
        for tenant in tenants:
            ids = list(leases[tenant])
            args += [len(ids), *ids]
        raw = await self._run(self._renew, keys, args)
        lost = orjson.loads(raw)
        return {
            (tenant, rid)
            for tenant, gone in zip(tenants, lost)
            # cjson writes an empty table as {}.
            for rid in (gone if isinstance(gone, list) else [])
        }

    async def release(self, leases: Mapping[str, Collection[str]]) -> None:
        # ZREM alone is atomic and needs no read: one pipelined round trip.
        pipe = self._redis.pipeline(transaction=False)
        for tenant, ids in leases.items():
            if ids:
                pipe.zrem(self.key(tenant, "max_concurrency"), *ids)
        if not pipe.command_stack:
            return
        try:
            await pipe.execute()
        except (RedisError, OSError) as exc:
            raise QuotaStoreError(f"redis unreachable: {exc}") from exc

    async def usage(self, tenant: str, limits: TenantLimits, now: float) -> tuple[LimitState, ...]:
        result = await self._call(tenant, limits, 0, "", now, 0.0, False)
        return self._states(limits, result, now)[0]

    async def ping(self) -> None:
        try:
            await self._redis.ping()
        except (RedisError, OSError) as exc:
            raise QuotaStoreError(f"redis unreachable: {exc}") from exc

    async def close(self) -> None:
        await self._redis.aclose()
