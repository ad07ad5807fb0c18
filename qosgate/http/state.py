"""What every handler shares: the app's state, the request keys, and
authentication (which counts failures per client address).
"""

from __future__ import annotations

import dataclasses
import re
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, TypeVar

from aiohttp import web

from qosgate.config.models import PolicyConfig
from qosgate.runtime.errors import AuthThrottled, Unauthorized
from qosgate.runtime.gate import Gateway
from qosgate.wiring import LivePolicy

from .identity import AuthFailureLimiter, Identity, KeyRing

if TYPE_CHECKING:
    from qosgate.batch.runner import BatchService

_T = TypeVar("_T")


REQUEST_ID = web.RequestKey("qosgate.request_id", str)
RATELIMIT = web.RequestKey("qosgate.ratelimit", dict)
"""The x-ratelimit headers of the request's tenant, once its quota was checked."""
ADMITTED = web.RequestKey("qosgate.admitted", bool)
"""Set once the request is handed to the runtime (`Gateway.admit`), which from
then on counts its outcome, refused or not."""
TIER = web.RequestKey("qosgate.tier", str)
TENANT = web.RequestKey("qosgate.tenant", str)
"""The tenant and tier, once the request's identity is known."""
MODEL = web.RequestKey("qosgate.model", object)
"""The `model` of the request's body as its client wrote it, once the body is
read (the metrics count a refusal under it, bounded to the served names)."""
OUTCOME = web.RequestKey("qosgate.outcome", str)
"""The outcome of a request refused with an error status (the admitted
request's own is on its record)."""
RECORD = web.RequestKey("qosgate.record", object)
"""The admitted request's record (`core.request.Request`)."""
TRACE_HEADERS = web.RequestKey("qosgate.trace_headers", dict)
"""The request's trace context as W3C headers, when it is traced."""
CLIENT_REQUEST_ID = web.RequestKey("qosgate.client_request_id", str)
"""The client's own X-Request-Id, when it is a valid one: echoed back."""
BAD_FORWARDING = web.RequestKey("qosgate.bad_forwarding", str)
"""Set when a trusted proxy's X-Forwarded-For cannot be read: why (the
request is then refused inside the error middleware, so that it is rendered
and audited like any other refusal)."""
VIA_PROXY = web.RequestKey("qosgate.via_proxy", bool)
"""True when the connection is a trusted proxy's and no client address could
be found beyond it: `request.remote` is then the proxy itself."""
REQUEST_ID_HEADER = "x-request-id"


_CLIENT_REQUEST_ID = re.compile(r"[\x21-\x7e]{1,128}")
"""A client's X-Request-Id kept and echoed: 1-128 visible ASCII characters
(UUIDs, ULIDs, a proxy's ids). Anything else is replaced by the gateway's
own, so no log line or header carries control characters or a long string."""


def valid_client_request_id(value: str | None) -> str | None:
    if value is None or not _CLIENT_REQUEST_ID.fullmatch(value):
        return None
    return value


def echoed_request_id(request: web.Request) -> str:
    """The x-request-id of the answer: the client's own, or the gateway's."""
    return request.get(CLIENT_REQUEST_ID) or request[REQUEST_ID]


@dataclass
class AppState:
    gateway: Gateway
    live: LivePolicy
    """The policy and keys served, swapped by a reload."""
    started: int
    """Unix time the app was built (the `created` of /v1/models)."""
    admin_token: str | None = None
    """Bearer token of the /admin endpoints (None: they are disabled)."""
    metrics_token: str | None = None
    """Bearer token /metrics requires (None: it is open)."""
    auth_failures: AuthFailureLimiter = dataclasses.field(
        default_factory=lambda: AuthFailureLimiter(0)
    )
    """Failed authentications per client address (API keys and admin token)."""
    batches: BatchService | None = None
    """The Batch API's service (None: `batch.data_dir` is unset)."""

    @property
    def policy(self) -> PolicyConfig:
        return self.live.policy

    @property
    def keyring(self) -> KeyRing:
        return self.live.keyring


STATE = web.AppKey("qosgate.state", AppState)


def authenticated(request: web.Request, check: Callable[[], _T], state: AppState) -> _T:
    """Runs `check` (which raises Unauthorized on bad credentials) unless the
    client's address has failed too often already; counts its failures.

    The address is the client's as read through the trusted proxies. Two
    kinds of request are neither counted nor held back: those signed with
    the front gateway's secret (its tenants share its address, and it has
    proved who it is), and those a trusted proxy sends naming no client
    (counting them would count every client behind it as one)."""
    if request.get(VIA_PROXY) or state.keyring.signed(request.headers):
        return check()
    limiter = state.auth_failures
    address = request.remote or "unknown"
    # Any steady clock will do, as long as the limiter only ever sees this
    # one; asking the loop for its time costs a system call (getpid) on 3.11.
    now = time.monotonic()
    wait = limiter.retry_after(address, now)
    if wait is not None:
        raise AuthThrottled(
            "Too many failed authentications from this address; try again later.",
            retry_after_s=wait,
        )
    try:
        return check()
    except Unauthorized:
        limiter.failed(address, now)
        raise


def identify(request: web.Request, state: AppState) -> Identity:
    keyring = state.keyring
    identity = authenticated(request, lambda: keyring.identify(request.headers), state)
    request[TENANT] = identity.tenant
    request[TIER] = identity.tier
    return identity
