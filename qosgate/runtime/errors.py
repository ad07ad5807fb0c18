"""The gateway's typed errors.

Each class stands for one way a request can end without completing, so it
carries the one `Outcome` (metrics label, log field) and the one HTTP status
that way of ending maps to; the HTTP layer renders any of them generically in
OpenAI's error shape.
"""

from __future__ import annotations

from typing import Any, ClassVar

from qosgate.core.admission import MAX_RETRY_AFTER_S, retry_after_header
from qosgate.core.request import Outcome


class GatewayError(Exception):
    """A request the gateway answers with an error instead of output."""

    status: ClassVar[int] = 500
    outcome: ClassVar[Outcome] = Outcome.BACKEND_ERROR
    code: ClassVar[str] = "internal_error"
    """OpenAI-style `error.code`."""
    type: ClassVar[str] = "server_error"
    """OpenAI-style `error.type`."""
    detail: str | None = None
    """What went wrong, for the gateway's log only (it may name hosts)."""

    def __init__(
        self, message: str, *, retry_after_s: float | None = None, param: str | None = None
    ) -> None:
        super().__init__(message)
        self.message = message
        self.retry_after_s = retry_after_s
        """Seconds after which a retry may succeed (sent as Retry-After), if known."""
        self.param = param
        """The request field at fault, for 400s."""

    @property
    def retry_after_header(self) -> str | None:
        return retry_after_header(self.retry_after_s)

    def body(self) -> dict[str, Any]:
        """The OpenAI error body."""
        return {
            "error": {
                "message": self.message,
                "type": self.type,
                "code": self.code,
                "param": self.param,
            }
        }


class QueueFull(GatewayError):
    """The tier's queue holds `max_queue_len` requests already."""


class QuotaExceeded(GatewayError):
    """The tenant's quota cannot hold the request now (Retry-After: when it
    will), or ever (no Retry-After: the request alone is larger)."""


class QuotaStoreUnavailable(GatewayError):
    """The quota store is unreachable and the gateway fails closed."""


class QuotaLeaseLost(QuotaStoreUnavailable):
    """A running request's concurrency lease ran out before the quota store
    could renew it, and the gateway fails closed: the request is cut (charged
    what ran), so that none runs without a live lease."""


class Overloaded(GatewayError):
    """Admission predicted a queue wait beyond the tier's budget."""


class Expired(GatewayError):
    """The request was still queued at its tier's deadline (its queue budget, or a
    delay tier's expire_after_ms)."""


class BackendFailed(GatewayError):
    """The backend failed the request."""


class BackendUnavailableError(GatewayError):
    """The backend is down or not ready; worth retrying later."""


class GatewayClosing(BackendUnavailableError):
    """The gateway shut down under the request. The client is told 503 like for
    a backend that is down (another replica can serve it), but nothing failed:
    the gateway cancelled the request, and the outcome says so."""

    def __init__(self) -> None:
        super().__init__("the gateway is shutting down", retry_after_s=1.0)


class WorkQueueFull(QueueFull):
    """Fleet mode: the tier's queue in the shared store already holds
    `max_queue_len` items."""

    def __init__(self, tier: str, max_queued: int) -> None:
        super().__init__(
            f"tier {tier!r} has {max_queued} requests queued in the fleet", retry_after_s=1.0
        )


class WorkQueueOverloaded(Overloaded):
    """Fleet mode: the wait predicted over the live engine nodes exceeds the
    tier's budget."""

    def __init__(self, tier: str, predicted_wait_s: float, budget_s: float) -> None:
        super().__init__(
            f"predicted queue wait {predicted_wait_s:.2f}s in the fleet exceeds tier "
            f"{tier!r} budget {budget_s:.2f}s",
            retry_after_s=min(predicted_wait_s - budget_s, MAX_RETRY_AFTER_S),
        )
        self.predicted_wait_s = predicted_wait_s
        self.budget_s = budget_s


class WorkQueueError(BackendUnavailableError):
    """Fleet mode: the shared queue's store could not be reached or did not
    answer in time."""

    def __init__(self, message: str) -> None:
        super().__init__(f"the fleet's queue is not reachable: {message}", retry_after_s=1.0)


class BadRequest(GatewayError):
    """The request can never be served as given; `param` names the field."""


class ContextLengthExceeded(BadRequest):
    """400: the prompt, or the prompt and the asked output, exceed the model's
    context (OpenAI's code for it)."""


class Unauthorized(GatewayError):
    """Credentials missing or not valid (an API key, the admin token)."""


class AuthThrottled(GatewayError):
    """The client's address failed authentication too often: refused unchecked
    until its allowance refills (Retry-After), so keys cannot be guessed fast."""


