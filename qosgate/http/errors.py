"""OpenAI's error shape, and the errors only the HTTP layer raises."""

from __future__ import annotations

from typing import Any

from aiohttp import web

from qosgate.runtime.errors import BadRequest, GatewayError


class ModelNotFound(BadRequest):
    """404, as OpenAI answers for a model it does not serve."""

    status = 404
    code = "model_not_found"

    def __init__(self, model: str) -> None:
        # The name goes back through JSON, so a hostile one cannot break the body.
        super().__init__(
            f"The model `{model[:200]}` does not exist or you do not have access to it.",
            param="model",
        )


class UnsupportedMediaType(BadRequest):
    """415: the body was declared as something other than JSON."""

    status = 415
    code = "unsupported_media_type"

    def __init__(self, content_type: str) -> None:
        super().__init__(
            f"Unsupported Content-Type {content_type!r}: send the body as application/json."
        )


class MalformedRequest(BadRequest):
    """400: the bytes are not a well-formed HTTP request (request line, header
    syntax, body framing or encoding)."""

    code = "malformed_request"


class UriTooLong(BadRequest):
    """414: the request line is over its limit (RFC 9110, 15.5.15)."""

    status = 414
    code = "uri_too_long"


class HeaderFieldsTooLarge(BadRequest):
    """431: a header field is over its limit, or there are too many of them
    (RFC 6585, 5)."""

    status = 431
    code = "request_header_fields_too_large"


class RouteNotFound(BadRequest):
    status = 404
    code = "not_found"


class MethodNotAllowed(BadRequest):
    status = 405
    code = "method_not_allowed"


def error_payload(message: str, type_: str, code: str | None, param: str | None) -> dict[str, Any]:
    return {"error": {"message": message, "type": type_, "code": code, "param": param}}


INTERNAL_ERROR = error_payload(
    "The server had an error processing your request.", "server_error", "internal_error", None
)
"""A bug's answer, as a status or a stream's last event: it names nothing of
the bug (its message could quote a prompt)."""


def error_response(exc: GatewayError, headers: dict[str, str] | None = None) -> web.Response:
    headers = dict(headers or {})
    retry_after = exc.retry_after_header
    if retry_after is not None:
        headers["Retry-After"] = retry_after
    return web.json_response(exc.body(), status=exc.status, headers=headers)
