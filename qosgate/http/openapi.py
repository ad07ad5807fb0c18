"""The OpenAPI 3.1 description of the HTTP surface, served at GET /openapi.json.

Its schemas are generated: request bodies from the request models
(validation.request_schema, narrowed to what the backend honours), answers
from the response models (responses.py), error codes from the error classes.
What is written here is what no model holds: the paths, their statuses and
words, and the security schemes. The schemathesis test
(tests/test_schemathesis.py) holds the document and the gateway together by
sending what it allows and what it forbids to a live gateway and checking
every answer against it.
"""

from __future__ import annotations

import copy
import functools
from collections.abc import Iterator, Sequence
from typing import Any

from pydantic.json_schema import GenerateJsonSchema, models_json_schema

from qosgate.backends.support import LOGPROBS, PASSTHROUGH, RequestSupport
from qosgate.runtime.errors import GatewayError

from .responses import ANSWERS, CHOICES_WITH_LOGPROBS
from .validation import METADATA_SCHEMA, NOT_ONLY_SPACE, Endpoint, request_schema

OPENAPI_VERSION = "3.1.0"

_JSON = "application/json"
_SCHEMAS = "#/components/schemas/{model}"
_AUTH_THROTTLED = (
    "The client's address failed authentication more than "
    "`server.auth_failures_per_minute` times a minute (`too_many_authentication_failures`): "
    "refused before its credentials are looked at."
)

CODES_OUTSIDE_CLASSES: dict[int, tuple[str, ...]] = {503: ("not_ready",)}
"""Codes the HTTP layer writes without an error class: /readyz's."""
STREAM_ONLY_CODES = ("client_too_slow",)
"""Codes that only ever end a stream (an error event after a 200): a client
that read slower than its tier's delivery floor."""


def _error_classes(cls: type[GatewayError] = GatewayError) -> Iterator[type[GatewayError]]:
    yield cls
    for sub in cls.__subclasses__():
        yield from _error_classes(sub)


def error_codes() -> dict[int, list[str]]:
    """Each status's `error.code`s, from the error classes (each maps to one
    status) and the few codes written without one."""
    by_status: dict[int, set[str]] = {}
    for cls in _error_classes():
        by_status.setdefault(cls.status, set()).add(cls.code)
    for status, codes in CODES_OUTSIDE_CLASSES.items():
        by_status.setdefault(status, set()).update(codes)
    return {status: sorted(codes) for status, codes in sorted(by_status.items())}


def _ref(kind: str, name: str) -> dict[str, str]:
    return {"$ref": f"#/components/{kind}/{name}"}


def _json(schema: dict[str, Any]) -> dict[str, Any]:
    return {_JSON: {"schema": schema}}


def _ok(description: str, content: dict[str, Any], **headers: Any) -> dict[str, Any]:
    headers = {"x-request-id": _ref("headers", "RequestId"), **headers}
    return {"description": description, "headers": headers, "content": content}


_RETRY_AFTER = frozenset({429, 502, 503})
"""The statuses whose answers may say when to retry (a 502 does where the
backend failed before any output)."""


def _error(status: int, description: str) -> dict[str, Any]:
    headers: dict[str, Any] = {"x-request-id": _ref("headers", "RequestId")}
    if status in _RETRY_AFTER:
        headers["Retry-After"] = _ref("headers", "RetryAfter")
    content = _json(_ref("schemas", f"Error{status}"))
    return {"description": description, "headers": headers, "content": content}


def _operation(
    summary: str, security: list[dict[str, list[str]]], ok: dict[str, Any], errors: dict[int, str]
) -> dict[str, Any]:
    """An operation answering `ok` or, with each status of `errors` (and 500
    for a bug), an error whose codes the status's schema lists."""
    responses = {"200": ok, **{str(s): _error(s, text) for s, text in sorted(errors.items())}}
    responses["500"] = _ref("responses", "InternalError")
    return {"summary": summary, "security": security, "responses": responses}


