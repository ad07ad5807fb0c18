"""One conformance suite for every WorkQueue: memory and a real Redis.

Every test takes the queue from the `queue` fixture, which runs it once per
kind; time is passed in (`now`), so nothing sleeps. A differential test then
drives both stores with the same random operations and asserts they answer
alike and that every item is, after every step, exactly one of queued,
leased or completed.
"""

from __future__ import annotations

import asyncio
import dataclasses
import math
import random
import uuid

import pytest

from qosgate.config.models import PolicyConfig
from qosgate.fleet import (
    FleetLoad,
    FleetTiers,
    Lease,
    MemoryWorkQueue,
    Prefill,
    WorkItem,
    WorkQueue,
    pick_tier,
    predicted_wait,
)
from qosgate.fleet.redis_store import RedisWorkQueue
from qosgate.runtime.errors import WorkQueueFull, WorkQueueOverloaded

T0 = 1_700_000_000.0
LEASE = 10.0
INTERVAL = 2.0
BUDGET = 1.0
# gold refuses late work (admission) and expires it; silver and bronze age
# once their items have waited BUDGET.
TIERS = FleetTiers.of(
    {"gold": 0, "silver": 1, "bronze": 3}, interval_s=INTERVAL, max_boost=2,
    budgets={"gold": 30.0, "silver": BUDGET, "bronze": BUDGET}, delays=["silver", "bronze"],
)  # fmt: skip


def make_queue(kind: str, request, tiers: FleetTiers = TIERS, **kw) -> WorkQueue:
    if kind == "memory":
        return MemoryWorkQueue(tiers, **kw)
    server = request.getfixturevalue("redis_server")
    # A generous timeout, so that a loaded machine does not make the store
    # retry a script that had already run (see test_fleet_rules_differential).
    kw.setdefault("socket_timeout_s", 30.0)
    return RedisWorkQueue(server.url, tiers, key_prefix=f"test-{uuid.uuid4().hex[:8]}:", **kw)


def each_store(tiers: FleetTiers):
    """A fixture that runs its test once per kind of store over `tiers`."""

    @pytest.fixture(params=["memory", "redis"])
    async def store(request):
        store = make_queue(request.param, request, tiers)
        yield store
        await store.close()

    return store


queue = each_store(TIERS)

# A queue whose tiers order tenants by virtual token counter.
FAIR = FleetTiers.of(
    {"gold": 0, "silver": 1}, interval_s=INTERVAL, max_boost=2, fair=True,
    budgets={"silver": BUDGET}, delays=["silver"],
)  # fmt: skip
fair = each_store(FAIR)


def item(
    id: str, tier: str, arrival: float, tenant: str = "t", payload: bytes = b"", affinity: str = "",
    charge: float = 0.0, work: int = 0, prompt: int = 0,
) -> WorkItem:  # fmt: skip
    return WorkItem(
        id=id,
        tier=tier,
        tenant=tenant,
        arrival=arrival,
        payload=payload or id.encode(),
        affinity=affinity,
        charge=charge,
        work=work,
        prompt=prompt,
    )


async def ids(queue: WorkQueue, now: float, max_items: int = 10, node: str = "n1") -> list[str]:
    return [lease.item.id for lease in (await queue.claim(node, max_items, now, LEASE)).leases]


# -- the tier choice, pure ----------------------------------------------------


def test_pick_tier_ages_delay_tiers_one_level_per_interval_past_their_budget():
    # bronze (3) ages once its oldest has waited its budget (1 s): one level
    # per 2 s past it, at most two, to silver's level 1. At one level (2) it
    # is still behind silver; at two it ties, and equal levels go to the
    # older head.
    assert pick_tier(TIERS, {"silver": T0 + 5, "bronze": T0}, T0 + 4.999) == "silver"
    assert pick_tier(TIERS, {"silver": T0 + 5, "bronze": T0}, T0 + 5.0) == "bronze"
    assert pick_tier(TIERS, {"silver": T0 - 1, "bronze": T0}, T0 + 1e6) == "silver"
    # Ageing stops below gold, which refuses late work (a latency tier): no
    # delay tier ever goes ahead of it, however long it waited.
    assert pick_tier(TIERS, {"gold": T0 + 1e6, "silver": T0}, T0 + 1e6) == "gold"
    assert pick_tier(TIERS, {"gold": T0 + 1e6, "bronze": T0}, T0 + 1e6) == "gold"
    assert pick_tier(TIERS, {}, T0) is None
    # A tier that expires late work (on_timeout: reject) never ages.
    rejecting = FleetTiers.of(
        {"gold": 0, "std": 1}, interval_s=1.0, max_boost=3, budgets={"gold": 1.0, "std": 1.0}
    )
    assert pick_tier(rejecting, {"gold": T0 + 1e6, "std": T0}, T0 + 1e6) == "gold"
    # Same level, same head: the lower base priority.
    assert pick_tier(TIERS, {"silver": T0, "bronze": T0}, T0 + 5.0) == "silver"
    # A head from a clock slightly ahead does not age backwards.
    assert pick_tier(TIERS, {"silver": T0 + 5, "bronze": T0 + 5}, T0) == "silver"


def test_fleet_tiers_from_config_follow_the_scheduling_policy():
    tiers = {"gold": {"priority": 0}, "bronze": {"priority": 2}}
    aging = {"interval_ms": 500, "max_boost": 3}
    qos = FleetTiers.from_config(
        PolicyConfig.model_validate({"tiers": tiers, "scheduler": {"aging": aging}})
    )
    assert [(t.name, t.priority) for t in qos.tiers] == [("gold", 0), ("bronze", 2)]
    assert (qos.interval_s, qos.max_boost, qos.fair) == (0.5, 3, True)
    # Budgets, ageing and admission as the tiers say (30 s and reject by default).
    assert [(t.budget_s, t.delays, t.name in qos.admitting) for t in qos.tiers] == [
        (30.0, False, True), (30.0, False, True),
    ]  # fmt: skip
    late = {"gold": {"priority": 0, "max_queue_wait_ms": 500},
            "bronze": {"priority": 2, "on_timeout": "delay"}}  # fmt: skip
    mixed = FleetTiers.from_config(PolicyConfig.model_validate({"tiers": late}))
    assert [(t.budget_s, t.delays, t.name in mixed.admitting) for t in mixed.tiers] == [
        (0.5, False, True), (30.0, True, False),
    ]  # fmt: skip
    off = FleetTiers.from_config(
        PolicyConfig.model_validate({"tiers": late, "scheduler": {"admission": False}})
    )
    assert not off.admitting
    fifo = FleetTiers.from_config(
        PolicyConfig.model_validate({"tiers": tiers, "scheduler": {"fairness": "fifo"}})
    )
    assert not fifo.fair
    strict = FleetTiers.from_config(
        PolicyConfig.model_validate(
            {"tiers": tiers, "scheduler": {"policy": "strict", "aging": aging}}
        )
    )
    assert strict.max_boost == 0 and not strict.fair
    fcfs = FleetTiers.from_config(
        PolicyConfig.model_validate({"tiers": tiers, "scheduler": {"policy": "fcfs"}})
    )
    assert {t.priority for t in fcfs.tiers} == {0} and fcfs.max_boost == 0 and not fcfs.fair
    assert not fcfs.admitting


# -- ordering -----------------------------------------------------------------


async def test_claims_follow_priority_across_tiers(queue):
    await queue.enqueue(item("b", "bronze", T0))
    await queue.enqueue(item("s", "silver", T0 + 0.1))
    await queue.enqueue(item("g", "gold", T0 + 0.2))
    assert await ids(queue, T0 + 0.3) == ["g", "s", "b"]


async def test_an_aged_item_overtakes_fresh_higher_tier_work_exactly_at_its_boost(queue):
    await queue.enqueue(item("old-bronze", "bronze", T0))
    await queue.enqueue(item("s1", "silver", T0 + 4.999))
    # Not yet two levels up: silver first.
    assert await ids(queue, T0 + 4.999, 1) == ["s1"]
    await queue.enqueue(item("s2", "silver", T0 + 5.0))
    # Two levels up, tied with silver, and older.
    assert await ids(queue, T0 + 5.0, 1) == ["old-bronze"]
    assert await ids(queue, T0 + 5.0) == ["s2"]


