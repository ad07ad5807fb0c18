"""VTC's edge cases, and the core's bookkeeping against the requests themselves.

The edge cases (docs/SCHEDULING.md, "vtc: virtual token counters"): the lift
to the floor after a tier drains, the refund of a preempted request's charge,
and a refunded tenant moving forward. The properties drive the real
Scheduler with random traffic, one release at a time, and check after every
step that the totals it reports (snapshot(), depth_by_tier()) are those of
the requests it holds, and that each tier's counters are those of a small
reference model of the rule written here, and that every release goes to a
backlogged tenant with the smallest counter.
"""

from __future__ import annotations

import itertools
from collections.abc import Iterable

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from qosgate.config.models import PolicyConfig, TenantConfig
from qosgate.core.request import Outcome, Request, RequestState
from qosgate.core.scheduler import BackendCapacity, SchedulePlan, Scheduler

from core_driver import Harness
from test_core_properties import TIERS, make_policy

FULL = BackendCapacity(free_slots=0, free_kv_tokens=0, kv_capacity_tokens=10**9)
ONE = BackendCapacity(free_slots=1, free_kv_tokens=10**9, kv_capacity_tokens=10**9)

_ids = itertools.count()


def scheduler(policy: PolicyConfig, drain_rate_hint: float = 10**6) -> Scheduler:
    return Harness(policy, drain_rate_hint=drain_rate_hint).scheduler


def released(sched: Scheduler, n: int, now: float = 0.0) -> list[Request]:
    """The next `n` releases with one slot, each completing at once with
    its max_tokens of output (so the estimate charged is the service)."""
    out = []
    for _ in range(n):
        plan = sched.schedule(now, ONE)
        out.extend(plan.dispatch)
        for r in plan.dispatch:
            sched.finish(r.id, now, Outcome.COMPLETED, r.max_tokens)
    return out


def one_tier(preemption: bool = False) -> PolicyConfig:
    """Tenants a and b share tier t (weight 1 each); with `preemption`, t is
    preemptible and tenant u's tier `urgent` outranks it."""
    return PolicyConfig.model_validate({
        "tiers": {
            "urgent": {"priority": 0, "max_queue_wait_ms": 60_000},
            "t": {"priority": 1, "max_queue_wait_ms": 10**6, "on_timeout": "delay",
                  "preemptible": preemption},
        },
        "tenants": [{"id": "a", "tier": "t"}, {"id": "b", "tier": "t"},
                    {"id": "u", "tier": "urgent"}],
        "scheduler": {"preemption": preemption},
    })  # fmt: skip


def submit(sched: Scheduler, tenant: str, n: int, *, tier: str = "t", at: float = 0.0,
           prompt: int = 100, max_tokens: int = 100) -> list[Request]:  # fmt: skip
    reqs = [Request(f"v{next(_ids)}", tenant, tier, prompt, max_tokens, at) for _ in range(n)]
    for r in reqs:
        assert sched.submit(r, at).admitted
    return reqs


# -- the edge cases ----------------------------------------------------------------


def test_after_a_tier_drains_an_idle_tenant_arriving_first_banks_no_credit():
    sched = scheduler(one_tier())
    submit(sched, "a", 20)
    released(sched, 20)  # the tier is empty again; b never sent anything
    # b arrives first, into an empty tier: it is lifted to the counter of
    # the tenant served last (a's), not left at 0.
    submit(sched, "b", 10)
    submit(sched, "a", 10)
    nxt = released(sched, 10)
    assert sum(r.tenant == "b" for r in nxt) == 5


def test_a_preempted_requests_charge_is_refunded_and_its_tenant_moves_forward():
    sched = scheduler(one_tier(preemption=True))
    x1, x2 = submit(sched, "a", 2)  # charged 100 + 2 x 100 = 300 each
    assert sched.schedule(0.0, ONE).dispatch == [x1]
    # b's small requests (charge 10 + 2 x 10 = 30) arrive while a is served:
    # b is lifted to a's counter, 300.
    y1, y2 = submit(sched, "b", 2, prompt=10, max_tokens=10)
    counters = sched.queue("t").order.counters
    assert counters() == {"a": 300.0, "b": 300.0}
    urgent = submit(sched, "u", 1, tier="urgent")[0]
    assert sched.schedule(0.0, FULL).preempt == [x1]
    # The charge of a request sent back is refunded whole.
    assert counters()["a"] == 0.0
    assert released(sched, 1) == [urgent]
    # a (0) now goes before b (300), then they alternate as counters say.
    assert released(sched, 4) == [x1, y1, x2, y2]
    assert x1.preemptions == 1 and x1.outcome is Outcome.COMPLETED


