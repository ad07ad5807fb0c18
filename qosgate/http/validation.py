"""Request bodies of /v1/chat/completions and /v1/completions.

Only what the gateway relies on is checked (the model, the prompt, the size
and sampling fields); everything else passes through to the backend, as
DESIGN.md section 6 asks. Each field has one validator that raises one error,
so a bad request is answered with one message that names one field, the way
OpenAI does, instead of pydantic's list of union alternatives.
"""

from __future__ import annotations

import json
import math
import re
from collections.abc import Callable, Iterable
from typing import Annotated, Any, Literal

import orjson
from pydantic import (
    BaseModel,
    ConfigDict,
    Field,
    PlainValidator,
    ValidationError,
    model_validator,
)
from pydantic_core import PydanticCustomError

from qosgate.runtime.errors import BadRequest

from .errors import ModelNotFound

MAX_PRIORITY_OFFSET = 1000
"""Deepest level a client may push its request below its tier (TierConfig.priority's range)."""


def _fail(kind: str, message: str) -> PydanticCustomError:
    return PydanticCustomError(kind, message)


def _type_name(value: Any) -> str:
    if value is None:
        return "null"
    if isinstance(value, bool):
        return "a boolean"
    if isinstance(value, int):
        return "an integer"
    if isinstance(value, float):
        return "a number"
    if isinstance(value, str):
        return "a string"
    if isinstance(value, list):
        return "an array"
    if isinstance(value, dict):
        return "an object"
    return type(value).__name__


def _integer(minimum: int) -> Callable[[Any], int]:
    def check(value: Any) -> int:
        # JSON has one number type: `2.0` is the integer 2 to every JSON Schema
        # reader (our OpenAPI document included), so it is taken as 2. JSON
        # true is an int to Python, but not a number to JSON.
        if isinstance(value, float) and value.is_integer():
            value = int(value)
        if isinstance(value, bool) or not isinstance(value, int):
            raise _fail("int_type", f"expected an integer, but got {_type_name(value)}")
        if value < minimum:
            raise _fail("too_small", f"must be at least {minimum}, got {value}")
        return value

    return check


def _number(low: float, high: float) -> Callable[[Any], float]:
    def check(value: Any) -> float:
        if isinstance(value, bool) or not isinstance(value, (int, float)):
            raise _fail("number_type", f"expected a number, but got {_type_name(value)}")
        if not (math.isfinite(value) and low <= value <= high):
            raise _fail("out_of_range", f"must be between {low:g} and {high:g}, got {value!r}")
        return value

    return check


def _boolean(value: Any) -> bool:
    if not isinstance(value, bool):
        raise _fail("bool_type", f"expected a boolean, but got {_type_name(value)}")
    return value


def _string(value: Any) -> str:
    if not isinstance(value, str):
        raise _fail("string_type", f"expected a string, but got {_type_name(value)}")
    return value


def _model_name(value: Any) -> str:
    name = _string(value)
    if not name.strip():
        raise _fail("string_empty", "must not be empty")
    return name


def _exactly_one(value: Any) -> int:
    n = _integer(1)(value)
    if n != 1:
        raise _fail("unsupported", "only n=1 is supported")
    return n


def _content(value: Any) -> str | list[dict[str, Any]] | None:
    if value is None or isinstance(value, str):
        return value
    if not isinstance(value, list):
        raise _fail(
            "content_type", f"expected a string or an array of parts, but got {_type_name(value)}"
        )
    for index, part in enumerate(value):
        if not isinstance(part, dict) or not isinstance(part.get("type"), str):
            raise _fail("part_type", f"part {index} must be an object with a string 'type'")
        if part["type"] == "text" and not isinstance(part.get("text"), str):
            raise _fail("part_text", f"part {index} of type 'text' needs a string 'text'")
    return value


