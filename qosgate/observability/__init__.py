"""Metrics (Prometheus) and logs (structlog): what the gateway tells operators.

`Observer` is what the gateway calls at each event of a request's life; it
feeds both the metrics and the request log.
"""

from __future__ import annotations

from collections.abc import Iterable

from prometheus_client import CollectorRegistry

from qosgate.config.models import PolicyConfig
from qosgate.core.request import Outcome, Request

from .logging import configure_logging, request_finished
from .metrics import GatewayMetrics


class Observer:
    def __init__(self, policy: PolicyConfig, registry: CollectorRegistry | None = None) -> None:
        obs = policy.observability
        self.metrics = GatewayMetrics(policy, registry, tenant_labels=obs.metrics_tenant_labels)
        self.log_requests = obs.log_requests

    def refused(self, tier: str, outcome: Outcome) -> None:
        self.metrics.refused(tier, outcome)

    def dispatched(self, req: Request, now: float) -> None:
        self.metrics.dispatched(req, now)

    def released(self, batches: Iterable[tuple[str, int, float]]) -> None:
        self.metrics.released(batches)

    def first_token(self, req: Request, now: float) -> None:
        self.metrics.first_token(req, now)

    def finished(self, req: Request, usage: tuple[int, int] | None) -> None:
        self.metrics.finished(req, usage)
        if self.log_requests:
            try:
                request_finished(req, usage)
            except Exception:  # noqa: BLE001 - a log that cannot be written must not fail the request
                pass


__all__ = ["GatewayMetrics", "Observer", "configure_logging", "request_finished"]
