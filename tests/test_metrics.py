"""/metrics under load: every documented metric (README, "Operations") is there, parsed
with prometheus-client's own parser, and moves as the load does."""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator

import aiohttp
import pytest
from prometheus_client.parser import text_string_to_metric_families
from structlog.testing import capture_logs

from qosgate.backends.base import Chunk, GenerationJob
from tests.http_support import (
    ALICE_KEY,
    BOB_KEY,
    MODEL,
    POLICY_YAML,
    ScriptedBackend,
    live_app,
    make_policy,
    words,
)
from tests.upstream_support import FakeUpstream, over_upstream

# Metric families (counters without their _total suffix), by their documented names.
DESIGN_METRICS = {
    "qosgate_queue_depth", "qosgate_queue_tokens", "qosgate_oldest_wait_seconds",
    "qosgate_queue_wait_seconds", "qosgate_requests", "qosgate_ttft_seconds",
    "qosgate_tpot_seconds", "qosgate_e2e_seconds", "qosgate_slo_attained", "qosgate_slo_missed",
    "qosgate_batch_size", "qosgate_batch_wait_seconds", "qosgate_tokens",
    "qosgate_quota_remaining_tokens", "qosgate_backend_inflight", "qosgate_backend_capacity",
}  # fmt: skip


def policy():
    # alice (interactive) has a token quota and an SLO nothing can meet, so
    # slo_missed moves; bob (batch) has a generous end-to-end SLO.
    text = POLICY_YAML.replace(
        "    ttft_slo_ms: 500", "    ttft_slo_ms: 0.001"
    ).replace(
        '    api_keys: ["sha256:', "    quotas: {tokens_per_minute: 1000000}\n    api_keys: [\"sha256:", 1
    ).replace(
        "    default_max_tokens: 8", "    default_max_tokens: 8\n    e2e_slo_ms: 600000"
    )
    return make_policy(text)


async def scrape(http: aiohttp.ClientSession, url: str) -> dict[tuple[str, tuple], float]:
    async with http.get(url + "/metrics") as r:
        assert r.status == 200
        assert r.content_type == "text/plain"
        text = await r.text()
    samples = {}
    families = set()
    for family in text_string_to_metric_families(text):
        families.add(family.name)
        for s in family.samples:
            samples[(s.name, tuple(sorted(s.labels.items())))] = s.value
    samples[("families", ())] = families  # type: ignore[assignment]
    return samples


def value(samples, name: str, **labels) -> float:
    return samples.get((name, tuple(sorted(labels.items()))), 0.0)


