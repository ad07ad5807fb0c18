"""A gateway killed with SIGKILL gives its tenant's concurrency slots back
within the lease, not after an hour: a real redis-server and 4 `qosgate serve`
processes sharing one quota store, a tenant with `max_concurrency: 4` and
`lease_s: 2`. Its 4 streams on one gateway run past their first lease and keep
their slots (renewed); once that gateway is killed, the others admit the
tenant again within about `lease_s`."""

from __future__ import annotations

import asyncio
import time
from pathlib import Path

import aiohttp
import redis.asyncio as aioredis
import yaml

from tests.fleet_support import KEYS, Proc, policy
from tests.redis_server import RedisServer

LEASE_S = 2.0
SLOTS = 4
MODEL = "sim-llama3-8b"


def body(max_tokens: int, stream: bool) -> dict:
    return {"model": MODEL, "messages": [{"role": "user", "content": "hello"}],
            "max_tokens": max_tokens, "stream": stream}  # fmt: skip


HEADERS = {"Authorization": f"Bearer {KEYS['standard']}"}


async def status_of(http: aiohttp.ClientSession, url: str) -> int:
    async with http.post(url + "/chat/completions", json=body(1, False), headers=HEADERS) as r:
        await r.read()
        return r.status


async def test_a_killed_gateways_slots_come_back_within_the_lease(tmp_path: Path):
    doc = policy(speed=1.0, seqs=16, redis_url=None)
    # A token every 50 ms or so: a 4,000-token stream outlives the test.
    doc["backend"]["speed"] = 0.05
    with RedisServer() as redis:
        doc["quota_store"] = {"kind": "redis", "url": redis.url, "lease_s": LEASE_S,
                              "key_prefix": "lease-kill:"}  # fmt: skip
        for tenant in doc["tenants"]:
            if tenant["id"] == "fleet-standard":
                tenant["quotas"] = {"max_concurrency": SLOTS}
        config = tmp_path / "policy.yaml"
        config.write_text(yaml.safe_dump(doc))
        gateways: list[Proc] = []
        try:
            for index in range(4):
                gateways.append(Proc(config, f"gateway-{index + 1}", tmp_path, None))
            doomed, survivors = gateways[0], gateways[1:]
            async with aiohttp.ClientSession() as http:
                streams = []
                for _ in range(SLOTS):
                    response = await http.post(doomed.url + "/chat/completions",
                                               json=body(4000, True), headers=HEADERS)  # fmt: skip
                    assert response.status == 200, await response.text()
                    streams.append(response)
                held_at = time.monotonic()
                # The streams run on past their first lease (read as they come).
                while time.monotonic() < held_at + 1.5 * LEASE_S:
                    for response in streams:
                        assert await asyncio.wait_for(response.content.readline(), 10)
                for gateway in survivors:
                    assert await status_of(http, gateway.url) == 429, "a 5th slot was taken"
                # The tenant's leases live in one key, which expires with the
                # last lease renewed (Redis says when, as a keyspace event).
                store = aioredis.Redis.from_url(redis.url)
                await store.config_set("notify-keyspace-events", "Ex")
                expiries = store.pubsub()
                await expiries.psubscribe("__keyevent@*__:expired")
                try:
                    doomed.kill()
                    killed_at = time.monotonic()
                    for response in streams:
                        response.close()
                    async with asyncio.timeout(3 * LEASE_S):
                        async for message in expiries.listen():
                            if message["type"] == "pmessage" and message["data"].endswith(
                                b"{fleet-standard}:conc"
                            ):
                                break
                    freed_after = time.monotonic() - killed_at
                finally:
                    await expiries.aclose()
                    await store.aclose()
                # Within the lease (and a renewal tick's slack), not an hour,
                # and a survivor admits the tenant again at once.
                assert freed_after <= LEASE_S + 0.5, freed_after
                assert await status_of(http, survivors[0].url) == 200
                admitted_after = time.monotonic() - killed_at
                print(f"slots back {admitted_after:.2f} s after the SIGKILL (lease_s {LEASE_S})")
        finally:
            for gateway in gateways:
                if gateway is gateways[0]:
                    gateway.kill()
                else:
                    gateway.stop()