async def test_boost_stops_at_max_boost(queue):
    await queue.enqueue(item("old-bronze", "bronze", T0))
    await queue.enqueue(item("s", "silver", T0 + 1000))
    await queue.enqueue(item("g", "gold", T0 + 1000))
    # bronze is two levels up (silver's level, where it is the older head),
    # and no further: gold goes first.
    assert await ids(queue, T0 + 1000) == ["g", "old-bronze", "s"]


RESERVED = FleetTiers.of(
    {"gold": 0, "silver": 1, "bronze": 3}, interval_s=INTERVAL, max_boost=2,
    budgets={"gold": 30.0, "silver": BUDGET, "bronze": BUDGET}, delays=["silver", "bronze"],
    reserve_slots=2,
)  # fmt: skip


@pytest.mark.parametrize("kind", ["memory", "redis"])
async def test_a_node_keeps_its_reserved_slots_for_the_top_level(kind, request):
    queue = make_queue(kind, request, RESERVED)
    try:
        for n in range(4):
            await queue.enqueue(item(f"s{n}", "silver", T0 + n))
        # Three free slots, two of them held for gold: one silver goes.
        assert await ids(queue, T0 + 5, 3) == ["s0"]
        # Two free: both held, none goes, though silver is all that waits.
        assert await ids(queue, T0 + 5, 2, node="n2") == []
        await queue.enqueue(item("g", "gold", T0 + 5))
        # Gold takes a reserved slot; below it the reserve still holds.
        assert await ids(queue, T0 + 6, 2, node="n2") == ["g"]
        assert await ids(queue, T0 + 6, 5, node="n3") == ["s1", "s2", "s3"]
    finally:
        await queue.close()


@pytest.mark.parametrize("kind", ["memory", "redis"])
async def test_a_claim_says_when_it_stopped_at_the_reserve(kind, request):
    """A node held at its reserve is full to the work below the top level
    (admission.saturated): its drain estimate counts that time, as one
    node's scheduler counts a release the reserve blocks."""
    queue = make_queue(kind, request, RESERVED)
    try:
        for n in range(2):
            await queue.enqueue(item(f"s{n}", "silver", T0 + n))
        stopped = await queue.claim("n1", 3, T0 + 5, LEASE)
        assert [lease.item.id for lease in stopped.leases] == ["s0"] and stopped.at_reserve
        # Room past the reserve, and the queue runs dry first: not held.
        emptied = await queue.claim("n2", 5, T0 + 5, LEASE)
        assert [lease.item.id for lease in emptied.leases] == ["s1"] and not emptied.at_reserve
        await queue.enqueue(item("g", "gold", T0 + 6))
        assert not (await queue.claim("n3", 1, T0 + 6, LEASE)).at_reserve
    finally:
        await queue.close()


def test_the_fleet_reserves_what_one_node_reserves():
    tiers = {"gold": {"priority": 0}, "bronze": {"priority": 2}}
    reserve = {"reserve": {"slots": 3}}
    qos = FleetTiers.from_config(PolicyConfig.model_validate({"tiers": tiers,
                                                              "scheduler": reserve}))
    assert (qos.reserve_slots, qos.top_level) == (3, 0)
    fcfs = FleetTiers.from_config(PolicyConfig.model_validate(
        {"tiers": tiers, "scheduler": {**reserve, "policy": "fcfs"}}))
    assert fcfs.reserve_slots == 0


# gold and std refuse late work; bronze delays.
PREFILL = FleetTiers.of(
    {"gold": 0, "std": 1, "bronze": 3}, interval_s=INTERVAL, max_boost=2,
    budgets={"gold": 30.0, "std": 10.0, "bronze": BUDGET}, delays=["bronze"],
)  # fmt: skip
prefill_store = each_store(PREFILL)


async def test_below_the_top_level_a_claim_keeps_the_nodes_prefill_within_its_budget(
    prefill_store,
):
    queue = prefill_store
    await queue.enqueue(item("s-long", "std", T0, prompt=3000))
    await queue.enqueue(item("b-short", "bronze", T0 + 1, prompt=100))
    await queue.enqueue(item("g", "gold", T0 + 2, prompt=5000))
    # 1,000 tokens already in prefill, a 2,048-token budget: gold goes whatever
    # its prompt; std's does not fit, and bronze's short one does not overtake it.
    claim = await queue.claim("n1", 10, T0 + 3, LEASE, prefill=Prefill(1000, 2048))
    assert [lease.item.id for lease in claim.leases] == ["g"]
    assert [lease.item.prompt for lease in claim.leases] == [5000]
    assert claim.held_for_prefill and not claim.paced
    # Still 1,500 in: bronze's 100 would fit, but std's head is held.
    claim = await queue.claim("n1", 9, T0 + 3, LEASE, prefill=Prefill(1500, 2048))
    assert claim.leases == [] and claim.held_for_prefill
    # Nothing in prefill: the first prompt goes however long, then bronze's
    # waits behind it.
    claim = await queue.claim("n1", 9, T0 + 3, LEASE, prefill=Prefill(0, 2048))
    assert [lease.item.id for lease in claim.leases] == ["s-long"] and claim.held_for_prefill
    # No budget: no holding.
    claim = await queue.claim("n1", 8, T0 + 3, LEASE, prefill=Prefill(3000))
    assert [lease.item.id for lease in claim.leases] == ["b-short"]
    assert not claim.held_for_prefill


async def test_tiers_without_a_latency_objective_go_in_at_the_pace_of_prefill(queue):
    await queue.enqueue(item("s", "silver", T0, prompt=1000))
    await queue.enqueue(item("b", "bronze", T0 + 1, prompt=100))
    await queue.enqueue(item("g", "gold", T0 + 2, prompt=1000))
    # gold has a latency objective: the pace never holds it. silver's prompt
    # would take the node past 1,500 tokens; bronze keeps its place behind.
    claim = await queue.claim("n1", 10, T0 + 3, LEASE, prefill=Prefill(1000, pace=1500))
    assert [lease.item.id for lease in claim.leases] == ["g"]
    assert claim.paced and not claim.held_for_prefill
    claim = await queue.claim("n1", 9, T0 + 3, LEASE, prefill=Prefill(450, pace=1500))
    assert [lease.item.id for lease in claim.leases] == ["s"] and claim.paced


async def test_a_node_holding_for_its_prefill_budget_has_no_room_below_the_top(prefill_store):
    """Admission reads a held node as one node's scheduler reads a held
    level: its free slots take no newcomer below the top level at once."""
    queue = prefill_store
    await queue.enqueue(item("s1", "std", T0, prompt=3000, work=3100))
    await queue.enqueue(item("s2", "std", T0, prompt=3000, work=3100))
    claim = await queue.claim("n1", 10, T0 + 1, LEASE, drain_rate=1000.0,
                              prefill=Prefill(0, 2048))  # fmt: skip
    assert [lease.item.id for lease in claim.leases] == ["s1"] and claim.held_for_prefill
    load = await queue.load(T0 + 1)
    assert (load.rooms, load.held_rooms, load.room) == ((), (9,), 9)
    # std's newcomer waits for s2's work and its own, as on a full node;
    # gold's starts at once.
    assert predicted_wait(PREFILL, "std", 100, load, T0 + 1) == (3100 + 100) / 1000.0
    assert predicted_wait(PREFILL, "gold", 100, load, T0 + 1) == 0.0
    # Its next claim, after the first token, holds nothing: the node has room again.
    claim = await queue.claim("n1", 9, T0 + 2, LEASE, drain_rate=1000.0, prefill=Prefill(0, 2048))
    assert [lease.item.id for lease in claim.leases] == ["s2"] and not claim.held_for_prefill
    load = await queue.load(T0 + 2)
    assert (load.rooms, load.held_rooms) == ((8,), ())
    # A node that leaves takes its record with it.
    await queue.claim("n1", 8, T0 + 2, LEASE, prefill=Prefill(3000, 2048))
    await queue.leave("n1")
    assert (await queue.load(T0 + 2)).held_rooms == ()


