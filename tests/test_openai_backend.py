"""The openai backend against real HTTP servers on loopback ports: fake
OpenAI-compatible upstreams (upstream_support.FakeUpstream)."""

from __future__ import annotations

import asyncio
import contextlib
import gc
import json
from collections.abc import AsyncIterator
from typing import Any, Literal

import aiohttp
import openai
import pytest
from http_support import ALICE_KEY, MODEL, Live, live_app
from upstream_support import FakeUpstream, chat_logprobs, text_logprobs

from qosgate.backends.base import (
    BackendError,
    BackendRejected,
    BackendUnavailable,
    Chunk,
    GenerationJob,
)
from qosgate.backends.openai import UNKNOWN_KV_TOKENS, OpenAIBackend, _EventStream
from qosgate.config.models import OpenAIBackendConfig

# A guard against a hang, never a wait: every await below ends on an event.
LIMIT_S = 5.0


class Harness:
    def __init__(self) -> None:
        self.upstreams: list[FakeUpstream] = []
        self.backends: list[OpenAIBackend] = []

    async def upstream(self, name: str, models: tuple[str, ...] = ("m",)) -> FakeUpstream:
        up = FakeUpstream(name, models)
        await up.start()
        self.upstreams.append(up)
        return up

    async def backend(
        self,
        ups: list[FakeUpstream],
        limits: list[int] | None = None,
        weights: list[float] | None = None,
        **cfg: Any,
    ) -> OpenAIBackend:
        cfg.setdefault("health_interval_s", 3600.0)
        entries = []
        for i, up in enumerate(ups):
            entry: dict[str, Any] = {"url": up.url}
            if limits:
                entry["max_concurrency"] = limits[i]
            if weights:
                entry["weight"] = weights[i]
            entries.append(entry)
        backend = OpenAIBackend(OpenAIBackendConfig(upstreams=entries, **cfg))
        await backend.start()
        self.backends.append(backend)
        return backend


@pytest.fixture
async def h():
    harness = Harness()
    yield harness
    for backend in harness.backends:
        await backend.close()
    for up in harness.upstreams:
        up.release.set()
        await up.stop()


_ids = iter(range(1_000_000))


def job(
    endpoint: Literal["chat", "completions"] = "chat",
    *,
    tenant: str = "t",
    session: str | None = None,
    max_tokens: int = 16,
    body: dict[str, Any] | None = None,
) -> GenerationJob:
    if body is None:
        body = (
            {"model": "m", "messages": [{"role": "user", "content": "hello"}], "stream": True}
            if endpoint == "chat"
            else {"model": "m", "prompt": "hello", "stream": True}
        )
    return GenerationJob(
        request_id=f"r{next(_ids)}",
        endpoint=endpoint,
        body=body,
        prompt_tokens=2,
        max_tokens=max_tokens,
        priority=0,
        tenant=tenant,
        session=session,
    )


async def collect(stream) -> list[Chunk]:
    return [chunk async for chunk in stream]


async def served_by(backend: OpenAIBackend, j: GenerationJob) -> str:
    """The name of the upstream that answered (its text starts with it)."""
    return "".join(c.text for c in await collect(backend.generate(j))).split(" ")[0]


async def first(stream) -> Chunk:
    return await asyncio.wait_for(stream.__anext__(), LIMIT_S)


async def wait(event: asyncio.Event) -> None:
    await asyncio.wait_for(event.wait(), LIMIT_S)


# -- streaming -------------------------------------------------------------


async def test_chat_streams_chunks_with_usage_and_passes_fields_through(h):
    up = await h.upstream("up0")
    up.delta_extra = {"reasoning_content": "hmm"}
    backend = await h.backend([up])
    body = {
        "model": "m",
        "messages": [{"role": "user", "content": "hi"}],
        "max_tokens": 999,
        "stream": True,
        "seed": 42,
        "stream_options": {"continuous_usage_stats": False},
    }
    chunks = await collect(backend.generate(job(max_tokens=16, body=body)))

    # Deltas that arrive in one read may come as one chunk; the one with
    # fields of its own never merges with plain text.
    assert "".join(c.text for c in chunks) == "up0 says hi"
    assert chunks[0].text == "up0"
    assert [c.finish_reason for c in chunks] == [None] * (len(chunks) - 1) + ["stop"]
    assert chunks[-1].text == ""
    assert chunks[0].raw == {"delta": {"reasoning_content": "hmm"}}
    assert all(not c.raw for c in chunks[1:])
    assert chunks[-1].usage == {"prompt_tokens": 5, "completion_tokens": 3, "total_tokens": 8}
    assert sum(c.tokens for c in chunks) == 3
    sent = up.requests[0]
    assert sent["path"] == "/v1/chat/completions"
    assert sent["body"]["max_tokens"] == 16  # the tier's clamp, not the client's ask
    assert sent["body"]["stream"] is True
    assert sent["body"]["stream_options"] == {
        "continuous_usage_stats": False,
        "include_usage": True,
    }
    assert sent["body"]["seed"] == 42  # fields pass through (the HTTP layer strips its own)
    assert "Authorization" not in sent["headers"]


async def test_completions_endpoint(h):
    up = await h.upstream("up0")
    backend = await h.backend([up])
    chunks = await collect(backend.generate(job("completions")))
    assert "".join(c.text for c in chunks) == "up0 says hi"
    assert chunks[-1].finish_reason == "stop"
    assert chunks[-1].usage is not None and chunks[-1].usage["completion_tokens"] == 3
    assert up.requests[0]["path"] == "/v1/completions"
    assert up.requests[0]["body"]["prompt"] == "hello"


