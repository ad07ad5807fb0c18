"""The `WorkQueue` port and its in-process implementation."""

from __future__ import annotations

import dataclasses
import heapq
import itertools
from abc import ABC, abstractmethod
from typing import Literal

from .model import FleetTiers, Lease, WorkItem, pick_tier

ItemStatus = Literal["queued", "leased", "completed"]


class WorkQueueError(Exception):
    """The store could not be reached or did not answer in time."""


class WorkQueueFull(Exception):
    """The item's tier already holds as many queued items as it may."""


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

    def __init__(self, tiers: FleetTiers, *, done_retention_s: float = 86_400.0) -> None:
        self.tiers = tiers
        self.done_retention_s = done_retention_s
        """How long an ended item's id is remembered (refusing a duplicate
        enqueue) after its last lease ran out or it was cancelled."""

    def _check_tier(self, item: WorkItem) -> None:
        if item.tier not in self.tiers:
            raise ValueError(f"unknown tier {item.tier!r}")

    @abstractmethod
    async def enqueue(self, item: WorkItem, *, max_queued: int | None = None) -> None:
        """Queue `item`; ValueError if its id was enqueued here before (queued,
        leased or ended within `done_retention_s`), so nothing runs twice;
        WorkQueueFull if its tier already holds `max_queued` queued items.
        Wakes idle engine nodes."""

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
    async def claim(self, node: str, max_items: int, now: float, lease_s: float) -> list[Lease]:
        """Return expired leases' items to their queues, then lease up to
        `max_items` to `node`, each from the tier `pick_tier` names at that
        moment, until `now + lease_s`."""

    @abstractmethod
    async def renew(self, lease: Lease, now: float, lease_s: float) -> Lease | None:
        """Extend a lease to `now + lease_s`; None if it was lost (reclaimed
        by a `claim` after expiring, released, or completed)."""

    @abstractmethod
    async def complete(self, lease: Lease, reply: tuple[str, bytes] | None = None) -> bool:
        """End the item for good: True exactly once, for the current holder.
        With `reply` (channel, message), the message is published in the same
        step, so the gateway hears of the end if and only if it happened."""

    @abstractmethod
    async def next_expiry(self) -> float | None:
        """When the first live lease runs out (None: no leases): when a
        claim would next find work to take back from a silent node."""

    @abstractmethod
    async def release(self, lease: Lease) -> bool:
        """Give the item back at once, at its original arrival (a node
        shutting down); False if the lease was already lost."""

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


@dataclasses.dataclass(slots=True)
class _Held:
    item: WorkItem
    node: str
    token: int
    expires_at: float


class MemoryWorkQueue(WorkQueue):
    """One process's queues: for tests, the simulator and single-node use."""

    name = "memory"

    def __init__(self, tiers: FleetTiers, *, done_retention_s: float = 86_400.0) -> None:
        super().__init__(tiers, done_retention_s=done_retention_s)
        # Heaps of (arrival, id, item): the same order as a Redis sorted set
        # scored by arrival, whose ties go by member.
        self._queues: dict[str, list[tuple[float, str, WorkItem]]] = {
            name: [] for name in tiers.names()
        }
        self._held: dict[str, _Held] = {}
        # Ended ids -> when they ended (as the Redis store scores them).
        self._completed: dict[str, float] = {}
        self._queued: dict[str, WorkItem] = {}
        self._tokens = itertools.count(1)
        self.published: list[tuple[str, bytes]] = []
        """Replies `complete` published, in order (Redis publishes them)."""
        self.wakes = 0
        """Enqueues that would have woken idle engine nodes."""

    async def enqueue(self, item: WorkItem, *, max_queued: int | None = None) -> None:
        self._check_tier(item)
        if item.id in self._queued or item.id in self._held or item.id in self._completed:
            raise ValueError(f"duplicate work item id {item.id!r}")
        if max_queued is not None and len(self._queues[item.tier]) >= max_queued:
            raise WorkQueueFull(f"tier {item.tier!r} holds {max_queued} queued items")
        self._push(item)
        self.wakes += 1

    async def cancel(
        self, item_id: str, now: float, *, only_queued: bool = False
    ) -> ItemStatus | None:
        item = self._queued.pop(item_id, None)
        if item is not None:
            queue = self._queues[item.tier]
            queue.remove((item.arrival, item.id, item))
            heapq.heapify(queue)
            self._completed[item_id] = now
            return "queued"
        if item_id in self._held:
            if not only_queued:
                del self._held[item_id]
                self._completed[item_id] = now
            return "leased"
        return "completed" if item_id in self._completed else None

    def _push(self, item: WorkItem) -> None:
        heapq.heappush(self._queues[item.tier], (item.arrival, item.id, item))
        self._queued[item.id] = item

    def _requeue(self, held: _Held) -> None:
        del self._held[held.item.id]
        self._push(dataclasses.replace(held.item, attempt=held.item.attempt + 1))

    async def claim(self, node: str, max_items: int, now: float, lease_s: float) -> list[Lease]:
        for held in [h for h in self._held.values() if h.expires_at <= now]:
            self._requeue(held)
        horizon = now - self.done_retention_s
        for item_id in [i for i, at in self._completed.items() if at < horizon]:
            del self._completed[item_id]
        leases: list[Lease] = []
        expires_at = now + lease_s
        while len(leases) < max_items:
            heads = {name: q[0][0] for name, q in self._queues.items() if q}
            tier = pick_tier(self.tiers, heads, now)
            if tier is None:
                break
            _, _, item = heapq.heappop(self._queues[tier])
            del self._queued[item.id]
            token = next(self._tokens)
            self._held[item.id] = _Held(item, node, token, expires_at)
            leases.append(Lease(item, node, token, expires_at))
        return leases

    def _current(self, lease: Lease) -> _Held | None:
        held = self._held.get(lease.item.id)
        return held if held is not None and held.token == lease.token else None

    async def renew(self, lease: Lease, now: float, lease_s: float) -> Lease | None:
        held = self._current(lease)
        if held is None:
            return None
        held.expires_at = now + lease_s
        return Lease(held.item, held.node, held.token, held.expires_at)

    async def complete(self, lease: Lease, reply: tuple[str, bytes] | None = None) -> bool:
        held = self._current(lease)
        if held is None:
            return False
        del self._held[held.item.id]
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
