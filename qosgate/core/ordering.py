"""Which tier goes next, how waiting work ages, and which run makes room:
for the single node's scheduler and the fleet (whose claim script restates
the tier choice, held to this by tests/test_fleet_rules_differential.py)."""

from __future__ import annotations

from typing import Callable, Iterable, Protocol, Reversible, Sequence, TypeVar

from qosgate.core.policy import Ageing

# A run sent back this often is no longer chosen as a victim, so a
# preemptible tier cannot be livelocked by a steady stream of higher work.
MAX_PREEMPTIONS = 2


class TierView(Protocol):
    """Port: what ordering reads of a tier."""

    @property
    def priority(self) -> int: ...

    @property
    def delays(self) -> bool: ...

    @property
    def budget_s(self) -> float | None: ...


T = TypeVar("T", bound=TierView)
R = TypeVar("R")


def ageing_boost(
    now: float, oldest_arrival: float, budget_s: float, interval_s: float, max_boost: int
) -> int:
    """Levels a `delay` tier has climbed by `now`: one per `interval_s` its
    oldest request has waited past its budget, at most `max_boost` (a clock
    a little behind the arrival's gives none)."""
    over = now - oldest_arrival - budget_s
    if over < interval_s:
        return 0
    levels = int(over / interval_s)
    return levels if levels < max_boost else max_boost


def aged_work(
    now: float, oldest_arrival: float, work: float, budget_s: float, climb: int, interval_s: float
) -> tuple[float, float]:
    """Of a `delay` tier's queued `work`, the part that has aged `climb`
    levels by now, and the rate in tokens/s at which more does: only the
    oldest arrival is known, so arrivals are taken as spread evenly between
    it and now."""
    threshold = now - budget_s - climb * interval_s
    span = now - oldest_arrival
    if oldest_arrival > threshold or span <= 0:
        return 0.0, 0.0
    rate = work / span
    return rate * min(span, threshold - oldest_arrival), rate


def tier_level(tier: TierView, oldest_arrival: float, now: float, ageing: Ageing) -> int:
    """The level a non-empty tier competes at: its priority less the levels
    its oldest request has climbed (only `delay` tiers age, once their
    budget is spent), floored at 0."""
    level = tier.priority
    if ageing.max_boost and tier.delays and tier.budget_s is not None:
        level -= ageing_boost(
            now, oldest_arrival, tier.budget_s, ageing.interval_s, ageing.max_boost
        )
    return level if level > 0 else 0


def pick_tier(heads: Iterable[tuple[T, float]], now: float, ageing: Ageing) -> tuple[T, int] | None:
    """Of the tiers that may release now, with their oldest arrivals, in
    (priority, name) order: the one to release from, and its level. Lowest
    level first; then the older head (so an aged request overtakes fresher
    work of the tier it climbed to), the lower priority, the earlier given."""
    best: tuple[T, int] | None = None
    best_key: tuple[int, float, int] | None = None
    for tier, oldest in heads:
        key = (tier_level(tier, oldest, now, ageing), oldest, tier.priority)
        if best_key is None or key < best_key:
            best, best_key = (tier, key[0]), key
    return best


def may_preempt(times_sent_back: int, output_begun: bool) -> bool:
    """Whether a run may be sent back: output already streamed to a client
    cannot be taken back, and a run sent back MAX_PREEMPTIONS times stays."""
    return times_sent_back < MAX_PREEMPTIONS and not output_begun


def preemption_victim(
    waiting_priority: int,
    tiers: Sequence[tuple[int, bool, Reversible[R]]],
    eligible: Callable[[R], bool],
) -> R | None:
    """The newest eligible run of the least important preemptible tier below
    `waiting_priority`; `tiers`: (priority, preemptible, runs in dispatch
    order) per tier, in (priority, name) order."""
    for priority, preemptible, runs in reversed(tiers):
        if priority <= waiting_priority:
            return None
        if preemptible:
            for run in reversed(runs):
                if eligible(run):
                    return run
    return None
