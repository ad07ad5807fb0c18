"""Faults, end to end: the real HTTP app and gateway in front of an upstream
that drops its connection, hangs or goes silent, a client that stops reading,
and a storm of clients that all leave at once.

For every fault the same three things are checked:
- each affected request ends with exactly one outcome and a clear error in
  OpenAI's shape (for a stream that had started, an SSE error event as its
  last event), within a bounded time that the test measures;
- its quota reservation is refunded: the tenants have quotas in a memory
  store, and after the fault the store holds exactly the tokens of what was
  served (the usage the clients were shown), with no request still counted
  as running;
- the gateway keeps serving everyone else: a request of another tenant in
  flight during the fault completes, and a new request afterwards succeeds.

Nothing here sleeps to wait for something: every wait is on an event or a
socket, bounded by LIMIT_S so a regression fails instead of hanging. The
sleeps that remain are the faults' own behaviour (a slow upstream's pace).
"""

from __future__ import annotations

import asyncio
import contextlib
import fcntl
import hashlib
import json
import socket
import struct
import termios
from collections import Counter
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass, field
from typing import Any

import aiohttp
import pytest
from aiohttp import web
from aiohttp.test_utils import TestServer

from qosgate.backends import build_backend
from qosgate.backends.base import Backend, Chunk, GenerationJob
from qosgate.config.models import PolicyConfig
from qosgate.core.request import Outcome, Request
from qosgate.http.app import REQUEST_ID, build_app
from qosgate.observability import Observer
from qosgate.quotas import MemoryQuotaStore, QuotaGuard
from qosgate.runtime.gate import Gateway, RequestStream
from tests.http_support import ScriptedBackend

LIMIT_S = 15.0
"""Bounds every wait: a guard against a hang, never a pace."""

MODEL = "m"
KEYS = {"alice": "key-alice", "bob": "key-bob", "carol": "key-carol"}
QUOTAS = {
    "tokens_per_minute": {"limit": 10_000_000},
    "requests_per_minute": {"limit": 100_000},
    "max_concurrency": 1_000,
}


def make_policy(
    backend: dict[str, Any], *, stall_s: float = 60.0, max_tokens: int = 64,
    tier: dict[str, Any] | None = None, **scheduler: Any,
) -> PolicyConfig:
    return PolicyConfig.model_validate({
        "server": {"client_stall_timeout_s": stall_s},
        "backend": backend,
        "scheduler": {"initial_drain_rate": 1e6, **scheduler},
        "observability": {"log_requests": False},
        "tiers": {"standard": {"priority": 0, "max_queue_wait_ms": 60_000,
                               "max_tokens": max_tokens, **(tier or {})}},
        "tenants": [
            {"id": tenant, "tier": "standard", "quotas": QUOTAS,
             "api_keys": [f"sha256:{hashlib.sha256(key.encode()).hexdigest()}"]}
            for tenant, key in KEYS.items()
        ],
    })  # fmt: skip


# -- the gateway, watched ----------------------------------------------------


class Watch(Observer):
    """The gateway's observer, also counting how each request ended: the
    invariant is exactly one `finished` per admitted request."""

    def __init__(self, policy: PolicyConfig) -> None:
        super().__init__(policy)
        self.ends: Counter[str] = Counter()
        self.usage: dict[str, tuple[int, int] | None] = {}
        self.changed = asyncio.Event()

    def first_token(self, req: Request, now: float, model: object) -> None:
        super().first_token(req, now, model)
        self.changed.set()

    def finished(self, req: Request, usage: tuple[int, int] | None, model: str = "") -> None:
        super().finished(req, usage, model)
        self.ends[req.id] += 1
        self.usage[req.id] = usage
        self.changed.set()


class Gate(Gateway):
    """Keeps every stream it hands out; `before_aclose` sees a stream the
    HTTP layer is about to close (its client gone or dropped)."""

    observer: Watch

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.streams: dict[str, RequestStream] = {}
        self.before_aclose: Callable[[RequestStream], None] | None = None

    def submit(self, **kwargs: Any) -> RequestStream:
        stream = super().submit(**kwargs)
        self.streams[stream.request.id] = stream
        close = stream.aclose

        async def aclose() -> None:
            if self.before_aclose is not None:
                self.before_aclose(stream)
            await close()

        stream.aclose = aclose  # type: ignore[method-assign]
        self.observer.changed.set()
        return stream

    async def until(self, condition: Callable[[], bool]) -> None:
        """Wait for `condition`, re-checked whenever a request is admitted,
        gets its first token or ends."""
        changed = self.observer.changed
        async with asyncio.timeout(LIMIT_S):
            while not condition():
                changed.clear()
                await changed.wait()

    def outcome(self, request_id: str) -> Outcome | None:
        return self.streams[request_id].request.outcome


@dataclass
class Stage:
    url: str
    host: str
    port: int
    gate: Gate
    guard: QuotaGuard
    transports: dict[str, asyncio.Transport] = field(default_factory=dict)
    """Each request's server-side connection, by request id."""
    sockets: list[socket.socket] = field(default_factory=list)
    """Bare client sockets, closed before the server (a test that fails must
    not leave the server waiting on a client that never reads)."""

    @property
    def api(self) -> str:
        return self.url + "/v1/chat/completions"

    async def used(self, tenant: str) -> dict[str, int]:
        return {s.kind: s.used for s in await self.guard.usage(tenant)}

    def assert_every_request_ended_once(self) -> None:
        assert set(self.gate.observer.ends) == set(self.gate.streams)
        assert set(self.gate.observer.ends.values()) == {1}
        snap = self.gate.snapshot()
        assert (snap["queued"], snap["running"]) == (0, 0)
        assert snap["backend"]["dispatched_not_started"] == 0


