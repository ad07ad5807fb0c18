"""The quota arithmetic in one process: synchronous, `now` passed in.

`LocalLimiter` is what the memory store runs, what a fail-open gateway falls
back on while Redis is down, and the reference the Redis store's Lua scripts
(qosgate/quotas/redis_store.py) follow step for step; the conformance suite
(tests/test_quota_conformance.py) holds them to the same answers.
"""

from __future__ import annotations

import math
from collections import defaultdict
from collections.abc import Collection, Mapping
from dataclasses import dataclass, field

from .model import (
    SLOTS,
    Holding,
    LimitState,
    QuotaDecision,
    RateKind,
    RateRule,
    Reservation,
    SettledTwice,
    TenantLimits,
    oldest_slot,
    refusal_reason,
)


@dataclass(slots=True)
class _Window:
    """One rate limit's state for one tenant: slot index -> amount, and the bucket."""

    slots: dict[int, int] = field(default_factory=dict)
    level: float | None = None  # bucket level; None: full
    level_at: float = 0.0

    def prune(self, kind: RateKind, now: float) -> int:
        """Drop slots that no longer overlap the window; the amount still in it."""
        oldest = oldest_slot(kind, now)
        stale = [k for k in self.slots if k < oldest]
        for k in stale:
            del self.slots[k]
        return sum(self.slots.values())

    def bucket(self, rule: RateRule, now: float) -> float:
        if self.level is None:
            return float(rule.burst)
        return min(float(rule.burst), self.level + (now - self.level_at) * rule.rate_per_s)

    def set_bucket(self, rule: RateRule, now: float, level: float) -> None:
        self.level = min(float(rule.burst), level)
        self.level_at = now


def window_wait(rule: RateRule, slots: dict[int, int], used: int, need: int, now: float) -> float:
    """Seconds until `need` more fits the window, as old slots leave it."""
    freed = 0
    for k in sorted(slots):
        freed += slots[k]
        if used - freed + need <= rule.limit:
            # Slot k stops overlapping the window when slot k + SLOTS + 1 begins.
            return max(0.0, (k + SLOTS + 1) * rule.width_s - now)
    return 0.0


def window_reset(rule: RateRule, slots: dict[int, int], now: float) -> float:
    if not slots:
        return 0.0
    return max(0.0, (max(slots) + SLOTS + 1) * rule.width_s - now)


def bucket_wait(rule: RateRule, level: float, need: int) -> float:
    return max(0.0, (need - level) / rule.rate_per_s)


def evaluate(
    rule: RateRule, slots: dict[int, int], used: int, level: float, need: int, now: float
) -> tuple[bool, float | None]:
    """Whether `need` fits now, and if not, the wait (None: it never will)."""
    fits = used + need <= rule.limit and (not rule.bucketed or level >= need)
    if fits:
        return True, 0.0
    if need > rule.burst:
        return False, None
    wait = 0.0
    if used + need > rule.limit:
        wait = window_wait(rule, slots, used, need, now)
    if rule.bucketed and level < need:
        wait = max(wait, bucket_wait(rule, level, need))
    return False, wait


def limit_state(
    rule: RateRule, slots: dict[int, int], used: int, level: float, now: float
) -> LimitState:
    remaining = rule.limit - used
    reset = window_reset(rule, slots, now)
    if rule.bucketed:
        remaining = min(remaining, math.floor(level))
        reset = max(reset, bucket_wait(rule, level, rule.burst))
    return LimitState(rule.kind, rule.limit, used, max(0, remaining), reset)


_Refusal = tuple[str, int, int, float | None]
"""(limit named, its value, need, wait) of a refused check."""


def refusal(rule: RateRule, need: int, wait: float | None) -> _Refusal:
    if wait is None and need <= rule.limit:
        return (f"{rule.kind}.burst", rule.burst, need, None)
    return (rule.kind, rule.limit, need, wait)


def refused(why: _Refusal, states: tuple[LimitState, ...]) -> QuotaDecision:
    kind, limit, need, wait = why
    return QuotaDecision(
        admitted=False, exceeded=kind, retry_after_s=wait,
        reason=refusal_reason(kind, limit, need, wait), states=states,
    )  # fmt: skip


