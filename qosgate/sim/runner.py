"""Discrete-event simulation: the live scheduling core against a simulated GPU,
on a virtual clock.

The loop has three kinds of events: an arrival, the end of the engine step in
progress, and the scheduler's own wake-up (batch windows, queue deadlines).
Nothing here knows scheduling policy; it only carries out the core's plans,
exactly as the async runtime does with a real backend.
"""

from __future__ import annotations

import math
import sys
from dataclasses import dataclass, field
from typing import Callable, Sequence

from qosgate.backends.sim import SimEngine
from qosgate.config.models import PolicyConfig, SimBackendConfig
from qosgate.config.scheduling import scheduling_policy
from qosgate.core.request import Outcome, Request
from qosgate.core.scheduler import SchedulePlan, Scheduler
from qosgate.sim.workload import Arrival

_INF = math.inf


@dataclass
class PolicyRun:
    """Everything one policy's run produced."""

    policy: str
    requests: list[Request]
    samples: list[tuple[float, dict[str, int]]]
    """Queue depth per tier at regular instants."""
    end_time: float
    saturated_s_samples: list[tuple[float, float]] = field(default_factory=list)
    """At the instants of `samples`, the engine's saturated seconds so far."""
    steps: int = 0
    engine_busy_s: float = 0.0
    engine_saturated_s: float = 0.0
    """Of engine_busy_s, seconds in saturated steps (`StepResult.saturated`)."""
    engine_preemptions: int = 0
    gateway_preemptions: int = 0
    batch_sizes: list[int] = field(default_factory=list)


def with_policy(policy: PolicyConfig, name: str) -> PolicyConfig:
    """The same policy file with a different scheduler.policy."""
    scheduler = policy.scheduler.model_copy(update={"policy": name})
    return policy.model_copy(update={"scheduler": scheduler})


def _request(arrival: Arrival) -> Request:
    return Request(
        arrival.id, arrival.tenant, arrival.tier, arrival.prompt_tokens, arrival.max_tokens,
        arrival.t, priority_offset=arrival.priority_offset,
    )  # fmt: skip