@contextlib.asynccontextmanager
async def serving(policy: PolicyConfig, backend: Backend | None = None) -> AsyncIterator[Stage]:
    backend = backend if backend is not None else build_backend(policy.backend)
    guard = QuotaGuard.from_policy(policy, MemoryQuotaStore())
    gate = Gate(policy, backend, quotas=guard, observer=Watch(policy))
    await gate.start()
    app = build_app(gate, policy, environ={})
    transports: dict[str, asyncio.Transport] = {}

    async def remember(request: web.Request, response: web.StreamResponse) -> None:
        transports[request[REQUEST_ID]] = request.transport

    app.on_response_prepare.append(remember)
    server = TestServer(app, host="127.0.0.1", handler_cancellation=True)
    await server.start_server()
    stage = Stage(
        str(server.make_url("")).rstrip("/"), "127.0.0.1", server.port, gate, guard, transports
    )
    try:
        yield stage
    finally:
        for sock in stage.sockets:
            sock.close()
        await server.close()
        await gate.close()


# -- clients -----------------------------------------------------------------


def auth(tenant: str) -> dict[str, str]:
    return {"Authorization": f"Bearer {KEYS[tenant]}"}


def chat(what: str, *, stream: bool, max_tokens: int = 16) -> dict[str, Any]:
    """A request whose prompt tells the upstream (or script) what to do."""
    return {
        "model": MODEL,
        "messages": [{"role": "user", "content": what}],
        "max_tokens": max_tokens,
        "stream": stream,
    }


def parse_sse(raw: bytes) -> list[Any]:
    events: list[Any] = []
    for block in raw.split(b"\n\n"):
        if block.startswith(b"data: "):
            data = block[6:]
            events.append("[DONE]" if data == b"[DONE]" else json.loads(data))
    return events


def text_of(events: list[Any]) -> str:
    return "".join(
        e["choices"][0]["delta"].get("content") or ""
        for e in events
        if isinstance(e, dict) and e.get("choices")
    )


def assert_error(body: dict[str, Any], code: str) -> str:
    """OpenAI's error shape with `code`; returns the message."""
    assert set(body) == {"error"}
    error = body["error"]
    assert set(error) == {"message", "type", "code", "param"}
    assert error["code"] == code and error["type"] == "server_error"
    assert isinstance(error["message"], str) and error["message"]
    return error["message"]


async def served(http: aiohttp.ClientSession, stage: Stage, tenant: str, body: dict) -> int:
    """A request that must succeed; returns the total tokens it was billed."""
    async with (
        asyncio.timeout(LIMIT_S),
        http.post(stage.api, json=body, headers=auth(tenant)) as resp,
    ):
        assert resp.status == 200, await resp.text()
        if body["stream"]:
            events = parse_sse(await resp.content.read())
            assert events[-1] == "[DONE]"
            return events[-2]["usage"]["total_tokens"]
        return (await resp.json())["usage"]["total_tokens"]


async def post(
    http: aiohttp.ClientSession, stage: Stage, tenant: str, body: dict
) -> aiohttp.ClientResponse:
    return await http.post(stage.api, json=body, headers=auth(tenant))


async def read_sse(resp: aiohttp.ClientResponse) -> list[Any]:
    async with asyncio.timeout(LIMIT_S):
        return parse_sse(await resp.content.read())


# -- an upstream that misbehaves on request ----------------------------------

PIECES = ("one", " two", " three", " four")


