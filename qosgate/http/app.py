"""The OpenAI-compatible HTTP surface (docs/HTTP.md): the app, its error
middleware and the probes. The handlers live by concern: completions.py
(identity, body, validation, then the runtime's `Gateway.admit`),
streaming.py, render.py, admin.py. Every error, whether the
gateway's own, aiohttp's (404, 405, 413) or a bug, leaves as OpenAI's
`{"error": {...}}` with the status docs/HTTP.md gives it.
"""

from __future__ import annotations

import asyncio
import logging
import os
import time
import traceback
from collections.abc import Mapping
from typing import Any

import structlog
from aiohttp import web

from qosgate.config.models import PolicyConfig
from qosgate.config.secrets import read_secret
from qosgate.core.request import Outcome, Request
from qosgate.observability import request_refused
from qosgate.observability.otel import Clock, Tracing
from qosgate.runtime.errors import GatewayError, PayloadTooLarge, RequestTimeout
from qosgate.runtime.gate import Gateway
from qosgate.wiring import LivePolicy, build_batches

from . import batches as batch_routes
from .admin import admin_quotas, admin_reload, admin_stats, dashboard_page, get_metrics
from .completions import post_chat_completions, post_completions
from .clients import TrustedProxies
from .errors import (
    INTERNAL_ERROR, MalformedRequest, MethodNotAllowed, RouteNotFound, error_payload,
    error_response,
)  # fmt: skip
from .identity import AuthFailureLimiter
from .openapi import build_openapi
from .state import (
    ADMITTED, BAD_FORWARDING, CLIENT_REQUEST_ID, MODEL, OUTCOME, RATELIMIT, RECORD, REQUEST_ID,
    REQUEST_ID_HEADER, STATE, TENANT, TIER, TRACE_HEADERS, AppState, identify,
    valid_client_request_id,
)

log = logging.getLogger("qosgate.http")


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
    # Each middleware only where it has work (off, it costs nothing): the
    # client's address first, so everything after it (the limiter, the audit
    # line) sees the client's, not the proxy's; then the request's span.
    middlewares: list[Any] = []
    if policy.server.trusted_proxies:
        middlewares.append(TrustedProxies(policy.server.trusted_proxies).middleware)
    tracing = gateway.observer.tracing
    if tracing is not None:
        middlewares.append(_traced(tracing))
    middlewares.append(_error_middleware)
    app = web.Application(
        client_max_size=policy.server.max_body_bytes, middlewares=middlewares
    )
    state = app[STATE] = AppState(
        gateway=gateway,
        live=live,
        started=int(time.time()),
        admin_token=read_secret(policy.server.admin_token_env, live.environ),
        metrics_token=read_secret(policy.server.metrics_token_env, live.environ),
        auth_failures=AuthFailureLimiter(policy.server.auth_failures_per_minute),
        batches=build_batches(gateway, live),
    )
    if state.batches is not None:
        # Jobs resume when the app starts and end before the gateway closes
        # (`qosgate serve` stops them itself, earlier, within its grace).
        service = state.batches
        app.on_startup.append(lambda _: service.start())
        app.on_shutdown.append(lambda _: service.stop())
    # Every response the tenant gets, streamed or not, error or not, carries
    # its quota as it stood once checked.
    app.on_response_prepare.append(_before_headers)
    app.router.add_post("/v1/chat/completions", post_chat_completions)
    app.router.add_post("/v1/completions", post_completions)
    app.router.add_get("/v1/models", _models)
    app.router.add_get("/healthz", _healthz)
    app.router.add_get("/readyz", _readyz)
    app.router.add_get("/admin/quotas", admin_quotas)
    app.router.add_get("/admin/stats", admin_stats)
    app.router.add_post("/admin/reload", admin_reload)
    app.router.add_get("/dashboard", dashboard_page)
    app.router.add_get("/metrics", get_metrics)
    app.router.add_get("/openapi.json", _openapi)
    batch_routes.add_routes(app)
    return app


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
    # 128 random bits, as a UUID4's hex but without building the UUID. It
    # stays the gateway's own (quota reservations and the fleet's queue key
    # on it, so it must be unique); a client's own id is kept beside it.
    request_id = os.urandom(16).hex()
    request[REQUEST_ID] = request_id
    client_id = valid_client_request_id(request.headers.get(REQUEST_ID_HEADER))
    # Every line logged while this request is served carries its ids (and,
    # once known, its tenant and tier).
    structlog.contextvars.clear_contextvars()
    if client_id is None:
        structlog.contextvars.bind_contextvars(request_id=request_id)
    else:
        request[CLIENT_REQUEST_ID] = client_id
        structlog.contextvars.bind_contextvars(request_id=request_id, client_request_id=client_id)
    reason: str | None = None
    try:
        bad_forwarding = request.get(BAD_FORWARDING)
        if bad_forwarding is not None:
            raise MalformedRequest(
                f"Invalid X-Forwarded-For from a trusted proxy: {bad_forwarding}."
            )
        response = await handler(request)
    except GatewayError as exc:
        _count_refusal(request, exc.outcome)
        response = error_response(exc)
        reason = exc.code
        if exc.detail is not None:
            log.warning("%s: %s", exc.code, exc.detail)
        request[OUTCOME] = exc.outcome.value
        if isinstance(exc, RequestTimeout):
            # The rest of the body may still come; read as a next request it
            # would be garbage.
            response.force_close()
    except web.HTTPException as exc:
        if exc.status >= 400:
            _count_refusal(request, Outcome.BAD_REQUEST)
        response, reason = _from_http_exception(request, exc)
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
        response = web.json_response(INTERNAL_ERROR, status=500)
        reason = INTERNAL_ERROR["error"]["code"]
        request[OUTCOME] = Outcome.BACKEND_ERROR.value
    if reason is not None:
        request_refused(
            status=response.status, reason=reason, request_id=request_id,
            client=request.remote, tenant=request.get(TENANT), tier=request.get(TIER),
            client_request_id=client_id,
        )  # fmt: skip
    if not response.prepared:
        response.headers[REQUEST_ID_HEADER] = client_id or request_id
    return response


