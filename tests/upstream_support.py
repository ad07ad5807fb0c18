"""OpenAI-compatible upstreams on loopback ports, for the openai backend's tests.

`FakeUpstream` speaks the OpenAI protocol, streamed and whole, and does what
its test sets (hold, drop the connection, answer an error status). Its text
starts with its own name, so a test can tell which upstream served a request
from the client side alone.

`VllmUpstream` judges requests as vLLM's OpenAI-compatible server does: what
vLLM refuses (SamplingParams' ranges, its protocol's cross-field rules, token
ids past the vocabulary, a text-only model's image parts) it refuses with
vLLM's 400. `live_backend` runs the whole gateway over either backend the
hostile-input tests cover: the simulated GPU, or the openai backend in front
of a `VllmUpstream`.
"""

from __future__ import annotations

import asyncio
import collections
import contextlib
import json
from collections.abc import AsyncIterator, Callable
from typing import Any

import yaml
from aiohttp import web
from http_support import MODEL, POLICY_YAML, Live, live_app, make_policy

BACKENDS = ("sim", "openai")
"""The backends the hostile-input tests run against (`live_backend`'s kinds)."""


class FakeUpstream:
    """An OpenAI-compatible server that answers every request with its `pieces`,
    or as its `mode` and attributes say. Subclasses judge and answer each
    request by its body (`refusal`, `pieces_for`, `script_for`,
    `whole_choice_for`)."""

    def __init__(self, name: str, models: tuple[str, ...] = ("m",)) -> None:
        self.name = name
        self.models = list(models)
        # ok | hold (stop after the first delta until `release`) | kill (drop
        # the connection after the first delta) | hangup (drop it before
        # answering) | status | malformed
        self.mode = "ok"
        self.hangups = 0
        """Requests to hang up on before answering again, whatever the mode."""
        self.send_usage = True
        self.prompt_tokens = 5
        """The prompt tokens its usage reports."""
        self.completion_tokens: int | None = None  # None: one per delta
        self.tokens_per_delta_usage: int | None = None  # vLLM's continuous usage stats
        self.delta_extra: dict[str, Any] = {}
        self.script: list[dict[str, Any]] | None = None
        """Streamed choices sent instead of the pieces, the finishing one included."""
        self.whole_choice: dict[str, Any] | None = None
        """The whole answer's choice, instead of one made of the pieces."""
        self.status = 500
        self.status_headers: dict[str, str] = {}
        self.status_body: Any = {"error": {"message": "boom", "type": "server_error"}}
        self.answer_headers: dict[str, str] = {}
        """Sent with every whole (non-streamed) answer."""
        self.release = asyncio.Event()
        # When set, the end of the body waits for it after [DONE] was sent.
        self.eof_gate: asyncio.Event | None = None
        self.done_sent = asyncio.Event()
        self.held = asyncio.Event()
        """Set when a whole answer is being held (mode hold)."""
        self.disconnected = asyncio.Event()
        self.requests: list[dict[str, Any]] = []
        self.model_probes: list[dict[str, str]] = []
        self.roots: dict[str, str] = {}
        self.contexts: dict[str, int] = {}
        """Each model's `max_model_len`, listed in /models as vLLM lists it."""
        """Each model's `root` in /models (vLLM lists the path it loaded)."""
        self.active = 0
        self.max_active = 0
        self.port = 0
        self._runner: web.AppRunner | None = None

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}/v1"

    @property
    def pieces(self) -> list[str]:
        return [self.name, " says", " hi"]

    async def start(self) -> None:
        app = web.Application()
        app.router.add_get("/v1/models", self._models)
        app.router.add_get("/metrics", self._metrics)
        app.router.add_post("/v1/chat/completions", self._generate)
        app.router.add_post("/v1/completions", self._generate)
        # Cancelling the handler on disconnect is how a held stream learns its
        # client is gone.
        self._runner = web.AppRunner(app, handler_cancellation=True)
        await self._runner.setup()
        site = web.TCPSite(self._runner, "127.0.0.1", self.port)
        await site.start()
        self.port = self._runner.addresses[0][1]

    async def stop(self) -> None:
        if self._runner is not None:
            await self._runner.cleanup()
            self._runner = None

    # -- what a subclass may answer per request ------------------------------------

    def refusal(self, path: str, body: dict[str, Any]) -> tuple[int, Any] | None:
        """(status, JSON body) to refuse the request with, or None to answer it."""
        return None

    def pieces_for(self, body: dict[str, Any]) -> list[str]:
        return self.pieces

    def script_for(self, body: dict[str, Any], chat: bool) -> list[dict[str, Any]] | None:
        return self.script

    def whole_choice_for(self, body: dict[str, Any], chat: bool) -> dict[str, Any] | None:
        return self.whole_choice

    def metrics_page(self) -> str | None:
        """Its /metrics page (None: it has none, 404, as a server that is not vLLM)."""
        return None

    async def _metrics(self, request: web.Request) -> web.Response:
        page = self.metrics_page()
        if page is None:
            raise web.HTTPNotFound()
        return web.Response(text=page, content_type="text/plain")

    async def _models(self, request: web.Request) -> web.Response:
        self.model_probes.append(dict(request.headers))
        data = [{"id": m, **({"root": self.roots[m]} if m in self.roots else {}),
                 **({"max_model_len": self.contexts[m]} if m in self.contexts else {})}
                for m in self.models]
        return web.json_response({"object": "list", "data": data})

    async def _generate(self, request: web.Request) -> web.StreamResponse:
        body = await request.json()
        assert request.transport is not None
        self.requests.append({
            "path": request.path,
            "body": body,
            "headers": dict(request.headers),
            "peer": request.transport.get_extra_info("peername"),
        })
        if self.mode == "hangup" or self.hangups > 0:
            # As a server does to a pooled connection it closed as the request came.
            self.hangups = max(0, self.hangups - 1)
            request.transport.abort()
            return web.Response()
        if self.mode == "status":
            return web.json_response(
                self.status_body, status=self.status, headers=self.status_headers
            )
        refused = self.refusal(request.path, body)
        if refused is not None:
            return web.json_response(refused[1], status=refused[0])
        chat = request.path.endswith("/chat/completions")
        if body.get("stream") is not True:
            return await self._whole(request, body, chat)
        pieces = self.pieces_for(body)
        script = self.script_for(body, chat)
        response = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
        await response.prepare(request)
        self.active += 1
        self.max_active = max(self.max_active, self.active)
        counted = True

        async def send(payload: Any) -> None:
            data = payload if isinstance(payload, str) else json.dumps(payload)
            await response.write(f"data: {data}\n\n".encode())

        def choice(text: str, finish: str | None, extra: dict[str, Any] | None = None) -> dict:
            if chat:
                delta: dict[str, Any] = {"content": text} if text else {}
                delta.update(extra or {})
                return {"index": 0, "delta": delta, "finish_reason": finish, "logprobs": None}
            return {"index": 0, "text": text, "finish_reason": finish, "logprobs": None}

        try:
            if chat:
                await send(
                    {"choices": [{"index": 0, "delta": {"role": "assistant", "content": ""}}]}
                )
            if self.mode == "malformed":
                await send("{not json")
            for scripted in script or []:
                await send({"choices": [scripted]})
            for i, piece in enumerate(pieces if script is None else []):
                event: dict[str, Any] = {
                    "choices": [choice(piece, None, self.delta_extra if i == 0 else None)]
                }
                if self.tokens_per_delta_usage:
                    done = self.tokens_per_delta_usage * (i + 1)
                    event["usage"] = {"prompt_tokens": self.prompt_tokens,
                                      "completion_tokens": done}
                await send(event)
                if i == 0 and self.mode == "hold":
                    await self.release.wait()
                if i == 0 and self.mode == "kill":
                    assert request.transport is not None
                    request.transport.close()
                    return response
            # Counted out before the last bytes: the client frees its slot only
            # after reading them, so its count can never trail this one.
            self.active -= 1
            counted = False
            if script is None:
                await send({"choices": [choice("", "stop")]})
            if self.send_usage and body.get("stream_options", {}).get("include_usage"):
                done = self.completion_tokens or len(pieces)
                usage = {"prompt_tokens": self.prompt_tokens, "completion_tokens": done,
                         "total_tokens": self.prompt_tokens + done}
                await send({"choices": [], "usage": usage})
            await send("[DONE]")
            if self.eof_gate is not None:
                self.done_sent.set()
                await self.eof_gate.wait()
            await response.write_eof()
            return response
        except (asyncio.CancelledError, ConnectionError):
            self.disconnected.set()
            raise
        finally:
            if counted:
                self.active -= 1

    async def _whole(self, request: web.Request, body: dict, chat: bool) -> web.StreamResponse:
        """The same answer, not streamed."""
        if self.mode == "malformed":
            return web.Response(text="{not json", content_type="application/json")
        if self.mode == "hold":
            self.active += 1
            self.held.set()
            try:
                await self.release.wait()
            except asyncio.CancelledError:
                self.disconnected.set()
                raise
            finally:
                self.active -= 1
        pieces = self.pieces_for(body)
        text = "".join(pieces)
        if chat:
            message = {"role": "assistant", "content": text, **self.delta_extra}
            choice = {"index": 0, "message": message, "finish_reason": "stop"}
        else:
            choice = {"index": 0, "text": text, "finish_reason": "stop"}
        choice = self.whole_choice_for(body, chat) or choice
        answer: dict[str, Any] = {"object": "x", "choices": [choice]}
        if self.send_usage:
            done = self.completion_tokens or len(pieces)
            answer["usage"] = {"prompt_tokens": self.prompt_tokens, "completion_tokens": done,
                               "total_tokens": self.prompt_tokens + done}
        return web.json_response(answer, headers=self.answer_headers)