class _Untitled(GenerateJsonSchema):
    """Pydantic's schemas without the titles it derives from field names."""

    def field_title_should_be_set(self, schema: Any) -> bool:
        return False


@functools.cache
def _answer_schemas() -> dict[str, Any]:
    _, top = models_json_schema(
        [(model, "validation") for model in ANSWERS],
        ref_template=_SCHEMAS,
        schema_generator=_Untitled,
    )
    return top["$defs"]


def _model_schema(models: Sequence[str]) -> dict[str, Any]:
    if models:
        # Any other name is answered 404 model_not_found.
        return {"type": "string", "enum": list(models)}
    # A backend that cannot list its models judges the name itself; the
    # gateway only refuses an empty or blank one.
    return {"type": "string", "pattern": NOT_ONLY_SPACE}


def _request(
    endpoint: Endpoint, models: Sequence[str], support: RequestSupport, max_model_len: int | None
) -> dict[str, Any]:
    schema = request_schema(endpoint, support, max_model_len)
    schema["properties"]["model"] = _model_schema(models)
    return schema


def _schemas(
    models: Sequence[str], support: RequestSupport, max_model_len: int | None
) -> dict[str, Any]:
    schemas = copy.deepcopy(_answer_schemas())
    if not (support.passthrough or LOGPROBS in support.features):
        # Only a backend that passes every field on (an OpenAI-compatible
        # upstream's, relayed) or that computes them (vLLM's) can be asked
        # for logprobs; the others refuse the field.
        for choice in CHOICES_WITH_LOGPROBS:
            schemas[choice.__name__]["properties"]["logprobs"] = {"type": "null"}
    codes = error_codes()
    for status, listed in codes.items():
        schemas[f"Error{status}"] = {
            "allOf": [
                _ref("schemas", "Error"),
                {"properties": {"error": {"properties": {"code": {"enum": listed}}}}},
            ]
        }
    every_code = sorted({code for listed in codes.values() for code in listed})
    schemas["ErrorCode"] = {
        "description": "Every `error.code` the gateway answers with.",
        "enum": sorted([*every_code, *STREAM_ONLY_CODES]),
    }
    schemas.update(_batch_request_schemas())
    schemas["ChatCompletionRequest"] = _request("chat", models, support, max_model_len)
    schemas["CompletionRequest"] = _request("completions", models, support, max_model_len)
    schemas["Event"] = {
        # Before OpenAPI 3.2's itemSchema, a text/event-stream schema
        # describes one event.
        "type": "object",
        "description": "One server-sent event of a streamed completion.",
        "required": ["data"],
        "properties": {
            "data": {
                "type": "string",
                "description": (
                    "A chunk, the last one with `usage`; then `[DONE]`. A stream that cannot "
                    "go on ends with an error instead of `[DONE]`: a 5xx's code (the backend "
                    "failed, `shutting_down`, `quota_lease_lost`), the backend's refusal "
                    "(`invalid_request`), or `client_too_slow` (the client read slower than "
                    "its tier's delivery floor)."
                ),
                "anyOf": [
                    {"const": "[DONE]"},
                    {
                        "pattern": r"^\{.*\}$",
                        "contentMediaType": _JSON,
                        "contentSchema": {
                            "anyOf": [
                                _ref("schemas", "ChatCompletionChunk"),
                                _ref("schemas", "CompletionChunk"),
                                _ref("schemas", "Error"),
                            ]
                        },
                    },
                ],
            }
        },
    }
    return schemas


_TENANT = [{"apiKey": []}, {"tenantHeader": [], "gatewaySecret": []}]
_ADMIN = [{"adminToken": []}]
_ADMIN_ERRORS = {
    401: "No admin token, or a wrong one, as a Bearer token.",
    404: "The admin endpoints are disabled: `server.admin_token_env` is unset or its variable "
    "empty.",
    429: _AUTH_THROTTLED,
}


