"""`QuotaGuard`: the gateway's one door to the quota store.

It knows each tenant's limits, reads the wall clock, and decides what an
unreachable store means (`quota_store.on_error`): fail open onto a
`LocalLimiter` of this process, or refuse with 503. It never polls: after a
failure the store is left alone until `retry_interval_s` has passed, and the
next request to arrive after that tries it again. Settlements run in tasks of
their own so a request's end never waits on the network; those the store
could not take are kept and sent again, in order, once it answers.

Over a shared store (Redis) the guard also keeps a ledger: a `LocalLimiter`
of everything this gateway admitted in the current windows, store and
fallback alike, and its running requests. The fallback checks against it, so
a gateway failing open admits no more than the limit counting what it had
admitted before the outage (N gateways: at most N x the limit in a window).
When the store answers again, what was admitted without it is carried into
it; when the store lost its data (Redis restarted empty, seen as a changed
generation of the tenant's keys), everything the ledger holds is, before this
gateway reserves there again, and at the latest at its next renewal tick.

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
import functools
import logging
import time
from collections import Counter, defaultdict, deque
from collections.abc import Callable, Mapping
from dataclasses import dataclass

from qosgate.config.models import PolicyConfig, QuotaStoreConfig
from qosgate.config.secrets import redis_password, redis_url

from .local import LocalLimiter, mark_settled, settle_deltas
from .model import (
    Holding,
    LimitState,
    QuotaDecision,
    RateKind,
    Reservation,
    TenantLimits,
    oldest_slot,
)
from .store import MemoryQuotaStore, QuotaStore, QuotaStoreError, StoreRecovering, StoreReset

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
    unshared_tokens: int = 0
    """Tokens reserved on the local limiter (fail_open): admitted without the
    shared store, so each gateway's admissions add up alone until they are
    carried into it."""
    carried: int = 0
    """Times this gateway carried a tenant's admissions into the store: after
    an outage (what it admitted alone) or a data loss (all it held)."""
    last_error_unix: float | None = None
    """When a call to the store last failed (Unix time), or None."""


class QuotaStoreDown(Exception):
    """fail_closed and the store is unreachable; `retry_after_s` says when it
    will next be tried."""

    def __init__(self, message: str, retry_after_s: float) -> None:
        super().__init__(message)
        self.retry_after_s = retry_after_s


def _in_window(slots: dict[RateKind, dict[int, int]], now: float) -> dict[RateKind, dict[int, int]]:
    """The slots still in their limit's window: those older have left it."""
    kept: dict[RateKind, dict[int, int]] = {}
    for kind, amounts in slots.items():
        oldest = oldest_slot(kind, now)
        kept[kind] = {k: v for k, v in amounts.items() if k >= oldest and v}
    return kept


