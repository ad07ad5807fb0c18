"""The OpenAI-compatible HTTP surface (docs/HTTP.md).

A request goes identity -> body -> validation -> prompt tokens -> max_tokens
(capped by the tier) -> `Gateway.submit`, then streams back as SSE or one JSON
body. Every error, whether the gateway's own, aiohttp's (404, 405, 413) or a
bug, leaves as OpenAI's `{"error": {...}}` with the status docs/HTTP.md gives it.
"""

from __future__ import annotations

import asyncio
import dataclasses
import fcntl
import hashlib
import hmac
import importlib.resources
import logging
import os
import socket
import struct
import sys
import time
import traceback
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any, TypeVar

import orjson
import structlog
from aiohttp import web
from aiohttp.http_exceptions import HttpProcessingError
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest

from qosgate.backends.base import Backend, Chunk
from qosgate.config.models import BackendConfig, PolicyConfig, VllmBackendConfig
from qosgate.core.request import Outcome
from qosgate.observability.metrics import stats_view
from qosgate.quotas import LimitState
from qosgate.runtime.errors import (
    AuthThrottled,
    GatewayError,
    PayloadTooLarge,
    RequestTimeout,
    Unauthorized,
)
from qosgate.runtime.ask import Ask
from qosgate.runtime.gate import Gateway, RequestStream
from qosgate.wiring import LivePolicy

from .errors import (
    MalformedRequest,
    MethodNotAllowed,
    RouteNotFound,
    UnsupportedMediaType,
    error_payload,
    error_response,
)
from .identity import AuthFailureLimiter, Identity, KeyRing
from .openapi import build_openapi
from .protocol import describe_parse_error
from .ratelimit import ratelimit_headers
from .validation import (
    MAX_PRIORITY_OFFSET,
    Endpoint,
    parse_json,
    asked_field,
    validate_body,
)

log = logging.getLogger("qosgate.http")
_T = TypeVar("_T")

# Typed request keys are recent in aiohttp; a plain string works everywhere.
REQUEST_ID: Any = (
    web.RequestKey("qosgate.request_id", str)
    if hasattr(web, "RequestKey")
    else "qosgate.request_id"
)
RATELIMIT: Any = (
    web.RequestKey("qosgate.ratelimit", dict)
    if hasattr(web, "RequestKey")
    else "qosgate.ratelimit"
)
"""The x-ratelimit headers of the request's tenant, once its quota was checked."""
ADMITTED: Any = (
    web.RequestKey("qosgate.admitted", bool)
    if hasattr(web, "RequestKey")
    else "qosgate.admitted"
)
"""Set once the request is handed to the gateway, which from then on counts
its outcome itself."""
TIER: Any = web.RequestKey("qosgate.tier", str) if hasattr(web, "RequestKey") else "qosgate.tier"
REQUEST_ID_HEADER = "x-request-id"
SESSION_HEADER = "X-Session-Id"
_MAX_SESSION_LEN = 256


@dataclass
class AppState:
    gateway: Gateway
    live: LivePolicy
    """The policy and keys served, swapped by a reload."""
    started: int
    """Unix time the app was built (the `created` of /v1/models)."""
    admin_token: str | None = None
    """Bearer token of the /admin endpoints (None: they are disabled)."""
    auth_failures: AuthFailureLimiter = dataclasses.field(
        default_factory=lambda: AuthFailureLimiter(0)
    )
    """Failed authentications per client address (API keys and admin token)."""

    @property
    def policy(self) -> PolicyConfig:
        return self.live.policy

    @property
    def keyring(self) -> KeyRing:
        return self.live.keyring


STATE = web.AppKey("qosgate.state", AppState)


def build_app(
    gateway: Gateway,
    policy: PolicyConfig | None = None,
    *,
    environ: Mapping[str, str] = os.environ,
    policy_path: str | None = None,
    live: LivePolicy | None = None,
) -> web.Application:
    """`policy_path`: the file a reload re-reads (None: reload is refused).
    `live`: the policy and keys served, where the caller holds them (it
    reloads them); otherwise built from the rest."""
    if live is None:
        live = LivePolicy(gateway, policy, environ=environ, policy_path=policy_path)
    policy = live.policy
    app = web.Application(
        client_max_size=policy.server.max_body_bytes,
        middlewares=[_error_middleware],
    )
    app[STATE] = AppState(
        gateway=gateway,
        live=live,
        started=int(time.time()),
        admin_token=_admin_token(policy, live.environ),
        auth_failures=AuthFailureLimiter(policy.server.auth_failures_per_minute),
    )
    # Every response the tenant gets, streamed or not, error or not, carries
    # its quota as it stood once checked.
    app.on_response_prepare.append(_before_headers)
    app.router.add_post("/v1/chat/completions", _chat_completions)
    app.router.add_post("/v1/completions", _completions)
    app.router.add_get("/v1/models", _models)
    app.router.add_get("/healthz", _healthz)
    app.router.add_get("/readyz", _readyz)
    app.router.add_get("/admin/quotas", _admin_quotas)
    app.router.add_get("/admin/stats", _admin_stats)
    app.router.add_post("/admin/reload", _admin_reload)
    app.router.add_get("/dashboard", _dashboard)
    app.router.add_get("/metrics", _metrics)
    app.router.add_get("/openapi.json", _openapi)
    return app


