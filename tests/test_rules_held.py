"""Scheduling rules of docs/SCHEDULING.md that a mutation run found untested,
each pinned through the Scheduler's public calls (submit, schedule, finish,
on_first_token, snapshot, level) with explicit `now` values: reserved slots,
the preemption rules, the ageing cap, and the batch window's token count."""

from __future__ import annotations

import itertools

import pytest

from qosgate.config.models import PolicyConfig
from qosgate.core.request import Outcome, Request, RequestState
from qosgate.core.scheduler import BackendCapacity, Scheduler

from core_driver import Harness

FULL = BackendCapacity(free_slots=0, free_kv_tokens=0, kv_capacity_tokens=10**9)
ROOMY = BackendCapacity(free_slots=1000, free_kv_tokens=10**9, kv_capacity_tokens=10**9)

_ids = itertools.count()


def slots(n: int) -> BackendCapacity:
    return BackendCapacity(free_slots=n, free_kv_tokens=10**9, kv_capacity_tokens=10**9)


def three_tiers(scheduler: dict | None = None, batch: dict | None = None) -> PolicyConfig:
    """interactive (0), standard (1), batch (2, delay, preemptible), one
    tenant each; long budgets so nothing expires unless a test means it to."""
    return PolicyConfig.model_validate({
        "tiers": {
            "interactive": {"priority": 0, "max_queue_wait_ms": 60_000},
            "standard": {"priority": 1, "max_queue_wait_ms": 60_000},
            "batch": {"priority": 2, "max_queue_wait_ms": 10_000, "on_timeout": "delay",
                      "preemptible": True, **(batch or {})},
        },
        "tenants": [{"id": "i", "tier": "interactive"}, {"id": "s", "tier": "standard"},
                    {"id": "b", "tier": "batch"}],
        "scheduler": {"aging": {"interval_ms": 1000, "max_boost": 2}, **(scheduler or {})},
    })  # fmt: skip


def scheduler(policy: PolicyConfig) -> Scheduler:
    """A Scheduler over `policy` built as the core's harness builds one, with
    a drain rate that admits everything these tests send."""
    return Harness(policy, drain_rate_hint=10**6).scheduler


def req(tier: str, at: float, *, tenant: str | None = None, prompt: int = 100,
        max_tokens: int = 100) -> Request:  # fmt: skip
    return Request(f"h{next(_ids)}", tenant or tier[0], tier, prompt, max_tokens, at)


# -- 1. reserved slots -------------------------------------------------------


def test_reserved_slots_are_left_free_for_top_level_work():
    sched = scheduler(three_tiers({"reserve": {"slots": 1}}))
    standard = [req("standard", 0.0) for _ in range(3)]
    for r in standard:
        sched.submit(r, 0.0)
    # Three free slots: standard work may take two, the last is held back.
    plan = sched.schedule(0.0, slots(3))
    assert plan.dispatch == standard[:2]
    assert sched.schedule(0.0, slots(1)).dispatch == []
    # Top-level work takes the held slot at once.
    urgent = req("interactive", 0.1)
    sched.submit(urgent, 0.1)
    assert sched.schedule(0.1, slots(1)).dispatch == [urgent]


def test_without_a_reserve_lower_work_takes_every_slot():
    # The control for the test above: the same traffic with no reserve.
    sched = scheduler(three_tiers())
    standard = [req("standard", 0.0) for _ in range(3)]
    for r in standard:
        sched.submit(r, 0.0)
    assert sched.schedule(0.0, slots(3)).dispatch == standard


# -- 2. never preempt a request that has streamed -------------------------------


def batch_running() -> tuple[Scheduler, Request]:
    """A scheduler that preempts, with one batch request on the backend (its
    only slot) since 0 s."""
    sched = scheduler(three_tiers({"preemption": True}))
    running = req("batch", 0.0)
    sched.submit(running, 0.0)
    assert sched.schedule(0.0, slots(1)).dispatch == [running]
    return sched, running


def _batch_running_then_urgent(streamed: bool) -> tuple[Scheduler, Request, Request]:
    sched, running = batch_running()
    if streamed:
        sched.on_first_token(running.id, 0.2)
    # Created when it arrives: its budget (60 s) is far from spent, so the
    # round below does try to preempt for it.
    urgent = req("interactive", 0.5)
    assert sched.submit(urgent, 0.5).admitted
    return sched, running, urgent


def test_a_run_without_output_is_preempted_for_urgent_work():
    sched, running, urgent = _batch_running_then_urgent(streamed=False)
    plan = sched.schedule(0.5, FULL)
    assert plan.preempt == [running] and not plan.expired
    assert running.state is RequestState.QUEUED


def test_a_run_that_has_streamed_output_is_never_preempted():
    sched, running, urgent = _batch_running_then_urgent(streamed=True)
    plan = sched.schedule(0.5, FULL)
    # Preemption was tried (the urgent request waits, unexpired) and refused.
    assert not plan.expired and urgent.state is RequestState.QUEUED
    assert not plan.preempt
    assert running.state is RequestState.RUNNING and running.preemptions == 0


# -- 3. the preemption cap and the requeue at the front of age order ---------------


