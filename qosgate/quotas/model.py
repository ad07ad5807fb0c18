"""What every quota store agrees on: the limits, a reservation, a decision.

A rate limit here is a sliding window, not a token bucket: `limit` is the most
a tenant can have admitted in *any* window of one period, so 64 concurrent
streams cannot take a minute's quota twice over at a window's edge. The window
is kept as `SLOTS` sub-windows and checked conservatively: a reservation at
time t counts against every window that contains t, by counting the
`SLOTS + 1` slots that overlap (t - period, t]. The price is that a slot's
worth of usage (1/60 of the period) can be held back a little longer than an
exact log would; the gain is that a store holds at most 62 numbers per limit
whatever the traffic.

`burst`, when below the limit, adds a token bucket of that size refilled at
limit/period: it bounds how much of the window can be spent at once.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Literal

from qosgate.config.models import RateLimit, TenantQuotas

SLOTS = 60
"""Sub-windows per period."""

RateKind = Literal["tokens_per_minute", "tokens_per_day", "requests_per_minute"]
RATE_KINDS: tuple[RateKind, ...] = ("tokens_per_minute", "tokens_per_day", "requests_per_minute")
PERIOD_S: dict[RateKind, float] = {
    "tokens_per_minute": 60.0,
    "tokens_per_day": 86_400.0,
    "requests_per_minute": 60.0,
}
KEY_SUFFIX: dict[str, str] = {
    "tokens_per_minute": "tpm",
    "tokens_per_day": "tpd",
    "requests_per_minute": "rpm",
    "max_concurrency": "conc",
    "generation": "gen",
    "recovery": "recovering",
}


def oldest_slot(kind: RateKind, now: float) -> int:
    """The oldest slot still in the window of a limit at `now`: the window
    counts it and the ones after, those that overlap (now - period, now]."""
    # As RateRule.slot reckons it, to the last bit.
    return math.floor(now / (PERIOD_S[kind] / SLOTS)) - SLOTS


@dataclass(frozen=True, slots=True)
class RateRule:
    """One sliding-window limit, with its optional bucket."""

    kind: RateKind
    limit: int
    burst: int
    period_s: float

    @property
    def width_s(self) -> float:
        return self.period_s / SLOTS

    @property
    def bucketed(self) -> bool:
        """Whether the bucket constrains anything (burst below the limit)."""
        return self.burst < self.limit

    @property
    def rate_per_s(self) -> float:
        return self.limit / self.period_s

    def slot(self, at: float) -> int:
        return math.floor(at / self.width_s)

    @property
    def counts_requests(self) -> bool:
        return self.kind == "requests_per_minute"


@dataclass(frozen=True, slots=True)
class TenantLimits:
    """A tenant's quotas in the form the stores use."""

    rates: tuple[RateRule, ...] = ()
    max_concurrency: int | None = None

    @classmethod
    def from_config(cls, quotas: TenantQuotas) -> TenantLimits:
        rates = []
        for kind in RATE_KINDS:
            rule: RateLimit | None = getattr(quotas, kind)
            if rule is not None:
                burst = rule.burst if rule.burst is not None else rule.limit
                rates.append(RateRule(kind, rule.limit, min(burst, rule.limit), PERIOD_S[kind]))
        return cls(tuple(rates), quotas.max_concurrency)

    @property
    def empty(self) -> bool:
        return not self.rates and self.max_concurrency is None


@dataclass(frozen=True, slots=True)
class LimitState:
    """One limit as it stands: what the x-ratelimit headers and the usage view show."""

    kind: str
    limit: int
    used: int
    """Admitted in the current window (for max_concurrency: in flight)."""
    remaining: int
    """What one more request could take now."""
    reset_s: float
    """Seconds until the limit is back to full (nothing left in its window)."""


@dataclass(slots=True, eq=False)
class Reservation:
    """What a request holds between admission and its end. Settled exactly once."""

    tenant: str
    request_id: str
    tokens: int
    """Reserved: prompt tokens + max_tokens."""
    at: float
    """Wall-clock time of the reservation; names the slots to refund into."""
    limits: TenantLimits
    store: str = ""
    """Which store holds it (a fail-open gateway may hold some locally)."""
    generation: str = ""
    """The store's generation of the tenant's data it was made in (or carried
    into): a settlement moves the windows only of that generation."""
    recorded: bool = False
    """The store keeps a record of it by request id until it is settled, so
    that a process that restarts can settle it, exactly once (`find`)."""
    settled: bool = False
    charged: int | None = None
    """Tokens kept once settled (0 when refunded in full)."""


@dataclass(slots=True)
class Holding:
    """What one gateway has admitted of a tenant in the current windows: what
    it carries into a store that lost its data, or that did not see it."""

    slots: dict[RateKind, dict[int, int]] = field(default_factory=dict)
    """Per rate limit, slot index -> amount."""
    running: list[Reservation] = field(default_factory=list)
    """Its requests not yet settled: each takes the store's new generation,
    and those under max_concurrency hold a slot again."""

    @property
    def empty(self) -> bool:
        return not self.running and not any(self.slots.values())


@dataclass(frozen=True, slots=True)
class Renewal:
    """What one lease renewal found."""

    lost: set[tuple[str, str]] = field(default_factory=set)
    """(tenant, request id) whose lease had already ended: not taken back."""
    reset: set[str] = field(default_factory=set)
    """Tenants whose data the store lost since this gateway last saw it: none
    of their leases was renewed; the gateway carries what it holds back."""


@dataclass(frozen=True, slots=True)
class QuotaDecision:
    admitted: bool
    reservation: Reservation | None = None
    exceeded: str | None = None
    """The limit that refused it."""
    retry_after_s: float | None = None
    """When the refusing limit will hold enough; None if it never can (the
    request alone is larger than the limit)."""
    reason: str = ""
    states: tuple[LimitState, ...] = field(default=())
    """Every limit after the reservation (or as it stands, when refused)."""


def refusal_reason(kind: str, limit: int, need: int, retry_after_s: float | None) -> str:
    unit = "request" if kind in ("requests_per_minute", "max_concurrency") else "tokens"
    if retry_after_s is None:
        return (
            f"the request needs {need} {unit}, more than the tenant's {kind} limit of {limit}; "
            "lower max_tokens or the prompt"
        )
    if kind == "max_concurrency":
        return f"the tenant already has {limit} requests in flight (max_concurrency {limit})"
    if unit == "request":
        return f"the tenant's {kind} limit of {limit} is used up"
    return f"the tenant's {kind} limit of {limit} cannot hold {need} more tokens now"


class SettledTwice(RuntimeError):
    """A reservation was settled or refunded a second time: a gateway bug."""