def _prompt(value: Any) -> str | list[str]:
    if isinstance(value, str):
        return value
    if not isinstance(value, list):
        raise _fail(
            "prompt_type", f"expected a string or an array of strings, but got {_type_name(value)}"
        )
    if not value:
        raise _fail("prompt_empty", "must not be an empty array")
    if not all(isinstance(item, str) for item in value):
        # Token-id prompts would bypass the gateway's prompt-token estimate.
        raise _fail("prompt_type", "expected a string or an array of strings")
    if len(value) > 1:
        # Several prompts are several generations; the gateway schedules and
        # meters one per request, as with n=1.
        raise _fail("unsupported", "only one prompt per request is supported")
    return value


Int1 = Annotated[int, PlainValidator(_integer(1))]
StrictBool = Annotated[bool, PlainValidator(_boolean)]


class StreamOptions(BaseModel):
    model_config = ConfigDict(extra="allow")

    include_usage: Annotated[bool, PlainValidator(_boolean)] = False


class _Body(BaseModel):
    # Unknown fields are the backend's business (DESIGN.md section 6).
    model_config = ConfigDict(extra="allow")

    model: Annotated[str, PlainValidator(_model_name)]
    stream: StrictBool = False
    stream_options: StreamOptions | None = None
    max_tokens: Int1 | None = None
    n: Annotated[int, PlainValidator(_exactly_one)] | None = None
    temperature: Annotated[float, PlainValidator(_number(0.0, 2.0))] | None = None
    top_p: Annotated[float, PlainValidator(_number(0.0, 1.0))] | None = None
    priority: Annotated[int, PlainValidator(_integer(0))] | None = None
    """vLLM-style extension: levels below the tenant's tier (0: the tier's own)."""

    @property
    def asked_max_tokens(self) -> int | None:
        return self.max_tokens

    @property
    def include_usage(self) -> bool:
        return self.stream_options is not None and self.stream_options.include_usage


class Message(BaseModel):
    model_config = ConfigDict(extra="allow")

    role: Literal["system", "user", "assistant", "tool", "developer"]
    content: Annotated[Any, PlainValidator(_content)] = None

    @model_validator(mode="after")
    def _content_present(self) -> Message:
        # Only an assistant turn that carries tool calls may come without content.
        if self.content is None and self.role != "assistant":
            raise _fail("missing", "Field required")
        return self


class ChatBody(_Body):
    messages: Annotated[list[Message], Field(min_length=1)]
    max_completion_tokens: Int1 | None = None

    @property
    def asked_max_tokens(self) -> int | None:
        # OpenAI's newer name wins when both are given.
        return (
            self.max_completion_tokens
            if self.max_completion_tokens is not None
            else self.max_tokens
        )


class CompletionBody(_Body):
    prompt: Annotated[Any, PlainValidator(_prompt)]


Endpoint = Literal["chat", "completions"]
_BODIES: dict[str, type[_Body]] = {"chat": ChatBody, "completions": CompletionBody}


def _param(loc: Iterable[int | str]) -> str | None:
    parts = [str(part) for part in loc]
    return ".".join(parts) or None


def _message(error: dict[str, Any], param: str | None) -> str:
    if error["type"] == "missing":
        return f"Missing required parameter: '{param}'."
    if error["type"] == "literal_error" and param and param.endswith(".role"):
        return (
            f"Invalid value for '{param}': must be one of system, user, assistant, tool, developer."
        )
    if error["type"] == "too_short" and param == "messages":
        return "Invalid value for 'messages': must not be empty."
    if error["type"] == "list_type":
        return f"Invalid type for '{param}': expected an array."
    if error["type"] == "model_type":
        return f"Invalid type for '{param}': expected an object."
    if param is None:
        return f"Invalid request: {error['msg']}."
    return f"Invalid value for '{param}': {error['msg']}."


_INTEGER_FIELDS = ("max_tokens", "max_completion_tokens", "n", "priority")