def test_a_request_preempted_twice_is_never_chosen_again():
    sched, victim = batch_running()
    for round_ in range(1, 3):
        t = float(round_)
        urgent = req("interactive", t)
        sched.submit(urgent, t)
        assert sched.schedule(t, FULL).preempt == [victim]
        assert victim.preemptions == round_
        # The urgent one runs and ends; the victim goes back on the backend.
        assert sched.schedule(t, slots(1)).dispatch == [urgent]
        sched.finish(urgent.id, t, Outcome.COMPLETED, 10)
        assert sched.schedule(t, slots(1)).dispatch == [victim]
    urgent = req("interactive", 3.0)
    sched.submit(urgent, 3.0)
    plan = sched.schedule(3.0, FULL)
    assert not plan.preempt and not plan.expired
    assert victim.state is RequestState.RUNNING and victim.preemptions == 2


def test_a_preempted_request_goes_back_to_the_front_of_its_tiers_age_order():
    sched, first = batch_running()
    later = req("batch", 5.0)
    sched.submit(later, 5.0)
    urgent = req("interactive", 6.0)
    sched.submit(urgent, 6.0)
    assert sched.schedule(6.0, FULL).preempt == [first]
    # The tier's oldest is the preempted request (arrived at 0), not the one
    # that arrived at 5 s: its wait drives the tier's ageing.
    batch = sched.snapshot(6.0)["tiers"]["batch"]
    assert batch["queued"] == 2 and batch["oldest_wait_s"] == pytest.approx(6.0)
    # It goes back on the backend before the later one.
    assert sched.schedule(6.0, slots(1)).dispatch == [urgent]
    sched.finish(urgent.id, 6.5, Outcome.COMPLETED, 10)
    assert sched.schedule(6.5, slots(1)).dispatch == [first]


# -- 4. the ageing cap ------------------------------------------------------------


def test_ageing_stops_at_max_boost_levels_however_long_the_wait():
    # Batch at priority 3 with max_boost 1: a long wait would earn three
    # levels, and its age floor (below interactive, which refuses late work)
    # would allow two, but the cap gives one, so it competes at level 2 for
    # ever.
    policy = PolicyConfig.model_validate({
        "tiers": {
            "interactive": {"priority": 0, "max_queue_wait_ms": 60_000},
            "standard": {"priority": 1, "max_queue_wait_ms": 60_000, "on_timeout": "delay"},
            "batch": {"priority": 3, "max_queue_wait_ms": 1000, "on_timeout": "delay"},
        },
        "tenants": [{"id": "s", "tier": "standard"}, {"id": "b", "tier": "batch"}],
        "scheduler": {"aging": {"interval_ms": 1000, "max_boost": 1}},
    })  # fmt: skip
    sched = scheduler(policy)
    old = req("batch", 0.0)
    sched.submit(old, 0.0)
    batch = sched.queue("batch")
    assert sched.level(batch, 1.9) == 3
    assert sched.level(batch, 2.0) == 2
    assert sched.level(batch, 100.0) == 2
    assert sched.snapshot(100.0)["tiers"]["batch"]["level"] == 2
    # So fresh standard work (level 1) still goes before it.
    fresh = req("standard", 100.0)
    sched.submit(fresh, 100.0)
    assert sched.schedule(100.0, slots(1)).dispatch == [fresh]


# -- 6. the batch window's token count -------------------------------------------------


def windowed(size: int = 100, tokens: int = 250) -> PolicyConfig:
    return PolicyConfig.model_validate({
        "tiers": {"standard": {"priority": 0, "max_queue_wait_ms": 60_000,
                               "batch": {"max_wait_ms": 50, "max_batch_size": size,
                                         "max_batch_tokens": tokens}}},
        "tenants": [{"id": "s", "tier": "standard"}],
    })  # fmt: skip


def test_released_prompts_no_longer_count_toward_the_next_window():
    sched = scheduler(windowed())
    full = [req("standard", 0.0) for _ in range(3)]
    for r in full:
        sched.submit(r, 0.0)
    # 300 prompt tokens >= 250: the window opens at once.
    assert sched.schedule(0.0, ROOMY).dispatch == full
    # One request of 100 prompt tokens waits for its window (50 ms).
    alone = req("standard", 1.0)
    sched.submit(alone, 1.0)
    plan = sched.schedule(1.0, ROOMY)
    assert plan.dispatch == [] and plan.wakeup_at == pytest.approx(1.05)
    assert sched.schedule(1.05, ROOMY).dispatch == [alone]


def test_prompts_that_left_the_queue_out_of_turn_no_longer_count_either():
    sched = scheduler(windowed())
    gone = [req("standard", 0.0) for _ in range(2)]
    for r in gone:
        sched.submit(r, 0.0)
        sched.cancel(r.id, 0.0)
    alone = req("standard", 0.0)
    sched.submit(alone, 0.0)
    plan = sched.schedule(0.0, ROOMY)
    assert plan.dispatch == [] and plan.wakeup_at == pytest.approx(0.05)


def test_an_open_batch_stops_once_its_tokens_are_spent():
    sched = scheduler(windowed())
    queued = [req("standard", 0.0) for _ in range(5)]
    for r in queued:
        sched.submit(r, 0.0)
    # 500 prompt tokens open the window; the batch (250 tokens, checked
    # before each release) takes three; the two left (200 tokens) wait.
    plan = sched.schedule(0.0, ROOMY)
    assert plan.dispatch == queued[:3]
    assert plan.batches == [("standard", 3, 0.0)]
    assert plan.wakeup_at == pytest.approx(0.05)
