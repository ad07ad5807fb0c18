"""One judgement of whether a request met its tier's objective: the gateway's
metrics (qosgate_slo_attained/missed) and the simulator's report
(slo_attainment) read it from the same place, so they agree on every request."""

from __future__ import annotations

import pytest

from qosgate.config.models import PolicyConfig
from qosgate.core.request import Outcome, Request
from qosgate.observability.metrics import GatewayMetrics
from qosgate.sim.report import met_slo

POLICY = PolicyConfig.model_validate({
    "tiers": {
        "chat": {"priority": 0, "ttft_slo_ms": 500, "max_queue_wait_ms": 250},
        "bulk": {"priority": 1, "e2e_slo_ms": 10_000, "max_queue_wait_ms": 5_000,
                 "on_timeout": "delay"},
        "free": {"priority": 2},
    },
    "tenants": [{"id": "a", "tier": "chat"}, {"id": "b", "tier": "bulk"},
                {"id": "c", "tier": "free"}],
})


def finished(tier: str, *, first: float | None, end: float,
             outcome: Outcome = Outcome.COMPLETED) -> Request:
    request = Request("r", "a", tier, prompt_tokens=10, max_tokens=10, arrival=100.0)
    request.first_token_at = None if first is None else 100.0 + first
    request.finished_at = 100.0 + end
    request.outcome = outcome
    request.output_tokens = 0 if first is None else 5
    return request


CASES = [
    # tier, first token after, end after, outcome, met
    ("chat", 0.5, 3.0, Outcome.COMPLETED, True),   # the boundary itself is met
    ("chat", 0.5000001, 0.6, Outcome.COMPLETED, False),
    ("chat", None, 0.4, Outcome.COMPLETED, True),  # no token: the answer came whole at its end
    ("chat", None, 0.7, Outcome.COMPLETED, False),
    ("chat", 0.1, 0.2, Outcome.BACKEND_ERROR, False),
    ("bulk", 9.0, 10.0, Outcome.COMPLETED, True),
    ("bulk", 0.1, 10.01, Outcome.COMPLETED, False),
    ("free", 30.0, 60.0, Outcome.COMPLETED, None),  # no objective: neither met nor missed
]


@pytest.mark.parametrize("tier, first, end, outcome, met", CASES)
def test_the_core_judges_each_request_once(tier, first, end, outcome, met):
    request = finished(tier, first=first, end=end, outcome=outcome)
    assert request.met_objective(*POLICY.tiers[tier].objectives_s) is met


@pytest.mark.parametrize("tier, first, end, outcome, met",
                         [c for c in CASES if c[3] is Outcome.COMPLETED])
def test_metrics_and_simulator_agree(tier, first, end, outcome, met):
    metrics = GatewayMetrics(POLICY)
    request = finished(tier, first=first, end=end, outcome=outcome)
    metrics.finished(request, None, None)
    attained = metrics.slo_attained.labels(tier=tier, model="none")._value.get()
    missed = metrics.slo_missed.labels(tier=tier, model="none")._value.get()
    if met is None:
        assert (attained, missed) == (0, 0)
        assert met_slo(request, POLICY.tiers[tier])  # the simulator: completing is enough
    else:
        assert (attained, missed) == ((1, 0) if met else (0, 1))
        assert met_slo(request, POLICY.tiers[tier]) is met
