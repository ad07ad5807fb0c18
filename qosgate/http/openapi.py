"""The OpenAPI 3.1 description of the HTTP surface, served at GET /openapi.json.

It is written by hand rather than derived from the pydantic models: the
validators in validation.py are plain functions (one error per field, the way
OpenAI words them), so their rules are restated here as JSON Schema. The
schemathesis test (tests/test_schemathesis.py) holds the two together by
sending what this document allows and what it forbids to a live gateway and
checking every answer against it.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from qosgate.backends.support import LOGPROBS, MEDIA, PASSTHROUGH, RequestSupport

from .validation import NOT_ONLY_SPACE, Endpoint, nullable, request_schema

OPENAPI_VERSION = "3.1.0"

_JSON = "application/json"
_AUTH_THROTTLED = (
    "The client's address failed authentication more than "
    "`server.auth_failures_per_minute` times a minute (`too_many_authentication_failures`): "
    "refused before its credentials are looked at."
)
_REF = "#/components"


def _ref(kind: str, name: str) -> dict[str, str]:
    return {"$ref": f"{_REF}/{kind}/{name}"}


def _json(schema: dict[str, Any]) -> dict[str, Any]:
    return {_JSON: {"schema": schema}}


def _error(description: str, *, retry_after: bool = False) -> dict[str, Any]:
    headers: dict[str, Any] = {"x-request-id": _ref("headers", "RequestId")}
    if retry_after:
        headers["Retry-After"] = _ref("headers", "RetryAfter")
    return {
        "description": description,
        "headers": headers,
        "content": _json(_ref("schemas", "Error")),
    }


def _ok(description: str, content: dict[str, Any], **headers: Any) -> dict[str, Any]:
    return {
        "description": description,
        "headers": {"x-request-id": _ref("headers", "RequestId"), **headers},
        "content": content,
    }


def _model_schema(models: Sequence[str]) -> dict[str, Any]:
    if models:
        # Any other name is answered 404 model_not_found.
        return {"type": "string", "enum": list(models)}
    # A backend that cannot list its models judges the name itself; the
    # gateway only refuses an empty or blank one.
    return {"type": "string", "pattern": NOT_ONLY_SPACE}


def _request(
    endpoint: Endpoint, support: RequestSupport, max_model_len: int | None, **fields: Any
) -> dict[str, Any]:
    schema = request_schema(endpoint, support, max_model_len)
    schema["properties"].update(fields)
    schema["description"] = (
        "Fields not listed pass through to the backend unchecked."
        if support.passthrough
        else f"The {support.backend} backend takes no field beyond these."
    )
    return schema


def _parts(support: RequestSupport) -> dict[str, Any]:
    """Content parts: text and refusals everywhere; media where the backend
    takes them (else refused by name)."""
    kinds: list[dict[str, Any]] = [
        {
            "type": "object",
            "required": ["type", kind],
            "properties": {"type": {"const": kind}, kind: {"type": "string"}},
        }
        for kind in ("text", "refusal")
    ]
    kinds += [
        {
            "type": "object",
            "required": ["type", kind],
            "properties": {"type": {"const": kind}, kind: {"type": "object"}},
        }
        for kind in MEDIA
        if support.passthrough or kind in support.features
    ]
    return {"type": "array", "items": {"anyOf": kinds}}


def _schemas(
    models: Sequence[str], support: RequestSupport, max_model_len: int | None
) -> dict[str, Any]:
    parts = _parts(support)
    usage = {
        "type": "object",
        "required": ["prompt_tokens", "completion_tokens", "total_tokens"],
        "properties": {
            "prompt_tokens": {"type": "integer", "minimum": 0},
            "completion_tokens": {"type": "integer", "minimum": 0},
            "total_tokens": {"type": "integer", "minimum": 0},
        },
    }
    # Only a backend that passes every field on (an OpenAI-compatible
    # upstream's, relayed) or that computes them (vLLM's) can be asked for
    # logprobs; the others refuse the field.
    logprobs = (
        {"type": ["object", "null"]}
        if support.passthrough or LOGPROBS in support.features
        else {"type": "null"}
    )
    completion_head = {
        "id": {"type": "string"},
        "created": {"type": "integer"},
        "model": {"type": "string"},
        "usage": _ref("schemas", "Usage"),
    }
    return {
        "Error": {
            "type": "object",
            "required": ["error"],
            "additionalProperties": False,
            "properties": {
                "error": {
                    "type": "object",
                    "required": ["message", "type", "code", "param"],
                    "additionalProperties": False,
                    "properties": {
                        "message": {"type": "string", "minLength": 1},
                        "type": {"type": "string"},
                        "code": {"type": ["string", "null"]},
                        "param": {
                            "type": ["string", "null"],
                            "description": "The field at fault, e.g. `messages.0.role`.",
                        },
                    },
                }
            },
        },
        "Message": {
            # Only an assistant turn (one that carries tool calls) may come without content.
            "anyOf": [
                {
                    "type": "object",
                    "required": ["role", "content"],
                    "properties": {
                        "role": {"enum": ["system", "user", "tool", "developer"]},
                        "content": {"anyOf": [{"type": "string"}, parts]},
                    },
                },
                {
                    "type": "object",
                    "required": ["role"],
                    "properties": {
                        "role": {"const": "assistant"},
                        "content": nullable({"anyOf": [{"type": "string"}, parts]}),
                    },
                },
            ]
        },
        "ChatCompletionRequest": _request(
            "chat",
            support,
            max_model_len,
            model=_model_schema(models),
            messages={"type": "array", "minItems": 1, "items": _ref("schemas", "Message")},
        ),
        "CompletionRequest": _request(
            "completions", support, max_model_len, model=_model_schema(models)
        ),
        "Usage": usage,
        "Event": {
            # Before OpenAPI 3.2's itemSchema, a text/event-stream schema
            # describes one event.
            "type": "object",
            "description": "One server-sent event of a streamed completion.",
            "required": ["data"],
            "properties": {
                "data": {
                    "type": "string",
                    "description": (
                        "A chunk (`chat.completion.chunk` or `text_completion`), the last one "
                        "with `usage`; an error as OpenAI's error object when the backend fails "
                        "mid-stream; then `[DONE]`."
                    ),
                    "anyOf": [
                        {"const": "[DONE]"},
                        {"pattern": r"^\{.*\}$", "contentMediaType": _JSON},
                    ],
                }
            },
        },
        "ChatCompletion": {
            "type": "object",
            "required": ["id", "object", "created", "model", "choices", "usage"],
            "properties": {
                **completion_head,
                "object": {"const": "chat.completion"},
                "choices": {
                    "type": "array",
                    "minItems": 1,
                    "maxItems": 1,
                    "items": {
                        "type": "object",
                        "required": ["index", "message", "finish_reason"],
                        "properties": {
                            "index": {"const": 0},
                            "message": {
                                "type": "object",
                                "required": ["role"],
                                "properties": {
                                    "role": {"const": "assistant"},
                                    "content": {"type": ["string", "null"]},
                                },
                            },
                            "logprobs": logprobs,
                            "finish_reason": {"type": "string"},
                        },
                    },
                },
            },
        },
        "Completion": {
            "type": "object",
            "required": ["id", "object", "created", "model", "choices", "usage"],
            "properties": {
                **completion_head,
                "object": {"const": "text_completion"},
                "choices": {
                    "type": "array",
                    "minItems": 1,
                    "maxItems": 1,
                    "items": {
                        "type": "object",
                        "required": ["index", "text", "finish_reason"],
                        "properties": {
                            "index": {"const": 0},
                            "text": {"type": "string"},
                            "logprobs": logprobs,
                            "finish_reason": {"type": "string"},
                        },
                    },
                },
            },
        },
        "ModelList": {
            "type": "object",
            "required": ["object", "data"],
            "properties": {
                "object": {"const": "list"},
                "data": {
                    "type": "array",
                    "items": {
                        "type": "object",
                        "required": ["id", "object", "created", "owned_by", "root", "parent"],
                        "properties": {
                            "id": {"type": "string"},
                            "object": {"const": "model"},
                            "created": {"type": "integer"},
                            "owned_by": {"type": "string"},
                            "root": {
                                "type": "string",
                                "description": (
                                    "As vLLM lists it: the path or name the model was "
                                    "loaded from (vllm backend), else the id."
                                ),
                            },
                            "parent": {"type": "null"},
                        },
                    },
                },
            },
        },
        "Status": {
            "type": "object",
            "required": ["status"],
            "properties": {"status": {"type": "string"}},
        },
        "QuotaUse": {
            "type": "object",
            "description": "Each tenant of the policy: its tier and each of its limits.",
            "additionalProperties": {
                "type": "object",
                "required": ["tier", "limits"],
                "properties": {
                    "tier": {"type": "string"},
                    "limits": {
                        "type": "object",
                        "additionalProperties": {
                            "type": "object",
                            "required": ["limit", "used", "remaining", "reset_s"],
                            "properties": {
                                "limit": {"type": "number"},
                                "used": {"type": "number"},
                                "remaining": {"type": "number"},
                                "reset_s": {"type": "number"},
                            },
                        },
                    },
                },
            },
        },
        "Stats": {
            "type": "object",
            "required": ["time", "ready", "scheduler", "backend", "tiers", "quotas"],
            "properties": {
                "time": {"type": "number"},
                "ready": {"type": "boolean"},
                "scheduler": {"type": "object"},
                "backend": {"type": "object"},
                "tiers": {"type": "object", "additionalProperties": {"type": "object"}},
                "requests": {"type": "object"},
                "slo": {"type": "object"},
                "ttft": {"type": "object"},
                "batches": {"type": "object"},
                "quotas": _ref("schemas", "QuotaUse"),
                "fleet": {
                    "description": "Fleet mode: the shared queue as read from Redis "
                    "(null on one node, or when Redis was not read in time).",
                    "type": ["object", "null"],
                    "required": ["queued", "running"],
                    "properties": {
                        "queued": {
                            "type": "object",
                            "additionalProperties": {"type": "integer", "minimum": 0},
                        },
                        "running": {"type": "integer", "minimum": 0},
                    },
                },
            },
        },
        "Quotas": {
            "type": "object",
            "required": ["store", "tenants"],
            "properties": {
                "store": {
                    "type": "object",
                    "required": ["kind", "on_error", "reachable"],
                    "properties": {
                        "kind": {"type": "string"},
                        "on_error": {"type": "string"},
                        "reachable": {"type": "boolean"},
                    },
                },
                "tenants": _ref("schemas", "QuotaUse"),
            },
        },
        "Reloaded": {
            "type": "object",
            "required": ["status", "path", "tiers", "tenants"],
            "properties": {
                "status": {"const": "reloaded"},
                "path": {"type": "string"},
                "tiers": {"type": "array", "items": {"type": "string"}},
                "tenants": {"type": "integer", "minimum": 0},
            },
        },
    }


def _completion_operation(
    summary: str, request_schema: str, response_schema: str, max_body_bytes: int
) -> dict[str, Any]:
    ratelimit = {
        f"x-ratelimit-{what}-{unit}": _ref("headers", "RateLimit")
        for what in ("limit", "remaining", "reset")
        for unit in ("tokens", "requests")
    }
    return {
        "summary": summary,
        "security": [{"apiKey": []}, {"tenantHeader": [], "gatewaySecret": []}],
        "parameters": [
            {
                "name": "X-Session-Id",
                "in": "header",
                "required": False,
                "description": "Groups a conversation's requests (first 256 characters kept).",
                "schema": {"type": "string"},
            }
        ],
        "requestBody": {
            "required": True,
            "description": (
                f"At most {max_body_bytes} bytes. A missing Content-Type is read as JSON; "
                "a declared non-JSON one is answered 415."
            ),
            "content": _json(_ref("schemas", request_schema)),
        },
        "responses": {
            "200": _ok(
                "The completion: one JSON body, or with `stream: true` server-sent events "
                "(`data: {chunk}` lines ending with `data: [DONE]`; a backend failure after the "
                "first event ends the stream with an error event).",
                {
                    **_json(_ref("schemas", response_schema)),
                    "text/event-stream": {"schema": _ref("schemas", "Event")},
                },
                **ratelimit,
            ),
            "400": _error(
                "Malformed JSON, a wrong type or out-of-range value (`param` names the field), "
                "a malformed X-Tenant-Id, or a prompt that can never fit the backend."
            ),
            "401": _error("Unknown or missing key, or a tenant header without the secret."),
            "404": _error("The model is not served (`model_not_found`)."),
            "408": _error(
                "The body did not arrive within `server.body_timeout_s` (`request_timeout`)."
            ),
            "413": _error(f"The body is over {max_body_bytes} bytes."),
            "415": _error("The body was declared as something other than JSON."),
            "429": _error(
                "Over the tenant's quota (`rate_limit_exceeded`; no Retry-After when the "
                "request alone is larger than the quota), the tier's queue is full "
                "(`queue_full`), or too many failed authentications (below).\n\n" + _AUTH_THROTTLED,
                retry_after=True,
            ),
            "500": _ref("responses", "InternalError"),
            "502": _error("The backend failed the request (`backend_error`)."),
            "503": _error(
                "Overloaded (`overloaded`), backend unavailable (`backend_unavailable`), "
                "the gateway stopping (`shutting_down`) or the quota store down with "
                "fail_closed (`quota_store_unavailable`).",
                retry_after=True,
            ),
            "504": _error("Still queued at the tier's deadline (`queue_timeout`)."),
        },
    }


def _admin_operation(summary: str, response_schema: str, *, reload: bool = False) -> dict[str, Any]:
    responses: dict[str, Any] = {
        "200": _ok(summary, _json(_ref("schemas", response_schema))),
    }
    if reload:
        responses["400"] = _error(
            "The new policy was refused (`policy_rejected`) with every problem; the running "
            "policy stays."
        )
    responses["401"] = _error("No admin token, or a wrong one, as a Bearer token.")
    responses["404"] = _error(
        "The admin endpoints are disabled: `server.admin_token_env` is unset or its variable empty."
    )
    responses["429"] = _error(_AUTH_THROTTLED, retry_after=True)
    responses["500"] = _ref("responses", "InternalError")
    return {"summary": summary, "security": [{"adminToken": []}], "responses": responses}


def _open_get(summary: str, response: dict[str, Any], **more: Any) -> dict[str, Any]:
    responses = {"200": response, **more, "500": _ref("responses", "InternalError")}
    return {"get": {"summary": summary, "security": [], "responses": responses}}


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
                'shape: {"error": {"message", "type", "code", "param"}}. A method a path does '
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
                "get": {
                    "summary": "The models the backend serves",
                    "security": [{"apiKey": []}, {"tenantHeader": [], "gatewaySecret": []}],
                    "responses": {
                        "200": _ok("The models.", _json(_ref("schemas", "ModelList"))),
                        "400": _error("A malformed X-Tenant-Id."),
                        "401": _error("Unknown or missing key."),
                        "429": _error(_AUTH_THROTTLED, retry_after=True),
                        "500": _ref("responses", "InternalError"),
                    },
                }
            },
            "/healthz": _open_get("Liveness", _ok("The process is alive.", status)),
            "/readyz": _open_get(
                "Readiness",
                _ok("The backend is ready.", status),
                **{
                    "503": _error(
                        "The backend is not ready (`not_ready`) or the gateway is stopping "
                        "(`shutting_down`).",
                        retry_after=True,
                    )
                },
            ),
            "/metrics": _open_get(
                "Prometheus metrics",
                _ok("The exposition format.", {"text/plain": {"schema": {"type": "string"}}}),
            ),
            "/dashboard": _open_get(
                "The live dashboard page; it reads /admin/stats with the admin token",
                _ok("The page.", {"text/html": {"schema": {"type": "string"}}}),
            ),
            "/openapi.json": _open_get(
                "This document", _ok("The OpenAPI document.", _json({"type": "object"}))
            ),
            "/admin/stats": {
                "get": _admin_operation("Queues, backend, outcomes, SLOs and quotas", "Stats")
            },
            "/admin/quotas": {"get": _admin_operation("Each tenant's quota use", "Quotas")},
            "/admin/reload": {
                "post": _admin_operation(
                    "Re-read the policy file (as SIGHUP does)", "Reloaded", reload=True
                )
            },
        },
        "components": {
            "securitySchemes": {
                "apiKey": {
                    "type": "http",
                    "scheme": "bearer",
                    "description": "A tenant's API key.",
                },
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
            },
            "headers": {
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
            },
            "responses": {
                "InternalError": _error("A bug in the gateway (`internal_error`)."),
            },
            "schemas": _schemas(models, support, max_model_len),
        },
    }