async def test_upstream_usage_overrides_delta_count(h):
    up = await h.upstream("up0")
    up.completion_tokens = 7  # three deltas carried seven tokens
    backend = await h.backend([up])
    chunks = await collect(backend.generate(job()))
    assert sum(c.tokens for c in chunks) == 7
    assert chunks[-1].usage["completion_tokens"] == 7


async def test_running_usage_counts_tokens_per_chunk(h):
    up = await h.upstream("up0")
    up.tokens_per_delta_usage, up.completion_tokens = 2, 6
    backend = await h.backend([up])
    chunks = await collect(backend.generate(job("completions")))
    assert sum(c.tokens for c in chunks[:-1]) == 6 and chunks[-1].tokens == 0
    assert chunks[-1].usage["completion_tokens"] == 6


async def test_without_upstream_usage_tokens_are_counted_as_deltas(h):
    up = await h.upstream("up0")
    up.send_usage = False
    backend = await h.backend([up])
    chunks = await collect(backend.generate(job()))
    assert sum(c.tokens for c in chunks) == 3
    assert chunks[-1].finish_reason == "stop" and chunks[-1].usage is None


def _sse(*payloads: Any) -> bytes:
    return b"".join(
        b"data: " + (p if isinstance(p, bytes) else json.dumps(p).encode()) + b"\n\n"
        for p in payloads
    )


def _delta(text: str, **extra: Any) -> dict[str, Any]:
    return {"choices": [{"index": 0, "delta": {"content": text, **extra}, "finish_reason": None}]}


def test_text_that_arrives_in_one_read_is_one_chunk_and_fields_stay_apart():
    events = _EventStream("chat")
    events.feed(_sse(_delta("a"), _delta("b"), _delta("c", tool_calls=[{"id": "t"}]), _delta("d")))
    assert [(c.text, c.tokens, c.raw) for c in events.ready] == [
        ("ab", 2, {}), ("c", 1, {"delta": {"tool_calls": [{"id": "t"}]}}), ("d", 1, {}),
    ]
    events.ready.clear()
    events.feed(_sse(_delta("e"), _delta("f")))
    taken = events.ready.popleft()
    # What was taken is never added to, though it was the last piece made:
    # the next read starts a new one.
    events.feed(_sse(_delta("g"), _delta("h")))
    assert taken.text == "ef" and taken.tokens == 2
    assert [c.text for c in events.ready] == ["gh"]
    events.feed(_sse({"choices": [{"index": 0, "delta": {}, "finish_reason": "stop"}]}, b"[DONE]"))
    assert events.ended and events.ready[-1].finish_reason == "stop"
    assert [c.text for c in events.ready] == ["gh", ""]


def _read_whole(blocks: list[bytes]) -> tuple[str, int, list, dict | None, str | None]:
    events = _EventStream("chat")
    for block in blocks:
        events.feed(block)
    events.end()
    assert events.error is None
    chunks = list(events.ready)
    return (
        "".join(c.text for c in chunks),
        sum(c.tokens for c in chunks),
        [c.raw for c in chunks if c.raw],
        chunks[-1].usage,
        chunks[-1].finish_reason,
    )


def test_every_form_of_event_reads_the_same_whatever_the_reads():
    # The usual one-line events, then the other forms SSE allows: a comment,
    # `data:` without its space, an event in two data lines, other fields,
    # runs of blank lines; CRLF line ends come in a read of their own.
    lf = (
        _sse(_delta("a"), _delta("b"))
        + b": keep-alive\n\n"
        + b"data:" + json.dumps(_delta("c")).encode() + b"\n\n\n\n"
        + b'data: {"choices": [{"index": 0,\ndata: "delta": {"content": "d"}}]}\n\n'
        + b"event: message\nid: 7\n" + _sse(_delta("e", tool_calls=[{"id": "t"}]))
    )
    crlf = b"data: " + json.dumps(_delta("f")).encode() + b"\r\n\r\n"
    end = _sse(
        {"choices": [{"index": 0, "delta": {}, "finish_reason": "length"}]},
        {"choices": [], "usage": {"prompt_tokens": 3, "completion_tokens": 6}},
        b"[DONE]",
    )
    expected = ("abcdef", 6, [{"delta": {"tool_calls": [{"id": "t"}]}}],
                {"prompt_tokens": 3, "completion_tokens": 6}, "length")
    assert _read_whole([lf, crlf, end]) == expected
    body = lf + crlf + end
    # Cut at every event's end, and at every n bytes.
    assert _read_whole([e + b"\n\n" for e in body.split(b"\n\n")]) == expected
    for size in (1, 2, 3, 7, 64):
        assert _read_whole([body[i : i + size] for i in range(0, len(body), size)]) == expected


# -- routing and capacity --------------------------------------------------


async def test_least_outstanding_spreads_load(h):
    ups = [await h.upstream("a"), await h.upstream("b")]
    for up in ups:
        up.mode = "hold"
    backend = await h.backend(ups, limits=[4, 4])
    streams = [backend.generate(job()) for _ in range(4)]
    names = [(await first(s)).text for s in streams]
    assert sorted(names) == ["a", "a", "b", "b"]
    assert backend.capacity().free_slots == 4
    for up in ups:
        up.release.set()
    for s in streams:
        await collect(s)
    assert backend.capacity().free_slots == 8


async def test_ties_go_to_the_heavier_upstream_then_round_robin(h):
    ups = [await h.upstream("light"), await h.upstream("heavy")]
    backend = await h.backend(ups, weights=[1.0, 3.0])
    assert await served_by(backend, job()) == "heavy"
    backend2 = await h.backend(ups)
    assert [await served_by(backend2, job()) for _ in range(4)] == ["light", "heavy"] * 2


