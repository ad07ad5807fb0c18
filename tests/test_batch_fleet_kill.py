"""Batches in fleet mode survive the death of any process: each a `qosgate
serve` of its own on a real redis-server (the batch jobs, the work queue and
the quota windows all in it), the batch files on one directory the gateway
replicas share, and one process killed with SIGKILL mid-job.

- An engine node: what it ran goes back to the queue when its leases run out,
  and runs again when it is started again; the job completes.
- The gateway replica driving the job: its lease on the job runs out and the
  other replica takes the job over, settles the tries the dead one left
  (its journal) and runs the lines without a result.

Either way every custom_id appears exactly once in the output and error
files, and the tenant's day window holds exactly what the output's usage
adds up to: each line charged once.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import openai
import redis.asyncio as aioredis
import yaml
from batch_support import (
    ENDED, QUOTAS, TENANT, assert_each_line_once, day_used, results, submit, until, usage,
)  # fmt: skip
from fleet_support import KEYS, Proc, policy, with_fleet

from tests.redis_server import RedisServer

LINES = 160
KILL_AFTER = 30
QUOTA_PREFIX = "batch-fleet-kill:"
ENGINE_LEASE_S = 1.0
BATCH_LEASE_S = 1.5


def _config(tmp_path: Path, redis_url: str) -> Path:
    doc: dict[str, Any] = policy(speed=1.0, seqs=4, redis_url=None)
    doc = with_fleet(doc, redis_url, lease_s=ENGINE_LEASE_S)
    for tenant in doc["tenants"]:
        if tenant["id"] == TENANT:
            tenant["quotas"] = {"tokens_per_day": QUOTAS.tokens_per_day.limit}
    doc["quota_store"] = {"kind": "redis", "url": redis_url, "key_prefix": QUOTA_PREFIX}
    # No `store:`: in fleet mode the jobs are in the fleet's Redis.
    doc["batch"] = {"data_dir": str(tmp_path / "shared"), "in_flight_per_job": 8,
                    "lease_s": BATCH_LEASE_S}  # fmt: skip
    config = tmp_path / "fleet.yaml"
    config.write_text(yaml.safe_dump(doc))
    return config


def _client(gateway: Proc) -> openai.AsyncOpenAI:
    return openai.AsyncOpenAI(base_url=gateway.url, api_key=KEYS["batch"], max_retries=0)


async def _finish(client: openai.AsyncOpenAI, batch_id: str) -> list[dict[str, Any]]:
    """The job's end, which must be a completion with every line once: its lines."""
    ended = await until(client, batch_id, lambda b: b.status in ENDED)
    assert ended.status == "completed", ended
    assert (ended.request_counts.completed, ended.request_counts.failed) == (LINES, 0)
    found = await results(client, ended)
    assert_each_line_once(found, LINES)
    return found


def _stop(procs: list[Proc]) -> dict[str, int]:
    return {proc.name: proc.stop() for proc in procs}


@contextlib.asynccontextmanager
async def _running(procs: list[Proc]) -> AsyncIterator[dict[str, int]]:
    """The processes in `procs` (as the list stands at the end) stopped after
    the block, their exit codes put in what it yields; their logs printed
    if the block fails."""
    codes: dict[str, int] = {}
    try:
        yield codes
    except BaseException:
        print("\n".join(f"--- {p.name}\n{p.tail()}" for p in procs))
        raise
    finally:
        codes.update(await asyncio.to_thread(_stop, procs))


async def test_an_engine_node_killed_mid_job(tmp_path: Path) -> None:
    with RedisServer() as redis:
        config = _config(tmp_path, redis.url)
        engine = Proc(config, "engine-1", tmp_path, "engine")
        procs = [engine]
        async with _running(procs) as codes:
            gateway = Proc(config, "gateway-1", tmp_path, "gateway")
            procs.append(gateway)
            client = _client(gateway)
            batch = await submit(client, LINES)
            await until(client, batch.id, lambda b: b.request_counts.completed >= KILL_AFTER)
            held = (await asyncio.to_thread(engine.get, "/fleet"))["running"]
            assert held > 0, "the engine ran nothing: the kill would prove nothing"
            await asyncio.to_thread(engine.kill)
            stalled = await client.batches.retrieve(batch.id)
            assert stalled.request_counts.completed < LINES, "the kill came after the end"
            # The only engine node, started again: it takes back what the
            # dead one held once those leases run out.
            procs[0] = Proc(config, "engine-1", tmp_path, "engine")
            found = await _finish(client, batch.id)
            await client.close()
        assert codes == {"gateway-1": 0, "engine-1": 0}, codes
        assert await day_used(redis.url, QUOTA_PREFIX) == usage(found)


async def test_the_replica_driving_a_job_killed_mid_job(tmp_path: Path) -> None:
    with RedisServer() as redis:
        config = _config(tmp_path, redis.url)
        procs = [Proc(config, "engine-1", tmp_path, "engine")]
        async with _running(procs) as codes:
            driver = Proc(config, "gateway-1", tmp_path, "gateway")
            procs.append(driver)
            other = Proc(config, "gateway-2", tmp_path, "gateway")
            procs.append(other)
            on_driver, on_other = _client(driver), _client(other)
            batch = await submit(on_driver, LINES)  # its creator drives it
            # The other replica reads the job's progress as the driver makes it.
            await until(on_other, batch.id, lambda b: b.request_counts.completed >= KILL_AFTER)
            await asyncio.to_thread(driver.kill)
            await on_driver.close()
            # The kill left tries sent and unrecorded, their quota reserved.
            store = aioredis.Redis.from_url(redis.url)
            try:
                prefix = yaml.safe_load(config.read_text())["fleet"]["key_prefix"]
                stranded = await store.hlen(f"{prefix}batch:sent:{batch.id}")
            finally:
                await store.aclose()
            assert stranded > 0
            left = await on_other.batches.retrieve(batch.id)
            assert left.request_counts.completed < LINES, "the kill came after the end"
            found = await _finish(on_other, batch.id)
            await on_other.close()
        assert codes == {"engine-1": 0, "gateway-1": -9, "gateway-2": 0}, codes
        assert "taken over" in procs[2].tail()
        assert await day_used(redis.url, QUOTA_PREFIX) == usage(found)
