"""OpenTelemetry tracing (`observability.otel`, the `otel` extra).

One span per HTTP request, a child of the client's W3C `traceparent` when it
sends one. Its phases become child spans once the request has ended, from
the request record's own times (arrival, dispatch, first token, end), so the
hot path pays nothing per phase: `admission` (identity, body, counting,
quota, the scheduler's admission), `queue wait`, `backend ttft` and
`streaming`. Attributes are sizes, names and the outcome, never text.

The trace context travels on as plain W3C headers (`GenerationJob.trace`):
the openai backend sends them to its upstream, the fleet's work item carries
them to the engine node, whose span joins the same trace.

Nothing here is imported unless tracing is configured, and a process whose
policy asks for it without the extra installed is told which extra to install.
"""

from __future__ import annotations

import time
from collections.abc import Mapping
from typing import Any

from qosgate.config.models import OtelConfig
from qosgate.core.request import Request

_NS = 1_000_000_000


class TracingUnavailable(RuntimeError):
    """`observability.otel` is set but the `otel` extra is not installed."""


class Clock:
    """Converts the event loop's times (the request record's) to the epoch
    nanoseconds spans take, from one reading of both clocks."""

    __slots__ = ("_loop_at", "_ns_at")

    def __init__(self, loop_now: float) -> None:
        self._loop_at = loop_now
        self._ns_at = time.time_ns()

    def ns(self, loop_time: float) -> int:
        return self._ns_at + int((loop_time - self._loop_at) * _NS)


class Tracing:
    """A tracer over a `TracerProvider` of its own (never the global one, so
    two gateways in one process, or a test, keep their spans apart)."""

    def __init__(self, provider: Any) -> None:
        from opentelemetry import trace
        from opentelemetry.trace.propagation.tracecontext import TraceContextTextMapPropagator

        self._trace = trace
        self._provider = provider
        self._tracer = provider.get_tracer("qosgate")
        self._propagator = TraceContextTextMapPropagator()

    @classmethod
    def from_config(cls, cfg: OtelConfig | None) -> Tracing | None:
        if cfg is None:
            return None
        try:
            from opentelemetry.exporter.otlp.proto.http.trace_exporter import OTLPSpanExporter
            from opentelemetry.sdk.resources import Resource
            from opentelemetry.sdk.trace import TracerProvider
            from opentelemetry.sdk.trace.export import BatchSpanProcessor
            from opentelemetry.sdk.trace.sampling import ParentBasedTraceIdRatio
        except ImportError:
            raise TracingUnavailable(
                "observability.otel needs the otel extra: pip install 'qosgate[otel]'"
            ) from None
        provider = TracerProvider(
            resource=Resource.create({"service.name": cfg.service_name}),
            sampler=ParentBasedTraceIdRatio(cfg.sample_ratio),
        )
        exporter = OTLPSpanExporter(endpoint=cfg.endpoint) if cfg.endpoint else OTLPSpanExporter()
        # Exported from a thread of its own, in batches: never on the event loop.
        provider.add_span_processor(BatchSpanProcessor(exporter))
        return cls(provider)

    def close(self) -> None:
        """Export what is still buffered."""
        self._provider.shutdown()

    # -- spans -----------------------------------------------------------------

    def start(
        self, name: str, parent: Mapping[str, str] | None, *, server: bool,
        start_ns: int | None = None,
    ) -> Any:  # fmt: skip
        """A span, the child of the trace context in `parent` (W3C headers)
        if it holds one; a server span (an HTTP request) or a consumer's (an
        engine node's run of a fleet item)."""
        kinds = self._trace.SpanKind
        context = self._propagator.extract(parent) if parent else None
        return self._tracer.start_span(
            name, context=context, kind=kinds.SERVER if server else kinds.CONSUMER,
            start_time=start_ns,
        )  # fmt: skip

    def headers(self, span: Any) -> dict[str, str]:
        """`span`'s trace context as W3C headers (`traceparent`, ...): what
        goes to the upstream and into fleet items."""
        carrier: dict[str, str] = {}
        self._propagator.inject(carrier, context=self._trace.set_span_in_context(span))
        return carrier

    def phases(self, span: Any, req: Request, clock: Clock, start_ns: int) -> None:
        """The admitted request's phases, as children of `span`, from its
        record's times; a phase it never reached is left out."""
        context = self._trace.set_span_in_context(span)
        marks = [
            ("admission", start_ns),
            ("queue wait", clock.ns(req.arrival)),
            ("backend ttft", _at(clock, req.dispatched_at)),
            ("streaming", _at(clock, req.first_token_at)),
        ]
        end = _at(clock, req.finished_at)
        for index, (name, begun) in enumerate(marks):
            if begun is None:
                break
            following = marks[index + 1][1] if index + 1 < len(marks) else None
            ended = following if following is not None else end
            child = self._tracer.start_span(name, context=context, start_time=begun)
            child.end(end_time=ended if ended is not None else begun)

    @staticmethod
    def describe(
        span: Any, *, tenant: str | None, tier: str | None, outcome: str, status: int,
        prompt_tokens: int | None = None, output_tokens: int | None = None,
    ) -> None:  # fmt: skip
        """The request's attributes: names, sizes and its outcome, never text."""
        attributes: dict[str, Any] = {
            "qosgate.outcome": outcome,
            "http.response.status_code": status,
        }
        for key, value in (
            ("qosgate.tenant", tenant),
            ("qosgate.tier", tier),
            ("gen_ai.usage.input_tokens", prompt_tokens),
            ("gen_ai.usage.output_tokens", output_tokens),
        ):
            if value is not None:
                attributes[key] = value
        span.set_attributes(attributes)
        if status >= 500:
            span.set_status(_error_status())


def _at(clock: Clock, loop_time: float | None) -> int | None:
    return None if loop_time is None else clock.ns(loop_time)


def _error_status() -> Any:
    from opentelemetry.trace import Status, StatusCode

    return Status(StatusCode.ERROR)
