"""Per-tenant quotas: sliding-window token and request limits, concurrency
caps, and the stores that hold them (memory, Redis)."""

from .guard import FALLBACK, GuardCounters, QuotaGuard, QuotaStoreDown, build_store
from .local import LocalLimiter
from .model import (
    SLOTS,
    LimitState,
    QuotaDecision,
    RateRule,
    Reservation,
    SettledTwice,
    TenantLimits,
)
from .store import MemoryQuotaStore, QuotaStore, QuotaStoreError

__all__ = [
    "FALLBACK",
    "SLOTS",
    "GuardCounters",
    "LimitState",
    "LocalLimiter",
    "MemoryQuotaStore",
    "QuotaDecision",
    "QuotaGuard",
    "QuotaStore",
    "QuotaStoreDown",
    "QuotaStoreError",
    "RateRule",
    "Reservation",
    "SettledTwice",
    "TenantLimits",
    "build_store",
]
