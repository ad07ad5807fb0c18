"""The scheduling core's parameters, read from a policy file."""

from __future__ import annotations

from typing import Literal

from qosgate.config.models import PolicyConfig, SimBackendConfig, TierConfig, VllmBackendConfig
from qosgate.core.policy import SchedulingPolicy, TierParams

PREFILL_BUDGET_STEPS = 4
"""An automatic prefill budget, in the engine's steps. A prompt counts until
its first token is heard, and what is released then reaches the engine a
step later at best (an engine plans its next step before its first tokens
are heard; a remote one adds its HTTP hop), so about half of it is in
transit or already prefilled: a top-level prompt waits behind some two
steps of earlier prompts, and the engine always has a step's prefill
waiting. Two steps in all left it idling through that gap: on B3's mix
through HTTP, 0.94x fcfs's tokens/s at 1x."""

PREFILL_BUDGET_STEPS_IN_ORDER = 1
"""The same in front of an engine that may take its queue in arrival order
(Backend.arrival_order_queue: an upstream server, whose vLLM schedules first
come first served by default), where a top-level prompt waits behind every
prompt sent before it, not only behind those already in prefill: one step
of them. In front of a 128-sequence vLLM server on 2 CPU cores at 2x its
capacity (B8 upstream), interactive's TTFT attainment was 0.87 with one
step, 0.68 with two and 0.54 with none; on the simulated H100 taking its
queue in arrival order, one step costs 7% of fcfs's tokens/s at 1x and 2%
at 4x (docs/SCHEDULING.md, "Capacity")."""


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


def backend_step_tokens(policy: PolicyConfig) -> int | None:
    """Tokens the backend's engine takes per step, where the policy says (the
    sim's, or vllm's engine_args.max_num_batched_tokens; None: an engine
    default qosgate does not know, or an upstream server)."""
    backend = policy.backend
    if isinstance(backend, SimBackendConfig):
        return backend.step_tokens
    if isinstance(backend, VllmBackendConfig):
        return backend.engine_count("max_num_batched_tokens")
    return None


def backend_in_order(policy: PolicyConfig) -> bool:
    """Whether the policy's backend may take its engine's queue in arrival
    order (Backend.arrival_order_queue, as the running backend says it): an
    upstream server, or an engine with `scheduling_policy: fcfs`."""
    backend = policy.backend
    if isinstance(backend, SimBackendConfig):
        return backend.scheduling_policy == "fcfs"
    if isinstance(backend, VllmBackendConfig):
        return backend.engine_args.get("scheduling_policy", "priority") != "priority"
    return True


def prefill_budget(
    setting: int | Literal["auto"] | None, step_tokens: int | None, *, in_order: bool = False
) -> int | None:
    """A prefill budget setting (prefill_budget_tokens, delay_prefill_tokens)
    in tokens, `auto` resolved against an engine that takes `step_tokens` per
    step (None: unknown, so no budget): four of its steps, or one where it may
    take its queue in arrival order (`in_order`)."""
    if setting != "auto":
        return setting
    steps = PREFILL_BUDGET_STEPS_IN_ORDER if in_order else PREFILL_BUDGET_STEPS
    return steps * step_tokens if step_tokens else None


def scheduling_policy(
    policy: PolicyConfig, *, step_tokens: int | None = None, prefill_limits: bool = True,
    in_order: bool = False,
) -> SchedulingPolicy:
    """The core's parameters. `step_tokens`: the tokens per step of the
    engine the scheduler releases into (Backend.step_tokens; the simulator's
    engine), which an automatic prefill budget is counted in; None: unknown,
    so `auto` sets none. `in_order`: that engine may take its own queue in
    arrival order (Backend.arrival_order_queue), so `auto` is one step, not
    four. Without `prefill_limits` (Backend.releases_prefill False) neither
    the prefill budget nor the pace is set, whatever the policy says: they
    act where work enters the engine."""
    sched = policy.scheduler
    if not prefill_limits:
        step_tokens = None
        sched = sched.model_copy(update={"prefill_budget_tokens": None,
                                         "delay_prefill_tokens": None})  # fmt: skip
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
        reserve_arrivals=sched.reserve.arrivals,
        w_in=sched.vtc.w_in,
        w_out=sched.vtc.w_out,
        drain_rate_tau_s=sched.drain_rate_tau_s,
        initial_drain_rate=sched.initial_drain_rate,
        prefill_budget_tokens=prefill_budget(sched.prefill_budget_tokens, step_tokens,
                                             in_order=in_order),
        delay_prefill_tokens=prefill_budget(sched.delay_prefill_tokens, step_tokens,
                                            in_order=in_order),
    )
