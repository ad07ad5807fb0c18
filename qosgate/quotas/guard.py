"""`QuotaGuard`: the gateway's one door to the quota store.

It knows each tenant's limits, reads the wall clock, and decides what an
unreachable store means (`quota_store.on_error`): fail open onto a
`LocalLimiter` of this process, or refuse with 503. It never polls: after a
failure the store is left alone until `retry_interval_s` has passed, and the
next request to arrive after that tries it again (the interval doubles, up to
8x, while it stays down). Settlements run in tasks of their own so a
request's end never waits on the network; those the store could not take are
kept and sent again, in order, once it answers.

A running request holds its tenant's concurrency slot on a lease of
`lease_s`. One timer per gateway renews every running request's lease each
third of `lease_s`, all tenants in one store call, so a request keeps its slot
for as long as it runs and a gateway that dies gives its slots back within
`lease_s`. A renewal the store cannot take counts as a store failure like any
other call; the next tick tries again (two more before a lease runs out). A
lease found gone (it ran out while the store was unreachable) is not taken
back: fail_open lets the request finish uncounted by the store, as the
reservations it makes on its local limiter are; fail_closed ends it
(`on_lease_lost`), as it does once a lease it could not renew has run out.
"""

from __future__ import annotations

import asyncio
import collections
import logging
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass

from qosgate.config.models import PolicyConfig, QuotaStoreConfig

from .local import LocalLimiter
from .model import LimitState, QuotaDecision, Reservation, TenantLimits
from .store import MemoryQuotaStore, QuotaStore, QuotaStoreError

log = logging.getLogger(__name__)

FALLBACK = "local-fallback"
"""The `store` of a reservation a fail-open gateway made on its own limiter."""

_MAX_UNSENT = 100_000
"""Settlements kept for a store that is down; beyond this the oldest go (and
are counted): their windows have long moved on."""


@dataclass
class GuardCounters:
    """What the guard has had to do, for the usage view and the metrics."""

    store_errors: int = 0
    """Calls to the store that failed."""
    fallback_reservations: int = 0
    """Reservations made on the local limiter while the store was down (fail_open)."""
    refused_store_down: int = 0
    """Requests refused because the store was down (fail_closed)."""
    settlements_resent: int = 0
    """Settlements the store took late, after it came back."""
    settlements_dropped: int = 0
    """Settlements given up (too many waiting): their tokens stay charged."""
    leases_lost: int = 0
    """Running requests whose concurrency lease ran out before it was renewed."""


class QuotaStoreDown(Exception):
    """fail_closed and the store is unreachable; `retry_after_s` says when it
    will next be tried."""

    def __init__(self, message: str, retry_after_s: float) -> None:
        super().__init__(message)
        self.retry_after_s = retry_after_s


def build_store(cfg: QuotaStoreConfig) -> QuotaStore:
    if cfg.kind == "redis":
        from .redis_store import RedisQuotaStore

        return RedisQuotaStore(
            cfg.url, key_prefix=cfg.key_prefix, socket_timeout_s=cfg.timeout_ms / 1000
        )
    return MemoryQuotaStore()