class RequestTimeout(GatewayError):
    """The request body did not arrive within `server.body_timeout_s`."""


class PayloadTooLarge(GatewayError):
    """The request body is over `server.max_body_bytes`."""


class PolicyRejected(BadRequest):
    """A reload that was refused; the running policy stays."""


class BatchesNotConfigured(BadRequest):
    """A Batch API route on a gateway without `batch.data_dir`: a 404, as for a
    route the gateway does not serve, with a code of its own."""

    def __init__(self) -> None:
        super().__init__(
            "Batches are not configured on this gateway: its policy sets no batch.data_dir."
        )


class BatchObjectNotFound(BadRequest):
    """No such file or batch of the tenant's (another tenant's is none of its)."""


class InvalidBatchFile(BadRequest):
    """A batch input file that cannot run as given; the message names the line."""


class FileInUse(BadRequest):
    """The file is the input of a batch still running."""


class BatchStoreUnavailable(GatewayError):
    """The batch jobs' shared store (Redis, in fleet mode) cannot be reached.
    The client is told to try again shortly; what went wrong is in `detail`,
    which str() gives too."""

    def __init__(self, detail: str) -> None:
        super().__init__("The batch store cannot be reached now; try again shortly.",
                         retry_after_s=1.0)  # fmt: skip
        self.detail = detail

    def __str__(self) -> str:
        return self.detail


class BatchNotCancellable(BadRequest):
    """The batch has already ended (or is ending) and cannot be cancelled."""


def _give_rows(table: dict[type[GatewayError], tuple[int, Outcome, str, str]]) -> None:
    """Give each error class its row: (status, outcome, code, type)."""
    for cls, (status, outcome, code, type_) in table.items():
        cls.status, cls.outcome, cls.code, cls.type = status, outcome, code, type_


_INVALID, _RATE_LIMITED, _SERVER = "invalid_request_error", "rate_limit_error", "server_error"

# The one table: each way a request can end without completing, its HTTP
# status, its outcome, and OpenAI's `error.code` and `error.type` for it.
_give_rows({
    QueueFull: (429, Outcome.REJECTED_QUEUE_FULL, "queue_full", _RATE_LIMITED),
    QuotaExceeded: (429, Outcome.REJECTED_QUOTA, "rate_limit_exceeded", _RATE_LIMITED),
    QuotaStoreUnavailable: (503, Outcome.REJECTED_QUOTA, "quota_store_unavailable", _SERVER),
    QuotaLeaseLost: (503, Outcome.CANCELLED, "quota_lease_lost", _SERVER),
    Overloaded: (503, Outcome.REJECTED_OVERLOAD, "overloaded", _SERVER),
    Expired: (504, Outcome.EXPIRED, "queue_timeout", _SERVER),
    BackendFailed: (502, Outcome.BACKEND_ERROR, "backend_error", _SERVER),
    BackendUnavailableError: (503, Outcome.BACKEND_ERROR, "backend_unavailable", _SERVER),
    GatewayClosing: (503, Outcome.CANCELLED, "shutting_down", _SERVER),
    BadRequest: (400, Outcome.BAD_REQUEST, "invalid_request", _INVALID),
    ContextLengthExceeded: (400, Outcome.BAD_REQUEST, "context_length_exceeded", _INVALID),
    Unauthorized: (401, Outcome.UNAUTHORIZED, "invalid_api_key", "authentication_error"),
    AuthThrottled: (429, Outcome.UNAUTHORIZED, "too_many_authentication_failures", _RATE_LIMITED),
    RequestTimeout: (408, Outcome.BAD_REQUEST, "request_timeout", _INVALID),
    PayloadTooLarge: (413, Outcome.BAD_REQUEST, "request_too_large", _INVALID),
    PolicyRejected: (400, Outcome.BAD_REQUEST, "policy_rejected", _INVALID),
    BatchesNotConfigured: (404, Outcome.BAD_REQUEST, "batches_not_configured", _INVALID),
    BatchObjectNotFound: (404, Outcome.BAD_REQUEST, "not_found", _INVALID),
    InvalidBatchFile: (400, Outcome.BAD_REQUEST, "invalid_file", _INVALID),
    FileInUse: (409, Outcome.BAD_REQUEST, "file_in_use", _INVALID),
    BatchNotCancellable: (409, Outcome.BAD_REQUEST, "batch_not_cancellable", _INVALID),
    BatchStoreUnavailable: (503, Outcome.BACKEND_ERROR, "batch_store_unavailable", _SERVER),
})  # fmt: skip
