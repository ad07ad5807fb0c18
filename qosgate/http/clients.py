"""The client's address, as seen through the trusted proxies in front.

aiohttp-remotes' `XForwardedFiltered` does the reading: from the right of
X-Forwarded-For it skips trusted addresses and takes the first untrusted one,
and the request handed on carries it as `request.remote`. It is applied only
to connections from a trusted proxy: anyone else could name any address in
the header and so pick the address the failed-authentication limit counts.
"""

from __future__ import annotations

import ipaddress
from collections.abc import Awaitable, Callable, Sequence

from aiohttp import web
from aiohttp_remotes import XForwardedFiltered
from aiohttp_remotes.exceptions import RemoteError

from .state import BAD_FORWARDING, VIA_PROXY

Handler = Callable[[web.Request], Awaitable[web.StreamResponse]]


class _Filtered(XForwardedFiltered):
    async def raise_error(self, request: web.Request) -> None:  # type: ignore[override]
        raise _Unreadable("more than one X-Forwarded-For header")


class _Unreadable(Exception):
    pass


class TrustedProxies:
    """The `server.trusted_proxies` networks, and the middleware that reads
    client addresses through them. Empty: every connection is its own client."""

    def __init__(self, networks: Sequence[str]) -> None:
        self._networks = tuple(ipaddress.ip_network(n, strict=False) for n in networks)
        self._filtered = _Filtered(set(networks)) if networks else None

    def trusts(self, address: str | None) -> bool:
        if not self._networks or address is None:
            return False
        try:
            ip = ipaddress.ip_address(address.partition("%")[0])
        except ValueError:
            return False
        return any(ip in network for network in self._networks)

    @web.middleware
    async def middleware(self, request: web.Request, handler: Handler) -> web.StreamResponse:
        if self._filtered is None or not self.trusts(request.remote):
            return await handler(request)
        seen: list[web.Request] = []

        async def reached(forwarded: web.Request) -> web.StreamResponse:
            seen.append(forwarded)
            if self.trusts(forwarded.remote):
                forwarded[VIA_PROXY] = True
            return await handler(forwarded)

        try:
            return await self._filtered.middleware(request, reached)
        except (_Unreadable, RemoteError, web.HTTPBadRequest) as exc:
            if seen:
                # Raised by the handler, not by the header's reading.
                raise
            reason = str(exc) if isinstance(exc, _Unreadable) else "not a list of IP addresses"
            request[BAD_FORWARDING] = reason
            request[VIA_PROXY] = True
            return await handler(request)
