"""Quotas over HTTP: 429 with Retry-After and the reason, the x-ratelimit
headers on every response, refunds visible in the next response, the admin
usage view, and the official client's view of a 429."""

from __future__ import annotations

import asyncio
import json

import aiohttp
import openai
import pytest

from tests.http_support import (
    ALICE_KEY,
    BOB_KEY,
    MODEL,
    POLICY_YAML,
    ScriptedBackend,
    hang_after_one,
    live_app,
    words,
    make_policy,
)

ADMIN_TOKEN = "admin-secret"


def quota_policy(alice_quotas: str, bob_quotas: str = "{}", admin: bool = False):
    text = POLICY_YAML.replace(
        '    api_keys: ["sha256:', f"    quotas: {alice_quotas}\n    api_keys: [\"sha256:", 1
    ).replace('    api_keys: ["env:QG_TEST_BOB_KEY"]',
              f'    quotas: {bob_quotas}\n    api_keys: ["env:QG_TEST_BOB_KEY"]')
    if admin:
        text = text.replace("server:\n", "server:\n  admin_token_env: QG_TEST_ADMIN\n", 1)
    return make_policy(text)


def chat(max_tokens: int = 4, stream: bool = False) -> dict:
    return {
        "model": MODEL,
        "messages": [{"role": "user", "content": "hello there"}],
        "max_tokens": max_tokens,
        "stream": stream,
    }


def auth(key: str = ALICE_KEY) -> dict:
    return {"Authorization": f"Bearer {key}"}


async def post(http, live, body, key=ALICE_KEY):
    async with http.post(live.url + "/v1/chat/completions", json=body, headers=auth(key)) as r:
        return r.status, dict(r.headers), await r.read()


async def test_every_response_carries_the_tenants_ratelimit_headers():
    policy = quota_policy("{tokens_per_minute: 1000, requests_per_minute: 10}")
    async with live_app(policy) as live, aiohttp.ClientSession() as http:
        status, headers, _ = await post(http, live, chat(max_tokens=4))
        assert status == 200
        assert headers["x-ratelimit-limit-tokens"] == "1000"
        assert headers["x-ratelimit-limit-requests"] == "10"
        assert headers["x-ratelimit-remaining-requests"] == "9"
        assert 0 < int(headers["x-ratelimit-remaining-tokens"]) < 1000
        assert headers["x-ratelimit-reset-tokens"].endswith("s")
        # Streamed responses too (the headers go out before the first event).
        status, headers, body = await post(http, live, chat(max_tokens=4, stream=True))
        assert status == 200 and b"data: [DONE]" in body
        assert headers["x-ratelimit-remaining-requests"] == "8"
        # A tenant with no quota gets none.
        status, headers, _ = await post(http, live, chat(), key=BOB_KEY)
        assert status == 200
        assert not any(h.lower().startswith("x-ratelimit") for h in headers)


async def test_unused_tokens_are_refunded_at_the_end():
    policy = quota_policy("{tokens_per_minute: 1000}")
    backend = ScriptedBackend(lambda job: words(job, 2))  # 2 tokens, whatever was asked
    async with live_app(policy, backend) as live, aiohttp.ClientSession() as http:
        _, first, body = await post(http, live, chat(max_tokens=16))
        usage = json.loads(body)["usage"]
        prompt = usage["prompt_tokens"]
        assert usage["completion_tokens"] == 2
        # At admission it held prompt + 16...
        assert int(first["x-ratelimit-remaining-tokens"]) == 1000 - (prompt + 16)
        _, second, _ = await post(http, live, chat(max_tokens=1))
        # ...and once it ended, only what it used: the next one sees the refund.
        assert int(second["x-ratelimit-remaining-tokens"]) == 1000 - (prompt + 2) - (prompt + 1)


