"""Distributed mode: a shared per-tier work queue that gateway replicas fill
and engine nodes drain under leases (memory and Redis stores)."""

from .model import FleetLoad, FleetTiers, Lease, Prefill, WorkItem, pick_tier, predicted_wait
from .store import MemoryWorkQueue, WorkQueue

__all__ = [
    "FleetLoad", "FleetTiers", "Lease", "MemoryWorkQueue", "Prefill", "WorkItem", "WorkQueue",
    "pick_tier", "predicted_wait",
]  # fmt: skip
