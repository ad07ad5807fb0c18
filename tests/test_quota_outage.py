"""Redis killed and restarted under a gateway: fail_open keeps serving on the
local limiter, fail_closed refuses with 503; both come back by themselves.

The guard's clock is the test's, so "after the retry interval" is a step of
the clock, not a sleep; Redis is a real server the test kills and restarts on
the same port.
"""

from __future__ import annotations

import asyncio
import uuid

import pytest

from qosgate.config.models import QuotaStoreConfig, TenantQuotas
from qosgate.quotas import FALLBACK, QuotaGuard, QuotaStoreDown, TenantLimits
from qosgate.quotas.redis_store import RedisQuotaStore
from tests.http_support import make_policy
from tests.redis_server import RedisServer


class Clock:
    def __init__(self) -> None:
        self.now = 1_700_000_640.0

    def __call__(self) -> float:
        return self.now


LIMITS = {"t": TenantLimits.from_config(TenantQuotas(tokens_per_minute=1000, max_concurrency=4))}


def make_guard(server: RedisServer, on_error: str, clock: Clock) -> QuotaGuard:
    cfg = QuotaStoreConfig(
        kind="redis", url=server.url, on_error=on_error, retry_interval_s=1.0, timeout_ms=500
    )
    store = RedisQuotaStore(cfg.url, key_prefix=f"outage-{uuid.uuid4().hex[:8]}:")
    return QuotaGuard(store, cfg, LIMITS, clock=clock)


async def used(guard: QuotaGuard) -> dict[str, int]:
    return {s.kind: s.used for s in await guard.usage("t")}


async def test_fail_open_serves_on_the_local_limiter_and_recovers(own_redis_server):
    clock = Clock()
    guard = make_guard(own_redis_server, "fail_open", clock)
    try:
        before = await guard.reserve("t", 600, "r1")
        assert before.admitted and before.reservation.store == "redis"

        own_redis_server.stop()
        # Settling while Redis is down keeps the settlement for later.
        guard.settle_soon(before.reservation, 100, True)
        during = await guard.reserve("t", 700, "r2")
        assert during.admitted and during.reservation.store == FALLBACK
        assert guard.store_down
        assert guard.counters.store_errors >= 1 and guard.counters.fallback_reservations == 1
        # The local limiter still holds the line: 700 + 400 > 1000.
        refused = await guard.reserve("t", 400, "r3")
        assert not refused.admitted and refused.exceeded == "tokens_per_minute"
        errors = guard.counters.store_errors
        clock.now += 0.5  # within the retry interval: Redis is not tried
        assert (await guard.reserve("t", 100, "r4")).reservation.store == FALLBACK
        assert guard.counters.store_errors == errors

        own_redis_server.start()
        clock.now += 1.0
        after = await guard.reserve("t", 100, "r5")
        assert after.admitted and after.reservation.store == "redis"
        assert not guard.store_down
        # Back, the gateway carries in what it admitted alone (r2's 700 and
        # r4's 100), then sends the settlement Redis missed (r1: 600 reserved,
        # 100 charged): 100 + 800 + r5's 100.
        assert guard._catching_up is not None
        await guard._catching_up
        assert guard.counters.settlements_resent == 1
        assert guard.counters.unshared_tokens == 800 and guard.counters.carried == 1
        assert (await used(guard))["tokens_per_minute"] == 1000
        assert not (await guard.reserve("t", 1, "r6")).admitted
        guard.settle_soon(during.reservation, 0, False)  # local, settles locally
    finally:
        await guard.close()


