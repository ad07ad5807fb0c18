"""Distributed mode: a shared per-tier work queue that gateway replicas fill
and engine nodes drain under leases (memory and Redis stores)."""

from .model import (
    Claim,
    FleetLoad,
    FleetTiers,
    Lease,
    WorkItem,
    pick_tier,
    predicted_wait,
)
from qosgate.runtime.errors import WorkQueueError, WorkQueueFull, WorkQueueOverloaded

from .store import ItemStatus, MemoryWorkQueue, WorkQueue

__all__ = [
    "Claim",
    "FleetLoad",
    "FleetTiers",
    "ItemStatus",
    "Lease",
    "MemoryWorkQueue",
    "WorkItem",
    "WorkQueue",
    "WorkQueueError",
    "WorkQueueFull",
    "WorkQueueOverloaded",
    "pick_tier",
    "predicted_wait",
]