def _completion_operation(
    summary: str, request: str, answer: str, max_body_bytes: int
) -> dict[str, Any]:
    ratelimit = {
        f"x-ratelimit-{what}-{unit}": _ref("headers", "RateLimit")
        for what in ("limit", "remaining", "reset")
        for unit in ("tokens", "requests")
    }
    answers = {**_json(_ref("schemas", answer)), "text/event-stream": {"schema": _ref("schemas", "Event")}}  # fmt: skip
    ok = _ok(
        "The completion: one JSON body, or with `stream: true` server-sent events "
        "(`data: {chunk}` lines ending with `data: [DONE]`; a failure after the first "
        "event ends the stream with an error event).",
        answers,
        **ratelimit,
    )
    operation = _operation(summary, _TENANT, ok, {
        400: "Malformed JSON, a wrong type or out-of-range value (`param` names the field), "
        "a malformed X-Tenant-Id, or a prompt that can never fit the backend.",
        401: "Unknown or missing key, or a tenant header without the secret.",
        404: "The model is not served (`model_not_found`).",
        408: "The body did not arrive within `server.body_timeout_s`.",
        413: f"The body is over {max_body_bytes} bytes.",
        415: "The body was declared as something other than JSON.",
        429: "Over the tenant's quota (`rate_limit_exceeded`; no Retry-After when the request "
        "alone is larger than the quota), the tier's queue is full (`queue_full`), or too many "
        "failed authentications (below).\n\n" + _AUTH_THROTTLED,
        502: "The backend failed the request.",
        503: "Overloaded, backend unavailable, the gateway stopping, or the quota store down "
        "with fail_closed (a running request's lease lost, before its first token).",
        504: "Still queued at the tier's deadline.",
    })  # fmt: skip
    session = {
        "name": "X-Session-Id",
        "in": "header",
        "required": False,
        "description": "Groups a conversation's requests (first 256 characters kept).",
        "schema": {"type": "string"},
    }
    body = {
        "required": True,
        "description": f"At most {max_body_bytes} bytes. A missing Content-Type is read as "
        "JSON; a declared non-JSON one is answered 415.",
        "content": _json(_ref("schemas", request)),
    }
    return {**operation, "parameters": [session], "requestBody": body}


_BATCH_ERRORS = {
    400: "A malformed X-Tenant-Id, or a bad parameter or body (`param` names it).",
    401: "Unknown or missing key, or a tenant header without the secret.",
    404: "No such file or batch of the tenant's (`not_found`; another tenant's is none of "
    "its), or the gateway has no `batch.data_dir` (`batches_not_configured`).",
    429: _AUTH_THROTTLED,
    503: "The batch jobs' Redis (`batch.store: redis`) does not answer "
    "(`batch_store_unavailable`); Retry-After.",
}


def _batch_operation(
    summary: str, answer: str | None, errors: dict[int, str] | None = None, **extra: Any
) -> dict[str, Any]:
    if answer is None:
        ok = _ok(summary, {"application/octet-stream": {"schema": {"type": "string"}}})
    else:
        ok = _ok(summary, _json(_ref("schemas", answer)))
    return {**_operation(summary, _TENANT, ok, {**_BATCH_ERRORS, **(errors or {})}), **extra}


def _parameter(name: str, where: str, schema: dict[str, Any], text: str) -> dict[str, Any]:
    return {"name": name, "in": where, "required": where == "path", "description": text,
            "schema": schema}  # fmt: skip


def _page_parameters(most: int) -> list[dict[str, Any]]:
    return [
        _parameter("after", "query", {"type": "string"}, "The id the page starts after."),
        _parameter("limit", "query", {"type": "integer", "minimum": 1, "maximum": most},
                   "How many at most."),  # fmt: skip
    ]


