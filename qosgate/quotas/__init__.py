"""Per-tenant quotas: sliding-window token and request limits, concurrency
caps, and the stores that hold them (memory, Redis)."""

from .guard import FALLBACK, GuardCounters, QuotaGuard, QuotaStoreDown, build_store
from .local import LocalLimiter
from .model import (
    SLOTS,
    LimitState,
    Holding,
    QuotaDecision,
    RateRule,
    Renewal,
    Reservation,
    SettledTwice,
    TenantLimits,
)
from .store import MemoryQuotaStore, QuotaStore, QuotaStoreError, StoreRecovering, StoreReset

__all__ = [
    "FALLBACK",
    "SLOTS",
    "GuardCounters",
    "Holding",
    "LimitState",
    "LocalLimiter",
    "MemoryQuotaStore",
    "QuotaDecision",
    "QuotaGuard",
    "QuotaStore",
    "QuotaStoreDown",
    "QuotaStoreError",
    "RateRule",
    "Renewal",
    "Reservation",
    "SettledTwice",
    "StoreRecovering",
    "StoreReset",
    "TenantLimits",
    "build_store",
]
