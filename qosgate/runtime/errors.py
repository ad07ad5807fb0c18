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

    status = 429
    outcome = Outcome.REJECTED_QUEUE_FULL
    code = "queue_full"
    type = "rate_limit_error"


class QuotaExceeded(GatewayError):
    """The tenant's quota cannot hold the request now (Retry-After: when it
    will), or ever (no Retry-After: the request alone is larger)."""

    status = 429
    outcome = Outcome.REJECTED_QUOTA
    code = "rate_limit_exceeded"
    type = "rate_limit_error"


class QuotaStoreUnavailable(GatewayError):
    """The quota store is unreachable and the gateway fails closed."""

    status = 503
    outcome = Outcome.REJECTED_QUOTA
    code = "quota_store_unavailable"


class QuotaLeaseLost(QuotaStoreUnavailable):
    """A running request's concurrency lease ran out before the quota store
    could renew it, and the gateway fails closed: the request is cut (charged
    what ran), so that none runs without a live lease."""

    outcome = Outcome.CANCELLED
    code = "quota_lease_lost"


class Overloaded(GatewayError):
    """Admission predicted a queue wait beyond the tier's budget."""

    status = 503
    outcome = Outcome.REJECTED_OVERLOAD
    code = "overloaded"


class Expired(GatewayError):
    """The request was still queued at its tier's deadline (its queue budget, or a
    delay tier's expire_after_ms)."""

    status = 504
    outcome = Outcome.EXPIRED
    code = "queue_timeout"


class BackendFailed(GatewayError):
    """The backend failed the request."""

    status = 502
    outcome = Outcome.BACKEND_ERROR
    code = "backend_error"


class BackendUnavailableError(GatewayError):
    """The backend is down or not ready; worth retrying later."""

    status = 503
    outcome = Outcome.BACKEND_ERROR
    code = "backend_unavailable"


class GatewayClosing(BackendUnavailableError):
    """The gateway shut down under the request. The client is told 503 like for
    a backend that is down (another replica can serve it), but nothing failed:
    the gateway cancelled the request, and the outcome says so."""

    outcome = Outcome.CANCELLED
    code = "shutting_down"

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

    status = 400
    outcome = Outcome.BAD_REQUEST
    code = "invalid_request"
    type = "invalid_request_error"


class ContextLengthExceeded(BadRequest):
    """400: the prompt, or the prompt and the asked output, exceed the model's
    context (OpenAI's code for it)."""

    code = "context_length_exceeded"


class Unauthorized(GatewayError):
    status = 401
    outcome = Outcome.UNAUTHORIZED
    code = "invalid_api_key"
    type = "authentication_error"


class AuthThrottled(GatewayError):
    """The client's address failed authentication too often: refused unchecked
    until its allowance refills (Retry-After), so keys cannot be guessed fast."""

    status = 429
    outcome = Outcome.UNAUTHORIZED
    code = "too_many_authentication_failures"
    type = "rate_limit_error"


class RequestTimeout(GatewayError):
    """The request body did not arrive within `server.body_timeout_s`."""

    status = 408
    outcome = Outcome.BAD_REQUEST
    code = "request_timeout"
    type = "invalid_request_error"


class PayloadTooLarge(GatewayError):
    status = 413
    outcome = Outcome.BAD_REQUEST
    code = "request_too_large"
    type = "invalid_request_error"


class PolicyRejected(BadRequest):
    """A reload that was refused; the running policy stays."""

    code = "policy_rejected"


class BatchesNotConfigured(BadRequest):
    """404, as for a route the gateway does not serve, with a code of its own:
    the Batch API routes of a gateway without `batch.data_dir`."""

    status = 404
    code = "batches_not_configured"

    def __init__(self) -> None:
        super().__init__(
            "Batches are not configured on this gateway: its policy sets no batch.data_dir."
        )


class BatchObjectNotFound(BadRequest):
    """404: no such file or batch of the tenant's (another tenant's is none of its)."""

    status = 404
    code = "not_found"


class InvalidBatchFile(BadRequest):
    """400: a batch input file that cannot run as given; the message names the line."""

    code = "invalid_file"


class FileInUse(BadRequest):
    """409: the file is the input of a batch still running."""

    status = 409
    code = "file_in_use"


class BatchNotCancellable(BadRequest):
    """409: the batch has already ended (or is ending) and cannot be cancelled."""

    status = 409
    code = "batch_not_cancellable"
