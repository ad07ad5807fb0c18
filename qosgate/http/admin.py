"""The operators' endpoints: /metrics, /dashboard, and /admin/stats,
/admin/quotas and /admin/reload behind the admin token.
"""

from __future__ import annotations

import asyncio
import functools
import hashlib
import hmac
import importlib.resources
import time
from typing import Any

import orjson
from aiohttp import web
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest

from qosgate.observability.metrics import stats_view
from qosgate.runtime.errors import Unauthorized
from qosgate.runtime.gate import Gateway

from .errors import RouteNotFound
from .state import STATE, AppState, authenticated


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


async def get_metrics(request: web.Request) -> web.Response:
    state = request.app[STATE]
    token = state.metrics_token
    if token is not None:
        authenticated(request, lambda: _check_bearer(
            request, token, "/metrics needs the metrics token as a Bearer token."
        ), state)  # fmt: skip
    gateway = state.gateway
    metrics = gateway.observer.metrics
    metrics.fleet_levels = await _fleet_levels(gateway)
    registry = metrics.registry
    response = web.Response(body=generate_latest(registry))
    response.content_type = CONTENT_TYPE_LATEST.split(";")[0]
    return response


def _check_admin(request: web.Request) -> None:
    authenticated(request, lambda: _check_admin_token(request), request.app[STATE])


def _check_admin_token(request: web.Request) -> None:
    token = request.app[STATE].admin_token
    if token is None:
        raise RouteNotFound(
            "The admin endpoints are disabled: set the variable named by "
            "server.admin_token_env to a token to enable them."
        )
    _check_bearer(request, token, "The admin endpoints need the admin token as a Bearer token.")


def _check_bearer(request: web.Request, token: str, refusal: str) -> None:
    given = request.headers.get("Authorization", "")
    scheme, _, value = given.partition(" ")
    # Digests of equal length are compared, so not even the token's length
    # shows in the time a wrong guess takes.
    if scheme.lower() != "bearer" or not hmac.compare_digest(
        hashlib.sha256(value.strip().encode("utf-8", "surrogateescape")).digest(),
        hashlib.sha256(token.encode()).digest(),
    ):
        raise Unauthorized(refusal)


async def admin_reload(request: web.Request) -> web.Response:
    _check_admin(request)
    return web.json_response(request.app[STATE].live.reload())


async def admin_stats(request: web.Request) -> web.Response:
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
            "batch_jobs": _batch_jobs(state),
        },
    )


def _batch_jobs(state: AppState) -> dict[str, Any] | None:
    if state.batches is None:
        return None
    jobs, queued = state.batches.levels()
    return {"jobs": jobs, "queued": queued}


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


async def admin_quotas(request: web.Request) -> web.Response:
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


def _json_text(value: Any) -> str:
    return orjson.dumps(value).decode()


@functools.cache
def _dashboard() -> bytes:
    return importlib.resources.files("qosgate.http").joinpath("static/dashboard.html").read_bytes()


async def dashboard_page(request: web.Request) -> web.Response:
    """The live page. It carries no data: the browser reads /admin/stats with
    the admin token, given once as `/dashboard#token=...` (a fragment never
    reaches a server or its logs) or typed into the page."""
    return web.Response(
        body=_dashboard(),
        content_type="text/html",
        charset="utf-8",
        headers={"Cache-Control": "no-cache", "Content-Security-Policy": "default-src 'self'; "
                 "script-src 'unsafe-inline'; style-src 'unsafe-inline'"},
    )
