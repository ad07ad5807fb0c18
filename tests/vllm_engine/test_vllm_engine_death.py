"""An engine that dies turns into 503s with Retry-After and an unready
gateway: not a hang, not a lost request, and no tokens kept from the
tenant's quota for work the engine never finished."""

from __future__ import annotations

import asyncio
import signal

import aiohttp
import psutil
import pytest
import pytest_asyncio

from tests.http_support import live_app, make_policy
from tests.vllm_engine.test_vllm_backend import KEYS, policy_yaml

pytestmark = pytest.mark.asyncio(loop_scope="module")


@pytest_asyncio.fixture(scope="module", loop_scope="module")
async def live(tiny_model):
    from qosgate.backends import build_backend

    # Gold has quotas, so the refunds can be seen in its (memory) store.
    yaml_text = policy_yaml(tiny_model).replace(
        "  - id: g\n    tier: gold\n",
        "  - id: g\n    tier: gold\n    quotas: {tokens_per_minute: 1000000, max_concurrency: 8}\n",
    )
    assert "quotas" in yaml_text
    policy = make_policy(yaml_text)
    backend = build_backend(policy.backend)
    async with live_app(policy, backend) as app:
        await backend.wait_ready()
        yield app


async def test_a_dead_engine_makes_503s_and_an_unready_gateway(live):
    backend = live.gateway.backend
    headers = {"Authorization": "Bearer " + KEYS["gold"]}
    body = {"model": "tiny", "prompt": "hello", "max_tokens": 2000, "stream": True,
            "ignore_eos": True}
    async with aiohttp.ClientSession() as http:
        url = live.url + "/v1/completions"
        running = await http.post(url, json=body, headers=headers)
        assert running.status == 200
        await running.content.readline()  # generating when the engine dies

        for child in psutil.Process().children(recursive=True):
            child.send_signal(signal.SIGKILL)
        await asyncio.wait_for(backend.died.wait(), 60)

        # The request that was running ends with an error event, not a hang.
        rest = await asyncio.wait_for(running.content.read(), 30)
        assert b'"error"' in rest
        async with http.get(live.url + "/readyz") as r:
            assert r.status == 503
        async with http.post(url, json={**body, "stream": False}, headers=headers) as r:
            assert r.status == 503
            assert int(r.headers["Retry-After"]) >= 1
            assert (await r.json())["error"]["code"] == "backend_unavailable"
    outcomes = [s.request.outcome.value for s in live.gateway.streams]
    assert outcomes[0] == "backend_error"
    # Neither the request the engine died under nor the one refused after it
    # keeps anything of the tenant's quota.
    used = {s.kind: s.used for s in await live.gateway.quotas.usage("g")}
    assert used == {"tokens_per_minute": 0, "max_concurrency": 0}
