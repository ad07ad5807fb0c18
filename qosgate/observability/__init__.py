"""Metrics (Prometheus) and logs (structlog): what the gateway tells operators.

`Observer` is what the gateway calls at each event of a request's life; it
feeds both the metrics and the request log.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable

from prometheus_client import CollectorRegistry

from qosgate.config.models import PolicyConfig
from qosgate.core.request import Outcome, Request

from .logging import configure_logging, request_finished, request_refused
from .metrics import GatewayMetrics
from .otel import Tracing
from .trace import TraceWriter


class Observer:
    def __init__(self, policy: PolicyConfig, registry: CollectorRegistry | None = None) -> None:
        obs = policy.observability
        self.metrics = GatewayMetrics(policy, registry, tenant_labels=obs.metrics_tenant_labels)
        self.log_requests = obs.log_requests
        self.trace = (
            TraceWriter(obs.trace, on_dropped=self.metrics.trace_dropped.inc)
            if obs.trace is not None else None
        )  # fmt: skip
        """The request trace (`observability.trace`), None when off."""
        self.tracing = Tracing.from_config(obs.otel)
        """OpenTelemetry tracing (`observability.otel`), None when off."""

    def start(self, clock: Callable[[], float]) -> None:
        """The gateway starts: the trace's times count from now, on `clock`."""
        if self.trace is not None:
            self.trace.start(clock)

    def close(self) -> None:
        """The gateway has ended every request: what the trace holds is written."""
        if self.trace is not None:
            self.trace.flush()
        if self.tracing is not None:
            self.tracing.close()

    # `model`: the name the request's client wrote (None: not read yet); the
    # metrics bound it (`GatewayMetrics.model_label`).

    def refused(
        self,
        tier: str,
        outcome: Outcome,
        request: Request | None = None,
        tenant: str = "none",
        model: object = None,
    ) -> None:
        """A request refused before it was queued; `request` when it was far
        enough to have a tenant and counted lengths (it goes into the trace);
        `tenant` otherwise, once known."""
        tenant = request.tenant if request is not None else tenant
        self.metrics.refused(tier, outcome, tenant, model)
        if request is not None:
            self._trace(request, outcome, None)

    def dispatched(self, req: Request, now: float, model: object) -> None:
        self.metrics.dispatched(req, now, model)

    def released(self, batches: Iterable[tuple[str, int, float]]) -> None:
        self.metrics.released(batches)

    def first_token(self, req: Request, now: float, model: object) -> None:
        self.metrics.first_token(req, now, model)

    def finished(self, req: Request, usage: tuple[int, int] | None, model: object) -> None:
        """An admitted request ended."""
        assert req.outcome is not None
        self.metrics.finished(req, usage, model)
        self._trace(req, req.outcome, usage)
        if self.log_requests:
            try:
                request_finished(req, usage)
            except Exception:  # noqa: BLE001 - a log that cannot be written must not fail the request
                pass

    def _trace(self, req: Request, outcome: Outcome, usage: tuple[int, int] | None) -> None:
        if self.trace is None:
            return
        # The backend's own counts where it reported them (what really ran).
        prompt, output = usage if usage is not None else (req.prompt_tokens, req.output_tokens)
        self.trace.record(
            arrival=req.arrival, tenant=req.tenant, tier=req.tier, prompt_tokens=prompt,
            max_tokens=req.max_tokens, output_tokens=output, outcome=outcome.value,
        )  # fmt: skip


__all__ = [
    "GatewayMetrics", "Observer", "configure_logging", "request_finished", "request_refused",
]  # fmt: skip