# -- the properties -----------------------------------------------------------------

# The random-traffic policy of test_core_properties (three tiers, a batch
# window on interactive, a preemptible delay tier, two tenants of different
# weights in each), with two more tenants in the preemptible tier, so that a
# tenant sent back often has others' counters between its refunded one and
# its charged one.
_MORE = (TenantConfig(id="t6", tier="batch", weight=1.0),
         TenantConfig(id="t7", tier="batch", weight=3.0))  # fmt: skip


def traffic_policy(kind: str, fairness: str, window_ms: float) -> PolicyConfig:
    policy = make_policy(kind, fairness, True, window_ms)
    return policy.model_copy(update={"tenants": (*policy.tenants, *_MORE)})


_POLICY = traffic_policy("qos", "vtc", 0.0)
W_IN, W_OUT = _POLICY.scheduler.vtc.w_in, _POLICY.scheduler.vtc.w_out
TENANTS = {t.id: (t.tier, t.weight) for t in _POLICY.tenants}
"""tenant -> (tier, weight)."""
LATENCY_TIERS = {name for name, tier in _POLICY.tiers.items() if tier.on_timeout == "reject"}
"""The tiers that admit by their predicted wait."""


class VtcModel:
    """The rule as docs/SCHEDULING.md states it, per tier: a dispatch adds
    the estimate (w_in * prompt + w_out * expected output) / weight; the end
    corrects it to what ran; a preemption refunds it; a tenant that becomes
    backlogged is lifted to the smallest backlogged counter, or, with none
    backlogged, to the counter of the tenant served last."""

    def __init__(self) -> None:
        self.counters: dict[str, dict[str, float]] = {tier: {} for tier in TIERS}
        self.last_served: dict[str, float] = dict.fromkeys(TIERS, 0.0)

    @staticmethod
    def charge(req: Request) -> float:
        return (W_IN * req.prompt_tokens + W_OUT * (req.work - req.prompt_tokens)) / _weight(req)

    def lift(self, req: Request, backlogged: Iterable[str]) -> None:
        tier = self.counters[req.tier]
        floors = [tier[t] for t in backlogged if t != req.tenant]
        floor = min(floors) if floors else self.last_served[req.tier]
        tier[req.tenant] = max(tier.get(req.tenant, 0.0), floor)

    def dispatch(self, req: Request) -> None:
        tier = self.counters[req.tier]
        tier[req.tenant] += self.charge(req)
        self.last_served[req.tier] = tier[req.tenant]

    def end(self, req: Request, output_tokens: int) -> None:
        actual = (W_IN * req.prompt_tokens + W_OUT * output_tokens) / _weight(req)
        self.counters[req.tier][req.tenant] += actual - self.charge(req)

    def refund(self, req: Request) -> None:
        self.counters[req.tier][req.tenant] -= self.charge(req)


def _weight(req: Request) -> float:
    return TENANTS[req.tenant][1]


