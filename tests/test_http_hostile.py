"""A corpus of malformed and hostile requests against one live server, over
each backend: the simulated GPU, and the openai backend in front of an
upstream that judges requests as vLLM does (upstream_support.VllmUpstream).

Each gets its exact status (a 4xx in OpenAI's error shape, never a 5xx), and
the server keeps serving: the corpus runs in one test against one server, and
after it a valid request still completes and /readyz says ready. Where the
backends differ (the sim refuses by name what it cannot honour, the openai
backend passes it on for its upstream to judge), the case says so.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from typing import Any

import aiohttp
import pytest
from http_support import ALICE_KEY, MAX_BODY, MODEL, SECRET, live_app
from upstream_support import BACKENDS, VOCAB_SIZE, live_backend

AUTH = {"Authorization": f"Bearer {ALICE_KEY}"}
JSON = {"Content-Type": "application/json"}
MSGS = [{"role": "user", "content": "hi"}]
CHAT = "/v1/chat/completions"
COMP = "/v1/completions"


def chat(**fields: Any) -> dict[str, Any]:
    body: dict[str, Any] = {"model": MODEL, "messages": MSGS, "max_tokens": 2}
    body.update(fields)
    return {k: v for k, v in body.items() if v is not DROP}


def comp(**fields: Any) -> dict[str, Any]:
    body: dict[str, Any] = {"model": MODEL, "prompt": "hi", "max_tokens": 2}
    body.update(fields)
    return {k: v for k, v in body.items() if v is not DROP}


DROP = object()
"""A field value meaning: leave the field out."""


@dataclass
class Case:
    name: str
    status: int
    body: Any = None
    """dict/list -> JSON; bytes -> sent as is; None -> no body."""
    path: str = CHAT
    method: str = "POST"
    headers: dict[str, str] = field(default_factory=lambda: {**AUTH, **JSON})
    param: str | None = None
    code: str | None = None
    upstream: int | None = None
    """Under the openai backend, which refuses nothing by name, the request
    goes on to the upstream, and this is the status its answer makes."""
    upstream_param: str | None = None
    vllm: int | None = None
    """Under the in-process vllm backend (make test-vllm), where it differs:
    the engine honours more than the sim, and refuses what vLLM refuses."""
    vllm_param: str | None = None

    def expected(self, backend: str) -> tuple[int, str | None, str | None]:
        """(status, param, code) under `backend`."""
        if backend == "openai" and self.upstream is not None:
            return self.upstream, self.upstream_param, None
        if backend == "vllm" and self.vllm is not None:
            return self.vllm, self.vllm_param, None
        return self.status, self.param, self.code

    def reaches_backend(self, backend: str) -> bool:
        return self.status == 200 or (backend == "openai" and self.upstream is not None)


def no_auth(**extra: str) -> dict[str, str]:
    return {**JSON, **extra}


CASES = [
    # -- identity ---------------------------------------------------------
    Case("no key", 401, chat(), headers=no_auth(), code="invalid_api_key"),
    Case("wrong key", 401, chat(), headers=no_auth(Authorization="Bearer sk-not-a-key")),
    Case("basic auth", 401, chat(), headers=no_auth(Authorization="Basic YWxpY2U6cHc=")),
    Case("empty bearer", 401, chat(), headers=no_auth(Authorization="Bearer ")),
    Case(
        "key hash instead of key",
        401,
        chat(),
        headers=no_auth(Authorization="Bearer sha256:" + "0" * 64),
    ),
    Case("non-ascii key", 401, chat(), headers=no_auth(Authorization="Bearer clé-ÿ")),
    Case("forged tenant header", 401, chat(), headers=no_auth(**{"X-Tenant-Id": "alice"})),
    Case(
        "forged tenant header beside a valid key",
        401,
        chat(),
        headers={**AUTH, **JSON, "X-Tenant-Id": "bob"},
    ),
    Case(
        "tenant header, wrong secret",
        401,
        chat(),
        headers=no_auth(**{"X-Tenant-Id": "alice", "X-Gateway-Secret": "guess"}),
    ),
    Case(
        "tenant header, non-ascii secret",
        401,
        chat(),
        headers=no_auth(**{"X-Tenant-Id": "alice", "X-Gateway-Secret": "sécret"}),
    ),
    Case(
        "tenant header, unknown tenant, no default tier",
        401,
        chat(),
        headers=no_auth(**{"X-Tenant-Id": "mallory", "X-Gateway-Secret": SECRET}),
    ),
    Case(
        "tenant header, malformed tenant id",
        400,
        chat(),
        param="X-Tenant-Id",
        headers=no_auth(**{"X-Tenant-Id": "../admin x", "X-Gateway-Secret": SECRET}),
    ),
    Case("models without key", 401, None, path="/v1/models", method="GET", headers={}),
    # -- the body as bytes --------------------------------------------------
    Case("empty body", 400, b""),
    Case("truncated JSON", 400, b'{"model": "x", "messages": ['),
    Case("not JSON at all", 400, b"model=x&messages=hi"),
    Case("JSON null", 400, b"null"),
    Case("JSON array", 400, b"[]"),
    Case("JSON string", 400, b'"hello"'),
    Case(
        "NaN temperature",
        400,
        b'{"model": "%s", "messages": [], "temperature": NaN}' % MODEL.encode(),
    ),
    Case(
        "infinite number",
        400,
        json.dumps(chat()).replace('"max_tokens": 2', '"max_tokens": 1e999').encode(),
    ),
    Case("invalid UTF-8", 400, b'{"model": "\xff\xfe", "messages": []}'),
    Case("nesting bomb", 400, b"[" * 30_000 + b"]" * 30_000),
    Case("5000-digit number", 400, b'{"max_tokens": ' + b"9" * 5000 + b"}"),
    Case("text/plain", 415, chat(), headers={**AUTH, "Content-Type": "text/plain"}),
    Case(
        "form-encoded",
        415,
        chat(),
        headers={**AUTH, "Content-Type": "application/x-www-form-urlencoded"},
    ),
    Case(
        "oversized body",
        413,
        chat(messages=[{"role": "user", "content": "x" * (MAX_BODY + 1)}]),
        code="request_too_large",
    ),
    # -- fields ----------------------------------------------------------------
    Case("missing model", 400, chat(model=DROP), param="model"),
    Case("model is a number", 400, chat(model=42), param="model"),
    Case("empty model", 400, chat(model=""), param="model"),
    Case("unknown model", 404, chat(model="gpt-4o"), param="model", code="model_not_found"),
    Case("model with markup", 404, chat(model='"}<script>'), param="model", code="model_not_found"),
    Case("missing messages", 400, chat(messages=DROP), param="messages"),
    Case("empty messages", 400, chat(messages=[]), param="messages"),
    Case("messages is a string", 400, chat(messages="hi"), param="messages"),
    Case("message is a string", 400, chat(messages=["hi"]), param="messages.0"),
    Case(
        "unknown role",
        400,
        chat(messages=[{"role": "root", "content": "hi"}]),
        param="messages.0.role",
    ),
    Case("missing role", 400, chat(messages=[{"content": "hi"}]), param="messages.0.role"),
    Case(
        "user without content", 400, chat(messages=[{"role": "user"}]), param="messages.0.content"
    ),
    Case(
        "content is a number",
        400,
        chat(messages=[{"role": "user", "content": 42}]),
        param="messages.0.content",
    ),
    Case(
        "text part without text",
        400,
        chat(messages=[MSGS[0], {"role": "user", "content": [{"type": "text", "text": 5}]}]),
        param="messages.1.content",
    ),
    Case("max_tokens 0", 400, chat(max_tokens=0), param="max_tokens"),
    Case("max_tokens negative", 400, chat(max_tokens=-100), param="max_tokens"),
    Case("max_tokens string", 400, chat(max_tokens="10"), param="max_tokens"),
    Case("max_tokens float", 400, chat(max_tokens=1.5), param="max_tokens"),
    Case("max_tokens bool", 400, chat(max_tokens=True), param="max_tokens"),
    Case(
        "max_completion_tokens negative",
        400,
        chat(max_completion_tokens=-1),
        param="max_completion_tokens",
    ),
    Case("n=2", 400, chat(n=2), param="n"),
    Case("n=0", 400, chat(n=0), param="n"),
    Case("stream as string", 400, chat(stream="yes"), param="stream"),
    Case(
        "stream_options not an object",
        400,
        chat(stream=True, stream_options="all"),
        param="stream_options",
    ),
    Case("temperature 3", 400, chat(temperature=3), param="temperature"),
    Case("temperature negative", 400, chat(temperature=-0.5), param="temperature"),
    Case("top_p 1.5", 400, chat(top_p=1.5), param="top_p"),
    Case("priority negative", 400, chat(priority=-1), param="priority"),
    Case("priority string", 400, chat(priority="high"), param="priority"),
    Case("completion without prompt", 400, comp(prompt=DROP), path=COMP, param="prompt"),
    Case("empty prompt list", 400, comp(prompt=[]), path=COMP, param="prompt"),
    Case("prompt is a number", 400, comp(prompt=42), path=COMP, param="prompt"),
    Case("prompt of a negative token id", 400, comp(prompt=[1, -2]), path=COMP, param="prompt"),
    Case("prompt of mixed ids", 400, comp(prompt=[1, "a"]), path=COMP, param="prompt"),
    # Past the model's context, as OpenAI answers (the sim's model has 128k).
    # The openai backend knows no context length: the tier's cap clamps the
    # ask before the upstream sees it.
    Case("max_tokens 1e12", 400, chat(max_tokens=10**12), param="max_tokens",
         code="context_length_exceeded", upstream=200),
    Case("max_tokens 1e300", 400, chat(max_tokens=10**300), param="max_tokens",
         code="context_length_exceeded", upstream=200),
    Case("max_completion_tokens past the context", 400,
         chat(max_tokens=DROP, max_completion_tokens=131_073), param="max_completion_tokens",
         code="context_length_exceeded", upstream=200),
    # What the simulated GPU cannot honour is refused by name, never dropped;
    # the openai backend's upstream honours it, or refuses it itself.
    Case("unknown field", 400, chat(unknown_field={"nested": [1]}), param="unknown_field",
         upstream=200),
    Case("image part", 400, chat(messages=[
        {"role": "user", "content": [{"type": "image_url", "image_url": {"url": "x"}}]}
    ]), param="messages.0.content.0", upstream=400),
    Case("tools", 400, chat(tools=[{"type": "function", "function": {"name": "f"}}],
                            tool_choice="required"), param="tools", upstream=200),
    Case("tool_choice without tools", 400, chat(tool_choice="required"), param="tool_choice",
         upstream=400),
    Case("json schema output", 400, chat(response_format={
        "type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "object"}}}),
        param="response_format", upstream=200, vllm=200),
    Case("chat logprobs", 400, chat(logprobs=True, top_logprobs=2), param="logprobs",
         upstream=200, vllm=200),
    Case("top_logprobs without logprobs", 400, chat(top_logprobs=2), param="top_logprobs",
         upstream=400, upstream_param="top_logprobs"),
    Case("completion logprobs", 400, comp(logprobs=1), path=COMP, param="logprobs",
         upstream=200, vllm=200),
    Case("echo", 400, comp(echo=True), path=COMP, param="echo", upstream=200),
    Case("suffix", 400, comp(suffix="x"), path=COMP, param="suffix", upstream=400),
    # Valid to OpenAI's model, which the simulated GPU serves; vLLM refuses them.
    Case("top_p 0", 200, chat(top_p=0), upstream=400, upstream_param="top_p", vllm=400,
         vllm_param="top_p"),
    Case("top_k past the vocabulary", 200, chat(top_k=VOCAB_SIZE + 1), upstream=400,
         upstream_param="top_k"),
    Case("logit_bias past the vocabulary", 200, chat(logit_bias={str(VOCAB_SIZE): 5}),
         upstream=400, upstream_param="logit_bias", vllm=400, vllm_param="logit_bias"),
    Case("min_tokens over max_tokens", 200, chat(min_tokens=3), upstream=400,
         upstream_param="min_tokens", vllm=400, vllm_param="min_tokens"),
    Case("prompt id past the vocabulary", 200, comp(prompt=[1, VOCAB_SIZE]), path=COMP,
         upstream=400, vllm=400, vllm_param="prompt"),
    # Where nothing types it, JSON allows any integer; it goes on as sent.
    Case("30-digit integer in a message's extra key", 200,
         chat(messages=[{"role": "user", "content": "hi", "x": 10**30}])),
    Case("several prompts", 400, comp(prompt=["a", "b"]), path=COMP, param="prompt"),
    Case(
        "completion, max_tokens negative", 400, comp(max_tokens=-1), path=COMP, param="max_tokens"
    ),
    # -- routes and methods ------------------------------------------------------
    Case("GET on chat", 405, None, method="GET", code="method_not_allowed"),
    Case("PUT on completions", 405, comp(), path=COMP, method="PUT", code="method_not_allowed"),
    Case("DELETE on healthz", 405, None, path="/healthz", method="DELETE"),
    Case("unknown endpoint", 404, chat(), path="/v1/embeddings", code="not_found"),
    Case("path traversal", 404, None, path="/v1/../../etc/passwd", method="GET"),
    Case("admin probe", 404, None, path="/admin/config", method="GET"),
]


def test_corpus_is_large_enough() -> None:
    assert len(CASES) >= 40
    assert len({case.name for case in CASES}) == len(CASES)


async def _send(http: aiohttp.ClientSession, base: str, case: Case) -> aiohttp.ClientResponse:
    if case.body is None:
        data = None
    elif isinstance(case.body, bytes):
        data = case.body
    else:
        data = json.dumps(case.body).encode()
    return await http.request(case.method, base + case.path, data=data, headers=case.headers)


def _check(case: Case, backend: str, status: int, raw: bytes, headers: Any) -> str | None:
    """What is wrong with the answer to `case`, if anything."""
    want, param, code = case.expected(backend)
    try:
        body = json.loads(raw)
    except ValueError:
        return f"{status}, not JSON: {raw[:80]!r}"
    if status != want:
        return f"status {status}, want {want}: {raw[:200]!r}"
    if "x-request-id" not in headers:
        return "no x-request-id"
    if status == 200:
        return None if "choices" in body else f"not a completion: {raw[:200]!r}"
    error = body.get("error") if isinstance(body, dict) else None
    if not isinstance(error, dict) or set(error) != {"message", "type", "code", "param"}:
        return f"not OpenAI's error shape: {raw[:200]!r}"
    if not isinstance(error["message"], str) or not error["message"]:
        return "empty message"
    if param is not None and error["param"] != param:
        return f"param {error['param']!r}, want {param!r}"
    if code is not None and error["code"] != code:
        return f"code {error['code']!r}, want {code!r}"
    if "Retry-After" in headers:
        return "a client error must not invite a retry"
    if status == 405 and not headers.get("Allow"):
        return "405 without Allow"
    return None


@pytest.mark.parametrize("backend", BACKENDS)
async def test_hostile_corpus_gets_exact_4xx_and_server_keeps_serving(backend: str) -> None:
    failures: list[str] = []
    async with (
        live_backend(backend) as (live, upstream),
        aiohttp.ClientSession(skip_auto_headers={"Content-Type"}) as http,
    ):
        for case in CASES:
            async with await _send(http, live.url, case) as response:
                raw = await response.read()
                problem = _check(case, backend, response.status, raw, response.headers)
            if problem is not None:
                failures.append(f"{case.name}: {problem}")

        # The rest were refused at the door, none reached the backend.
        reached = sum(case.reaches_backend(backend) for case in CASES)
        assert len(live.gateway.streams) == reached
        if upstream is not None:
            assert len(upstream.requests) == reached

        async with http.post(
            live.url + CHAT, data=json.dumps(chat()).encode(), headers={**AUTH, **JSON}
        ) as response:
            assert response.status == 200, await response.text()
            reply = await response.json()
        assert reply["usage"]["completion_tokens"] == 2
        async with http.get(live.url + "/readyz") as response:
            assert response.status == 200, await response.text()
    assert not failures, "\n".join(failures)


@pytest.mark.parametrize(
    "body",
    [
        chat(max_tokens=100_000),  # within the context: clamped to the tier cap, not refused
        chat(priority=10**9),  # as low as it goes
        chat(user="u-1", seed=7, metadata={"k": "v"}, store=False, logit_bias={"5": -100}),
        chat(
            messages=[
                {"role": "assistant", "content": None, "tool_calls": []},
                {"role": "tool", "content": "42", "tool_call_id": "t1"},
                {"role": "developer", "content": [{"type": "text", "text": "be brief"}]},
            ]
        ),
        chat(temperature=0, top_p=1, n=1, stream=False),
        # Values that ask for nothing the backend lacks.
        chat(logprobs=False, tool_choice="none", response_format={"type": "text"}),
        # The tier's cap lowers max_tokens below it: min_tokens comes down too,
        # or an upstream that checks the two (vLLM) refuses what the client
        # did not ask.
        chat(max_tokens=100, min_tokens=50),
    ],
    ids=[
        "max_tokens 1e5",
        "priority 1e9",
        "informational fields",
        "roles and parts",
        "edge values",
        "no-op values",
        "min_tokens past the tier's cap",
    ],
)
@pytest.mark.parametrize("backend", BACKENDS)
async def test_odd_but_valid_requests_succeed(backend: str, body: dict[str, Any]) -> None:
    async with live_backend(backend) as (live, _), aiohttp.ClientSession() as http:
        async with http.post(live.url + CHAT, json=body, headers=AUTH) as response:
            assert response.status == 200, await response.text()
            reply = await response.json()
        assert reply["usage"]["completion_tokens"] <= live.policy.tiers["interactive"].max_tokens


@pytest.mark.parametrize("prompt", [[5, 6, 7], [[5, 6, 7]]], ids=["ids", "one list of ids"])
async def test_token_id_prompts_are_served_and_counted_by_their_ids(prompt: list[Any]) -> None:
    async with live_app() as live, aiohttp.ClientSession() as http:
        async with http.post(live.url + COMP, json=comp(prompt=prompt), headers=AUTH) as response:
            assert response.status == 200, await response.text()
            reply = await response.json()
    assert reply["usage"]["prompt_tokens"] == 3
