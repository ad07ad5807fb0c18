"""Distributed mode end to end: 3 gateway replicas and 2 engine nodes, each its
own `qosgate serve` process, on a real redis-server; one engine node is
killed with SIGKILL while it runs requests. The requests belong to a few
sessions, so the survivor must also take work held back for the dead node's
sessions once that node stops counting as live.

No request may be lost: every client gets its whole answer (the simulated
GPU's text is deterministic, so a re-run that repeated or dropped a token
would show), streamed or not, and the replicas count exactly one outcome per
request. The speed and scale figures of this setup are benchmarks/fleet.py's.
"""

from __future__ import annotations

import asyncio
import json
from pathlib import Path

import aiohttp
import pytest

from qosgate.backends.sim_live import filler_text
from tests.fleet_support import KEYS, Fleet, bucket_quantile

LIMIT_S = 60.0
REQUESTS = 40
TOKENS = 60


async def ask(session: aiohttp.ClientSession, url: str, stream: bool, chat: str,
              first: asyncio.Queue[None]) -> tuple[int, str, dict | None]:  # fmt: skip
    body = {"model": "sim-llama3-8b", "messages": [{"role": "user", "content": "hello " * 40}],
            "max_tokens": TOKENS, "stream": stream}  # fmt: skip
    if stream:
        body["stream_options"] = {"include_usage": True}
    headers = {"Authorization": f"Bearer {KEYS['batch']}", "X-Session-Id": chat}
    async with session.post(url + "/chat/completions", json=body, headers=headers) as response:
        if not stream:
            payload = await response.json()
            if response.status != 200:
                return response.status, json.dumps(payload), None
            return 200, payload["choices"][0]["message"]["content"], payload["usage"]
        text, usage, done = "", None, False
        async for raw in response.content:
            line = raw.decode().strip()
            if not line.startswith("data: "):
                continue
            data = line.removeprefix("data: ")
            if data == "[DONE]":
                done = True
                break
            event = json.loads(data)
            if "error" in event:
                return 500, data, None
            if event.get("usage"):
                usage = event["usage"]
            for choice in event.get("choices", []):
                piece = choice.get("delta", {}).get("content") or ""
                if piece and not text:
                    first.put_nowait(None)
                text += piece
        return (response.status if done else 599), text, usage


@pytest.mark.timeout(180)
def test_a_quantile_is_read_from_buckets_as_prometheus_reads_it():
    inf = float("inf")
    # Half of 10 in the first bucket: its upper bound; interpolated inside one.
    assert bucket_quantile({0.1: 5, 0.5: 10, inf: 10}, 0.5) == 0.1
    assert bucket_quantile({0.1: 0, 0.5: 10, inf: 10}, 0.5) == pytest.approx(0.3)
    # In the +Inf bucket: the highest finite bound. Nothing observed: None.
    assert bucket_quantile({0.1: 5, 0.5: 10, inf: 20}, 0.99) == 0.5
    assert bucket_quantile({0.1: 0, inf: 0}, 0.5) is None


async def test_killing_an_engine_node_loses_no_request(tmp_path: Path):
    fleet = await asyncio.to_thread(Fleet, tmp_path, gateways=3, engines=2, speed=1.0, seqs=4,
                                    lease_s=1.0)  # fmt: skip
    victim = fleet.engines[1]
    try:
        first: asyncio.Queue[None] = asyncio.Queue()
        async with aiohttp.ClientSession() as session, asyncio.timeout(LIMIT_S):
            tasks = [
                asyncio.ensure_future(ask(
                    session, fleet.gateways[i % 3].url, stream=i % 2 == 0, chat=f"chat-{i % 6}",
                    first=first,
                ))  # fmt: skip
                for i in range(REQUESTS)
            ]
            # Both nodes have every slot busy once this many streams have
            # output (half the requests stream, and all were sent at once).
            for _ in range(4):
                await first.get()
            held = (await asyncio.to_thread(victim.get, "/fleet"))["running"]
            assert held > 0, "the victim ran nothing: the test would prove nothing"
            await asyncio.to_thread(victim.kill)
            answers = await asyncio.gather(*tasks)
        expected = filler_text(0, TOKENS)
        bad = [a for a in answers if a[0] != 200 or a[1] != expected]
        assert not bad, f"{len(bad)} requests not answered in full, e.g. {bad[:2]}"
        assert all(usage and usage["completion_tokens"] == TOKENS for _, _, usage in answers)
        outcomes = await asyncio.to_thread(fleet.outcomes)
        assert outcomes == {"completed": REQUESTS}, outcomes
        # Each request's wait in the shared queue, observed once by its own
        # replica, however many runs it took.
        waits = await asyncio.to_thread(fleet.total, "qosgate_fleet_queue_wait_seconds_count")
        assert waits == REQUESTS
        by_tier = await asyncio.to_thread(fleet.fleet_waits)
        assert set(by_tier) == {"batch"} and by_tier["batch"]["count"] == REQUESTS
        assert 0.0 <= by_tier["batch"]["p50_s"] <= by_tier["batch"]["p99_s"] < LIMIT_S
    except BaseException:
        print(fleet.logs())
        raise
    finally:
        codes = await asyncio.to_thread(fleet.close)
    # SIGKILL for the victim; a clean exit for everyone else.
    assert codes == {"gateway-1": 0, "gateway-2": 0, "gateway-3": 0, "engine-1": 0,
                     "engine-2": -9}  # fmt: skip
