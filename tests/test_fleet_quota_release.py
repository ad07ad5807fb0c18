"""Fleet mode: a gateway replica killed with SIGKILL while it holds all of a
tenant's `max_concurrency` slots gives them back as soon as an engine node
finds it gone, not when the quota lease runs out.

A real redis-server holds both the fleet's queue and the quota store; two
replicas and one engine node are `qosgate serve` processes. The quota lease
is 30 s, so the surviving replica can admit the tenant within the test's few
seconds only through the engine node's release.
"""

from __future__ import annotations

import asyncio
import time
from pathlib import Path

import aiohttp
import pytest
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

SLOTS = 4
QUOTA_LEASE_S = 30.0
FLEET_LEASE_S = 1.0
ADMITTED_WITHIN_S = 3.0
"""A renewal tick of the engine node (a third of FLEET_LEASE_S) finds the
replica gone, with room for a slow machine; a tenth of the quota lease."""


async def refused_for(http: aiohttp.ClientSession, url: str) -> str | None:
    """None when `url` admits (and serves) a one-token request of the tenant,
    else the refusal's text."""
    async with http.post(url + "/chat/completions", json=chat(1, False), headers=STANDARD) as r:
        text = await r.text()
        return None if r.status == 200 else f"{r.status} {text}"


@pytest.mark.timeout(120)
async def test_a_killed_replicas_slots_come_back_when_its_runs_are_stopped(tmp_path: Path):
    with RedisServer() as redis:
        # A token every 50 ms or so: a 4,000-token stream outlives the test.
        doc = policy(speed=0.05, seqs=16, redis_url=redis.url, lease_s=FLEET_LEASE_S)
        cap_concurrency(doc, redis.url, slots=SLOTS, lease_s=QUOTA_LEASE_S,
                        key_prefix="fleet-quota:")  # fmt: skip
        config = tmp_path / "fleet.yaml"
        config.write_text(yaml.safe_dump(doc))
        procs: list[Proc] = []
        try:
            engine = Proc(config, "engine-1", tmp_path, "engine")
            procs.append(engine)
            doomed = Proc(config, "gateway-a", tmp_path, "gateway")
            procs.append(doomed)
            survivor = Proc(config, "gateway-b", tmp_path, "gateway")
            procs.append(survivor)
            async with aiohttp.ClientSession() as http:
                streams = await hold_streams(http, doomed.url, SLOTS, 4000)
                refusal = await refused_for(http, survivor.url)
                assert refusal is not None and "max_concurrency" in refusal, refusal
                # A release takes leases out of the tenant's key: the event
                # to wait on between attempts (nothing else settles meanwhile).
                async with slot_events(redis.url, "zrem") as removed:
                    doomed.kill()
                    killed_at = time.monotonic()
                    for response in streams:
                        response.close()
                    freed_after = None
                    try:
                        async with asyncio.timeout(ADMITTED_WITHIN_S):
                            while (refusal := await refused_for(http, survivor.url)) is not None:
                                await removed()
                                freed_after = time.monotonic() - killed_at
                    except TimeoutError:
                        pytest.fail(f"still refused {ADMITTED_WITHIN_S} s after the kill: "
                                    f"{refusal}\n{engine.tail()}")  # fmt: skip
                    admitted_after = time.monotonic() - killed_at
                # The answer to the admitted request (one token on the slowed
                # simulated GPU) takes about 0.15 s of the second figure. A
                # release before the first attempt has no time of its own.
                freed = "before the first attempt" if freed_after is None else (
                    f"{freed_after:.2f} s")
                print(f"slots released {freed}, the tenant served again {admitted_after:.2f} s "
                      f"after the SIGKILL (fleet lease_s {FLEET_LEASE_S}, quota lease_s "
                      f"{QUOTA_LEASE_S})")  # fmt: skip
                assert engine.get("/fleet")["orphaned"] == SLOTS
        finally:
            for proc in reversed(procs):
                proc.stop()
