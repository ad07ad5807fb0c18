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

`...:gen` names the generation of a tenant's data: a random value set by the
first write after it was missing, and outliving every other key of the
tenant. A Redis that restarted empty has lost it, so the first script of each
gateway that runs for the tenant afterwards sees a generation other than the
one it knew, and, if the gateway had admitted any of the tenant's current
windows, writes nothing and answers `stale`: the gateway carries what it
holds (its ledger of the windows, its running requests' leases) back with
`carry` before it reserves again. A settlement moves the windows only of the
generation its reservation was made in or carried into; the carry already
brought the rest. The scripts live in `lua/`, one file each.
"""

from __future__ import annotations

import math
import secrets
from collections.abc import Collection, Mapping
from typing import Any

import orjson
import redis.asyncio as aioredis
from redis.exceptions import RedisError

from .local import (
    concurrency_refusal,
    concurrency_state,
    evaluate,
    limit_state,
    mark_settled,
    refusal,
    refused,
    settle_deltas,
)
from .model import (
    KEY_SUFFIX,
    PERIOD_S,
    SLOTS,
    Holding,
    LimitState,
    QuotaDecision,
    Renewal,
    Reservation,
    TenantLimits,
)
from .redis_client import connection_pool, guarded, register_scripts
from .store import QuotaStore, QuotaStoreError, StoreRecovering, StoreReset


def _list(value: Any) -> list[Any]:
    # cjson writes an empty table as {}.
    return value if isinstance(value, list) else []


def _ttl_ms(period_s: float) -> int:
    # The window plus the slot it may still overlap, and one more for slack.
    return math.ceil((period_s + 2 * period_s / SLOTS) * 1000)


_GENERATION_TTL_MS = _ttl_ms(max(PERIOD_S.values()))
"""A tenant's generation outlives every window key of it: while the key is
there, the store still has what was admitted in the windows."""


def _generation_ttl_ms(lease_s: float) -> int:
    return max(_GENERATION_TTL_MS, math.ceil(lease_s * 1000) + 1000)


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
        recovery_s: float = 0.25,
        client: aioredis.Redis | None = None,
        password: str | None = None,
    ) -> None:
        """`password`: used where `url` carries none. `recovery_s`: after a
        gateway finds the store lost a tenant's data and carries its own back,
        how long the tenant's reservations wait for the other gateways to find
        it too (each does at its next call)."""
        self._prefix = key_prefix
        self._recovery_s = recovery_s
        if client is None:
            # A retried reservation that had in fact run holds its tokens
            # twice until its window passes: too strict, never too lax.
            pool = connection_pool(
                url, timeout_s=socket_timeout_s, password=password,
                pool_class=aioredis.BlockingConnectionPool,
                # Beyond this many calls at once, a call waits for a connection
                # (up to `timeout`) rather than failing.
                max_connections=max_connections, timeout=max(1.0, 4 * socket_timeout_s),
            )  # fmt: skip
            # The client owns its pool, so close() disconnects it too.
            client = aioredis.Redis.from_pool(pool)
        self._redis = client
        self._reserve, self._settle, self._renew, self._carry = register_scripts(
            client, __package__, ("reserve", "settle", "renew", "carry")
        )
        # Per tenant, the generation of its data this gateway last saw. Redis
        # restarted empty has none: a script that finds it missing or changed
        # knows the windows it holds lack what this gateway had admitted.
        self._generations: dict[str, str] = {}

    def key(self, tenant: str, kind: str) -> str:
        return f"{self._prefix}quota:{{{tenant}}}:{KEY_SUFFIX[kind]}"

    def record_key(self, tenant: str, request_id: str) -> str:
        """Where a recorded reservation is kept until it is settled."""
        return f"{self._prefix}quota:{{{tenant}}}:rsv:{request_id}"

    async def _run(self, script: Any, keys: list[str], args: list[Any]) -> Any:
        return await guarded(script(keys=keys, args=args), QuotaStoreError)

    def reserve_call(
        self,
        tenant: str,
        limits: TenantLimits,
        tokens: int,
        request_id: str,
        now: float,
        lease_s: float,
        write: bool,
        holds: bool = False,
    ) -> tuple[list[str], list[Any]]:
        """The keys and arguments of the reserve script for one call (B7's
        round-trip benchmark sends them bare, beside the store's own call)."""
        keys = [self.key(tenant, rule.kind) for rule in limits.rates]
        keys += [self.key(tenant, kind) for kind in ("max_concurrency", "generation", "recovery")]
        args: list[Any] = [
            repr(now), request_id, repr(lease_s), SLOTS, len(limits.rates),
            limits.max_concurrency or 0, 1 if write else 0,
            self._generations.get(tenant, ""), secrets.token_hex(8), 1 if holds else 0,
            _generation_ttl_ms(lease_s),
        ]  # fmt: skip
        for rule in limits.rates:
            need = 1 if rule.counts_requests else tokens
            args += [need, rule.limit, rule.burst, repr(rule.period_s), _ttl_ms(rule.period_s)]
        return keys, args

    async def _call(
        self, tenant: str, call: tuple[list[str], list[Any]], write: bool
    ) -> dict[str, Any]:
        keys, args = call
        raw = await self._run(self._reserve, keys, args)
        result = orjson.loads(raw)
        if result.get("stale"):
            raise StoreReset(tenant)
        if "recovering" in result:
            raise StoreRecovering(tenant, float(result["recovering"]))
        if write:
            self._generations[tenant] = result["gen"]
        return result

    def _states(
        self, limits: TenantLimits, result: dict[str, Any], now: float
    ) -> tuple[tuple[LimitState, ...], list[tuple[dict[int, int], int, float]]]:
        views = []
        states = []
        for rule, (flat, level) in zip(limits.rates, result["rules"]):
            pairs = _list(flat)
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
        holds: bool = False,
        record: bool = False,
    ) -> QuotaDecision:
        call = self.reserve_call(tenant, limits, tokens, request_id, now, lease_s, True, holds)
        if record:
            # Kept as long as the longest window it counts in: past that a
            # settlement would move nothing anyway.
            ttl = max([_ttl_ms(rule.period_s) for rule in limits.rates] + [_ttl_ms(60.0)])
            call[0].append(self.record_key(tenant, request_id))
            call[1].extend([f"{tokens} {now!r}", ttl])
        result = await self._call(tenant, call, True)
        states, views = self._states(limits, result, now)
        if result["ok"] == 1:
            reservation = Reservation(
                tenant, request_id, tokens, now, limits, store=self.name, generation=result["gen"],
                recorded=record,
            )
            return QuotaDecision(admitted=True, reservation=reservation, states=states)
        failed = int(result["failed"])
        if failed == -1:
            assert limits.max_concurrency is not None
            return refused(concurrency_refusal(limits.max_concurrency), states)
        rule = limits.rates[failed - 1]
        slots, used, level = views[failed - 1]
        need = 1 if rule.counts_requests else tokens
        _, wait = evaluate(rule, slots, used, level, need, now)
        return refused(refusal(rule, need, wait), states)

    async def settle(self, reservation: Reservation, charged: int, served: bool, now: float) -> None:
        changes = settle_deltas(reservation, charged, served)
        limits = reservation.limits
        if changes or limits.max_concurrency is not None or reservation.recorded:
            tenant = reservation.tenant
            keys = [self.key(tenant, rule.kind) for rule, _, _ in changes]
            keys += [self.key(tenant, "max_concurrency"), self.key(tenant, "generation")]
            if reservation.recorded:
                keys.append(self.record_key(tenant, reservation.request_id))
            args: list[Any] = [repr(now), reservation.request_id, reservation.generation, len(changes)]
            for rule, delta, slot in changes:
                args += [
                    slot, delta, rule.limit, rule.burst, repr(rule.period_s), _ttl_ms(rule.period_s)
                ]  # fmt: skip
            await self._run(self._settle, keys, args)
        # Only once the store has it: a settlement that failed can be retried.
        mark_settled(reservation, charged)

    async def find(
        self, tenant: str, request_id: str, limits: TenantLimits
    ) -> Reservation | None:
        try:
            raw = await self._redis.get(self.record_key(tenant, request_id))
        except (RedisError, OSError) as exc:
            raise QuotaStoreError(f"redis failed: {exc}") from exc
        if raw is None:
            return None
        tokens, at, generation = raw.decode().split(" ", 2)
        return Reservation(
            tenant, request_id, int(tokens), float(at), limits, store=self.name,
            generation=generation, recorded=True,
        )  # fmt: skip

    async def renew(
        self, leases: Mapping[str, Collection[str]], now: float, *, lease_s: float
    ) -> Renewal:
        tenants = list(leases)
        if not tenants:
            return Renewal()
        keys = []
        args: list[Any] = [repr(now), repr(lease_s), _generation_ttl_ms(lease_s)]
        for tenant in tenants:
            keys += [self.key(tenant, "max_concurrency"), self.key(tenant, "generation")]
            ids = list(leases[tenant])
            args += [self._generations.get(tenant, ""), len(ids), *ids]
        result = orjson.loads(await self._run(self._renew, keys, args))
        return Renewal(
            lost={
                (tenant, rid)
                for tenant, gone in zip(tenants, _list(result["lost"]))
                for rid in _list(gone)
            },
            reset={tenants[t - 1] for t in _list(result["stale"])},
        )

    async def carry(
        self, tenant: str, holding: Holding, now: float, *, lease_s: float, whole: bool
    ) -> None:
        keys = [self.key(tenant, kind) for kind in ("generation", "max_concurrency", "recovery")]
        ids = [r.request_id for r in holding.running if r.limits.max_concurrency is not None]
        args: list[Any] = [
            "whole" if whole else "add", self._generations.get(tenant, ""), secrets.token_hex(8),
            _generation_ttl_ms(lease_s), repr(now + lease_s), math.ceil(lease_s * 1000),
            repr(now + self._recovery_s) if self._recovery_s > 0 else "0", len(ids), *ids,
        ]  # fmt: skip
        for kind, slots in holding.slots.items():
            keys.append(self.key(tenant, kind))
            args += [_ttl_ms(PERIOD_S[kind]), len(slots)]
            for k, amount in slots.items():
                args += [k, amount]
        result = orjson.loads(await self._run(self._carry, keys, args))
        if result.get("stale"):
            raise StoreReset(tenant)
        generation = self._generations[tenant] = result["gen"]
        for reservation in holding.running:
            reservation.store = self.name
            reservation.generation = generation

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
        call = self.reserve_call(tenant, limits, 0, "", now, 0.0, False)
        result = await self._call(tenant, call, False)
        return self._states(limits, result, now)[0]

    async def ping(self) -> None:
        try:
            await self._redis.ping()
        except (RedisError, OSError) as exc:
            raise QuotaStoreError(f"redis unreachable: {exc}") from exc

    async def close(self) -> None:
        await self._redis.aclose()