def chat_logprobs(*tokens: str) -> dict[str, Any]:
    def entry(token: str) -> dict[str, Any]:
        return {"token": token, "logprob": -0.5, "bytes": list(token.encode())}

    return {"content": [{**entry(t), "top_logprobs": [entry(t)]} for t in tokens]}


def text_logprobs(tokens: list[str], offset: int) -> dict[str, Any]:
    """Completions' shape: parallel lists, offsets from the start of the text."""
    offsets = []
    for token in tokens:
        offsets.append(offset)
        offset += len(token)
    return {
        "tokens": tokens,
        "token_logprobs": [-0.5] * len(tokens),
        "top_logprobs": [{t: -0.5} for t in tokens],
        "text_offset": offsets,
    }


# -- an upstream that judges requests as vLLM does ----------------------------------

VOCAB_SIZE = 32_000
"""The fake model's vocabulary: vLLM refuses token ids past it."""
MAX_MODEL_LEN = 4096
MAX_LOGPROBS = 20
"""vLLM's default `max_logprobs`."""

_NUMBERS = ("temperature", "top_p", "min_p", "presence_penalty", "frequency_penalty",
            "repetition_penalty")  # fmt: skip
_INTEGERS = ("top_k", "seed", "max_tokens", "max_completion_tokens", "min_tokens", "n",
             "best_of", "top_logprobs")  # fmt: skip
