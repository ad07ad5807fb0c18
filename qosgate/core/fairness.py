"""Who goes next inside one tier: FIFO, or weighted virtual token counters (VTC).

Both orders keep requests in lanes with lazy deletion: a request that leaves
the queue out of turn (cancelled, expired) is only marked, and skipped when it
reaches the front. That keeps removal by id O(1), and lanes are swept when
dead entries outnumber live ones so memory stays proportional to what is
queued. VTC picks the next tenant from a heap of counters, O(log tenants).
"""

from __future__ import annotations

import heapq
from bisect import insort
from collections import deque
from typing import Callable, Iterable, Iterator, Protocol

from qosgate.core.request import Request, RequestState

_QUEUED = RequestState.QUEUED


def service(w_in: float, w_out: float, prompt_tokens: int, output_tokens: int) -> float:
    """Weighted tokens of service, before the tenant's weight divides them."""
    return w_in * prompt_tokens + w_out * output_tokens


def lifted(counter: float, backlogged_min: float | None, last_served: float) -> float:
    """The counter of a tenant that becomes backlogged: lifted to the
    smallest counter among the backlogged (or, if none, the counter last
    served), so time spent idle cannot be banked as credit."""
    floor = last_served if backlogged_min is None else backlogged_min
    return floor if counter < floor else counter


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


class _Lane:
    """Queued requests in release order: by priority offset, then admission order.

    One deque per offset (nearly always only offset 0), so arrivals append and
    releases pop from the left in O(1), touching one node: with a deep queue
    the request released was admitted long ago and its memory is cold, which
    a heap's sift pays for at every level. A request leaving out of turn is
    only marked, skipped when it reaches the front, and swept out when the
    dead outnumber the live.
    """

    __slots__ = ("groups", "offsets", "live", "dead")

    def __init__(self) -> None:
        self.groups: dict[int, deque[Request]] = {}
        self.offsets: list[int] = []
        """Offsets present, ascending."""
        self.live = 0
        self.dead = 0

    def push(self, req: Request) -> None:
        offset = req.priority_offset
        group = self.groups.get(offset)
        if group is None:
            group = self.groups[offset] = deque()
            insort(self.offsets, offset)
        if group and group[-1].seq > req.seq:
            # A preempted request goes back to its place by admission order
            # (rare, and near the front: a short scan).
            index = 0
            while group[index].seq < req.seq:
                index += 1
            group.insert(index, req)
        else:
            group.append(req)
        self.live += 1

    def discard(self, req: Request | None = None) -> None:
        """A request left out of turn (which one does not matter: it is marked)."""
        self.live -= 1
        self.dead += 1
        if self.dead > 64 and self.dead > self.live:
            for offset, group in self.groups.items():
                self.groups[offset] = deque(r for r in group if r.state is _QUEUED)
            self.dead = 0

    def peek(self) -> Request | None:
        for offset in self.offsets:
            group = self.groups[offset]
            while group:
                req = group[0]
                if req.state is _QUEUED:
                    return req
                group.popleft()
                self.dead -= 1
        return None

    def pop(self) -> Request:
        req = self.peek()
        if req is None:
            raise IndexError("pop from an empty lane")
        self.groups[req.priority_offset].popleft()
        self.live -= 1
        return req


class FifoOrder(_Lane):
    """Admission order (client-lowered requests after the rest), one lane for
    the tier; no tenant fairness."""

    __slots__ = ()

    def on_dispatch(self, req: Request, charge: float) -> None:
        pass

    def on_settle(self, req: Request, correction: float) -> None:
        pass

    def counters(self) -> dict[str, float]:
        return {}