async def test_a_node_stopped_at_the_slots_it_keeps_for_arrivals_has_no_room_below_the_top(
    prefill_store,
):
    """The slots a node keeps for the top level's expected arrivals are the
    top level's, at the door as at the claim: one node's scheduler, stopped
    there, is full to the levels below (admission.saturated)."""
    queue = prefill_store
    for n in range(3):
        await queue.enqueue(item(f"s{n}", "std", T0, prompt=100, work=1000))
    # Four free, three kept for gold's expected arrivals: one std goes.
    claim = await queue.claim("n1", 4, T0 + 1, LEASE, drain_rate=1000.0, held_for_arrivals=3)
    assert [lease.item.id for lease in claim.leases] == ["s0"] and claim.at_reserve
    load = await queue.load(T0 + 1)
    assert (load.rooms, load.held_rooms) == ((), (3,))
    # std's newcomer waits for the queued std work and its own slot, as on a
    # full node; gold's starts at once in a kept slot.
    assert predicted_wait(PREFILL, "std", 100, load, T0 + 1) == (2000 + 100) / 1000.0
    assert predicted_wait(PREFILL, "gold", 100, load, T0 + 1) == 0.0
    # Kept nothing on its next claim, the node takes std again, and has room.
    claim = await queue.claim("n1", 4, T0 + 2, LEASE, drain_rate=1000.0)
    assert [lease.item.id for lease in claim.leases] == ["s1", "s2"] and not claim.at_reserve
    assert (await queue.load(T0 + 2)).rooms == (2,)


async def test_the_tier_is_picked_again_for_every_item_of_a_claim(queue):
    await queue.enqueue(item("b-old", "bronze", T0))
    await queue.enqueue(item("b-new", "bronze", T0 + 10))
    await queue.enqueue(item("s", "silver", T0 + 10))
    # Once b-old is taken, bronze's head is fresh again and silver comes first.
    assert await ids(queue, T0 + 10) == ["b-old", "s", "b-new"]


async def test_fifo_by_arrival_within_a_tier_then_by_id(queue):
    await queue.enqueue(item("third", "gold", T0 + 2))
    await queue.enqueue(item("first", "gold", T0))
    await queue.enqueue(item("b-second", "gold", T0 + 1))
    await queue.enqueue(item("a-second", "gold", T0 + 1))
    assert await ids(queue, T0 + 3) == ["first", "a-second", "b-second", "third"]


async def test_claim_hands_back_the_item_and_a_lease(queue):
    work = WorkItem("r1", "silver", "acme", T0 + 0.123456789, b"\x00\xffbody")
    await queue.enqueue(work)
    assert (await queue.claim("n1", 0, T0 + 1, LEASE)).leases == []
    [lease] = (await queue.claim("n1", 5, T0 + 1, LEASE)).leases
    assert lease == Lease(work, "n1", lease.token, T0 + 1 + LEASE)
    assert await queue.depth() == {"gold": 0, "silver": 0, "bronze": 0}
    assert await queue.leased() == 1
    assert await queue.status("r1") == "leased"
    assert await queue.status("never") is None


# -- leases -------------------------------------------------------------------


async def test_an_expired_lease_returns_at_its_arrival_and_the_old_holder_is_fenced(queue):
    await queue.enqueue(item("a", "gold", T0))
    [stale] = (await queue.claim("dead", 1, T0, LEASE)).leases
    await queue.enqueue(item("b", "gold", T0 + 5))
    # Not yet expired: nothing for another node but b.
    assert await ids(queue, T0 + LEASE - 0.001, 1, "live") == ["b"]
    [fresh] = (await queue.claim("live", 1, T0 + LEASE, LEASE)).leases
    assert fresh.item == dataclasses.replace(stale.item, attempt=1)
    assert fresh.item.arrival == T0 and fresh.node == "live"
    assert fresh.token > stale.token
    assert await queue.complete(stale) is False
    assert await queue.renew(stale, T0 + LEASE, LEASE) is None
    assert await queue.release(stale) is False
    assert await queue.status("a") == "leased"
    assert await queue.complete(fresh) is True


async def test_an_expired_lease_nobody_reclaimed_yet_can_still_complete(queue):
    await queue.enqueue(item("a", "gold", T0))
    [lease] = (await queue.claim("slow", 1, T0, LEASE)).leases
    # Past its end, but no claim has taken it back: the holder still holds it.
    late = await queue.renew(lease, T0 + LEASE + 1, LEASE)
    assert late is not None and late.expires_at == T0 + 2 * LEASE + 1
    assert await queue.complete(late) is True
    assert await ids(queue, T0 + 2 * LEASE) == []


async def test_renew_keeps_the_lease(queue):
    await queue.enqueue(item("a", "gold", T0))
    [lease] = (await queue.claim("n1", 1, T0, LEASE)).leases
    renewed = await queue.renew(lease, T0 + 8, LEASE)
    assert renewed == Lease(lease.item, "n1", lease.token, T0 + 8 + LEASE)
    assert await ids(queue, T0 + 15, 1, "n2") == []
    assert await queue.leased() == 1
    assert await queue.complete(renewed) is True
    # Past the renewed end, had it not completed, it would have gone back.
    assert await ids(queue, T0 + 30) == []


async def test_renew_all_renews_every_lease_still_held_in_one_call(queue):
    for name in ("a", "b", "c"):
        await queue.enqueue(item(name, "gold", T0))
    [a] = (await queue.claim("n1", 1, T0, LEASE)).leases
    b, c = (await queue.claim("n1", 2, T0 + 1, LEASE)).leases
    # a runs out and another node takes it over; c is done.
    [taken] = (await queue.claim("n2", 1, T0 + LEASE, LEASE)).leases
    assert taken.item.id == "a"
    assert await queue.complete(c) is True
    renewed = await queue.renew_all([a, b, c], T0 + LEASE, LEASE)
    assert renewed == [None, Lease(b.item, "n1", b.token, T0 + 2 * LEASE), None]
    assert await ids(queue, T0 + 2 * LEASE - 0.001, 1, "n2") == []
    assert await queue.renew_all([], T0, LEASE) == []


async def test_complete_is_true_exactly_once(queue):
    await queue.enqueue(item("a", "gold", T0))
    [lease] = (await queue.claim("n1", 1, T0, LEASE)).leases
    assert await queue.complete(lease) is True
    assert await queue.complete(lease) is False
    assert await queue.renew(lease, T0 + 1, LEASE) is None
    assert await queue.release(lease) is False
    assert await queue.status("a") == "completed"
    assert await queue.leased() == 0
    assert sum((await queue.depth()).values()) == 0


async def test_release_gives_the_item_back_at_once_at_its_arrival(queue):
    await queue.enqueue(item("a", "silver", T0))
    await queue.enqueue(item("b", "silver", T0 + 1))
    [lease] = (await queue.claim("leaving", 1, T0 + 2, LEASE)).leases
    assert lease.item.id == "a"
    assert await queue.release(lease) is True
    assert await queue.status("a") == "queued"
    assert await queue.depth() == {"gold": 0, "silver": 2, "bronze": 0}
    assert await queue.leased() == 0
    [again] = (await queue.claim("other", 1, T0 + 2, LEASE)).leases
    assert (again.item.id, again.item.arrival, again.item.attempt) == ("a", T0, 1)
    assert await queue.release(lease) is False
    assert await queue.complete(lease) is False


async def test_duplicate_ids_are_refused_whatever_state_the_first_is_in(queue):
    await queue.enqueue(item("a", "gold", T0))
    with pytest.raises(ValueError, match="duplicate"):
        await queue.enqueue(item("a", "silver", T0 + 1))
    [lease] = (await queue.claim("n1", 1, T0, LEASE)).leases
    with pytest.raises(ValueError, match="duplicate"):
        await queue.enqueue(item("a", "gold", T0))
    assert await queue.complete(lease)
    with pytest.raises(ValueError, match="duplicate"):
        await queue.enqueue(item("a", "gold", T0))
    with pytest.raises(ValueError, match="unknown tier"):
        await queue.enqueue(item("x", "platinum", T0))
    assert await queue.depth() == {"gold": 0, "silver": 0, "bronze": 0}