class Upstream:
    """An OpenAI-compatible server on a loopback port. Each request does what
    its prompt says, so faulty and healthy requests share one upstream:

    - ok: streams PIECES (or answers them whole) with usage;
    - hold: like ok, but stops after the first piece (whole: before answering)
      until `release`; `held` is set once it waits;
    - drop: streamed, sends two pieces and drops the connection; whole, drops
      it before answering (the server died while generating);
    - mute: accepts the request and never sends a header;
    - silent: sends the headers and two pieces, then nothing;
    - slow: streams PIECES three times over, `gap_s` apart; whole, answers
      after `gap_s`;
    - status N: answers HTTP status N with an error body (Retry-After: 7 for
      429 and 503), as vLLM does;
    - refuse midway: streams two pieces, then an error event coded 400.
    """

    def __init__(self, gap_s: float = 0.1) -> None:
        self.gap_s = gap_s
        self.release = asyncio.Event()
        self.held = asyncio.Event()
        self.left: list[str] = []
        """What each request was asked to do, for requests the gateway left."""
        self.changed = asyncio.Event()
        self.port = 0
        self._runner: web.AppRunner | None = None

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}/v1"

    async def start(self) -> None:
        app = web.Application()
        app.router.add_get("/v1/models", self._models)
        app.router.add_post("/v1/chat/completions", self._generate)
        # So that a handler learns when the gateway hangs up on it.
        self._runner = web.AppRunner(app, handler_cancellation=True)
        await self._runner.setup()
        await web.TCPSite(self._runner, "127.0.0.1", 0).start()
        self.port = self._runner.addresses[0][1]

    async def stop(self) -> None:
        if self._runner is not None:
            await self._runner.cleanup()
            self._runner = None

    async def until_left(self, what: str) -> None:
        async with asyncio.timeout(LIMIT_S):
            while what not in self.left:
                self.changed.clear()
                await self.changed.wait()

    async def _models(self, request: web.Request) -> web.Response:
        return web.json_response({"object": "list", "data": [{"id": MODEL}]})

    async def _generate(self, request: web.Request) -> web.StreamResponse:
        body = await request.json()
        what = body["messages"][-1]["content"]
        if what.startswith("status "):
            status = int(what.split()[1])
            return web.json_response(
                {"error": {"message": f"upstream says {status}", "type": "BadRequestError",
                           "param": "temperature", "code": status}},
                status=status, headers={"Retry-After": "7"} if status in (429, 503) else None,
            )  # fmt: skip
        try:
            if body.get("stream"):
                return await self._stream(request, what)
            return await self._whole(request, what)
        except (asyncio.CancelledError, ConnectionError):
            self.left.append(what)
            self.changed.set()
            raise

    async def _stream(self, request: web.Request, what: str) -> web.StreamResponse:
        if what == "mute":
            await asyncio.Event().wait()
        response = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
        await response.prepare(request)

        async def send(payload: Any) -> None:
            data = payload if isinstance(payload, str) else json.dumps(payload)
            await response.write(f"data: {data}\n\n".encode())

        def delta(text: str, finish: str | None = None) -> dict[str, Any]:
            content = {"content": text} if text else {}
            return {"choices": [{"index": 0, "delta": content, "finish_reason": finish}]}

        pieces = PIECES * 3 if what == "slow" else PIECES
        for i, piece in enumerate(pieces):
            await send(delta(piece))
            if what == "hold" and i == 0:
                self.held.set()
                await self.release.wait()
            if what == "drop" and i == 1:
                assert request.transport is not None
                request.transport.abort()
                return response
            if what == "silent" and i == 1:
                await asyncio.Event().wait()
            if what == "refuse midway" and i == 1:
                await send({"error": {"message": "stop is invalid here", "param": "stop",
                                      "code": 400}})  # fmt: skip
                await response.write_eof()
                return response
            if what == "slow":
                await asyncio.sleep(self.gap_s)
        await send(delta("", "stop"))
        n = len(pieces)
        await send({"choices": [], "usage": {"prompt_tokens": 5, "completion_tokens": n,
                                             "total_tokens": 5 + n}})  # fmt: skip
        await send("[DONE]")
        await response.write_eof()
        return response

    async def _whole(self, request: web.Request, what: str) -> web.StreamResponse:
        if what == "mute":
            await asyncio.Event().wait()
        if what == "hold":
            self.held.set()
            await self.release.wait()
        if what == "slow":
            await asyncio.sleep(self.gap_s)
        if what == "drop":
            assert request.transport is not None
            request.transport.abort()
            return web.Response()
        n = len(PIECES)
        return web.json_response({
            "object": "chat.completion",
            "choices": [{"index": 0, "finish_reason": "stop",
                         "message": {"role": "assistant", "content": "".join(PIECES)}}],
            "usage": {"prompt_tokens": 5, "completion_tokens": n, "total_tokens": 5 + n},
        })  # fmt: skip


@pytest.fixture
async def upstream() -> AsyncIterator[Upstream]:
    up = Upstream()
    await up.start()
    yield up
    up.release.set()
    await up.stop()


def openai_backend(up: Upstream, **cfg: Any) -> dict[str, Any]:
    return {
        "kind": "openai",
        "upstreams": [{"url": up.url, "max_concurrency": 8}],
        "models": [MODEL],
        "health_interval_s": 3600,
        **cfg,
    }


# -- a. the upstream drops the connection ------------------------------------


@pytest.mark.parametrize("stream", [True, False], ids=["streamed", "whole"])
async def test_an_upstream_that_drops_the_connection_fails_only_its_request(
    upstream: Upstream, stream: bool
) -> None:
    async with serving(make_policy(openai_backend(upstream))) as stage, \
            aiohttp.ClientSession() as http:  # fmt: skip
        loop = asyncio.get_running_loop()
        # Bob's request is in flight on the same upstream through the fault.
        bob = asyncio.ensure_future(post(http, stage, "bob", chat("hold", stream=stream)))
        async with asyncio.timeout(LIMIT_S):
            await upstream.held.wait()

        start = loop.time()
        async with http.post(stage.api, json=chat("drop", stream=stream),
                             headers=auth("alice")) as resp:  # fmt: skip
            rid = resp.headers["x-request-id"]
            if stream:
                # It had started: the status is gone, the error is the last event.
                assert resp.status == 200
                events = await read_sse(resp)
                assert text_of(events) == "one two"
                message = assert_error(events[-1], "backend_error")
                assert "[DONE]" not in events
            else:
                assert resp.status == 502
                message = assert_error(await resp.json(), "backend_error")
        took = loop.time() - start
        # The upstream's address is internal: the log has it, the client not.
        assert upstream.url not in message and str(upstream.port) not in message
        assert took < 2.0, took
        assert stage.gate.outcome(rid) is Outcome.BACKEND_ERROR
        assert (await stage.used("alice"))["tokens_per_minute"] == 0

        upstream.release.set()
        async with asyncio.timeout(LIMIT_S):
            bob_resp = await bob
        async with bob_resp:
            assert bob_resp.status == 200
            if stream:
                events = await read_sse(bob_resp)
                assert events[-1] == "[DONE]"
                bob_tokens = events[-2]["usage"]["total_tokens"]
            else:
                bob_tokens = (await bob_resp.json())["usage"]["total_tokens"]
        alice_tokens = await served(http, stage, "alice", chat("ok", stream=stream))

        stage.assert_every_request_ended_once()
        assert await stage.used("alice") == {
            "tokens_per_minute": alice_tokens,
            "requests_per_minute": 1,
            "max_concurrency": 0,
        }
        assert await stage.used("bob") == {
            "tokens_per_minute": bob_tokens,
            "requests_per_minute": 1,
            "max_concurrency": 0,
        }
        print(f"\n[a/{'streamed' if stream else 'whole'}] dropped request ended in "
              f"{took * 1000:.0f} ms: {message}")  # fmt: skip


