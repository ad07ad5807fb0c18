"""POST /v1/chat/completions and /v1/completions: identity, body and
validation here, then the runtime's `Gateway.admit`, then the answer, whole
(here) or streamed (streaming.py).
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Sequence
from typing import Any

import orjson
import structlog
from aiohttp import web
from aiohttp.http_exceptions import HttpProcessingError

from qosgate.quotas import LimitState
from qosgate.runtime.ask import Ask
from qosgate.runtime.errors import RequestTimeout
from qosgate.runtime.gate import RequestStream

from .errors import MalformedRequest, UnsupportedMediaType
from .protocol import describe_parse_error
from .ratelimit import ratelimit_headers
from .render import Call, answer_body
from .state import (
    ADMITTED, MODEL, RATELIMIT, RECORD, REQUEST_ID, STATE, TRACE_HEADERS, AppState, identify,
)  # fmt: skip
from .streaming import Pace, stream_response
from .validation import MAX_PRIORITY_OFFSET, Endpoint, parse_json, validate_body

SESSION_HEADER = "X-Session-Id"
_MAX_SESSION_LEN = 256


async def post_chat_completions(request: web.Request) -> web.StreamResponse:
    return await _generate(request, "chat")


async def post_completions(request: web.Request) -> web.StreamResponse:
    return await _generate(request, "completions")


async def read_json(request: web.Request, state: AppState) -> Any:
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
        raise RequestTimeout(f"The request body did not arrive within {timeout_s:g} s.") from None
    except (HttpProcessingError, web.RequestPayloadError) as exc:
        # A broken chunked encoding, a body shorter than its Content-Length, a
        # gzip body that does not inflate: the client's fault, not a bug of ours.
        raise MalformedRequest(f"Malformed request body: {describe_parse_error(exc)}.") from None
    return parse_json(raw)


async def _generate(request: web.Request, endpoint: Endpoint) -> web.StreamResponse:
    state = request.app[STATE]
    # Identity first: an unauthenticated client does not get its body parsed.
    identity = identify(request, state)
    structlog.contextvars.bind_contextvars(tenant=identity.tenant, tier=identity.tier)
    raw = await read_json(request, state)
    request[MODEL] = raw.get("model") if isinstance(raw, dict) else None
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
        asked_field=parsed.asked_field,
        min_tokens=parsed.min_tokens,
        priority_offset=min(parsed.priority or 0, MAX_PRIORITY_OFFSET),
        session=session[:_MAX_SESSION_LEN] if session else None,
        trace=request.get(TRACE_HEADERS),
    )
    # Read before admit awaits the quota store: a reload meanwhile that removed
    # the tier must not fail a stream already admitted.
    tier = state.policy.tiers[identity.tier]
    pace = Pace(tier.min_delivery_bytes_per_s, tier.delivery_window_s)
    request[ADMITTED] = True  # admitted or refused, the gateway counts it from here

    def quota_checked(states: Sequence[LimitState]) -> None:
        request[RATELIMIT] = ratelimit_headers(states)

    # From here on the request is admitted: every path must end it (the
    # response functions close the stream on any way out but completion).
    stream = await gateway.admit(ask, on_quota=quota_checked)
    request[RECORD] = stream.request
    call = Call(
        endpoint=endpoint,
        response_id=("chatcmpl-" if endpoint == "chat" else "cmpl-") + request_id,
        created=int(time.time()),
        model=parsed.model,
        prompt_tokens=stream.request.prompt_tokens,
        include_usage=parsed.include_usage,
    )
    if parsed.stream:
        return await stream_response(request, stream, call, state, pace)
    return await _json_response(stream, call)


async def _json_response(stream: RequestStream, call: Call) -> web.Response:
    body = orjson.dumps(await answer_body(stream, call))
    return web.Response(body=body, content_type="application/json", charset="utf-8")
