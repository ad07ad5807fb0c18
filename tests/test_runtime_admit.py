"""Gateway.admit: one entry from a validated ask to a stream. It clamps
max_tokens and counts the prompt, reserves the tenant's quota, refunds it
when admission refuses, and counts every refusal once, by its outcome."""

from __future__ import annotations

from fake_backend import FakeBackend

import pytest

from qosgate.config.models import PolicyConfig
from qosgate.core.request import Outcome
from qosgate.runtime import Gateway
from qosgate.runtime.ask import Ask
from qosgate.runtime.errors import ContextLengthExceeded, QueueFull, QuotaExceeded


def policy(**quotas: int) -> PolicyConfig:
    return PolicyConfig.model_validate({
        "tiers": {"gold": {"priority": 0, "max_tokens": 100, "default_max_tokens": 40,
                           "max_queue_len": 1}},
        "tenants": [{"id": "t", "tier": "gold", **({"quotas": quotas} if quotas else {})}],
    })  # fmt: skip


def ask(request_id: str, **fields) -> Ask:
    return Ask(request_id=request_id, tenant="t", tier="gold", endpoint="chat",
               body={"model": "fake-model", "messages": [], **fields.pop("body", {})},
               **fields)  # fmt: skip


def refused(gw: Gateway, outcome: Outcome) -> float:
    value = gw.observer.metrics.registry.get_sample_value(
        "qosgate_requests_total",
        {"tier": "gold", "tenant": "t", "outcome": outcome.value, "model": "fake-model"},
    )
    return value or 0.0


async def test_admit_clamps_to_the_tier_and_the_context_and_strips_priority() -> None:
    backend = FakeBackend(slots=4)
    backend.max_model_len = 60  # the prompt counts 1 token: room for 59
    gw = Gateway(policy(), backend)
    await gw.start()
    try:
        default = await gw.admit(ask("a", body={"priority": 3}))
        asked = await gw.admit(ask("b", asked_max_tokens=60, min_tokens=60,
                                   body={"max_completion_tokens": 60, "min_tokens": 60}))
        assert default.job.max_tokens == 40 and default.job.body["max_tokens"] == 40
        assert "priority" not in default.job.body
        # Past the room the prompt leaves: lowered to it, and min_tokens with it.
        assert asked.job.max_tokens == 59
        assert asked.job.body["max_completion_tokens"] == 59
        assert asked.job.body["min_tokens"] == 59
        with pytest.raises(ContextLengthExceeded) as exc:
            await gw.admit(ask("c", asked_max_tokens=61, asked_field="max_completion_tokens"))
        assert exc.value.param == "max_completion_tokens"
        assert refused(gw, Outcome.BAD_REQUEST) == 1
    finally:
        await gw.close()


async def test_a_refused_admission_refunds_the_quota_and_counts_once() -> None:
    backend = FakeBackend(slots=1)
    gw = Gateway(policy(tokens_per_minute=130), backend)
    await gw.start()
    seen = []
    try:
        # Dispatched (its consumer has not started it yet), it holds the slot.
        running = await gw.admit(ask("a"), on_quota=seen.append)
        queued = await gw.admit(ask("b"), on_quota=seen.append)
        # The tier's queue holds one: the third is refused after its quota
        # was reserved, and gets it back.
        with pytest.raises(QueueFull):
            await gw.admit(ask("c"), on_quota=seen.append)
        assert len(seen) == 3
        assert refused(gw, Outcome.REJECTED_QUEUE_FULL) == 1
        usage = {s.kind: s for s in await gw.quotas.usage("t")}
        assert usage["tokens_per_minute"].used == 2 * 41  # prompt 1 + max_tokens 40 each
        # 48 tokens left: a fourth asking 61 is refused by the quota, and counted so.
        with pytest.raises(QuotaExceeded):
            await gw.admit(ask("d", asked_max_tokens=60), on_quota=seen.append)
        assert len(seen) == 4
        assert refused(gw, Outcome.REJECTED_QUOTA) == 1
        assert refused(gw, Outcome.REJECTED_QUEUE_FULL) == 1
        await running.aclose()
        await queued.aclose()
        # Neither ran: both are refunded.
        usage = {s.kind: s for s in await gw.quotas.usage("t")}
        assert usage["tokens_per_minute"].used == 0
    finally:
        await gw.close()