async def test_every_design_metric_is_exported_and_moves_with_the_load():
    gate = asyncio.Event()

    async def held(job: GenerationJob) -> AsyncIterator[Chunk]:
        await gate.wait()
        for i in range(4):
            yield Chunk(text=f"w{i} ", tokens=1, finish_reason="stop" if i == 3 else None)

    backend = ScriptedBackend(held, free_slots=2)
    async with live_app(policy(), backend) as live, aiohttp.ClientSession() as http:
        before = await scrape(http, live.url)
        assert DESIGN_METRICS <= before[("families", ())]
        assert value(before, "qosgate_backend_capacity") == 2
        # The quota store's counters, all zero on the memory store.
        for name in ("store_errors", "unshared_tokens", "carries", "leases_lost"):
            assert (f"qosgate_quota_{name}_total", ()) in before
            assert value(before, f"qosgate_quota_{name}_total") == 0

        async def call(key: str, stream: bool) -> int:
            body = {"model": MODEL, "messages": [{"role": "user", "content": "hi"}],
                    "max_tokens": 4, "stream": stream}
            async with http.post(live.url + "/v1/chat/completions", json=body,
                                 headers={"Authorization": f"Bearer {key}"}) as r:
                await r.read()
                return r.status

        with capture_logs() as logs:
            calls = [asyncio.create_task(call(k, s)) for k in (ALICE_KEY, BOB_KEY)
                     for s in (False, True, False)]
            # Two run (held by the backend), four wait in qosgate's queues.
            while len(live.gateway.streams) < 6:
                await live.gateway.submitted.wait()
                live.gateway.submitted.clear()
            during = await scrape(http, live.url)
            assert value(during, "qosgate_backend_inflight") == 2
            queued = sum(value(during, "qosgate_queue_depth", tier=t)
                         for t in ("interactive", "batch"))
            assert queued == 4
            assert sum(value(during, "qosgate_queue_tokens", tier=t)
                       for t in ("interactive", "batch")) > 0
            assert max(value(during, "qosgate_oldest_wait_seconds", tier=t)
                       for t in ("interactive", "batch")) > 0

            gate.set()
            assert await asyncio.gather(*calls) == [200] * 6
            # A refusal at the door counts too.
            async with http.post(live.url + "/v1/chat/completions", json={"model": MODEL},
                                 headers={"Authorization": "Bearer wrong"}) as r:
                assert r.status == 401

        after = await scrape(http, live.url)
    requests = "qosgate_requests_total"
    served = {"model": MODEL}
    assert value(after, requests, tier="interactive", tenant="alice", outcome="completed",
                 **served) == 3
    assert value(after, requests, tier="batch", tenant="bob", outcome="completed", **served) == 3
    # Refused before its body was read: no model yet.
    assert value(after, requests, tier="none", tenant="none", outcome="unauthorized",
                 model="none") == 1
    assert value(after, "qosgate_queue_depth", tier="interactive") == 0
    assert value(after, "qosgate_backend_inflight") == 0
    for name in ("qosgate_queue_wait_seconds_count", "qosgate_ttft_seconds_count",
                 "qosgate_tpot_seconds_count", "qosgate_e2e_seconds_count"):
        assert value(after, name, tier="interactive", **served) == 3, name
        assert value(after, name, tier="batch", **served) == 3, name
    assert value(after, "qosgate_slo_missed_total", tier="interactive", **served) == 3
    assert value(after, "qosgate_slo_attained_total", tier="batch", **served) == 3
    assert value(after, "qosgate_batch_size_count") >= 3
    assert value(after, "qosgate_batch_size_sum") == 6
    assert value(after, "qosgate_batch_wait_seconds_count") == value(after, "qosgate_batch_size_count")
    tokens = "qosgate_tokens_total"
    assert value(after, tokens, tenant="alice", kind="completion", model=MODEL) == 12
    assert value(after, tokens, tenant="bob", kind="prompt", model=MODEL) == 3 * 5
    remaining = value(after, "qosgate_quota_remaining_tokens", tenant="alice")
    assert 0 < remaining < 1_000_000

    # One log line per finished request, with its outcome, waits and tokens.
    lines = [entry for entry in logs if entry.get("event") == "request"]
    assert len(lines) == 6
    assert {line["outcome"] for line in lines} == {"completed"}
    assert all(line["completion_tokens"] == 4 and line["prompt_tokens"] == 5 for line in lines)
    assert all(line["queue_wait_ms"] is not None and line["ttft_ms"] is not None for line in lines)
    assert {line["tenant"] for line in lines} == {"alice", "bob"}
    assert not any("hi" == str(v) for line in lines for v in line.values())  # no prompt text


PER_REQUEST = (
    "qosgate_requests_total", "qosgate_queue_wait_seconds_count", "qosgate_ttft_seconds_count",
    "qosgate_tpot_seconds_count", "qosgate_e2e_seconds_count", "qosgate_tokens_total",
)  # fmt: skip
"""The per-request series that carry `model` (SLO attained and missed do too)."""


def models_of(samples, *names: str) -> set[str]:
    return {dict(labels)["model"] for (name, labels) in samples if name in names}


@contextlib.asynccontextmanager
async def over_models(*models: str) -> AsyncIterator[tuple[str, aiohttp.ClientSession]]:
    """The gateway over an openai backend whose one upstream lists `models`
    (none: it cannot say), and a client for it: the URL and the session."""
    upstream = FakeUpstream("up", models)
    await upstream.start()
    try:
        policy = make_policy(over_upstream(POLICY_YAML, upstream.url))
        async with live_app(policy) as live, aiohttp.ClientSession(
            headers={"Authorization": f"Bearer {ALICE_KEY}"}
        ) as http:
            yield live.url, http
    finally:
        await upstream.stop()


async def chat(http: aiohttp.ClientSession, url: str, model: str, stream: bool = False) -> int:
    body = {"model": model, "messages": [{"role": "user", "content": "hi"}], "stream": stream}
    async with http.post(url + "/v1/chat/completions", json=body) as r:
        await r.read()
        return r.status


async def test_two_served_models_have_series_of_their_own():
    async with over_models("alpha", "beta") as (url, http):
        for model, stream in (("alpha", False), ("alpha", True), ("beta", True)):
            assert await chat(http, url, model, stream) == 200
        # Not served: refused at the door (404), and counted under `other`.
        assert await chat(http, url, "made-up-name") == 404
        samples = await scrape(http, url)
    completed = {"tier": "interactive", "tenant": "alice", "outcome": "completed"}
    for model, n in (("alpha", 2), ("beta", 1)):
        assert value(samples, "qosgate_requests_total", **completed, model=model) == n
        for name in ("qosgate_queue_wait_seconds_count", "qosgate_ttft_seconds_count",
                     "qosgate_tpot_seconds_count", "qosgate_e2e_seconds_count"):
            assert value(samples, name, tier="interactive", model=model) == n, (name, model)
        slo = sum(value(samples, f"qosgate_slo_{judged}_total", tier="interactive", model=model)
                  for judged in ("attained", "missed"))
        assert slo == n, model
        assert value(samples, "qosgate_tokens_total", tenant="alice", kind="completion",
                     model=model) == 3 * n  # the fake upstream's three deltas
    assert value(samples, "qosgate_requests_total", tier="interactive", tenant="alice",
                 outcome="bad_request", model="other") == 1
    assert models_of(samples, *PER_REQUEST) == {"alpha", "beta", "other"}


