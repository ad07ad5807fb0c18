"""Request bodies of /v1/chat/completions and /v1/completions: OpenAI's
request model, enforced before any backend sees a request.

Every field OpenAI documents for the two endpoints (and vLLM's sampling
extensions, which OpenAI-compatible servers share) is typed and ranged here,
so a backend only ever sees valid values. A field the configured backend
cannot honour is refused by name (`check_support`), never dropped. Each field
has one validator that raises one error, so a bad request is answered with
one message that names one field, the way OpenAI does, instead of pydantic's
list of union alternatives; its JSON Schema sits beside it and is what the
OpenAPI document publishes.
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
    WithJsonSchema,
    model_validator,
)
from pydantic_core import PydanticCustomError

from qosgate.backends.base import LONG_NUMBER
from qosgate.backends.support import (
    ECHO,
    LOGIT_BIAS,
    LOGPROBS,
    MEDIA,
    RESPONSE_FORMAT,
    SUFFIX,
    TOOLS,
    RequestSupport,
)
from qosgate.runtime.ask import short_number
from qosgate.runtime.errors import BadRequest

from .errors import ModelNotFound

MAX_PRIORITY_OFFSET = 1000
"""Deepest level a client may push its request below its tier (TierConfig.priority's range)."""

# Some character that Python's str.strip() would keep. Spelled out because
# `\S` differs between regex dialects (ECMA's counts U+FEFF as a space,
# Python's does not; Python's counts U+001C-U+001F, ECMA's does not).
NOT_ONLY_SPACE = r"[^\t-\r\u001c- \u0085\u00a0\u1680\u2000-\u200a\u2028\u2029\u202f\u205f\u3000]"


def _fail(kind: str, message: str) -> PydanticCustomError:
    return PydanticCustomError(kind, message)


# bool before int: JSON true is an int to Python.
_JSON_TYPES = (
    (type(None), "null"), (bool, "a boolean"), (int, "an integer"), (float, "a number"),
    (str, "a string"), (list, "an array"), (dict, "an object"),
)  # fmt: skip


def _type_name(value: Any) -> str:
    for kind, name in _JSON_TYPES:
        if isinstance(value, kind):
            return name
    return type(value).__name__


def _is_whole(value: Any) -> bool:
    # JSON has one number type: `2.0` is the integer 2 to every JSON Schema
    # reader (our OpenAPI document included), so it is taken as 2. JSON true
    # is an int to Python, but not a number to JSON.
    if isinstance(value, float):
        return value.is_integer()
    return isinstance(value, int) and not isinstance(value, bool)


def _integer(low: int, high: int | None = None) -> Callable[[Any], int]:
    def check(value: Any) -> int:
        if not _is_whole(value):
            raise _fail("int_type", f"expected an integer, but got {_type_name(value)}")
        value = int(value)
        if value < low:
            raise _fail("too_small", f"must be at least {low}, got {short_number(value)}")
        if high is not None and value > high:
            raise _fail("too_large", f"must be at most {high}, got {short_number(value)}")
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
        raise _fail(
            "unsupported",
            "only 1 is supported: the gateway schedules and meters one generation per request",
        )
    return n


def _strings(limit: int) -> Callable[[Any], str | list[str]]:
    """A string or an array of at most `limit` strings (OpenAI's `stop`)."""

    def check(value: Any) -> str | list[str]:
        if isinstance(value, str):
            return value
        if not isinstance(value, list):
            raise _fail(
                "stop_type",
                f"expected a string or an array of strings, but got {_type_name(value)}",
            )
        if len(value) > limit:
            raise _fail("too_long", f"at most {limit} strings, got {len(value)}")
        for index, item in enumerate(value):
            if not isinstance(item, str):
                raise _fail("stop_type", f"item {index} must be a string, not {_type_name(item)}")
        return value

    return check


def _token_ids(limit: int) -> Callable[[Any], list[int]]:
    token = _integer(0, MAX_TOKEN_ID)

    def check(value: Any) -> list[int]:
        if not isinstance(value, list):
            raise _fail("list_type", f"expected an array of token ids, but got {_type_name(value)}")
        if len(value) > limit:
            raise _fail("too_long", f"at most {limit} token ids, got {len(value)}")
        out = []
        for index, item in enumerate(value):
            try:
                out.append(token(item))
            except PydanticCustomError as exc:
                raise _fail("token_id", f"item {index}: {exc.message()}") from None
        return out

    return check


_TOKEN_KEY = re.compile(r"[0-9]{1,9}")


def _logit_bias(value: Any) -> dict[str, float]:
    if not isinstance(value, dict):
        raise _fail("object_type", f"expected an object, but got {_type_name(value)}")
    if len(value) > MAX_LOGIT_BIAS:
        raise _fail("too_long", f"at most {MAX_LOGIT_BIAS} entries, got {len(value)}")
    bias = _number(-100.0, 100.0)
    for key, item in value.items():
        # JSON keys are strings: a token id written as one.
        if not _TOKEN_KEY.fullmatch(key):
            raise _fail("token_id", f"key {key[:20]!r} is not a token id")
        try:
            bias(item)
        except PydanticCustomError as exc:
            raise _fail("bias", f"token {key}: {exc.message()}") from None
    return value


def _metadata(value: Any) -> dict[str, str]:
    if not isinstance(value, dict):
        raise _fail("object_type", f"expected an object, but got {_type_name(value)}")
    if len(value) > 16:
        raise _fail("too_long", f"at most 16 pairs, got {len(value)}")
    for key, item in value.items():
        if len(key) > 64 or not isinstance(item, str) or len(item) > 512:
            raise _fail("metadata", "keys are strings of at most 64 characters, values at most 512")
    return value


_FUNCTION_NAME = re.compile(r"[a-zA-Z0-9_-]{1,64}")


def _function_name(value: Any, where: str) -> str:
    if not isinstance(value, str) or not _FUNCTION_NAME.fullmatch(value):
        raise _fail(
            "function_name",
            f"{where} must be a string of 1 to 64 letters, digits, underscores or dashes",
        )
    return value


def _object(value: Any, where: str) -> dict[str, Any]:
    if not isinstance(value, dict):
        raise _fail("object_type", f"{where} must be an object, not {_type_name(value)}")
    return value


def _tools(value: Any) -> list[dict[str, Any]]:
    if not isinstance(value, list):
        raise _fail("list_type", f"expected an array of tools, but got {_type_name(value)}")
    if len(value) > MAX_TOOLS:
        raise _fail("too_long", f"at most {MAX_TOOLS} tools, got {len(value)}")
    for index, tool in enumerate(value):
        tool = _object(tool, f"tool {index}")
        if tool.get("type") != "function":
            raise _fail("tool_type", f"tool {index}: 'type' must be 'function'")
        function = _object(tool.get("function"), f"tool {index}'s 'function'")
        _function_name(function.get("name"), f"tool {index}'s function name")
        if "description" in function and not isinstance(function["description"], str):
            raise _fail("tool", f"tool {index}'s function description must be a string")
        if function.get("parameters") is not None:
            _object(function["parameters"], f"tool {index}'s function parameters")
        if function.get("strict") is not None and not isinstance(function["strict"], bool):
            raise _fail("tool", f"tool {index}'s function strict must be a boolean")
    return value


def _tool_choice(value: Any) -> str | dict[str, Any]:
    if isinstance(value, str):
        if value not in ("none", "auto", "required"):
            raise _fail("tool_choice", "must be 'none', 'auto', 'required' or a named function")
        return value
    choice = _object(value, "a named tool choice")
    if choice.get("type") != "function":
        raise _fail("tool_choice", "a named tool choice needs 'type': 'function'")
    function = _object(choice.get("function"), "its 'function'")
    _function_name(function.get("name"), "its function name")
    return value


def _response_format(value: Any) -> dict[str, Any]:
    fmt = _object(value, "response_format")
    kind = fmt.get("type")
    if kind not in ("text", "json_object", "json_schema"):
        raise _fail("response_format", "'type' must be 'text', 'json_object' or 'json_schema'")
    if kind == "json_schema":
        spec = _object(fmt.get("json_schema"), "'json_schema'")
        _function_name(spec.get("name"), "'json_schema.name'")
        if spec.get("schema") is not None:
            _object(spec["schema"], "'json_schema.schema'")
        if spec.get("strict") is not None and not isinstance(spec["strict"], bool):
            raise _fail("response_format", "'json_schema.strict' must be a boolean")
    return value


_PART_TYPES = ("text", "refusal", *MEDIA)


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
        kind = part["type"]
        if kind not in _PART_TYPES:
            raise _fail("part_type", f"part {index} has an unknown type {kind[:40]!r}")
        if kind in ("text", "refusal") and not isinstance(part.get(kind), str):
            raise _fail("part_text", f"part {index} of type {kind!r} needs a string {kind!r}")
    return value


def _prompt(value: Any) -> str | list[str] | list[int] | list[list[int]]:
    if isinstance(value, str):
        return value
    if not isinstance(value, list):
        raise _fail(
            "prompt_type",
            f"expected a string, an array of token ids or an array of one of them, "
            f"but got {_type_name(value)}",
        )
    if not value:
        raise _fail("prompt_empty", "must not be an empty array")
    if all(_is_whole(item) for item in value):
        return _token_ids(MAX_PROMPT_IDS)(value)
    if len(value) > 1:
        # Several prompts are several generations; the gateway schedules and
        # meters one per request, as with n=1.
        raise _fail("unsupported", "only one prompt per request is supported")
    (only,) = value
    if isinstance(only, str):
        return value
    if isinstance(only, list) and only:
        return [_token_ids(MAX_PROMPT_IDS)(only)]
    raise _fail(
        "prompt_type", "expected a string, an array of token ids or an array of one of them"
    )


def _field(check: Callable[[Any], Any], schema: dict[str, Any]) -> Any:
    """A field's one rule and its JSON Schema, side by side (the OpenAPI
    document reads the schema from here)."""
    return Annotated[Any, PlainValidator(check), WithJsonSchema(schema)]


_INT32 = 2**31 - 1
MAX_TOKEN_ID = _INT32
MAX_PROMPT_IDS = 1_000_000
MAX_LOGIT_BIAS = 1024
MAX_TOOLS = 128
MAX_STOP = 4
"""OpenAI's limit on stop sequences."""
MAX_STOP_TOKEN_IDS = 64



def _ranged_number(low: float, high: float) -> Any:
    return _field(_number(low, high), {"type": "number", "minimum": low, "maximum": high})


def _ranged_integer(low: int, high: int | None = None, **schema: Any) -> Any:
    bounds = {"minimum": low} if high is None else {"minimum": low, "maximum": high}
    return _field(_integer(low, high), {"type": "integer", **bounds, **schema})


# No upper bound here: past the model's context is refused by `runtime.ask.fit_context`,
# where the backend's context length is known.
Int1 = _ranged_integer(1)
StrictBool = _field(_boolean, {"type": "boolean"})
_Text = _field(_string, {"type": "string"})
_OnlyOne = _field(_exactly_one, {"type": "integer", "enum": [1]})
_Temperature = _ranged_number(0.0, 2.0)
_Probability = _ranged_number(0.0, 1.0)
_Penalty = _ranged_number(-2.0, 2.0)
_RepetitionPenalty = _ranged_number(0.01, 10.0)
_Seed = _ranged_integer(-(2**63), 2**63 - 1)
_TopK = _ranged_integer(-1, _INT32)
_MinTokens = _ranged_integer(0, _INT32)
_TopLogprobs = _ranged_integer(0, 20)
_CompletionLogprobs = _ranged_integer(0, 5)
_Priority = _ranged_integer(
    0,
    description=(
        "vLLM-style extension: levels below the tenant's tier (never above it); "
        f"values past {MAX_PRIORITY_OFFSET} count as {MAX_PRIORITY_OFFSET}."
    ),
)
_Stop = _field(
    _strings(MAX_STOP),
    {
        "anyOf": [
            {"type": "string"},
            {"type": "array", "maxItems": MAX_STOP, "items": {"type": "string"}},
        ]
    },
)
_TOKEN_ID_SCHEMA = {"type": "integer", "minimum": 0, "maximum": MAX_TOKEN_ID}
_TokenIds = _field(
    _token_ids(MAX_STOP_TOKEN_IDS),
    {"type": "array", "maxItems": MAX_STOP_TOKEN_IDS, "items": _TOKEN_ID_SCHEMA},
)

def nullable(schema: dict[str, Any]) -> dict[str, Any]:
    """`schema`, or JSON null ("not given")."""
    return {"anyOf": [schema, {"type": "null"}]}


_NAME_SCHEMA = {"type": "string", "pattern": f"^{_FUNCTION_NAME.pattern}$"}
_OBJECT = {"type": "object"}


def _function_schema(**more: Any) -> dict[str, Any]:
    """A tool or a named tool choice: `type` function, and a named function."""
    properties = {"name": _NAME_SCHEMA, **more}
    function = {"type": "object", "required": ["name"], "properties": properties}
    return {
        "type": "object",
        "required": ["type", "function"],
        "properties": {"type": {"const": "function"}, "function": function},
    }


_TOOL_SCHEMA = _function_schema(
    description={"type": "string"},
    parameters=nullable(_OBJECT),
    strict=nullable({"type": "boolean"}),
)
_NAMED_CHOICE_SCHEMA = _function_schema()
_RESPONSE_FORMAT_SCHEMA = {
    "anyOf": [
        {
            "type": "object",
            "required": ["type"],
            "properties": {"type": {"enum": ["text", "json_object"]}},
        },
        {
            "type": "object",
            "required": ["type", "json_schema"],
            "properties": {
                "type": {"const": "json_schema"},
                "json_schema": {
                    "type": "object",
                    "required": ["name"],
                    "properties": {
                        "name": _NAME_SCHEMA,
                        "schema": nullable(_OBJECT),
                        "strict": nullable({"type": "boolean"}),
                    },
                },
            },
        },
    ]
}


_ModelName = _field(_model_name, {"type": "string", "pattern": NOT_ONLY_SPACE})
_LogitBias = _field(
    _logit_bias,
    {
        "type": "object",
        "maxProperties": MAX_LOGIT_BIAS,
        "propertyNames": {"pattern": f"^{_TOKEN_KEY.pattern}$"},
        "additionalProperties": {"type": "number", "minimum": -100, "maximum": 100},
    },
)
METADATA_SCHEMA = {
    "type": "object",
    "maxProperties": 16,
    "propertyNames": {"maxLength": 64},
    "additionalProperties": {"type": "string", "maxLength": 512},
}
_Metadata = _field(_metadata, METADATA_SCHEMA)
_Content = _field(_content, {})
_ResponseFormat = _field(_response_format, _RESPONSE_FORMAT_SCHEMA)
_Tools = _field(_tools, {"type": "array", "maxItems": MAX_TOOLS, "items": _TOOL_SCHEMA})
_ToolChoice = _field(
    _tool_choice, {"anyOf": [{"enum": ["none", "auto", "required"]}, _NAMED_CHOICE_SCHEMA]}
)
_Prompt = _field(
    _prompt,
    {
        "anyOf": [
            {"type": "string"},
            {"type": "array", "minItems": 1, "maxItems": 1, "items": {"type": "string"}},
            {"type": "array", "minItems": 1, "items": _TOKEN_ID_SCHEMA},
            {
                "type": "array",
                "minItems": 1,
                "maxItems": 1,
                "items": {"type": "array", "minItems": 1, "items": _TOKEN_ID_SCHEMA},
            },
        ]
    },
)


class StreamOptions(BaseModel):
    model_config = ConfigDict(extra="allow")

    include_usage: StrictBool = False
    include_obfuscation: StrictBool = False


class _Body(BaseModel):
    """What both endpoints share: OpenAI's fields, typed and ranged as OpenAI
    documents them, and vLLM's sampling extensions. Every field may be JSON
    null, meaning "not given"."""

    # Other fields are judged against the backend (`check_support`).
    model_config = ConfigDict(extra="allow")

    model: _ModelName
    stream: StrictBool = Field(
        False,
        description="Answer as text/event-stream: `data: {chunk}` lines, then `data: [DONE]`.",
    )
    stream_options: StreamOptions | None = None
    max_tokens: Int1 | None = Field(
        None,
        description=(
            "Clamped to the tier's max_tokens and the room the prompt leaves; past the "
            "model's context: 400. Absent: the tier's default."
        ),
    )
    n: _OnlyOne | None = Field(
        None, description="One generation per request: the gateway schedules and meters one."
    )
    temperature: _Temperature | None = None
    top_p: _Probability | None = None
    presence_penalty: _Penalty | None = None
    frequency_penalty: _Penalty | None = None
    seed: _Seed | None = None
    stop: _Stop | None = None
    logit_bias: _LogitBias | None = None
    user: _Text | None = None
    metadata: _Metadata | None = None
    store: StrictBool | None = None
    service_tier: _Text | None = None
    # vLLM's sampling extensions, which OpenAI-compatible servers share.
    top_k: _TopK | None = None
    min_p: _Probability | None = None
    repetition_penalty: _RepetitionPenalty | None = None
    min_tokens: _MinTokens | None = None
    ignore_eos: StrictBool | None = None
    stop_token_ids: _TokenIds | None = None
    include_stop_str_in_output: StrictBool | None = None
    skip_special_tokens: StrictBool | None = None
    spaces_between_special_tokens: StrictBool | None = None
    priority: _Priority | None = None
    """vLLM-style extension: levels below the tenant's tier (0: the tier's own)."""

    @property
    def asked_field(self) -> str:
        """The field the client asked its output length in."""
        return "max_tokens"

    @property
    def asked_max_tokens(self) -> int | None:
        return getattr(self, self.asked_field)

    @property
    def include_usage(self) -> bool:
        return self.stream_options is not None and self.stream_options.include_usage

    def features(self) -> list[tuple[str, str]]:
        """(field, feature) for each optional capability the request asks of
        its backend (values that change nothing, like `logprobs: false`, ask
        for none)."""
        wanted = []
        if self.logit_bias:
            wanted.append(("logit_bias", LOGIT_BIAS))
        return wanted


def _part_schema(kind: str) -> dict[str, Any]:
    text = kind in ("text", "refusal")
    return {
        "type": "object",
        "required": ["type", kind],
        "properties": {"type": {"const": kind}, kind: {"type": "string" if text else "object"}},
    }


def _content_schema() -> dict[str, Any]:
    parts = {"anyOf": [_part_schema(kind) for kind in _PART_TYPES]}
    return {"anyOf": [{"type": "string"}, {"type": "array", "items": parts}]}


class Message(BaseModel):
    model_config = ConfigDict(extra="allow")

    role: Literal["system", "user", "assistant", "tool", "developer"]
    content: _Content = None

    @classmethod
    def __get_pydantic_json_schema__(cls, core_schema: Any, handler: Any) -> dict[str, Any]:
        # `_content_present` as JSON Schema: only an assistant turn may come
        # without content.
        return {
            "anyOf": [
                {
                    "type": "object",
                    "required": ["role", "content"],
                    "properties": {
                        "role": {"enum": ["system", "user", "tool", "developer"]},
                        "content": _content_schema(),
                    },
                },
                {
                    "type": "object",
                    "required": ["role"],
                    "properties": {
                        "role": {"const": "assistant"},
                        "content": nullable(_content_schema()),
                    },
                },
            ]
        }

    @model_validator(mode="after")
    def _content_present(self) -> Message:
        # Only an assistant turn that carries tool calls may come without content.
        if self.content is None and self.role != "assistant":
            raise _fail("missing", "Field required")
        return self


class ChatBody(_Body):
    messages: Annotated[list[Message], Field(min_length=1)]
    max_completion_tokens: Int1 | None = None
    logprobs: StrictBool | None = None
    top_logprobs: _TopLogprobs | None = None
    response_format: _ResponseFormat | None = None
    tools: _Tools | None = None
    tool_choice: _ToolChoice | None = None
    parallel_tool_calls: StrictBool | None = None

    @property
    def asked_field(self) -> str:
        # OpenAI's newer name wins when both are given.
        return "max_tokens" if self.max_completion_tokens is None else "max_completion_tokens"

    def features(self) -> list[tuple[str, str]]:
        wanted = super().features()
        # Combinations (tool_choice without tools, top_logprobs without
        # logprobs) are the backend's to judge: each field asks on its own.
        if self.logprobs:
            wanted.append(("logprobs", LOGPROBS))
        if self.top_logprobs:
            wanted.append(("top_logprobs", LOGPROBS))
        if self.response_format is not None and self.response_format["type"] != "text":
            wanted.append(("response_format", RESPONSE_FORMAT))
        if self.tools:
            wanted.append(("tools", TOOLS))
        if self.tool_choice not in (None, "none"):
            wanted.append(("tool_choice", TOOLS))
        for m, message in enumerate(self.messages):
            if isinstance(message.content, list):
                for p, part in enumerate(message.content):
                    if part["type"] in MEDIA:
                        wanted.append((f"messages.{m}.content.{p}", part["type"]))
        return wanted


class CompletionBody(_Body):
    prompt: _Prompt
    logprobs: _CompletionLogprobs | None = None
    echo: StrictBool | None = None
    best_of: _OnlyOne | None = None
    suffix: _Text | None = None

    def features(self) -> list[tuple[str, str]]:
        wanted = super().features()
        if self.logprobs is not None:
            wanted.append(("logprobs", LOGPROBS))
        if self.echo:
            wanted.append(("echo", ECHO))
        if self.suffix:
            wanted.append(("suffix", SUFFIX))
        return wanted


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


_REWRITTEN_FIELDS = (
    "max_tokens", "max_completion_tokens", "n", "priority", "seed", "top_k", "min_tokens",
    "top_logprobs", "best_of", "logprobs", "prompt", "stop_token_ids",
)  # fmt: skip
"""Fields read as integers (`logprobs` is one for completions; for chat, a
float there is refused as not a boolean) or as arrays of token ids: a whole
float there is the parsed integer in the body the backend gets."""


def validate_body(
    endpoint: Endpoint,
    body: Any,
    served_models: Iterable[str],
    support: RequestSupport | None = None,
) -> _Body:
    """Raises BadRequest naming the field, or ModelNotFound.

    With `support`, a field the backend cannot honour is refused by name
    (never dropped); without it, everything valid is taken.

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
    fields = type(parsed).model_fields
    for name in _REWRITTEN_FIELDS:
        if isinstance(body.get(name), (float, list)) and name in fields:
            body[name] = getattr(parsed, name)
    if support is not None:
        check_support(parsed, support)
    return parsed


# What a request may hold where its backend lacks a feature: only the values
# that ask for nothing (the OpenAPI document of such a gateway says so).
_WITHOUT: dict[str, dict[str, dict[str, Any]]] = {
    LOGPROBS: {"logprobs": {"const": False}, "top_logprobs": {"const": 0}},
    RESPONSE_FORMAT: {
        "response_format": {
            "type": "object", "required": ["type"], "properties": {"type": {"const": "text"}}
        }
    },
    TOOLS: {"tools": {"type": "array", "maxItems": 0}, "tool_choice": {"const": "none"}},
    ECHO: {"echo": {"const": False}},
    SUFFIX: {"suffix": {"type": "string", "maxLength": 0}},
    LOGIT_BIAS: {"logit_bias": {"type": "object", "maxProperties": 0}},
}  # fmt: skip
_WITHOUT_COMPLETIONS = {LOGPROBS: {"logprobs": {"type": "null"}}}


def request_schema(
    endpoint: Endpoint, support: RequestSupport, max_model_len: int | None
) -> dict[str, Any]:
    """The JSON Schema of a request body as a gateway with this backend takes
    it: the request model's own schema, less what the backend cannot honour
    (then no unknown field either, and no media part it cannot read), with
    asks up to the model's context. `model` is the caller's (the served
    names)."""
    schema = _BODIES[endpoint].model_json_schema(ref_template="#/$defs/{model}")
    defs = schema.pop("$defs", {})
    properties = schema["properties"]
    for name, prop in properties.items():
        prop.pop("title", None)
        _inline(prop, defs)
    if max_model_len is not None:
        for name in ("max_tokens", "max_completion_tokens"):
            if name in properties:
                properties[name]["anyOf"][0]["maximum"] = max_model_len
    if not support.passthrough:
        schema["additionalProperties"] = False
        for feature, narrowed in _WITHOUT.items():
            if feature in support.features:
                continue
            if endpoint == "completions":
                narrowed = _WITHOUT_COMPLETIONS.get(feature, narrowed)
            for name, rule in narrowed.items():
                if name in properties:
                    properties[name] = {**nullable(rule), "default": None}
        if "messages" in properties:
            for turn in properties["messages"]["items"]["anyOf"]:
                _drop_media(turn["properties"]["content"], support)
    schema.pop("title", None)
    schema["description"] = (
        "Fields not listed pass through to the backend unchecked."
        if support.passthrough
        else f"The {support.backend} backend takes no field beyond these."
    )
    return schema


def _inline(node: Any, defs: dict[str, Any]) -> None:
    """Each `$ref` in `node` replaced by its definition (the schema is
    published inside another document, where `$defs` would not resolve)."""
    if isinstance(node, list):
        for item in node:
            _inline(item, defs)
    elif isinstance(node, dict):
        ref = node.pop("$ref", None)
        if ref is not None:
            node.update(defs[ref.rsplit("/", 1)[-1]])
            node.pop("title", None)
        for value in node.values():
            _inline(value, defs)


def _drop_media(content: dict[str, Any], support: RequestSupport) -> None:
    """Content parts of a media kind the backend cannot read, out of a
    message's content schema (they are refused by name)."""
    for form in content["anyOf"]:
        if "anyOf" in form:  # the nullable wrapper of an assistant's content
            _drop_media(form, support)
        elif form.get("type") == "array":
            parts = form["items"]["anyOf"]
            parts[:] = [
                part
                for part in parts
                if part["properties"]["type"]["const"] not in MEDIA
                or part["properties"]["type"]["const"] in support.features
            ]


def check_support(parsed: _Body, support: RequestSupport) -> None:
    """BadRequest naming the first field `support`'s backend cannot honour."""
    if support.passthrough:
        return
    for name in parsed.model_extra or ():
        raise BadRequest(
            f"Unrecognized request argument supplied: '{name[:100]}' "
            f"(not supported by the {support.backend} backend).",
            param=name[:100],
        )
    for param, feature in parsed.features():
        if feature not in support.features:
            raise BadRequest(
                f"'{param}' ({feature.replace('_', ' ')}) is not supported by the "
                f"{support.backend} backend.",
                param=param,
            )


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
# it exact (and validation then names the field): bodies that may hold one
# (LONG_NUMBER) take the slow path.


def parse_json(raw: bytes) -> Any:
    """The body as JSON, or BadRequest. Hostile input (invalid UTF-8, NaN,
    numbers with thousands of digits, nesting deep enough to exhaust the
    parser's recursion, escapes of unpaired surrogates) all land here as a
    400, never as a crash."""
    if not LONG_NUMBER.search(raw):
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