def build_store(cfg: QuotaStoreConfig) -> QuotaStore:
    if cfg.kind == "redis":
        from .redis_store import RedisQuotaStore

        return RedisQuotaStore(
            redis_url(cfg.url, cfg.url_env),
            password=redis_password(cfg.password_env),
            key_prefix=cfg.key_prefix,
            socket_timeout_s=cfg.timeout_ms / 1000,
            recovery_s=cfg.retry_interval_s,
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
        # The memory store is the ledger: it is never down and never loses data.
        self._keeps_ledger = not isinstance(store, MemoryQuotaStore)
        self._ledger = LocalLimiter()
        # Requests not yet settled, per tenant; and per tenant, limit and slot,
        # what was admitted on the fallback and has not reached the store.
        self._running: dict[str, dict[str, Reservation]] = {}
        self._unshared: defaultdict[str, defaultdict[RateKind, Counter[int]]] = defaultdict(
            lambda: defaultdict(Counter)
        )
        self._carrying: dict[str, asyncio.Future[None]] = {}
        self._down_until: float | None = None
        self._unsent: deque[tuple[Reservation, int, bool, float]] = deque()
        self._catching_up: asyncio.Task[None] | None = None
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

    @property
    def failing_open(self) -> bool:
        """The store is down and requests are admitted on this gateway's own
        limiter (fail_open): each gateway's admissions add up alone."""
        return self.store_down and self._cfg.on_error == "fail_open"

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
        return self._ledger.usage(tenant, limits, now)

    # -- reserve and settle ----------------------------------------------------

    async def reserve(
        self, tenant: str, tokens: int, request_id: str, *, record: bool = False
    ) -> QuotaDecision | None:
        """None for a tenant without limits. Raises QuotaStoreDown (fail_closed).
        `record`: a shared store keeps a record of the reservation until it is
        settled, so that after a restart it can be settled exactly once
        (`settle_recorded`). One made on the local limiter (fail_open) is not
        recorded: it goes with the process."""
        limits = self.limits(tenant)
        if limits is None:
            return None
        now = self._clock()
        if self._down_until is None or now >= self._down_until:
            try:
                decision = await self._store_reserve(
                    tenant, limits, tokens, request_id, now, record
                )
            except StoreRecovering as exc:
                return self._without_store(
                    tenant, limits, tokens, request_id, now, str(exc), exc.retry_after_s
                )
            except QuotaStoreError as exc:
                self._failed(now, exc)
            else:
                self._recovered()
                self._admitted(decision, now)
                return decision
        assert self._down_until is not None
        return self._without_store(
            tenant, limits, tokens, request_id, now,
            "the quota store is unreachable and this gateway fails closed",
            self._down_until - now,
        )  # fmt: skip

    def _without_store(
        self,
        tenant: str,
        limits: TenantLimits,
        tokens: int,
        request_id: str,
        now: float,
        why: str,
        retry_after_s: float,
    ) -> QuotaDecision:
        """The store cannot decide now: refuse (fail_closed) or decide on this
        gateway's ledger (fail_open)."""
        if self._cfg.on_error == "fail_closed":
            self.counters.refused_store_down += 1
            raise QuotaStoreDown(why, retry_after_s=max(1.0, retry_after_s))
        self.counters.fallback_reservations += 1
        decision = self._ledger.reserve(
            tenant, limits, tokens, request_id, now, lease_s=self._cfg.lease_s, store=FALLBACK
        )
        if decision.reservation is not None:
            self.counters.unshared_tokens += tokens
            unshared = self._unshared[tenant]
            for rule in limits.rates:
                unshared[rule.kind][rule.slot(now)] += 1 if rule.counts_requests else tokens
        self._admitted(decision, now)
        return decision

    async def _store_reserve(
        self, tenant: str, limits: TenantLimits, tokens: int, request_id: str, now: float,
        record: bool,
    ) -> QuotaDecision:  # fmt: skip
        if isinstance(self.store, MemoryQuotaStore):
            # Nothing in it awaits, so a cancellation cannot land half-way.
            return await self.store.reserve(
                tenant, limits, tokens, request_id, now, lease_s=self._cfg.lease_s
            )
        # A client that leaves while the script runs must not leave a
        # reservation behind: the call finishes on its own, and is refunded.
        task = asyncio.ensure_future(
            self._reserve_carrying(tenant, limits, tokens, request_id, now, record)
        )
        try:
            return await asyncio.shield(task)
        except asyncio.CancelledError:
            task.add_done_callback(self._refund_orphan)
            raise

    async def _reserve_carrying(
        self, tenant: str, limits: TenantLimits, tokens: int, request_id: str, now: float,
        record: bool,
    ) -> QuotaDecision:  # fmt: skip
        reserve = functools.partial(
            self.store.reserve, tenant, limits, tokens, request_id, now,
            lease_s=self._cfg.lease_s, record=record,
        )  # fmt: skip
        try:
            return await reserve(holds=self._ledger.holds(tenant, now))
        except StoreReset:
            # The store lost what this gateway admitted: not one reservation
            # there before it has it back. (A second loss meanwhile is a
            # store failure like any other.)
            await self._carry(tenant, whole=True)
            return await reserve(holds=True)

    def _refund_orphan(self, task: asyncio.Future[QuotaDecision]) -> None:
        if task.cancelled() or task.exception() is not None:
            return
        decision = task.result()
        if decision.reservation is not None:
            self._admitted(decision, self._clock())
            self.settle_soon(decision.reservation, 0, False)

    def settle_soon(self, reservation: Reservation, charged: int, served: bool) -> None:
        """Settle without making the caller wait (called from the request's
        end, which is synchronous). Exactly once per reservation."""
        # Its slot is given back here: no lease of it is renewed any more.
        tenant = reservation.tenant
        self._held.pop((tenant, reservation.request_id), None)
        now = self._clock()
        if self._keeps_ledger:
            running = self._running.get(tenant, {})
            running.pop(reservation.request_id, None)
            if not running:
                self._running.pop(tenant, None)
        if reservation.store == FALLBACK:
            mark_settled(reservation, charged)
            self._ledger.apply(reservation, charged, served, now)
            # Not carried yet: what reaches the store is what it came to.
            for rule, delta, k in settle_deltas(reservation, charged, served):
                self._unshared[tenant][rule.kind][k] += delta
            return
        if self._keeps_ledger:
            self._ledger.apply(reservation, charged, served, now)
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

    async def settle_recorded(
        self, tenant: str, request_id: str, charged: int, served: bool
    ) -> bool:
        """Settle a recorded reservation that a process which is gone (an
        earlier run of this one) made and may not have settled: if the store
        still holds it, it is settled now (`charged` kept); if it was settled
        already, or never made, nothing changes. A memory store's
        reservations, and a fail-open gateway's local ones, went with the
        process. Whether one was settled; raises QuotaStoreError when the
        store cannot be reached."""
        limits = self._limits.get(tenant)
        if limits is None or isinstance(self.store, MemoryQuotaStore):
            return False
        reservation = await self.store.find(tenant, request_id, limits)
        if reservation is None:
            return False
        await self.store.settle(reservation, charged, served, self._clock())
        return True

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

    # -- carrying admissions into the store --------------------------------------

    async def _carry(self, tenant: str, *, whole: bool) -> None:
        """Bring the store what this gateway admitted of the tenant and it
        lacks, once at a time per tenant: a caller that finds a carry under
        way waits for that one, which leaves the store with everything."""
        running = self._carrying.get(tenant)
        if running is None:
            running = asyncio.ensure_future(self._carry_now(tenant, whole))
            self._carrying[tenant] = running
            running.add_done_callback(lambda _: self._carrying.pop(tenant, None))
        await asyncio.shield(running)

    async def _carry_now(self, tenant: str, whole: bool) -> None:
        lease = self._cfg.lease_s
        now = self._clock()
        running = list(self._running.get(tenant, {}).values())
        if not whole:
            unshared = self._unshared.pop(tenant, {})
            holding = Holding(_in_window(unshared, now), [r for r in running if r.store == FALLBACK])
            if holding.empty:
                return
            try:
                await self.store.carry(tenant, holding, now, lease_s=lease, whole=False)
            except StoreReset:
                pass  # the store lost the rest too: carry the whole
            except QuotaStoreError:
                for kind, slots in unshared.items():
                    self._unshared[tenant][kind].update(slots)
                raise
            else:
                self._carried(holding, now)
                return
        holding = self._ledger.holding(tenant, now)
        holding.running = running
        await self.store.carry(tenant, holding, now, lease_s=lease, whole=True)
        self._unshared.pop(tenant, None)
        log.warning(
            "the quota store had lost tenant %s's windows; carried back what this gateway "
            "admitted in them", tenant,
        )  # fmt: skip
        self._carried(holding, now)

    def _carried(self, holding: Holding, now: float) -> None:
        self.counters.carried += 1
        until = now + self._cfg.lease_s
        for reservation in holding.running:
            key = (reservation.tenant, reservation.request_id)
            if key in self._held:
                self._held[key] = (reservation, until)

    async def _catch_up(self) -> None:
        """The store answers again: carry in what was admitted without it,
        then send the settlements it missed."""
        for tenant in list(self._unshared):
            try:
                await self._carry(tenant, whole=False)
            except QuotaStoreError as exc:
                self._failed(self._clock(), exc)
                return
        await self._resend()

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

    def _admitted(self, decision: QuotaDecision, now: float) -> None:
        reservation = decision.reservation
        if reservation is None:
            return
        if self._keeps_ledger:
            if reservation.store != FALLBACK:
                self._ledger.record(reservation, now)
            self._running.setdefault(reservation.tenant, {})[reservation.request_id] = reservation
        elif reservation.limits.max_concurrency is None:
            return
        if reservation.limits.max_concurrency is not None:
            key = (reservation.tenant, reservation.request_id)
            self._held[key] = (reservation, now + self._cfg.lease_s)
        if self._renew_timer is None:
            self._renew_timer = asyncio.get_running_loop().call_later(
                self._cfg.lease_s / 3, self._on_renew
            )

    def _on_renew(self) -> None:
        self._renew_timer = None
        if not self._held and not (self._keeps_ledger and self._ledger.tenants(self._clock())):
            return  # the next admission arms it again
        loop = asyncio.get_running_loop()
        self._renew_timer = loop.call_later(self._cfg.lease_s / 3, self._on_renew)
        if self._renewing is None or self._renewing.done():
            self._renewing = loop.create_task(self.renew())

    async def renew(self) -> None:
        """Extend the lease of every running request that holds a concurrency
        slot to `lease_s` from now: one store call for all of them (the timer
        does this every third of `lease_s`). The same call asks the store
        whether it still has every tenant this gateway holds admissions of,
        and what it lost is carried back."""
        now = self._clock()
        lease = self._cfg.lease_s
        on_store: dict[str, list[str]] = {}
        on_fallback: dict[str, list[str]] = {}
        for (tenant, rid), (reservation, _) in self._held.items():
            side = on_fallback if reservation.store == FALLBACK else on_store
            side.setdefault(tenant, []).append(rid)
        lost = self._ledger.renew(on_fallback, now, lease_s=lease) if on_fallback else set()
        if self._keeps_ledger:
            for tenant in self._ledger.tenants(now):
                on_store.setdefault(tenant, [])
        failed = False
        if on_store:
            try:
                renewal = await self.store.renew(on_store, now, lease_s=lease)
                for tenant in renewal.reset:
                    await self._carry(tenant, whole=True)
            except QuotaStoreError as exc:
                self._failed(self._clock(), exc)
                failed = True
            else:
                lost |= renewal.lost
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
        self.counters.last_error_unix = time.time()
        if self._down_until is None:
            log.warning(
                "quota store unreachable (%s); %s", exc,
                "serving on this gateway's local limiter" if self._cfg.on_error == "fail_open"
                else "refusing requests of tenants with quotas (fail_closed)",
            )  # fmt: skip
        # No doubling: one call per interval is all a down store gets from a
        # gateway, and a store back up is used again within the interval.
        self._down_until = now + self._cfg.retry_interval_s

    def _recovered(self) -> None:
        if self._down_until is not None:
            log.warning("quota store reachable again")
            self._down_until = None
        if (self._unsent or self._unshared) and (
            self._catching_up is None or self._catching_up.done()
        ):
            self._catching_up = asyncio.get_running_loop().create_task(self._catch_up())

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
        if self._catching_up is not None:
            await asyncio.gather(self._catching_up, return_exceptions=True)
        if self._unsent:
            await self._resend()
            if self._unsent:
                log.warning(
                    "%d quota settlements never reached the store; their tokens stay charged "
                    "until their windows pass", len(self._unsent),
                )  # fmt: skip
        await self.store.close()