class Driver:
    """The Scheduler under test and what the test knows of every request."""

    def __init__(self, policy: PolicyConfig, slots: int) -> None:
        self.sched = scheduler(policy, drain_rate_hint=3000.0)
        self.vtc = policy.scheduler.policy == "qos" and policy.scheduler.fairness == "vtc"
        self.kind = policy.scheduler.policy
        self.slots = slots
        self.now = 0.0
        self.queued: dict[str, Request] = {}
        self.running: dict[str, Request] = {}
        self.model = VtcModel()
        self.seq = 0

    def backlogged(self, tier: str) -> set[str]:
        return {r.tenant for r in self.queued.values() if r.tier == tier}

    def at_the_door(self, tier: str) -> bool:
        """Whether `tier` keeps admission order and is fair at the door
        (a tier that admits by its predicted wait, under qos with vtc)."""
        return self.vtc and tier in LATENCY_TIERS

    def standing(self, tier: str, tenant: str, backlogged: set[str]) -> float:
        """The model's standing of a tenant: its counter, lifted if it has
        nothing queued, plus the charges of what it has queued."""
        counters = self.model.counters[tier]
        counter = counters.get(tenant, 0.0)
        if tenant not in backlogged:
            floors = [counters[t] for t in backlogged]
            counter = max(counter, min(floors) if floors else self.model.last_served[tier])
        return counter + sum(self.model.charge(r) for r in self.queued.values()
                             if r.tenant == tenant)

    def arrive(self, tenant: str, prompt: int, max_tokens: int) -> None:
        self.seq += 1
        req = Request(f"p{self.seq}", tenant, TENANTS[tenant][0], prompt, max_tokens, self.now)
        before = self.backlogged(req.tier)
        queued = dict(self.queued)
        admitted = self.sched.submit(req, self.now).admitted
        pushed = [r for r in queued.values() if r.finished]
        if pushed:
            # One queued request made room for the newcomer: the newest of a
            # tenant of its tier that stays at or ahead of the newcomer's.
            assert admitted and len(pushed) == 1 and self.at_the_door(req.tier)
            victim = pushed[0]
            assert victim.outcome is Outcome.REJECTED_OVERLOAD
            assert victim.tier == req.tier and victim.tenant != req.tenant
            standing = self.standing(req.tier, victim.tenant, before)
            mine = self.standing(req.tier, req.tenant, before) + self.model.charge(req)
            assert standing - self.model.charge(victim) >= mine - 1e-6
            # Newest first: a newer one of its tenant would not have made room
            # (less work), or would have put its tenant behind the newcomer's.
            assert all(r.work < victim.work or standing - self.model.charge(r) < mine + 1e-6
                       for r in queued.values()
                       if r.tenant == victim.tenant and r.seq > victim.seq)
            del self.queued[victim.id]
            before = self.backlogged(req.tier)
        if admitted:
            if req.tenant not in before:
                self.model.lift(req, before)
            self.queued[req.id] = req

    def step(self, room: bool) -> None:
        """One scheduling round with room for at most one release."""
        free = self.slots - len(self.running)
        cap = ONE if room and free > 0 else FULL
        plan = self.sched.schedule(self.now, cap)
        self.apply(plan)

    def apply(self, plan: SchedulePlan) -> None:
        for req in plan.expired:
            del self.queued[req.id]
        # Taken out at the arrival that pushed them out (arrive).
        assert not any(req.id in self.queued for req in plan.pushed_out)
        assert not plan.failed
        for req in plan.dispatch:
            self.released(req)
            self.model.dispatch(req)
        for req in plan.preempt:
            del self.running[req.id]
            before = self.backlogged(req.tier)
            self.model.refund(req)
            if req.tenant not in before:
                self.model.lift(req, before)
            self.queued[req.id] = req

    def released(self, req: Request) -> None:
        """`req` was released: it was queued, and of its tier's backlogged
        tenants its own counter is the smallest, and of its tenant's queued
        requests it is the first admitted."""
        assert self.queued.pop(req.id) is req
        self.running[req.id] = req
        if not self.vtc:
            return
        if self.at_the_door(req.tier):
            # Admission order: what was admitted first goes first.
            assert all(req.seq < r.seq for r in self.queued.values() if r.tier == req.tier)
            return
        counters = self.model.counters[req.tier]
        backlogged = self.backlogged(req.tier) | {req.tenant}
        assert counters[req.tenant] <= min(counters[t] for t in backlogged) + 1e-6
        mine = [r.seq for r in self.queued.values() if r.tenant == req.tenant]
        assert all(req.seq < seq for seq in mine)

    def end(self, pick: int, output_frac: float, cancel: bool) -> None:
        if not self.running:
            return
        req = sorted(self.running.values(), key=lambda r: r.seq)[pick % len(self.running)]
        out = int(req.max_tokens * output_frac)
        if cancel:
            got, was_running = self.sched.cancel(req.id, self.now, output_tokens=out)
            assert got is req and was_running
        else:
            self.sched.finish(req.id, self.now, Outcome.COMPLETED, out)
        del self.running[req.id]
        self.model.end(req, out)

    def leave_queue(self, pick: int) -> None:
        if not self.queued:
            return
        req = sorted(self.queued.values(), key=lambda r: r.seq)[pick % len(self.queued)]
        assert self.sched.cancel(req.id, self.now) == (req, False)
        del self.queued[req.id]

    def first_token(self, pick: int) -> None:
        if self.running:
            req = sorted(self.running.values(), key=lambda r: r.seq)[pick % len(self.running)]
            self.sched.on_first_token(req.id, self.now)

    def check_totals(self) -> None:
        sched = self.sched
        assert {r.id for r in sched.queued()} == set(self.queued)
        assert {r.id for r in sched.running()} == set(self.running)
        assert all(r.state is RequestState.QUEUED for r in self.queued.values())
        assert all(r.state is RequestState.RUNNING for r in self.running.values())
        snap = sched.snapshot(self.now)
        assert (snap["queued"], snap["running"]) == (len(self.queued), len(self.running))
        assert sched.queued_count == len(self.queued)
        assert sched.running_count == len(self.running)
        depth = {tier: 0 for tier in TIERS}
        for req in self.queued.values():
            depth[req.tier] += 1
        assert sched.depth_by_tier() == depth
        # Under fcfs every tier shares one queue ("*"): its totals are the sum.
        groups = {"*": TIERS} if self.kind == "fcfs" else {tier: (tier,) for tier in TIERS}
        assert set(snap["tiers"]) == set(groups)
        for name, tiers in groups.items():
            queued = [r for r in self.queued.values() if r.tier in tiers]
            running = [r for r in self.running.values() if r.tier in tiers]
            view = snap["tiers"][name]
            assert view["queued"] == len(queued)
            assert view["queued_tokens"] == sum(r.work for r in queued)
            assert view["running"] == len(running)
            if queued:
                # The wait of a request of the tier; at most the longest.
                waits = [self.now - r.arrival for r in queued]
                assert any(abs(view["oldest_wait_s"] - w) < 1e-9 for w in waits)
                assert view["oldest_wait_s"] <= self.now - min(r.arrival for r in queued) + 1e-9
            else:
                assert view["oldest_wait_s"] == 0.0 and view["level"] is None

    def check_counters(self) -> None:
        if not self.vtc:
            return
        for tier in TIERS:
            real = self.sched.queue(tier).order.counters()
            model = self.model.counters[tier]
            assert set(real) == set(model)
            for tenant, value in real.items():
                assert value == pytest.approx(model[tenant], abs=1e-6), (tier, tenant)