def _admin_token(policy: PolicyConfig, environ: Mapping[str, str]) -> str | None:
    name = policy.server.admin_token_env
    token = environ.get(name) if name else None
    return token or None


async def _before_headers(request: web.Request, response: web.StreamResponse) -> None:
    headers = request.get(RATELIMIT)
    if headers:
        response.headers.update(headers)
    # A keep-alive client of a stopping gateway must reconnect (to another
    # replica) for its next request.
    if request.app[STATE].gateway.draining:
        response.force_close()
        # This hook runs after aiohttp wrote the Connection header.
        response.headers["Connection"] = "close"


# --------------------------------------------------------------------------
# Errors


@web.middleware
async def _error_middleware(request: web.Request, handler: Any) -> web.StreamResponse:
    # 128 random bits, as a UUID4's hex but without building the UUID.
    request_id = os.urandom(16).hex()
    request[REQUEST_ID] = request_id
    # Every line logged while this request is served carries its id (and,
    # once known, its tenant and tier).
    structlog.contextvars.clear_contextvars()
    structlog.contextvars.bind_contextvars(request_id=request_id)
    try:
        response = await handler(request)
    except GatewayError as exc:
        _count_refusal(request, exc.outcome)
        response = error_response(exc)
        if isinstance(exc, RequestTimeout):
            # The rest of the body may still come; read as a next request it
            # would be garbage.
            response.force_close()
    except web.HTTPException as exc:
        if exc.status >= 400:
            _count_refusal(request, Outcome.BAD_REQUEST)
        response = _from_http_exception(request, exc)
    except asyncio.CancelledError:
        raise
    except Exception as exc:  # noqa: BLE001 - any bug must still answer in OpenAI's shape
        # The traceback without the exception's message: a message can quote
        # the request (a prompt), and prompts are never logged.
        log.error(
            "unhandled %s in %s %s (request %s)\n%s",
            type(exc).__name__,
            request.method,
            request.path,
            request_id,
            "".join(traceback.format_tb(exc.__traceback__)),
        )
        response = web.json_response(
            error_payload(
                "The server had an error processing your request.",
                "server_error",
                "internal_error",
                None,
            ),
            status=500,
        )
    if not response.prepared:
        response.headers[REQUEST_ID_HEADER] = request_id
    return response


def _count_refusal(request: web.Request, outcome: Outcome) -> None:
    """A request that ended before the gateway took it (the gateway counts the
    rest). Only the API's own paths count as requests."""
    if request.get(ADMITTED) or not request.path.startswith("/v1/"):
        return
    request.app[STATE].gateway.observer.refused(request.get(TIER, "none"), outcome)


def _from_http_exception(request: web.Request, exc: web.HTTPException) -> web.StreamResponse:
    if exc.status < 400:
        raise exc
    if isinstance(exc, web.HTTPNotFound):
        return error_response(RouteNotFound(f"Unknown path: {request.path[:200]}"))
    if isinstance(exc, web.HTTPMethodNotAllowed):
        # 405 must say what is allowed (RFC 9110).
        return error_response(
            MethodNotAllowed(
                f"Method {request.method[:20]} is not allowed on {request.path[:200]}."
            ),
            headers={"Allow": exc.headers.get("Allow", "")},
        )
    if isinstance(exc, web.HTTPRequestEntityTooLarge):
        limit = request.app[STATE].policy.server.max_body_bytes
        return error_response(PayloadTooLarge(f"Request body too large: at most {limit} bytes."))
    # Anything else aiohttp raises (a malformed body stream, ...): its status, our shape.
    return web.json_response(
        error_payload(
            exc.reason,
            "invalid_request_error" if exc.status < 500 else "server_error",
            exc.reason.lower().replace(" ", "_"),
            None,
        ),
        status=exc.status,
    )


# --------------------------------------------------------------------------
# Probes and models


_FLEET_LEVELS_TIMEOUT_S = 2.0
"""How long a scrape waits for the fleet's shared queue before answering without it."""


async def _fleet_levels(gateway: Gateway) -> dict[str, Any] | None:
    """The fleet's shared queue (fleet mode), or None: one node, or Redis not
    read in time. A replica's own queue only holds work on its way to the
    fleet; the backlog operators watch is in the shared queue, read as asked."""
    try:
        async with asyncio.timeout(_FLEET_LEVELS_TIMEOUT_S):
            return await gateway.backend.fleet_levels()
    except TimeoutError:
        return None