# (field, what vLLM's SamplingParams takes, its message)
_RANGES: tuple[tuple[str, Any, str], ...] = (
    ("temperature", lambda v: v >= 0, "temperature must be non-negative, got {}."),
    ("top_p", lambda v: 0 < v <= 1, "top_p must be in (0, 1], got {}."),
    ("top_k", lambda v: v >= -1, "top_k must be 0 (disable), or at least 1, got {}."),
    ("top_k", lambda v: v <= VOCAB_SIZE,
     f"top_k cannot be greater than vocabulary size({VOCAB_SIZE}), but got {{}}."),
    ("min_p", lambda v: 0 <= v <= 1, "min_p must be in [0, 1], got {}."),
    ("presence_penalty", lambda v: -2 <= v <= 2, "presence_penalty must be in [-2, 2], got {}."),
    ("frequency_penalty", lambda v: -2 <= v <= 2, "frequency_penalty must be in [-2, 2], got {}."),
    ("repetition_penalty", lambda v: v > 0,
     "repetition_penalty must be greater than zero, got {}."),
    ("max_tokens", lambda v: v >= 1, "max_tokens must be at least 1, got {}."),
    ("min_tokens", lambda v: v >= 0, "min_tokens must be greater than or equal to 0, got {}."),
    ("n", lambda v: v >= 1, "n must be at least 1, got {}."),
    ("seed", lambda v: -(2**63) <= v < 2**63, "seed must be a 64-bit integer, got {}."),
)  # fmt: skip