async def test_over_quota_is_429_with_retry_after_and_the_reason():
    # The tier clamps max_tokens to 16: each request reserves prompt + 16.
    policy = quota_policy("{tokens_per_minute: 30}")
    async with live_app(policy) as live, aiohttp.ClientSession() as http:
        status, _, _ = await post(http, live, chat(max_tokens=40))
        assert status == 200
        status, headers, body = await post(http, live, chat(max_tokens=40))
        assert status == 429
        assert 1 <= int(headers["Retry-After"]) <= 61
        error = (await _json(body))["error"]
        assert error["code"] == "rate_limit_exceeded" and error["type"] == "rate_limit_error"
        assert "tokens_per_minute" in error["message"]
        assert headers["x-ratelimit-limit-tokens"] == "30"
        # The refused request reserved nothing and ran nothing.
        assert len(live.gateway.streams) == 1


async def test_a_request_larger_than_the_quota_gets_no_retry_after():
    policy = quota_policy("{tokens_per_minute: 10}")
    async with live_app(policy) as live, aiohttp.ClientSession() as http:
        status, headers, body = await post(http, live, chat(max_tokens=16))
        assert status == 429
        assert "Retry-After" not in headers
        assert "max_tokens" in (await _json(body))["error"]["message"]


async def test_max_concurrency_refuses_the_next_and_frees_when_one_ends():
    policy = quota_policy("{max_concurrency: 1}")
    backend = ScriptedBackend(hang_after_one)
    async with live_app(policy, backend) as live, aiohttp.ClientSession() as http:
        url = live.url + "/v1/chat/completions"
        first = await http.post(url, json=chat(stream=True), headers=auth())
        assert first.status == 200
        await first.content.readline()  # streaming: it holds its slot
        status, headers, body = await post(http, live, chat())
        assert status == 429 and headers["Retry-After"] == "1"
        assert "max_concurrency" in (await _json(body))["error"]["message"]
        first.close()  # the client leaves: its slot is given back
        await asyncio.wait_for(live.gateway.aclosed.wait(), 5)
        backend._script = _one_word
        status, _, _ = await post(http, live, chat())
        assert status == 200


async def _one_word(job):
    from qosgate.backends.base import Chunk

    yield Chunk(text="ok", tokens=1, finish_reason="stop")


async def test_the_official_client_sees_a_rate_limit_error():
    policy = quota_policy("{requests_per_minute: 1}")
    async with live_app(policy) as live:
        client = openai.AsyncOpenAI(base_url=live.url + "/v1", api_key=ALICE_KEY, max_retries=0)
        await client.chat.completions.create(**chat())
        with pytest.raises(openai.RateLimitError) as refused:
            await client.chat.completions.create(**chat())
        assert refused.value.response.headers["x-ratelimit-remaining-requests"] == "0"
        assert "requests_per_minute" in refused.value.message
        await client.close()


async def test_admin_quota_view(monkeypatch):
    policy = quota_policy("{tokens_per_minute: 1000, max_concurrency: 3}", admin=True)
    from tests import http_support

    monkeypatch.setitem(http_support.ENV, "QG_TEST_ADMIN", ADMIN_TOKEN)
    async with live_app(policy) as live, aiohttp.ClientSession() as http:
        await post(http, live, chat(max_tokens=8))
        url = live.url + "/admin/quotas"
        async with http.get(url) as r:
            assert r.status == 401
        async with http.get(url, headers={"Authorization": "Bearer wrong"}) as r:
            assert r.status == 401
        async with http.get(url, headers={"Authorization": f"Bearer {ADMIN_TOKEN}"}) as r:
            assert r.status == 200
            view = await r.json()
        alice = view["tenants"]["alice"]["limits"]
        assert alice["tokens_per_minute"]["limit"] == 1000
        assert 0 < alice["tokens_per_minute"]["used"] < 1000
        assert alice["max_concurrency"] == {"limit": 3, "used": 0, "remaining": 3, "reset_s": 0}
        assert view["tenants"]["bob"]["limits"] == {}
        assert view["store"]["kind"] == "memory" and view["store"]["reachable"]


async def test_admin_view_is_absent_without_a_token():
    policy = quota_policy("{tokens_per_minute: 1000}")
    async with live_app(policy) as live, aiohttp.ClientSession() as http:
        async with http.get(live.url + "/admin/quotas") as r:
            assert r.status == 404
            assert "admin_token_env" in (await r.json())["error"]["message"]


async def _json(body: bytes):
    return json.loads(body)

