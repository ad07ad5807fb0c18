"""Who is asking: bearer key or trusted front-gateway header -> tenant -> tier.

Keys live in the policy only as SHA-256 digests (or come from the environment
at start-up and are digested at once), so the plain key exists in this
process only for the length of one request. A presented key is digested,
looked up, and the match confirmed with a constant-time compare.
"""

from __future__ import annotations

import hashlib
import hmac
import logging
import os
import re
from collections.abc import Mapping
from typing import NamedTuple

from qosgate.config.models import PolicyConfig
from qosgate.config.secrets import read_secret
from qosgate.runtime.errors import BadRequest, Unauthorized

log = logging.getLogger("qosgate.http.identity")

TENANT_HEADER = "X-Tenant-Id"
SECRET_HEADER = "X-Gateway-Secret"
ANONYMOUS = "anonymous"

# The same shape as TenantConfig.id: the tenant id becomes a metrics label and
# a quota key, so a front gateway must not be able to inject arbitrary text.
_TENANT_ID = re.compile(r"^[A-Za-z0-9][A-Za-z0-9_.\-]{0,63}$")


class KeyRingError(ValueError):
    """The keys the policy and the environment give cannot be used together."""


class Identity(NamedTuple):
    tenant: str
    tier: str


def _digest(secret: str) -> str:
    # Header values arrive latin-1 decoded; any str encodes to UTF-8, and the
    # digest is what gets compared, so non-ASCII input cannot upset compare_digest.
    return hashlib.sha256(secret.encode("utf-8", "surrogateescape")).hexdigest()


class KeyRing:
    """Maps key digests to tenants, and checks the trusted header's secret."""

    def __init__(
        self,
        keys: Mapping[str, str],
        tiers: Mapping[str, str],
        *,
        default_tier: str | None,
        header_secret_digest: str | None,
    ) -> None:
        self._keys = dict(keys)  # sha256 hex -> tenant id
        # The digest as configured, to confirm a lookup hit against.
        self._stored = {digest: digest for digest in self._keys}
        self._tiers = dict(tiers)  # tenant id -> tier
        self._default_tier = default_tier
        self._secret_digest = header_secret_digest

    @classmethod
    def from_policy(cls, policy: PolicyConfig, environ: Mapping[str, str] = os.environ) -> KeyRing:
        keys: dict[str, str] = {}
        for tenant in policy.tenants:
            for ref in tenant.api_keys:
                if ref.startswith("sha256:"):
                    keys[ref.removeprefix("sha256:")] = tenant.id
                    continue
                variable = ref.removeprefix("env:")
                value = read_secret(variable, environ)
                if not value:
                    # The key just does not exist; the tenant's other keys still work.
                    log.warning("api key variable %s of tenant %s is unset", variable, tenant.id)
                    continue
                digest = _digest(value)
                owner = keys.get(digest)
                if owner is not None and owner != tenant.id:
                    # The config validator cannot see environment values; refuse
                    # rather than let one key silently name two tenants.
                    raise KeyRingError(
                        f"the key in {variable} (tenant {tenant.id}) "
                        f"already belongs to tenant {owner}"
                    )
                keys[digest] = tenant.id

        secret_digest = None
        secret_env = policy.server.trusted_header_secret_env
        if secret_env:
            secret = read_secret(secret_env, environ)
            if secret:
                secret_digest = _digest(secret)
            else:
                log.warning("trusted header disabled: variable %s is unset", secret_env)
        return cls(
            keys,
            {tenant.id: tenant.tier for tenant in policy.tenants},
            default_tier=policy.default_tier,
            header_secret_digest=secret_digest,
        )

    def signed(self, headers: Mapping[str, str]) -> bool:
        """Whether the request carries the front gateway's secret."""
        presented = headers.get(SECRET_HEADER)
        return (
            self._secret_digest is not None
            and presented is not None
            and hmac.compare_digest(_digest(presented).encode(), self._secret_digest.encode())
        )

    def identify(self, headers: Mapping[str, str]) -> Identity:
        """Raises Unauthorized (401) for bad credentials, BadRequest for a
        malformed tenant id from an authenticated front gateway."""
        if headers.get(TENANT_HEADER) is not None:
            return self._from_header(headers)
        authorization = headers.get("Authorization")
        if authorization is None:
            return self._unknown(ANONYMOUS, "Missing API key: send 'Authorization: Bearer <key>'.")
        scheme, _, key = authorization.strip().partition(" ")
        key = key.strip()
        if scheme.lower() != "bearer" or not key:
            raise Unauthorized("Malformed Authorization header: expected 'Bearer <key>'.")
        digest = _digest(key)
        tenant = self._keys.get(digest)
        # The lookup is by digest, so its timing says nothing usable about the
        # key; the compare then confirms the hit without a data-dependent exit.
        if tenant is None or not hmac.compare_digest(
            digest.encode(), self._stored[digest].encode()
        ):
            # A wrong key is refused even with a default tier: a typo should fail
            # loudly, not quietly run as anonymous in a lower tier.
            raise Unauthorized("Incorrect API key provided.")
        return Identity(tenant, self._tiers[tenant])

    def _from_header(self, headers: Mapping[str, str]) -> Identity:
        # Without a configured secret nothing can vouch for the header; a
        # client sending it is trying to pick its own tenant.
        if not self.signed(headers):
            raise Unauthorized(f"{TENANT_HEADER} is only accepted from the trusted front gateway.")
        tenant = headers[TENANT_HEADER].strip()
        if not _TENANT_ID.match(tenant):
            raise BadRequest(
                f"Invalid {TENANT_HEADER}: 1-64 letters, digits, '_', '.', '-'.",
                param=TENANT_HEADER,
            )
        tier = self._tiers.get(tenant)
        if tier is not None:
            return Identity(tenant, tier)
        return self._unknown(tenant, f"Unknown tenant {tenant!r}.")

    def _unknown(self, tenant: str, message: str) -> Identity:
        if self._default_tier is None:
            raise Unauthorized(message)
        return Identity(tenant, self._default_tier)