async def _metrics(request: web.Request) -> web.Response:
    gateway = request.app[STATE].gateway
    metrics = gateway.observer.metrics
    metrics.fleet_levels = await _fleet_levels(gateway)
    registry = metrics.registry
    response = web.Response(body=generate_latest(registry))
    response.content_type = CONTENT_TYPE_LATEST.split(";")[0]
    return response


async def _healthz(request: web.Request) -> web.Response:
    return web.json_response({"status": "ok"})


async def _readyz(request: web.Request) -> web.Response:
    gateway = request.app[STATE].gateway
    if gateway.ready():
        return web.json_response({"status": "ready"})
    if gateway.draining:
        message, code = "The gateway is shutting down.", "shutting_down"
    else:
        message, code = "The backend is not ready.", "not_ready"
    return web.json_response(
        error_payload(message, "server_error", code, None),
        status=503,
        headers={"Retry-After": "1"},
    )


def _authenticated(request: web.Request, check: Callable[[], _T], state: AppState) -> _T:
    """Runs `check` (which raises Unauthorized on bad credentials) unless the
    client's address has failed too often already; counts its failures."""
    limiter = state.auth_failures
    address = request.remote or "unknown"
    # Any steady clock will do, as long as the limiter only ever sees this
    # one; asking the loop for its time costs a system call (getpid) on 3.11.
    now = time.monotonic()
    wait = limiter.retry_after(address, now)
    if wait is not None:
        raise AuthThrottled(
            "Too many failed authentications from this address; try again later.",
            retry_after_s=wait,
        )
    try:
        return check()
    except Unauthorized:
        limiter.failed(address, now)
        raise


def _identify(request: web.Request, state: AppState) -> Identity:
    keyring = state.keyring
    return _authenticated(request, lambda: keyring.identify(request.headers), state)


async def _models(request: web.Request) -> web.Response:
    state = request.app[STATE]
    _identify(request, state)
    return web.json_response(
        {
            "object": "list",
            "data": [
                {
                    "id": name,
                    "object": "model",
                    "created": state.started,
                    "owned_by": "qosgate",
                    "root": _model_root(state.policy.backend, state.gateway.backend, name),
                    "parent": None,
                }
                for name in state.gateway.backend.models
            ],
        }
    )


def _model_root(config: BackendConfig, backend: Backend, name: str) -> str:
    """What vLLM lists as a model's `root` (clients such as its benchmark
    read it to find the tokenizer): the path or hub name the engine loaded,
    which `served_model_name` hides; the openai backend's upstream's own
    `root` (`model_roots`). Otherwise the name is all there is."""
    if isinstance(config, VllmBackendConfig) and name == (config.served_model_name or config.model):
        return config.model
    return backend.model_roots.get(name, name)


async def _openapi(request: web.Request) -> web.Response:
    """The OpenAPI description of this surface. No key, so that tools can
    read it first; it does name the served models (docs/HTTP.md). Built per
    call: an openai backend learns its models from its upstreams as it runs."""
    state = request.app[STATE]
    backend = state.gateway.backend
    return web.json_response(
        build_openapi(
            backend.models,
            max_body_bytes=state.policy.server.max_body_bytes,
            support=backend.support,
            max_model_len=backend.max_model_len,
        )
    )


# --------------------------------------------------------------------------
# Admin


def _check_admin(request: web.Request) -> None:
    _authenticated(request, lambda: _check_admin_token(request), request.app[STATE])


def _check_admin_token(request: web.Request) -> None:
    token = request.app[STATE].admin_token
    if token is None:
        raise RouteNotFound(
            "The admin endpoints are disabled: set the variable named by "
            "server.admin_token_env to a token to enable them."
        )
    given = request.headers.get("Authorization", "")
    scheme, _, value = given.partition(" ")
    # Digests of equal length are compared, so not even the token's length
    # shows in the time a wrong guess takes.
    if scheme.lower() != "bearer" or not hmac.compare_digest(
        hashlib.sha256(value.strip().encode("utf-8", "surrogateescape")).digest(),
        hashlib.sha256(token.encode()).digest(),
    ):
        raise Unauthorized("The admin endpoints need the admin token as a Bearer token.")


_DASHBOARD: bytes | None = None


async def _dashboard(request: web.Request) -> web.Response:
    """The live page. It carries no data: the browser reads /admin/stats with
    the admin token, given once as `/dashboard#token=...` (a fragment never
    reaches a server or its logs) or typed into the page."""
    global _DASHBOARD
    if _DASHBOARD is None:
        _DASHBOARD = (
            importlib.resources.files("qosgate.http").joinpath("static/dashboard.html").read_bytes()
        )
    return web.Response(
        body=_DASHBOARD,
        content_type="text/html",
        charset="utf-8",
        headers={"Cache-Control": "no-cache", "Content-Security-Policy": "default-src 'self'; "
                 "script-src 'unsafe-inline'; style-src 'unsafe-inline'"},
    )