def concurrency_state(max_concurrency: int, inflight: int) -> LimitState:
    return LimitState(
        "max_concurrency", max_concurrency, inflight, max(0, max_concurrency - inflight), 0.0
    )


CONCURRENCY_RETRY_S = 1.0
"""Retry-After for a tenant at max_concurrency: a slot frees when one of its
requests ends, which no clock can predict."""


def concurrency_refusal(max_concurrency: int) -> _Refusal:
    return ("max_concurrency", max_concurrency, 1, CONCURRENCY_RETRY_S)


def settle_deltas(
    reservation: Reservation, charged: int, served: bool
) -> list[tuple[RateRule, int, int]]:
    """(rule, change to its window, slot it goes to) for each rate a settlement
    moves: tokens by charged - reserved, the request back if it was not served."""
    changes = []
    for rule in reservation.limits.rates:
        if rule.counts_requests:
            delta = 0 if served else -1
        else:
            delta = charged - reservation.tokens
        if delta:
            changes.append((rule, delta, rule.slot(reservation.at)))
    return changes


def mark_settled(reservation: Reservation, charged: int) -> None:
    if reservation.settled:
        raise SettledTwice(f"reservation of request {reservation.request_id} settled twice")
    reservation.settled = True
    reservation.charged = charged


class LocalLimiter:
    """Every tenant's windows and in-flight sets, in this process."""

    def __init__(self) -> None:
        # tenant -> limit -> window; tenant -> request id -> lease end
        self._windows: defaultdict[str, defaultdict[RateKind, _Window]] = defaultdict(
            lambda: defaultdict(_Window)
        )
        self._inflight: defaultdict[str, dict[str, float]] = defaultdict(dict)

    def _live(self, tenant: str, now: float) -> dict[str, float]:
        inflight = self._inflight[tenant]
        expired = [rid for rid, until in inflight.items() if until <= now]
        for rid in expired:
            del inflight[rid]
        return inflight

    def reserve(
        self,
        tenant: str,
        limits: TenantLimits,
        tokens: int,
        request_id: str,
        now: float,
        *,
        lease_s: float,
        store: str = "memory",
    ) -> QuotaDecision:
        """Reserve `tokens` (and one request, and one concurrency slot) under
        every limit, or nothing at all."""
        why: _Refusal | None = None
        for rule in limits.rates:
            window = self._windows[tenant][rule.kind]
            need = 1 if rule.counts_requests else tokens
            used = window.prune(rule.kind, now)
            fits, wait = evaluate(rule, window.slots, used, window.bucket(rule, now), need, now)
            if not fits:
                why = refusal(rule, need, wait)
                break
        inflight = self._live(tenant, now) if limits.max_concurrency is not None else {}
        if why is None and limits.max_concurrency is not None:
            if len(inflight) >= limits.max_concurrency:
                why = concurrency_refusal(limits.max_concurrency)
        if why is not None:
            return refused(why, self.usage(tenant, limits, now))
        reservation = Reservation(tenant, request_id, tokens, now, limits, store=store)
        # Counted as any admission is; its lease, not `record`'s endless one.
        self.record(reservation, now)
        if limits.max_concurrency is not None:
            inflight[request_id] = now + lease_s
        return QuotaDecision(
            admitted=True, reservation=reservation, states=self.usage(tenant, limits, now)
        )

    def settle(self, reservation: Reservation, charged: int, served: bool, now: float) -> None:
        """End a reservation: keep `charged` tokens of it (refund the rest, or
        charge the excess), and give back the request if it was not served."""
        mark_settled(reservation, charged)
        self.apply(reservation, charged, served, now)

    def apply(self, reservation: Reservation, charged: int, served: bool, now: float) -> None:
        """`settle`'s changes to the windows, for a reservation settled elsewhere."""
        tenant = reservation.tenant
        for rule, delta, k in settle_deltas(reservation, charged, served):
            window = self._windows[tenant][rule.kind]
            if k in window.slots:
                value = window.slots[k] + delta
                if value > 0:
                    window.slots[k] = value
                else:
                    del window.slots[k]
            if rule.bucketed:
                window.set_bucket(rule, now, window.bucket(rule, now) - delta)
        if reservation.limits.max_concurrency is not None:
            self._inflight.get(tenant, {}).pop(reservation.request_id, None)

    def record(self, reservation: Reservation, now: float) -> None:
        """Count an admission another store decided (a gateway's own ledger):
        no check; its concurrency slot is held until it is applied."""
        tenant = reservation.tenant
        for rule in reservation.limits.rates:
            window = self._windows[tenant][rule.kind]
            need = 1 if rule.counts_requests else reservation.tokens
            k = rule.slot(reservation.at)
            window.slots[k] = window.slots.get(k, 0) + need
            if rule.bucketed:
                window.set_bucket(rule, now, window.bucket(rule, now) - need)
        if reservation.limits.max_concurrency is not None:
            self._live(tenant, now)[reservation.request_id] = math.inf

    def add(self, tenant: str, holding: Holding, now: float, *, lease_s: float) -> None:
        """Add what another limiter admitted: its slots, and a lease of
        `lease_s` for each of its running requests under max_concurrency."""
        for kind, slots in holding.slots.items():
            window = self._windows[tenant][kind]
            for k, amount in slots.items():
                window.slots[k] = window.slots.get(k, 0) + amount
        for reservation in holding.running:
            if reservation.limits.max_concurrency is not None:
                self._live(tenant, now)[reservation.request_id] = now + lease_s

    def holding(self, tenant: str, now: float) -> Holding:
        """The tenant's windows as they stand (its running requests are the
        caller's to add)."""
        slots: dict[RateKind, dict[int, int]] = {}
        for kind, window in self._windows.get(tenant, {}).items():
            if window.prune(kind, now):
                slots[kind] = dict(window.slots)
        return Holding(slots=slots)

    def holds(self, tenant: str, now: float) -> bool:
        """Whether anything of the tenant is in a window or in flight."""
        # Asked at every reservation: it makes no entry for a tenant it does not know.
        if tenant in self._inflight and self._live(tenant, now):
            return True
        return any(w.prune(k, now) for k, w in self._windows.get(tenant, {}).items())

    def tenants(self, now: float) -> set[str]:
        """The tenants with anything in a window or in flight; the others are
        forgotten."""
        for tenant in list(self._windows):
            if not any(w.prune(k, now) for k, w in self._windows[tenant].items()):
                del self._windows[tenant]
        for tenant in list(self._inflight):
            if not self._live(tenant, now):
                del self._inflight[tenant]
        return set(self._windows) | set(self._inflight)

    def renew(
        self, leases: Mapping[str, Collection[str]], now: float, *, lease_s: float
    ) -> set[tuple[str, str]]:
        """Extend each live concurrency lease named (tenant -> request ids) to
        `now + lease_s`. Returns the (tenant, request id) pairs whose lease had
        already ended or been released: those are not taken back."""
        lost = set()
        for tenant, request_ids in leases.items():
            inflight = self._live(tenant, now)
            for rid in request_ids:
                if rid in inflight:
                    inflight[rid] = max(inflight[rid], now + lease_s)
                else:
                    lost.add((tenant, rid))
        return lost

    def release(self, leases: Mapping[str, Collection[str]]) -> None:
        """Free the concurrency slots named (tenant -> request ids)."""
        for tenant, request_ids in leases.items():
            inflight = self._inflight.get(tenant)
            for rid in request_ids if inflight is not None else ():
                inflight.pop(rid, None)

    def usage(self, tenant: str, limits: TenantLimits, now: float) -> tuple[LimitState, ...]:
        states = []
        for rule in limits.rates:
            window = self._windows[tenant][rule.kind]
            used = window.prune(rule.kind, now)
            states.append(limit_state(rule, window.slots, used, window.bucket(rule, now), now))
        if limits.max_concurrency is not None:
            states.append(concurrency_state(limits.max_concurrency, len(self._live(tenant, now))))
        return tuple(states)
