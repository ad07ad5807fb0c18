"""The ranges of a policy's numbers: every number is bounded, and a policy at
the bounds still serves (tests/test_bad_policies.py is the other side)."""

from __future__ import annotations

import hashlib
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import aiohttp
import pytest

from qosgate.cli import main
from qosgate.config import ConfigError, load_policy_text
from qosgate.config import models as m
from qosgate.config.models import PolicyConfig
from tests.http_support import ENV, MODEL, Served

ADMIN_TOKEN = "admin-secret"
KEYS = {"alice": "key-of-alice", "carol": "key-of-carol"}


def digest(tenant: str) -> str:
    return "sha256:" + hashlib.sha256(KEYS[tenant].encode()).hexdigest()


WEEK_MS = m.MAX_DURATION_MS
WEEK_S = m.MAX_DURATION_S
QUOTAS_AT_MAX = (
    f"{{tokens_per_minute: {m.MAX_QUOTA}, tokens_per_day: {{limit: {m.MAX_QUOTA}, "
    f"burst: {m.MAX_QUOTA}}}, requests_per_minute: {m.MAX_QUOTA}, max_concurrency: {m.MAX_COUNT}}}"
)
BATCH_AT_MAX = f"max_batch_size: {m.MAX_COUNT}, max_batch_tokens: {m.MAX_COUNT}"
TIER_AT_MAX = f"""
    ttft_slo_ms: {WEEK_MS}
    e2e_slo_ms: {WEEK_MS}
    max_queue_wait_ms: {WEEK_MS}
    max_queue_len: {m.MAX_COUNT}
    on_timeout: delay
    max_tokens: {m.MAX_COUNT}
    default_max_tokens: {m.MAX_COUNT}
    min_delivery_bytes_per_s: {m.MAX_BODY_BYTES}
    delivery_window_s: {WEEK_S}
"""
SERVER_AT_MAX = f"""
server:
  port: 65535
  max_body_bytes: {m.MAX_BODY_BYTES}
  admin_token_env: QG_TEST_ADMIN
  shutdown_grace_s: {WEEK_S}
  idle_timeout_s: {WEEK_S}
  body_timeout_s: {WEEK_S}
  client_stall_timeout_s: {WEEK_S}
  auth_failures_per_minute: {m.MAX_COUNT}
"""
SIM_AT_MAX = f"""
backend:
  kind: sim
  model: {MODEL}
  speed: {m.MAX_FACTOR}
  max_num_seqs: {m.MAX_COUNT}
  max_num_batched_tokens: {m.MAX_COUNT}
  kv_capacity_tokens: {m.MAX_COUNT}
  output_median_tokens: {m.MAX_COUNT}
"""
OPENAI_AT_MAX = f"""
backend:
  kind: openai
  upstreams:
    - {{url: "http://127.0.0.1:9/v1", max_concurrency: {m.MAX_COUNT}, weight: {m.MAX_FACTOR}}}
    - {{url: "http://127.0.0.1:10/v1", weight: {m.MIN_FACTOR}}}
  health_interval_s: {WEEK_S}
  timeout_s: {WEEK_S}
  read_timeout_s: {WEEK_S}
"""
FLEET_AT_MAX = f"""
fleet:
  role: gateway
  lease_s: {WEEK_S}
  timeout_ms: {WEEK_MS}
  affinity_ttl_s: {WEEK_S}
"""
# Every number at its upper bound; weights also at their lower one. The one
# exception is the top tier's batch window: a window of a week holds a request
# a week by design, so the requests go to a tier without one, and the window
# at its bound sits on the bottom tier.
REST_AT_MAX = f"""
scheduler:
  aging: {{interval_ms: {WEEK_MS}, max_boost: {m.MAX_LEVEL}}}
  vtc: {{w_in: {m.MAX_FACTOR}, w_out: {m.MAX_FACTOR}}}
  preemption: true
  reserve: {{slots: {m.MAX_COUNT}, kv_tokens: {m.MAX_COUNT}}}
  drain_rate_tau_s: {WEEK_S}
  initial_drain_rate: {m.MAX_COUNT}
tiers:
  top:
    priority: 0
{TIER_AT_MAX}
    batch: {{max_wait_ms: 0, {BATCH_AT_MAX}}}
  bottom:
    priority: {m.MAX_LEVEL}
{TIER_AT_MAX}
    preemptible: true
    batch: {{max_wait_ms: {WEEK_MS}, {BATCH_AT_MAX}}}
tenants:
  - id: alice
    tier: top
    weight: {m.MAX_FACTOR}
    api_keys: ["{digest("alice")}"]
    quotas: {QUOTAS_AT_MAX}
  - id: carol
    tier: top
    weight: {m.MIN_FACTOR}
    api_keys: ["{digest("carol")}"]
    quotas: {QUOTAS_AT_MAX}
  - id: bob
    tier: bottom
    weight: {m.MAX_FACTOR}
    quotas: {QUOTAS_AT_MAX}
default_tier: bottom
quota_store: {{timeout_ms: {WEEK_MS}, retry_interval_s: {WEEK_S}, lease_s: {WEEK_S}}}
"""
MAX_POLICY = SERVER_AT_MAX + SIM_AT_MAX + REST_AT_MAX