def validate_body(endpoint: Endpoint, body: Any, served_models: Iterable[str]) -> _Body:
    """Raises BadRequest naming the field, or ModelNotFound.

    Integer fields written as whole floats (`"n": 1.0`) are rewritten in
    `body` as integers: the body goes on to the backend, and a backend with a
    stricter reader (serde's u32) would refuse what the gateway took."""
    if not isinstance(body, dict):
        raise BadRequest(
            f"The request body must be a JSON object, not {_type_name(body)}.", param=None
        )
    try:
        parsed = _BODIES[endpoint].model_validate(body)
    except ValidationError as exc:
        # The message validator reports a missing content at the message level;
        # point at the field instead.
        error = exc.errors(include_url=False)[0]
        loc = list(error["loc"])
        if error["type"] == "missing" and len(loc) == 2 and loc[0] == "messages":
            loc.append("content")
        param = _param(loc)
        raise BadRequest(_message(error, param), param=param) from None
    models = tuple(served_models)
    # An empty list means the backend cannot enumerate its models (an upstream
    # that does not say): let the backend judge the name.
    if models and parsed.model not in models:
        raise ModelNotFound(parsed.model)
    for name in _INTEGER_FIELDS:
        if isinstance(body.get(name), float) and name in type(parsed).model_fields:
            body[name] = getattr(parsed, name)
    return parsed


def _no_constants(name: str) -> Any:
    # Python's json takes NaN and Infinity; JSON (and every backend) does not.
    raise ValueError(f"{name} is not valid JSON")


def _finite(text: str) -> float:
    # 1e999 parses to inf, which would reach a backend as the invalid `Infinity`.
    value = float(text)
    if not math.isfinite(value):
        raise ValueError(f"number {text[:20]} is out of range")
    return value


# An escape of a UTF-16 surrogate (\uD800 to \uDFFF): only these can put a
# surrogate into a parsed string, raw UTF-8 cannot encode one. A client that
# escapes all non-ASCII sends each emoji as a pair of them, which json.loads
# joins into one character; only the scan after it tells a lone one apart.
_SURROGATE_ESCAPE = re.compile(rb"\\u[dD][89abcdefABCDEF]")


def _has_lone_surrogate(value: Any) -> bool:
    # Iterative: the value may be nested nearly as deep as the recursion limit.
    stack = [value]
    while stack:
        item = stack.pop()
        if isinstance(item, str):
            try:
                item.encode("utf-8")
            except UnicodeEncodeError:
                return True
        elif isinstance(item, list):
            stack.extend(item)
        elif isinstance(item, dict):
            stack.extend(item.keys())
            stack.extend(item.values())
    return False


# orjson reads an integer beyond 64 bits as a float, where Python's json keeps
# it exact (and validation then names the field): such bodies take the slow path.
_LONG_NUMBER = re.compile(rb"[0-9]{20}")


def parse_json(raw: bytes) -> Any:
    """The body as JSON, or BadRequest. Hostile input (invalid UTF-8, NaN,
    numbers with thousands of digits, nesting deep enough to exhaust the
    parser's recursion, escapes of unpaired surrogates) all land here as a
    400, never as a crash."""
    if not _LONG_NUMBER.search(raw):
        # The common case, in a fifth of the time. orjson refuses everything
        # the path below refuses (NaN, infinities, invalid UTF-8, unpaired
        # surrogates, nesting past its depth limit); what it refuses goes on
        # to the path below, whose messages are the ones clients see.
        try:
            return orjson.loads(raw)
        except orjson.JSONDecodeError:
            pass
    try:
        text = raw.decode("utf-8")
        value = json.loads(text, parse_constant=_no_constants, parse_float=_finite)
        # A lone surrogate is valid JSON but not Unicode: the body could not
        # be encoded again for an upstream backend (a 502 and a traceback),
        # nor a reply that echoes the string (the model name, where the
        # backend lists no models: a 500).
        if _SURROGATE_ESCAPE.search(raw) and _has_lone_surrogate(value):
            raise ValueError("a string holds an unpaired UTF-16 surrogate escape")
        return value
    except RecursionError:
        raise BadRequest("The JSON body of your request is nested too deeply.") from None
    except ValueError as exc:
        if isinstance(exc, json.JSONDecodeError):
            detail = exc.msg
        elif isinstance(exc, UnicodeDecodeError):
            detail = "not UTF-8"
        elif "integer string conversion" in str(exc):
            detail = "a number has too many digits"
        else:
            # Our hooks' messages; they quote at most a few characters of the body.
            detail = str(exc)[:100]
        raise BadRequest(
            f"We could not parse the JSON body of your request ({detail}).", param=None
        ) from None
