"""Fuzzing of everything that reads client or operator input.

Each reader may accept its input or refuse it with the project's own typed
error; nothing else may come out of it, whatever the input:
- the request body (`parse_json`, `validate_body`): a GatewayError with a 4xx
  status and a message, whose `param` names a field the body has or lacks;
- the credentials (`KeyRing.identify`): Unauthorized or BadRequest;
- the policy file (`load_policy_text`): a ConfigError whose every problem is
  rendered with its field path;
- every sampling field, through the live gateway over each backend (the
  simulated GPU; the openai backend in front of an upstream that judges
  requests as vLLM does): a 200, or a 4xx in OpenAI's error shape whose
  `param` is a field the body holds.

The examples are derandomized, so a failure shows on every run, not one in
a hundred.
"""

from __future__ import annotations

import copy
import hashlib
import json
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import aiohttp
import pytest
import yaml
from http_support import (
    ALICE_KEY,
    BOB_KEY,
    ENV,
    MODEL,
    SECRET,
    Live,
    ScriptedBackend,
    live_app,
    make_policy,
    words,
)
from hypothesis import HealthCheck, event, example, given, settings
from hypothesis import strategies as st
from multidict import CIMultiDict
from upstream_support import BACKENDS, VOCAB_SIZE, live_backend

from qosgate.config.loader import ConfigError, load_policy_text
from qosgate.config.models import PolicyConfig
from qosgate.http.identity import Identity, KeyRing
from qosgate.http.validation import parse_json, validate_body
from qosgate.runtime.errors import BadRequest, GatewayError, Unauthorized

FUZZ = settings(
    max_examples=300,
    derandomize=True,
    deadline=None,
    database=None,
    suppress_health_check=[HealthCheck.too_slow],
)

# -- JSON values ----------------------------------------------------------------

json_scalars = (
    st.none()
    | st.booleans()
    | st.integers()
    | st.integers(min_value=-(10**30), max_value=10**30)
    | st.floats(allow_nan=False, allow_infinity=False)
    | st.text(max_size=20)
)


def _json_containers(children: st.SearchStrategy[Any]) -> st.SearchStrategy[Any]:
    return st.lists(children, max_size=4) | st.dictionaries(
        st.text(max_size=10), children, max_size=4
    )


json_values = st.recursive(json_scalars, _json_containers, max_leaves=12)

# Lone surrogates are valid JSON escapes but not Unicode: no UTF-8 encoder
# (a backend's, a log's) takes them.
surrogates = st.sampled_from(["\ud800", "\udbff", "\udc00", "\udfff", "\ud83d"])
strings_with_surrogates = st.builds(
    lambda a, s, b: a + s + b, st.text(max_size=5), surrogates, st.text(max_size=5)
)


def _check_refusal(exc: BaseException) -> GatewayError:
    """The one kind of refusal a reader of client input may raise."""
    assert isinstance(exc, GatewayError), f"{type(exc).__name__}: {exc}"
    assert 400 <= exc.status < 500, exc.status
    assert isinstance(exc.message, str) and exc.message.strip()
    # The body goes back to the client as JSON and into logs as UTF-8.
    json.dumps(exc.body(), ensure_ascii=False).encode("utf-8")
    return exc


def _re_encodable(value: Any) -> None:
    # What parse_json returns is what a backend is sent: it must encode again.
    json.dumps(value, ensure_ascii=False, allow_nan=False).encode("utf-8")


# -- parse_json -----------------------------------------------------------------


def _mutate_bytes(data: bytes, edits: list[tuple[int, int]]) -> bytes:
    buffer = bytearray(data)
    for position, byte in edits:
        if buffer:
            buffer[position % len(buffer)] = byte
    return bytes(buffer)


json_bytes = st.one_of(
    st.binary(max_size=200),
    json_values.map(lambda v: json.dumps(v).encode()),
    st.builds(
        _mutate_bytes,
        json_values.map(lambda v: json.dumps(v).encode()),
        st.lists(st.tuples(st.integers(0, 1000), st.integers(0, 255)), max_size=3),
    ),
    st.builds(
        lambda s: json.dumps({"model": MODEL, "prompt": s}).encode(),
        strings_with_surrogates | st.text(),
    ),
)


