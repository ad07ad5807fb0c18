"""OpenTelemetry tracing, with the SDK's in-memory exporter: a request that
carries a `traceparent` is one trace whose spans cover admission, queue
wait, the backend's first token and streaming, and the upstream receives the
same trace id."""

from __future__ import annotations

import uuid
from typing import Any

import aiohttp
import pytest
from opentelemetry.sdk.trace import TracerProvider
from opentelemetry.sdk.trace.export import SimpleSpanProcessor
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter

from qosgate.config.models import OtelConfig
from qosgate.observability.otel import Tracing
from tests.http_support import ALICE_KEY, POLICY_YAML, live_app, make_policy
from tests.upstream_support import backend_policy

TRACE_ID = "0af7651916cd43dd8448eb211c80319c"
PARENT_ID = "b7ad6b7169203331"
TRACEPARENT = f"00-{TRACE_ID}-{PARENT_ID}-01"
PROMPT = "zq-canary-prompt-7"
TRACED_POLICY = POLICY_YAML + "observability:\n  otel: {}\n"


@pytest.fixture
def exporter(monkeypatch: pytest.MonkeyPatch) -> InMemorySpanExporter:
    """What the gateway's tracing exports, kept in memory."""
    exporter = InMemorySpanExporter()
    provider = TracerProvider()
    provider.add_span_processor(SimpleSpanProcessor(exporter))
    tracing = Tracing(provider)
    monkeypatch.setattr(
        Tracing, "from_config", staticmethod(lambda cfg: tracing if cfg is not None else None)
    )
    return exporter


def hex_trace(span: Any) -> str:
    return format(span.context.trace_id, "032x")


async def chat(http: aiohttp.ClientSession, url: str, model: str, headers: dict[str, str]):
    body = {"model": model, "messages": [{"role": "user", "content": PROMPT}],
            "max_tokens": 4, "stream": True}  # fmt: skip
    async with http.post(url + "/v1/chat/completions", json=body, headers=headers) as r:
        await r.read()
        return r.status


async def test_a_traced_request_is_one_trace_from_the_client_to_the_upstream(exporter):
    async with backend_policy("openai", TRACED_POLICY) as (text, upstream):
        assert upstream is not None
        policy = make_policy(text)
        async with live_app(policy) as live, aiohttp.ClientSession() as http:
            model = live.gateway.backend.models[0]
            headers = {"Authorization": f"Bearer {ALICE_KEY}", "traceparent": TRACEPARENT}
            assert await chat(http, live.url, model, headers) == 200
    spans = exporter.get_finished_spans()
    assert {hex_trace(s) for s in spans} == {TRACE_ID}
    [root] = [s for s in spans if s.name == "POST /v1/chat/completions"]
    assert root.parent is not None and format(root.parent.span_id, "016x") == PARENT_ID
    phases = {s.name: s for s in spans if s is not root}
    assert list(phases) == ["admission", "queue wait", "backend ttft", "streaming"]
    for phase in phases.values():
        assert phase.parent.span_id == root.context.span_id
        assert root.start_time <= phase.start_time <= phase.end_time <= root.end_time
    # One after the other, each from where the last ended.
    ordered = list(phases.values())
    for before, after in zip(ordered, ordered[1:]):
        assert before.end_time == after.start_time
    attributes = dict(root.attributes)
    assert attributes["qosgate.tenant"] == "alice"
    assert attributes["qosgate.tier"] == "interactive"
    assert attributes["qosgate.outcome"] == "completed"
    assert attributes["gen_ai.usage.output_tokens"] > 0
    assert attributes["gen_ai.usage.input_tokens"] > 0
    assert PROMPT not in repr([dict(s.attributes) for s in spans])
    # The upstream was called within the same trace, from the request's span.
    sent = upstream.requests[-1]["headers"]["traceparent"]
    assert sent == f"00-{TRACE_ID}-{format(root.context.span_id, '016x')}-01"


async def test_a_refused_request_is_traced_with_its_outcome(exporter):
    async with live_app(make_policy(TRACED_POLICY)) as live, aiohttp.ClientSession() as http:
        headers = {"Authorization": "Bearer wrong", "traceparent": TRACEPARENT}
        assert await chat(http, live.url, "sim-test-model", headers) == 401
        # Without a traceparent the request begins a trace of its own.
        headers = {"Authorization": f"Bearer {ALICE_KEY}"}
        assert await chat(http, live.url, "sim-test-model", headers) == 200
        # Not the API: no span.
        async with http.get(live.url + "/healthz") as r:
            assert r.status == 200
    refused, served = [s for s in exporter.get_finished_spans() if s.parent is None
                       or format(s.parent.span_id, "016x") == PARENT_ID]  # fmt: skip
    assert hex_trace(refused) == TRACE_ID
    assert dict(refused.attributes)["qosgate.outcome"] == "unauthorized"
    assert dict(refused.attributes)["http.response.status_code"] == 401
    assert hex_trace(served) != TRACE_ID
    assert dict(served.attributes)["qosgate.outcome"] == "completed"
    assert len(exporter.get_finished_spans()) == 2 + 4


async def test_untraced_requests_send_no_trace_context_upstream():
    async with backend_policy("openai") as (text, upstream):
        assert upstream is not None
        async with live_app(make_policy(text)) as live, aiohttp.ClientSession() as http:
            model = live.gateway.backend.models[0]
            headers = {"Authorization": f"Bearer {ALICE_KEY}", "traceparent": TRACEPARENT}
            assert await chat(http, live.url, model, headers) == 200
            assert live.gateway.observer.tracing is None
    assert "traceparent" not in {k.lower() for k in upstream.requests[-1]["headers"]}


def test_the_configured_exporter_is_built_and_closed():
    tracing = Tracing.from_config(OtelConfig(endpoint="http://127.0.0.1:9/v1/traces"))
    assert tracing is not None
    tracing.close()
    assert Tracing.from_config(None) is None


async def test_in_fleet_mode_the_engine_nodes_run_joins_the_replicas_trace(
    exporter, redis_server
):
    from aiohttp.test_utils import TestServer

    from qosgate.config.models import ObservabilityConfig
    from qosgate.http.app import build_app
    from tests.test_fleet_runtime import Fleet
    from tests.test_fleet_runtime import make_policy as fleet_policy

    policy = fleet_policy(redis_server.url, f"otel{uuid.uuid4().hex[:8]}:").model_copy(
        update={"observability": ObservabilityConfig(otel=OtelConfig())}
    )
    async with Fleet(policy, engines=1) as fleet:
        server = TestServer(build_app(fleet.gateway, policy), handler_cancellation=True)
        await server.start_server()
        try:
            url = str(server.make_url("")).rstrip("/")
            async with aiohttp.ClientSession() as http:
                assert await chat(http, url, "sim-llama3-8b", {"traceparent": TRACEPARENT}) == 200
        finally:
            await server.close()
    spans = exporter.get_finished_spans()
    assert {hex_trace(s) for s in spans} == {TRACE_ID}
    [root] = [s for s in spans if s.name == "POST /v1/chat/completions"]
    [run] = [s for s in spans if s.name == "engine run"]
    assert run.parent.span_id == root.context.span_id
    assert dict(run.attributes)["qosgate.node"] == "e0"