async def test_a_tier_at_its_cap_refuses_more_and_other_tiers_do_not_care(queue):
    await queue.enqueue(item("a", "gold", T0), max_queued=2)
    await queue.enqueue(item("b", "gold", T0 + 1), max_queued=2)
    with pytest.raises(WorkQueueFull):
        await queue.enqueue(item("c", "gold", T0 + 2), max_queued=2)
    await queue.enqueue(item("d", "silver", T0 + 2), max_queued=2)
    assert await queue.status("c") is None
    # A leased item no longer counts against its tier's queue.
    await queue.claim("n1", 1, T0 + 3, LEASE)
    await queue.enqueue(item("c", "gold", T0 + 4), max_queued=2)
    assert await queue.depth() == {"gold": 2, "silver": 1, "bronze": 0}


async def test_cancel_takes_an_item_out_wherever_it_is(queue):
    for name, at in (("q", T0), ("l", T0 - 1), ("c", T0 - 2)):
        await queue.enqueue(item(name, "silver", at))
    done, held = (await queue.claim("n1", 2, T0, LEASE)).leases
    assert (done.item.id, held.item.id) == ("c", "l")
    assert await queue.complete(done)
    assert await queue.cancel("q", T0 + 1) == "queued"
    assert await queue.cancel("l", T0 + 1) == "leased"
    assert await queue.cancel("c", T0 + 1) == "completed"
    assert await queue.cancel("never", T0 + 1) is None
    assert [await queue.status(i) for i in "qlc"] == ["completed"] * 3
    # The holder of a cancelled item can neither keep nor complete it, and it
    # does not come back when the lease runs out.
    assert await queue.renew(held, T0 + 1, LEASE) is None
    assert await queue.complete(held) is False
    assert (await queue.claim("n2", 5, T0 + 2 * LEASE, LEASE)).leases == []
    assert await queue.leased() == 0
    assert await queue.cancel("q", T0 + 2) == "completed"
    with pytest.raises(ValueError, match="duplicate"):
        await queue.enqueue(item("q", "silver", T0))


async def test_cancel_only_queued_leaves_a_running_item_alone(queue):
    await queue.enqueue(item("l", "gold", T0))
    await queue.enqueue(item("q", "gold", T0 + 1))
    [held] = (await queue.claim("n1", 1, T0 + 2, LEASE)).leases
    assert await queue.cancel("l", T0 + 3, only_queued=True) == "leased"
    assert await queue.status("l") == "leased"
    assert await queue.renew(held, T0 + 3, LEASE) is not None
    assert await queue.cancel("q", T0 + 3, only_queued=True) == "queued"
    assert await queue.status("q") == "completed"
    assert await queue.complete(held) is True


async def test_next_expiry_is_the_first_live_lease_end(queue):
    assert await queue.next_expiry() is None
    await queue.enqueue(item("a", "gold", T0))
    await queue.enqueue(item("b", "gold", T0 + 1))
    first, second = (await queue.claim("n1", 2, T0 + 0.25, LEASE)).leases
    await queue.renew(first, T0 + 3, LEASE)
    assert await queue.next_expiry() == T0 + 0.25 + LEASE
    await queue.complete(second)
    assert await queue.next_expiry() == T0 + 3 + LEASE
    await queue.release(first)
    assert await queue.next_expiry() is None


async def test_ended_ids_are_forgotten_after_the_retention(request, queue):
    store = make_queue(type(queue).name, request, done_retention_s=100.0)
    try:
        await store.enqueue(item("a", "gold", T0))
        await store.enqueue(item("b", "gold", T0))
        [lease] = (await store.claim("n1", 1, T0, LEASE)).leases
        assert await store.complete(lease)
        assert await store.cancel("b", T0 + 50) == "queued"
        await store.claim("n1", 1, T0 + LEASE + 99, LEASE)
        assert [await store.status(i) for i in "ab"] == ["completed", "completed"]
        await store.claim("n1", 1, T0 + LEASE + 101, LEASE)
        assert await store.status("a") is None
        assert await store.status("b") == "completed"
        await store.enqueue(item("a", "gold", T0 + 200))
        assert await store.status("a") == "queued"
    finally:
        await store.close()


async def test_complete_publishes_its_reply_only_when_it_completes(queue):
    channel = f"reply-{uuid.uuid4().hex[:6]}"
    listener = None
    if isinstance(queue, RedisWorkQueue):
        listener = queue.redis.pubsub()
        await listener.subscribe(channel, queue.wake_channel)
    await queue.enqueue(item("a", "gold", T0))
    [lease] = (await queue.claim("n1", 1, T0, LEASE)).leases
    assert await queue.complete(lease, (channel, b"done:a")) is True
    assert await queue.complete(lease, (channel, b"again")) is False
    if isinstance(queue, MemoryWorkQueue):
        assert queue.published == [(channel, b"done:a")]
        assert queue.wakes == 1
        return
    assert listener is not None
    got = []
    async with asyncio.timeout(5):
        while len(got) < 2:
            message = await listener.get_message(timeout=5.0)
            if message is not None and message["type"] == "message":
                got.append((message["channel"].decode(), message["data"]))
    # The enqueue's wake names the tier (a full node may preempt for it).
    assert got == [(queue.wake_channel, b"q:gold"), (channel, b"done:a")]
    await listener.aclose()


# -- fairness between tenants (VTC) ---------------------------------------------


async def test_a_fair_tier_serves_the_tenant_with_the_least_service_first(fair):
    for i in range(3):
        await fair.enqueue(item(f"a{i}", "gold", T0 + i, tenant="a", charge=10.0))
    await fair.enqueue(item("b0", "gold", T0 + 5, tenant="b", charge=10.0))
    # Equal counters go by tenant name; then b, behind on service, comes
    # before a's older items.
    assert await ids(fair, T0 + 6) == ["a0", "b0", "a1", "a2"]
    assert await fair.counters("gold") == {"a": 30.0, "b": 10.0}
    assert await fair.counters("silver") == {}


async def test_service_is_divided_by_weight_through_the_charge(fair):
    # Weight 10 against weight 1: the same request charges a tenth.
    for i in range(5):
        await fair.enqueue(item(f"h{i}", "gold", T0 + i, tenant="heavy", charge=1.0))
    for i in range(2):
        await fair.enqueue(item(f"l{i}", "gold", T0 + i, tenant="light", charge=10.0))
    assert await ids(fair, T0 + 6) == ["h0", "l0", "h1", "h2", "h3", "h4", "l1"]


async def test_a_newly_backlogged_tenant_is_lifted_so_idle_time_is_no_credit(fair):
    for i in range(4):
        await fair.enqueue(item(f"a{i}", "gold", T0 + i, tenant="a", charge=10.0))
    assert await ids(fair, T0 + 4, 3) == ["a0", "a1", "a2"]
    # b arrives with a counter of 0, but is lifted to a's 30: it does not
    # take both its items before a's next.
    await fair.enqueue(item("b0", "gold", T0 + 5, tenant="b", charge=10.0))
    await fair.enqueue(item("b1", "gold", T0 + 6, tenant="b", charge=10.0))
    assert await ids(fair, T0 + 7) == ["a3", "b0", "b1"]
    assert await fair.counters("gold") == {"a": 40.0, "b": 50.0}
    # Nobody backlogged: a newcomer is lifted to the counter last served.
    await fair.enqueue(item("c0", "gold", T0 + 8, tenant="c", charge=1.0))
    assert (await fair.counters("gold"))["c"] == 50.0


async def test_counters_are_settled_at_completion_and_refunded_when_a_lease_is_lost(fair):
    await fair.enqueue(item("a0", "gold", T0, tenant="a", charge=10.0))
    await fair.enqueue(item("b0", "gold", T0, tenant="b", charge=10.0))
    [a0, b0] = (await fair.claim("n1", 2, T0, LEASE)).leases
    assert await fair.complete(a0, used=4.5) is True
    assert await fair.complete(a0, used=100.0) is False  # settled once
    assert await fair.counters("gold") == {"a": 4.5, "b": 10.0}
    assert await fair.release(b0) is True
    # Refunded, then lifted back to the counter last served (b's own 10),
    # as the in-process scheduler treats a preempted request.
    assert await fair.counters("gold") == {"a": 4.5, "b": 10.0}
    await fair.enqueue(item("a1", "gold", T0 + 1, tenant="a", charge=10.0))
    # a is lifted to b's 10 (the smallest backlogged counter); a tie goes by name.
    assert await ids(fair, T0 + 2) == ["a1", "b0"]