async def test_per_upstream_concurrency_is_never_exceeded(h):
    ups = [await h.upstream("a"), await h.upstream("b")]
    for up in ups:
        up.mode = "hold"
    backend = await h.backend(ups, limits=[2, 3])
    wake = asyncio.Event()
    backend.set_capacity_listener(wake.set)
    pending = [job() for _ in range(40)]
    # Fill every slot while the upstreams hold their streams open, so the
    # limits are reached, not just respected by a lightly loaded backend.
    wave = []
    while pending and backend.capacity().free_slots > 0:
        wave.append(backend.generate(pending.pop()))
    assert sorted([(await first(s)).text for s in wave]) == ["a", "a", "b", "b", "b"]
    with pytest.raises(BackendUnavailable):
        await collect(backend.generate(job()))
    for up in ups:
        up.release.set()
    tasks = [asyncio.create_task(collect(s)) for s in wave]
    # The rest the way the runtime dispatches: only into reported free slots,
    # and again whenever the listener says capacity grew.
    while pending:
        while pending and backend.capacity().free_slots > 0:
            tasks.append(asyncio.create_task(collect(backend.generate(pending.pop()))))
        if pending:
            await wait(wake)
            wake.clear()
    results = await asyncio.gather(*tasks)
    assert all(r[-1].finish_reason == "stop" for r in results)
    assert (ups[0].max_active, ups[1].max_active) == (2, 3)
    assert len(ups[0].requests) + len(ups[1].requests) == 40
    assert backend.capacity().free_slots == 5


async def test_full_backend_refuses_with_unavailable(h):
    up = await h.upstream("a")
    up.mode = "hold"
    backend = await h.backend([up], limits=[1])
    held = backend.generate(job())
    await first(held)
    assert backend.capacity().free_slots == 0
    with pytest.raises(BackendUnavailable):
        await collect(backend.generate(job()))
    assert up.max_active == 1
    up.release.set()
    await collect(held)


async def test_capacity_reports_unknown_kv(h):
    backend = await h.backend([await h.upstream("a")], limits=[3])
    cap = backend.capacity()
    assert (cap.free_slots, cap.free_kv_tokens, cap.kv_capacity_tokens) == (
        3,
        UNKNOWN_KV_TOKENS,
        None,
    )


async def test_tenant_affinity_is_sticky_and_falls_back_when_saturated(h):
    ups = [await h.upstream(n) for n in ("a", "b", "c")]
    backend = await h.backend(ups, limits=[1, 1, 1], affinity="tenant")
    for up in ups:
        up.release.set()
    home = await served_by(backend, job(tenant="acme"))
    assert [await served_by(backend, job(tenant="acme")) for _ in range(5)] == [home] * 5
    homes = {await served_by(backend, job(tenant=f"t{i}")) for i in range(20)}
    assert len(homes) > 1  # affinity spreads tenants, it does not pin them all to one

    for up in ups:
        up.mode = "hold"
        up.release.clear()
    held = backend.generate(job(tenant="acme"))
    assert (await first(held)).text.split(" ")[0] == home
    other = backend.generate(job(tenant="acme"))
    assert (await first(other)).text != home
    for up in ups:
        up.release.set()
    await collect(held)
    await collect(other)
    assert await served_by(backend, job(tenant="acme")) == home


async def test_session_affinity_is_sticky_across_tenants_and_falls_back(h):
    ups = [await h.upstream(n) for n in ("a", "b", "c")]
    backend = await h.backend(ups, limits=[1, 1, 1], affinity="session")
    for up in ups:
        up.release.set()
    home = await served_by(backend, job(session="s-1", tenant="x"))
    assert {await served_by(backend, job(session="s-1", tenant=f"t{i}")) for i in range(5)} == {
        home
    }
    # Without a session the request goes by load alone, round the upstreams.
    assert len({await served_by(backend, job(tenant="x")) for _ in range(3)}) == 3

    for up in ups:
        up.mode = "hold"
        up.release.clear()
    held = backend.generate(job(session="s-1"))
    assert (await first(held)).text.split(" ")[0] == home
    other = backend.generate(job(session="s-1"))
    assert (await first(other)).text != home
    for up in ups:
        up.release.set()
    await collect(held)
    await collect(other)


# -- failures --------------------------------------------------------------


async def test_upstream_500_is_a_backend_error(h):
    up = await h.upstream("a")
    up.mode = "status"
    backend = await h.backend([up])
    with pytest.raises(BackendError) as info:
        await collect(backend.generate(job()))
    assert type(info.value) is BackendError
    assert "500" in str(info.value) and "boom" in str(info.value)
    assert up.url not in str(info.value) and "127.0.0.1" not in str(info.value)
    # It produced nothing: worth another try (the gateway says when: Retry-After).
    assert info.value.retryable
    assert backend.capacity().free_slots == 64
    assert backend.ready()  # an answering upstream stays in rotation


@pytest.mark.parametrize("status", [400, 413, 422])
@pytest.mark.parametrize("stream", [True, False], ids=["streamed", "whole"])
async def test_an_upstream_refusing_the_request_is_a_rejection_with_its_message(h, status, stream):
    up = await h.upstream("a")
    up.mode, up.status = "status", status
    up.status_body = {"error": {"message": "temperature is out of range", "param": "temperature"}}
    backend = await h.backend([up])
    body = {"model": "m", "messages": [{"role": "user", "content": "hi"}], "stream": stream}
    with pytest.raises(BackendRejected) as info:
        await collect(backend.generate(job(body=body)))
    # The upstream's own words, nothing of the gateway's (no address either).
    assert info.value.message == str(info.value) == "temperature is out of range"
    assert info.value.param == "temperature"
    assert not info.value.retryable
    assert backend.ready() and backend.capacity().free_slots == 64


