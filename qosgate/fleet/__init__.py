"""Distributed mode: a shared per-tier work queue that gateway replicas fill
and engine nodes drain under leases (memory and Redis stores)."""

from .model import Claim, FleetTier, FleetTiers, Lease, WorkItem, boost, effective_level, pick_tier
from .store import ItemStatus, MemoryWorkQueue, WorkQueue, WorkQueueError, WorkQueueFull

__all__ = [
    "Claim",
    "FleetTier",
    "FleetTiers",
    "ItemStatus",
    "Lease",
    "MemoryWorkQueue",
    "WorkItem",
    "WorkQueue",
    "WorkQueueError",
    "WorkQueueFull",
    "boost",
    "effective_level",
    "pick_tier",
]
