"""Per-tenant quotas: sliding-window token and request limits, concurrency
caps, and the stores that hold them (memory, Redis)."""

from .guard import FALLBACK, QuotaGuard, QuotaStoreDown, build_store
from .model import SLOTS, LimitState, Renewal, Reservation, SettledTwice, TenantLimits
from .store import MemoryQuotaStore, QuotaStore, QuotaStoreError, StoreReset

__all__ = [
    "FALLBACK", "SLOTS", "LimitState", "MemoryQuotaStore", "QuotaGuard", "QuotaStore",
    "QuotaStoreDown", "QuotaStoreError", "Renewal", "Reservation", "SettledTwice", "StoreReset",
    "TenantLimits", "build_store",
]  # fmt: skip
