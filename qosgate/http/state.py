"""What every handler shares: the app's state, the request keys, and
authentication (which counts failures per client address).
"""

from __future__ import annotations

import dataclasses
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, TypeVar

from aiohttp import web

from qosgate.config.models import PolicyConfig
from qosgate.runtime.errors import AuthThrottled, Unauthorized
from qosgate.runtime.gate import Gateway
from qosgate.wiring import LivePolicy

from .identity import AuthFailureLimiter, Identity, KeyRing

if TYPE_CHECKING:
    from qosgate.batch.runner import BatchService

_T = TypeVar("_T")


def _key(name: str, kind: type) -> Any:
    # Typed request keys are recent in aiohttp; a plain string works everywhere.
    return web.RequestKey(name, kind) if hasattr(web, "RequestKey") else name


REQUEST_ID = _key("qosgate.request_id", str)
RATELIMIT = _key("qosgate.ratelimit", dict)
"""The x-ratelimit headers of the request's tenant, once its quota was checked."""
ADMITTED = _key("qosgate.admitted", bool)
"""Set once the request is handed to the runtime (`Gateway.admit`), which from
then on counts its outcome, refused or not."""
TIER = _key("qosgate.tier", str)
REQUEST_ID_HEADER = "x-request-id"


@dataclass
class AppState:
    gateway: Gateway
    live: LivePolicy
    """The policy and keys served, swapped by a reload."""
    started: int
    """Unix time the app was built (the `created` of /v1/models)."""
    admin_token: str | None = None
    """Bearer token of the /admin endpoints (None: they are disabled)."""
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
    client's address has failed too often already; counts its failures."""
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
    return authenticated(request, lambda: keyring.identify(request.headers), state)
