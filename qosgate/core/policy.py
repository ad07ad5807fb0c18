"""What the scheduling rules read of a policy, and what each mode turns on:
the core's own records (qosgate.config.scheduling builds them from a policy
file), read alike by the single node's scheduler and the fleet."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Literal, Mapping

PolicyKind = Literal["qos", "strict", "fcfs"]


@dataclass(frozen=True, slots=True)
class TierParams:
    """One tier as the rules see it."""

    name: str
    priority: int
    budget_s: float | None
    """Queue budget in seconds (None: none, so it never expires or ages)."""
    delays: bool
    """`on_timeout: delay`: past its budget it ages instead of expiring."""
    max_len: int = 1 << 62
    max_wait_s: float = 0.0
    max_batch_size: int = 1 << 30
    max_batch_tokens: int = 1 << 62
    preemptible: bool = False


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
    w_in: float = 1.0
    w_out: float = 2.0
    drain_rate_tau_s: float = 10.0
    initial_drain_rate: float | None = None

    # `fcfs` is one FIFO and nothing else; `strict` adds tiers, admission,
    # preemption and the reserve; `qos` adds ageing and tenant fairness.

    @property
    def tiered(self) -> bool:
        return self.kind != "fcfs"

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