async def test_a_name_the_backend_does_not_list_adds_no_series():
    """An upstream that lists no models lets every name through to it (it
    judges them): each is served, and counted under `other`, so that the
    names a client makes up never become label values."""
    async with over_models() as (url, http):
        for model in ("invented-1", "invented-2"):
            assert await chat(http, url, model, stream=True) == 200
        async with http.get(url + "/metrics") as r:
            text = await r.text()
        samples = await scrape(http, url)
    assert "invented" not in text
    assert models_of(samples, *PER_REQUEST) == {"other"}
    assert value(samples, "qosgate_requests_total", tier="interactive", tenant="alice",
                 outcome="completed", model="other") == 2


async def test_tenant_labels_can_be_switched_off():
    text = POLICY_YAML + "observability:\n  metrics_tenant_labels: false\n"
    async with live_app(make_policy(text)) as live, aiohttp.ClientSession() as http:
        body = {"model": MODEL, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2}
        async with http.post(live.url + "/v1/chat/completions", json=body,
                             headers={"Authorization": f"Bearer {ALICE_KEY}"}) as r:
            assert r.status == 200
        after = await scrape(http, live.url)
    for metric in ("qosgate_tokens_total", "qosgate_requests_total"):
        tenants = {dict(labels).get("tenant") for (name, labels) in after if name == metric}
        assert tenants == {"all"}, metric


async def test_admin_stats_has_what_the_dashboard_draws(monkeypatch):
    from tests import http_support

    monkeypatch.setitem(http_support.ENV, "QG_TEST_ADMIN", "stats-token")
    yaml_text = POLICY_YAML.replace("server:\n", "server:\n  admin_token_env: QG_TEST_ADMIN\n", 1)
    yaml_text = yaml_text.replace(
        '    api_keys: ["sha256:', "    quotas: {tokens_per_minute: 5000}\n    api_keys: [\"sha256:", 1
    )
    async with live_app(make_policy(yaml_text)) as live, aiohttp.ClientSession() as http:
        body = {"model": MODEL, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 3}
        for key in (ALICE_KEY, BOB_KEY):
            async with http.post(live.url + "/v1/chat/completions", json=body,
                                 headers={"Authorization": f"Bearer {key}"}) as r:
                assert r.status == 200
        async with http.get(live.url + "/admin/stats") as r:
            assert r.status == 401
        async with http.get(live.url + "/admin/stats",
                            headers={"Authorization": "Bearer stats-token"}) as r:
            assert r.status == 200
            stats = await r.json()
    assert set(stats["tiers"]) == {"interactive", "batch"}
    inter = stats["tiers"]["interactive"]
    assert inter["queued"] == 0 and inter["ttft_slo_ms"] == 500 and inter["priority"] == 0
    assert stats["requests"]["interactive"]["completed"] == 1
    assert stats["requests"]["batch"]["completed"] == 1
    assert stats["ttft"]["interactive"]["n"] == 1 and stats["ttft"]["interactive"]["p99_s"] > 0
    assert stats["slo"]["interactive"]["attained"] + stats["slo"]["interactive"].get("missed", 0) == 1
    assert stats["batches"]["recent"] >= 2
    alice = stats["quotas"]["alice"]["limits"]["tokens_per_minute"]
    assert alice["limit"] == 5000 and 0 < alice["used"] < 5000
    assert stats["ready"] is True and "free_slots" in stats["backend"]


async def test_prompts_are_logged_only_when_enabled():
    body = {"model": MODEL, "messages": [{"role": "user", "content": "secret words"}],
            "max_tokens": 2}
    for enabled in (False, True):
        text = POLICY_YAML + f"observability:\n  log_prompts: {str(enabled).lower()}\n"
        with capture_logs() as logs:
            async with live_app(make_policy(text)) as live, aiohttp.ClientSession() as http:
                async with http.post(live.url + "/v1/chat/completions", json=body,
                                     headers={"Authorization": f"Bearer {ALICE_KEY}"}) as r:
                    assert r.status == 200
        logged = [e for e in logs if "secret words" in str(e)]
        if enabled:
            assert len(logged) == 1 and logged[0]["event"] == "prompt"
            assert logged[0]["prompt"] == body["messages"]
        else:
            assert logged == []


