"""Property-based tests of the core's invariants over random traffic.

Each example drives the real Scheduler against a slot backend on a virtual
clock (tests/core_driver.py): random arrivals, cancellations, backend
failures, expiries, preemptions. No event loop, no sleeps.
"""

from __future__ import annotations

from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from qosgate.config.models import PolicyConfig
from qosgate.core.request import Outcome, Request, RequestState

from core_driver import Harness

SETTINGS = settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])

TIERS = ["interactive", "standard", "batch"]


def make_policy(kind: str, fairness: str, preemption: bool, window_ms: float) -> PolicyConfig:
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
                      "aging": {"interval_ms": 500, "max_boost": 2}},
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
    ops=st.lists(op, min_size=1, max_size=120),
)
def test_every_request_ends_once_nothing_lost_capacity_held(kind, fairness, preemption,
                                                             window_ms, slots, ops):
    h = Harness(make_policy(kind, fairness, preemption, window_ms), slots=slots,
                service=lambda r: 0.05 + r.prompt_tokens / 1000.0,
                output_tokens=lambda r: max(1, r.max_tokens // 2), drain_rate_hint=2000.0)
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
    slots=st.integers(1, 3),
    service=st.lists(st.floats(0.05, 1.0), min_size=1, max_size=50),
    flood_gap=st.floats(0.01, 0.2),
    batch_count=st.integers(1, 4),
    fairness=st.sampled_from(["vtc", "fifo"]),
)
def test_ageing_bound_holds_for_a_trickle_under_a_flood(slots, service, flood_gap, batch_count,
                                                       fairness):
    """The ageing bound (docs/SCHEDULING.md): no admitted request waits longer than its tier's
    max_queue_wait_ms + max_boost * interval_ms + one service time."""
    budget, interval, max_boost, s_max = 2.0, 0.5, 2, 1.0
    policy = PolicyConfig.model_validate({
        "tiers": {
            "interactive": {"priority": 0, "max_queue_wait_ms": 500},
            "batch": {"priority": 2, "max_queue_wait_ms": budget * 1000, "on_timeout": "delay"},
        },
        "tenants": [{"id": "i", "tier": "interactive"}, {"id": "b", "tier": "batch"}],
        "scheduler": {"fairness": fairness,
                      "aging": {"interval_ms": interval * 1000, "max_boost": max_boost}},
    })
    h = Harness(policy, slots=slots, service=lambda r: service[r.seq % len(service)],
                drain_rate_hint=1e9)  # admit the whole flood: the worst case for batch
    bound = budget + max_boost * interval + s_max
    horizon = (bound + 1.0) * batch_count + 1.0
    batch_times = [0.3 + k * (bound + 1.0) for k in range(batch_count)]
    t, n = 0.0, 0
    while t < horizon:
        while batch_times and batch_times[0] <= t:
            bt = batch_times.pop(0)
            h.advance(bt)
            n += 1
            h.submit(Request(f"b{n}", "b", "batch", 10, 10, h.now))
        h.advance(t)
        n += 1
        h.submit(Request(f"i{n}", "i", "interactive", 10, 10, h.now))
        t += flood_gap
    h.drain()
    batch = [r for r in h.all_requests if r.tier == "batch"]
    assert batch and all(r.outcome is Outcome.COMPLETED for r in batch)
    for r in batch:
        assert r.queue_wait <= bound + 1e-9, (r.queue_wait, bound)


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