async def test_tiers_still_come_first_and_age_under_fairness(fair):
    await fair.enqueue(item("s-old", "silver", T0, tenant="a"))
    await fair.enqueue(item("g", "gold", T0 + 4.0, tenant="z", charge=100.0))
    await fair.enqueue(item("g2", "gold", T0 + 4.0, tenant="a"))
    # silver's oldest waited 4 s, 3 s past its budget: one level up, tied
    # with gold and older.
    assert await ids(fair, T0 + 4.0, 1) == ["s-old"]
    assert await ids(fair, T0 + 4.0) == ["g2", "g"]


# -- preemption -----------------------------------------------------------------


async def test_preempt_gives_a_run_back_only_while_more_urgent_work_is_uncovered(queue):
    await queue.enqueue(item("s", "silver", T0, tenant="a", charge=5.0))
    [lease] = (await queue.claim("n1", 1, T0, LEASE)).leases
    # Nothing more urgent is queued: no reason to give it back.
    assert not await queue.preempt(lease, T0 + 1)
    await queue.enqueue(item("g", "gold", T0 + 1))
    # Another live node has a free slot for gold: still no reason.
    await queue.heartbeat("n2", 1, T0 + 1, LEASE)
    assert not await queue.preempt(lease, T0 + 1)
    await queue.heartbeat("n2", 0, T0 + 1, LEASE)
    assert await queue.preempt(lease, T0 + 1)
    # Back at its arrival (as a release, which refunds its charge too), and
    # its node has the slot for gold.
    assert await queue.status("s") == "queued"
    assert (await queue.load(T0 + 1)).room == 1
    assert not await queue.preempt(lease, T0 + 1), "the lease is gone"
    claim = await queue.claim("n1", 1, T0 + 1, LEASE)
    assert [lease.item.id for lease in claim.leases] == ["g"]
    [again] = (await queue.claim("n2", 1, T0 + 2, LEASE)).leases
    assert (again.item.id, again.item.attempt) == ("s", 1)


# -- admission ------------------------------------------------------------------

# gold outranks std; both refuse late work at the door. Arrival rates are
# averaged over 10 s.
ADMIT = FleetTiers.of(
    {"gold": 0, "std": 1}, interval_s=INTERVAL, max_boost=2,
    budgets={"gold": 30.0, "std": 10.0}, inflow_tau_s=10.0,
)  # fmt: skip
admit = each_store(ADMIT)


def test_predicted_wait_is_work_ahead_over_what_drains_beyond_the_inflow():
    load = FleetLoad(queued_work={"gold": 500, "std": 300}, inflow={"gold": 50.0, "std": 80.0},
                     drain=150.0, rooms=(0,))  # fmt: skip
    # Every node full: its own 100 tokens, then what is queued at or above std,
    # drained at 150 less gold's 50 tokens/s of arrivals.
    assert predicted_wait(ADMIT, "std", 100, load, T0) == (100 + 500 + 300) / 100.0
    # gold has nothing above it: no inflow counts, and std's queue is behind it.
    assert predicted_wait(ADMIT, "gold", 100, load, T0) == 600 / 150.0
    # Free slots start that much work at once.
    roomy = dataclasses.replace(load, rooms=(3,))
    assert predicted_wait(ADMIT, "std", 100, roomy, T0) == 500 / 100.0
    assert predicted_wait(ADMIT, "std", 400, roomy, T0) == 0.0
    # Arrivals above as fast as the fleet drains: never served.
    assert predicted_wait(ADMIT, "std", 100, dataclasses.replace(load, drain=50.0), T0) == math.inf
    # Slots a node keeps for the top level are room for gold only: std's
    # room is what is past each node's reserve (3 - 2 here, none there): one
    # slot, which takes 100 tokens of what is ahead at once.
    reserved = dataclasses.replace(ADMIT, reserve_slots=2)
    held = dataclasses.replace(load, rooms=(2, 3))
    assert predicted_wait(reserved, "std", 100, held, T0) == (500 + 300 - 100) / 100.0
    assert predicted_wait(reserved, "gold", 100, held, T0) == 0.0
    assert predicted_wait(reserved, "std", 100, dataclasses.replace(load, rooms=(2, 2)), T0) == (
        100 + 500 + 300) / 100.0
    # No node reports a rate: no evidence, no prediction.
    assert predicted_wait(ADMIT, "std", 100, dataclasses.replace(load, drain=0.0), T0) is None


def test_predicted_wait_leaves_out_aged_work_and_lower_tiers_shares():
    # batch (2) ages past its 5 s budget, but never to gold's level: however
    # long it waited, none of its work is served before a gold newcomer. Nor
    # does its guaranteed share (10%) pass gold's work: gold keeps the drain.
    tiers = FleetTiers.of(
        {"gold": 0, "batch": 2}, interval_s=2.0, max_boost=2,
        budgets={"gold": 10.0, "batch": 5.0}, delays=["batch"], shares={"batch": 0.1},
    )  # fmt: skip
    load = FleetLoad(queued_work={"gold": 300, "batch": 1900}, inflow={}, drain=200.0, rooms=(0,),
                     oldest={"gold": T0 + 18, "batch": T0})  # fmt: skip
    for now in (T0 + 8.9, T0 + 19, T0 + 1e5):
        assert predicted_wait(tiers, "gold", 100, load, now) == pytest.approx(400 / 200.0)
    idle = dataclasses.replace(load, queued_work={"gold": 300, "batch": 0}, oldest={})
    assert predicted_wait(tiers, "gold", 100, idle, T0 + 19) == pytest.approx(400 / 200.0)


async def test_admission_refuses_what_would_wait_past_its_budget(admit):
    # One live node, full, draining 100 tokens/s.
    await admit.heartbeat("n1", 0, T0, LEASE, drain_rate=100.0)
    for n in range(3):  # 10, 20 and exactly 30 s: within gold's budget
        await admit.enqueue(item(f"g{n}", "gold", T0, work=1000))
    with pytest.raises(WorkQueueOverloaded) as refused:
        await admit.enqueue(item("g3", "gold", T0, work=1000))
    assert (refused.value.predicted_wait_s, refused.value.budget_s) == (40.0, 30.0)
    # Nothing of it stays: not queued, not counted, and its id is still free.
    assert await admit.status("g3") is None
    assert (await admit.load(T0)).queued_work == {"gold": 3000, "std": 0}
    # A smaller one still fits.
    await admit.enqueue(item("g3", "gold", T0, work=0))
    assert await admit.depth() == {"gold": 4, "std": 0}


async def test_the_inflow_of_more_important_tiers_counts_against_the_wait(admit):
    await admit.heartbeat("n1", 0, T0, LEASE, drain_rate=100.0)
    await admit.enqueue(item("g", "gold", T0, work=500))
    load = await admit.load(T0)
    assert load.inflow == {"gold": 50.0, "std": 0.0} and load.drain == 100.0
    # 600 tokens ahead at 100 - 50 tokens/s: 12 s, over std's 10 s. Without
    # the inflow it would be 6 s.
    with pytest.raises(WorkQueueOverloaded) as refused:
        await admit.enqueue(item("s", "std", T0, work=100))
    assert refused.value.predicted_wait_s == 12.0
    # Ten seconds on, gold's arrivals have decayed by e and its item was taken.
    [_] = (await admit.claim("n1", 1, T0 + 10, LEASE, drain_rate=100.0)).leases
    await admit.heartbeat("n1", 0, T0 + 10, LEASE, drain_rate=100.0)
    assert (await admit.load(T0 + 10)).inflow["gold"] == pytest.approx(50.0 / math.e)
    await admit.enqueue(item("s", "std", T0 + 10, work=100))


