"""A batch survives its gateway: `qosgate serve` killed with SIGKILL in the
middle of a job, started again on the same data directory, finishes it,
with every custom_id exactly once in the output and the tenant's quota (in
a real Redis, which outlives the process) charged once per line: what the
window holds is what the output's usage adds up to."""

from __future__ import annotations

import sqlite3
from pathlib import Path
from typing import Any

import openai
import yaml
from batch_support import (
    ENDED, QUOTAS, TENANT, assert_each_line_once, day_used, results, submit, until, usage,
)  # fmt: skip
from fleet_support import KEYS, Proc

from tests.redis_server import RedisServer

LINES = 240
KILL_AFTER = 40


def _policy(data_dir: Path, redis_url: str) -> dict[str, Any]:
    return {
        "version": 1,
        "server": {"port": 0, "admin_token_env": None, "auth_failures_per_minute": 0},
        "backend": {"kind": "sim", "speed": 1.0, "max_num_seqs": 8},
        "tiers": {
            "interactive": {"priority": 0, "ttft_slo_ms": 500, "max_queue_wait_ms": 1000},
            "batch": {"priority": 2, "e2e_slo_ms": 600000, "max_queue_wait_ms": 60000,
                      "on_timeout": "delay"},
        },  # fmt: skip
        "tenants": [{
            "id": TENANT, "tier": "interactive", "api_keys": ["env:QG_FLEET_BATCH"],
            "quotas": {"tokens_per_day": QUOTAS.tokens_per_day.limit},
        }],  # fmt: skip
        "quota_store": {"kind": "redis", "url": redis_url, "key_prefix": "batch-restart:"},
        "observability": {"log_requests": False},
        "batch": {"data_dir": str(data_dir), "in_flight_per_job": 8},
    }


async def test_a_job_killed_mid_way_resumes_and_charges_each_line_once(tmp_path: Path) -> None:
    with RedisServer() as redis:
        config = tmp_path / "policy.yaml"
        config.write_text(yaml.safe_dump(_policy(tmp_path / "data", redis.url)))
        first = Proc(config, "first", tmp_path, None)
        try:
            client = openai.AsyncOpenAI(base_url=first.url, api_key=KEYS["batch"], max_retries=0)
            batch = await submit(client, LINES)
            seen = await until(client, batch.id,
                               lambda b: b.request_counts.completed >= KILL_AFTER)  # fmt: skip
            assert seen.status == "in_progress"
            first.kill()
        finally:
            first.kill()
        await client.close()
        # The kill cut tries off with their quota reserved: the journal holds
        # them, without a result.
        with sqlite3.connect(tmp_path / "data" / "batches.sqlite3") as db:
            (stranded,) = db.execute(
                "SELECT COUNT(*) FROM sent s LEFT JOIN results r ON r.batch_id = s.batch_id "
                "AND r.line_no = s.line_no AND r.request_id = s.request_id "
                "WHERE r.line_no IS NULL"
            ).fetchone()
        assert stranded > 0

        second = Proc(config, "second", tmp_path, None)
        try:
            client = openai.AsyncOpenAI(base_url=second.url, api_key=KEYS["batch"], max_retries=0)
            resumed = await client.batches.retrieve(batch.id)
            assert resumed.request_counts.completed >= KILL_AFTER
            assert resumed.request_counts.completed < LINES, "the kill came after the end"
            ended = await until(client, batch.id, lambda b: b.status in ENDED)
            assert ended.status == "completed", ended
            assert (ended.request_counts.completed, ended.request_counts.failed) == (LINES, 0)
            assert ended.error_file_id is None
            out = await results(client, ended)
            await client.close()
        finally:
            assert second.stop() == 0, second.tail()

        assert_each_line_once(out, LINES)
        assert await day_used(redis.url, "batch-restart:") == usage(out)