# -- a2. the upstream refuses the request, or fails it -----------------------


def assert_client_error(body: dict[str, Any]) -> dict[str, Any]:
    """OpenAI's error shape for the client's fault; returns the error."""
    assert set(body) == {"error"} and set(body["error"]) == {"message", "type", "code", "param"}
    assert body["error"]["type"] == "invalid_request_error"
    return body["error"]


@pytest.mark.parametrize("stream", [True, False], ids=["streamed", "whole"])
async def test_upstream_errors_are_classified_for_the_client_and_refunded(
    upstream: Upstream, stream: bool
) -> None:
    """An upstream's 400, 413 or 422 is the client's fault: a 400 with the
    upstream's message and param. Its 5xx is a 502, its 429 and 503 a 503,
    with Retry-After. None names the upstream, and none is charged."""
    expected = [  # what the upstream answers -> status, code, Retry-After, outcome
        ("status 400", 400, "invalid_request", None, Outcome.BAD_REQUEST),
        ("status 413", 400, "invalid_request", None, Outcome.BAD_REQUEST),
        ("status 422", 400, "invalid_request", None, Outcome.BAD_REQUEST),
        ("status 500", 502, "backend_error", "1", Outcome.BACKEND_ERROR),
        ("status 502", 502, "backend_error", "1", Outcome.BACKEND_ERROR),
        ("status 429", 503, "backend_unavailable", "7", Outcome.BACKEND_ERROR),
        ("status 503", 503, "backend_unavailable", "7", Outcome.BACKEND_ERROR),
    ]
    async with serving(make_policy(openai_backend(upstream))) as stage, \
            aiohttp.ClientSession() as http:  # fmt: skip
        for what, status, code, retry_after, outcome in expected:
            async with http.post(stage.api, json=chat(what, stream=stream),
                                 headers=auth("alice")) as resp:  # fmt: skip
                assert (resp.status, resp.headers.get("Retry-After")) == (status, retry_after), what
                assert resp.content_type == "application/json"
                body = await resp.json()
                assert stage.gate.outcome(resp.headers["x-request-id"]) is outcome
            if status == 400:
                error = assert_client_error(body)
                assert (error["message"], error["param"]) == (f"upstream says {what[7:]}",
                                                              "temperature")  # fmt: skip
            else:
                message = assert_error(body, code)
                assert f"upstream says {what[7:]}" in message
                assert upstream.url not in message and str(upstream.port) not in message
        # Refused or failed, nothing is charged; the same tenant is served next.
        assert await stage.used("alice") == {
            "tokens_per_minute": 0, "requests_per_minute": 0, "max_concurrency": 0,
        }  # fmt: skip
        tokens = await served(http, stage, "alice", chat("ok", stream=stream))
        stage.assert_every_request_ended_once()
        assert (await stage.used("alice"))["tokens_per_minute"] == tokens


async def test_a_refusal_after_output_is_the_streams_last_event(upstream: Upstream) -> None:
    async with serving(make_policy(openai_backend(upstream))) as stage, \
            aiohttp.ClientSession() as http:  # fmt: skip
        async with http.post(stage.api, json=chat("refuse midway", stream=True),
                             headers=auth("alice")) as resp:  # fmt: skip
            assert resp.status == 200
            events = await read_sse(resp)
            rid = resp.headers["x-request-id"]
        assert text_of(events) == "one two" and "[DONE]" not in events
        error = assert_client_error(events[-1])
        assert (error["message"], error["param"]) == ("stop is invalid here", "stop")
        assert stage.gate.outcome(rid) is Outcome.BAD_REQUEST
        stage.assert_every_request_ended_once()
        assert (await stage.used("alice"))["tokens_per_minute"] == 0


