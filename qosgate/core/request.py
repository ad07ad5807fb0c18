"""The request record the core schedules, and the outcome every request ends with."""

from __future__ import annotations

import enum
from dataclasses import dataclass, field


class Outcome(enum.StrEnum):
    """How a request ended. Exactly one per request; also the metrics label."""

    COMPLETED = "completed"
    REJECTED_QUOTA = "rejected_quota"
    REJECTED_OVERLOAD = "rejected_overload"
    REJECTED_QUEUE_FULL = "rejected_queue_full"
    EXPIRED = "expired"
    CANCELLED = "cancelled"
    BACKEND_ERROR = "backend_error"
    BAD_REQUEST = "bad_request"
    UNAUTHORIZED = "unauthorized"


_ROUNDING_S = 1e-9


class RequestState(enum.Enum):
    NEW = "new"
    QUEUED = "queued"
    RUNNING = "running"
    FINISHED = "finished"


@dataclass(slots=True, eq=False)
class Request:
    """One inference request as the scheduler sees it (no prompt text: only sizes)."""

    id: str
    tenant: str
    tier: str
    prompt_tokens: int
    max_tokens: int
    arrival: float
    """When it reached the gateway (scheduler clock, seconds)."""
    priority_offset: int = 0
    """Levels below its tier's priority the client asked for (never above)."""

    state: RequestState = RequestState.NEW
    outcome: Outcome | None = None
    deadline: float | None = None
    """When its queue budget runs out (None: no budget)."""
    dispatched_at: float | None = None
    """Last time it was released to the backend."""
    first_token_at: float | None = None
    finished_at: float | None = None
    output_tokens: int = 0
    """Output tokens produced (reported by the backend)."""
    preemptions: int = 0
    seq: int = 0
    """Admission order, the tie-breaker everywhere (set by the scheduler)."""
    work: int = field(default=0, repr=False)
    """Tokens of backend work it is expected to cost (prompt + expected output),
    fixed at admission so queue totals stay consistent when it leaves."""
    charged_service: float = field(default=0.0, repr=False)
    """Virtual service charged to its tenant at dispatch (vtc bookkeeping)."""

    @property
    def finished(self) -> bool:
        return self.state is RequestState.FINISHED

    def end(self, outcome: Outcome | None, now: float) -> None:
        self.state = RequestState.FINISHED
        self.outcome = outcome
        self.finished_at = now

    @property
    def queue_wait(self) -> float | None:
        if self.dispatched_at is None:
            return None
        return self.dispatched_at - self.arrival

    @property
    def ttft(self) -> float | None:
        if self.first_token_at is None:
            return None
        return self.first_token_at - self.arrival

    def met_objective(self, ttft_slo_s: float | None, e2e_slo_s: float | None) -> bool | None:
        """Whether this request met its tier's objective: its time to first
        token if the tier has a TTFT objective, else its end-to-end latency if
        it has one; None when the tier has neither. Only a completed request
        can meet one. A completed answer with no token came whole at its end,
        so its first token is its end. Within a nanosecond counts as met, so
        that a latency computed from two clock readings is not failed by float
        rounding at the boundary."""
        if self.outcome is not Outcome.COMPLETED:
            return False if ttft_slo_s is not None or e2e_slo_s is not None else None
        end = self.finished_at
        if ttft_slo_s is not None:
            first = self.first_token_at if self.first_token_at is not None else end
            return first is not None and first - self.arrival <= ttft_slo_s + _ROUNDING_S
        if e2e_slo_s is not None:
            return end is not None and end - self.arrival <= e2e_slo_s + _ROUNDING_S
        return None
