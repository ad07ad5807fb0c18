"""Distributed mode, sans I/O: what a shared work queue holds and which tier
an engine node takes from next.

Gateway replicas put requests into one queue per tier in a shared store;
engine nodes pull the globally most urgent work when they have room. The
rules are the single node's, from qosgate/core (ordering.pick_tier and
share_credit, admission.predicted_wait, fairness.lifted and
fairness.service, ahead_at_door and gives_place): the shared queue is a
storage strategy under them. The Redis store's scripts restate the tier
choice, the share credit, what waits for a first token under a node's
prefill budget (ordering.prefill_holds), the arrival-rate update and the VTC
lift, which
must run inside Redis to be atomic, and keep the sums of queued charges a
fair latency tier's door reads; tests/test_fleet_rules_differential.py
holds them to the core.

A tier's level counts from its oldest queued item, whoever it is held back
for (below); a tier with nothing the claiming node may take is passed over.
Within a fair tier (`fairness: vtc`) the tenant with the smallest counter
goes next, ties by tenant name, and its items by arrival (ties by id); a
tenant is charged the item's `charge` when a node takes it, corrected at
completion and refunded when the lease is lost or released. A fair tier that
admits by prediction (`FleetTiers.admitting`) goes by arrival instead, as
one node's (fairness.CountedFifoOrder), and its counters act at its door: a
newcomer the prediction refuses may take the place of one queued item of a
tenant further ahead (`TierStandings`, `WorkQueue.enqueue`).

Session affinity: an item may carry an affinity key (its session, or its
tenant). The first node to claim an item with a key is bound to it, so that
its prefix cache holds the conversation. A claim by any other node leaves
such an item for the bound node while that node is live (its last claim or
heartbeat is less than a lease old) and has room, as many items as it has
room for, in claim order; past that (the bound node is saturated or already
has its fill) the item goes to whoever claims, and the key stays bound to its
live node. A key whose node is no longer live is bound to the next node that
takes one of its items. So affinity changes only which node runs an item,
never whether the most urgent work runs now: every item held back is one
the bound node, having room, takes at once.

Where the fleet differs from one node: docs/FLEET.md.
"""

from __future__ import annotations

import dataclasses
import struct
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from typing import Literal

from qosgate.config.models import PolicyConfig
from qosgate.config.scheduling import scheduling_policy
from qosgate.core import admission, ordering
from qosgate.core.fairness import ahead_at_door, lifted, service
from qosgate.core.policy import Ageing, SchedulingPolicy, TierParams, with_age_floors


@dataclass(frozen=True, slots=True)
class WorkItem:
    """One request waiting for, or held by, an engine node."""

    id: str
    tier: str
    tenant: str
    arrival: float
    """Wall-clock seconds when the gateway first queued it; kept across
    re-queues so that a lost lease does not send the item to the back."""
    payload: bytes
    attempt: int = 0
    """How many leases of this item ended without completing it."""
    affinity: str = ""
    """Key of the node this item prefers (session or tenant); empty: none."""
    charge: float = 0.0
    """Virtual service its tenant is charged when a node takes it (fair
    tiers): estimated weighted tokens over the tenant's weight."""
    work: int = 0
    """Tokens it is expected to take (prompt + expected output): what it adds
    to its tier's queued work, which admission divides by the drain rate."""
    prompt: int = 0
    """Its prompt's tokens: what it adds to its node's prefill queue (a
    claim's prefill budget, `Prefill`)."""


@dataclass(frozen=True, slots=True)
class Lease:
    """A node's claim on an item until `expires_at` unless renewed."""

    item: WorkItem
    node: str
    token: int
    """Fencing token, increasing per store: after a lease is lost and the item
    re-leased, only the newer token can complete or renew it."""
    expires_at: float


@dataclass(frozen=True, slots=True)
class Prefill:
    """A claiming node's prefill queue and the limits on it: the core's
    prefill budget and delay tiers' pace (ordering.prefill_holds), resolved
    against that node's backend."""

    tokens: int = 0
    """Prompt tokens the node sent to its backend that have no first token yet."""
    budget: int | None = None
    """Below the top level, what may be in prefill (None: no limit)."""
    pace: int | None = None
    """For tiers without a latency objective, the same (None: no limit)."""


NO_PREFILL_LIMIT = Prefill()


