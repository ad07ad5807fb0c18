"""The `WorkQueue` port and its in-process implementation."""

from __future__ import annotations

import bisect
import dataclasses
import itertools
from abc import ABC, abstractmethod
from collections.abc import Callable, Sequence
from typing import Literal

from qosgate.core import ordering
from qosgate.core.admission import ArrivalRate
from qosgate.core.fairness import fits_place, gives_place, lifted
from qosgate.core.scheduler import PUSHOUT_CANDIDATES
from qosgate.runtime.errors import WorkQueueFull, WorkQueueOverloaded

from .model import (
    NO_PREFILL_LIMIT,
    Claim,
    FleetLoad,
    FleetTiers,
    Lease,
    Prefill,
    TierStandings,
    WorkItem,
    choose_tier,
    predicted_wait,
    settle_shares,
)

ItemStatus = Literal["queued", "leased", "completed"]

Notice = Callable[[WorkItem], tuple[str, bytes] | None]
"""What to publish, as (channel, message), to the gateway of a queued item
whose place a newcomer took; None: nothing."""

QueuedEntry = tuple[str, int, float, int]
"""A queued item as the door weighs it: id, attempt, charge and work."""

_DOOR_PAGE = 16
"""A tenant's queued items read at a time, newest first, at the door."""


def milli(rate: float) -> int:
    """A node's drain rate as stored: whole thousandths of a token per second,
    so that summing the nodes' rates is exact in any order (in Lua too)."""
    return max(0, round(rate * 1000.0))