SETTINGS = settings(max_examples=80, deadline=None, suppress_health_check=[HealthCheck.too_slow])

op = st.one_of(
    st.tuples(st.just("arrive"), st.sampled_from(sorted(TENANTS)), st.integers(1, 400),
              st.integers(1, 300)),
    st.tuples(st.just("step"), st.booleans()),
    st.tuples(st.just("end"), st.integers(0, 10**6), st.floats(0.0, 1.0), st.booleans()),
    st.tuples(st.just("leave"), st.integers(0, 10**6)),
    st.tuples(st.just("first_token"), st.integers(0, 10**6)),
    st.tuples(st.just("wait"), st.floats(0.0, 0.5)),
)


def run(driver: Driver, ops: list[tuple]) -> None:
    for item in ops:
        name = item[0]
        if name == "arrive":
            driver.arrive(*item[1:])
        elif name == "step":
            driver.step(item[1])
        elif name == "end":
            driver.end(*item[1:])
        elif name == "leave":
            driver.leave_queue(item[1])
        elif name == "first_token":
            driver.first_token(item[1])
        else:
            driver.now += item[1]
        driver.check_totals()
        driver.check_counters()
    # Drain: everything still queued is released (or expires) and ends.
    for _ in range(10_000):
        if not driver.queued and not driver.running:
            break
        driver.now += 0.05
        driver.step(True)
        driver.end(0, 0.5, False)
        driver.check_totals()
        driver.check_counters()
    assert not driver.queued and not driver.running


@SETTINGS
@given(
    kind=st.sampled_from(["qos", "strict", "fcfs"]),
    fairness=st.sampled_from(["vtc", "fifo"]),
    window_ms=st.sampled_from([0.0, 30.0]),
    slots=st.integers(1, 4),
    ops=st.lists(op, min_size=60, max_size=250),
)
def test_reported_queue_totals_are_those_of_the_queued_requests(kind, fairness, window_ms,
                                                                 slots, ops):  # fmt: skip
    run(Driver(traffic_policy(kind, fairness, window_ms), slots), ops)


@SETTINGS
@given(
    window_ms=st.sampled_from([0.0, 30.0]),
    slots=st.integers(1, 3),
    ops=st.lists(op, min_size=60, max_size=250),
)
def test_vtc_counters_follow_the_reference_model(window_ms, slots, ops):
    driver = Driver(traffic_policy("qos", "vtc", window_ms), slots)
    assert driver.vtc
    run(driver, ops)