@dataclass(frozen=True, slots=True)
class Claim:
    """What one claim took, and when to claim again if it left work behind."""

    leases: list[Lease]
    held_back_until: float | None = None
    """Set when the claim left items for other nodes (affinity): the first
    instant one of those nodes stops counting as live unless it speaks again,
    so a node that died holding nothing is not waited for longer than that."""
    home: frozenset[str] = frozenset()
    """Ids of the items taken whose affinity key was bound to this node (the
    node ran their session before: its prefix cache may hold it)."""
    away: frozenset[str] = frozenset()
    """Ids of the items taken whose key was bound to another node (that one
    was full or is gone)."""
    at_reserve: bool = False
    """It stopped at the node's reserved slots (ordering.reserve_holds) with
    work below the top level still queued: to that work the node is full."""
    held_for_prefill: bool = False
    """It left work below the top level queued for the node's prefill budget
    (ordering.prefill_holds): that work waits for a first token, not a slot."""
    paced: bool = False
    """It left work of a tier without a latency objective queued for the
    delay tiers' pace: that too waits for a first token."""

    def placement(self, item_id: str) -> Literal["home", "away", "new"]:
        """Where a taken item's key was bound: here, elsewhere, or nowhere."""
        if item_id in self.home:
            return "home"
        return "away" if item_id in self.away else "new"


@dataclass(frozen=True, slots=True)
class FleetTiers:
    """The inputs of the tier choice. `tiers` is in (priority, name) order,
    the order ties are settled in, so both stores iterate it as given."""

    tiers: tuple[TierParams, ...]
    interval_s: float
    max_boost: int
    fair: bool = False
    """Keep a virtual token counter (VTC) per tenant in each tier: it orders
    the tenants of a tier without a latency objective, and acts at the door
    of one with (`doors`), which goes by arrival."""
    inflow_tau_s: float = 10.0
    """Time constant of each tier's arrival-rate average (admission)."""
    admitting: frozenset[str] = frozenset()
    """Tiers that refuse at enqueue an item whose predicted wait exceeds
    their budget."""
    reserve_slots: int = 0
    """Of a node's free slots, how many only top-level work may take (the
    core's reserve, per engine node as per backend on one node)."""

    def __post_init__(self) -> None:
        if not self.tiers:
            raise ValueError("at least one tier")
        if len({t.name for t in self.tiers}) != len(self.tiers):
            raise ValueError("duplicate tier name")
        if self.interval_s <= 0 or self.max_boost < 0:
            raise ValueError("aging interval must be > 0 and max_boost >= 0")
        if self.inflow_tau_s <= 0:
            raise ValueError("inflow_tau_s must be > 0")
        if self.reserve_slots < 0:
            raise ValueError("reserve_slots must be >= 0")
        floored = with_age_floors({t.name: t for t in self.tiers}).values()
        ordered = tuple(sorted(floored, key=lambda t: (t.priority, t.name)))
        object.__setattr__(self, "tiers", ordered)

    @classmethod
    def of(
        cls,
        priorities: Mapping[str, int],
        *,
        interval_s: float,
        max_boost: int,
        fair: bool = False,
        budgets: Mapping[str, float] | None = None,
        delays: Iterable[str] = (),
        shares: Mapping[str, float] | None = None,
        admission: bool = True,
        inflow_tau_s: float = 10.0,
        reserve_slots: int = 0,
    ) -> FleetTiers:
        """Tiers by priority. A tier in `budgets` has that queue budget; one
        in `delays` ages past it, any other refuses late work at the door
        when `admission`; one in `shares` has that guaranteed share."""
        budgets, shares = budgets or {}, shares or {}
        delays = frozenset(delays)
        return cls(
            tuple(TierParams(n, p, budgets.get(n), n in delays, min_share=shares.get(n, 0.0))
                  for n, p in priorities.items()),
            interval_s,
            max_boost,
            fair,
            inflow_tau_s,
            frozenset(n for n in budgets if admission and n not in delays),
            reserve_slots,
        )

    @classmethod
    def from_config(cls, policy: PolicyConfig) -> FleetTiers:
        return cls.from_policy(scheduling_policy(policy))

    @classmethod
    def from_policy(cls, policy: SchedulingPolicy) -> FleetTiers:
        """As one node reads the policy; `fcfs` is one FIFO by the head's age."""
        if policy.tiered:
            tiers = tuple(policy.tiers.values())
        else:
            tiers = tuple(TierParams(t.name, 0, None, False) for t in policy.tiers.values())
        return cls(
            tiers,
            policy.interval_s,
            policy.ageing.max_boost,
            policy.fair,
            policy.drain_rate_tau_s,
            frozenset(t.name for t in tiers
                      if policy.admission and t.budget_s is not None and not t.delays),
            policy.held_slots,
        )

    @property
    def doors(self) -> frozenset[str]:
        """The fair tiers that admit by prediction: they release by arrival,
        and their counters act at the door (fairness.CountedFifoOrder)."""
        return self.admitting if self.fair else frozenset()

    @property
    def ageing(self) -> Ageing:
        return Ageing(self.interval_s, self.max_boost)

    @property
    def top_level(self) -> int:
        return min(t.priority for t in self.tiers)

    def tier(self, name: str) -> TierParams:
        for tier in self.tiers:
            if tier.name == name:
                return tier
        raise KeyError(name)

    def names(self) -> tuple[str, ...]:
        return tuple(t.name for t in self.tiers)

    def __contains__(self, name: object) -> bool:
        return any(t.name == name for t in self.tiers)