def _vllm_problem(chat: bool, body: dict[str, Any]) -> tuple[str, str | None] | None:
    """What vLLM would refuse in `body` (message, param), if anything. The
    field types come first, so that no rule below meets a value it cannot
    compare: a crash here would be the fake's 500, not the gateway's."""
    for name in (*_NUMBERS, *_INTEGERS):
        value = body.get(name)
        whole = name in _INTEGERS
        if value is not None and (
            isinstance(value, bool)
            or not isinstance(value, (int, float))
            or (whole and isinstance(value, float))
        ):
            kind = "a valid integer" if whole else "a valid number"
            return f"1 validation error for request\n{name}\n  Input should be {kind}", name
    for name, within, message in _RANGES:
        value = body.get(name)
        if value is not None and not within(value):
            return message.format(value), name
    max_tokens = body.get("max_completion_tokens") or body.get("max_tokens") or 16
    if (body.get("min_tokens") or 0) > max_tokens:
        return (
            f"min_tokens must be less than or equal to max_tokens={max_tokens}, "
            f"got {body['min_tokens']}.",
            "min_tokens",
        )
    prompt = body.get("messages") if chat else body.get("prompt")
    prompt_tokens = len(json.dumps(prompt)) // 4
    if prompt_tokens + max_tokens > MAX_MODEL_LEN:
        return (
            f"This model's maximum context length is {MAX_MODEL_LEN} tokens. However, you "
            f"requested {prompt_tokens + max_tokens} tokens. Please reduce the length of "
            "the prompt or completion.",
            None,
        )
    bias = body.get("logit_bias")
    if isinstance(bias, dict):
        past = [key for key in bias if not key.isdigit() or int(key) >= VOCAB_SIZE]
        if past:
            return (
                f"token_id(s) {past[:5]} in logit_bias contain out-of-vocab token ids. "
                f"Vocabulary size: {VOCAB_SIZE}",
                "logit_bias",
            )
    if body.get("stream_options") is not None and body.get("stream") is not True:
        return "Stream options can only be defined when `stream=True`.", "stream_options"
    if chat:
        return _vllm_chat_problem(body)
    logprobs = body.get("logprobs")
    if isinstance(logprobs, int) and logprobs > MAX_LOGPROBS:
        return (
            f"Requested sample logprobs of {logprobs}, which is greater than max allowed: "
            f"{MAX_LOGPROBS}",
            "logprobs",
        )
    if body.get("suffix") is not None:
        return "suffix is not currently supported", None
    if isinstance(prompt, list):
        ids = prompt[0] if prompt and isinstance(prompt[0], list) else prompt
        past = [i for i in ids if isinstance(i, int) and i >= VOCAB_SIZE]
        if past:
            return f"Token id {max(past)} is out of vocabulary", None
    return None


def _vllm_chat_problem(body: dict[str, Any]) -> tuple[str, str | None] | None:
    top_logprobs = body.get("top_logprobs")
    if top_logprobs is not None:
        if not body.get("logprobs"):
            return "when using `top_logprobs`, `logprobs` must be set to true.", "top_logprobs"
        if top_logprobs > MAX_LOGPROBS:
            return (
                f"Requested sample logprobs of {top_logprobs}, which is greater than max "
                f"allowed: {MAX_LOGPROBS}",
                "top_logprobs",
            )
    choice = body.get("tool_choice")
    if choice not in (None, "none"):
        tools = body.get("tools")
        if tools is None:
            return "When using `tool_choice`, `tools` must be set.", None
        if isinstance(choice, dict):
            wanted = (choice.get("function") or {}).get("name")
            if wanted not in [(t.get("function") or {}).get("name") for t in tools]:
                return (
                    "The tool specified in `tool_choice` does not match any of the "
                    "specified `tools`",
                    None,
                )
    for message in body.get("messages") or []:
        content = message.get("content") if isinstance(message, dict) else None
        for part in content if isinstance(content, list) else []:
            kind = part.get("type") if isinstance(part, dict) else None
            if kind not in ("text", "refusal"):
                return f"{MODEL} is a text-only model: it takes no {kind} parts", None
    return None


def _forced_call(body: dict[str, Any]) -> dict[str, Any] | None:
    """The tool call a request forces (tool_choice required, or a named
    function), as vLLM's guided decoding makes one."""
    choice, tools = body.get("tool_choice"), body.get("tools")
    if not tools or choice in (None, "none", "auto"):
        return None
    name = choice["function"]["name"] if isinstance(choice, dict) else tools[0]["function"]["name"]
    return {"id": "call_0", "type": "function", "function": {"name": name, "arguments": "{}"}}


