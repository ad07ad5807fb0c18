"""A minimal virtual-clock harness for the core: a backend with a fixed number of
slots whose requests each take a known service time. No asyncio, no sleeps."""

from __future__ import annotations

from dataclasses import dataclass, field

from qosgate.config.models import PolicyConfig
from qosgate.config.scheduling import scheduling_policy
from qosgate.core.request import Outcome, Request
from qosgate.core.scheduler import BackendCapacity, SchedulePlan, Scheduler


@dataclass
class SlotBackend:
    slots: int
    kv_tokens: int = 1 << 40
    running: dict[str, float] = field(default_factory=dict)
    """request id -> time it completes."""
    kv_used: dict[str, int] = field(default_factory=dict)
    max_seen: int = 0

    def capacity(self) -> BackendCapacity:
        used = sum(self.kv_used.values())
        return BackendCapacity(self.slots - len(self.running), self.kv_tokens - used, self.kv_tokens)

    def start(self, req: Request, now: float, service: float, kv: int) -> None:
        assert len(self.running) < self.slots, "dispatcher overfilled the backend"
        assert sum(self.kv_used.values()) + kv <= self.kv_tokens, "dispatcher overfilled the KV cache"
        self.running[req.id] = now + service
        self.kv_used[req.id] = kv
        self.max_seen = max(self.max_seen, len(self.running))

    def stop(self, req_id: str) -> None:
        self.running.pop(req_id, None)
        self.kv_used.pop(req_id, None)

    def next_completion(self) -> tuple[float, str] | None:
        if not self.running:
            return None
        req_id = min(self.running, key=lambda r: (self.running[r], r))
        return self.running[req_id], req_id


@dataclass
class Harness:
    """Drives a Scheduler and a SlotBackend through arrivals on a virtual clock."""

    policy: PolicyConfig
    slots: int = 2
    service: callable = lambda req: 1.0  # noqa: E731
    output_tokens: callable = lambda req: req.max_tokens  # noqa: E731
    drain_rate_hint: float = 1000.0
    now: float = 0.0
    scheduler: Scheduler = None
    backend: SlotBackend = None
    all_requests: list[Request] = field(default_factory=list)
    plans: list[SchedulePlan] = field(default_factory=list)
    wakeup: float | None = None
    step_tokens: int | None = None
    """The engine's tokens per step, for an automatic prefill budget."""
    in_order: bool = False
    """The engine takes its queue in arrival order (Backend.arrival_order_queue)."""

    def __post_init__(self) -> None:
        rules = scheduling_policy(self.policy, step_tokens=self.step_tokens, in_order=self.in_order)
        self.scheduler = Scheduler(rules, drain_rate_hint=self.drain_rate_hint)
        self.backend = SlotBackend(self.slots)

    def submit(self, req: Request):
        self.all_requests.append(req)
        decision = self.scheduler.submit(req, self.now)
        self.schedule()
        return decision

    def schedule(self) -> SchedulePlan:
        while True:
            cap = self.backend.capacity()
            plan = self.scheduler.schedule(self.now, cap)
            self.plans.append(plan)
            assert len(plan.dispatch) <= max(cap.free_slots, 0)
            for req in plan.preempt:
                self.backend.stop(req.id)
            for req in plan.dispatch:
                self.backend.start(req, self.now, self.service(req), req.work)
            self.wakeup = plan.wakeup_at
            if not plan.preempt:
                return plan

    def advance(self, until: float) -> None:
        """Run completions and timers up to `until`."""
        while True:
            nxt = self.backend.next_completion()
            candidates = [t for t in (nxt[0] if nxt else None, self.wakeup) if t is not None]
            t = min(candidates) if candidates else None
            if t is None or t > until:
                break
            self.now = max(self.now, t)
            if nxt and nxt[0] <= self.now:
                req_id = nxt[1]
                self.backend.stop(req_id)
                req = self.scheduler.get(req_id)
                self.scheduler.on_first_token(req_id, self.now)
                self.scheduler.finish(req_id, self.now, Outcome.COMPLETED, self.output_tokens(req))
            self.schedule()
        self.now = max(self.now, until)
        self.schedule()

    def drain(self, limit: float = 1e7) -> None:
        self.advance(limit)
        assert self.scheduler.queued_count == 0 and self.scheduler.running_count == 0

