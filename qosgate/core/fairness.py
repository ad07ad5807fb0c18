"""Who goes next inside one tier: FIFO, or weighted virtual token counters (VTC).

Both orders keep lazy-deletion heaps: a request that leaves the queue out of
turn (cancelled, expired) is only marked, and skipped when it reaches the top.
That keeps removal by id O(1) here and O(log n) amortised overall, and the
heaps are rebuilt when dead entries outnumber live ones so memory stays
proportional to what is queued.
"""

from __future__ import annotations

import heapq
from typing import Protocol

from qosgate.core.request import Request, RequestState

_QUEUED = RequestState.QUEUED


class FairnessOrder(Protocol):
    """Port: the order in which one tier's queued requests are released."""

    def push(self, req: Request) -> None: ...

    def discard(self, req: Request) -> None:
        """`req` left the queue out of turn (already marked not queued)."""

    def peek(self) -> Request | None: ...

    def pop(self) -> Request: ...

    def on_dispatch(self, req: Request, charge: float) -> None:
        """`req` was released; `charge` is its virtual service estimate. Called
        after every `pop`, with 0 for a request that left without service."""

    def on_settle(self, req: Request, correction: float) -> None:
        """`req` finished; `correction` is actual minus estimated service."""

    def counters(self) -> dict[str, float]: ...


def _key(req: Request) -> tuple[int, int]:
    # A client-lowered request sorts after its tier's ordinary ones; admission
    # order breaks ties, so a requeued request keeps its original place.
    return (req.priority_offset, req.seq)


class _Lane:
    """A lazy-deletion heap of requests ordered by (priority_offset, seq)."""

    __slots__ = ("heap", "live")

    def __init__(self) -> None:
        self.heap: list[tuple[int, int, Request]] = []
        self.live = 0

    def push(self, req: Request) -> None:
        heapq.heappush(self.heap, (req.priority_offset, req.seq, req))
        self.live += 1

    def discard(self) -> None:
        self.live -= 1
        if len(self.heap) > 64 and len(self.heap) > 2 * self.live:
            self.heap = [entry for entry in self.heap if entry[2].state is _QUEUED]
            heapq.heapify(self.heap)

    def peek(self) -> Request | None:
        heap = self.heap
        while heap:
            req = heap[0][2]
            if req.state is _QUEUED:
                return req
            heapq.heappop(heap)
        return None

    def pop(self) -> Request:
        req = self.peek()
        if req is None:
            raise IndexError("pop from an empty lane")
        heapq.heappop(self.heap)
        self.live -= 1
        return req


class FifoOrder:
    """Admission order (client-lowered requests after the rest); no tenant fairness."""

    def __init__(self) -> None:
        self._lane = _Lane()

    def push(self, req: Request) -> None:
        self._lane.push(req)

    def discard(self, req: Request) -> None:
        self._lane.discard()

    def peek(self) -> Request | None:
        return self._lane.peek()

    def pop(self) -> Request:
        return self._lane.pop()

    def on_dispatch(self, req: Request, charge: float) -> None:
        pass

    def on_settle(self, req: Request, correction: float) -> None:
        pass

    def counters(self) -> dict[str, float]:
        return {}


class VtcOrder:
    """Virtual token counters (Sheng et al., "Fairness in Serving Large Language
    Models", OSDI 2024): the backlogged tenant with the smallest counter goes next.

    A tenant's counter grows by the service it receives divided by its weight.
    Service is charged at dispatch from the estimate and corrected at settlement,
    so a tenant cannot get ahead by asking for large outputs it has not yet
    produced. A tenant that becomes backlogged is lifted to the smallest counter
    among backlogged tenants, so time spent idle cannot be banked as credit.
    """

    def __init__(self, weights: dict[str, float] | None = None) -> None:
        self._weights = dict(weights or {})
        self._counter: dict[str, float] = {}
        self._lanes: dict[str, _Lane] = {}
        # (counter, version, tenant); an entry is current iff its version matches.
        self._heap: list[tuple[float, int, str]] = []
        self._version: dict[str, int] = {}
        self._last_served = 0.0

    def set_weights(self, weights: dict[str, float]) -> None:
        self._weights = dict(weights)

    def weight(self, tenant: str) -> float:
        return self._weights.get(tenant, 1.0)

    def _min_backlogged(self) -> float | None:
        heap = self._heap
        while heap:
            counter, version, tenant = heap[0]
            if self._version.get(tenant) == version and self._lanes[tenant].live > 0:
                return counter
            heapq.heappop(heap)
        return None

    def _schedule_tenant(self, tenant: str) -> None:
        version = self._version.get(tenant, 0) + 1
        self._version[tenant] = version
        heapq.heappush(self._heap, (self._counter[tenant], version, tenant))

    def push(self, req: Request) -> None:
        tenant = req.tenant
        lane = self._lanes.get(tenant)
        if lane is None:
            lane = self._lanes[tenant] = _Lane()
            self._counter[tenant] = 0.0
        if lane.live == 0:
            floor = self._min_backlogged()
            if floor is None:
                floor = self._last_served
            if self._counter[tenant] < floor:
                self._counter[tenant] = floor
            lane.push(req)
            self._schedule_tenant(tenant)
        else:
            lane.push(req)

    def discard(self, req: Request) -> None:
        self._lanes[req.tenant].discard()

    def _next_tenant(self) -> str | None:
        if self._min_backlogged() is None:
            return None
        return self._heap[0][2]

    def peek(self) -> Request | None:
        tenant = self._next_tenant()
        if tenant is None:
            return None
        return self._lanes[tenant].peek()

    def pop(self) -> Request:
        tenant = self._next_tenant()
        if tenant is None:
            raise IndexError("pop from an empty tier")
        heapq.heappop(self._heap)
        lane = self._lanes[tenant]
        req = lane.pop()
        if lane.live == 0:
            self._version[tenant] += 1
        # Still backlogged: on_dispatch, which always follows, re-enters the
        # tenant with its grown counter.
        return req

    def on_dispatch(self, req: Request, charge: float) -> None:
        tenant = req.tenant
        counter = self._counter[tenant] + charge / self.weight(tenant)
        self._counter[tenant] = counter
        self._last_served = counter
        if self._lanes[tenant].live > 0:
            self._schedule_tenant(tenant)

    def on_settle(self, req: Request, correction: float) -> None:
        tenant = req.tenant
        if tenant not in self._counter or correction == 0.0:
            return
        self._counter[tenant] += correction / self.weight(tenant)
        if self._lanes[tenant].live > 0:
            self._schedule_tenant(tenant)

    def counters(self) -> dict[str, float]:
        return dict(self._counter)

    def backlogged_counters(self) -> dict[str, float]:
        return {t: c for t, c in self._counter.items() if self._lanes[t].live > 0}