class VllmUpstream(FakeUpstream):
    """An upstream that judges each request as vLLM's OpenAI-compatible server
    does, with vLLM's 400 in its shape (`refusals` keeps every message), and
    answers the rest with `max_tokens` words, with logprobs and a tool call
    where the request asks for them."""

    def __init__(self, models: tuple[str, ...] = (MODEL,)) -> None:
        super().__init__("vllm", models)
        self.refusals: list[str] = []

    def refusal(self, path: str, body: dict[str, Any]) -> tuple[int, Any] | None:
        if body.get("model") not in self.models:
            message = f"The model `{body.get('model')}` does not exist."
            self.refusals.append(message)
            return 404, {"error": {"message": message, "type": "NotFoundError", "param": None,
                                   "code": 404}}  # fmt: skip
        problem = _vllm_problem(path.endswith("/chat/completions"), body)
        if problem is None:
            return None
        message, param = problem
        self.refusals.append(message)
        return 400, {"error": {"message": message, "type": "BadRequestError", "param": param,
                               "code": 400}}  # fmt: skip

    def pieces_for(self, body: dict[str, Any]) -> list[str]:
        count = body.get("max_completion_tokens") or body.get("max_tokens") or 16
        return [self.name] + [f" w{i}" for i in range(1, count)]

    def script_for(self, body: dict[str, Any], chat: bool) -> list[dict[str, Any]] | None:
        call = _forced_call(body) if chat else None
        logprobs = bool(body.get("logprobs")) if chat else body.get("logprobs") is not None
        if call is None and not logprobs:
            return None
        script: list[dict[str, Any]] = []
        offset = 0
        for piece in self.pieces_for(body):
            choice: dict[str, Any] = {"index": 0, "finish_reason": None}
            if chat:
                choice["delta"] = {"content": piece}
            else:
                choice["text"] = piece
            if logprobs and chat:
                choice["logprobs"] = chat_logprobs(piece)
            elif logprobs:
                choice["logprobs"] = text_logprobs([piece], offset)
            offset += len(piece)
            script.append(choice)
        if call is not None:
            delta = {"tool_calls": [{"index": 0, **call}]}
            script.append({"index": 0, "delta": delta, "finish_reason": None})
        script[-1]["finish_reason"] = "tool_calls" if call is not None else "length"
        return script

    def whole_choice_for(self, body: dict[str, Any], chat: bool) -> dict[str, Any] | None:
        script = self.script_for(body, chat)
        if script is None:
            return None
        pieces = self.pieces_for(body)
        choice: dict[str, Any] = {"index": 0, "finish_reason": script[-1]["finish_reason"]}
        if chat:
            choice["message"] = {"role": "assistant", "content": "".join(pieces)}
            call = _forced_call(body)
            if call is not None:
                choice["message"]["tool_calls"] = [call]
            choice["logprobs"] = chat_logprobs(*pieces) if body.get("logprobs") else None
        else:
            choice["text"] = "".join(pieces)
            choice["logprobs"] = (
                text_logprobs(pieces, 0) if body.get("logprobs") is not None else None
            )
        return choice


# -- the whole gateway over either backend -------------------------------------------


def over_upstream(yaml_text: str, url: str) -> str:
    """The policy `yaml_text` with the openai backend over `url` in place of
    its own; the models are what the upstream lists."""
    data = yaml.safe_load(yaml_text)
    data["backend"] = {"kind": "openai", "upstreams": [{"url": url}]}
    return yaml.safe_dump(data, sort_keys=False)


@contextlib.asynccontextmanager
async def backend_policy(
    kind: str, yaml_text: str = POLICY_YAML
) -> AsyncIterator[tuple[str, VllmUpstream | None]]:
    """`yaml_text` as it is (`sim`), or (`openai`) over a `VllmUpstream`
    that runs for as long as the block."""
    if kind == "sim":
        yield yaml_text, None
        return
    assert kind == "openai", kind
    upstream = VllmUpstream()
    await upstream.start()
    try:
        yield over_upstream(yaml_text, upstream.url), upstream
    finally:
        upstream.release.set()
        await upstream.stop()


@contextlib.asynccontextmanager
async def live_backend(
    kind: str, yaml_text: str = POLICY_YAML
) -> AsyncIterator[tuple[Live, VllmUpstream | None]]:
    """`live_app` over the `kind` backend (see `backend_policy`)."""
    async with backend_policy(kind, yaml_text) as (text, upstream), live_app(
        make_policy(text)
    ) as live:
        yield live, upstream