async def test_an_unreachable_upstream_is_a_503_to_retry_naming_no_address(
    upstream: Upstream,
) -> None:
    """Down, not failing: 503 with Retry-After, which OpenAI's clients wait
    out, where a 502 is retried at once."""
    async with serving(make_policy(openai_backend(upstream))) as stage, \
            aiohttp.ClientSession() as http:  # fmt: skip
        await upstream.stop()
        async with http.post(stage.api, json=chat("ok", stream=False),
                             headers=auth("alice")) as resp:  # fmt: skip
            assert (resp.status, resp.headers.get("Retry-After")) == (503, "1")
            message = assert_error(await resp.json(), "backend_unavailable")
        assert upstream.url not in message and str(upstream.port) not in message
        stage.assert_every_request_ended_once()
        assert (await stage.used("alice"))["tokens_per_minute"] == 0


# -- b. the upstream hangs ---------------------------------------------------

READ_TIMEOUT_S = 0.4


async def test_a_silent_upstream_ends_its_streams_within_the_read_timeout(
    upstream: Upstream,
) -> None:
    """One request gets no headers at all, one stops after two pieces; a slow
    but steady stream that runs far longer than the read timeout is not cut."""
    upstream.gap_s = READ_TIMEOUT_S / 4
    backend = openai_backend(upstream, read_timeout_s=READ_TIMEOUT_S, timeout_s=30)
    async with serving(make_policy(backend)) as stage, aiohttp.ClientSession() as http:
        loop = asyncio.get_running_loop()

        async def slow() -> tuple[float, int]:
            start = loop.time()
            tokens = await served(http, stage, "bob", chat("slow", stream=True))
            return loop.time() - start, tokens

        async def timed(what: str) -> tuple[float, int, str, Any]:
            start = loop.time()
            async with http.post(stage.api, json=chat(what, stream=True),
                                 headers=auth("alice")) as resp:  # fmt: skip
                body = await resp.json() if resp.status != 200 else await read_sse(resp)
                return loop.time() - start, resp.status, resp.headers["x-request-id"], body

        steady = asyncio.ensure_future(slow())
        async with asyncio.timeout(LIMIT_S):
            (
                (mute_s, mute_status, mute_id, mute_body),
                (silent_s, silent_status, silent_id, events),
            ) = await asyncio.gather(timed("mute"), timed("silent"))
        # No headers came, so none went out: a plain 502.
        assert mute_status == 502
        assert "sent nothing for 0.4s" in assert_error(mute_body, "backend_error")
        # Two pieces went out, then the error as the stream's last event.
        assert silent_status == 200
        assert text_of(events) == "one two"
        assert "sent nothing for 0.4s" in assert_error(events[-1], "backend_error")
        for took in (mute_s, silent_s):
            assert READ_TIMEOUT_S <= took < READ_TIMEOUT_S + 2.0, took
        # The upstream sees the gateway hang up: it is not left generating.
        await upstream.until_left("mute")
        await upstream.until_left("silent")

        async with asyncio.timeout(LIMIT_S):
            steady_s, bob_tokens = await steady
        assert steady_s > 2 * READ_TIMEOUT_S
        alice_tokens = await served(http, stage, "alice", chat("ok", stream=True))

        for rid in (mute_id, silent_id):
            assert stage.gate.outcome(rid) is Outcome.BACKEND_ERROR
        stage.assert_every_request_ended_once()
        assert await stage.used("alice") == {
            "tokens_per_minute": alice_tokens,
            "requests_per_minute": 1,
            "max_concurrency": 0,
        }
        assert (await stage.used("bob"))["tokens_per_minute"] == bob_tokens
        print(f"\n[b] read timeout {READ_TIMEOUT_S}s: no headers -> 502 in {mute_s:.2f}s, "
              f"silent mid-stream -> error event in {silent_s:.2f}s; a steady stream "
              f"of {steady_s:.2f}s completed")  # fmt: skip


async def test_a_hung_whole_answer_is_bounded_by_the_request_timeout(upstream: Upstream) -> None:
    """An answer read whole is silent until it is done, so the read timeout
    does not apply to it; timeout_s does."""
    upstream.gap_s = 0.5  # bob's answer: silent for longer than the read timeout
    backend = openai_backend(upstream, read_timeout_s=0.2, timeout_s=1.0)
    async with serving(make_policy(backend)) as stage, aiohttp.ClientSession() as http:
        loop = asyncio.get_running_loop()
        bob = asyncio.ensure_future(served(http, stage, "bob", chat("slow", stream=False)))
        start = loop.time()
        async with http.post(stage.api, json=chat("mute", stream=False),
                             headers=auth("alice")) as resp:  # fmt: skip
            assert resp.status == 502
            message = assert_error(await resp.json(), "backend_error")
            rid = resp.headers["x-request-id"]
        took = loop.time() - start
        assert "timed out after 1s" in message
        assert 1.0 <= took < 3.0, took
        # Bob's answer, silent for longer than the read timeout, was not cut by it.
        async with asyncio.timeout(LIMIT_S):
            bob_tokens = await bob
        alice_tokens = await served(http, stage, "alice", chat("ok", stream=False))

        assert stage.gate.outcome(rid) is Outcome.BACKEND_ERROR
        stage.assert_every_request_ended_once()
        assert (await stage.used("alice"))["tokens_per_minute"] == alice_tokens
        assert (await stage.used("bob"))["tokens_per_minute"] == bob_tokens
        print(f"\n[b/whole] hung whole answer -> 502 in {took:.2f}s (timeout_s 1)")


# -- c. a client that stops reading ------------------------------------------