async def test_a_rejection_in_vllms_unwrapped_shape_and_in_plain_text(h):
    up = await h.upstream("a")
    up.mode, up.status = "status", 400
    up.status_body = {"object": "error", "message": "prompt too long", "type": "BadRequestError",
                      "param": None, "code": 400}  # fmt: skip
    backend = await h.backend([up])
    with pytest.raises(BackendRejected) as info:
        await collect(backend.generate(job()))
    assert (info.value.message, info.value.param) == ("prompt too long", None)
    up.status_body = "no JSON here"
    with pytest.raises(BackendRejected) as info:
        await collect(backend.generate(job()))
    assert info.value.message == '"no JSON here"'


VLLM_OVER_CONTEXT = {"error": {
    "message": "This model's maximum context length is 512 tokens. However, you requested "
               "600 tokens (590 in the messages, 10 in the completion). Please reduce the "
               "length of the messages or completion.",
    "type": "BadRequestError", "param": "input_tokens", "code": 400}}


async def test_an_upstream_saying_the_context_is_exceeded_is_context_length_exceeded(h):
    """A prompt past the model's context that the gateway's count let through
    (a count by characters, or a model whose context the upstream does not
    list) is refused by the upstream: vLLM's server says so in words, OpenAI's
    API by code. Either way the client gets OpenAI's code for it, which
    clients act on (they shorten the prompt), as when the gateway refuses it
    itself; before, it was `invalid_request`."""
    up = await h.upstream("a")
    up.mode, up.status = "status", 400
    backend = OpenAIBackend(OpenAIBackendConfig(upstreams=[{"url": up.url}],
                                                health_interval_s=3600.0))  # fmt: skip
    openai_shape = {"error": {"message": "Please reduce the length of the messages.",
                              "type": "invalid_request_error", "param": "messages",
                              "code": "context_length_exceeded"}}  # fmt: skip
    other = {"error": {"message": "temperature is out of range", "param": "temperature"}}
    headers = {"Authorization": f"Bearer {ALICE_KEY}"}
    body = {"model": "m", "messages": [{"role": "user", "content": "hi"}]}
    async with live_app(backend=backend) as live, aiohttp.ClientSession() as http:
        for refusal, code, param in ((VLLM_OVER_CONTEXT, "context_length_exceeded", "input_tokens"),
                                     (openai_shape, "context_length_exceeded", "messages"),
                                     (other, "invalid_request", "temperature")):  # fmt: skip
            up.status_body = refusal
            async with http.post(live.url + "/v1/chat/completions", headers=headers,
                                 json=body) as r:
                error = (await r.json())["error"]
            assert r.status == 400
            assert (error["code"], error["param"], error["type"]) == (
                code, param, "invalid_request_error")
            assert error["message"] == refusal["error"]["message"]


@pytest.mark.parametrize("status", [401, 403, 404])
async def test_an_upstream_refusing_the_gateway_is_not_the_clients_fault(h, status):
    """Its key, its path or its model list is the gateway's configuration:
    not the client's to fix, nor worth a retry."""
    up = await h.upstream("a")
    up.mode, up.status = "status", status
    backend = await h.backend([up])
    with pytest.raises(BackendError) as info:
        await collect(backend.generate(job()))
    assert type(info.value) is BackendError and not info.value.retryable
    assert f"answered {status}" in str(info.value) and up.url not in str(info.value)


async def test_an_error_event_mid_stream_keeps_its_meaning_only_as_a_rejection():
    """vLLM sends an error object with an HTTP status as its code. A 400 is
    the client's whenever it comes; any other error after output only ends
    the stream (no retry: that output went out)."""
    events = _EventStream("chat")
    events.feed(b'data: {"error": {"message": "bad stop", "param": "stop", "code": 400}}\n\n')
    assert isinstance(events.error, BackendRejected)
    assert (events.error.message, events.error.param) == ("bad stop", "stop")

    events = _EventStream("chat")
    events.feed(b'data: {"choices": [{"index": 0, "delta": {"content": "x"}}]}\n\n'
                b'data: {"error": {"message": "engine died", "code": 503}}\n\n')
    assert [c.text for c in events.ready] == ["x"]
    assert type(events.error) is BackendError and not events.error.retryable
    assert "engine died" in str(events.error)


async def test_upstream_429_and_503_are_unavailable_with_retry_after(h):
    up = await h.upstream("a")
    up.mode, up.status, up.status_headers = "status", 429, {"Retry-After": "7"}
    backend = await h.backend([up])
    with pytest.raises(BackendUnavailable) as info:
        await collect(backend.generate(job()))
    assert info.value.retry_after_s == 7.0
    assert "boom" in str(info.value) and up.url not in str(info.value)
    up.status, up.status_headers = 503, {}
    with pytest.raises(BackendUnavailable) as info:
        await collect(backend.generate(job()))
    assert info.value.retry_after_s == 1.0


async def test_connection_refused_marks_upstream_unhealthy(h):
    up = await h.upstream("a")
    backend = await h.backend([up])
    assert backend.ready()
    await up.stop()
    # Down, not failing: the client is told when to come back.
    with pytest.raises(BackendUnavailable) as info:
        await collect(backend.generate(job()))
    assert info.value.retry_after_s == 1.0
    assert up.url not in str(info.value) and str(up.port) not in str(info.value)
    assert not backend.ready()
    assert backend.capacity().free_slots == 0
    with pytest.raises(BackendUnavailable):
        await collect(backend.generate(job()))