class _FleetReplicaBackend(ScriptedBackend):
    """A backend that reports the fleet's shared queue, or cannot (None), or
    hangs while reading it."""

    def __init__(self, levels: dict | None, *, hang: bool = False) -> None:
        super().__init__(lambda job: words(job))
        self.levels = levels
        self.hang = hang
        self.reads = 0

    async def fleet_levels(self) -> dict | None:
        self.reads += 1
        if self.hang:
            await asyncio.Event().wait()
        return self.levels


async def test_fleet_levels_are_read_at_each_scrape_and_left_out_when_unreadable(monkeypatch):
    import qosgate.http.admin as admin_module

    monkeypatch.setattr(admin_module, "_FLEET_LEVELS_TIMEOUT_S", 0.05)
    levels = {"queued": {"interactive": 3, "batch": 0}, "running": 2}
    backend = _FleetReplicaBackend(levels)
    async with live_app(make_policy(), backend) as live, aiohttp.ClientSession() as http:
        samples = await scrape(http, live.url)
        assert samples[("qosgate_fleet_queue_depth", (("tier", "interactive"),))] == 3
        assert samples[("qosgate_fleet_queue_depth", (("tier", "batch"),))] == 0
        assert samples[("qosgate_fleet_running", ())] == 2
        # Redis unreadable (None), then too slow (the timeout): the scrape
        # still answers, and the fleet series are gone rather than stale.
        for backend.levels, backend.hang in ((None, False), (levels, True)):
            samples = await scrape(http, live.url)
            assert not [k for k in samples if k[0].startswith("qosgate_fleet_")]
            assert {"qosgate_fleet_queue_depth", "qosgate_fleet_running"} <= samples[
                ("families", ())
            ]
        assert backend.reads == 3


async def test_one_node_declares_the_fleet_families_without_samples():
    async with live_app() as live, aiohttp.ClientSession() as http:
        samples = await scrape(http, live.url)
    assert not [k for k in samples if k[0].startswith("qosgate_fleet_")]
    assert {"qosgate_fleet_queue_depth", "qosgate_fleet_running"} <= samples[("families", ())]


def test_admin_stats_sum_each_tiers_counts_over_the_models():
    from prometheus_client import CollectorRegistry

    from qosgate.core.request import Outcome, Request
    from qosgate.observability.metrics import GatewayMetrics, stats_view

    metrics = GatewayMetrics(make_policy(POLICY_YAML), CollectorRegistry())
    metrics.watch_models(lambda: ("alpha", "beta"))
    for i, model in enumerate(("alpha", "beta", "beta")):
        request = Request(f"r{i}", "alice", "interactive", 5, 4, arrival=0.0)
        request.first_token_at, request.finished_at = 0.1, 0.2
        request.outcome, request.output_tokens = Outcome.COMPLETED, 4
        metrics.finished(request, (5, 4), model)
    view = stats_view(metrics)
    assert view["requests"]["interactive"]["completed"] == 3
    assert view["slo"]["interactive"] == {"attained": 3}


def test_admin_stats_percentiles_are_the_reports_percentiles():
    """One percentile definition (qosgate.observability.stats) for the
    dashboard, the reports and the benchmarks: linear between ranks."""
    from prometheus_client import CollectorRegistry

    from qosgate.observability.metrics import GatewayMetrics, stats_view
    from qosgate.observability.stats import percentile

    metrics = GatewayMetrics(make_policy(POLICY_YAML), CollectorRegistry())
    metrics.recent_ttft["interactive"].extend([0.4, 0.1, 0.3, 0.2])
    ttft = stats_view(metrics)["ttft"]["interactive"]
    assert ttft["p50_s"] == pytest.approx(0.25) == percentile([0.1, 0.2, 0.3, 0.4], 50)
    assert ttft["p99_s"] == pytest.approx(0.397) and ttft["n"] == 4


async def test_the_sim_engine_serves_its_own_time_on_metrics() -> None:
    """The simulated engine's step time and saturated time, as vLLM's engine
    serves its own series: what a benchmark reads the engine's business from."""
    from qosgate.backends import build_backend

    policy = make_policy()
    assert policy.backend.kind == "sim"
    backend = build_backend(policy.backend)
    async with live_app(policy, backend) as live, aiohttp.ClientSession() as http:
        before = await scrape(http, live.url)
        assert value(before, "qosgate_sim_step_seconds_total") == 0
        body = {"model": MODEL, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 4}
        async with http.post(live.url + "/v1/chat/completions", json=body,
                             headers={"Authorization": f"Bearer {ALICE_KEY}"}) as r:
            assert r.status == 200
        after = await scrape(http, live.url)
    stepped = value(after, "qosgate_sim_step_seconds_total")
    assert stepped == pytest.approx(backend.engine.step_seconds) and stepped > 0
    # One short request never fills a step: no step was saturated.
    assert value(after, "qosgate_sim_saturated_step_seconds_total") == 0
    assert value(after, "qosgate_sim_preemptions_total") == 0