def choose_tier(
    tiers: FleetTiers,
    oldest: Mapping[str, WorkItem | float],
    now: float,
    credits: Mapping[str, float] | None = None,
) -> tuple[str, int] | None:
    """The tier to take the next item from, given each non-empty tier's oldest
    item (or its arrival alone: no share is owed) and the tiers' share credits
    (the core's ordering.pick_tier): its name and the level it competes at.
    None when every tier is empty."""
    credits = credits or {}
    heads = [
        (t, head, False) if isinstance(head, float)
        else (t, head.arrival, ordering.share_owed(credits.get(t.name, 0.0), head.work))
        for t in tiers.tiers if (head := oldest.get(t.name)) is not None
    ]  # fmt: skip
    chosen = ordering.pick_tier(heads, now, tiers.ageing)
    if chosen is None:
        return None
    tier, level = chosen
    return tier.name, level


def pick_tier(
    tiers: FleetTiers,
    oldest: Mapping[str, WorkItem | float],
    now: float,
    credits: Mapping[str, float] | None = None,
) -> str | None:
    """The name `choose_tier` gives."""
    chosen = choose_tier(tiers, oldest, now, credits)
    return chosen[0] if chosen is not None else None


def settle_shares(
    tiers: FleetTiers, credits: dict[str, float], queued: Mapping[str, int], taken: str, work: int
) -> None:
    """After an item of `work` tokens of tier `taken` went to a node: every
    tier with a share and work queued (`queued`: tier -> items) settles its
    credit as the core's ordering.share_credit says, as one node's scheduler
    does at each release (none for a release of a tier with a latency
    objective: ordering.settles_shares). A tier whose queue empties drops its
    credit."""
    if not ordering.settles_shares(tiers.tier(taken)):
        return
    for tier in tiers.tiers:
        if tier.min_share > 0 and queued.get(tier.name, 0) > 0:
            credits[tier.name] = ordering.share_credit(
                credits.get(tier.name, 0.0), tier.min_share, work, taken=tier.name == taken
            )


@dataclass(frozen=True, slots=True)
class FleetLoad:
    """What a store knows of the fleet's load at an enqueue."""

    queued_work: Mapping[str, int]
    """Tier -> tokens (prompt + expected output) of its queued items."""
    inflow: Mapping[str, float]
    """Tier -> tokens/s of new work arriving there (an exponential average)."""
    drain: float
    """Tokens/s the live engine nodes complete, summed (0: none reports)."""
    rooms: tuple[int, ...]
    """Free sequence slots of each live engine node whose last claim held
    nothing back below the top level (`held_rooms`), fewest first."""
    oldest: Mapping[str, float] = dataclasses.field(default_factory=dict)
    """Tier -> arrival of its oldest queued item (non-empty tiers)."""
    held_rooms: tuple[int, ...] = ()
    """Free sequence slots of each live node whose last claim held work below
    the top level back, for its prefill budget (Claim.held_for_prefill) or at
    its reserved slots, the slots it keeps for the top level's expected
    arrivals included (Claim.at_reserve): room for top-level work only, as
    one node's backend is while a level below the top is held or blocked."""

    @property
    def room(self) -> int:
        """Free sequence slots of the live engine nodes, summed."""
        return sum(self.rooms) + sum(self.held_rooms)