STALL_S = 0.5
BLOCK = "x" * 1023 + " "
"""One token of the endless stream: 1 KiB of text."""
ENDLESS_TOKENS = 50_000
"""50 MiB of output: far more than every buffer between gateway and client."""


def queued_bytes(sock: socket.socket | Any, request: int) -> int:
    return struct.unpack("i", fcntl.ioctl(sock.fileno(), request, b"\0" * 4))[0]


async def raw_request(
    stage: Stage, body: dict, tenant: str, *, rcvbuf: int | None = None
) -> socket.socket:
    """A client on a bare socket, so the test decides when it reads."""
    loop = asyncio.get_running_loop()
    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    stage.sockets.append(sock)
    if rcvbuf is not None:
        # Set before connecting, so the window it advertises is small from the start.
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, rcvbuf)
    sock.setblocking(False)
    await loop.sock_connect(sock, (stage.host, stage.port))
    data = json.dumps(body).encode()
    head = (
        "POST /v1/chat/completions HTTP/1.1\r\nHost: test\r\n"
        f"Authorization: Bearer {KEYS[tenant]}\r\nContent-Type: application/json\r\n"
        f"Content-Length: {len(data)}\r\n\r\n"
    )
    await loop.sock_sendall(sock, head.encode() + data)
    return sock


async def stall_script(job: GenerationJob, pulls: list[float],
                       release: asyncio.Event) -> AsyncIterator[Chunk]:  # fmt: skip
    what = job.body["messages"][-1]["content"]
    n = job.max_tokens
    if what == "endless":
        for i in range(n):
            pulls.append(asyncio.get_running_loop().time())
            yield Chunk(text=BLOCK, tokens=1, finish_reason="length" if i == n - 1 else None)
        return
    for i in range(n):
        yield Chunk(text=f"w{i} ", tokens=1, finish_reason="length" if i == n - 1 else None)
        if what == "hold" and i == 0:
            await release.wait()


async def test_a_client_that_stops_reading_is_dropped_and_never_buffered_for() -> None:
    pulls: list[float] = []
    release = asyncio.Event()
    backend = ScriptedBackend(lambda job: stall_script(job, pulls, release), models=(MODEL,),
                              free_slots=2)  # fmt: skip
    policy = make_policy({"kind": "sim"}, stall_s=STALL_S, max_tokens=ENDLESS_TOKENS)
    async with serving(policy, backend) as stage, aiohttp.ClientSession() as http:
        loop = asyncio.get_running_loop()
        gate = stage.gate
        # Bob streams through the whole fault (the backend's other slot): his
        # client reads, and his request waits on the backend, not on a write.
        bob = await http.post(stage.api, json=chat("hold", stream=True, max_tokens=4),
                              headers=auth("bob"))  # fmt: skip
        assert bob.status == 200

        client = await raw_request(
            stage, chat("endless", stream=True, max_tokens=ENDLESS_TOKENS), "alice", rcvbuf=4096
        )
        got = b""
        async with asyncio.timeout(LIMIT_S):
            while b"\r\n\r\n" not in got:
                got += await loop.sock_recv(client, 65536)
        assert got.startswith(b"HTTP/1.1 200")
        # From here alice's client reads nothing.

        # Carol queues behind the two busy slots.
        carol = asyncio.ensure_future(
            served(http, stage, "carol", chat("ok", stream=False, max_tokens=4))
        )
        await gate.until(lambda: len(gate.streams) == 3)

        seen: dict[str, Any] = {}

        def measure(stream: RequestStream) -> None:
            # The moment the gateway gives up on the client, before it hangs up.
            server_side = stage.transports.get(stream.request.id)
            if stream.request.tenant != "alice" or seen or server_side is None:
                return
            if server_side.is_closing():
                return  # the client left on its own: not the drop under test
            seen.update(
                rid=stream.request.id,
                at=loop.time(),
                pulled=len(pulls),
                transport=server_side.get_write_buffer_size(),
                server_sndq=queued_bytes(server_side.get_extra_info("socket"), termios.TIOCOUTQ),
                client_rcvq=queued_bytes(client, termios.FIONREAD),
            )

        gate.before_aclose = measure
        await gate.until(lambda: bool(seen) and gate.observer.ends[seen["rid"]] == 1)
        rid = seen["rid"]
        pulled_bytes = seen["pulled"] * len(BLOCK)
        in_sockets = len(got) + seen["client_rcvq"] + seen["server_sndq"] + seen["transport"]
        stalled_for = seen["at"] - pulls[-1]

        # Dropped after the stall timeout, not before, and not much after.
        assert STALL_S - 0.01 <= stalled_for < STALL_S + 1.0, stalled_for
        # The gateway pulled only what the sockets hold, and holds none of it
        # itself beyond the transport's bounded buffer.
        assert seen["pulled"] < ENDLESS_TOKENS // 4
        assert seen["transport"] <= 256 * 1024
        assert pulled_bytes <= in_sockets
        # Cancelled, and charged what ran: its prompt and every token pulled.
        assert gate.outcome(rid) is Outcome.CANCELLED
        assert gate.observer.usage[rid] == (5, seen["pulled"])
        assert await stage.used("alice") == {
            "tokens_per_minute": 5 + seen["pulled"], "requests_per_minute": 1,
            "max_concurrency": 0,
        }  # fmt: skip
        # Its connection is gone: what is left to read ends without [DONE].
        rest = b""
        with contextlib.suppress(ConnectionResetError):
            async with asyncio.timeout(LIMIT_S):
                while block := await loop.sock_recv(client, 1 << 20):
                    rest += block
        client.close()
        assert b"[DONE]" not in got + rest

        # Its slot went to carol, queued behind it.
        async with asyncio.timeout(LIMIT_S):
            carol_tokens = await carol
        carol_rid = next(r for r, s in gate.streams.items() if s.request.tenant == "carol")
        assert gate.streams[carol_rid].request.dispatched_at >= seen["at"]
        # Bob, in flight all along, completes.
        release.set()
        async with bob:
            events = await read_sse(bob)
        assert events[-1] == "[DONE]"
        bob_tokens = events[-2]["usage"]["total_tokens"]
        alice_tokens = await served(http, stage, "alice", chat("ok", stream=True, max_tokens=3))

        stage.assert_every_request_ended_once()
        assert (await stage.used("alice"))["tokens_per_minute"] == 5 + seen["pulled"] + alice_tokens
        assert (await stage.used("bob"))["tokens_per_minute"] == bob_tokens
        assert (await stage.used("carol"))["tokens_per_minute"] == carol_tokens
        print(
            f"\n[c] stall timeout {STALL_S}s: dropped {stalled_for:.2f}s after the last pull; "
            f"pulled {seen['pulled']} tokens ({pulled_bytes >> 10} KiB) of {ENDLESS_TOKENS}; "
            f"client read {len(got)} B, its socket holds {seen['client_rcvq']} B, the "
            f"server's {seen['server_sndq']} B, the transport {seen['transport']} B"
        )