async def _admin_reload(request: web.Request) -> web.Response:
    _check_admin(request)
    return web.json_response(request.app[STATE].live.reload())


async def _admin_stats(request: web.Request) -> web.Response:
    """The dashboard's data: queues and backend as they stand, requests by
    outcome, SLOs, first-token times and batch sizes per tier, quotas."""
    _check_admin(request)
    state = request.app[STATE]
    gateway = state.gateway
    snapshot = gateway.snapshot()
    tiers = {
        name: {
            **snapshot["tiers"].get(name, {}),
            "priority": tier.priority,
            "ttft_slo_ms": tier.ttft_slo_ms,
            "e2e_slo_ms": tier.e2e_slo_ms,
        }
        for name, tier in state.policy.tiers.items()
    }
    return web.json_response(
        dumps=_json_text,
        data={
            "time": time.time(),
            "ready": gateway.ready(),
            "scheduler": {k: v for k, v in snapshot.items() if k not in ("tiers", "backend")},
            "backend": snapshot["backend"],
            "tiers": tiers,
            **stats_view(gateway.observer.metrics),
            "quotas": await _quota_view(state),
            "fleet": await _fleet_levels(gateway),
        },
    )


async def _quota_view(state: AppState) -> dict[str, Any]:
    guard = state.gateway.quotas
    tenants = {}
    for tenant in state.policy.tenants:
        states = await guard.usage(tenant.id)
        tenants[tenant.id] = {
            "tier": tenant.tier,
            "limits": {
                s.kind: {
                    "limit": s.limit,
                    "used": s.used,
                    "remaining": s.remaining,
                    "reset_s": round(s.reset_s, 3),
                }
                for s in states
            },
        }
    return tenants


async def _admin_quotas(request: web.Request) -> web.Response:
    """Each tenant's quota use and what is left (read-only)."""
    _check_admin(request)
    state = request.app[STATE]
    guard = state.gateway.quotas
    tenants = await _quota_view(state)
    counters = guard.counters
    return web.json_response(
        dumps=_json_text,
        data={
            "store": {
                "kind": guard.store.name,
                "on_error": state.policy.quota_store.on_error,
                "reachable": not guard.store_down,
                **vars(counters),
            },
            "tenants": tenants,
        },
    )


# --------------------------------------------------------------------------
# Completions


async def _chat_completions(request: web.Request) -> web.StreamResponse:
    return await _generate(request, "chat")


async def _completions(request: web.Request) -> web.StreamResponse:
    return await _generate(request, "completions")


async def _read_json(request: web.Request, state: AppState) -> Any:
    content_type = request.headers.get("Content-Type")
    if content_type is not None:
        mime = content_type.split(";", 1)[0].strip().lower()
        # A missing Content-Type is let through (hand-written curl often omits
        # it); a declared non-JSON one is a client bug worth naming.
        if mime != "application/json" and not mime.endswith("+json"):
            raise UnsupportedMediaType(mime[:100])
    timeout_s = state.policy.server.body_timeout_s
    try:
        if request.content.is_eof():
            # The whole body came with the headers (the usual case): reading
            # it cannot wait, so it needs no timer.
            raw = await request.read()
        else:
            # A client trickling its body would otherwise hold the handler
            # (and the connection) for as long as it likes.
            async with asyncio.timeout(timeout_s):
                raw = await request.read()
    except TimeoutError:
        raise RequestTimeout(
            f"The request body did not arrive within {timeout_s:g} s."
        ) from None
    except (HttpProcessingError, web.RequestPayloadError) as exc:
        # A broken chunked encoding, a body shorter than its Content-Length, a
        # gzip body that does not inflate: the client's fault, not a bug of ours.
        raise MalformedRequest(f"Malformed request body: {describe_parse_error(exc)}.") from None
    return parse_json(raw)


@dataclass
class _Call:
    """What the response needs to know about one admitted request."""

    endpoint: Endpoint
    response_id: str
    created: int
    model: str
    prompt_tokens: int
    include_usage: bool