async def test_fail_closed_refuses_with_retry_after_and_recovers(own_redis_server):
    clock = Clock()
    guard = make_guard(own_redis_server, "fail_closed", clock)
    try:
        assert (await guard.reserve("t", 100, "r1")).admitted
        own_redis_server.stop()
        with pytest.raises(QuotaStoreDown) as refused:
            await guard.reserve("t", 100, "r2")
        assert refused.value.retry_after_s >= 1.0
        assert guard.counters.refused_store_down == 1
        clock.now += 1.0
        with pytest.raises(QuotaStoreDown):  # still down: tried, and refused
            await guard.reserve("t", 100, "r3")
        own_redis_server.start()
        clock.now += 0.5  # not yet: the retry interval has not passed
        with pytest.raises(QuotaStoreDown):
            await guard.reserve("t", 100, "r4")
        clock.now += 0.5  # one interval, never more, after the last failure
        back = await guard.reserve("t", 100, "r5")
        assert back.admitted and back.reservation.store == "redis"
        assert not guard.store_down
    finally:
        await guard.close()


async def test_a_gateway_failing_closed_answers_503_then_recovers(own_redis_server):
    """Only the tenant with quotas is refused while Redis is down (bob, without,
    is served throughout), and afterwards Redis holds exactly what alice's
    served requests were billed: the refused one reserved nothing."""
    import aiohttp

    from qosgate.backends import build_backend
    from tests.http_support import ALICE_KEY, BOB_KEY, MODEL, POLICY_YAML, live_app

    yaml_text = POLICY_YAML.replace(
        "    api_keys: [\"sha256:",
        "    quotas: {tokens_per_minute: 100000}\n    api_keys: [\"sha256:",
        1,
    ) + (
        f"quota_store:\n  kind: redis\n  url: {own_redis_server.url}\n"
        "  on_error: fail_closed\n  key_prefix: \"http-outage:\"\n"
    )
    policy = make_policy(yaml_text)
    clock = Clock()
    guard = QuotaGuard(
        RedisQuotaStore(own_redis_server.url, key_prefix="http-outage:"),
        policy.quota_store,
        {t.id: TenantLimits.from_config(t.quotas) for t in policy.tenants},
        clock=clock,
    )
    body = {"model": MODEL, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 4}
    headers = {"Authorization": f"Bearer {ALICE_KEY}"}
    billed = 0
    async with live_app(policy, build_backend(policy.backend), quotas=guard) as live:
        async with aiohttp.ClientSession() as http:
            url = live.url + "/v1/chat/completions"
            async with http.post(url, json=body, headers=headers) as resp:
                assert resp.status == 200
                assert int(resp.headers["x-ratelimit-remaining-tokens"]) < 100_000
                billed += (await resp.json())["usage"]["total_tokens"]
            # Its settlement reaches Redis before Redis goes.
            await asyncio.gather(*guard._tasks)
            own_redis_server.stop()
            async with http.post(url, json=body, headers=headers) as resp:
                assert resp.status == 503
                assert int(resp.headers["Retry-After"]) >= 1
                error = (await resp.json())["error"]
                assert error["code"] == "quota_store_unavailable"
            bob = {"Authorization": f"Bearer {BOB_KEY}"}
            async with http.post(url, json=body, headers=bob) as resp:
                assert resp.status == 200
            async with http.get(live.url + "/metrics") as resp:
                metrics = await resp.text()
            errors = [line for line in metrics.splitlines()
                      if line.startswith("qosgate_quota_store_errors_total ")]  # fmt: skip
            assert errors and float(errors[0].split()[1]) >= 1
            own_redis_server.start()
            clock.now += 1.0
            async with http.post(url, json=body, headers=headers) as resp:
                assert resp.status == 200
                billed += (await resp.json())["usage"]["total_tokens"]
    # The gateway has closed, its settlements delivered; read Redis afresh.
    reader = QuotaGuard(
        RedisQuotaStore(own_redis_server.url, key_prefix="http-outage:"),
        policy.quota_store,
        {t.id: TenantLimits.from_config(t.quotas) for t in policy.tenants},
        clock=clock,
    )
    try:
        assert {s.kind: s.used for s in await reader.usage("alice")} == {
            "tokens_per_minute": billed
        }
    finally:
        await reader.close()
