"""What the tests that kill processes under a batch job share: the job's
lines, polling a batch with a bound, its output and error lines, and what
the tenant's quota window in Redis holds (tests/test_batch_restart.py,
tests/test_batch_fleet_kill.py)."""

from __future__ import annotations

import asyncio
import json
import time
from typing import Any

import openai

from qosgate.config.models import TenantQuotas
from qosgate.quotas import TenantLimits
from qosgate.quotas.redis_store import RedisQuotaStore

TENANT = "fleet-batch"
"""The tenant of fleet_support's batch key."""
QUOTAS = TenantQuotas(tokens_per_day=10**9)
POLL_S = 0.1
MAX_POLLS = 1200
"""Bounded: two minutes of polls at most for any one wait."""
ENDED = ("completed", "failed", "expired", "cancelled")


def line(i: int) -> bytes:
    return json.dumps({
        "custom_id": f"line-{i}", "method": "POST", "url": "/v1/chat/completions",
        "body": {"model": "sim-llama3-8b", "max_tokens": 8 + i % 9,
                 "messages": [{"role": "user", "content": f"question {i} " * (1 + i % 5)}]},
    }).encode() + b"\n"  # fmt: skip


async def submit(client: openai.AsyncOpenAI, lines: int) -> Any:
    """A batch of `lines` lines, created."""
    source = b"".join(line(i) for i in range(lines))
    uploaded = await client.files.create(file=("in.jsonl", source), purpose="batch")
    return await client.batches.create(
        input_file_id=uploaded.id, endpoint="/v1/chat/completions", completion_window="24h"
    )


async def until(client: openai.AsyncOpenAI, batch_id: str, done: Any) -> Any:
    """The batch once `done(batch)` holds, polled every POLL_S."""
    for _ in range(MAX_POLLS):
        batch = await client.batches.retrieve(batch_id)
        if done(batch):
            return batch
        await asyncio.sleep(POLL_S)
    raise AssertionError(f"batch {batch_id} never got there: {batch}")


async def results(client: openai.AsyncOpenAI, batch: Any) -> list[dict[str, Any]]:
    """The ended batch's output lines, then its error lines."""
    found = []
    for file_id in (batch.output_file_id, batch.error_file_id):
        if file_id is not None:
            content = await client.files.content(file_id)
            found += [json.loads(text) for text in content.text.splitlines()]
    return found


def assert_each_line_once(found: list[dict[str, Any]], lines: int) -> None:
    ids = [o["custom_id"] for o in found]
    assert sorted(ids) == sorted(f"line-{i}" for i in range(lines))


async def day_used(redis_url: str, key_prefix: str) -> int:
    """The tokens the tenant's day window holds."""
    store = RedisQuotaStore(redis_url, key_prefix=key_prefix)
    try:
        (day,) = await store.usage(TENANT, TenantLimits.from_config(QUOTAS), time.time())
    finally:
        await store.close()
    return day.used


def usage(found: list[dict[str, Any]]) -> int:
    """What the answers' usage adds up to."""
    return sum(o["response"]["body"]["usage"]["total_tokens"] for o in found)