# -- c2. slow readers --------------------------------------------------------

SLOW_READERS = 4
SLOW_PACE = 256
"""Bytes a second each slow reader takes."""
FLOOR = 1024
"""The tier's delivery floor in the test, in bytes a second: four times the pace."""
WINDOW_S = 1.0
SLO_S = 5.0
"""Carol's objective: her first token within 5 s (her tier's ttft_slo_ms)."""


async def slow_reader(sock: socket.socket, fast: asyncio.Event) -> bytes:
    """Reads SLOW_PACE bytes a second until `fast` is set, then all the rest
    at once, to the end of the connection."""
    loop = asyncio.get_running_loop()
    got = b""
    with contextlib.suppress(ConnectionResetError):
        while not fast.is_set():
            block = await loop.sock_recv(sock, SLOW_PACE)
            if not block:
                return got
            got += block
            with contextlib.suppress(TimeoutError):
                async with asyncio.timeout(1.0):  # the reader's own pace
                    await fast.wait()
        while block := await loop.sock_recv(sock, 1 << 20):
            got += block
    return got


async def test_slow_readers_do_not_keep_another_tenant_from_being_served() -> None:
    """Four clients that read 256 B/s hold all four of the backend's slots
    with answers larger than the buffers between them and the gateway. The
    tier's delivery floor ends their streams, with a `client_too_slow` event,
    and the slots go to carol's request, queued behind them, within her SLO."""
    pulls: dict[str, int] = Counter()

    async def endless(job: GenerationJob) -> AsyncIterator[Chunk]:
        if job.body["messages"][-1]["content"] != "endless":
            yield Chunk(text="ok", tokens=1, finish_reason="stop")
            return
        for i in range(job.max_tokens):
            pulls[job.request_id] += 1
            yield Chunk(text=BLOCK, tokens=1,
                        finish_reason="length" if i == job.max_tokens - 1 else None)  # fmt: skip

    backend = ScriptedBackend(endless, models=(MODEL,), free_slots=SLOW_READERS)
    policy = make_policy(
        {"kind": "sim"}, max_tokens=ENDLESS_TOKENS,
        tier={"ttft_slo_ms": SLO_S * 1000, "max_queue_wait_ms": 8_000,
              "min_delivery_bytes_per_s": FLOOR, "delivery_window_s": WINDOW_S},
    )  # fmt: skip
    async with serving(policy, backend) as stage, aiohttp.ClientSession() as http:
        loop = asyncio.get_running_loop()
        gate = stage.gate
        fast = asyncio.Event()
        readers = []
        for _ in range(SLOW_READERS):
            sock = await raw_request(
                stage, chat("endless", stream=True, max_tokens=ENDLESS_TOKENS), "alice",
                rcvbuf=4096,
            )
            readers.append(asyncio.ensure_future(slow_reader(sock, fast)))
        # Every slot is taken by a slow reader before carol asks.
        await gate.until(lambda: len(gate.streams) == SLOW_READERS and all(
            s.request.first_token_at is not None for s in gate.streams.values()))  # fmt: skip
        start = loop.time()
        carol = asyncio.ensure_future(
            served(http, stage, "carol", chat("ok", stream=True, max_tokens=4))
        )
        await gate.until(lambda: len(gate.streams) == SLOW_READERS + 1)
        carol_rid = next(r for r, s in gate.streams.items() if s.request.tenant == "carol")
        async with asyncio.timeout(LIMIT_S):
            carol_tokens = await carol
        carol_took = loop.time() - start
        carol_request = gate.streams[carol_rid].request
        carol_ttft = carol_request.first_token_at - carol_request.arrival
        slow = [r for r, s in gate.streams.items() if s.request.tenant == "alice"]
        # Each slow reader was cut (cancelled), before carol ran.
        await gate.until(lambda: all(gate.observer.ends[r] == 1 for r in slow))
        assert all(gate.outcome(r) is Outcome.CANCELLED for r in slow)
        assert carol_ttft < SLO_S, carol_ttft
        # Charged what ran: its prompt and every token pulled for it.
        for rid in slow:
            assert gate.observer.usage[rid] == (5, pulls[rid])
        assert await stage.used("alice") == {
            "tokens_per_minute": sum(5 + pulls[r] for r in slow), "requests_per_minute": 4,
            "max_concurrency": 0,
        }  # fmt: skip
        assert all(pulls[r] < ENDLESS_TOKENS // 4 for r in slow)

        # A client that reads on gets what was sent, then the error event, and
        # the connection ends: no [DONE].
        fast.set()
        async with asyncio.timeout(LIMIT_S):
            got = await asyncio.gather(*readers)
        for raw in got:
            assert raw.startswith(b"HTTP/1.1 200")
            tail = raw.rstrip(b"\r\n0").rsplit(b"data: ", 1)[1]
            body = json.loads(tail.split(b"\r\n", 1)[0])
            message = assert_error(body, "client_too_slow")
            assert "bytes a second" in message
            assert b"[DONE]" not in raw

        alice_tokens = await served(http, stage, "alice", chat("ok", stream=True, max_tokens=3))
        stage.assert_every_request_ended_once()
        assert (await stage.used("carol"))["tokens_per_minute"] == carol_tokens
        assert (await stage.used("alice"))["tokens_per_minute"] == sum(
            5 + pulls[r] for r in slow) + alice_tokens  # fmt: skip
        print(
            f"\n[c2] {SLOW_READERS} readers at {SLOW_PACE} B/s on {SLOW_READERS} slots, floor "
            f"{FLOOR} B/s over {WINDOW_S:g} s: carol's first token {carol_ttft:.2f}s "
            f"(SLO {SLO_S:g}s), served in {carol_took:.2f}s; the slow ones pulled "
            f"{min(pulls[r] for r in slow)}-{max(pulls[r] for r in slow)} tokens of 1 KiB"
        )


# -- d. a storm of disconnects -----------------------------------------------

STORM = 300
SEQS = 8


async def test_a_storm_of_disconnects_ends_every_request_once_and_refunds_it() -> None:
    # A slow simulated GPU (a token every ~0.1 s) with room for 8: most of
    # the storm is queued, the rest running, some of them mid-output.
    backend = {"kind": "sim", "speed": 0.05, "max_num_seqs": SEQS, "model": MODEL}
    policy = make_policy(backend, max_tokens=200, admission=False)
    async with serving(policy) as stage, aiohttp.ClientSession() as http:
        loop = asyncio.get_running_loop()
        gate = stage.gate
        tenants = list(KEYS)
        clients = [
            await raw_request(
                stage, chat(f"storm {i}", stream=i % 2 == 0, max_tokens=200), tenants[i % 3]
            )
            for i in range(STORM)
        ]
        await gate.until(lambda: len(gate.streams) == STORM)
        await gate.until(lambda: sum(s.request.first_token_at is not None
                                     for s in gate.streams.values()) >= SEQS)  # fmt: skip
        snap = gate.snapshot()
        assert snap["running"] == SEQS and snap["queued"] == STORM - SEQS

        start = loop.time()
        for i, client in enumerate(clients):
            if i % 3 == 0:
                # A reset rather than a close, for a third of them.
                client.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
            client.close()
        await gate.until(lambda: len(gate.observer.ends) == STORM)
        took = loop.time() - start
        assert took < 5.0, took

        stage.assert_every_request_ended_once()
        assert {s.request.outcome for s in gate.streams.values()} == {Outcome.CANCELLED}
        assert gate.backend.capacity().free_slots == SEQS
        assert not gate.backend.engine.has_work()  # type: ignore[attr-defined]
        # Those dispatched as the storm broke may have started before their
        # cancellation reached them: they ran too, for nothing but their prompt.
        ran = [s for s in gate.streams.values() if s._ran]
        assert len(ran) >= SEQS
        assert sum(s.request.output_tokens for s in ran) > 0
        for tenant in tenants:
            mine = [s for s in gate.streams.values() if s.request.tenant == tenant]
            charged = sum(s.request.prompt_tokens + s.request.output_tokens
                          for s in mine if s._ran)  # fmt: skip
            assert charged == sum(sum(gate.observer.usage[s.request.id] or (0, 0)) for s in mine)
            assert await stage.used(tenant) == {
                "tokens_per_minute": charged,
                "requests_per_minute": sum(s._ran for s in mine),
                "max_concurrency": 0,
            }
        before = await stage.used("alice")
        tokens = await served(http, stage, "alice", chat("after", stream=False, max_tokens=2))
        assert (await stage.used("alice"))["tokens_per_minute"] == (
            before["tokens_per_minute"] + tokens
        )
        print(
            f"\n[d] {STORM} clients ({SEQS} running) left at once: all ended cancelled in "
            f"{took * 1000:.0f} ms; {sum(s.request.output_tokens for s in ran)} output tokens "
            f"charged for what ran, every reservation of the queued refunded"
        )