async def test_a_live_upstream_that_hangs_up_on_a_request_stays_in_rotation(h):
    """A connection dropped before any answer (a pooled one its server closed
    as the request went out: vLLM's closes those idle for 5 s) fails that
    request, and the upstream is probed at once rather than taken out on it:
    taken out, a gateway in front of one server answered /readyz 503 and
    refused what was queued until the probe, and learned the server's room
    again from the start, for a server that was up all along."""
    up = await h.upstream("a")
    backend = await h.backend([up])
    up.mode = "hangup"
    with pytest.raises(BackendError):
        await collect(backend.generate(job()))
    assert backend.ready()
    # It hung up on the request and on its one retry.
    assert len(up.requests) == 2
    up.mode = "ok"
    assert await served_by(backend, job()) == "a"


@pytest.mark.parametrize("stream", [True, False], ids=["streamed", "whole"])
async def test_a_request_on_a_connection_that_broke_goes_once_more(h, stream):
    """No answer came on the broken connection, so no output was produced:
    the request is sent once more and answered, instead of failing the client
    for the connection's fault (a 502 before)."""
    up = await h.upstream("a")
    backend = await h.backend([up])
    up.hangups = 1
    body = {"model": "m", "messages": [{"role": "user", "content": "hi"}], "stream": stream}
    chunks = await collect(backend.generate(job(body=body)))
    assert chunks and chunks[-1].finish_reason is not None
    assert len(up.requests) == 2 and up.hangups == 0
    assert backend.ready()

async def test_unhealthy_upstream_recovers_via_health_check(h):
    up = await h.upstream("a")
    backend = await h.backend([up], health_interval_s=0.02)
    recovered = asyncio.Event()
    await up.stop()
    with pytest.raises(BackendError):
        await collect(backend.generate(job()))
    assert not backend.ready()
    backend.set_capacity_listener(recovered.set)
    await up.start()  # same port
    await wait(recovered)
    assert backend.ready()
    assert await served_by(backend, job()) == "a"


async def test_requests_avoid_an_unhealthy_upstream(h):
    a, b = await h.upstream("a"), await h.upstream("b")
    backend = await h.backend([a, b], affinity="tenant")
    tenants = [f"t{i}" for i in range(20)]
    homes = {t: await served_by(backend, job(tenant=t)) for t in tenants}
    on_a = next(t for t in tenants if homes[t] == "a")
    await a.stop()
    with pytest.raises(BackendError):
        await collect(backend.generate(job(tenant=on_a)))
    # Its tenants move to the survivor; the others stay where they were.
    assert {await served_by(backend, job(tenant=t)) for t in tenants} == {"b"}


async def test_upstream_killed_mid_stream_is_a_backend_error(h):
    up = await h.upstream("a")
    up.mode = "kill"
    backend = await h.backend([up])
    seen: list[Chunk] = []
    with pytest.raises(BackendError):
        async for chunk in backend.generate(job()):
            seen.append(chunk)
    assert [c.text for c in seen] == ["a"]
    assert backend.capacity().free_slots == 64


async def test_malformed_stream_is_a_backend_error(h):
    up = await h.upstream("a")
    up.mode = "malformed"
    backend = await h.backend([up])
    with pytest.raises(BackendError, match="malformed"):
        await collect(backend.generate(job()))


# -- ending early ----------------------------------------------------------


async def test_closing_the_stream_early_disconnects_the_upstream(h):
    up = await h.upstream("a")
    up.mode = "hold"
    backend = await h.backend([up], limits=[2])
    calls = []
    backend.set_capacity_listener(lambda: calls.append(1))
    stream = backend.generate(job())
    await first(stream)
    assert backend.capacity().free_slots == 1
    await stream.aclose()
    await wait(up.disconnected)
    assert backend.capacity().free_slots == 2
    assert calls


async def test_a_consumer_that_stops_at_the_last_chunk_keeps_the_connection(h):
    # The gateway closes a stream as soon as it has the chunk with the finish
    # reason; the upstream connection must still go back to the pool.
    # The end of the body lags the [DONE] event, as it can on a real network.
    up = await h.upstream("a")
    backend = await h.backend([up])

    async def lag_the_end() -> None:
        await up.done_sent.wait()
        up.done_sent.clear()
        assert up.eof_gate is not None
        up.eof_gate.set()

    for _ in range(4):
        up.eof_gate = asyncio.Event()
        lag = asyncio.create_task(lag_the_end())
        stream = backend.generate(job())
        async for chunk in stream:
            if chunk.finish_reason is not None:
                break
        await stream.aclose()
        await asyncio.wait_for(lag, LIMIT_S)
    assert len(up.requests) == 4
    assert len({r["peer"] for r in up.requests}) == 1


async def test_abort_stops_the_upstream_and_is_idempotent(h):
    up = await h.upstream("a")
    up.mode = "hold"
    backend = await h.backend([up], limits=[2])
    j = job()
    stream = backend.generate(j)
    await first(stream)
    reader = asyncio.create_task(collect(stream))
    backend.abort(j.request_id)
    backend.abort(j.request_id)
    backend.abort("no-such-request")
    with pytest.raises(BackendError) as info:
        await asyncio.wait_for(reader, LIMIT_S)
    assert info.value.retryable
    await wait(up.disconnected)
    assert backend.capacity().free_slots == 2


async def test_abort_before_the_first_read(h):
    up = await h.upstream("a")
    backend = await h.backend([up], limits=[1])
    j = job()
    stream = backend.generate(j)
    assert backend.capacity().free_slots == 0
    backend.abort(j.request_id)
    assert backend.capacity().free_slots == 1
    with pytest.raises(BackendError):
        await collect(stream)
    assert up.requests == []


