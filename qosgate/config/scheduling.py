"""The scheduling core's parameters, read from a policy file."""

from __future__ import annotations

from qosgate.config.models import PolicyConfig, TierConfig
from qosgate.core.policy import SchedulingPolicy, TierParams


def _tier(name: str, tier: TierConfig) -> TierParams:
    return TierParams(
        name,
        priority=tier.priority,
        budget_s=tier.budget_s,
        delays=tier.delays,
        max_len=tier.max_queue_len,
        max_wait_s=tier.batch.max_wait_ms / 1000.0,
        max_batch_size=tier.batch.max_batch_size,
        max_batch_tokens=tier.batch.max_batch_tokens,
        preemptible=tier.preemptible,
        min_share=tier.share,
        deadline_s=None if tier.expiry_ms is None else tier.expiry_ms / 1000.0,
    )


def scheduling_policy(policy: PolicyConfig) -> SchedulingPolicy:
    sched = policy.scheduler
    return SchedulingPolicy(
        kind=sched.policy,
        tiers={name: _tier(name, tier) for name, tier in policy.tiers.items()},
        weights={t.id: t.weight for t in policy.tenants},
        fairness=sched.fairness,
        interval_s=sched.aging.interval_ms / 1000.0,
        max_boost=sched.aging.max_boost,
        admission_on=sched.admission,
        preemption_on=sched.preemption,
        reserve_slots=sched.reserve.slots,
        reserve_kv_tokens=sched.reserve.kv_tokens,
        w_in=sched.vtc.w_in,
        w_out=sched.vtc.w_out,
        drain_rate_tau_s=sched.drain_rate_tau_s,
        initial_drain_rate=sched.initial_drain_rate,
        prefill_budget_tokens=sched.prefill_budget_tokens,
    )