async def test_free_slots_and_dead_nodes(admit):
    # Two slots free, at 1 token/s: as one node counts it, the slots take
    # as much queued work as two items of the newcomer's size, and only what
    # is left over is waited for.
    await admit.heartbeat("n1", 2, T0, 1.0, drain_rate=1.0)
    for name in "abc":
        await admit.enqueue(item(name, "std", T0, work=1000))
    with pytest.raises(WorkQueueOverloaded) as refused:
        await admit.enqueue(item("d", "std", T0, work=1000))
    assert refused.value.predicted_wait_s == 1000.0
    assert (await admit.load(T0)).room == 2
    # Once the node's record runs out nothing drains as far as anyone knows:
    # no prediction, so no refusal (the item waits for a node, or expires).
    await admit.enqueue(item("d", "std", T0 + 1.0, work=1000))
    load = await admit.load(T0 + 1.0)
    assert (load.drain, load.room) == (0.0, 0)
    # Rates add up over the live nodes.
    await admit.heartbeat("n1", 0, T0 + 2, LEASE, drain_rate=100.0)
    await admit.heartbeat("n2", 0, T0 + 2, LEASE, drain_rate=50.5)
    assert (await admit.load(T0 + 2)).drain == 150.5
    await admit.leave("n2")
    assert (await admit.load(T0 + 2)).drain == 100.0


async def test_queued_work_follows_items_out_of_the_queue_and_back(admit):
    for n, tier in enumerate(["gold", "std", "std"]):
        await admit.enqueue(item(f"i{n}", tier, T0, work=100 * (n + 1)))
    assert (await admit.load(T0)).queued_work == {"gold": 100, "std": 500}
    [lease] = (await admit.claim("n1", 1, T0, LEASE)).leases
    assert (await admit.load(T0)).queued_work == {"gold": 0, "std": 500}
    await admit.cancel("i1", T0)
    assert (await admit.load(T0)).queued_work == {"gold": 0, "std": 300}
    await admit.release(lease)
    assert (await admit.load(T0)).queued_work == {"gold": 100, "std": 300}


# -- a fair latency tier: arrival order, and fairness at the door ----------------

# std refuses late work at the door (a latency objective) under vtc; gold has
# no budget, so its counters order it.
DOOR = FleetTiers.of(
    {"gold": 0, "std": 1}, interval_s=INTERVAL, max_boost=2, fair=True, budgets={"std": 10.0},
)  # fmt: skip
door = each_store(DOOR)


async def test_a_fair_latency_tier_releases_by_arrival_and_still_charges_counters(door):
    assert DOOR.doors == {"std"}
    for tier in ("gold", "std"):
        for i in range(3):
            await door.enqueue(item(f"{tier}-a{i}", tier, T0 + i, tenant="a", charge=10.0))
        await door.enqueue(item(f"{tier}-b0", tier, T0 + 5, tenant="b", charge=10.0))
    # gold by counters: b, behind on service, before a's older items.
    assert await ids(door, T0 + 6, 4) == ["gold-a0", "gold-b0", "gold-a1", "gold-a2"]
    # std as admitted: every admitted item is expected to start within the
    # budget in this order; another order only makes some of them expire.
    assert await ids(door, T0 + 6) == ["std-a0", "std-a1", "std-a2", "std-b0"]
    assert await door.counters("std") == {"a": 30.0, "b": 10.0}


async def _flood(store: WorkQueue, count: int) -> None:
    """One live node, full, draining 100 tokens/s; tenant `flood` queues
    `count` items of 100 tokens in std: the last waits count seconds."""
    await store.heartbeat("n1", 0, T0, LEASE, drain_rate=100.0)
    for i in range(count):
        await store.enqueue(item(f"f{i}", "std", T0 + i / 1000, tenant="flood", charge=1.0,
                                 work=100))  # fmt: skip


async def test_a_light_tenants_newcomer_takes_the_newest_place_of_a_flood(door):
    await _flood(door, 10)  # 1 s to 10 s: all within the budget
    channel = f"door-{uuid.uuid4().hex[:6]}"
    listener = None
    if isinstance(door, RedisWorkQueue):
        listener = door.redis.pubsub()
        await listener.subscribe(channel)
    # The flood's next would wait 11 s, and no tenant stands behind it.
    with pytest.raises(WorkQueueOverloaded) as refused:
        await door.enqueue(item("f10", "std", T0 + 0.5, tenant="flood", charge=1.0, work=100))
    assert refused.value.predicted_wait_s == 11.0

    def notice(taken: WorkItem) -> tuple[str, bytes]:
        return channel, b"pushed out:" + taken.id.encode()

    # A light tenant's newcomer would wait 11 s too; the flood stands at 10
    # (no service yet, 10 queued charges of 1), light at 1 with it. The
    # flood's newest leaving makes the room (10 s).
    light = item("l0", "std", T0 + 0.6, tenant="light", charge=1.0, work=100)
    taken = await door.enqueue(light, notice=notice)
    assert taken == item("f9", "std", T0 + 9 / 1000, tenant="flood", charge=1.0, work=100)
    assert await door.status("f9") == "completed"
    assert (await door.load(T0 + 0.6)).queued_work["std"] == 1000
    # Its id stays refused, and no node gets it.
    with pytest.raises(ValueError):
        await door.enqueue(item("f9", "std", T0 + 0.7, tenant="flood"))
    # Light stands at 2 with its second (1 queued, 1 more), the flood at 9:
    # the flood's next newest goes.
    taken = await door.enqueue(item("l1", "std", T0 + 0.8, tenant="light", charge=1.0, work=100))
    assert taken is not None and taken.id == "f8"
    # The flood's own newcomer is still refused: it stands ahead of light.
    with pytest.raises(WorkQueueOverloaded):
        await door.enqueue(item("f11", "std", T0 + 0.9, tenant="flood", charge=1.0, work=100))
    claim = await door.claim("n2", 20, T0 + 1, LEASE)
    assert [lease.item.id for lease in claim.leases] == [f"f{i}" for i in range(8)] + ["l0", "l1"]
    if isinstance(door, MemoryWorkQueue):
        assert door.published == [(channel, b"pushed out:f9")]
        return
    assert listener is not None
    async with asyncio.timeout(5):
        while (message := await listener.get_message(timeout=5.0)) is None or (
            message["type"] != "message"
        ):
            pass
    assert message["data"] == b"pushed out:f9"
    await listener.aclose()


async def test_a_newcomer_takes_no_place_of_a_smaller_item(door):
    await _flood(door, 9)  # 900 tokens queued
    # light's 150-token newcomer would wait 10.5 s. The flood's newest leaving
    # would bring that to 9.5 s, but would leave more work queued than before
    # for whoever comes next: no place is taken.
    with pytest.raises(WorkQueueOverloaded):
        await door.enqueue(item("l0", "std", T0 + 0.6, tenant="light", charge=1.0, work=150))
    assert await door.status("f8") == "queued"
    # 10 s for the flood's own next: admitted outright.
    assert await door.enqueue(item("f9", "std", T0 + 0.7, tenant="flood", charge=1.0,
                                    work=100)) is None  # fmt: skip
    # A 50-token newcomer takes the place of the flood's newest: 950 tokens
    # queued after, not 1,050.
    taken = await door.enqueue(item("l1", "std", T0 + 0.8, tenant="light", charge=1.0, work=50))
    assert taken is not None and taken.id == "f9"
    assert (await door.load(T0 + 0.8)).queued_work["std"] == 950


async def test_a_place_goes_only_where_one_leaving_makes_room_and_never_a_rerun(door):
    await _flood(door, 9)
    # 9 s queued: a newcomer of 300 tokens would wait 12 s, and no single
    # item of 100 leaving makes room for it (11 s).
    with pytest.raises(WorkQueueOverloaded):
        await door.enqueue(item("big", "std", T0 + 1, tenant="light", charge=1.0, work=300))
    assert await door.depth() == {"gold": 0, "std": 9}
    for i in range(9):
        await door.cancel(f"f{i}", T0 + 1)
    # An item that ran once and came back keeps its place, as a preempted
    # request does on one node: g0 (800 tokens) is taken and given back.
    await door.enqueue(item("g0", "std", T0 + 1, tenant="flood", charge=1.0, work=800))
    [lease] = (await door.claim("n1", 1, T0 + 1, LEASE, drain_rate=100.0)).leases
    assert await door.release(lease)
    await door.enqueue(item("g1", "std", T0 + 1.5, tenant="flood", charge=1.0, work=100))
    # 12 s for the newcomer: g1's leaving leaves 11 s; g0's would leave 4 s,
    # but g0 has run.
    with pytest.raises(WorkQueueOverloaded):
        await door.enqueue(item("l0", "std", T0 + 2, tenant="light", charge=1.0, work=300))
    assert await door.status("g0") == "queued"
    assert await door.depth() == {"gold": 0, "std": 2}