async def _generate(request: web.Request, endpoint: Endpoint) -> web.StreamResponse:
    state = request.app[STATE]
    # Identity first: an unauthenticated client does not get its body parsed.
    identity = _identify(request, state)
    request[TIER] = identity.tier
    structlog.contextvars.bind_contextvars(tenant=identity.tenant, tier=identity.tier)
    raw = await _read_json(request, state)
    gateway = state.gateway
    backend = gateway.backend
    parsed = validate_body(endpoint, raw, backend.models, backend.support)

    request_id = request[REQUEST_ID]
    session = request.headers.get(SESSION_HEADER)
    ask = Ask(
        request_id=request_id,
        tenant=identity.tenant,
        tier=identity.tier,
        endpoint=endpoint,
        body=raw,
        asked_max_tokens=parsed.asked_max_tokens,
        asked_field=asked_field(parsed),
        min_tokens=parsed.min_tokens,
        priority_offset=min(parsed.priority or 0, MAX_PRIORITY_OFFSET),
        session=session[:_MAX_SESSION_LEN] if session else None,
    )
    request[ADMITTED] = True  # admitted or refused, the gateway counts it from here

    def quota_checked(states: Sequence[LimitState]) -> None:
        request[RATELIMIT] = ratelimit_headers(states)

    # From here on the request is admitted: every path must end it (the
    # response functions close the stream on any way out but completion).
    stream = await gateway.admit(ask, on_quota=quota_checked)
    call = _Call(
        endpoint=endpoint,
        response_id=("chatcmpl-" if endpoint == "chat" else "cmpl-") + request_id,
        created=int(time.time()),
        model=parsed.model,
        prompt_tokens=stream.request.prompt_tokens,
        include_usage=parsed.include_usage,
    )
    tier = state.policy.tiers[identity.tier]
    if parsed.stream:
        pace = _Pace(tier.min_delivery_bytes_per_s, tier.delivery_window_s)
        return await _stream_response(request, stream, call, state, pace)
    return await _json_response(stream, call)


def _usage(call: _Call, completion_tokens: int, reported: dict[str, int] | None) -> dict[str, int]:
    # The backend's own count wins where it has one (a real tokenizer).
    prompt = call.prompt_tokens
    completion = completion_tokens
    if reported:
        prompt = int(reported.get("prompt_tokens", prompt))
        completion = int(reported.get("completion_tokens", completion))
    return {
        "prompt_tokens": prompt,
        "completion_tokens": completion,
        "total_tokens": prompt + completion,
    }


class _Tally:
    def __init__(self) -> None:
        self.tokens = 0
        self.finish_reason: str | None = None
        self.usage: dict[str, int] | None = None

    def add(self, chunk: Chunk) -> None:
        self.tokens += chunk.tokens
        if chunk.finish_reason is not None:
            self.finish_reason = chunk.finish_reason
        if chunk.usage:
            self.usage = chunk.usage


_NOT_CHOICE_FIELDS = frozenset({"index", "delta", "message", "text", "finish_reason"})
"""Keys of a chunk's `raw` that are not the choice's own fields: the gateway
renders these itself, or (delta, message) puts them further in."""


def _join_logprobs(have: Any, more: Any) -> Any:
    """Two consecutive chunks' logprobs as one. Every list in them runs along
    the tokens (chat's `content` and `refusal`; completions' `tokens`,
    `token_logprobs`, `top_logprobs`, `text_offset`, which upstreams count
    from the start of the whole text), so the lists go end to end. The
    joined lists are the response's own, extended in place: a whole answer
    given token by token (the vllm backend's) joins in linear time."""
    if not isinstance(more, dict):
        return have if more is None else more
    joined = have if isinstance(have, dict) else {}
    for key, value in more.items():
        before = joined.get(key)
        if isinstance(before, list) and isinstance(value, list):
            before.extend(value)
        elif isinstance(value, list):
            joined[key] = list(value)  # a copy: the chunk's list is not ours to grow
        elif value is not None:
            joined[key] = value
    return joined


def _relay_choice_fields(choice: dict[str, Any], raw: dict[str, Any]) -> None:
    """What a backend relays beyond text (logprobs, vLLM's stop_reason, ...)
    onto `choice`; logprobs already there are joined, not replaced."""
    for key, value in raw.items():
        if key in _NOT_CHOICE_FIELDS:
            continue
        if key == "logprobs":
            value = _join_logprobs(choice.get("logprobs"), value)
        choice[key] = value