@FUZZ
@given(json_bytes)
@example(b'{"model": "m", "prompt": "\\ud800"}')
@example(b'{"\\udfff": 1}')
@example(b'["\\ud83d\\ude00 an emoji, as a pair: fine"]')
@example(b"[" * 5000 + b"]" * 5000)
@example(b'{"max_tokens": 1e999}')
@example(b"[NaN, -Infinity]")
@example(b"\xef\xbb\xbf{}")
@example(b"1" * 5000)
@example(b'"\\\\ud800 is an escaped backslash, not a surrogate"')
def test_parse_json_parses_or_refuses_any_bytes(raw: bytes) -> None:
    try:
        value = parse_json(raw)
    except Exception as exc:  # noqa: BLE001 - the property is about what may come out
        error = _check_refusal(exc)
        assert isinstance(error, BadRequest) and error.param is None
        event("refused")
        return
    event("parsed")
    _re_encodable(value)


@FUZZ
@given(json_values)
def test_parse_json_reads_back_what_json_writes(value: Any) -> None:
    for text in (json.dumps(value), json.dumps(value, ensure_ascii=False)):
        assert parse_json(text.encode()) == value


# -- validate_body ----------------------------------------------------------------

VALID = {
    "chat": {"model": MODEL, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 4},
    "completions": {"model": MODEL, "prompt": "hi", "max_tokens": 4},
}
REQUIRED = {"chat": {"model", "messages"}, "completions": {"model", "prompt"}}
FIELDS = [
    "model", "messages", "prompt", "stream", "stream_options", "max_tokens",
    "max_completion_tokens", "n", "temperature", "top_p", "priority", "user", "seed",
]  # fmt: skip


def _check_param_names_a_field(endpoint: str, body: Any, param: str | None) -> None:
    """`param` is a path into the body, except that its last part may be a
    field the body lacks (a missing required field)."""
    if param is None:
        return
    assert param, "an empty param"
    parts = param.split(".")
    node = body
    for index, part in enumerate(parts):
        last = index == len(parts) - 1
        if isinstance(node, dict):
            if part in node:
                node = node[part]
                continue
            assert last, f"param {param!r}: {part!r} is not in the body"
            return
        if isinstance(node, list):
            assert part.isdigit() and int(part) < len(node), f"param {param!r}: bad index {part}"
            node = node[int(part)]
            continue
        raise AssertionError(f"param {param!r} goes below a scalar at {part!r}")


def _validate(endpoint: str, body: Any) -> None:
    original = copy.deepcopy(body)
    try:
        validate_body(endpoint, body, [MODEL])  # type: ignore[arg-type]
    except Exception as exc:  # noqa: BLE001 - the property is about what may come out
        error = _check_refusal(exc)
        if not isinstance(original, dict):
            assert error.param is None
        _check_param_names_a_field(endpoint, original, error.param)
        event(f"refused, {'param' if error.param else 'no param'}")
        return
    event("accepted")
    assert isinstance(body, dict)
    assert REQUIRED[endpoint] <= set(body)
    for name in ("max_tokens", "max_completion_tokens", "n", "priority"):
        # Whatever the gateway took as an integer goes on as one.
        if endpoint == "chat" or name != "max_completion_tokens":
            assert body.get(name) is None or type(body[name]) is int, (name, body[name])


endpoints = st.sampled_from(["chat", "completions"])
# Objects with the fields the gateway reads, holding anything.
json_bodies = json_values | st.dictionaries(
    st.sampled_from(FIELDS) | st.text(max_size=6), json_values, max_size=6
)


@FUZZ
@given(endpoints, json_bodies)
@example("chat", {"model": MODEL, "messages": [{"role": [], "content": "x"}]})
@example("chat", {"model": MODEL, "messages": [{"role": {}, "content": "x"}]})
def test_validate_body_takes_or_refuses_any_json(endpoint: str, body: Any) -> None:
    # Any value parse_json can return: no lone surrogates (it refuses them).
    _validate(endpoint, body)


def _apply(body: dict[str, Any], edits: list[tuple[str, str, Any]]) -> dict[str, Any]:
    body = copy.deepcopy(body)
    for action, field, value in edits:
        if action == "drop":
            body.pop(field, None)
        elif action == "set":
            body[field] = value
        elif action == "message" and isinstance(body.get("messages"), list) and body["messages"]:
            message = body["messages"][0]
            if isinstance(message, dict):
                message[field] = value
    return body