async def test_a_place_chosen_from_a_read_is_taken_only_if_still_queued(request):
    # Between the read the door decides on and the enqueue script, the item
    # whose place it was to take left the queue (its client went away): the
    # script refuses to take it, and the door decides again from a new read,
    # where the newcomer now fits outright.
    store = make_queue("redis", request, DOOR)
    try:
        await _flood(store, 10)
        chosen = store._queued_item

        async def gone_meanwhile(item_id: str) -> WorkItem | None:
            found = await chosen(item_id)
            await store.cancel(item_id, T0 + 1)
            store._queued_item = chosen  # once
            return found

        store._queued_item = gone_meanwhile
        light = item("l0", "std", T0 + 1, tenant="light", charge=1.0, work=100)
        assert await store.enqueue(light) is None
        assert await store.status("f9") == "completed"
        assert await store.depth() == {"gold": 0, "std": 10}
    finally:
        await store.close()


# -- session affinity -----------------------------------------------------------


class Wakes:
    """Counts wake messages: the memory store's counter, or what a subscriber
    to the Redis store's wake channel heard. A marker published after the
    operations bounds the read, since one connection's messages keep order."""

    def __init__(self, queue: WorkQueue) -> None:
        self.queue = queue
        self._pubsub = None

    async def __aenter__(self) -> Wakes:
        if isinstance(self.queue, RedisWorkQueue):
            self._pubsub = self.queue.redis.pubsub()
            await self._pubsub.subscribe(self.queue.wake_channel)
            await self._pubsub.get_message(timeout=5.0)  # the subscribe confirmation
        else:
            self._before = self.queue.wakes
        return self

    async def __aexit__(self, *exc: object) -> None:
        if self._pubsub is not None:
            await self._pubsub.aclose()

    async def count(self) -> int:
        if self._pubsub is None:
            count, self._before = self.queue.wakes - self._before, self.queue.wakes
            return count
        await self.queue.redis.publish(self.queue.wake_channel, "marker")
        count = 0
        async with asyncio.timeout(5):
            while True:
                message = await self._pubsub.get_message(timeout=5.0)
                if message is None or message["type"] != "message":
                    continue
                if message["data"] == b"marker":
                    return count
                count += 1


async def test_an_item_is_left_for_the_live_node_its_session_is_bound_to(queue):
    await queue.enqueue(item("s1", "gold", T0, affinity="session:s"))
    assert await ids(queue, T0, 2, "n1") == ["s1"]  # n1 keeps one slot free
    assert await queue.bound_node("session:s") == "n1"
    await queue.enqueue(item("s2", "gold", T0 + 1, affinity="session:s"))
    await queue.enqueue(item("other", "silver", T0 + 1, affinity="session:x"))
    # n2 has room and s2 is more urgent, but n1 is live with room for it.
    claim = await queue.claim("n2", 5, T0 + 2, LEASE)
    assert [lease.item.id for lease in claim.leases] == ["other"]
    assert claim.held_back_until == T0 + LEASE  # n1's last word, a claim at T0
    assert await queue.depth() == {"gold": 1, "silver": 0, "bronze": 0}
    claim = await queue.claim("n1", 1, T0 + 2, LEASE)
    [lease] = claim.leases
    assert lease.item == item("s2", "gold", T0 + 1, affinity="session:s")
    assert (claim.home, claim.away) == ({"s2"}, set())
    assert await queue.bound_node("session:s") == "n1"
    assert await queue.bound_node("session:x") == "n2"


async def test_items_without_a_key_or_bound_elsewhere_full_are_not_held_back(queue):
    await queue.enqueue(item("a", "gold", T0, affinity="session:s"))
    assert await ids(queue, T0, 1, "n1") == ["a"]  # n1 is now full
    await queue.enqueue(item("b", "gold", T0 + 1, affinity="session:s"))
    await queue.enqueue(item("c", "gold", T0 + 2))
    claim = await queue.claim("n2", 5, T0 + 3, LEASE)
    assert [lease.item.id for lease in claim.leases] == ["b", "c"]
    assert claim.held_back_until is None
    assert (claim.home, claim.away) == (set(), {"b"})
    # n1 is still live: the session stays with it for its next request.
    assert await queue.bound_node("session:s") == "n1"


async def test_no_more_is_held_back_than_the_bound_node_has_room_for(queue):
    await queue.enqueue(item("a", "gold", T0, affinity="session:s"))
    assert await ids(queue, T0, 1, "n1") == ["a"]
    await queue.heartbeat("n1", 1, T0 + 1, LEASE)  # a slot came free
    for i, tier in enumerate(["gold", "silver", "gold"]):
        await queue.enqueue(item(f"s{i}", tier, T0 + 2 + i, affinity="session:s"))
    # n1 can take one: the most urgent of its three, s0; the rest go to n2.
    claim = await queue.claim("n2", 5, T0 + 5, LEASE)
    assert [lease.item.id for lease in claim.leases] == ["s2", "s1"]
    assert claim.held_back_until == T0 + 1 + LEASE
    assert await ids(queue, T0 + 5, 5, "n1") == ["s0"]


async def test_a_fair_claim_looks_past_many_tenants_whose_items_are_held_back(fair):
    # Twelve tenants' next turns are each left for n1, which has room for all
    # of them; n2 still finds, behind them, the one item nobody waits for.
    for i in range(12):
        await fair.enqueue(item(f"p{i}", "gold", T0 + i, tenant=f"t{i:02}",
                                affinity=f"session:s{i}"))  # fmt: skip
    assert len(await ids(fair, T0 + 12, 24, "n1")) == 12  # bound; 12 slots left
    for i in range(12):
        await fair.enqueue(item(f"q{i}", "gold", T0 + 13 + i / 10, tenant=f"t{i:02}",
                                affinity=f"session:s{i}"))  # fmt: skip
    await fair.enqueue(item("z", "gold", T0 + 15, tenant="zz"))
    # Counters tie (no charges), so tenants go by name: all twelve t's first.
    assert await ids(fair, T0 + 16, 1, "n2") == ["z"]
    assert sorted(await ids(fair, T0 + 17, 12, "n1")) == sorted(f"q{i}" for i in range(12))


async def test_a_completion_gives_its_node_the_slot_back_at_once(queue):
    await queue.enqueue(item("s1", "gold", T0, affinity="session:s"))
    [lease] = (await queue.claim("n1", 1, T0, LEASE)).leases  # n1 now full
    assert await queue.complete(lease)
    # The session's next turn comes before n1 claims or speaks again: the
    # slot its last turn freed is already counted.
    await queue.enqueue(item("s2", "gold", T0 + 1, affinity="session:s"))
    claim = await queue.claim("n2", 1, T0 + 1, LEASE)
    assert claim.leases == [] and claim.held_back_until == T0 + LEASE
    assert await ids(queue, T0 + 1, 1, "n1") == ["s2"]


async def test_a_silent_node_is_waited_for_only_until_its_last_word_runs_out(queue):
    await queue.enqueue(item("a", "gold", T0, affinity="tenant:acme"))
    assert await ids(queue, T0, 3, "n1") == ["a"]
    await queue.enqueue(item("b", "gold", T0 + 1, affinity="tenant:acme"))
    await queue.heartbeat("n1", 2, T0 + 4, LEASE)
    assert (await queue.claim("n2", 1, T0 + LEASE, LEASE)).held_back_until == T0 + 4 + LEASE
    # n1 said nothing since T0 + 4 (and let a's lease run out): at
    # T0 + 4 + LEASE it no longer counts, and its work goes to n2.
    assert await ids(queue, T0 + 4 + LEASE - 0.001, 2, "n2") == []
    assert await ids(queue, T0 + 4 + LEASE, 2, "n2") == ["a", "b"]
    assert await queue.bound_node("tenant:acme") == "n2"


async def test_a_node_that_leaves_is_not_waited_for(queue):
    await queue.enqueue(item("a", "gold", T0, affinity="session:s"))
    assert await ids(queue, T0, 3, "n1") == ["a"]
    await queue.enqueue(item("b", "gold", T0 + 1, affinity="session:s"))
    assert await ids(queue, T0 + 1, 1, "n2") == []
    async with Wakes(queue) as wakes:
        await queue.leave("n1")
        assert await wakes.count() == 1
        await queue.leave("n1")
        await queue.leave("never-seen")
        assert await wakes.count() == 0
    assert await ids(queue, T0 + 1, 1, "n2") == ["b"]
    assert await queue.bound_node("session:s") == "n2"


