"""The metrics an operator alerts on: the process and its build, the quota
store's health, an engine node's own /metrics, and an in-process engine's
metrics served beside qosgate's."""

from __future__ import annotations

import asyncio

import aiohttp
from prometheus_client import CollectorRegistry, Gauge
from prometheus_client.parser import text_string_to_metric_families

from qosgate.backends.sim_live import SimBackend
from qosgate.config.loader import load_policy_text
from tests.http_support import ALICE_KEY, MODEL, POLICY_YAML, live_app, make_policy
from tests.redis_server import free_port

WAIT_S = 20.0


async def scrape(http: aiohttp.ClientSession, url: str) -> dict[tuple[str, tuple], float]:
    async with http.get(url + "/metrics") as r:
        assert r.status == 200
        text = await r.text()
    return {
        (s.name, tuple(sorted(s.labels.items()))): s.value
        for family in text_string_to_metric_families(text)
        for s in family.samples
    }


def value(samples: dict, name: str, **labels: str) -> float | None:
    return samples.get((name, tuple(sorted(labels.items()))))


async def test_the_process_and_its_build_are_exported():
    async with live_app() as live, aiohttp.ClientSession() as http:
        samples = await scrape(http, live.url)
    names = {name for name, _ in samples}
    assert {"process_cpu_seconds_total", "process_resident_memory_bytes"} <= names
    [build] = [labels for name, labels in samples if name == "qosgate_build_info"]
    assert dict(build)["version"] and dict(build)["python"].startswith("3.")


async def test_the_quota_store_health_shows_an_outage_and_failing_open():
    # alice has a token quota; the Redis store is a port nothing listens on.
    quota = "    quotas: {tokens_per_minute: 100000}\n"
    keys = '    api_keys: ["sha256:'
    text = POLICY_YAML.replace(keys, quota + keys, 1) + f"""
quota_store:
  kind: redis
  url: redis://127.0.0.1:{free_port()}/0
  on_error: fail_open
  timeout_ms: 200
"""
    async with live_app(make_policy(text)) as live, aiohttp.ClientSession() as http:
        before = await scrape(http, live.url)
        assert value(before, "qosgate_quota_store_up") == 1
        assert value(before, "qosgate_quota_store_failing_open") == 0
        assert value(before, "qosgate_quota_store_last_error_timestamp_seconds") == 0
        body = {"model": MODEL, "prompt": "hi", "max_tokens": 2}
        async with http.post(live.url + "/v1/completions", json=body,
                             headers={"Authorization": f"Bearer {ALICE_KEY}"}) as r:  # fmt: skip
            assert r.status == 200
        after = await scrape(http, live.url)
    assert value(after, "qosgate_quota_store_up") == 0
    assert value(after, "qosgate_quota_store_failing_open") == 1
    assert value(after, "qosgate_quota_store_last_error_timestamp_seconds") > 1.7e9


async def test_an_in_process_engines_own_metrics_are_served_beside_qosgates():
    engine_registry = CollectorRegistry()
    running = Gauge("vllm:num_requests_running", "running", ["engine"], registry=engine_registry)
    running.labels("0").set(3)
    Gauge("unrelated_metric", "not the engine's", registry=engine_registry).set(1)
    policy = make_policy()
    backend = SimBackend(policy.backend)
    backend.engine_metrics = (engine_registry, "vllm:")  # type: ignore[misc]
    async with live_app(policy, backend) as live, aiohttp.ClientSession() as http:
        samples = await scrape(http, live.url)
    assert value(samples, "vllm:num_requests_running", engine="0") == 3
    assert not any(name == "unrelated_metric" for name, _ in samples)


async def test_an_engine_node_serves_its_own_metrics(redis_server):
    from qosgate.wiring import serve_engine

    policy = load_policy_text(POLICY_YAML.replace(
        "backend:\n", "fleet:\n  role: engine\n  node_id: e-metrics\n"
        f"  url: {redis_server.url}\n  key_prefix: 'metrics-test:'\nbackend:\n", 1
    ), "test")  # fmt: skip
    listening: asyncio.Queue[str] = asyncio.Queue()
    stop = asyncio.Event()
    task = asyncio.create_task(
        serve_engine(policy, "127.0.0.1", 0, on_ready=listening.put_nowait, stop=stop)
    )
    try:
        async with asyncio.timeout(WAIT_S):
            url = await listening.get()
        async with aiohttp.ClientSession() as http:
            samples = await scrape(http, url)
    finally:
        stop.set()
        await task
    assert value(samples, "qosgate_engine_running", node="e-metrics") == 0
    assert value(samples, "qosgate_engine_completed_total", node="e-metrics") == 0
    assert value(samples, "qosgate_engine_free_slots", node="e-metrics") > 0
    assert any(name == "qosgate_build_info" for name, _ in samples)