edit = st.tuples(
    st.sampled_from(["drop", "set", "set", "message"]),
    st.sampled_from([*FIELDS, "role", "content", "text", "type"]) | st.text(max_size=6),
    json_values
    | st.sampled_from([MODEL, 1, 1.0, 0, -1, 2.5, 10**40, 1e300, "user", "assistant", None])
    | st.lists(st.fixed_dictionaries({"type": st.sampled_from(["text", "image_url"])}), max_size=2),
)


@FUZZ
@given(endpoints, st.lists(edit, min_size=1, max_size=4))
@example("chat", [("set", "n", 1.0), ("set", "max_completion_tokens", 3.0)])
@example("chat", [("message", "content", None)])
@example("chat", [("message", "role", "assistant"), ("message", "content", None)])
@example("completions", [("set", "prompt", ["a", "b"])])
@example("chat", [("set", "max_tokens", 1e300)])
def test_validate_body_names_the_field_of_a_broken_valid_body(
    endpoint: str, edits: list[tuple[str, str, Any]]
) -> None:
    _validate(endpoint, _apply(VALID[endpoint], edits))


# -- identity ---------------------------------------------------------------------

POLICY = make_policy()
RINGS = {
    "strict": KeyRing.from_policy(POLICY, ENV),
    # Requests without credentials get a tier instead of 401.
    "default tier": KeyRing.from_policy(POLICY.model_copy(update={"default_tier": "batch"}), ENV),
}
# Header values reach the app decoded as latin-1: any of its 256 characters.
header_text = st.text(st.characters(max_codepoint=255), max_size=40) | st.text(max_size=40)
credential = st.one_of(
    header_text,
    st.sampled_from([ALICE_KEY, BOB_KEY, SECRET, "alice", "bob", ""]),
    st.builds(
        lambda scheme, pad, key: f"{scheme}{pad}{key}",
        st.sampled_from(["Bearer ", "bearer ", "BEARER  ", "Basic ", "Bearer", " Bearer "]),
        st.sampled_from(["", " ", "\t"]),
        st.sampled_from(
            [ALICE_KEY, BOB_KEY, "sha256:" + hashlib.sha256(ALICE_KEY.encode()).hexdigest()]
        )
        | header_text,
    ),
)
header_names = st.sampled_from(
    ["Authorization", "authorization", "X-Tenant-Id", "x-tenant-id", "X-Gateway-Secret", "X-Other"]
)


@FUZZ
@given(st.sampled_from(sorted(RINGS)), st.lists(st.tuples(header_names, credential), max_size=4))
@example("strict", [("X-Tenant-Id", "alice"), ("X-Gateway-Secret", SECRET)])
@example("strict", [("X-Tenant-Id", "../etc"), ("X-Gateway-Secret", SECRET)])
@example("strict", [("Authorization", "Bearer " + ALICE_KEY + " ")])
@example("default tier", [("X-Tenant-Id", "ünïcödé"), ("X-Gateway-Secret", SECRET)])
def test_identify_answers_any_headers_with_an_identity_or_401_400(
    ring: str, headers: list[tuple[str, str]]
) -> None:
    try:
        identity = RINGS[ring].identify(CIMultiDict(headers))
    except (Unauthorized, BadRequest) as exc:
        _check_refusal(exc)
        if isinstance(exc, BadRequest):
            assert exc.param == "X-Tenant-Id"
        event(type(exc).__name__)
        return
    event("identified")
    assert isinstance(identity, Identity)
    assert identity.tier in POLICY.tiers
    authorization = CIMultiDict(headers).get("Authorization")
    if CIMultiDict(headers).get("X-Tenant-Id") is None and authorization is not None:
        # A key names its own tenant and nobody else's.
        assert identity.tenant == {ALICE_KEY: "alice", BOB_KEY: "bob"}[authorization.split()[1]]


# -- the policy loader --------------------------------------------------------------

EXAMPLE = Path(__file__).resolve().parent.parent / "policies" / "example.yaml"
EXAMPLE_TEXT = EXAMPLE.read_text()
EXAMPLE_DATA = yaml.safe_load(EXAMPLE_TEXT)


def _splice(text: str, edits: list[tuple[int, int, str]]) -> str:
    for position, cut, insert in edits:
        position %= len(text) + 1
        text = text[:position] + insert + text[position + cut :]
    return text


# The example policy's text with a few spans cut or replaced: broken
# indentation, truncated lines, stray characters in a realistic document.
spliced_example = st.builds(
    _splice,
    st.just(EXAMPLE_TEXT),
    st.lists(
        st.tuples(
            st.integers(0, len(EXAMPLE_TEXT)),
            st.integers(0, 40),
            st.text(max_size=4)
            | st.sampled_from([":", "- ", "  ", "\n", "{", "[", "&a ", "*a", "!!"]),
        ),
        min_size=1,
        max_size=3,
    ),
)