def numeric_schemas(schema: Any, where: str = "") -> Iterator[tuple[str, dict[str, Any]]]:
    if isinstance(schema, dict):
        if schema.get("type") in ("integer", "number") and "const" not in schema:
            yield where, schema
        for key, value in schema.items():
            yield from numeric_schemas(value, f"{where}.{key}")
    elif isinstance(schema, list):
        for index, value in enumerate(schema):
            yield from numeric_schemas(value, f"{where}.{index}")


def test_every_number_of_the_schema_is_bounded() -> None:
    found = list(numeric_schemas(PolicyConfig.model_json_schema()))
    assert len(found) > 40
    for where, schema in found:
        if ".engine_args." in where and schema["type"] == "number":
            continue  # vLLM's floats: only finite (not in a JSON schema), vLLM checks the rest
        assert "maximum" in schema, where
        assert "minimum" in schema or "exclusiveMinimum" in schema, where


@pytest.mark.parametrize(
    "text",
    [MAX_POLICY, MAX_POLICY + FLEET_AT_MAX, SERVER_AT_MAX + OPENAI_AT_MAX + REST_AT_MAX],
    ids=["sim", "fleet", "openai"],
)
def test_a_policy_at_the_bounds_validates(
    text: str, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    path = tmp_path / "max.yaml"
    path.write_text(text)
    assert main(["validate", str(path)]) == 0
    out = capsys.readouterr().out
    assert "valid policy" in out and "1P" in out  # the summary's quota column


@pytest.mark.parametrize(
    ("at_bound", "past"),
    [
        (f"tokens_per_minute: {m.MAX_QUOTA}", f"tokens_per_minute: {m.MAX_QUOTA + 1}"),
        (f"max_queue_wait_ms: {WEEK_MS}", f"max_queue_wait_ms: {WEEK_MS + 1}"),
        (f"weight: {m.MIN_FACTOR}", f"weight: {m.MIN_FACTOR / 2}"),
        (f"priority: {m.MAX_LEVEL}", f"priority: {m.MAX_LEVEL + 1}"),
    ],
)
def test_one_past_a_bound_is_refused(at_bound: str, past: str) -> None:
    assert at_bound in MAX_POLICY
    with pytest.raises(ConfigError, match="should be"):
        load_policy_text(MAX_POLICY.replace(at_bound, past, 1))


async def test_a_policy_at_the_bounds_serves() -> None:
    policy = load_policy_text(MAX_POLICY, "max.yaml")
    admin = {"Authorization": f"Bearer {ADMIN_TOKEN}"}
    body = {"model": MODEL, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 4}
    environ = {**ENV, "QG_TEST_ADMIN": ADMIN_TOKEN}
    async with Served(policy, environ=environ) as served, aiohttp.ClientSession() as http:
        for tenant, key in KEYS.items():
            for stream in (False, True):
                async with http.post(
                    served.url + "/v1/chat/completions", json={**body, "stream": stream},
                    headers={"Authorization": f"Bearer {key}"},
                ) as response:  # fmt: skip
                    text = await response.text()
                    assert response.status == 200, (tenant, text)
                    assert response.headers["x-ratelimit-limit-tokens"] == str(m.MAX_QUOTA)
        views = {}
        for path in ("/admin/stats", "/admin/quotas", "/dashboard", "/metrics"):
            async with http.get(served.url + path, headers=admin) as response:
                assert response.status == 200, (path, await response.text())
                if response.content_type == "application/json":
                    views[path] = await response.json()
    limits = views["/admin/quotas"]["tenants"]["alice"]["limits"]
    assert limits["tokens_per_day"]["limit"] == m.MAX_QUOTA
    assert 0 < limits["tokens_per_day"]["used"] < m.MAX_QUOTA


@pytest.mark.parametrize("port", ["70000", "-1", "http"])
def test_serve_refuses_a_port_option_that_is_no_port(
    port: str, capsys: pytest.CaptureFixture[str]
) -> None:
    # Before, 70000 was taken as 70000 - 65536 and served there.
    with pytest.raises(SystemExit) as exited:
        main(["serve", "--config", "policies/example.yaml", "--port", port])
    assert exited.value.code == 2
    assert "--port" in capsys.readouterr().err