async def test_a_dropped_stream_gives_its_slot_back(h):
    backend = await h.backend([await h.upstream("a")], limits=[1])
    notified = asyncio.Event()
    backend.set_capacity_listener(notified.set)
    stream = backend.generate(job())
    assert backend.capacity().free_slots == 0
    del stream
    gc.collect()
    assert backend.capacity().free_slots == 1
    await wait(notified)


async def test_capacity_listener_called_when_a_request_ends(h):
    backend = await h.backend([await h.upstream("a")])
    calls = []
    backend.set_capacity_listener(lambda: calls.append(backend.capacity().free_slots))
    await collect(backend.generate(job()))
    assert calls == [64]  # called after the slot was freed


# -- models, keys, token estimate ------------------------------------------


async def test_models_are_the_union_reported_by_upstreams(h):
    a = await h.upstream("a", models=("m1", "m2"))
    b = await h.upstream("b", models=("m2", "m3"))
    assert (await h.backend([a, b])).models == ("m1", "m2", "m3")
    assert (await h.backend([a, b], models=("only",))).models == ("only",)


async def test_models_carry_the_upstreams_root(h):
    """vLLM lists the path it loaded as `root`, and its benchmark client run
    without --model loads the tokenizer from there: /v1/models relays it."""
    a = await h.upstream("a", models=("tiny", "other"))
    a.roots["tiny"] = "/models/tiny-llama"
    b = await h.upstream("b", models=("tiny",))
    b.roots["tiny"] = "/elsewhere/tiny"  # the first upstream to list it wins
    backend = OpenAIBackend(OpenAIBackendConfig(
        upstreams=[{"url": a.url}, {"url": b.url}], health_interval_s=3600.0,
    ))  # fmt: skip
    async with live_app(backend=backend) as live, aiohttp.ClientSession() as http:
        async with http.get(
            live.url + "/v1/models", headers={"Authorization": f"Bearer {ALICE_KEY}"}
        ) as r:
            assert r.status == 200
            entries = (await r.json())["data"]
    # No root from the upstream: the name is all there is.
    assert [(e["id"], e["root"]) for e in entries] == [
        ("tiny", "/models/tiny-llama"), ("other", "other")
    ]


async def test_the_upstreams_context_bounds_asks_at_the_door(h):
    """vLLM lists each model's max_model_len: an ask past it is the client's
    400 at the gateway, as on the other backends, not the upstream's; the
    smallest of the upstreams' counts, since a request may go to any."""
    a = await h.upstream("a", models=("m",))
    b = await h.upstream("b", models=("m",))
    a.contexts["m"], b.contexts["m"] = 4096, 2048
    backend = OpenAIBackend(OpenAIBackendConfig(
        upstreams=[{"url": a.url}, {"url": b.url}], health_interval_s=3600.0,
    ))  # fmt: skip
    async with live_app(backend=backend) as live, aiohttp.ClientSession() as http:
        assert backend.max_model_len == 2048
        headers = {"Authorization": f"Bearer {ALICE_KEY}"}
        body = {"model": "m", "prompt": "hi"}
        async with http.post(live.url + "/v1/completions", headers=headers,
                             json={**body, "max_tokens": 3000}) as r:
            assert r.status == 400
            assert (await r.json())["error"]["code"] == "context_length_exceeded"
        async with http.post(live.url + "/v1/completions", headers=headers,
                             json={**body, "max_tokens": 2000}) as r:
            assert r.status == 200, await r.text()
        assert len(a.requests) + len(b.requests) == 1
        # Models with different contexts: no one bound for the backend.
        a.models.append("big")
        a.contexts["big"] = 131_072
        await backend._check_all()
        assert backend.max_model_len is None


async def test_api_key_from_environment(h, monkeypatch):
    up = await h.upstream("a")
    entries = [{"url": up.url, "api_key_env": "FAKE_UPSTREAM_KEY"}]
    monkeypatch.setenv("FAKE_UPSTREAM_KEY", "sk-123")
    backend = OpenAIBackend(OpenAIBackendConfig(upstreams=entries))
    await backend.start()
    h.backends.append(backend)
    await collect(backend.generate(job()))
    assert up.model_probes[0]["Authorization"] == "Bearer sk-123"
    assert up.requests[0]["headers"]["Authorization"] == "Bearer sk-123"

    monkeypatch.delenv("FAKE_UPSTREAM_KEY")
    missing = OpenAIBackend(OpenAIBackendConfig(upstreams=entries))
    with pytest.raises(BackendError, match="FAKE_UPSTREAM_KEY"):
        await missing.start()
    await missing.close()


def test_prompt_token_estimate():
    backend = OpenAIBackend(OpenAIBackendConfig(upstreams=[{"url": "http://127.0.0.1:9/v1"}]))
    chat = {
        "messages": [
            {"role": "system", "content": "x" * 40},
            {"role": "user", "content": [{"type": "text", "text": "y" * 8}, {"type": "image_url"}]},
        ]
    }
    assert backend.count_prompt_tokens("chat", chat) == 12 + 2 * 4
    assert backend.count_prompt_tokens("completions", {"prompt": "z" * 9}) == 3
    assert backend.count_prompt_tokens("completions", {"prompt": ""}) == 1


# -- counting prompt tokens ---------------------------------------------------------


def _word_tokenizer(path) -> str:
    """A tokenizer.json built here (no model hub): one token per known word."""
    from tokenizers import Tokenizer, models, pre_tokenizers

    vocab = {"[UNK]": 0, "hello": 1, "there": 2, "world": 3, "!": 4}
    tokenizer = Tokenizer(models.WordLevel(vocab, unk_token="[UNK]"))
    tokenizer.pre_tokenizer = pre_tokenizers.Whitespace()
    target = str(path / "tokenizer.json")
    tokenizer.save(target)
    return target