class AuthFailureLimiter:
    """How many failed authentications each client address has left.

    Each address has a bucket of `per_minute` failures that refills at
    `per_minute` a minute; an address whose bucket is empty is refused before
    its credentials are looked at, so keys cannot be guessed at line rate.
    Sans-I/O: the caller passes `now` (the event loop's clock).

    At most `max_addresses` are remembered, least recently failed forgotten
    first: a flood from many addresses costs bounded memory, and an address
    forgotten only gets its full allowance back.
    """

    def __init__(self, per_minute: int, *, max_addresses: int = 10_000) -> None:
        self._capacity = float(per_minute)
        self._rate = per_minute / 60.0
        self._max = max_addresses
        # address -> (failures left, as of time); dicts keep insertion order,
        # re-inserted on every failure, so the first key is the stalest.
        self._left: dict[str, tuple[float, float]] = {}

    @property
    def enabled(self) -> bool:
        return self._capacity > 0

    def _level(self, address: str, now: float) -> float:
        entry = self._left.get(address)
        if entry is None:
            return self._capacity
        left, at = entry
        return min(self._capacity, left + (now - at) * self._rate)

    def retry_after(self, address: str, now: float) -> float | None:
        """Seconds until `address` may try again, or None if it may now."""
        if not self.enabled:
            return None
        level = self._level(address, now)
        if level >= 1.0:
            return None
        return (1.0 - level) / self._rate

    def failed(self, address: str, now: float) -> None:
        if not self.enabled:
            return
        level = max(0.0, self._level(address, now) - 1.0)
        self._left.pop(address, None)
        self._left[address] = (level, now)
        if len(self._left) > self._max:
            del self._left[next(iter(self._left))]