def _traced(tracing: Tracing) -> Any:
    """The middleware that gives each API request its span (a child of the
    client's `traceparent`), with its phases and attributes once it ends."""

    @web.middleware
    async def traced(request: web.Request, handler: Any) -> web.StreamResponse:
        if not request.path.startswith("/v1/"):
            return await handler(request)
        clock = Clock(asyncio.get_running_loop().time())
        start_ns = time.time_ns()
        resource = request.match_info.route.resource
        name = request.method + (f" {resource.canonical}" if resource is not None else "")
        span = tracing.start(name, request.headers, server=True, start_ns=start_ns)
        request[TRACE_HEADERS] = tracing.headers(span)
        status = 500
        try:
            response = await handler(request)
            status = response.status
            return response
        finally:
            record = request.get(RECORD)
            if isinstance(record, Request):
                outcome = record.outcome.value if record.outcome is not None else "cancelled"
                tracing.describe(
                    span, tenant=record.tenant, tier=record.tier, outcome=outcome, status=status,
                    prompt_tokens=record.prompt_tokens, output_tokens=record.output_tokens,
                )  # fmt: skip
                tracing.phases(span, record, clock, start_ns)
            else:
                outcome = request.get(OUTCOME, "completed" if status < 400 else "bad_request")
                tracing.describe(
                    span, tenant=request.get(TENANT), tier=request.get(TIER), outcome=outcome,
                    status=status,
                )  # fmt: skip
            span.end()

    return traced


def _count_refusal(request: web.Request, outcome: Outcome) -> None:
    """A request refused before it became an ask (`Gateway.admit` counts those
    that did). Only the API's own paths count as requests."""
    if request.get(ADMITTED) or not request.path.startswith("/v1/"):
        return
    gateway = request.app[STATE].gateway
    gateway.refused(
        request.get(TIER, "none"), outcome,
        tenant=request.get(TENANT, "none"), model=request.get(MODEL),
    )  # fmt: skip


def _from_http_exception(
    request: web.Request, exc: web.HTTPException
) -> tuple[web.StreamResponse, str]:
    """The answer to an error aiohttp raised, and its code."""
    if exc.status < 400:
        raise exc
    error: GatewayError | None = None
    headers = None
    if isinstance(exc, web.HTTPNotFound):
        error = RouteNotFound(f"Unknown path: {request.path[:200]}")
    elif isinstance(exc, web.HTTPMethodNotAllowed):
        # 405 must say what is allowed (RFC 9110).
        error = MethodNotAllowed(
            f"Method {request.method[:20]} is not allowed on {request.path[:200]}."
        )
        headers = {"Allow": exc.headers.get("Allow", "")}
    elif isinstance(exc, web.HTTPRequestEntityTooLarge):
        limit = request.app[STATE].policy.server.max_body_bytes
        error = PayloadTooLarge(f"Request body too large: at most {limit} bytes.")
    if error is not None:
        return error_response(error, headers=headers), error.code
    # Anything else aiohttp raises (a malformed body stream, ...): its status, our shape.
    code = exc.reason.lower().replace(" ", "_")
    payload = error_payload(
        exc.reason, "invalid_request_error" if exc.status < 500 else "server_error", code, None
    )
    return web.json_response(payload, status=exc.status), code


# --------------------------------------------------------------------------
# Probes and models


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


async def _models(request: web.Request) -> web.Response:
    state = request.app[STATE]
    identify(request, state)
    return web.json_response(
        {
            "object": "list",
            "data": [
                {
                    "id": name,
                    "object": "model",
                    "created": state.started,
                    "owned_by": "qosgate",
                    "root": state.gateway.backend.model_roots.get(name, name),
                    "parent": None,
                }
                for name in state.gateway.backend.models
            ],
        }
    )


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
