"""The `QuotaStore` port and its in-process implementation."""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Collection, Mapping

from .local import LocalLimiter
from .model import Holding, LimitState, QuotaDecision, Renewal, Reservation, TenantLimits


class QuotaStoreError(Exception):
    """The store could not be reached or did not answer in time."""


class StoreReset(QuotaStoreError):
    """The store lost the tenant's data (Redis restarted empty) while this
    gateway holds admissions of it: carry them back (`carry`, whole) first."""

    def __init__(self, tenant: str) -> None:
        super().__init__(f"the quota store lost tenant {tenant!r}'s windows")
        self.tenant = tenant


class StoreRecovering(Exception):
    """The store lost the tenant's data a moment ago and the gateways are
    carrying theirs back: no reservation of it for `retry_after_s`."""

    def __init__(self, tenant: str, retry_after_s: float) -> None:
        super().__init__(
            f"the quota store is taking back tenant {tenant!r}'s windows from the gateways"
        )
        self.tenant = tenant
        self.retry_after_s = retry_after_s


class QuotaStore(ABC):
    """Where quota counters live. Every method takes the wall-clock `now`
    (seconds since the epoch): replicas sharing a store must agree on which
    window a reservation falls in, and a per-process loop clock would not."""

    name: str = ""

    @abstractmethod
    async def reserve(
        self,
        tenant: str,
        limits: TenantLimits,
        tokens: int,
        request_id: str,
        now: float,
        *,
        lease_s: float,
        holds: bool = False,
        record: bool = False,
    ) -> QuotaDecision:
        """Check every limit and reserve under all of them, atomically, or
        refuse. `lease_s` bounds how long a concurrency slot is held if the
        holder never settles (a replica that died). `record`: keep a record
        of the reservation by request id until it is settled (a store that
        outlives the process; `find`). `holds`: this gateway has
        admitted some of the tenant's current windows; a store that lost them
        since raises StoreReset instead of deciding without them, and
        StoreRecovering while other gateways may still be carrying theirs."""

    @abstractmethod
    async def settle(self, reservation: Reservation, charged: int, served: bool, now: float) -> None:
        """End a reservation exactly once (SettledTwice otherwise): keep
        `charged` tokens and refund the rest; give the request back unless it
        was `served`; free its concurrency slot."""

    @abstractmethod
    async def renew(
        self, leases: Mapping[str, Collection[str]], now: float, *, lease_s: float
    ) -> Renewal:
        """Extend the concurrency lease of each running request named (tenant
        -> request ids, any number of tenants, in one call) to `now + lease_s`.
        A lease that already ended (expired, or released by a settlement) is
        not taken back: its (tenant, request id) is returned, as lost. A
        tenant named with no ids is only checked: one whose data the store
        lost is returned in `reset` (its leases are not renewed)."""

    @abstractmethod
    async def carry(
        self, tenant: str, holding: Holding, now: float, *, lease_s: float, whole: bool
    ) -> None:
        """Add what this gateway holds of the tenant to the store: `whole`,
        everything, into a store that lost it (StoreReset); otherwise what it
        admitted without the store (raises StoreReset if the store has lost
        the rest since). Running requests join the store's current
        generation, and those under max_concurrency hold a slot on a lease of
        `lease_s`."""

    @abstractmethod
    async def release(self, leases: Mapping[str, Collection[str]]) -> None:
        """Free the concurrency slot of each request named (tenant -> request
        ids, in one call) whose holder is known to be gone, without settling
        its tokens: what it reserved stays charged until its window passes."""

    @abstractmethod
    async def usage(self, tenant: str, limits: TenantLimits, now: float) -> tuple[LimitState, ...]:
        """Read-only: each limit as it stands."""

    async def find(
        self, tenant: str, request_id: str, limits: TenantLimits
    ) -> Reservation | None:
        """A recorded reservation not yet settled, made by a process that may
        be gone (None: there is none, or the store keeps no records)."""
        return None

    async def ping(self) -> None:
        """Raise QuotaStoreError unless the store answers."""

    async def close(self) -> None:
        """Release connections."""


class MemoryQuotaStore(QuotaStore):
    """One process's counters (`quota_store.kind: memory`)."""

    name = "memory"

    def __init__(self) -> None:
        self._limiter = LocalLimiter()

    async def reserve(
        self,
        tenant: str,
        limits: TenantLimits,
        tokens: int,
        request_id: str,
        now: float,
        *,
        lease_s: float,
        holds: bool = False,
        record: bool = False,
    ) -> QuotaDecision:
        # Its reservations live as long as the process: nothing to record.
        return self._limiter.reserve(
            tenant, limits, tokens, request_id, now, lease_s=lease_s, store=self.name
        )

    async def settle(self, reservation: Reservation, charged: int, served: bool, now: float) -> None:
        self.settle_now(reservation, charged, served, now)

    def settle_now(self, reservation: Reservation, charged: int, served: bool, now: float) -> None:
        """`settle` without the await: nothing here waits on I/O."""
        self._limiter.settle(reservation, charged, served, now)

    async def renew(
        self, leases: Mapping[str, Collection[str]], now: float, *, lease_s: float
    ) -> Renewal:
        return Renewal(lost=self._limiter.renew(leases, now, lease_s=lease_s))

    async def carry(
        self, tenant: str, holding: Holding, now: float, *, lease_s: float, whole: bool
    ) -> None:
        # Its data lives as long as the process: only 'add' ever comes here.
        self._limiter.add(tenant, holding, now, lease_s=lease_s)
        for reservation in holding.running:
            reservation.store = self.name

    async def release(self, leases: Mapping[str, Collection[str]]) -> None:
        self._limiter.release(leases)

    async def usage(self, tenant: str, limits: TenantLimits, now: float) -> tuple[LimitState, ...]:
        return self._limiter.usage(tenant, limits, now)