async def test_a_configured_tokenizer_counts_the_prompt(h, tmp_path):
    up = await h.upstream("a")
    backend = await h.backend([up], tokenizer=_word_tokenizer(tmp_path))
    chat = {"messages": [{"role": "user", "content": "hello there world !"},
                         {"role": "user", "content": [{"type": "text", "text": "hello"}]}]}
    # 4 + 1 words, plus the template's allowance of 4 per message.
    assert backend.count_prompt_tokens("chat", chat) == 5 + 2 * 4
    assert backend.count_prompt_tokens("completions", {"prompt": "hello unknownword"}) == 2


async def test_without_a_tokenizer_the_estimate_is_used(h):
    up = await h.upstream("a")
    backend = await h.backend([up])
    assert backend.count_prompt_tokens("completions", {"prompt": "x" * 40}) == 10


async def test_an_unusable_tokenizer_stops_the_start_naming_the_field(h, tmp_path):
    up = await h.upstream("a")
    bad = tmp_path / "tokenizer.json"
    bad.write_text("{not a tokenizer")
    with pytest.raises(BackendError, match="backend.tokenizer"):
        await h.backend([up], tokenizer=str(bad))


# -- clients that read the answer whole -------------------------------------------


def whole_job(endpoint: Literal["chat", "completions"] = "chat", **body: Any) -> GenerationJob:
    base = (
        {"model": "m", "messages": [{"role": "user", "content": "hello"}]}
        if endpoint == "chat"
        else {"model": "m", "prompt": "hello"}
    )
    return job(endpoint, body={**base, "stream": False, **body})


async def test_a_whole_answer_is_asked_for_whole_and_comes_as_one_chunk(h):
    up = await h.upstream("up0")
    up.delta_extra = {"tool_calls": [{"id": "c1", "type": "function"}]}
    backend = await h.backend([up])
    chunks = await collect(backend.generate(whole_job(stream_options={"include_usage": True})))
    assert len(chunks) == 1
    (chunk,) = chunks
    assert chunk.text == "up0 says hi" and chunk.finish_reason == "stop"
    assert chunk.usage == {"prompt_tokens": 5, "completion_tokens": 3, "total_tokens": 8}
    assert chunk.tokens == 3
    assert chunk.raw == {"message": {"tool_calls": [{"id": "c1", "type": "function"}]}}
    sent = up.requests[0]["body"]
    assert sent["stream"] is False and "stream_options" not in sent


async def test_a_whole_completion_without_usage_is_estimated(h):
    up = await h.upstream("up0")
    up.send_usage = False
    backend = await h.backend([up])
    (chunk,) = await collect(backend.generate(whole_job("completions")))
    assert chunk.text == "up0 says hi" and chunk.usage is None
    assert chunk.tokens == 3  # 11 characters, about 4 a token


async def test_a_malformed_whole_answer_is_a_backend_error(h):
    up = await h.upstream("up0")
    up.mode = "malformed"
    backend = await h.backend([up])
    with pytest.raises(BackendError, match="malformed"):
        await collect(backend.generate(whole_job()))
    assert backend.capacity().free_slots > 0


async def test_whole_answers_reuse_the_connection(h):
    up = await h.upstream("up0")
    backend = await h.backend([up])
    for _ in range(3):
        stream = backend.generate(whole_job())
        async for _chunk in stream:
            break
        await stream.aclose()
    assert len({r["peer"] for r in up.requests}) == 1


async def test_a_cookie_an_upstream_sets_is_never_sent_back(h):
    # One client session serves every tenant: a cookie set in one tenant's
    # answer must not ride along on the next tenant's request. By name, not
    # by address: aiohttp's default jar ignores cookies from bare IPs anyway.
    up = await h.upstream("up0")
    up.answer_headers = {"Set-Cookie": "sid=tenant-a-secret; Path=/"}
    backend = OpenAIBackend(OpenAIBackendConfig(
        upstreams=[{"url": f"http://localhost:{up.port}/v1"}], health_interval_s=3600.0,
    ))  # fmt: skip
    await backend.start()
    h.backends.append(backend)
    await collect(backend.generate(whole_job()))
    await collect(backend.generate(whole_job()))
    assert len(up.requests) == 2
    assert "Cookie" not in up.requests[1]["headers"]


async def test_closing_a_held_whole_answer_disconnects_the_upstream(h):
    up = await h.upstream("up0")
    up.mode = "hold"
    backend = await h.backend([up])
    stream = backend.generate(whole_job())
    pending = asyncio.ensure_future(stream.__anext__())
    await wait(up.held)
    pending.cancel()  # the consumer's task is cancelled while it waits
    with pytest.raises(asyncio.CancelledError):
        await pending
    await stream.aclose()
    await wait(up.disconnected)


# -- through the gateway: what an upstream returns beyond text ---------------------


@contextlib.asynccontextmanager
async def gateway_over(up: FakeUpstream) -> AsyncIterator[tuple[Live, openai.AsyncOpenAI]]:
    """The whole gateway over `up`, and the official client pointed at it."""
    backend = OpenAIBackend(OpenAIBackendConfig(
        upstreams=[{"url": up.url}], models=[MODEL], health_interval_s=3600.0,
    ))  # fmt: skip
    async with live_app(backend=backend) as live:
        client = openai.AsyncOpenAI(
            base_url=live.url + "/v1", api_key=ALICE_KEY, max_retries=0, timeout=LIMIT_S
        )
        try:
            yield live, client
        finally:
            await client.close()