def _batch_paths(max_body_bytes: int) -> dict[str, Any]:
    """OpenAI's Files and Batches routes (docs/BATCH.md)."""
    file_id = [_parameter("file_id", "path", {"type": "string"}, "The file's id.")]
    batch_id = [_parameter("batch_id", "path", {"type": "string"}, "The batch's id.")]
    upload = {
        "required": True,
        "content": {"multipart/form-data": {"schema": _ref("schemas", "FileUpload")}},
    }
    create = {
        "required": True,
        "description": f"At most {max_body_bytes} bytes.",
        "content": _json(_ref("schemas", "BatchCreateRequest")),
    }
    json_body = {
        408: "The body did not arrive within `server.body_timeout_s`.",
        413: f"The body is over {max_body_bytes} bytes.",
        415: "The body was declared as something other than JSON.",
        503: "The gateway is stopping (`shutting_down`).",
    }
    return {
        "/v1/files": {
            "post": _batch_operation(
                "Upload a batch input file (JSONL, checked line by line)", "FileObject",
                {413: "The file is over `batch.max_file_bytes`."}, requestBody=upload,
            ),
            "get": _batch_operation(
                "The tenant's files, newest first", "FileList", parameters=[
                    *_page_parameters(10_000),
                    _parameter("order", "query", {"enum": ["asc", "desc"]}, "By creation."),
                    _parameter("purpose", "query", {"type": "string"}, "Only these."),
                ],
            ),
        },  # fmt: skip
        "/v1/files/{file_id}": {
            "get": _batch_operation("A file", "FileObject", parameters=file_id),
            "delete": _batch_operation(
                "Delete a file", "FileDeleted",
                {409: "The file is the input of a batch not yet ended (`file_in_use`)."},
                parameters=file_id,
            ),  # fmt: skip
        },
        "/v1/files/{file_id}/content": {
            "get": _batch_operation("A file's content", None, parameters=file_id),
        },
        "/v1/batches": {
            "post": _batch_operation(
                "Create a batch from an uploaded file", "Batch", json_body, requestBody=create
            ),
            "get": _batch_operation(
                "The tenant's batches, newest first", "BatchList",
                parameters=_page_parameters(100),
            ),  # fmt: skip
        },
        "/v1/batches/{batch_id}": {
            "get": _batch_operation("A batch", "Batch", parameters=batch_id),
        },
        "/v1/batches/{batch_id}/cancel": {
            "post": _batch_operation(
                "Cancel a batch: what has not run is written to its error file", "Batch",
                {409: "The batch has ended already (`batch_not_cancellable`)."},
                parameters=batch_id,
            ),  # fmt: skip
        },
    }


def _batch_request_schemas() -> dict[str, Any]:
    return {
        "FileUpload": {
            "type": "object",
            "required": ["purpose", "file"],
            "properties": {
                "purpose": {"enum": ["batch"]},
                "file": {"type": "string", "format": "binary",
                         "description": "JSONL: one request a line (docs/BATCH.md)."},
            },
        },  # fmt: skip
        "BatchCreateRequest": {
            "type": "object",
            "additionalProperties": False,
            "required": ["input_file_id", "endpoint", "completion_window"],
            "properties": {
                "input_file_id": {"type": "string"},
                "endpoint": {"enum": ["/v1/chat/completions", "/v1/completions"]},
                "completion_window": {
                    "type": "string", "pattern": "^[1-9][0-9]{0,6}[smhd]$",
                    "description": "The deadline, e.g. `24h`; at most 7 days.",
                },
                "metadata": {**METADATA_SCHEMA, "type": ["object", "null"]},
            },
        },  # fmt: skip
    }


def _admin_operation(
    summary: str, answer: str, errors: dict[int, str] | None = None
) -> dict[str, Any]:
    ok = _ok(summary, _json(_ref("schemas", answer)))
    return _operation(summary, _ADMIN, ok, {**_ADMIN_ERRORS, **(errors or {})})


def _open_get(
    summary: str, ok: dict[str, Any], errors: dict[int, str] | None = None
) -> dict[str, Any]:
    return {"get": _operation(summary, [], ok, errors or {})}


def _text(description: str, media_type: str) -> dict[str, Any]:
    return _ok(description, {media_type: {"schema": {"type": "string"}}})


