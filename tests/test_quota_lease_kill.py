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
import yaml

from tests.fleet_support import (
    STANDARD,
    Proc,
    cap_concurrency,
    chat,
    hold_streams,
    policy,
    slot_events,
)
from tests.redis_server import RedisServer

LEASE_S = 2.0
SLOTS = 4


async def status_of(http: aiohttp.ClientSession, url: str) -> int:
    async with http.post(url + "/chat/completions", json=chat(1, False), headers=STANDARD) as r:
        await r.read()
        return r.status


async def test_a_killed_gateways_slots_come_back_within_the_lease(tmp_path: Path):
    doc = policy(speed=1.0, seqs=16, redis_url=None)
    # A token every 50 ms or so: a 4,000-token stream outlives the test.
    doc["backend"]["speed"] = 0.05
    with RedisServer() as redis:
        cap_concurrency(doc, redis.url, slots=SLOTS, lease_s=LEASE_S, key_prefix="lease-kill:")
        config = tmp_path / "policy.yaml"
        config.write_text(yaml.safe_dump(doc))
        gateways: list[Proc] = []
        try:
            for index in range(4):
                gateways.append(Proc(config, f"gateway-{index + 1}", tmp_path, None))
            doomed, survivors = gateways[0], gateways[1:]
            async with aiohttp.ClientSession() as http:
                streams = await hold_streams(http, doomed.url, SLOTS, 4000)
                held_at = time.monotonic()
                # The streams run on past their first lease (read as they come).
                while time.monotonic() < held_at + 1.5 * LEASE_S:
                    for response in streams:
                        assert await asyncio.wait_for(response.content.readline(), 10)
                for gateway in survivors:
                    assert await status_of(http, gateway.url) == 429, "a 5th slot was taken"
                # The tenant's leases live in one key, which expires with the
                # last lease renewed (Redis says when, as a keyspace event).
                async with slot_events(redis.url, "expired") as expired:
                    doomed.kill()
                    killed_at = time.monotonic()
                    for response in streams:
                        response.close()
                    async with asyncio.timeout(3 * LEASE_S):
                        await expired()
                    freed_after = time.monotonic() - killed_at
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
