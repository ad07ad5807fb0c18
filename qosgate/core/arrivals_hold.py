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
the running requests expected to end by `t`, at most what the backend has
lately completed in as long (a run past its expected end is a long one, not
one about to end), `w` the top level's queue budget and `S(d, n)` the
slots the top level's arrivals in the next `d` seconds may want beyond `n`
ends (their mean difference, plus two standard deviations of it as of
Poisson counts, since lengths vary and which run ends first is a guess,
and one request; with no ends, `A(d)`: its arrival rate times `d`, two
standard deviations and one), the slots kept are

    hold = max over t >= now of  S(t - now, n(t + w)),   at least 0,

less the reserve's slots (free for the top level already), at most
`max_share` of the backend's slots. Where completions come evenly and many
within the budget, `E(n)` outruns `A` and nothing is held; where few are
expected within it (fewer than about six), a slot or two are, since then
none may come at all. Before a gap, the slots its arrivals need are kept as
the last completions ahead of it come in.

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


def shortfall(rate: float, seconds: float, ends: float) -> float:
    """S(d, n): the slots `seconds` of the top level's arrivals may want
    beyond `ends` runs expected to end in time. Those ends are guessed from
    the runs' starts and the time runs lately held a slot, while lengths vary
    run to run, so both are random counts: their mean difference, two
    standard deviations of it (as of Poisson counts), and one request. With
    no ends it is A(d)."""
    mean = rate * seconds
    return mean - ends + SPREAD * math.sqrt(mean + ends) + MARGIN


def arrivals_hold(
    starts: Iterable[float], now: float, hold_s: float, rate: float, budget_s: float,
    *, ended: int = 0, end_rate: float | None = None,
) -> float:
    """The slots to keep for top-level arrivals (module docstring), before
    any cap: `starts` the running requests' start times in ascending order,
    `hold_s` the time a request holds a slot, `rate` the top level's
    arrivals per second, `budget_s` its queue budget. The first `ended` of
    the running requests have left the backend already (it reports their
    slots free) though their end has not reached the caller. `end_rate`: the
    runs the backend has lately completed a second (None: no bound)."""
    if rate <= 0.0 or hold_s <= 0.0:
        return 0.0

    def ends(count: int, by: float) -> float:
        if end_rate is None:
            return float(count)
        return min(float(count), end_rate * (by - now))

    ahead = now + budget_s
    # Nothing started later than now, so nothing ends after now + hold_s:
    # past the point where even that cannot beat the worst, stop.
    latest = max(0.0, now + hold_s - ahead)
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
        counted = ends(k, end)
        need = shortfall(rate, end - ahead, counted)
        if need > worst:
            worst = need
        # What is to come has no more time and no fewer ends than this.
        if shortfall(rate, latest, counted) <= worst:
            break
    return max(0.0, worst, shortfall(rate, 0.0, ends(within, ahead)))


class ArrivalsHold:
    """One backend's estimates for `arrivals_hold`: the top level's arrival
    rate and the time a request holds a slot."""

    def __init__(self, max_share: float, reserve: int = 0) -> None:
        self.max_share = max_share
        """The most of the backend's slots kept (0: none)."""
        self.reserve = reserve
        """Slots the reserve keeps free for top-level work: they serve its
        arrivals as well as a slot kept here, so only what they do not cover
        is kept on top of them."""
        self._arrivals = ArrivalRate(ARRIVALS_TAU_S)
        self._ends = ArrivalRate(ARRIVALS_TAU_S)
        self._hold_s = 0.0

    def arrived(self, now: float) -> None:
        """A top-level request arrived (admitted or not: refused at the door
        for want of room, it is demand all the same)."""
        self._arrivals.add(1.0, now)

    def ended(self, now: float, started: float) -> None:
        """A request that started at `started` left the backend."""
        self._ends.add(1.0, now)
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
                             ended=ended, end_rate=self._ends.rate(now))  # fmt: skip
        return min(cap, max(0, math.ceil(hold - 1e-9) - self.reserve))