_SECURITY_SCHEMES = {
    "apiKey": {"type": "http", "scheme": "bearer", "description": "A tenant's API key."},
    "tenantHeader": {
        "type": "apiKey",
        "in": "header",
        "name": "X-Tenant-Id",
        "description": "The tenant, from a front gateway that authenticated it.",
    },
    "gatewaySecret": {
        "type": "apiKey",
        "in": "header",
        "name": "X-Gateway-Secret",
        "description": "The front gateway's shared secret; required with X-Tenant-Id.",
    },
    "adminToken": {
        "type": "http",
        "scheme": "bearer",
        "description": "The token in the variable `server.admin_token_env` names.",
    },
}
_HEADERS = {
    "RequestId": {
        "required": True,
        "description": "The request's id, as logged.",
        "schema": {"type": "string"},
    },
    "RetryAfter": {
        "description": "Whole seconds after which a retry may succeed (at least 1).",
        "schema": {"type": "integer", "minimum": 1},
    },
    "RateLimit": {
        "description": "OpenAI's rate-limit headers, for a tenant with quotas.",
        "schema": {"type": "string"},
    },
}


def build_openapi(
    models: Sequence[str] = (),
    *,
    max_body_bytes: int,
    support: RequestSupport = PASSTHROUGH,
    max_model_len: int | None = None,
) -> dict[str, Any]:
    """The document for a gateway whose backend serves `models` (empty: the
    backend cannot list them), honours `support` of a request, has a context
    of `max_model_len` tokens (None: unknown) and which reads bodies up to
    `max_body_bytes`."""
    status = _json(_ref("schemas", "Status"))
    return {
        "openapi": OPENAPI_VERSION,
        "info": {
            "title": "qosgate",
            "version": "1",
            "description": (
                "An OpenAI-compatible QoS gateway for LLM inference. Every error has OpenAI's "
                'shape: {"error": {"message", "type", "code", "param"}}; each status\'s '
                "schema lists its codes (`ErrorCode` lists them all). A method a path does "
                "not list is answered 405 with Allow, an unknown path 404."
            ),
        },
        "paths": {
            "/v1/chat/completions": {
                "post": _completion_operation(
                    "Chat completion", "ChatCompletionRequest", "ChatCompletion", max_body_bytes
                )
            },
            "/v1/completions": {
                "post": _completion_operation(
                    "Text completion", "CompletionRequest", "Completion", max_body_bytes
                )
            },
            "/v1/models": {
                "get": _operation(
                    "The models the backend serves",
                    _TENANT,
                    _ok("The models.", _json(_ref("schemas", "ModelList"))),
                    {400: "A malformed X-Tenant-Id.", 401: "Unknown or missing key.",
                     429: _AUTH_THROTTLED},
                )  # fmt: skip
            },
            "/healthz": _open_get("Liveness", _ok("The process is alive.", status)),
            "/readyz": _open_get("Readiness", _ok("The backend is ready.", status), {
                503: "The backend is not ready (`not_ready`) or the gateway is stopping "
                "(`shutting_down`).",
            }),  # fmt: skip
            "/metrics": _open_get("Prometheus metrics", _text("The exposition format.", "text/plain")),  # fmt: skip
            "/dashboard": _open_get(
                "The live dashboard page; it reads /admin/stats with the admin token",
                _text("The page.", "text/html"),
            ),
            "/openapi.json": _open_get(
                "This document", _ok("The OpenAPI document.", _json({"type": "object"}))
            ),
            **_batch_paths(max_body_bytes),
            "/admin/stats": {
                "get": _admin_operation("Queues, backend, outcomes, SLOs and quotas", "Stats")
            },
            "/admin/quotas": {"get": _admin_operation("Each tenant's quota use", "Quotas")},
            "/admin/reload": {
                "post": _admin_operation("Re-read the policy file (as SIGHUP does)", "Reloaded", {
                    400: "The new policy was refused (`policy_rejected`) with every problem; "
                    "the running policy stays.",
                })  # fmt: skip
            },
        },
        "components": {
            "securitySchemes": _SECURITY_SCHEMES,
            "headers": _HEADERS,
            "responses": {"InternalError": _error(500, "A bug in the gateway (`internal_error`).")},
            "schemas": _schemas(models, support, max_model_len),
        },
    }