class WorkQueue(ABC):
    """Per-tier queues shared by gateway replicas and engine nodes.

    Every method that depends on time takes the wall-clock `now` (seconds
    since the epoch) from the caller: replicas and nodes sharing a store must
    agree on arrivals and lease expiries, and tests drive the clock.

    An item is always exactly one of queued, leased or completed; a lease
    that expires puts its item back (at its original arrival) at the next
    `claim`, so a node that dies loses no work, and fencing tokens stop the
    dead node from completing what another node now holds.
    """

    name: str = ""

    def __init__(
        self,
        tiers: FleetTiers,
        *,
        done_retention_s: float = 86_400.0,
        affinity_ttl_s: float = 600.0,
    ) -> None:
        self.tiers = tiers
        self.done_retention_s = done_retention_s
        """How long an ended item's id is remembered (refusing a duplicate
        enqueue) after its last lease ran out or it was cancelled."""
        self.affinity_ttl_s = affinity_ttl_s
        """How long an affinity key stays bound to a node after the last
        claim of an item with that key."""

    def _check_tier(self, item: WorkItem) -> None:
        if item.tier not in self.tiers:
            raise ValueError(f"unknown tier {item.tier!r}")

    def _refusal(self, item: WorkItem, load: FleetLoad) -> WorkQueueOverloaded | None:
        """Admission, at the item's arrival, by the core's rule
        (model.predicted_wait), for a tier that admits by prediction."""
        tier = self.tiers.tier(item.tier)
        predicted = predicted_wait(self.tiers, item.tier, item.work, load, item.arrival)
        if predicted is None or tier.budget_s is None or predicted <= tier.budget_s:
            return None
        return WorkQueueOverloaded(item.tier, predicted, tier.budget_s)

    async def _place_for(self, item: WorkItem, load: FleetLoad) -> str | None:
        """At the door of a fair tier that admits by prediction, for `item`,
        which the prediction over `load` refuses: the id of the queued item
        whose place it takes, if any. One node's rule (Scheduler._push_out
        over fairness.CountedFifoOrder.pushout): candidates are the items of
        the tenants ahead of its own (TierStandings.ahead), each tenant's
        newest first, never one that ran before (it keeps its place) or one
        smaller than the newcomer (fairness.fits_place), and only where its
        tenant stays at or ahead (fairness.gives_place); of the first
        PUSHOUT_CANDIDATES of them, the first whose leaving brings the
        prediction within the budget."""
        budget = self.tiers.tier(item.tier).budget_s
        if item.tier not in self.tiers.doors or budget is None:
            return None
        standings = await self._standings(item.tier, item.tenant)
        mine = standings.mine(item.tenant, item.charge)
        tried = 0
        for standing, tenant in standings.ahead(item.tenant, mine):
            start = 0
            while True:
                page = await self._newest(item.tier, tenant, start, _DOOR_PAGE)
                for queued_id, attempt, charge, work in page:
                    if (attempt or not fits_place(item.work, work)
                            or not gives_place(standing, charge, mine)):
                        continue
                    if tried == PUSHOUT_CANDIDATES:
                        return None
                    tried += 1
                    queued_work = {**load.queued_work}
                    queued_work[item.tier] = queued_work.get(item.tier, 0) - work
                    after = predicted_wait(
                        self.tiers, item.tier, item.work,
                        dataclasses.replace(load, queued_work=queued_work), item.arrival,
                    )  # fmt: skip
                    if after is not None and after <= budget:
                        return queued_id
                if len(page) < _DOOR_PAGE:
                    break
                start += _DOOR_PAGE
        return None

    @abstractmethod
    async def _standings(self, tier: str, tenant: str) -> TierStandings:
        """A door tier's tenants as they stand, for a newcomer of `tenant`."""

    @abstractmethod
    async def _newest(self, tier: str, tenant: str, start: int, count: int) -> list[QueuedEntry]:
        """Up to `count` of `tenant`'s items queued in `tier`, newest first
        (by arrival, then id), skipping the first `start`."""

    @abstractmethod
    async def enqueue(
        self, item: WorkItem, *, max_queued: int | None = None, notice: Notice | None = None
    ) -> WorkItem | None:
        """Queue `item`; ValueError if its id was enqueued here before (queued,
        leased or ended within `done_retention_s`), so nothing runs twice;
        WorkQueueFull if its tier already holds `max_queued` queued items;
        WorkQueueOverloaded if its tier admits by prediction and
        `model.predicted_wait` (at `item.arrival`) exceeds the tier's budget,
        unless, in a fair tier, it takes the place of a queued item
        (`_place_for`). That one then ends as if cancelled (its id stays
        refused) and is returned; `notice(it)` says what to publish to its
        gateway in the same step. Adds `item.work` to its tier's queued work
        and arrival rate. Wakes idle engine nodes."""

    @abstractmethod
    async def cancel(
        self, item_id: str, now: float, *, only_queued: bool = False
    ) -> ItemStatus | None:
        """End an item wherever it is (its client went away): out of its
        queue, or its lease voided so that the holder's renew and complete
        fail. With `only_queued` (its queue budget ran out), a leased item is
        left running. Returns where it was; an item that had already
        completed stays completed."""

    @abstractmethod
    async def claim(
        self, node: str, max_items: int, now: float, lease_s: float, *, drain_rate: float = 0.0,
        prefill: Prefill = NO_PREFILL_LIMIT, held_for_arrivals: int = 0,
    ) -> Claim:
        """Return expired leases' items to their queues, then lease up to
        `max_items` to `node`, each from the tier `choose_tier` names at that
        moment (below the top level only while more of the node's room is
        left than the tiers' `reserve_slots` and the `held_for_arrivals` the
        node keeps for the top level's expected arrivals, core.arrivals_hold:
        `Claim.at_reserve` says it stopped there), until `now + lease_s`, leaving items for the live
        nodes their affinity keys are bound to while those have room (see
        model.py), and leaving queued what `node`'s prefill queue has no room
        for (`prefill`, by ordering.prefill_holds: `Claim.held_for_prefill`
        and `Claim.paced` say it did). Binds a taken item's key to `node`
        unless a live node has it, and records `node` as live until `now +
        lease_s` with the room it has left (`max_items` less what it took),
        whether it held work below the top level back (for its prefill
        budget, or at its reserved slots: room for the top level only, as
        one node's scheduler leaves a blocked level none), and the tokens/s it
        drains when full (`drain_rate`; 0: unknown), which admission sums
        over the live nodes."""

    @abstractmethod
    async def heartbeat(
        self, node: str, room: int, now: float, ttl_s: float, *, drain_rate: float = 0.0
    ) -> None:
        """Record `node` as live until `now + ttl_s` with `room` free slots and
        `drain_rate` (as `claim` does): how long, and for how many items,
        other nodes hold its affinity work back for it. A node whose room
        falls to 0 while work is queued wakes the others, which may now take
        what they held back."""

    @abstractmethod
    async def leave(self, node: str) -> None:
        """Forget `node`'s record (it is stopping): nothing is held back for
        it any more, and if it had room while work is queued, the other
        nodes are woken to take it."""

    @abstractmethod
    async def bound_node(self, key: str) -> str | None:
        """The node an affinity key is bound to, if any."""

    @abstractmethod
    async def renew(self, lease: Lease, now: float, lease_s: float) -> Lease | None:
        """Extend a lease to `now + lease_s`; None if it was lost (reclaimed
        by a `claim` after expiring, released, or completed)."""

    async def renew_all(
        self, leases: Sequence[Lease], now: float, lease_s: float
    ) -> list[Lease | None]:
        """`renew` each of `leases`, in order. A node may hold hundreds of
        runs and must renew them all well within a third of its lease: a
        store that can does it in one round trip."""
        return [await self.renew(lease, now, lease_s) for lease in leases]

    @abstractmethod
    async def complete(
        self, lease: Lease, reply: tuple[str, bytes] | None = None, *, used: float | None = None
    ) -> bool:
        """End the item for good: True exactly once, for the current holder.
        With `reply` (channel, message), the message is published in the same
        step, so the gateway hears of the end if and only if it happened.
        The holder's room record gains the slot the run held.
        With `used` (fair tiers), the tenant's counter is settled: it was
        charged `item.charge` at the claim and now counts `used` instead."""

    @abstractmethod
    async def counters(self, tier: str) -> dict[str, float]:
        """Fair tiers: the virtual token counter of every tenant seen in `tier`."""

    @abstractmethod
    async def next_expiry(self) -> float | None:
        """When the first live lease runs out (None: no leases): when a
        claim would next find work to take back from a silent node."""

    @abstractmethod
    async def release(self, lease: Lease) -> bool:
        """Give the item back at once, at its original arrival (a node
        shutting down); False if the lease was already lost."""

    @abstractmethod
    async def load(self, now: float) -> FleetLoad:
        """What admission sees at `now`: queued work and arrival rate per
        tier, and the live nodes' drain rate and room."""

    @abstractmethod
    async def preempt(self, lease: Lease, now: float) -> bool:
        """Give a running item back to its queue, at its original arrival and
        with its charge refunded (as `release`), to make room for more urgent
        work, if that is still needed: when the items queued in tiers that
        outrank the item's outnumber the free slots of the live nodes. The
        holder's room record gains the slot. False (and nothing changes) if
        the lease was lost or no such work is left uncovered."""

    @abstractmethod
    async def depth(self) -> dict[str, int]:
        """Queued items per tier (every tier, zeros included)."""

    @abstractmethod
    async def leased(self) -> int:
        """Items under a lease, expired or not, that no claim has reclaimed yet."""

    @abstractmethod
    async def status(self, item_id: str) -> ItemStatus | None:
        """Where an item is; None if it was never enqueued."""

    async def close(self) -> None:
        """Release connections."""


