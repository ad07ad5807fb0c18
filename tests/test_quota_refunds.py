"""A reservation is given back whenever its request never runs (docs/QUOTAS.md),
and the x-ratelimit token headers come from the tighter token limit.

A caller that leaves while Redis runs the reserve script (a real
redis-server), and a request the scheduler refuses after its tenant's quota
was reserved (through the HTTP API, whatever layer makes the reservation),
must both leave the tenant's usage as if the request had never been sent.
"""

from __future__ import annotations

import asyncio
import uuid

import aiohttp
import pytest

from qosgate.config.models import QuotaStoreConfig, TenantQuotas
from qosgate.quotas import QuotaGuard, TenantLimits
from qosgate.quotas.redis_store import RedisQuotaStore
from tests import http_support
from tests.http_support import ALICE_KEY, MODEL, POLICY_YAML, ScriptedBackend, live_app, words
from tests.http_support import make_policy as make_http_policy

LIMIT_S = 10.0
ADMIN_TOKEN = "refunds-admin-token"


# -- a caller gone while the reserve script runs ------------------------------------


class ObservedRedisStore(RedisQuotaStore):
    """The real Redis store, telling the test when a reserve call has gone
    out and when a settlement has been made (so nothing waits by sleeping)."""

    def __init__(self, *args, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self.reserving = asyncio.Event()
        self.settled = asyncio.Event()

    async def reserve(self, *args, **kwargs):
        self.reserving.set()
        return await super().reserve(*args, **kwargs)

    async def settle(self, *args, **kwargs):
        try:
            return await super().settle(*args, **kwargs)
        finally:
            self.settled.set()


async def test_a_caller_gone_during_the_redis_reserve_keeps_no_reservation(redis_server):
    cfg = QuotaStoreConfig(kind="redis", url=redis_server.url)
    limits = TenantQuotas(tokens_per_minute=1000, max_concurrency=1)
    store = ObservedRedisStore(cfg.url, key_prefix=f"refund-{uuid.uuid4().hex[:8]}:")
    guard = QuotaGuard(store, cfg, {"t": TenantLimits.from_config(limits)})
    try:
        caller = asyncio.ensure_future(guard.reserve("t", 600, "gone"))
        await store.reserving.wait()
        caller.cancel()  # the client left while the script runs in Redis
        with pytest.raises(asyncio.CancelledError):
            await caller
        # The reservation the script made is refunded whole.
        await asyncio.wait_for(store.settled.wait(), LIMIT_S)
        used = {state.kind: state.used for state in await guard.usage("t")}
        assert used == {"tokens_per_minute": 0, "max_concurrency": 0}
        # So the tenant's one concurrency slot is free for its next request.
        decision = await guard.reserve("t", 1000, "next")
        assert decision is not None and decision.admitted
    finally:
        await guard.close()


# -- a request refused by the scheduler after its quota was reserved --------------------


def alice_policy(quotas: str, *, max_queue_len: int | None = None, admin: bool = False):
    """The HTTP tests' policy with quotas for alice (tier interactive) and,
    optionally, a cap on interactive's queue and the admin view."""
    text = POLICY_YAML.replace(
        '    api_keys: ["sha256:', f'    quotas: {quotas}\n    api_keys: ["sha256:', 1
    )
    if max_queue_len is not None:
        text = text.replace(
            "    max_tokens: 16\n", f"    max_tokens: 16\n    max_queue_len: {max_queue_len}\n", 1
        )
    if admin:
        text = text.replace("server:\n", "server:\n  admin_token_env: QG_TEST_REFUNDS_ADMIN\n", 1)
    return make_http_policy(text)


def chat(max_tokens: int = 4, stream: bool = False) -> dict:
    return {"model": MODEL, "messages": [{"role": "user", "content": "hi"}],
            "max_tokens": max_tokens, "stream": stream}  # fmt: skip


ALICE = {"Authorization": f"Bearer {ALICE_KEY}"}


async def test_a_request_refused_as_its_queue_is_full_gives_its_tokens_back(monkeypatch):
    monkeypatch.setitem(http_support.ENV, "QG_TEST_REFUNDS_ADMIN", ADMIN_TOKEN)
    policy = alice_policy("{tokens_per_minute: 1000}", max_queue_len=1, admin=True)
    assert policy.tiers["interactive"].max_queue_len == 1
    hold = asyncio.Event()

    async def script(job):
        await hold.wait()  # every request runs until the test lets them end
        async for chunk in words(job, 1):
            yield chunk

    # One slot: the first request runs, the second waits in the queue (its
    # cap), the third is refused with 429 queue_full.
    backend = ScriptedBackend(script, free_slots=1)
    async with live_app(policy, backend) as live, aiohttp.ClientSession() as http:
        url = live.url + "/v1/chat/completions"

        async def ask():
            async with http.post(url, json=chat(), headers=ALICE) as response:
                return response.status, await response.json()

        async def used_tokens() -> int:
            async with http.get(live.url + "/admin/quotas",
                                headers={"Authorization": f"Bearer {ADMIN_TOKEN}"}) as r:
                assert r.status == 200, await r.text()
                view = await r.json()
            return view["tenants"]["alice"]["limits"]["tokens_per_minute"]["used"]  # fmt: skip

        async with asyncio.timeout(LIMIT_S):
            admitted = []
            for _ in range(2):
                live.gateway.submitted.clear()
                admitted.append(asyncio.ensure_future(ask()))
                await live.gateway.submitted.wait()
            held = await used_tokens()
            assert held > 0
            status, body = await ask()
            assert status == 429 and body["error"]["code"] == "queue_full", body
            # Refused after its reservation: the tokens it reserved are back.
            assert await used_tokens() == held
            hold.set()
            assert [status for status, _ in await asyncio.gather(*admitted)] == [200, 200]


# -- the x-ratelimit token headers ---------------------------------------------------------


@pytest.mark.parametrize(
    ("quotas", "limit"),
    [
        ("{tokens_per_minute: 1000, tokens_per_day: 100}", 100),
        ("{tokens_per_minute: 100, tokens_per_day: 1000}", 100),
    ],
    ids=["day-tighter", "minute-tighter"],
)
async def test_ratelimit_token_headers_come_from_the_limit_with_less_left(quotas, limit):
    policy = alice_policy(quotas)
    backend = ScriptedBackend(lambda job: words(job, 1))
    async with live_app(policy, backend) as live, aiohttp.ClientSession() as http:
        async with http.post(live.url + "/v1/chat/completions", json=chat(4),
                             headers=ALICE) as response:  # fmt: skip
            assert response.status == 200, await response.text()
            headers = response.headers
    # 5 prompt tokens (the scripted backend's count) + 4 reserved.
    assert headers["x-ratelimit-limit-tokens"] == str(limit)
    assert headers["x-ratelimit-remaining-tokens"] == str(limit - 9)