def run_policy(
    policy: PolicyConfig,
    engine_cfg: SimBackendConfig,
    arrivals: Sequence[Arrival],
    *,
    drain_until: float,
    drain_rate_hint: float | None = None,
    sample_every_s: float = 1.0,
    progress: Callable[[float], None] | None = None,
) -> PolicyRun:
    """Replay `arrivals` through a fresh scheduler and engine.

    The run ends when every request has an outcome, or at `drain_until`, when
    whatever is still queued or running is cancelled (and counted as such).
    """
    engine = SimEngine.from_config(engine_cfg)
    scheduler = Scheduler(scheduling_policy(policy, step_tokens=engine.max_num_batched_tokens,
                                            in_order=engine.scheduling_policy == "fcfs"),
                          drain_rate_hint=drain_rate_hint)
    by_id: dict[str, Request] = {}
    true_output: dict[str, int] = {}
    run = PolicyRun(policy=policy.scheduler.policy, requests=[], samples=[], end_time=0.0)
    n = len(arrivals)
    next_arrival = 0
    step_end = _INF
    step = None
    wakeup = _INF
    now = 0.0
    next_sample = 0.0
    next_progress = 0

    overhead = engine.request_overhead_s
    # Sent back while the step in flight ran: what that step produced for them
    # is nobody's (the live backend drops it the same way).
    sent_back: set[str] = set()

    def up_to(t: float, seconds: float, counts_step: bool) -> float:
        """The engine's `seconds` (step or saturated seconds) up to `t`: a step
        counts whole when it starts, so the part of the one in flight that
        lies past `t` comes off, where it is counted (`counts_step`)."""
        if counts_step and t < step_end < _INF:
            return seconds - (step_end - t)
        return seconds

    def saturated_by(t: float) -> float:
        return up_to(t, engine.saturated_seconds, step is not None and step.saturated)

    def start_step() -> None:
        nonlocal step, step_end
        if engine.has_work():
            step = engine.step()
            run.steps += 1
            step_end = now + step.duration

    def carry_out(plan: SchedulePlan) -> None:
        nonlocal wakeup
        for req in plan.dispatch:
            engine.add(req.id, req.prompt_tokens, true_output[req.id],
                       scheduler.engine_priority(req), ready_at=now + overhead if overhead else None)
        for req in plan.preempt:
            engine.abort(req.id)
            sent_back.add(req.id)
            run.gateway_preemptions += 1
        for _, size, _ in plan.batches:
            if size:
                run.batch_sizes.append(size)
        wakeup = plan.wakeup_at if plan.wakeup_at is not None else _INF

    while True:
        t_arrival = arrivals[next_arrival].t if next_arrival < n else _INF
        t_ready = engine.next_ready_at()
        now = min(t_arrival, step_end, wakeup, _INF if t_ready is None else t_ready)
        if now == _INF or now > drain_until:
            now = min(now, drain_until)
            break
        engine.take_ready(now)
        while next_sample <= now:
            run.samples.append((next_sample, scheduler.depth_by_tier()))
            run.saturated_s_samples.append((next_sample, saturated_by(next_sample)))
            next_sample += sample_every_s

        if now == step_end:
            result = step
            step_end = _INF
            gone, sent_back = sent_back, set()
            # The engine plans its next step before the gateway hears of this
            # one's tokens (vLLM's engine loop does, and the live simulated
            # GPU), so what the scheduler releases in answer waits in the
            # engine's queue for the step after.
            start_step()
            for seq_id in result.first_token:
                if seq_id not in gone:
                    scheduler.on_first_token(seq_id, now)
            for seq_id in result.finished:
                if seq_id not in gone:
                    scheduler.finish(seq_id, now, Outcome.COMPLETED, true_output[seq_id])
            run.engine_preemptions += len(result.preempted)
        elif now == t_arrival:
            # Every arrival at this instant is submitted before one schedule.
            while next_arrival < n and arrivals[next_arrival].t <= now:
                arrival = arrivals[next_arrival]
                next_arrival += 1
                req = by_id[arrival.id] = _request(arrival)
                true_output[req.id] = arrival.output_tokens
                scheduler.submit(req, now)
            if progress is not None and next_arrival >= next_progress:
                progress(next_arrival / n)
                next_progress = next_arrival + max(1, n // 20)
        # A preemption frees room that this same instant can use.
        while True:
            plan = scheduler.schedule(now, engine.capacity())
            carry_out(plan)
            if not plan.preempt:
                break

        if step_end == _INF:
            start_step()
        if next_arrival >= n and scheduler.queued_count == 0 and scheduler.running_count == 0:
            break

    # The step in flight may run past the horizon; only its share before counts.
    run.engine_busy_s = up_to(now, engine.step_seconds, step is not None)
    run.engine_saturated_s = saturated_by(now)
    # The horizon ended the run: whatever is left is cancelled, never lost.
    for req in list(scheduler.running()):
        scheduler.cancel(req.id, now, engine.generated(req.id))
        engine.abort(req.id)
    for req in list(scheduler.queued()):
        scheduler.cancel(req.id, now)
    for arrival in arrivals[next_arrival:]:
        req = by_id[arrival.id] = _request(arrival)
        req.outcome = Outcome.CANCELLED
        req.finished_at = now
    run.samples.append((now, scheduler.depth_by_tier()))
    run.saturated_s_samples.append((now, run.engine_saturated_s))
    run.requests = list(by_id.values())
    run.end_time = now
    return run


def measure_capacity(
    engine_cfg: SimBackendConfig,
    workload: Sequence[Arrival],
) -> tuple[float, float]:
    """Requests/s and tokens/s (prompt + output) the engine sustains when kept
    full with this length mix: the denominator of every `load`.

    The engine is fed the way the dispatcher feeds it (only what it has room
    for), and the rate is read between the 20th and 80th percentile of
    completions so the fill-up and drain transients do not count.
    """
    engine = SimEngine.from_config(engine_cfg)
    overhead = engine.request_overhead_s
    pending = list(reversed(workload))
    sizes = {a.id: a.prompt_tokens + a.output_tokens for a in workload}
    now = 0.0
    finishes: list[tuple[float, int]] = []
    total = len(workload)
    while len(finishes) < total:
        cap = engine.capacity()
        free_slots, free_kv = cap.free_slots, cap.free_kv_tokens
        while pending and free_slots > 0:
            nxt = pending[-1]
            need = min(nxt.prompt_tokens + nxt.output_tokens, cap.kv_capacity_tokens)
            if need > free_kv:
                break
            pending.pop()
            engine.add(nxt.id, nxt.prompt_tokens, nxt.output_tokens, 0,
                       ready_at=now + overhead if overhead else None)
            free_slots -= 1
            free_kv -= need
        engine.take_ready(now)
        if not engine.has_work():
            ready = engine.next_ready_at()
            if ready is None:
                raise RuntimeError("capacity measurement stalled: a request does not fit the engine")
            now = ready
            continue
        result = engine.step()
        now += result.duration
        for seq_id in result.finished:
            finishes.append((now, sizes[seq_id]))
    lo, hi = int(total * 0.2), int(total * 0.8)
    span = finishes[hi][0] - finishes[lo][0]
    tokens = sum(size for _, size in finishes[lo + 1 : hi + 1])
    return (hi - lo) / span, tokens / span


def stderr_progress(label: str) -> Callable[[float], None]:
    def report(fraction: float) -> None:
        print(f"\r  {label}: {fraction:4.0%}", end="" if fraction < 1 else "\n",
              file=sys.stderr, flush=True)

    return report