@dataclass(frozen=True, slots=True)
class _TierLoad:
    """One tier as admission reads it from a FleetLoad (admission.TierLoad)."""

    priority: int
    delays: bool
    budget_s: float | None
    work: int
    oldest_arrival: float | None
    inflow: float

    def inflow_rate(self, now: float) -> float:
        return self.inflow


def predicted_wait(
    tiers: FleetTiers, tier: str, work: int, load: FleetLoad, now: float
) -> float | None:
    """How long an item of `work` tokens entering `tier` at `now` is expected
    to wait before a node takes it: one node's rule (admission.predicted_wait)
    over the fleet, where the nodes' free slots that it may take
    (ordering.open_slots) are its room. None when no live node reports a
    drain rate (no evidence, so no refusal)."""
    if load.drain <= 0.0:
        return None
    views = [
        _TierLoad(t.priority, t.delays, t.budget_s, load.queued_work.get(t.name, 0),
                  load.oldest.get(t.name), load.inflow.get(t.name, 0.0))
        for t in tiers.tiers
    ]  # fmt: skip
    priority = tiers.tier(tier).priority
    reserved = ordering.has_reserve(priority, tiers.top_level, tiers.reserve_slots)
    # Below the top level a node holding work back (for its prefill budget, or
    # at the slots it keeps for the top level) does not take a newcomer at
    # once, whatever its free slots (as on one node).
    rooms = load.rooms + load.held_rooms if priority <= tiers.top_level else load.rooms
    room = sum(ordering.open_slots(priority, tiers.top_level, free, tiers.reserve_slots)
               for free in rooms)  # fmt: skip
    return admission.predicted_wait(
        priority, work, views, now,
        own_slot=room <= 0 and not reserved, room_work=room * work, drain=load.drain,
    )  # fmt: skip


@dataclass(frozen=True, slots=True)
class TierStandings:
    """A fair tier's tenants as its door reads them: where each stands in its
    fair share (fairness.CountedFifoOrder.standing), with charges already
    over the tenant's weight."""

    counters: Mapping[str, float]
    """Backlogged tenant (something queued) -> its counter."""
    queued: Mapping[str, float]
    """Backlogged tenant -> the charges of its queued items, summed."""
    own: float
    """The newcomer's tenant's counter (0 for a tenant never seen)."""
    served: float
    """The counter last served in the tier."""

    def _standing(self, tenant: str) -> float:
        return self.counters[tenant] + self.queued.get(tenant, 0.0)

    def mine(self, tenant: str, charge: float) -> float:
        """Where `tenant` stands with a newcomer of `charge` queued: lifted
        as it would be at the push if it has nothing queued."""
        if tenant in self.counters:
            return self._standing(tenant) + charge
        floor = min(self.counters.values(), default=None)
        return lifted(self.own, floor, self.served) + charge

    def ahead(self, tenant: str, mine: float) -> list[tuple[float, str]]:
        """The tenants whose items a newcomer of `tenant` standing at `mine`
        may take the place of, furthest ahead first (fairness.ahead_at_door)."""
        standings = ((self._standing(t), t) for t in self.counters if t != tenant)
        return ahead_at_door(standings, mine)


def lane_key(item: WorkItem) -> str:
    """The item's place among its tenant's items in a fair tier, as a string
    whose byte order is (tenant, arrival, id): what the Redis store sorts
    lexically. The big-endian bytes of a positive double sort as the number."""
    return f"{item.tenant}\x00{struct.pack('>d', item.arrival).hex()}\x00{item.id}"


class ServiceMeter:
    """Virtual service, as the in-process VTC counts it: weighted tokens over
    the tenant's weight (1 for a tenant the policy does not list)."""

    def __init__(self, policy: SchedulingPolicy) -> None:
        self._policy = policy

    def __call__(self, tenant: str, prompt_tokens: int, output_tokens: int) -> float:
        p = self._policy
        return service(p.w_in, p.w_out, prompt_tokens, output_tokens) / p.weight(tenant)