yaml_scalars = (
    st.none()
    | st.booleans()
    | st.integers(-(10**6), 10**12)
    | st.floats(allow_nan=True, allow_infinity=True)
    | st.text(max_size=12)
    | st.sampled_from(
        ["interactive", "batch", "standard", "sim", "redis", "sha256:" + "0" * 64, "-1", "1e3"]
    )
)
yaml_values = st.recursive(
    yaml_scalars,
    lambda children: (
        st.lists(children, max_size=3)
        | st.dictionaries(
            st.text(max_size=8) | st.sampled_from(["priority", "tier", "id"]), children, max_size=3
        )
    ),
    max_leaves=8,
)


def _paths(node: Any, prefix: tuple[Any, ...] = ()) -> list[tuple[Any, ...]]:
    found = [prefix]
    if isinstance(node, dict):
        for key, value in node.items():
            found += _paths(value, (*prefix, key))
    elif isinstance(node, list):
        for index, value in enumerate(node):
            found += _paths(value, (*prefix, index))
    return found


EXAMPLE_PATHS = _paths(EXAMPLE_DATA)


def _mutate(data: Any, mutations: list[tuple[str, int, Any, str]]) -> Any:
    data = copy.deepcopy(data)
    for action, which, value, key in mutations:
        paths = _paths(data)
        path = paths[which % len(paths)]
        if not path:
            if action == "add" and isinstance(data, dict):
                data[key] = value
            continue
        parent = data
        for part in path[:-1]:
            parent = parent[part]
        last = path[-1]
        if action == "delete":
            del parent[last]
        elif action == "replace":
            parent[last] = value
        elif action == "add" and isinstance(parent[last], dict):
            parent[last][key] = value
    return data


mutation = st.tuples(
    st.sampled_from(["delete", "replace", "replace", "add"]),
    st.integers(0, len(EXAMPLE_PATHS) * 2),
    yaml_values,
    st.text(min_size=1, max_size=10) | st.sampled_from(["unknown_key", "prioritty", "tier"]),
)


def _load(text: str) -> ConfigError | None:
    """None if the text loads, else its ConfigError, checked to say what and where."""
    try:
        load_policy_text(text, "fuzz.yaml")
    except ConfigError as exc:
        assert exc.issues, "a ConfigError without issues"
        for issue in exc.issues:
            assert issue.message.strip(), issue
            assert issue.render("fuzz.yaml") in str(exc)
        event("refused")
        return exc
    event("loaded")
    return None


@FUZZ
@given(st.text(max_size=300) | spliced_example)
@example("")
@example("- a\n- b\n")
@example("version: 1\nversion: 2\n")
@example("a: &x [*x]\n")
@example("tiers: !!timestamp 2001-02-30\n")
@example("x: " + "[" * 2000 + "]" * 2000)
@example("\ufeffversion: 1\n")
@example("tiers:\n  \x85: 1\n")
def test_loader_loads_or_explains_any_text(text: str) -> None:
    _load(text)


@FUZZ
@given(st.lists(mutation, min_size=1, max_size=3))
def test_loader_names_the_field_of_a_broken_example_policy(
    mutations: list[tuple[str, int, Any, str]],
) -> None:
    data = _mutate(EXAMPLE_DATA, mutations)
    try:
        text = yaml.safe_dump(data, allow_unicode=True)
    except (yaml.YAMLError, ValueError):
        return
    error = _load(text)
    if error is not None:
        # The document is a mapping, so every problem lies at some field.
        for issue in error.issues:
            assert issue.path, f"an issue that names no field: {issue}"
            assert issue.line is not None, issue


@FUZZ
@given(st.sampled_from([p for p in EXAMPLE_PATHS if p]), st.text(min_size=1, max_size=10))
def test_loader_names_an_unknown_key_where_it_was_added(path: tuple[Any, ...], key: str) -> None:
    data = copy.deepcopy(EXAMPLE_DATA)
    node = data
    for part in path:
        node = node[part]
    if not isinstance(node, dict) or key in node or not key.strip():
        return
    node[key] = {"unexpected": True}
    text = yaml.safe_dump(data, allow_unicode=True)
    if yaml.safe_load(text) != data:
        return  # PyYAML wrote a key it reads back otherwise (a NEL becomes a space)
    try:
        load_policy_text(text, "fuzz.yaml")
    except ConfigError as exc:
        where = ".".join(str(part) for part in (*path, key))
        assert any(issue.path.startswith(where) for issue in exc.issues), (where, str(exc))
        event("refused")
        return
    # Only a free-form mapping (tiers by name) can take a new key whole.
    raise AssertionError(f"unknown key {key!r} at {path} was accepted")