async def test_a_node_filling_up_wakes_the_others_only_while_work_waits(queue):
    async with Wakes(queue) as wakes:
        await queue.heartbeat("n1", 2, T0, LEASE)
        await queue.heartbeat("n1", 0, T0, LEASE)
        assert await wakes.count() == 0  # nothing queued: nothing to take
        await queue.enqueue(item("a", "gold", T0, affinity="session:s"))
        await queue.enqueue(item("b", "gold", T0, affinity="session:s"))
        assert await wakes.count() == 2  # the enqueues' own
        await queue.heartbeat("n1", 1, T0, LEASE)
        assert await wakes.count() == 0
        assert await ids(queue, T0, 1, "n1") == ["a"]  # full, b still queued
        assert await wakes.count() == 1
        await queue.heartbeat("n1", 0, T0 + 1, LEASE)  # still full: no news
        assert await wakes.count() == 0
        await queue.heartbeat("n1", 1, T0 + 2, LEASE)
        await queue.heartbeat("n1", 0, T0 + 2, LEASE)
        assert await wakes.count() == 1


async def test_a_binding_is_forgotten_after_the_affinity_ttl(request, queue):
    store = make_queue(type(queue).name, request, affinity_ttl_s=100.0)
    try:
        await store.enqueue(item("a", "gold", T0, affinity="session:s"))
        [lease] = (await store.claim("n1", 1, T0, LEASE)).leases
        assert await store.complete(lease)
        await store.claim("n2", 1, T0 + 100, LEASE)
        assert await store.bound_node("session:s") == "n1"
        await store.claim("n2", 1, T0 + 100.5, LEASE)
        assert await store.bound_node("session:s") is None
    finally:
        await store.close()


# -- both stores, same random operations ---------------------------------------


RATES = [0.0, 35.0, 120.25, 1234.5678, 9000.0]


@pytest.mark.parametrize("fairness", ["fifo", "vtc"])
async def test_stores_agree_on_random_operations_and_lose_nothing(request, fairness):
    # A seed whose run reaches every path, preemption included (it needs a
    # low tier's lease while more urgent work is queued).
    rng = random.Random(20240614)
    # gold and silver refuse late work at the door; bronze and batch age.
    tiers = FleetTiers.of(
        {"gold": 0, "silver": 1, "bronze": 2, "batch": 5}, interval_s=0.75, max_boost=3,
        fair=fairness == "vtc", budgets={"gold": 2.0, "silver": 1.0, "bronze": 0.5, "batch": 0.25},
        delays=["bronze", "batch"], shares={"silver": 0.1, "bronze": 0.1, "batch": 0.05},
        inflow_tau_s=3.0,
    )  # fmt: skip
    stores = [
        make_queue("memory", request, tiers, affinity_ttl_s=6.0),
        make_queue("redis", request, tiers, affinity_ttl_s=6.0),
    ]
    keys = ["session:a", "session:b", "tenant:c"]
    held_back = 0  # claims that left work for another node
    refused = 0  # enqueues refused by admission
    preempted = 0
    wakes = Wakes(stores[1])
    await wakes.__aenter__()
    now = T0 + 0.1
    enqueued: list[str] = []
    completed: set[str] = set()
    # Every lease ever handed out, per store, stale ones included.
    leases: list[tuple[Lease, Lease]] = []

    async def both(method: str, *args, **kwargs):
        results = []
        for store in stores:
            try:
                results.append(await getattr(store, method)(*args, **kwargs))
            except ValueError as exc:
                results.append(("ValueError", str(exc)))
            except WorkQueueOverloaded as exc:
                results.append(("overloaded", exc.predicted_wait_s, exc.budget_s))
        assert results[0] == results[1], results
        return results

    try:
        for step in range(300):
            roll = rng.random()
            if roll < 0.3:
                fresh = rng.random() > 0.1 or not enqueued
                item_id = f"r{len(enqueued)}" if fresh else rng.choice(enqueued)
                work = WorkItem(
                    id=item_id,
                    tier=rng.choice(tiers.names()),
                    tenant=rng.choice(["a", "b", "c"]),
                    arrival=now - rng.uniform(-0.2, 4.0),
                    payload=rng.randbytes(rng.randrange(0, 8)),
                    affinity=rng.choice(["", *keys]),
                    charge=rng.choice([0.0, 0.1, 1.25, 10.0, 33.3]),
                    work=rng.choice([0, 40, 300, 1200]),
                )
                [answer, _] = await both("enqueue", work)
                if isinstance(answer, tuple) and answer[0] == "overloaded":
                    refused += 1
                elif fresh:
                    enqueued.append(item_id)
                if isinstance(answer, WorkItem):
                    # It took this one's place at its tier's door: ended.
                    assert answer.id not in completed, "ended twice"
                    completed.add(answer.id)
            elif roll < 0.5:
                node = rng.choice(["n1", "n2", "n3"])
                max_items, lease_s = rng.randrange(0, 4), rng.choice([0.5, 1.0, 2.5])
                got = await both("claim", node, max_items, now, lease_s, drain_rate=rng.choice(RATES))
                leases += zip(got[0].leases, got[1].leases)
                held_back += got[0].held_back_until is not None
            elif roll < 0.55:
                node = rng.choice(["n1", "n2", "n3"])
                if rng.random() < 0.8:
                    await both(
                        "heartbeat", node, rng.randrange(0, 3), now, rng.choice([0.5, 2.5]),
                        drain_rate=rng.choice(RATES),
                    )
                else:
                    await both("leave", node)
            elif roll < 0.6 and enqueued:
                target = rng.choice(enqueued)
                only_queued = rng.random() < 0.3
                [was, _] = await both("cancel", target, now, only_queued=only_queued)
                if was == "queued" or (was == "leased" and not only_queued):
                    assert target not in completed, "ended twice"
                    completed.add(target)
            elif roll < 0.85 and leases:
                action = rng.choice(["renew", "complete", "complete", "release", "preempt"])
                # An engine node sends back runs of the tiers that age.
                low = [p for p in leases if p[0].item.tier in ("bronze", "batch")]
                pair = rng.choice(low if action == "preempt" and low else leases)
                if action == "renew":
                    lease_s = rng.choice([0.5, 2.0])
                    got = [await s.renew(pair[i], now, lease_s) for i, s in enumerate(stores)]
                    assert got[0] == got[1]
                    if got[0] is not None:
                        leases.append((got[0], got[1]))
                elif action == "complete":
                    used = rng.choice([None, 0.0, 0.7, 12.5, 40.1])
                    got = [await s.complete(pair[i], used=used) for i, s in enumerate(stores)]
                    assert got[0] == got[1]
                    if got[0]:
                        assert pair[0].item.id not in completed, "completed twice"
                        completed.add(pair[0].item.id)
                elif action == "release":
                    got = [await s.release(pair[i]) for i, s in enumerate(stores)]
                    assert got[0] == got[1]
                else:
                    got = [await s.preempt(pair[i], now) for i, s in enumerate(stores)]
                    assert got[0] == got[1]
                    preempted += got[0]
            else:
                now += rng.choice([0.0, 0.25, 0.5, 0.75, 1.0, 2.0])

            depth, leased = await both("depth"), await both("leased")
            await both("next_expiry")
            await both("load", now)
            for key in keys:
                await both("bound_node", key)
            for tier in tiers.names():
                await both("counters", tier)
            for store in stores:
                statuses = [await store.status(i) for i in enqueued]
                assert None not in statuses, f"step {step}: an item was lost"
                assert statuses.count("queued") == sum(depth[0].values())
                assert statuses.count("leased") == leased[0]
                assert {i for i, s in zip(enqueued, statuses) if s == "completed"} == completed
        assert completed and leases and held_back and refused and preempted, (
            "the run exercised too little", len(completed), len(leases), held_back, refused,
            preempted,
        )
        assert await wakes.count() == stores[0].wakes
    finally:
        await wakes.__aexit__()
        for store in stores:
            await store.close()