async def _json_response(stream: RequestStream, call: _Call) -> web.Response:
    parts: list[str] = []
    message_fields: dict[str, Any] = {}
    choice_fields: dict[str, Any] = {"logprobs": None}
    tally = _Tally()
    try:
        async for chunk in stream:
            parts.append(chunk.text)
            tally.add(chunk)
            if chunk.raw:
                # A backend that answers whole passes a chat message's other
                # fields (tool calls, ...) under "message". Deltas (raw["delta"])
                # come only to streamed requests: the openai backend asks a
                # whole answer of its upstream for a client that reads whole.
                extra = chunk.raw.get("message")
                if isinstance(extra, dict):
                    message_fields.update(extra)
                _relay_choice_fields(choice_fields, chunk.raw)
    except BaseException:
        # Cancelled (client gone) or failed: the stream must end its request
        # now, so a queued request leaves the queue and a running one aborts.
        await stream.aclose()
        raise
    text = "".join(parts)
    finish = tally.finish_reason or "stop"
    if call.endpoint == "chat":
        choice: dict[str, Any] = {
            "index": 0,
            "message": {"role": "assistant", "content": text, **message_fields},
            **choice_fields,
            "finish_reason": finish,
        }
        kind = "chat.completion"
    else:
        choice = {"index": 0, "text": text, **choice_fields, "finish_reason": finish}
        kind = "text_completion"
    body = orjson.dumps(
        {
            "id": call.response_id,
            "object": kind,
            "created": call.created,
            "model": call.model,
            "choices": [choice],
            "usage": _usage(call, tally.tokens, tally.usage),
        }
    )
    return web.Response(body=body, content_type="application/json", charset="utf-8")


def _json_text(value: Any) -> str:
    return orjson.dumps(value).decode()


def _event(payload: dict[str, Any]) -> bytes:
    return b"data: " + orjson.dumps(payload) + b"\n\n"


_DONE_EVENT = b"data: [DONE]\n\n"
# Stands in for the text while the rest of a text event is rendered. Any string
# would do: the text is the event's last string, so the last match is the text
# whatever the id or the model name hold.
_TEXT_MARKER = "\x00"
_TEXT_MARKER_JSON = orjson.dumps(_TEXT_MARKER)


def _text_event_parts(call: _Call) -> tuple[bytes, bytes]:
    """A text event's bytes before and after its JSON-quoted text. Text events
    differ in nothing else, so the rest is rendered once per response."""
    head, _, tail = _chunk_event(call, _TEXT_MARKER, None).rpartition(_TEXT_MARKER_JSON)
    return head, tail


def _chunk_event(
    call: _Call,
    delta_text: str | None,
    finish: str | None,
    *,
    role: bool = False,
    usage: dict[str, int] | None = None,
    raw: dict[str, Any] | None = None,
) -> bytes:
    if call.endpoint == "chat":
        delta: dict[str, Any] = {}
        if role:
            delta["role"] = "assistant"
        if delta_text is not None:
            delta["content"] = delta_text
        extra = raw.get("delta") if raw else None
        if isinstance(extra, dict):
            delta.update(extra)
        choice: dict[str, Any] = {
            "index": 0,
            "delta": delta,
            "logprobs": None,
            "finish_reason": finish,
        }
        kind = "chat.completion.chunk"
    else:
        choice = {"index": 0, "text": delta_text or "", "logprobs": None, "finish_reason": finish}
        kind = "text_completion"
    if raw:
        _relay_choice_fields(choice, raw)
    payload: dict[str, Any] = {
        "id": call.response_id,
        "object": kind,
        "created": call.created,
        "model": call.model,
        "choices": [choice],
    }
    if usage is not None:
        payload["usage"] = usage
    return _event(payload)


def _usage_event(call: _Call, usage: dict[str, int]) -> bytes:
    return _event(
        {
            "id": call.response_id,
            "object": "chat.completion.chunk" if call.endpoint == "chat" else "text_completion",
            "created": call.created,
            "model": call.model,
            "choices": [],
            "usage": usage,
        }
    )


