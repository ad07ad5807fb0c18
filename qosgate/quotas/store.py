"""The `QuotaStore` port and its in-process implementation."""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Collection, Mapping

from .local import LocalLimiter
from .model import LimitState, QuotaDecision, Reservation, TenantLimits


class QuotaStoreError(Exception):
    """The store could not be reached or did not answer in time."""


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
    ) -> QuotaDecision:
        """Check every limit and reserve under all of them, atomically, or
        refuse. `lease_s` bounds how long a concurrency slot is held if the
        holder never settles (a replica that died)."""

    @abstractmethod
    async def settle(self, reservation: Reservation, charged: int, served: bool, now: float) -> None:
        """End a reservation exactly once (SettledTwice otherwise): keep
        `charged` tokens and refund the rest; give the request back unless it
        was `served`; free its concurrency slot."""

    @abstractmethod
    async def renew(
        self, leases: Mapping[str, Collection[str]], now: float, *, lease_s: float
    ) -> set[tuple[str, str]]:
        """Extend the concurrency lease of each running request named (tenant
        -> request ids, any number of tenants, in one call) to `now + lease_s`.
        A lease that already ended (expired, or released by a settlement) is
        not taken back: its (tenant, request id) is returned, as lost."""

    @abstractmethod
    async def release(self, leases: Mapping[str, Collection[str]]) -> None:
        """Free the concurrency slot of each request named (tenant -> request
        ids, in one call) whose holder is known to be gone, without settling
        its tokens: what it reserved stays charged until its window passes."""

    @abstractmethod
    async def usage(self, tenant: str, limits: TenantLimits, now: float) -> tuple[LimitState, ...]:
        """Read-only: each limit as it stands."""

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
    ) -> QuotaDecision:
        return self._limiter.reserve(
            tenant, limits, tokens, request_id, now, lease_s=lease_s, store=self.name
        )

    async def settle(self, reservation: Reservation, charged: int, served: bool, now: float) -> None:
        self._limiter.settle(reservation, charged, served, now)

    def settle_now(self, reservation: Reservation, charged: int, served: bool, now: float) -> None:
        """`settle` without the await: nothing here waits on I/O."""
        self._limiter.settle(reservation, charged, served, now)

    async def renew(
        self, leases: Mapping[str, Collection[str]], now: float, *, lease_s: float
    ) -> set[tuple[str, str]]:
        return self._limiter.renew(leases, now, lease_s=lease_s)

    async def release(self, leases: Mapping[str, Collection[str]]) -> None:
        self._limiter.release(leases)

    async def usage(self, tenant: str, limits: TenantLimits, now: float) -> tuple[LimitState, ...]:
        return self._limiter.usage(tenant, limits, now)
