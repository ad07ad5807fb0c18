"""Free slots kept for the top level's expected arrivals (qos).

Requests of one length that start together end together (a benchmark's
fixed lengths with `ignore_eos`, a batch job's uniform prompts), and a slot
freed is refilled at once, so the phase persists: completions come for a
while, then none for a while, a request's length after the last gap in
starts. A top-level request arriving in such a gap finds no free slot and
waits for the gap's end, past its queue budget; a fixed reserve covers it
only if it is as large as the gap's arrivals, and costs its size always.

So before work below the top level takes a free slot, qos checks that the
slots left free, with the running requests expected to end in time, cover the
top level's expected arrivals. A running request is expected to end when it
started plus the time requests have lately held a slot, so the running
requests, in the order they started, give the completions ahead. With `n(t)`
the running requests expected to end by `t`, `w` the top level's queue
budget and `A(d)` the top level's expected arrivals in the next `d` seconds
(its arrival rate times `d`, plus two standard deviations of a Poisson count
and one request), the slots kept are

    hold = max over t >= now of  A(t - now) - n(t + w),   at least 0,

at most `max_share` of the backend's slots. Where completions come evenly,
`n` outruns `A` within the budget and nothing is held (B3's sweep moves
within the seeds' noise); before a gap, the slots its arrivals need are kept as the last
completions ahead of it come in.

Sans-I/O: every method takes `now`. One node's scheduler keeps one; in fleet
mode each engine node keeps its own over its own runs and hands its claim the
result.
"""

from __future__ import annotations

import math
from collections.abc import Collection, Iterable

from qosgate.core.admission import ArrivalRate
from qosgate.core.policy import TierParams, has_latency_objective

ARRIVALS_TAU_S = 10.0
"""Time constant of the top level's arrival rate."""
HOLD_WEIGHT = 0.2
"""Weight of each ended request in the time a request holds a slot: recent,
since the time moves with the load."""
SPREAD = 2.0
"""Standard deviations of a Poisson count of arrivals kept on top of its mean."""
MARGIN = 1.0
"""Requests kept on top of that."""


def top_budget(tiers: Iterable[TierParams]) -> float | None:
    """`w`: the shortest queue budget of the top level's tiers with a latency
    objective (None: the top level has none, and nothing is kept for it)."""
    tiers = list(tiers)
    top = min(t.priority for t in tiers)
    return min((t.budget_s for t in tiers
                if t.priority == top and has_latency_objective(t) and t.budget_s),
               default=None)  # fmt: skip


def expected_arrivals(rate: float, seconds: float) -> float:
    """A(d): the top level's arrivals in `seconds` to keep slots for."""
    mean = rate * seconds
    return mean + SPREAD * math.sqrt(mean) + MARGIN


def arrivals_hold(
    starts: Iterable[float], now: float, hold_s: float, rate: float, budget_s: float,
    *, ended: int = 0,
) -> float:
    """The slots to keep for top-level arrivals (module docstring), before
    any cap: `starts` the running requests' start times in ascending order,
    `hold_s` the time a request holds a slot, `rate` the top level's
    arrivals per second, `budget_s` its queue budget. The first `ended` of
    the running requests have left the backend already (it reports their
    slots free) though their end has not reached the caller."""
    if rate <= 0.0 or hold_s <= 0.0:
        return 0.0
    ahead = now + budget_s
    # Nothing started later than now, so nothing ends after now + hold_s:
    # past the point where even that cannot beat the worst, stop.
    most = expected_arrivals(rate, max(0.0, now + hold_s - ahead))
    within = 0  # n(now + w): ended by then (a prefix, in start order)
    worst = -math.inf
    for i, start in enumerate(starts):
        k = i - ended
        if k < 0:
            continue
        end = start + hold_s
        if end <= ahead:
            within = k + 1
            continue
        # Just before this one ends, k have: an arrival at end - w is served
        # by one of those, or by a slot kept free.
        need = expected_arrivals(rate, end - ahead) - k
        if need > worst:
            worst = need
        if most - k <= worst:
            break
    return max(0.0, worst, expected_arrivals(rate, 0.0) - within)


class ArrivalsHold:
    """One backend's estimates for `arrivals_hold`: the top level's arrival
    rate and the time a request holds a slot."""

    def __init__(self, max_share: float) -> None:
        self.max_share = max_share
        """The most of the backend's slots kept (0: none)."""
        self._arrivals = ArrivalRate(ARRIVALS_TAU_S)
        self._hold_s = 0.0

    def arrived(self, now: float) -> None:
        """A top-level request arrived (admitted or not: refused at the door
        for want of room, it is demand all the same)."""
        self._arrivals.add(1.0, now)

    def ended(self, now: float, started: float) -> None:
        """A request that started at `started` left the backend."""
        held = max(0.0, now - started)
        self._hold_s = held if self._hold_s <= 0.0 else (
            self._hold_s + HOLD_WEIGHT * (held - self._hold_s))

    def slots(
        self, now: float, starts: Collection[float], budget_s: float, *, free_slots: int,
        backend_slots: int | None,
    ) -> int:
        """Free slots to keep for top-level arrivals (module docstring):
        `starts` the running requests' start times in start order, on a
        backend with `free_slots` free of `backend_slots` in all (None:
        unknown)."""
        running = len(starts)
        if backend_slots is None:
            total, ended = free_slots + running, 0
        else:
            # A backend frees a slot a moment before the end reaches us.
            total = backend_slots
            ended = max(0, running - (backend_slots - free_slots))
        cap = int(self.max_share * total)
        if cap <= 0:
            return 0
        hold = arrivals_hold(starts, now, self._hold_s, self._arrivals.rate(now), budget_s,
                             ended=ended)  # fmt: skip
        return min(cap, math.ceil(hold - 1e-9))