class _Tenant:
    """One tenant's VTC state inside a tier."""

    __slots__ = ("name", "counter", "weight", "lane", "stamp")

    def __init__(self, name: str, weight: float) -> None:
        self.name = name
        self.counter = 0.0
        self.weight = weight
        self.lane = _Lane()
        self.stamp = 0
        """Stamp of its current heap entry (older entries are stale)."""


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
        self._tenants: dict[str, _Tenant] = {}
        # (counter, stamp, tenant): stamps are unique, so tenants never compare.
        self._heap: list[tuple[float, int, _Tenant]] = []
        self._stamps = 0
        self._last_served = 0.0

    def weight(self, tenant: str) -> float:
        return self._weights.get(tenant, 1.0)

    def set_weights(self, weights: dict[str, float]) -> None:
        """New weights (a policy reload): counters already earned stand; what
        is served from now on is divided by the new weight."""
        self._weights = dict(weights)
        for state in self._tenants.values():
            state.weight = self.weight(state.name)

    def _top(self) -> _Tenant | None:
        """The backlogged tenant with the smallest counter, with its entry current.

        Entries may lag behind a counter that has since grown (dispatch and
        settlement raise counters without touching the heap): such an entry is
        re-sifted with the current value when it reaches the top, one sift
        instead of a push per change. Counters that shrink are re-entered at
        once (on_settle), so no entry is ever too high."""
        heap = self._heap
        while heap:
            counter, stamp, state = heap[0]
            if state.stamp != stamp or state.lane.live == 0:
                heapq.heappop(heap)
            elif state.counter > counter:
                heapq.heapreplace(heap, (state.counter, stamp, state))
            else:
                return state
        return None

    def _enter(self, state: _Tenant) -> None:
        self._stamps += 1
        state.stamp = self._stamps
        heapq.heappush(self._heap, (state.counter, self._stamps, state))

    def push(self, req: Request) -> None:
        state = self._tenants.get(req.tenant)
        if state is None:
            state = self._tenants[req.tenant] = _Tenant(req.tenant, self.weight(req.tenant))
        if state.lane.live == 0:
            top = self._top()
            state.counter = lifted(
                state.counter, top.counter if top is not None else None, self._last_served
            )
            state.lane.push(req)
            self._enter(state)
        else:
            state.lane.push(req)

    def discard(self, req: Request) -> None:
        self._tenants[req.tenant].lane.discard()

    def peek(self) -> Request | None:
        state = self._top()
        return state.lane.peek() if state is not None else None

    def pop(self) -> Request:
        state = self._top()
        if state is None:
            raise IndexError("pop from an empty tier")
        # Its entry stays at the top: if it is still backlogged, the charge
        # on_dispatch adds makes the entry lag and _top re-sifts it; if not,
        # _top drops it.
        return state.lane.pop()

    def on_dispatch(self, req: Request, charge: float) -> None:
        state = self._tenants[req.tenant]
        state.counter += charge / state.weight
        self._last_served = state.counter

    def on_settle(self, req: Request, correction: float) -> None:
        state = self._tenants.get(req.tenant)
        if state is None or correction == 0.0:
            return
        state.counter += correction / state.weight
        if correction < 0.0 and state.lane.live > 0:
            # A refund moves the tenant forward: its lagging entry would be too
            # late, so enter it again now.
            self._enter(state)

    def counters(self) -> dict[str, float]:
        return {name: state.counter for name, state in self._tenants.items()}

    def backlogged_counters(self) -> dict[str, float]:
        return {name: st.counter for name, st in self._tenants.items() if st.lane.live > 0}


class _Share:
    """One tenant's counter, and what it has queued, in a tier whose release
    order is admission order (CountedFifoOrder)."""

    __slots__ = ("counter", "weight", "queued", "live", "service")

    def __init__(self, weight: float) -> None:
        self.counter = 0.0
        self.weight = weight
        self.queued: deque[Request] = deque()
        """Its queued requests in admission order, with some that left
        (skipped by state, trimmed from the front)."""
        self.live = 0
        """How many of them are still queued."""
        self.service = 0.0
        """Their estimated service (the charge each would be dispatched with)."""


