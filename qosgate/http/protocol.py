"""What aiohttp answers before the app sees a request, in OpenAI's shape.

A request aiohttp cannot parse (an oversized or malformed request line or
header, too many headers, broken body framing) never reaches the app's
middleware: aiohttp's connection answers it itself, in plain text, and logs
it at error level with a traceback, as if the server had failed. aiohttp has
no hook for that answer (aio-libs/aiohttp#3287) other than its connection's
`handle_error`, so the gateway runs its own connection class: the client gets
the JSON error an OpenAI client can read, the log one warning line.

The limits on a request's head (its request line and headers) are set here
too; docs/HTTP.md lists them.
"""

from __future__ import annotations

import logging
import os
import re

from aiohttp import web
from aiohttp.http_exceptions import HttpProcessingError, LineTooLong

from qosgate.observability import request_refused
from qosgate.runtime.errors import BadRequest, GatewayError

from .errors import HeaderFieldsTooLarge, MalformedRequest, UriTooLong, error_response

log = logging.getLogger("qosgate.http")

MAX_REQUEST_LINE = 4096
"""Bytes in the request line (414 beyond). The API's paths are short and take
no query; aiohttp's default (8190) is twice what any of them needs."""
MAX_HEADER_FIELD = 8190
"""Bytes in one header field, name and value (431 beyond): aiohttp's default,
and about what proxies in front of the gateway allow (nginx: 8 KiB)."""
MAX_HEADERS = 128
"""Header fields in a request (431 beyond): aiohttp's default; OpenAI's SDKs
send about fifteen, proxies add a few."""

HEAD_LIMITS = {
    "max_line_size": MAX_REQUEST_LINE,
    "max_field_size": MAX_HEADER_FIELD,
    "max_headers": MAX_HEADERS,
}
"""The runner's keyword arguments that set them."""

_QUOTED_BYTES = re.compile(r"""(?:bytearray\()?b['"].*""")


def describe_parse_error(exc: BaseException) -> str:
    """aiohttp's description of what it could not parse, without the bytes it
    quotes: they can hold a key or a prompt, and the description is logged."""
    cause = exc if isinstance(exc, HttpProcessingError) else exc.__cause__
    if not isinstance(cause, HttpProcessingError):
        return "the request could not be parsed"
    parts = []
    for line in cause.message.splitlines():
        line = _QUOTED_BYTES.sub("", line).strip().rstrip(":").strip()
        if line and line != "^":  # llhttp's pointer under the quoted bytes
            parts.append(line)
    return ": ".join(parts)[:200] or "the request could not be parsed"


def _client_error(exc: BaseException | None, connection: web.RequestHandler) -> BadRequest:
    if isinstance(exc, LineTooLong):
        # aiohttp says which limit a line broke, not which line it was; the two
        # limits differ, so the one broken tells the request line from a header.
        limit = exc.args[1] if len(exc.args) > 1 else None
        if limit == connection.max_line_size != connection.max_field_size:
            return UriTooLong(f"The request line is longer than {limit} bytes.")
        return HeaderFieldsTooLarge(
            f"A header field is longer than {connection.max_field_size} bytes."
        )
    if isinstance(exc, HttpProcessingError) and exc.message.startswith("Too many headers"):
        return HeaderFieldsTooLarge(
            f"The request has more than {connection.max_headers} header fields."
        )
    return MalformedRequest(f"Malformed HTTP request: {describe_parse_error(exc or Exception())}.")


class _Connection(web.RequestHandler):
    __slots__ = ()

    def handle_error(
        self,
        request: web.BaseRequest,
        status: int = 500,
        exc: BaseException | None = None,
        message: str | None = None,
    ) -> web.StreamResponse:
        if request.writer.output_size > 0:
            # Part of an answer is out: aiohttp logs the failure and drops the
            # connection, as nothing else can tell the client.
            return super().handle_error(request, status, exc, message)
        request_id = os.urandom(16).hex()
        error: GatewayError
        if status >= 500:
            # Not the client's doing: a bug outside the app's middleware, logged
            # with its traceback as aiohttp would.
            self.log_exception("Error handling request %s", request_id, exc_info=exc)
            error = GatewayError("The server had an error processing your request.")
        else:
            error = _client_error(exc, self)
            # The peer's address: a head that could not be parsed cannot be
            # trusted to name the client behind a proxy.
            request_refused(
                status=error.status, reason=error.code, request_id=request_id,
                client=request.remote,
            )  # fmt: skip
            log.debug("request %s: %s", request_id, error.message)
        response = error_response(error, {"x-request-id": request_id})
        # The parser lost its place in the byte stream: nothing after the
        # fault can be read as a next request.
        response.force_close()
        return response

    def log_exception(self, *args: object, **kwargs: object) -> None:
        if isinstance(kwargs.get("exc_info"), web.RequestPayloadError):
            # After the answer aiohttp reads what is left of the body; a body
            # it could not decode fails that read again, though the client has
            # had its 400 (app.py) and the connection closes anyway.
            self.log_debug("dropped the rest of a malformed body", exc_info=kwargs["exc_info"])
            return
        super().log_exception(*args, **kwargs)


class _Server(web.Server):
    def __call__(self) -> web.RequestHandler:
        return _Connection(self, loop=self._loop, **self._kwargs)


class GatewayRunner(web.AppRunner):
    """An AppRunner whose connections answer what aiohttp refuses before the
    app (a request it cannot parse) in OpenAI's error shape."""

    async def _make_server(self) -> web.Server:
        server = await super()._make_server()
        # The Server makes a connection for each client; ours differs from
        # aiohttp's in its methods only, so it can take the instance over.
        server.__class__ = _Server
        return server
