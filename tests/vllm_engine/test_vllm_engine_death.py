"""An engine that dies or wedges is seen, fenced and restarted.

Killed: its EngineCore process gets SIGKILL mid-stream. Wedged: its input
thread dies on a request the gateway would never send (vLLM's own
`msgspec.ValidationError` on `seed: "abc"`, given straight to the engine), so
the engine takes nothing more while it looks alive. Either way /readyz turns
false at once, the requests it was running end 503 with Retry-After (an error
event, for a stream already under way), nothing hangs past its deadline, no
tokens are kept from the tenant's quota for work the engine never finished,
and a new engine is serving within 60 s, counted in /metrics.
"""

from __future__ import annotations

import asyncio
import signal
import time

import aiohttp
import psutil
import pytest
import pytest_asyncio
from prometheus_client.parser import text_string_to_metric_families

from tests.http_support import live_app, make_policy
from tests.vllm_engine.test_vllm_backend import KEYS, policy_yaml

pytestmark = pytest.mark.asyncio(loop_scope="module")

STALL_S = 4.0
HEADERS = {"Authorization": "Bearer " + KEYS["gold"]}
LONG = {"model": "tiny", "prompt": "hello", "max_tokens": 1500, "ignore_eos": True}


@pytest_asyncio.fixture(scope="module", loop_scope="module")
async def live(tiny_model):
    from qosgate.backends import build_backend

    # Gold has quotas, so the refunds can be seen in its (memory) store.
    yaml_text = policy_yaml(tiny_model).replace(
        "  - id: g\n    tier: gold\n",
        "  - id: g\n    tier: gold\n    quotas: {tokens_per_minute: 1000000, max_concurrency: 8}\n",
    ).replace("  kind: vllm\n", f"  kind: vllm\n  stall_timeout_s: {STALL_S}\n")
    assert "quotas" in yaml_text and "stall_timeout_s" in yaml_text
    policy = make_policy(yaml_text)
    backend = build_backend(policy.backend)
    async with live_app(policy, backend) as app:
        await backend.wait_ready()
        yield app


async def _ready(http: aiohttp.ClientSession, live) -> int:
    async with http.get(live.url + "/readyz") as r:
        return r.status


async def _restarts(http: aiohttp.ClientSession, live) -> float:
    async with http.get(live.url + "/metrics") as r:
        text = await r.text()
    for family in text_string_to_metric_families(text):
        if family.name == "qosgate_backend_restarts":
            return family.samples[0].value
    raise AssertionError("no qosgate_backend_restarts_total in /metrics")


async def _fenced_then_back(http, live, streamed, wholes, started: float) -> int:
    """The checks both ways of failing share, from the moment the failure is
    caused (`started`). Returns the tokens the request served after it used."""
    backend = live.gateway.backend
    await asyncio.wait_for(backend.died.wait(), STALL_S + 10)
    fenced_s = time.monotonic() - started
    assert await _ready(http, live) == 503
    if streamed is not None:
        # The stream under way ends with an error event, not a hang.
        rest = await asyncio.wait_for(streamed.content.read(), 30)
        assert b'"error"' in rest and b"backend_unavailable" in rest, rest[-300:]
    for whole in wholes:
        # What was running and had sent nothing yet is a 503 with Retry-After.
        response = await asyncio.wait_for(whole, 30)
        assert response.status == 503, await response.text()
        assert int(response.headers["Retry-After"]) >= 1
        assert (await response.json())["error"]["code"] == "backend_unavailable"
    # Back and serving within 60 s of the failure.
    await asyncio.wait_for(backend.back.wait(), max(1.0, 60 - (time.monotonic() - started)))
    assert await _ready(http, live) == 200
    async with http.post(live.url + "/v1/completions", json={**LONG, "max_tokens": 4},
                         headers=HEADERS) as r:
        assert r.status == 200, await r.text()
        usage = (await r.json())["usage"]
        assert usage["completion_tokens"] == 4
    serving_s = time.monotonic() - started
    assert serving_s < 60
    # The figures docs/RELIABILITY.md quotes (pytest -s shows them).
    print(f"fenced {fenced_s:.2f} s and serving again {serving_s:.1f} s after the failure")
    return usage["total_tokens"]


async def _start_two(http, live):
    """A stream under way and a whole answer running, both in the engine."""
    backend = live.gateway.backend
    both_running = asyncio.Event()
    generate = backend.generate

    def watched(job):
        stream = generate(job)
        if len(backend._runs) >= 2:
            both_running.set()
        return stream

    backend.generate = watched
    try:
        url = live.url + "/v1/completions"
        streamed = await http.post(url, json={**LONG, "stream": True}, headers=HEADERS)
        assert streamed.status == 200
        await streamed.content.readline()  # generating when the engine fails
        whole = asyncio.ensure_future(http.post(url, json=LONG, headers=HEADERS))
        await asyncio.wait_for(both_running.wait(), 30)
    finally:
        del backend.generate
    return streamed, whole


async def test_a_killed_engine_is_fenced_and_restarted(live):
    backend = live.gateway.backend
    async with aiohttp.ClientSession() as http:
        assert await _restarts(http, live) == 0
        assert backend.warm_ups == 1 and backend.warm_up_s is not None
        streamed, whole = await _start_two(http, live)
        started = time.monotonic()
        for child in psutil.Process().children(recursive=True):
            child.send_signal(signal.SIGKILL)
        await asyncio.wait_for(backend.died.wait(), 2)  # seen within 2 s
        assert await _ready(http, live) == 503
        served = await _fenced_then_back(http, live, streamed, [whole], started)
        assert await _restarts(http, live) == 1
        # The new engine was warmed up too before it served.
        assert backend.warm_ups == 2 and backend.warm_up_s is not None
    outcomes = [s.request.outcome.value for s in live.gateway.streams[:2]]
    assert outcomes == ["backend_error", "backend_error"]
    # Neither request the engine died under keeps anything of the tenant's
    # quota: what it holds is the one served after the restart.
    used = {s.kind: s.used for s in await live.gateway.quotas.usage("g")}
    assert used == {"tokens_per_minute": served, "max_concurrency": 0}


async def test_a_wedged_engine_is_fenced_by_the_watchdog_and_restarted(live):
    from vllm import SamplingParams

    backend = live.gateway.backend
    async with aiohttp.ClientSession() as http:
        # What the gateway's request model stops at the door, given to the
        # engine directly: its input thread dies, and it takes nothing more.
        params = SamplingParams(max_tokens=4)
        params.seed = "abc"
        engine_input = backend._render("completions", {"prompt": [5, 6]})
        wedge = backend.engine.generate(engine_input, params, "wedge")
        wedging = asyncio.ensure_future(wedge.__anext__())
        started = time.monotonic()
        url = live.url + "/v1/completions"
        wholes = [
            asyncio.ensure_future(http.post(url, json={**LONG, "stream": stream}, headers=HEADERS))
            for stream in (False, True)
        ]
        try:
            await _fenced_then_back(http, live, None, wholes, started)
        finally:
            wedging.cancel()
            await asyncio.gather(wedging, return_exceptions=True)
        # Fenced by the stall bound, not before it.
        assert time.monotonic() - started >= STALL_S * 0.9
        assert await _restarts(http, live) == 2
