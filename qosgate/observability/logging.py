"""structlog for qosgate: JSON lines in production, console in development.

Context that belongs to a request (its id, tenant, tier) is bound once, in the
HTTP handler, with structlog's contextvars, so every line logged while
serving it carries them. The one line per finished request is written where
the request ends (`request_finished`), from the request record itself, since
a request can end outside its handler's context (expiry, shutdown).
"""

from __future__ import annotations

import logging
import sys
from typing import Any, Literal

import orjson
import structlog

from qosgate.core.request import Request

request_log = structlog.get_logger("qosgate.requests")
audit_log = structlog.get_logger("qosgate.audit")


class _CurrentStderr:
    """Whatever sys.stderr is when a line is written (it may be replaced after
    logging is configured: by a test runner, a daemonizer)."""

    def write(self, data: bytes) -> None:
        sys.stderr.buffer.write(data)

    def flush(self) -> None:
        sys.stderr.flush()


def configure_logging(
    fmt: Literal["auto", "json", "console"] = "auto", level: int = logging.INFO
) -> None:
    """structlog straight to stderr (orjson-rendered lines: the request log is
    on the hot path), and the standard library's logging (qosgate's modules,
    aiohttp, vLLM) through the same renderer. `auto`: console on a terminal,
    JSON otherwise."""
    if fmt == "auto":
        fmt = "console" if sys.stderr.isatty() else "json"
    shared: list[Any] = [
        structlog.contextvars.merge_contextvars,
        structlog.processors.add_log_level,
        # JSON lines take the epoch time: formatting a date on every request
        # line costs more than the rest of the line.
        structlog.processors.TimeStamper(fmt=None if fmt == "json" else "iso", utc=True),
    ]
    if fmt == "json":
        renderer: Any = structlog.processors.JSONRenderer(serializer=orjson.dumps)
        factory: Any = structlog.BytesLoggerFactory(_CurrentStderr())
        text_renderer: Any = structlog.processors.JSONRenderer()
    else:
        renderer = text_renderer = structlog.dev.ConsoleRenderer(colors=sys.stderr.isatty())
        factory = structlog.PrintLoggerFactory(sys.stderr)
    structlog.configure(
        processors=[*shared, renderer],
        logger_factory=factory,
        wrapper_class=structlog.make_filtering_bound_logger(level),
        cache_logger_on_first_use=True,
    )
    handler = logging.StreamHandler(sys.stderr)
    handler.setFormatter(
        structlog.stdlib.ProcessorFormatter(
            processors=[structlog.stdlib.ProcessorFormatter.remove_processors_meta, text_renderer],
            foreign_pre_chain=[*shared, structlog.stdlib.ExtraAdder()],
        )
    )
    root = logging.getLogger()
    root.handlers[:] = [handler]
    root.setLevel(level)


def request_finished(req: Request, usage: tuple[int, int] | None) -> None:
    """The one line per finished request: outcome, waits, TTFT and tokens.
    Never the prompt (the record holds none)."""
    assert req.outcome is not None and req.finished_at is not None
    request_log.info(
        "request",
        request_id=req.id,
        tenant=req.tenant,
        tier=req.tier,
        outcome=req.outcome.value,
        queue_wait_ms=_ms(req.arrival, req.dispatched_at),
        ttft_ms=_ms(req.arrival, req.first_token_at),
        e2e_ms=_ms(req.arrival, req.finished_at),
        prompt_tokens=usage[0] if usage else 0,
        completion_tokens=usage[1] if usage else 0,
        preemptions=req.preemptions,
    )


def request_refused(
    *,
    status: int,
    reason: str,
    request_id: str,
    client: str | None,
    tenant: str | None = None,
    tier: str | None = None,
    client_request_id: str | None = None,
) -> None:
    """The one line per refused request (any error status the gateway
    answers instead of output), so that a tenant's "you refused me" can be
    answered: the status, the reason (the error's code, never its message,
    which can quote the request), the tenant and tier once known, the
    client's address as read through the trusted proxies, and the request's
    ids. Written always, whatever `log_requests` says."""
    audit_log.info(
        "refused",
        status=status,
        reason=reason,
        tenant=tenant,
        tier=tier,
        client=client,
        request_id=request_id,
        client_request_id=client_request_id,
    )


def _ms(start: float | None, end: float | None) -> float | None:
    if start is None or end is None:
        return None
    return round((end - start) * 1000, 3)