async def _stream_response(
    request: web.Request, stream: RequestStream, call: _Call, state: AppState, pace: _Pace
) -> web.StreamResponse:
    chunks = stream.__aiter__()
    try:
        # Wait for the first chunk before sending headers: an error while the
        # request is queued (expired, backend down) can still be a proper status.
        try:
            first: Chunk | None = await chunks.__anext__()
        except StopAsyncIteration:
            first = None
    except BaseException:
        await stream.aclose()
        raise

    response = web.StreamResponse(
        headers={
            "Content-Type": "text/event-stream",
            "Cache-Control": "no-cache",
            # Proxies such as nginx would otherwise buffer the stream.
            "X-Accel-Buffering": "no",
            REQUEST_ID_HEADER: request[REQUEST_ID],
        }
    )
    tally = _Tally()
    head, tail = _text_event_parts(call)
    stall_s = state.policy.server.client_stall_timeout_s
    # Events are held until the stream may have to wait for its next chunk, then
    # go out in one write (one system call) rather than one each: an upstream's
    # events mostly arrive several to a read.
    pending: list[bytes] = []
    if call.endpoint == "chat":
        pending.append(_chunk_event(call, "", None, role=True))
    last: Chunk | None = None  # a finishing chunk with fields beyond text
    try:
        await response.prepare(request)
        chunk = first
        while chunk is not None:
            tally.add(chunk)
            if chunk.raw:
                # Fields beyond text (tool calls, logprobs) need the whole
                # event rendered. A finishing chunk's fields and text go out
                # in the finish event, as an upstream sends them.
                if chunk.finish_reason is None:
                    pending.append(_chunk_event(call, chunk.text or None, None, raw=chunk.raw))
                else:
                    last = chunk
            elif chunk.text:
                pending.append(head + orjson.dumps(chunk.text) + tail)
            # After the finishing chunk the stream ends without a wait, and
            # its events go out with the last ones.
            if pending and chunk.finish_reason is None and not stream.ready():
                data = b"".join(pending)
                pending.clear()
                await _write(request, response, data, stall_s, pace=pace)
            try:
                chunk = await chunks.__anext__()
            except StopAsyncIteration:
                chunk = None
        usage = _usage(call, tally.tokens, tally.usage)
        finish = tally.finish_reason or "stop"
        last_text = (last.text or None) if last is not None else None
        last_raw = last.raw if last is not None else None
        if call.include_usage:
            # OpenAI's shape when asked: the usage alone in a last, choice-less chunk.
            pending.append(_chunk_event(call, last_text, finish, raw=last_raw))
            pending.append(_usage_event(call, usage))
        else:
            # Usage goes in the final chunk even when not asked for (so every
            # stream can be metered by its reader); clients ignore a field
            # they do not expect.
            pending.append(_chunk_event(call, last_text, finish, usage=usage, raw=last_raw))
        pending.append(_DONE_EVENT)
        data = b"".join(pending)
        pending.clear()
        await _write(request, response, data, stall_s, last=True, pace=pace)
    except _ClientStalled:
        # Cancelled, not failed: the client is as good as gone, and what ran
        # for it is charged; its backend slot goes to the queue.
        await stream.aclose()
        _drop_stalled(request, stall_s)
    except _ClientTooSlow as slow:
        # As a stall (cancelled, charged what ran, the slot to the queue), but
        # the client still reads: the reason goes as the stream's last event,
        # behind what the buffers hold, and the connection closes after it.
        await stream.aclose()
        log.warning(
            "request %s: the client took %.0f B in %gs of waiting on it (floor %g B/s); ended",
            request[REQUEST_ID], slow.taken, slow.waited_s, pace.floor,
        )  # fmt: skip
        response.force_close()
        await _send_error_event(
            request,
            response,
            error_payload(
                f"The client read the stream slower than {pace.floor:g} bytes a second "
                f"(tier delivery floor) for {slow.waited_s:g}s; the stream was ended.",
                "server_error",
                "client_too_slow",
                None,
            ),
            pending,
            stall_s,
        )
    except ConnectionError:
        # The client went away mid-stream (aiohttp's write errors are
        # ConnectionResetError): end the request as cancelled.
        await stream.aclose()
    except GatewayError as exc:
        await stream.aclose()
        # Headers are gone; the status can only travel inside the stream.
        await _send_error_event(request, response, exc.body(), pending, stall_s)
    except asyncio.CancelledError:
        await stream.aclose()
        raise
    except Exception as exc:  # noqa: BLE001 - the stream must still end with an error event
        await stream.aclose()
        log.error(
            "unhandled %s while streaming request %s\n%s",
            type(exc).__name__,
            request[REQUEST_ID],
            "".join(traceback.format_tb(exc.__traceback__)),
        )
        await _send_error_event(
            request,
            response,
            error_payload(
                "The server had an error processing your request.",
                "server_error",
                "internal_error",
                None,
            ),
            pending,
            stall_s,
        )
    return response


class _ClientStalled(Exception):
    """The client took none of a write for `server.client_stall_timeout_s`."""


class _ClientTooSlow(Exception):
    """The client took less than its tier's delivery floor while the gateway
    waited on it for a whole window."""

    def __init__(self, taken: float, waited_s: float) -> None:
        super().__init__(taken, waited_s)
        self.taken = taken
        self.waited_s = waited_s


_SIOCOUTQ = 0x5411
"""Linux's ioctl for the bytes a TCP socket holds that its peer has not yet
acknowledged (TIOCOUTQ's number)."""