WEATHER = {
    "type": "function",
    "function": {
        "name": "get_weather",
        # Strict, so that the client's stream helper parses the arguments too.
        "strict": True,
        "parameters": {
            "type": "object",
            "properties": {"city": {"type": "string"}},
            "required": ["city"],
            "additionalProperties": False,
        },
    },
}
ASK = [{"role": "user", "content": "Weather in Paris?"}]


def call_delta(**fields: Any) -> dict[str, Any]:
    return {"tool_calls": [{"index": 0, **fields}]}


async def test_streamed_tool_calls_and_logprobs_reach_the_client(h):
    up = await h.upstream("up0")
    up.script = [
        {"index": 0, "delta": {"content": "Let me"}, "logprobs": chat_logprobs("Let", " me"),
         "finish_reason": None},
        # Plain text between, which takes the gateway's short way: still in order.
        {"index": 0, "delta": {"content": " check."}, "finish_reason": None},
        {"index": 0, "delta": call_delta(id="call_1", type="function",
                                         function={"name": "get_weather", "arguments": ""}),
         "logprobs": None, "finish_reason": None},
        {"index": 0, "delta": call_delta(function={"arguments": '{"city": '}),
         "finish_reason": None},
        # The finishing event carries the call's last piece and its logprobs.
        {"index": 0, "delta": call_delta(function={"arguments": '"Paris"}'}),
         "logprobs": chat_logprobs('"Paris"}'), "finish_reason": "tool_calls"},
    ]  # fmt: skip
    async with gateway_over(up) as (_, client), client.chat.completions.stream(
        model=MODEL, messages=ASK, tools=[WEATHER], logprobs=True, top_logprobs=1
    ) as stream:
        final = await stream.get_final_completion()
    (choice,) = final.choices
    assert choice.finish_reason == "tool_calls"
    assert choice.message.content == "Let me check."
    (call,) = choice.message.tool_calls or []
    assert (call.id, call.function.name) == ("call_1", "get_weather")
    assert call.function.arguments == '{"city": "Paris"}'
    assert call.function.parsed_arguments == {"city": "Paris"}
    assert choice.logprobs is not None and choice.logprobs.content is not None
    assert [t.token for t in choice.logprobs.content] == ["Let", " me", '"Paris"}']
    assert choice.logprobs.content[0].top_logprobs[0].token == "Let"
    sent = up.requests[0]["body"]
    assert sent["tools"] == [WEATHER] and sent["logprobs"] is True and sent["top_logprobs"] == 1


async def test_a_whole_answer_keeps_its_tool_calls_and_logprobs(h):
    up = await h.upstream("up0")
    tool_call = {"id": "call_1", "type": "function",
                 "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'}}
    up.whole_choice = {
        "index": 0,
        "message": {"role": "assistant", "content": None, "tool_calls": [tool_call]},
        "logprobs": chat_logprobs("get", "_weather"),
        "finish_reason": "tool_calls",
    }  # fmt: skip
    async with gateway_over(up) as (live, client), aiohttp.ClientSession() as http:
        reply = await client.chat.completions.create(
            model=MODEL, messages=ASK, tools=[WEATHER], logprobs=True
        )
        async with http.get(live.url + "/openapi.json") as r:
            schemas = (await r.json())["components"]["schemas"]
    (choice,) = reply.choices
    assert choice.finish_reason == "tool_calls"
    (call,) = choice.message.tool_calls or []
    assert call.model_dump() == tool_call
    assert choice.logprobs is not None and choice.logprobs.content is not None
    assert [t.token for t in choice.logprobs.content] == ["get", "_weather"]
    # The document says so too (the backends that refuse logprobs keep null).
    for name in ("ChatCompletion", "Completion"):
        item = schemas[name]["properties"]["choices"]["items"]["$ref"].rsplit("/", 1)[-1]
        relayed = schemas[item]["properties"]["logprobs"]
        assert "object" in relayed["type"]


@pytest.mark.parametrize("stream", [True, False], ids=["streamed", "whole"])
async def test_completion_logprobs_reach_the_client(h, stream: bool):
    up = await h.upstream("up0")
    up.script = [
        {"index": 0, "text": "up0", "logprobs": text_logprobs(["up0"], 0), "finish_reason": None},
        {"index": 0, "text": " says", "logprobs": text_logprobs([" says"], 3),
         "finish_reason": None},
        # The last token comes with the finish: neither may be lost.
        {"index": 0, "text": " hi", "logprobs": text_logprobs([" hi"], 8),
         "finish_reason": "stop"},
    ]  # fmt: skip
    up.whole_choice = {"index": 0, "text": "up0 says hi", "finish_reason": "stop",
                       "logprobs": text_logprobs(["up0", " says", " hi"], 0)}  # fmt: skip
    async with gateway_over(up) as (_, client):
        if stream:
            chunks = [c async for c in await client.completions.create(
                model=MODEL, prompt="hello", logprobs=1, stream=True,
                stream_options={"include_usage": True},
            )]  # fmt: skip
            choices = [c.choices[0] for c in chunks if c.choices]
        else:
            choices = (await client.completions.create(
                model=MODEL, prompt="hello", logprobs=1
            )).choices  # fmt: skip
    assert "".join(c.text for c in choices) == "up0 says hi"
    assert choices[-1].finish_reason == "stop"
    logprobs = [c.logprobs for c in choices if c.logprobs is not None]
    assert [t for lp in logprobs for t in lp.tokens or []] == ["up0", " says", " hi"]
    assert [o for lp in logprobs for o in lp.text_offset or []] == [0, 3, 8]
    assert [p for lp in logprobs for p in lp.top_logprobs or []] == [
        {"up0": -0.5}, {" says": -0.5}, {" hi": -0.5}
    ]
    assert up.requests[0]["body"]["logprobs"] == 1