# -- an upstream with an engine's limited room ---------------------------------------


class EngineUpstream(FakeUpstream):
    """An upstream that runs at most `slots` streamed requests at once, as an
    engine with `max_num_seqs` does, queues the rest first come first served,
    and reports both (and `kv`) on /metrics as vLLM's server does. A running
    request answers once the test gives it a turn (`turns`; None: at once).
    `until` waits for a state the test names: every change wakes it."""

    def __init__(self, slots: int, models: tuple[str, ...] = ("m",)) -> None:
        super().__init__("engine", models)
        self.slots = slots
        self.running = 0
        self.queue: collections.deque[asyncio.Future[None]] = collections.deque()
        self.started: list[dict[str, Any]] = []
        """The bodies of the requests that ran, in the order they started."""
        self.max_waiting = 0
        self.kv = 0.1
        self.turns: asyncio.Semaphore | None = asyncio.Semaphore(0)
        self.started_at: float | None = None
        """Its process start time on /metrics, as vLLM's server shows it (None: not shown)."""
        self.steps: dict[str, float] = {}
        """Its tokens-per-step histogram on /metrics, cumulative counts by
        bucket bound ("+Inf" the total), as vLLM's server shows it (empty:
        no step taken yet, every bucket 0)."""
        self._moved = asyncio.Event()

    def metrics_page(self) -> str | None:
        # vLLM's shape: one sample per engine, labelled, among other families
        # whose names start the same way.
        labels = '{engine="0",model_name="m"}'
        return "\n".join([
            "# HELP vllm:num_requests_running Number of requests in model execution batches.",
            "# TYPE vllm:num_requests_running gauge",
            f"vllm:num_requests_running{labels} {float(self.running)}",
            "# TYPE vllm:num_requests_waiting gauge",
            f"vllm:num_requests_waiting{labels} {float(len(self.queue))}",
            "# TYPE vllm:num_requests_waiting_by_reason gauge",
            'vllm:num_requests_waiting_by_reason{engine="0",reason="capacity"} 99.0',
            "# TYPE vllm:kv_cache_usage_perc gauge",
            f"vllm:kv_cache_usage_perc{labels} {self.kv}",
            "# TYPE vllm:e2e_request_latency_seconds histogram",
            'vllm:e2e_request_latency_seconds_bucket{le="+Inf",engine="0"} 3.0',
            "# TYPE vllm:iteration_tokens_total histogram",
            *(f'vllm:iteration_tokens_total_bucket{{engine="0",le="{bound}",model_name="m"}} '
              f"{self.steps.get(bound, 0.0)}"
              for bound in ("1.0", "8.0", "1024.0", "2048.0", "16384.0", "+Inf")),
            f'vllm:iteration_tokens_total_count{{engine="0",model_name="m"}} '
            f'{self.steps.get("+Inf", 0.0)}',
            *([] if self.started_at is None else [
                "# TYPE process_start_time_seconds gauge",
                f"process_start_time_seconds {self.started_at}",
            ]),
            "",
        ])  # fmt: skip

    async def until(self, predicate: Callable[[], bool]) -> None:
        while not predicate():
            self._moved.clear()
            await self._moved.wait()

    async def _generate(self, request: web.Request) -> web.StreamResponse:
        body = await request.json()  # aiohttp keeps the body: the base class reads it again
        if self.running < self.slots and not self.queue:
            self.running += 1
        else:
            turn = asyncio.get_running_loop().create_future()
            self.queue.append(turn)
            self.max_waiting = max(self.max_waiting, len(self.queue))
            self._moved.set()
            try:
                await turn  # the slot of a request that finished, handed over
            except asyncio.CancelledError:
                if turn in self.queue:
                    self.queue.remove(turn)
                    self._moved.set()
                else:
                    self._free()
                raise
        self.started.append(body)
        self._moved.set()
        try:
            if self.turns is not None:
                await self.turns.acquire()
            return await super()._generate(request)
        finally:
            self._free()

    def _free(self) -> None:
        while self.queue:
            turn = self.queue.popleft()
            if not turn.done():
                turn.set_result(None)
                break
        else:
            self.running -= 1
        self._moved.set()
