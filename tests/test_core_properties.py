"""Property-based tests of the core's invariants over random traffic.

Each example drives the real Scheduler against a slot backend on a virtual
clock (tests/core_driver.py): random arrivals, cancellations, backend
failures, expiries, preemptions. No event loop, no sleeps.
"""

from __future__ import annotations

from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from qosgate.config.models import PolicyConfig
from qosgate.config.scheduling import scheduling_policy
from qosgate.core.request import Outcome, Request, RequestState
from qosgate.core.scheduler import BackendCapacity, Scheduler

from core_driver import Harness

SETTINGS = settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])

TIERS = ["interactive", "standard", "batch"]


def make_policy(kind: str, fairness: str, preemption: bool, window_ms: float,
                prefill_budget: int | str | None = None) -> PolicyConfig:
    return PolicyConfig.model_validate({
        "tiers": {
            "interactive": {"priority": 0, "max_queue_wait_ms": 400, "max_queue_len": 8,
                            "batch": {"max_wait_ms": window_ms, "max_batch_size": 3}},
            "standard": {"priority": 1, "max_queue_wait_ms": 1500},
            "batch": {"priority": 2, "max_queue_wait_ms": 2000, "on_timeout": "delay",
                      "preemptible": True},
        },
        "tenants": [{"id": f"t{i}", "tier": TIERS[i % 3], "weight": 1 + i % 2} for i in range(6)],
        "scheduler": {"policy": kind, "fairness": fairness, "preemption": preemption,
                      "aging": {"interval_ms": 500, "max_boost": 2},
                      "prefill_budget_tokens": prefill_budget},
    })


op = st.one_of(
    st.tuples(st.just("arrive"), st.integers(0, 5), st.integers(1, 400), st.integers(1, 300),
              st.floats(0.0, 0.3)),
    st.tuples(st.just("cancel"), st.integers(0, 10**6)),
    st.tuples(st.just("fail"), st.integers(0, 10**6)),
    st.tuples(st.just("advance"), st.floats(0.0, 2.0)),
)