class _Pace:
    """A stream's delivery floor. The gateway pulls the backend's
    next chunk only once the client's socket took the last write, so a reader
    slower than the backend holds the backend's slot for as long as it reads:
    a 4,000-token answer at 256 B/s takes an hour. The stall timeout catches
    only a reader that takes nothing at all.

    The floor is judged only over the time the gateway waits on the client:
    then the buffers to it are full and the client alone holds the slot. A
    slow model keeps no write waiting, so a client of a slow model is never
    judged, however long the answer takes; a rate rather than a maximum
    duration for the same reason, since a duration long enough for a slow
    model's longest answer bounds nothing. While the gateway waits, what the
    client took is what left the transport's buffer and the kernel's send
    queue (the queue holds what the client's kernel has not acknowledged,
    SIOCOUTQ; where that cannot be read, what left the transport, which comes
    in bursts as the kernel frees room: a window must then outlast a burst).
    Once the waits add up to `window_s`, the bytes taken must reach
    `floor * window_s`, or the stream ends; the count then starts over.

    So a reader holds a slot for at most about the answer's bytes over the
    floor, on top of the backend's own time, and never more than `window_s`
    of waiting at below the floor."""

    __slots__ = ("floor", "window_s", "waited_s", "taken")

    def __init__(self, floor: float, window_s: float) -> None:
        self.floor = floor
        self.window_s = window_s
        self.waited_s = 0.0
        self.taken = 0.0

    @staticmethod
    def backlog(transport: asyncio.Transport) -> int:
        """Bytes written that the client's kernel has not acknowledged."""
        held = transport.get_write_buffer_size()
        if sys.platform == "linux":
            sock = transport.get_extra_info("socket")
            if sock is not None:
                try:
                    raw = fcntl.ioctl(sock.fileno(), _SIOCOUTQ, b"\0" * 4)
                    held += struct.unpack("i", raw)[0]
                except OSError:
                    pass
        return held

    async def wait(self, write: Any, transport: asyncio.Transport, size: int,
                   stall_s: float) -> None:  # fmt: skip
        """Await `write` (which adds `size` bytes), bounded by the stall
        timeout and judged against the floor."""
        loop = asyncio.get_running_loop()
        task = asyncio.ensure_future(write)
        start = loop.time()
        backlog = self.backlog(transport) + size
        try:
            while True:
                now = loop.time()
                until = min(start + stall_s, now + max(0.0, self.window_s - self.waited_s))
                await asyncio.wait((task,), timeout=max(0.0, until - now))
                left = self.backlog(transport)
                self.waited_s += loop.time() - now
                self.taken += max(0, backlog - left)
                backlog = left
                if task.done():
                    task.result()
                    return
                if loop.time() - start >= stall_s:
                    raise _ClientStalled
                if self.waited_s >= self.window_s:
                    if self.taken < self.floor * self.waited_s:
                        raise _ClientTooSlow(self.taken, self.waited_s)
                    self.waited_s = self.taken = 0.0
        finally:
            if not task.done():
                # Settled before anything else is written to the response.
                task.cancel()
                await asyncio.wait((task,))


_WRITE_SLACK = 4096
"""Bytes aiohttp may add to a write: chunk framing, and the headers it sends
along with the first one."""


async def _write(
    request: web.Request,
    response: web.StreamResponse,
    data: bytes,
    stall_s: float,
    *,
    last: bool = False,
    pace: _Pace | None = None,
) -> None:
    """Send `data` (and end the body, if `last`). aiohttp's write waits while
    the socket's buffers are full, which is what keeps a slow reader from
    making the gateway pull the backend ahead and buffer its output; bounding
    that wait keeps a reader that stopped from holding its backend slot, and
    `pace`'s floor one that reads too slowly."""
    transport = request.transport
    if (
        transport is not None
        and not request.protocol.writing_paused
        and transport.get_write_buffer_size() + len(data) + _WRITE_SLACK
        <= transport.get_write_buffer_limits()[1]
    ):
        # This write cannot wait: the transport stays below its high-water
        # mark, so aiohttp has nothing to drain. Most writes are like this,
        # and skip the timer (a few microseconds each, per token).
        if last:
            await response.write_eof(data)
        else:
            await response.write(data)
        return
    if pace is not None and pace.floor > 0 and transport is not None:
        write = response.write_eof(data) if last else response.write(data)
        await pace.wait(write, transport, len(data), stall_s)
        return
    try:
        async with asyncio.timeout(stall_s):
            if last:
                await response.write_eof(data)
            else:
                await response.write(data)
    except TimeoutError:
        raise _ClientStalled from None


def _drop_stalled(request: web.Request, stall_s: float) -> None:
    """Hang up on a stalled client at once, with a reset: a graceful close
    would leave the kernel holding what is still buffered for a reader that
    takes nothing, for as long as TCP keeps probing it."""
    log.warning(
        "request %s: the client read nothing for %gs; dropped", request[REQUEST_ID], stall_s
    )
    transport = request.transport
    if transport is None:
        return
    sock = transport.get_extra_info("socket")
    if sock is not None:
        try:
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
        except OSError:
            pass  # the socket refused the option: a plain abort then
    transport.abort()


async def _send_error_event(
    request: web.Request,
    response: web.StreamResponse,
    payload: dict[str, Any],
    pending: list[bytes],
    stall_s: float,
) -> None:
    """The error as the stream's last event, after the events not yet sent."""
    try:
        data = b"".join([*pending, _event(payload)])
        await _write(request, response, data, stall_s, last=True)
    except _ClientStalled:
        _drop_stalled(request, stall_s)
    except ConnectionError:
        pass