class CountedFifoOrder(_Lane):
    """Admission order, with VTC's counters kept for the door.

    For a tier that admits by its predicted wait (a latency objective):
    every request it admits is expected to start within the tier's budget in
    admission order, so releasing in another order only makes admitted
    requests expire. Fairness acts where such a tier chooses, at the door: a
    newcomer that would be refused may take the place of one queued request
    of a tenant further ahead, at least as large as it (`pushout`,
    `gives_place`, `fits_place`). A tenant's standing is its counter
    (service received over its weight, lifted as in VtcOrder) plus what it
    has queued, over its weight.

    Only backlogged tenants are looked at, and in a tier that admits by its
    wait they are few: its queue holds at most a budget's worth of work.
    """

    __slots__ = ("_weights", "_shares", "_backlogged", "_last_served", "_charge")

    def __init__(self, weights: dict[str, float] | None,
                 charge: Callable[[Request], float]) -> None:
        super().__init__()
        self._weights = dict(weights or {})
        self._shares: dict[str, _Share] = {}
        self._backlogged: dict[str, _Share] = {}
        self._last_served = 0.0
        self._charge = charge

    def weight(self, tenant: str) -> float:
        return self._weights.get(tenant, 1.0)

    def set_weights(self, weights: dict[str, float]) -> None:
        self._weights = dict(weights)
        for name, share in self._shares.items():
            share.weight = self.weight(name)

    def _lifted(self, counter: float) -> float:
        """`counter` as lifted if its tenant became backlogged now."""
        floor = min((s.counter for s in self._backlogged.values()), default=None)
        return lifted(counter, floor, self._last_served)

    def standing(self, tenant: str, extra: float = 0.0) -> float:
        """Where the tenant stands with `extra` more service queued: its
        counter (as it would be lifted now, if it has nothing queued) plus
        its queued service, over its weight."""
        share = self._backlogged.get(tenant)
        if share is not None:
            return share.counter + (share.service + extra) / share.weight
        idle = self._shares.get(tenant)
        counter = self._lifted(idle.counter if idle is not None else 0.0)
        return counter + extra / self.weight(tenant)

    def push(self, req: Request) -> None:
        share = self._shares.get(req.tenant)
        if share is None:
            share = self._shares[req.tenant] = _Share(self.weight(req.tenant))
        if not share.live:
            share.counter = self._lifted(share.counter)
            self._backlogged[req.tenant] = share
        share.queued.append(req)
        share.live += 1
        share.service += self._charge(req)
        super().push(req)

    def _unqueue(self, req: Request) -> None:
        share = self._shares[req.tenant]
        share.live -= 1
        if not share.live:
            del self._backlogged[req.tenant]
            share.queued.clear()
            share.service = 0.0
            return
        share.service -= self._charge(req)
        queued = share.queued
        if queued[0] is req:
            queued.popleft()
        while queued[0].state is not _QUEUED:
            queued.popleft()

    def discard(self, req: Request | None = None) -> None:
        if req is not None:
            self._unqueue(req)
        super().discard(req)

    def pop(self) -> Request:
        req = super().pop()
        self._unqueue(req)
        return req

    def on_dispatch(self, req: Request, charge: float) -> None:
        share = self._shares[req.tenant]
        share.counter += charge / share.weight
        self._last_served = share.counter

    def on_settle(self, req: Request, correction: float) -> None:
        share = self._shares.get(req.tenant)
        if share is not None:
            share.counter += correction / share.weight

    def counters(self) -> dict[str, float]:
        return {name: share.counter for name, share in self._shares.items()}

    def pushout(self, tenant: str, extra: float, work: int) -> Iterator[Request]:
        """Queued requests whose place a newcomer of `tenant` with `extra`
        service and `work` tokens may take: from the tenant furthest ahead
        on, each tenant's newest first, those at least as large as it
        (`fits_place`) whose tenant stays at or ahead of the newcomer's once
        they leave and it comes in."""
        mine = self.standing(tenant, extra)
        standings = ((self.standing(name), name) for name in self._backlogged if name != tenant)
        for standing, name in ahead_at_door(standings, mine):
            share = self._shares[name]
            for req in reversed(share.queued):
                # A preempted request already started once: it keeps its place.
                if (req.state is _QUEUED and not req.preemptions and fits_place(work, req.work)
                        and gives_place(standing, self._charge(req) / share.weight, mine)):
                    yield req


def ahead_at_door(standings: Iterable[tuple[float, str]], mine: float) -> list[tuple[float, str]]:
    """The (standing, tenant) pairs of the tenants with something queued,
    other than a newcomer's, whose places the newcomer may take when its
    tenant will stand at `mine`: those at or ahead of it, furthest ahead
    first (equal standings: the greater name first)."""
    return [entry for entry in sorted(standings, reverse=True) if entry[0] >= mine]


def fits_place(work: int, queued_work: int) -> bool:
    """Whether a newcomer of `work` tokens may take the place of a queued
    request of `queued_work`: only of one at least as large. The tier then
    holds as many requests as before and no more work, so the door changes
    who waits, never how long the queue is for whoever comes next. (A larger
    newcomer would: the door refuses a large newcomer sooner, since its own
    work counts in its wait on a full backend, and swapping it in for a
    smaller request made every later newcomer's wait longer.)"""
    return queued_work >= work


def gives_place(standing: float, charge: float, mine: float) -> bool:
    """Whether a queued request (`charge`, over its tenant's weight) of a
    tenant at `standing` may give its place to a newcomer whose tenant will
    stand at `mine` with it: only if its own tenant is then still at or
    ahead of the newcomer's, so a place never goes to a tenant that would
    end up ahead."""
    return standing - charge >= mine