@SETTINGS
@given(
    kind=st.sampled_from(["qos", "strict", "fcfs"]),
    fairness=st.sampled_from(["vtc", "fifo"]),
    preemption=st.booleans(),
    window_ms=st.sampled_from([0.0, 20.0]),
    slots=st.integers(1, 4),
    # auto: four of the 256-token steps, or one where the engine takes its
    # queue in arrival order.
    prefill_budget=st.sampled_from([None, 300, "auto"]),
    in_order=st.booleans(),
    ops=st.lists(op, min_size=1, max_size=120),
)
def test_every_request_ends_once_nothing_lost_capacity_held(kind, fairness, preemption,
                                                             window_ms, slots, prefill_budget,
                                                             in_order, ops):
    h = Harness(make_policy(kind, fairness, preemption, window_ms, prefill_budget), slots=slots,
                service=lambda r: 0.05 + r.prompt_tokens / 1000.0,
                output_tokens=lambda r: max(1, r.max_tokens // 2), drain_rate_hint=2000.0,
                step_tokens=256, in_order=in_order)
    seen_outcome: dict[str, Outcome] = {}
    counter = 0

    def check() -> None:
        sched = h.scheduler
        for r in h.all_requests:
            if r.outcome is not None:
                # An outcome, once given, never changes.
                assert seen_outcome.setdefault(r.id, r.outcome) is r.outcome
                assert r.state is RequestState.FINISHED
            else:
                assert r.state in (RequestState.QUEUED, RequestState.RUNNING)
        # Every request is in exactly one place.
        queued = {r.id for r in sched.queued()}
        running = {r.id for r in sched.running()}
        finished = {r.id for r in h.all_requests if r.outcome is not None}
        assert not (queued & running) and not (queued & finished) and not (running & finished)
        assert queued | running | finished == {r.id for r in h.all_requests}
        assert running == set(h.backend.running)
        assert len(running) <= slots
        # The prefill count is what runs with no first token yet.
        assert sched.prefilling_tokens == sum(
            r.prompt_tokens for r in sched.running() if r.first_token_at is None)
        # Queue totals match their contents.
        for queue in {id(q): q for q in sched.queues}.values():
            members = [r for r in sched.queued() if sched.queue(r.tier) is queue]
            assert len(queue) == len(members)
            assert queue.work == sum(r.work for r in members)

    for item in ops:
        kind_of = item[0]
        if kind_of == "arrive":
            _, tenant, prompt, max_tokens, dt = item
            h.advance(h.now + dt)
            counter += 1
            tier = TIERS[tenant % 3]
            h.submit(Request(f"q{counter}", f"t{tenant}", tier, prompt, max_tokens, h.now))
        elif kind_of == "cancel" and h.all_requests:
            target = h.all_requests[item[1] % len(h.all_requests)]
            _, was_running = h.scheduler.cancel(target.id, h.now, output_tokens=1)
            if was_running:
                h.backend.stop(target.id)
            h.schedule()
        elif kind_of == "fail":
            running = sorted(h.backend.running)
            if running:
                victim = running[item[1] % len(running)]
                h.backend.stop(victim)
                h.scheduler.finish(victim, h.now, Outcome.BACKEND_ERROR, 0)
                h.schedule()
        elif kind_of == "advance":
            h.advance(h.now + item[1])
        check()

    h.drain()
    check()
    assert all(r.outcome is not None for r in h.all_requests)


@SETTINGS
@given(
    flood=st.lists(st.tuples(st.integers(1, 400), st.integers(1, 300)), min_size=1, max_size=40),
    batch=st.lists(st.tuples(st.integers(1, 400), st.integers(1, 300)), min_size=1, max_size=12),
    share=st.sampled_from([0.02, 0.05, 0.2, 0.5]),
    fairness=st.sampled_from(["vtc", "fifo"]),
)
def test_a_delay_tier_gets_its_share_under_a_flood(flood, batch, share, fairness):
    """The share bound (docs/SCHEDULING.md): under a flood of more important
    work without a latency objective that never lets up, a delay tier with
    `min_share` s is released its oldest request before more than W / s
    tokens of other work went out since it was last released or had work
    queued, W that request's own work, plus one request of the others (the
    one that crossed the line); so of all tokens released while it has work
    queued, it gets at least s of them, less one request of its own and one
    of the others."""
    policy = PolicyConfig.model_validate({
        "tiers": {
            # A flood that could wait: a share divides what latency tiers leave.
            "bulk": {"priority": 0, "max_queue_wait_ms": 10**7, "on_timeout": "delay",
                     "min_share": 0},
            "batch": {"priority": 2, "max_queue_wait_ms": 1000, "on_timeout": "delay",
                      "min_share": share},
        },
        "tenants": [{"id": "i", "tier": "bulk"}, {"id": "b", "tier": "batch"}],
        "scheduler": {"fairness": fairness},
    })
    sched = Scheduler(scheduling_policy(policy), drain_rate_hint=1e12)  # admit the whole flood
    queued = [Request(f"b{k}", "b", "batch", p, m, 0.0) for k, (p, m) in enumerate(batch)]
    for r in queued:
        assert sched.submit(r, 0.0).admitted
    largest = max(r.work for r in queued)
    others = total = mine = other_largest = 0
    k = 0
    while queued:
        k += 1
        prompt, max_tokens = flood[k % len(flood)]
        now = k * 0.001
        sched.submit(Request(f"i{k}", "i", "bulk", prompt, max_tokens, now), now)
        [released] = sched.schedule(now, BackendCapacity(1, 10**12, 10**12)).dispatch
        sched.finish(released.id, now, Outcome.COMPLETED, 1)
        total += released.work
        if released.tier == "batch":
            assert released is queued[0]
            assert others <= released.work / share + other_largest + 1e-6, (others, share)
            queued.pop(0)
            mine += released.work
            others = 0
        else:
            others += released.work
            other_largest = max(other_largest, released.work)
        assert mine >= share * total - largest - other_largest - 1e-6, (mine, total, share)


@SETTINGS
@given(
    flood=st.lists(st.tuples(st.integers(1, 400), st.integers(1, 300)), min_size=1, max_size=40),
    batch=st.lists(st.tuples(st.integers(1, 400), st.integers(1, 300)), min_size=1, max_size=12),
    share=st.sampled_from([0.02, 0.05, 0.2, 0.5]),
    max_boost=st.integers(0, 3),
    policy_kind=st.sampled_from(["qos", "strict"]),
)
def test_no_share_or_ageing_passes_queued_latency_work(flood, batch, share, max_boost,
                                                        policy_kind):
    """Lowest tier first: while a tier with a latency objective has work
    queued, a delay tier is never released ahead of it, whatever its age; the
    latency tier is served exactly as if the delay tier had no work. (Its
    releases earn the delay tier no share, so the share is never owed here:
    test_core_scheduler's test_an_owed_share_waits_while_latency_work_is_queued
    holds an owed one.)"""
    tiers = {
        "interactive": {"priority": 0, "max_queue_wait_ms": 500},
        "batch": {"priority": 2, "max_queue_wait_ms": 10, "on_timeout": "delay",
                  "min_share": share, "expire_after_ms": 10**7},
    }
    policy = PolicyConfig.model_validate({
        "tiers": tiers,
        "tenants": [{"id": "i", "tier": "interactive"}, {"id": "b", "tier": "batch"}],
        "scheduler": {"policy": policy_kind,
                      "aging": {"interval_ms": 10, "max_boost": max_boost}},
    })
    sched = Scheduler(scheduling_policy(policy), drain_rate_hint=1e12)
    for k, (p, m) in enumerate(batch):
        assert sched.submit(Request(f"b{k}", "b", "batch", p, m, 0.0), 0.0).admitted
    for k in range(1, 4 * len(flood)):
        prompt, max_tokens = flood[k % len(flood)]
        now = k * 0.05  # batch is long past its budget: it has aged all it may
        sched.submit(Request(f"i{k}", "i", "interactive", prompt, max_tokens, now), now)
        [released] = sched.schedule(now, BackendCapacity(1, 10**12, 10**12)).dispatch
        assert released.tier == "interactive", (k, released)
        sched.finish(released.id, now, Outcome.COMPLETED, 1)
    # With the flood over, batch goes.
    assert sched.schedule(now, BackendCapacity(1, 10**12, 10**12)).dispatch[0].tier == "batch"


@SETTINGS
@given(
    weights=st.lists(st.sampled_from([1.0, 2.0, 3.0]), min_size=2, max_size=4),
    sizes=st.lists(st.tuples(st.integers(1, 300), st.integers(1, 300), st.floats(0.0, 1.0)),
                   min_size=20, max_size=150),
    slots=st.integers(1, 3),
)
def test_vtc_keeps_backlogged_tenants_within_one_request_of_service(weights, sizes, slots):
    """The VTC bound: counters of backlogged tenants never drift apart by more
    than twice the largest weighted charge of one request."""
    tenants = [{"id": f"u{i}", "tier": "t", "weight": w} for i, w in enumerate(weights)]
    policy = PolicyConfig.model_validate({
        "tiers": {"t": {"priority": 0, "max_queue_wait_ms": 10**7, "on_timeout": "delay"}},
        "tenants": tenants,
    })
    w_in, w_out = 1.0, 2.0
    unit = max(w_in * 300 + w_out * 300 for _ in (0,)) / min(weights)
    h = Harness(policy, slots=slots, service=lambda r: 0.01 * (1 + r.prompt_tokens % 7),
                output_tokens=lambda r: max(1, int(r.max_tokens * outputs[r.id])))
    outputs: dict[str, float] = {}
    order = h.scheduler.queue("t").order
    spread_seen = 0.0
    for k, (prompt, max_tokens, frac) in enumerate(sizes):
        # The first tenant is the heavy one: it sends every other request. The
        # last one stays idle for the first half, so it would come back with
        # banked credit if the lift rule did not hold.
        late = len(weights) - 1
        others = len(weights) - 1 if k >= len(sizes) // 2 else max(1, len(weights) - 2)
        tenant = 0 if k % 2 == 0 else 1 + (k // 2) % others
        if tenant == late and k < len(sizes) // 2:
            tenant = 0
        rid = f"v{k}"
        outputs[rid] = frac
        h.submit(Request(rid, f"u{tenant}", "t", prompt, max_tokens, h.now))
        if k % 5 == 4:
            h.advance(h.now + 0.02)
        counters = order.backlogged_counters()
        if len(counters) >= 2:
            spread = max(counters.values()) - min(counters.values())
            spread_seen = max(spread_seen, spread)
            assert spread <= 2 * unit + 1e-6, (spread, unit)
    h.drain()
    assert all(r.outcome is Outcome.COMPLETED for r in h.all_requests)
