"""One tier's queue: its release order, its oldest request, and its running totals."""

from __future__ import annotations

from collections import OrderedDict
from dataclasses import fields

from qosgate.core.admission import ArrivalRate
from qosgate.core.fairness import FairnessOrder
from qosgate.core.policy import TierParams
from qosgate.core.request import Request, RequestState

_SETTINGS = tuple(f.name for f in fields(TierParams))
"""What a queue copies of its tier (the rules read them off the queue)."""


class TierQueue:
    """Queued requests of one tier.

    `order` decides who is released next (FIFO or VTC between tenants);
    `_by_age` keeps admission order so the oldest request, which drives ageing,
    batch windows and expiry, is found in O(1) and any request leaves in O(1).
    """

    __slots__ = (
        *_SETTINGS, "order", "_by_age", "work", "prompt_tokens", "running", "inflow", "credit"
    )

    def __init__(self, tier: TierParams, order: FairnessOrder, inflow_tau_s: float = 10.0) -> None:
        self.configure(tier)
        self.order = order
        self._by_age: OrderedDict[str, Request] = OrderedDict()
        self.work = 0
        """Expected backend tokens of everything queued (prompt + expected output)."""
        self.prompt_tokens = 0
        self.running: dict[str, Request] = {}
        """Requests of this tier on the backend, in dispatch order (newest last)."""
        self.inflow = ArrivalRate(inflow_tau_s)
        """Work admitted to this tier per second."""
        self.credit = 0.0
        """Its guaranteed share's credit (ordering.share_credit)."""

    def configure(self, tier: TierParams) -> None:
        """Take the tier's settings, as TierParams describes them (again on a
        reload: what is queued stays)."""
        for name in _SETTINGS:
            setattr(self, name, getattr(tier, name))

    def reorder(self, order: FairnessOrder) -> None:
        """Release from now on in `order`, with what is queued in it, in
        admission order (a reload that changed which order the tier takes)."""
        self.order = order
        for req in self._by_age.values():
            order.push(req)

    def __len__(self) -> int:
        return len(self._by_age)

    def oldest(self) -> Request | None:
        for req in self._by_age.values():
            return req
        return None

    @property
    def oldest_arrival(self) -> float | None:
        oldest = self.oldest()
        return oldest.arrival if oldest is not None else None

    def inflow_rate(self, now: float) -> float:
        return self.inflow.rate(now)

    def push(self, req: Request, *, front: bool = False) -> None:
        req.state = RequestState.QUEUED
        self._by_age[req.id] = req
        if front:
            # A preempted request goes back ahead of everything admitted after it.
            self._by_age.move_to_end(req.id, last=False)
        self.work += req.work
        self.prompt_tokens += req.prompt_tokens
        self.order.push(req)

    def _forget(self, req: Request) -> None:
        del self._by_age[req.id]
        self.work -= req.work
        self.prompt_tokens -= req.prompt_tokens
        if not self._by_age:
            self.credit = 0.0

    def remove(self, req: Request) -> None:
        """Take `req` out of turn (cancelled, expired: already ended)."""
        self._forget(req)
        self.order.discard(req)

    def peek(self) -> Request | None:
        return self.order.peek()

    def pop(self) -> Request:
        req = self.order.pop()
        self._forget(req)
        return req