def test_example_policy_loads() -> None:
    # The mutations above start from a valid policy, or they test nothing.
    assert isinstance(load_policy_text(EXAMPLE.read_text()), PolicyConfig)
    assert len(EXAMPLE_PATHS) > 50


async def test_lone_surrogate_is_a_400_not_a_500() -> None:
    """Regression (found by the fuzzing above): a model name holding a lone
    surrogate escape reached the reply's encoder, where the backend lists no
    models to refuse it by, and the request failed with 500."""
    body = b'{"model": "m\\ud800", "messages": [{"role": "user", "content": "hi"}]}'
    async with (
        live_app(backend=ScriptedBackend(words, models=())) as live,
        aiohttp.ClientSession() as http,
        http.post(
            live.url + "/v1/chat/completions",
            data=body,
            headers={"Authorization": f"Bearer {ALICE_KEY}", "Content-Type": "application/json"},
        ) as response,
    ):
        assert response.status == 400, await response.text()
        assert "surrogate" in (await response.json())["error"]["message"]
    assert live.gateway.streams == []


# -- every sampling field, through the live gateway over each backend ----------------------

HTTP_FUZZ = settings(
    FUZZ,
    max_examples=300,
    # One live server serves every example (a server per example would be
    # most of the run); the fixture is function-scoped for its event loop.
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.function_scoped_fixture],
)
junk = st.one_of(
    json_values,
    st.sampled_from(
        [None, True, False, 10**30, -(10**30), 2**63, 2**31, -1, 0, 1, 0.5, 1e308, -1e-308,
         "NaN", "Infinity", "1", "", "true", [], {}, [None], {"": None}, [[1]], {"a": {"b": []}}]
    ),
)  # fmt: skip
_WORDS = ["", "x", "\n", "stop", "\u00e9\u4e2d"]
_FUNCTION = {"type": "function", "function": {"name": "f", "parameters": {"type": "object"}}}
SAMPLING: dict[str, list[Any]] = {
    "temperature": [0, 0.0, 1, 2, 2.0001, -0.01, 1e-9],
    "top_p": [0, 1e-9, 0.5, 1, 1.0001, -0.0],
    "top_k": [-2, -1, 0, 1, 40, VOCAB_SIZE, VOCAB_SIZE + 1, 2**31 - 1, 2**31],
    "min_p": [0, 0.5, 1, 1.01, -0.01],
    "seed": [0, -1, 2**63 - 1, 2**63, -(2**63), -(2**63) - 1, 7.0],
    "presence_penalty": [-2, 2, 0, 2.01, -2.01],
    "frequency_penalty": [-2, 2, 0, 2.01, -2.01],
    "repetition_penalty": [0, 0.009, 0.01, 1, 10, 10.01],
    "min_tokens": [0, 1, 2, 16, 17, 2**31 - 1, 2**31, -1],
    "max_tokens": [1, 2, 16, 17, 4.0, 0, -1, 10**12, 2**31],
    "max_completion_tokens": [1, 2, 16, 17, 0, -1, 10**12],
    "n": [1, 1.0, 2, 0],
    "best_of": [1, 2, 0],
    "stop": [*_WORDS, [], ["a"], ["a", "b", "c", "d"], ["a", "b", "c", "d", "e"], [1], [None]],
    "stop_token_ids": [[], [0], [VOCAB_SIZE], [2**31 - 1], [2**31], [-1], list(range(65))],
    "logit_bias": [{}, {"5": 100}, {"5": -100.0}, {"5": 100.1}, {"x": 1}, {"5": "1"},
                   {str(VOCAB_SIZE): 1}, {"1" * 10: 1}],  # fmt: skip
    "logprobs": [True, False, 0, 1, 5, 6, 20, 21, -1],
    "top_logprobs": [0, 1, 20, 21, -1],
    "echo": [True, False],
    "suffix": ["", "x"],
    "response_format": [
        {"type": "text"}, {"type": "json_object"}, {"type": "yaml"}, {},
        {"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "object"}}},
        {"type": "json_schema"}, {"type": "json_schema", "json_schema": {"name": "bad name"}},
    ],  # fmt: skip
    "tools": [[], [_FUNCTION], [{"type": "function"}], [{"type": "function", "function": {}}],
              [_FUNCTION] * 129],  # fmt: skip
    "tool_choice": ["none", "auto", "required", "any", {"type": "function"},
                    {"type": "function", "function": {"name": "f"}},
                    {"type": "function", "function": {"name": "g"}}],  # fmt: skip
    "parallel_tool_calls": [True, False],
    "stream": [True, False],
    "stream_options": [{"include_usage": True}, {"include_usage": False},
                       {"continuous_usage_stats": True}, {"include_usage": "yes"}, {}],  # fmt: skip
    "user": ["u-1", ""],
    "metadata": [{}, {"k": "v"}, {"k": 1}, {"k" * 65: "v"}, {str(i): "v" for i in range(17)}],
    "store": [True, False],
    "service_tier": ["auto", "default"],
    "priority": [0, 1, 1000, 10**9, -1],
    "ignore_eos": [True, False],
    "skip_special_tokens": [True, False],
    "spaces_between_special_tokens": [True, False],
    "include_stop_str_in_output": [True, False],
}


# A field and its value: mostly one the field has a meaning for (valid, at a
# bound, just past one), else anything at all. A body holds several, and one
# wrong value refuses it: with junk as likely as the rest, few were served.
sampling_field = st.one_of(
    [
        st.tuples(st.just(name), st.sampled_from(values) | st.sampled_from(values) | junk)
        for name, values in SAMPLING.items()
    ]
)
sampling_bodies = st.tuples(endpoints, st.lists(sampling_field, min_size=1, max_size=4)).map(
    lambda drawn: (drawn[0], {**VALID[drawn[0]], **dict(drawn[1])})
)


@pytest.fixture(params=BACKENDS)
async def fuzzed(
    request: pytest.FixtureRequest,
) -> AsyncIterator[tuple[Live, aiohttp.ClientSession]]:
    async with (
        live_backend(request.param) as (live, _),
        aiohttp.ClientSession(headers={"Authorization": f"Bearer {ALICE_KEY}"}) as http,
    ):
        yield live, http
        # What the examples did leaves the gateway serving, and saying so.
        async with http.post(live.url + "/v1/completions", json=VALID["completions"]) as response:
            assert response.status == 200, await response.text()
        async with http.get(live.url + "/readyz") as response:
            assert response.status == 200, await response.text()


def _check_answer(body: dict[str, Any], status: int, content_type: str, raw: bytes) -> None:
    assert status == 200 or 400 <= status < 500, (status, raw[:300])
    if status == 200:
        if content_type == "text/event-stream":
            events = [line[6:] for line in raw.decode().split("\n") if line.startswith("data: ")]
            assert events[-1] == "[DONE]", raw[-300:]
            for data in events[:-1]:
                assert "error" not in json.loads(data), data
        else:
            assert json.loads(raw)["choices"], raw[:300]
        event("200")
        return
    error = json.loads(raw)["error"]
    assert set(error) == {"message", "type", "code", "param"}, error
    assert isinstance(error["message"], str) and error["message"].strip(), error
    if status == 400 and error["param"] is not None:
        # Every body here has its required fields: what a 400 names, it holds.
        assert str(error["param"]).split(".")[0] in body, (error["param"], body)
    event(f"{status} {error['param']}")


@HTTP_FUZZ
@given(sampling_bodies)
@example(("chat", {**VALID["chat"], "top_p": 0}))
@example(("chat", {**VALID["chat"], "max_tokens": 100, "min_tokens": 50}))
@example(("chat", {**VALID["chat"], "logprobs": True, "top_logprobs": 1, "stream": True}))
@example(("chat", {**VALID["chat"], "tools": [_FUNCTION], "tool_choice": "required"}))
@example(("completions", {**VALID["completions"], "logprobs": 1, "echo": True}))
async def test_every_sampling_field_gets_200_or_a_4xx_in_openais_shape(
    fuzzed: tuple[Live, aiohttp.ClientSession], drawn: tuple[str, dict[str, Any]]
) -> None:
    live, http = fuzzed
    endpoint, body = drawn
    path = "/v1/chat/completions" if endpoint == "chat" else "/v1/completions"
    async with http.post(live.url + path, json=body) as response:
        _check_answer(body, response.status, response.content_type, await response.read())