class QuotaGuard:
    def __init__(
        self,
        store: QuotaStore,
        cfg: QuotaStoreConfig,
        limits: Mapping[str, TenantLimits],
        *,
        clock: Callable[[], float] = time.time,
    ) -> None:
        self.store = store
        self._cfg = cfg
        self._limits = dict(limits)
        self._clock = clock
        self._fallback = LocalLimiter()
        self._down_until: float | None = None
        self._backoff = cfg.retry_interval_s
        self._unsent: collections.deque[tuple[Reservation, int, bool, float]] = (
            collections.deque()
        )
        self._resending: asyncio.Task[None] | None = None
        self._tasks: set[asyncio.Task[None]] = set()
        self.counters = GuardCounters()
        # Running requests holding a concurrency slot: (tenant, request id) ->
        # the reservation and the end of its lease as last confirmed.
        self._held: dict[tuple[str, str], tuple[Reservation, float]] = {}
        self._renew_timer: asyncio.TimerHandle | None = None
        self._renewing: asyncio.Task[None] | None = None
        self.on_lease_lost: Callable[[Reservation], None] | None = None
        """Called (fail_closed) for a running request whose lease is gone: the
        gateway ends it."""

    @classmethod
    def from_policy(cls, policy: PolicyConfig, store: QuotaStore | None = None) -> QuotaGuard:
        limits = {t.id: TenantLimits.from_config(t.quotas) for t in policy.tenants}
        return cls(store or build_store(policy.quota_store), policy.quota_store, limits)

    def set_limits(self, policy: PolicyConfig) -> None:
        """A reloaded policy's limits, for reservations from now on; those
        already made settle under the limits they were made with."""
        self._limits = {t.id: TenantLimits.from_config(t.quotas) for t in policy.tenants}

    # -- views ---------------------------------------------------------------

    def limits(self, tenant: str) -> TenantLimits | None:
        """The tenant's limits, or None when it has none (nothing to reserve)."""
        limits = self._limits.get(tenant)
        return None if limits is None or limits.empty else limits

    @property
    def store_down(self) -> bool:
        return self._down_until is not None

    async def usage(self, tenant: str) -> tuple[LimitState, ...]:
        """Each of the tenant's limits as it stands (read-only). From the local
        limiter while the store is down."""
        limits = self.limits(tenant)
        if limits is None:
            return ()
        now = self._clock()
        if self._down_until is None or self.store.name == "memory":
            try:
                return await self.store.usage(tenant, limits, now)
            except QuotaStoreError as exc:
                self._failed(now, exc)
        return self._fallback.usage(tenant, limits, now)

    # -- reserve and settle ----------------------------------------------------

    async def reserve(self, tenant: str, tokens: int, request_id: str) -> QuotaDecision | None:
        """None for a tenant without limits. Raises QuotaStoreDown (fail_closed)."""
        limits = self.limits(tenant)
        if limits is None:
            return None
        now = self._clock()
        lease = self._cfg.lease_s
        if self._down_until is None or now >= self._down_until:
            try:
                decision = await self._store_reserve(tenant, limits, tokens, request_id, now)
            except QuotaStoreError as exc:
                self._failed(now, exc)
            else:
                self._recovered()
                self._hold(decision, now)
                return decision
        assert self._down_until is not None
        if self._cfg.on_error == "fail_closed":
            self.counters.refused_store_down += 1
            raise QuotaStoreDown(
                "the quota store is unreachable and this gateway fails closed",
                retry_after_s=max(1.0, self._down_until - now),
            )
        self.counters.fallback_reservations += 1
        decision = self._fallback.reserve(
            tenant, limits, tokens, request_id, now, lease_s=lease, store=FALLBACK
        )
        self._hold(decision, now)
        return decision

    async def _store_reserve(
        self, tenant: str, limits: TenantLimits, tokens: int, request_id: str, now: float
    ) -> QuotaDecision:
        call = self.store.reserve(tenant, limits, tokens, request_id, now, lease_s=self._cfg.lease_s)
        if isinstance(self.store, MemoryQuotaStore):
            # Nothing in it awaits, so a cancellation cannot land half-way.
            return await call
        # A client that leaves while the script runs must not leave a
        # reservation behind: the call finishes on its own, and is refunded.
        task = asyncio.ensure_future(call)
        try:
            return await asyncio.shield(task)
        except asyncio.CancelledError:
            task.add_done_callback(self._refund_orphan)
            raise

    def _refund_orphan(self, task: asyncio.Future[QuotaDecision]) -> None:
        if task.cancelled() or task.exception() is not None:
            return
        decision = task.result()
        if decision.reservation is not None:
            self.settle_soon(decision.reservation, 0, False)

    def settle_soon(self, reservation: Reservation, charged: int, served: bool) -> None:
        """Settle without making the caller wait (called from the request's
        end, which is synchronous). Exactly once per reservation."""
        # Its slot is given back here: no lease of it is renewed any more.
        self._held.pop((reservation.tenant, reservation.request_id), None)
        now = self._clock()
        if reservation.store == FALLBACK:
            self._fallback.settle(reservation, charged, served, now)
            return
        if isinstance(self.store, MemoryQuotaStore):
            # No I/O to wait for: settle in this very step.
            self.store.settle_now(reservation, charged, served, now)
            return
        if self._unsent or self._down_until is not None:
            # Behind the ones already waiting, so they reach the store in order.
            self._keep(reservation, charged, served, now)
            return
        task = asyncio.get_running_loop().create_task(
            self._settle(reservation, charged, served, now)
        )
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    async def _settle(self, reservation: Reservation, charged: int, served: bool, now: float) -> None:
        try:
            await self.store.settle(reservation, charged, served, now)
        except QuotaStoreError as exc:
            self._failed(self._clock(), exc)
            self._keep(reservation, charged, served, now)

    def _keep(self, reservation: Reservation, charged: int, served: bool, now: float) -> None:
        if len(self._unsent) >= _MAX_UNSENT:
            self._unsent.popleft()
            self.counters.settlements_dropped += 1
        self._unsent.append((reservation, charged, served, now))

    async def _resend(self) -> None:
        while self._unsent:
            reservation, charged, served, at = self._unsent[0]
            try:
                await self.store.settle(reservation, charged, served, at)
            except QuotaStoreError as exc:
                self._failed(self._clock(), exc)
                return
            self._unsent.popleft()
            self.counters.settlements_resent += 1

    # -- lease renewal -----------------------------------------------------------

    def _hold(self, decision: QuotaDecision, now: float) -> None:
        reservation = decision.reservation
        if reservation is None or reservation.limits.max_concurrency is None:
            return
        key = (reservation.tenant, reservation.request_id)
        self._held[key] = (reservation, now + self._cfg.lease_s)
        if self._renew_timer is None:
            loop = asyncio.get_running_loop()
            self._renew_timer = loop.call_at(loop.time() + self._cfg.lease_s / 3, self._on_renew)

    def _on_renew(self) -> None:
        self._renew_timer = None
        if not self._held:
            return  # the next reservation that holds a slot arms it again
        loop = asyncio.get_running_loop()
        self._renew_timer = loop.call_at(loop.time() + self._cfg.lease_s / 3, self._on_renew)
        if self._renewing is None or self._renewing.done():
            self._renewing = loop.create_task(self.renew())

    async def renew(self) -> None:
        """Extend the lease of every running request that holds a concurrency
        slot to `lease_s` from now: one store call for all of them (the timer
        does this every third of `lease_s`)."""
        now = self._clock()
        lease = self._cfg.lease_s
        on_store: dict[str, list[str]] = {}
        on_fallback: dict[str, list[str]] = {}
        for (tenant, rid), (reservation, _) in self._held.items():
            side = on_fallback if reservation.store == FALLBACK else on_store
            side.setdefault(tenant, []).append(rid)
        lost = self._fallback.renew(on_fallback, now, lease_s=lease) if on_fallback else set()
        failed = False
        if on_store:
            try:
                lost |= await self.store.renew(on_store, now, lease_s=lease)
            except QuotaStoreError as exc:
                self._failed(self._clock(), exc)
                failed = True
            else:
                self._recovered()
                self._confirm(on_store, lost, now + lease)
        self._confirm(on_fallback, lost, now + lease)
        for key in lost:
            held = self._held.pop(key, None)
            if held is not None:
                self._lose(held[0])
        if failed and self._cfg.on_error == "fail_closed":
            self._expire(now)

    def _confirm(
        self, renewed: Mapping[str, list[str]], lost: set[tuple[str, str]], until: float
    ) -> None:
        for tenant, rids in renewed.items():
            for rid in rids:
                key = (tenant, rid)
                held = self._held.get(key)
                if held is not None and key not in lost:
                    self._held[key] = (held[0], until)

    def _expire(self, now: float) -> None:
        """The store is unreachable and the gateway fails closed: the requests
        whose leases run out before the next tick end now. (Failing open, they
        run on; the store says which leases it lost once it answers again.)"""
        horizon = now + self._cfg.lease_s / 3
        for key, (reservation, until) in list(self._held.items()):
            if reservation.store != FALLBACK and until <= horizon:
                del self._held[key]
                self._lose(reservation)

    def _lose(self, reservation: Reservation) -> None:
        self.counters.leases_lost += 1
        closed = self._cfg.on_error == "fail_closed"
        log.warning(
            "the concurrency lease of request %s (tenant %s) ran out before it was renewed; %s",
            reservation.request_id, reservation.tenant,
            "ending it (fail_closed)" if closed else "it runs on, uncounted by the store",
        )  # fmt: skip
        if closed and self.on_lease_lost is not None:
            self.on_lease_lost(reservation)

    # -- the store's health ----------------------------------------------------

    def _failed(self, now: float, exc: QuotaStoreError) -> None:
        self.counters.store_errors += 1
        if self._down_until is None:
            log.warning(
                "quota store unreachable (%s); %s", exc,
                "serving on this gateway's local limiter" if self._cfg.on_error == "fail_open"
                else "refusing requests of tenants with quotas (fail_closed)",
            )  # fmt: skip
            self._backoff = self._cfg.retry_interval_s
        else:
            self._backoff = min(self._backoff * 2, self._cfg.retry_interval_s * 8)
        self._down_until = now + self._backoff

    def _recovered(self) -> None:
        if self._down_until is not None:
            log.warning("quota store reachable again")
            self._down_until = None
            self._backoff = self._cfg.retry_interval_s
        if self._unsent and (self._resending is None or self._resending.done()):
            self._resending = asyncio.get_running_loop().create_task(self._resend())

    async def close(self) -> None:
        """Wait for settlements in flight (and try the store once more for
        those kept), then close the store."""
        if self._renew_timer is not None:
            self._renew_timer.cancel()
            self._renew_timer = None
        if self._renewing is not None:
            await asyncio.gather(self._renewing, return_exceptions=True)
        if self._tasks:
            await asyncio.gather(*self._tasks, return_exceptions=True)
        if self._resending is not None:
            await asyncio.gather(self._resending, return_exceptions=True)
        if self._unsent:
            await self._resend()
            if self._unsent:
                log.warning(
                    "%d quota settlements never reached the store; their tokens stay charged "
                    "until their windows pass", len(self._unsent),
                )  # fmt: skip
        await self.store.close()
