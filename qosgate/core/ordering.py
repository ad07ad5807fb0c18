"""Which tier goes next, how waiting work ages, what each tier's guaranteed
share is owed, and which run makes room: for the single node's scheduler and
the fleet (whose claim script restates the tier choice and the share credit,
held to this by tests/test_fleet_rules_differential.py)."""

from __future__ import annotations

from typing import Callable, Iterable, Literal, Protocol, Reversible, Sequence, TypeVar

from qosgate.core.policy import Ageing, has_latency_objective

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

    @property
    def age_floor(self) -> int: ...


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


def tier_level(tier: TierView, oldest_arrival: float, now: float, ageing: Ageing) -> int:
    """The level a non-empty tier competes at: its priority less the levels
    its oldest request has climbed (only `delay` tiers age, once their
    budget is spent), never above its age floor."""
    level = tier.priority
    if ageing.max_boost and tier.delays and tier.budget_s is not None:
        level -= ageing_boost(
            now, oldest_arrival, tier.budget_s, ageing.interval_s, ageing.max_boost
        )
    floor = tier.age_floor
    return level if level > floor else floor


def pick_tier(
    heads: Iterable[tuple[T, float, bool]], now: float, ageing: Ageing
) -> tuple[T, int] | None:
    """Of the tiers that may release now, with their oldest arrivals and
    whether their guaranteed share is owed (share_owed), in (priority, name)
    order: the one to release from, and its level. A tier owed its share
    first, unless a tier with a latency objective has work here: shares
    divide what those tiers leave, so under their load the lowest tiers are
    shed first and the latency tiers are served exactly as without shares.
    Then the lowest level; then the older head (so an aged request overtakes
    fresher work of the tier it climbed to), the lower priority, the earlier
    given."""
    heads = list(heads)
    shares_hold = not any(has_latency_objective(tier) for tier, _, _ in heads)
    best: tuple[T, int] | None = None
    best_key: tuple[bool, int, float, int] | None = None
    for tier, oldest, owed in heads:
        key = (not (owed and shares_hold), tier_level(tier, oldest, now, ageing), oldest,
               tier.priority)
        if best_key is None or key < best_key:
            best, best_key = (tier, key[1]), key
    return best


def has_reserve(priority: int, top_level: int, reserve_slots: int) -> bool:
    """Whether free slots are held in reserve for work at `priority`: the top
    level's, when there is a reserve. Such work never waits for a slot of its
    own behind a full backend (admission's `own_slot`)."""
    return priority == top_level and reserve_slots > 0


def reserve_holds(level: int, top_level: int, free_slots: int, reserve_slots: int) -> bool:
    """Whether a release at `level` waits because the free slots left are held
    for top-level work (a guaranteed share included: it never takes capacity
    kept for the top level)."""
    return level > top_level and free_slots <= reserve_slots


def open_slots(level: int, top_level: int, free_slots: int, reserve_slots: int) -> int:
    """How many of a backend's `free_slots` a newcomer at `level` may take at
    once: every one for top-level work, those past the reserve for the rest
    (reserve_holds)."""
    return free_slots if level <= top_level else max(0, free_slots - reserve_slots)


# Prompt size classes per priority level in the engine's priority (powers of
# two: class k holds prompts of 2**(k-1) to 2**k - 1 tokens).
PROMPT_CLASSES = 32


def engine_priority(level: int, prompt_tokens: int) -> int:
    """The priority a backend orders its own queue by (lower runs first): the
    request's level, then its prompt's size class, so that inside the engine a
    long prompt does not hold up the shorter ones of its level that arrive
    while it waits (the engine still takes equal classes in arrival order).
    In a burst of a tier's prompts this is what lets the most of them meet a
    first-token objective: the engine's prefill takes a short prompt in a step
    or two, a long one in many. Levels never mix: a level's longest prompt
    runs before the next level's shortest."""
    return level * PROMPT_CLASSES + min(max(prompt_tokens, 0).bit_length(), PROMPT_CLASSES - 1)


def prefill_full(prefilling: int, prompt: int, limit: int | None) -> bool:
    """Whether a prompt of `prompt` tokens would take a backend's prefill
    queue (`prefilling`: prompt tokens sent in that have no first token yet)
    past `limit` (None: no limit). The first prompt in always goes, however
    long: holding it back gains nothing."""
    return limit is not None and prefilling > 0 and prefilling + prompt > limit


def prefill_holds(
    tier: TierView, level: int, top_level: int, prompt: int, prefilling: int,
    budget: int | None, pace: int | None, *, held: bool, paced: bool,
) -> Literal["budget", "pace"] | None:
    """Whether the next request of `tier`, competing at `level`, waits for a
    first token before it goes to the backend: "budget" when it is below the
    top level and the prefill budget is full, or something below the top
    level was held for it already this round (so a shorter prompt behind a
    held one does not overtake it); "pace" when its tier has no latency
    objective and the delay tiers' pace is full, or another such tier was
    held for it this round; None when it goes. The scheduler and the fleet's
    claim apply it the same way, one request at a time."""
    if level > top_level and (held or prefill_full(prefilling, prompt, budget)):
        return "budget"
    if not has_latency_objective(tier) and (paced or prefill_full(prefilling, prompt, pace)):
        return "pace"
    return None


def share_owed(credit: float, head_work: float) -> bool:
    """Whether a tier with work queued is owed its guaranteed share now: its
    credit covers the work of its oldest request (pick_tier says when that
    lets it go first)."""
    return credit > 0.0 and credit >= head_work


def settles_shares(taken: TierView) -> bool:
    """Whether a release of tier `taken` counts toward the tiers' shares: not
    one of a tier with a latency objective. A share never passes such a tier
    (pick_tier), so what it takes is not the shares' to divide, and a tier
    kept waiting by it banks nothing for the lull after."""
    return not has_latency_objective(taken)


def share_credit(credit: float, share: float, work: float, *, taken: bool) -> float:
    """A tier's share credit after `work` tokens were released, while it still
    has work queued (a tier whose queue empties starts again from 0). It earns
    `share` of every release and pays for its own, never below 0: taken when
    owed, it spends what it earned; taken in plain priority order, with little
    or no credit, nothing more important was waiting, so it owes nothing for
    it. So while it stays queued its releases add up to at least `share` of
    all of them, less one request, and it never banks credit for later."""
    if taken:
        left = credit + share * work - work
        return left if left > 0.0 else 0.0
    return credit + share * work


def preemption_needed(urgent_queued: int, free_slots: int) -> bool:
    """Whether sending a run back still makes room that work waits for: more
    requests of more important tiers are queued than the free slots can
    start (a preemption chosen a moment earlier, when the backend was full,
    may have been overtaken by a completion)."""
    return urgent_queued > free_slots


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
