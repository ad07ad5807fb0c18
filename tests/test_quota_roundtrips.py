"""The Redis store's round trips, counted by a real redis-server.

A reserve is one EVALSHA whatever the tenant's limits, and so is a settle,
and so is a renewal tick for every running request of every tenant;
the script text goes to the server once (the first call's NOSCRIPT, then
SCRIPT LOAD), never per call. Counted from the server's `INFO commandstats`
(benchmarks/b7_roundtrip.py measures what each costs in time).
"""

from __future__ import annotations

import asyncio
import time

import redis.asyncio as aioredis

from qosgate.config.models import TenantQuotas
from qosgate.quotas import Renewal, TenantLimits
from qosgate.quotas.redis_store import RedisQuotaStore
from tests.redis_server import RedisServer

SENT = {"ping", "evalsha", "evalsha_ro", "eval", "eval_ro", "script|load", "script|exists"}
"""Commands a client sends; commandstats also counts those run inside scripts."""

LIMITS = TenantLimits.from_config(
    TenantQuotas.model_validate(
        {
            "tokens_per_minute": 60_000,
            "tokens_per_day": 1_000_000,
            "requests_per_minute": 1_000,
            "max_concurrency": 64,
        }
    )
)


async def sent(admin: aioredis.Redis) -> dict[str, int]:
    """Commands of SENT received so far, failed and rejected ones included."""
    stats = await admin.info("commandstats")
    out = {}
    for name, v in stats.items():
        cmd = name.removeprefix("cmdstat_")
        if cmd in SENT:
            # `calls` counts those that failed in execution (NOSCRIPT) too.
            out[cmd] = int(v["calls"]) + int(v.get("rejected_calls", 0))
    return out


def diff(after: dict[str, int], before: dict[str, int]) -> dict[str, int]:
    return {k: v - before.get(k, 0) for k, v in after.items() if v != before.get(k, 0)}


async def test_reserve_and_settle_are_one_evalsha_each() -> None:
    with RedisServer() as server:
        admin = aioredis.Redis.from_url(server.url)
        store = RedisQuotaStore(server.url)
        try:
            before = await sent(admin)
            first = await store.reserve("t", LIMITS, 100, "r0", time.time(), lease_s=600)
            assert first.reservation is not None
            await store.settle(first.reservation, 0, False, time.time())
            # Each script once: EVALSHA (NOSCRIPT), SCRIPT LOAD, EVALSHA.
            assert diff(await sent(admin), before) == {"evalsha": 4, "script|load": 2}

            before = await sent(admin)
            for i in range(20):
                decision = await store.reserve("t", LIMITS, 100, f"r{i + 1}", time.time(),
                                               lease_s=600)  # fmt: skip
                assert decision.reservation is not None
                await store.settle(decision.reservation, 50, True, time.time())
            assert diff(await sent(admin), before) == {"evalsha": 40}

            # At once, as a gateway's streams call it: still one each, no reload.
            before = await sent(admin)
            decisions = await asyncio.gather(*(
                store.reserve("t", LIMITS, 100, f"c{i}", time.time(), lease_s=600)
                for i in range(16)
            ))  # fmt: skip
            assert all(d.reservation is not None for d in decisions)
            await asyncio.gather(*(
                store.settle(d.reservation, 0, False, time.time()) for d in decisions
            ))  # fmt: skip
            assert diff(await sent(admin), before) == {"evalsha": 32}
        finally:
            await store.close()
            await admin.aclose()


async def test_a_renewal_tick_is_one_evalsha_for_every_tenant() -> None:
    with RedisServer() as server:
        admin = aioredis.Redis.from_url(server.url)
        store = RedisQuotaStore(server.url)
        try:
            leases: dict[str, list[str]] = {}
            for tenant in range(8):
                for i in range(4):
                    d = await store.reserve(f"t{tenant}", LIMITS, 1, f"r{i}", time.time(),
                                            lease_s=600)  # fmt: skip
                    assert d.reservation is not None
                    leases.setdefault(f"t{tenant}", []).append(f"r{i}")
            assert await store.renew(leases, time.time(), lease_s=600) == Renewal()  # loads it
            before = await sent(admin)
            for _ in range(5):
                assert await store.renew(leases, time.time(), lease_s=600) == Renewal()
            assert diff(await sent(admin), before) == {"evalsha": 5}
        finally:
            await store.close()
            await admin.aclose()
