"""What the scheduling rules read of a policy, and what each mode turns on:
the core's own records (qosgate.config.scheduling builds them from a policy
file), read alike by the single node's scheduler and the fleet."""

from __future__ import annotations

from dataclasses import dataclass, field, replace
from typing import TYPE_CHECKING, Literal, Mapping

if TYPE_CHECKING:
    from qosgate.core.ordering import TierView

PolicyKind = Literal["qos", "strict", "fcfs"]


@dataclass(frozen=True, slots=True)
class TierParams:
    """One tier as the rules see it."""

    name: str
    priority: int
    budget_s: float | None
    """Queue budget in seconds (None: none, so it never expires or ages)."""
    delays: bool
    """`on_timeout: delay`: past its budget it waits on (and ages among the
    other `delay` tiers) until `deadline_s`, instead of expiring."""
    max_len: int = 1 << 62
    max_wait_s: float = 0.0
    max_batch_size: int = 1 << 30
    max_batch_tokens: int = 1 << 62
    preemptible: bool = False
    min_share: float = 0.0
    """Fraction of the tokens released to the backend that the tier is
    guaranteed while it has work queued, against tiers without a latency
    objective (ordering.pick_tier): a tier with one is never passed."""
    deadline_s: float | None = None
    """Queue wait after which a queued request of this tier expires (None:
    never): the budget of a `reject` tier, a `delay` tier's expire_after_ms
    (config.models.TierConfig.expiry_ms)."""
    age_floor: int = 0
    """The most important level ageing may lift the tier to
    (with_age_floors sets it from the other tiers)."""


def has_latency_objective(tier: TierView) -> bool:
    """Whether a tier refuses late work: it has a queue budget and does not
    `delay`. Such a tier's queued work is never passed by ageing or by a
    guaranteed share, so lower tiers are shed before it is refused."""
    return not tier.delays and tier.budget_s is not None


def with_age_floors(tiers: Mapping[str, TierParams]) -> dict[str, TierParams]:
    """The tiers with their age floors: a tier may age up to just below the
    least important tier more important than it that has a latency objective,
    and no further. So ageing only reorders `delay` tiers among themselves and
    never takes capacity that a latency tier's admitted work needs."""
    floors = {}
    for name, tier in tiers.items():
        above = [t.priority for t in tiers.values()
                 if has_latency_objective(t) and t.priority < tier.priority]
        floors[name] = max(above) + 1 if above else 0
    return {name: replace(tier, age_floor=floors[name]) for name, tier in tiers.items()}


@dataclass(frozen=True, slots=True)
class Ageing:
    """A `delay` tier climbs one level per `interval_s` past its budget, at
    most `max_boost` levels (0: no ageing)."""

    interval_s: float
    max_boost: int


@dataclass(frozen=True, slots=True)
class SchedulingPolicy:
    """The scheduling section of a policy, with its tiers and tenant weights."""

    kind: PolicyKind
    tiers: Mapping[str, TierParams]
    weights: Mapping[str, float] = field(default_factory=dict)
    """Tenant -> its share of its tier under VTC (1 if not listed)."""
    fairness: Literal["vtc", "fifo"] = "vtc"
    interval_s: float = 2.0
    max_boost: int = 2
    admission_on: bool = True
    preemption_on: bool = False
    reserve_slots: int = 0
    reserve_kv_tokens: int = 0
    reserve_arrivals: float = 0.5
    """The most of the backend's slots kept for the top level's expected
    arrivals (core.arrivals_hold; qos only: arrivals_share)."""
    w_in: float = 1.0
    w_out: float = 2.0
    drain_rate_tau_s: float = 10.0
    initial_drain_rate: float | None = None
    delay_prefill_tokens: int | None = None
    """Prompt tokens released and not yet past their prefill beyond which a
    tier without a latency objective is held back (None: no limit)."""
    prefill_budget_tokens: int | None = None
    """Prompt tokens released to the backend and not yet past their prefill
    (no first token) beyond which work below the top level is held back, so
    a top-level prefill never queues behind more than this (None: no limit)."""

    def __post_init__(self) -> None:
        tiers = with_age_floors(self.tiers)
        if self.kind != "qos":
            tiers = {name: replace(t, min_share=0.0) for name, t in tiers.items()}
        object.__setattr__(self, "tiers", tiers)

    # `fcfs` is one FIFO and nothing else; `strict` adds tiers, admission,
    # preemption and the reserve; `qos` adds ageing, the tiers' guaranteed
    # shares and tenant fairness.

    @property
    def tiered(self) -> bool:
        return self.kind != "fcfs"

    @property
    def held_slots(self) -> int:
        """Free slots kept for top-level work: the reserve, under `qos` and `strict`."""
        return self.reserve_slots if self.tiered else 0

    @property
    def arrivals_share(self) -> float:
        """The share of slots kept for the top level's expected arrivals, under
        `qos`; none under `strict` and `fcfs`."""
        return self.reserve_arrivals if self.kind == "qos" else 0.0

    @property
    def held_kv_tokens(self) -> int:
        return self.reserve_kv_tokens if self.tiered else 0

    @property
    def admission(self) -> bool:
        return self.admission_on and self.tiered

    @property
    def preemption(self) -> bool:
        return self.preemption_on and self.tiered

    @property
    def fair(self) -> bool:
        """Order a tier's tenants by virtual token counter (VTC)."""
        return self.kind == "qos" and self.fairness == "vtc"

    @property
    def ageing(self) -> Ageing:
        return Ageing(self.interval_s, self.max_boost if self.kind == "qos" else 0)

    def weight(self, tenant: str) -> float:
        return self.weights.get(tenant, 1.0)