class MemoryWorkQueue(WorkQueue):
    """One process's queues: for tests, the simulator and single-node use."""

    name = "memory"

    def __init__(self, tiers: FleetTiers, **retention: float) -> None:
        """`retention`: WorkQueue's done_retention_s and affinity_ttl_s."""
        super().__init__(tiers, **retention)
        # Sorted lists of (arrival, id, item): the same order as a Redis
        # sorted set scored by arrival, whose ties go by member. Lists, not
        # heaps, because a claim may step past items held back for others.
        self._queues: dict[str, list[tuple[float, str, WorkItem]]] = {
            name: [] for name in tiers.names()
        }
        # Item id -> its live lease, as last renewed.
        self._held: dict[str, Lease] = {}
        # Ended ids -> when they ended (as the Redis store scores them).
        self._completed: dict[str, float] = {}
        self._queued: dict[str, WorkItem] = {}
        self._tokens = itertools.count(1)
        # Node -> (room, live until, drain rate in milli-tokens/s);
        # affinity key -> (node, when bound).
        self._nodes: dict[str, tuple[int, float, int]] = {}
        self._bound: dict[str, tuple[str, float]] = {}
        # Nodes whose last claim held work below the top level back (for
        # their prefill budget, or at their reserved slots): their room is
        # the top level's only.
        self._top_only: set[str] = set()
        # Fair tiers: tier -> tenant -> its queued items (only backlogged
        # tenants have a lane), tier -> tenant -> counter, tier -> the
        # counter last served.
        self._lanes: dict[str, dict[str, list[tuple[float, str, WorkItem]]]] = {
            name: {} for name in tiers.names()
        }
        self._counters: dict[str, dict[str, float]] = {name: {} for name in tiers.names()}
        self._served: dict[str, float] = {}
        # Door tiers: tier -> backlogged tenant -> charges of its queued items.
        self._queued_charge: dict[str, dict[str, float]] = {name: {} for name in tiers.doors}
        # Admission: tier -> tokens queued, tier -> arrival rate.
        self._work = dict.fromkeys(tiers.names(), 0)
        self._inflow = {name: ArrivalRate(tiers.inflow_tau_s) for name in tiers.names()}
        # Tier -> its guaranteed share's credit (tiers with work queued).
        self._credits: dict[str, float] = {}
        self.published: list[tuple[str, bytes]] = []
        """Replies `complete` published, in order (Redis publishes them)."""
        self.wakes = 0
        """Enqueues that would have woken idle engine nodes."""

    async def enqueue(
        self, item: WorkItem, *, max_queued: int | None = None, notice: Notice | None = None
    ) -> WorkItem | None:
        self._check_tier(item)
        if item.id in self._queued or item.id in self._held or item.id in self._completed:
            raise ValueError(f"duplicate work item id {item.id!r}")
        if max_queued is not None and len(self._queues[item.tier]) >= max_queued:
            raise WorkQueueFull(item.tier, max_queued)
        taken = None
        if item.tier in self.tiers.admitting:
            load = self._load(item.arrival)
            refusal = self._refusal(item, load)
            if refusal is not None:
                place = await self._place_for(item, load)
                if place is None:
                    raise refusal
                taken = self._queued.pop(place)
                self._unqueue(taken)
                self._completed[place] = item.arrival
                reply = notice(taken) if notice is not None else None
                if reply is not None:
                    self.published.append(reply)
        self._push(item)
        self._inflow[item.tier].add(item.work, item.arrival)
        self.wakes += 1
        return taken

    async def _standings(self, tier: str, tenant: str) -> TierStandings:
        counters = self._counters[tier]
        return TierStandings(
            counters={t: counters[t] for t in self._lanes[tier]},
            queued=dict(self._queued_charge[tier]),
            own=counters.get(tenant, 0.0),
            served=self._served.get(tier, 0.0),
        )

    async def _newest(self, tier: str, tenant: str, start: int, count: int) -> list[QueuedEntry]:
        lane = self._lanes[tier].get(tenant, [])
        end = len(lane) - start
        return [(i.id, i.attempt, i.charge, i.work)
                for _, _, i in reversed(lane[max(0, end - count):max(0, end)])]  # fmt: skip

    def _load(self, now: float) -> FleetLoad:
        drain = 0
        rooms: list[int] = []
        held: list[int] = []
        for node, (node_room, until, rate) in self._nodes.items():
            if until > now:
                drain += rate
                (held if node in self._top_only else rooms).append(node_room)
        return FleetLoad(
            queued_work=dict(self._work),
            inflow={name: rate.rate(now) for name, rate in self._inflow.items()},
            drain=drain / 1000.0,
            rooms=tuple(sorted(rooms)),
            oldest={name: queue[0][0] for name, queue in self._queues.items() if queue},
            held_rooms=tuple(sorted(held)),
        )

    async def load(self, now: float) -> FleetLoad:
        return self._load(now)

    async def cancel(
        self, item_id: str, now: float, *, only_queued: bool = False
    ) -> ItemStatus | None:
        item = self._queued.pop(item_id, None)
        if item is not None:
            self._unqueue(item)
            self._completed[item_id] = now
            return "queued"
        if item_id in self._held:
            if not only_queued:
                del self._held[item_id]
                self._completed[item_id] = now
            return "leased"
        return "completed" if item_id in self._completed else None

    def _push(self, item: WorkItem) -> None:
        entry = (item.arrival, item.id, item)
        bisect.insort(self._queues[item.tier], entry)
        self._queued[item.id] = item
        self._work[item.tier] += item.work
        if self.tiers.fair:
            lanes = self._lanes[item.tier]
            charges = self._queued_charge.get(item.tier)
            if item.tenant not in lanes:
                counters = self._counters[item.tier]
                counters[item.tenant] = lifted(
                    counters.get(item.tenant, 0.0),
                    min((counters[t] for t in lanes), default=None),
                    self._served.get(item.tier, 0.0),
                )
                lanes[item.tenant] = []
                if charges is not None:
                    charges[item.tenant] = 0.0
            bisect.insort(lanes[item.tenant], entry)
            if charges is not None:
                charges[item.tenant] += item.charge

    def _unqueue(self, item: WorkItem) -> None:
        entry = (item.arrival, item.id, item)
        self._queues[item.tier].remove(entry)
        self._work[item.tier] -= item.work
        if not self._queues[item.tier]:
            self._credits.pop(item.tier, None)
        if self.tiers.fair:
            lanes = self._lanes[item.tier]
            lanes[item.tenant].remove(entry)
            charges = self._queued_charge.get(item.tier)
            if not lanes[item.tenant]:
                del lanes[item.tenant]
                if charges is not None:
                    # Emptied: what is left of the sum is rounding.
                    del charges[item.tenant]
            elif charges is not None:
                charges[item.tenant] -= item.charge

    def _add_service(self, tier: str, tenant: str, amount: float) -> float:
        counters = self._counters[tier]
        counters[tenant] = counters.get(tenant, 0.0) + amount
        return counters[tenant]

    def _requeue(self, held: Lease) -> None:
        del self._held[held.item.id]
        item = held.item
        if self.tiers.fair:
            self._add_service(item.tier, item.tenant, -item.charge)  # a refund
        self._push(dataclasses.replace(item, attempt=item.attempt + 1))

    def _candidate(
        self, tier: str, skipped: dict[tuple[str, str], int]
    ) -> tuple[WorkItem, tuple[str, str]] | None:
        """The next item of `tier` this claim may consider, and where its
        tier's (or tenant's) items held back so far are counted."""
        if not self.tiers.fair or tier in self.tiers.doors:
            # By arrival; a door tier's counters act at its door.
            queue, at = self._queues[tier], skipped.get((tier, ""), 0)
            return (queue[at][2], (tier, "")) if at < len(queue) else None
        counters = self._counters[tier]
        open_lanes = [
            (counters[t], t) for t, lane in self._lanes[tier].items()
            if skipped.get((tier, t), 0) < len(lane)
        ]  # fmt: skip
        if not open_lanes:
            return None
        _, tenant = min(open_lanes)
        at = skipped.get((tier, tenant), 0)
        return self._lanes[tier][tenant][at][2], (tier, tenant)

    async def counters(self, tier: str) -> dict[str, float]:
        return dict(self._counters[tier])

    async def claim(
        self, node: str, max_items: int, now: float, lease_s: float, *, drain_rate: float = 0.0,
        prefill: Prefill = NO_PREFILL_LIMIT, held_for_arrivals: int = 0,
    ) -> Claim:
        # In the Redis store's order (by lease end, then id): under fairness,
        # each refund and lift depends on the ones before it.
        expired = sorted(
            (h for h in self._held.values() if h.expires_at <= now),
            key=lambda h: (h.expires_at, h.item.id),
        )
        for held in expired:
            self._requeue(held)
        horizon = now - self.done_retention_s
        for item_id in [i for i, at in self._completed.items() if at < horizon]:
            del self._completed[item_id]
        horizon = now - self.affinity_ttl_s
        for key in [k for k, (_, at) in self._bound.items() if at < horizon]:
            del self._bound[key]
        for other in [n for n, (_, until, _) in self._nodes.items() if until <= now]:
            del self._nodes[other]
            self._top_only.discard(other)
        # How many more items each other live node has room for, and so may
        # still have held back for it.
        reserve = {n: room for n, (room, _, _) in self._nodes.items() if n != node and room > 0}
        held_back_until: float | None = None
        at_reserve = False
        home: set[str] = set()
        away: set[str] = set()
        # Items held back so far, per tier (FIFO) or per tier and tenant
        # (fair): always the first ones of their lane.
        skipped: dict[tuple[str, str], int] = {}
        passed: set[str] = set()  # tiers with nothing left for this node
        leases: list[Lease] = []
        expires_at = now + lease_s
        prefilling, held, paced = prefill.tokens, False, False
        while len(leases) < max_items:
            heads = {name: q[0][2] for name, q in self._queues.items() if q and name not in passed}
            chosen = choose_tier(self.tiers, heads, now, self._credits)
            if chosen is None:
                break
            tier, level = chosen
            if ordering.reserve_holds(level, self.tiers.top_level, max_items - len(leases),
                                      self.tiers.reserve_slots + held_for_arrivals):
                at_reserve = True
                break
            candidate = self._candidate(tier, skipped)
            if candidate is None:
                passed.add(tier)
                continue
            item, lane = candidate
            owner = self._bound[item.affinity][0] if item.affinity in self._bound else ""
            if owner and owner != node and reserve.get(owner, 0) > 0:
                reserve[owner] -= 1
                skipped[lane] = skipped.get(lane, 0) + 1
                until = self._nodes[owner][1]
                held_back_until = until if held_back_until is None else min(held_back_until, until)
                continue
            wait = ordering.prefill_holds(
                self.tiers.tier(tier), level, self.tiers.top_level, item.prompt, prefilling,
                prefill.budget, prefill.pace, held=held, paced=paced,
            )  # fmt: skip
            if wait is not None:
                held, paced = held or wait == "budget", paced or wait == "pace"
                passed.add(tier)
                continue
            prefilling += item.prompt
            self._unqueue(item)
            del self._queued[item.id]
            settle_shares(
                self.tiers, self._credits, {n: len(q) for n, q in self._queues.items()},
                tier, item.work,
            )  # fmt: skip
            if self.tiers.fair:
                self._served[tier] = self._add_service(tier, item.tenant, item.charge)
            if owner:
                (home if owner == node else away).add(item.id)
            if item.affinity:
                # A live owner keeps its key even when another node ran this
                # one (it was full): flipping the binding on every spill would
                # leave items held back for a node that has just claimed.
                owner = owner if owner in self._nodes else node
                self._bound[item.affinity] = (owner, now)
            self._held[item.id] = lease = Lease(item, node, next(self._tokens), expires_at)
            leases.append(lease)
        self._set_room(node, max_items - len(leases), expires_at, milli(drain_rate))
        if held or at_reserve:
            self._top_only.add(node)
        else:
            self._top_only.discard(node)
        return Claim(leases, held_back_until, frozenset(home), frozenset(away), at_reserve,
                     held, paced)  # fmt: skip

    def _set_room(self, node: str, room: int, until: float, rate: int) -> None:
        before = self._nodes.get(node, (0, 0.0, 0))[0]
        self._nodes[node] = (room, until, rate)
        self._wake_if_full(before, room)

    def _wake_if_full(self, before: int, room: int) -> None:
        # Others hold work back for a node only while it has room: once it is
        # full they may take that work, and must hear that they may.
        if before > 0 and room <= 0 and any(self._queues.values()):
            self.wakes += 1

    async def heartbeat(
        self, node: str, room: int, now: float, ttl_s: float, *, drain_rate: float = 0.0
    ) -> None:
        self._set_room(node, max(0, room), now + ttl_s, milli(drain_rate))

    async def leave(self, node: str) -> None:
        room, _, _ = self._nodes.pop(node, (0, 0.0, 0))
        self._top_only.discard(node)
        self._wake_if_full(room, 0)

    async def bound_node(self, key: str) -> str | None:
        bound = self._bound.get(key)
        return bound[0] if bound is not None else None

    def _current(self, lease: Lease) -> Lease | None:
        held = self._held.get(lease.item.id)
        return held if held is not None and held.token == lease.token else None

    async def renew(self, lease: Lease, now: float, lease_s: float) -> Lease | None:
        held = self._current(lease)
        if held is None:
            return None
        renewed = self._held[lease.item.id] = dataclasses.replace(held, expires_at=now + lease_s)
        return renewed

    async def complete(
        self, lease: Lease, reply: tuple[str, bytes] | None = None, *, used: float | None = None
    ) -> bool:
        held = self._current(lease)
        if held is None:
            return False
        del self._held[held.item.id]
        # Before the gateway hears of the end (and perhaps sends the
        # session's next turn).
        self._give_slot_back(held.node)
        if self.tiers.fair and used is not None:
            item = held.item
            self._add_service(item.tier, item.tenant, used - item.charge)
        self._completed[held.item.id] = held.expires_at
        if reply is not None:
            self.published.append(reply)
        return True

    async def next_expiry(self) -> float | None:
        return min((h.expires_at for h in self._held.values()), default=None)

    async def release(self, lease: Lease) -> bool:
        held = self._current(lease)
        if held is None:
            return False
        self._requeue(held)
        return True

    async def preempt(self, lease: Lease, now: float) -> bool:
        held = self._current(lease)
        if held is None:
            return False
        mine = self.tiers.tier(held.item.tier).priority
        urgent = sum(len(self._queues[t.name]) for t in self.tiers.tiers if t.priority < mine)
        if not ordering.preemption_needed(urgent, self._load(now).room):
            return False
        self._requeue(held)
        self._give_slot_back(held.node)
        return True

    def _give_slot_back(self, node: str) -> None:
        """A run's slot is free again: its node's record says so at once."""
        if node in self._nodes:
            room, until, rate = self._nodes[node]
            self._nodes[node] = (room + 1, until, rate)

    async def depth(self) -> dict[str, int]:
        return {name: len(q) for name, q in self._queues.items()}

    async def leased(self) -> int:
        return len(self._held)

    async def status(self, item_id: str) -> ItemStatus | None:
        if item_id in self._queued:
            return "queued"
        if item_id in self._held:
            return "leased"
        if item_id in self._completed:
            return "completed"
        return None
