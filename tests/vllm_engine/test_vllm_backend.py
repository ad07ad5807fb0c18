"""qosgate in front of a real co-located vLLM engine (CPU build, tiny model).

Over the HTTP API with the official `openai` client: chat and completions,
streamed and not. A client that leaves is aborted inside the engine. The
engine never holds more requests than its sequence slots while qosgate's
queues hold the rest. The engine priority (the tier's level, then the
prompt's size class) reaches the engine.
"""

from __future__ import annotations

import asyncio
from typing import Any

import aiohttp
import openai
import pytest
import pytest_asyncio

from qosgate.backends.vllm import VllmBackend
from qosgate.config.scheduling import PREFILL_BUDGET_STEPS
from qosgate.core.ordering import engine_priority
from tests.http_support import live_app, make_policy

pytestmark = pytest.mark.asyncio(loop_scope="module")

MAX_SEQS = 4
KEYS = {"gold": "vllm-gold-key", "bronze": "vllm-bronze-key"}


def policy_yaml(model: str) -> str:
    import hashlib

    def digest(key: str) -> str:
        return hashlib.sha256(key.encode()).hexdigest()

    return f"""
version: 1
backend:
  kind: vllm
  model: {model}
  served_model_name: tiny
  engine_args:
    enforce_eager: true
    dtype: bfloat16
    max_model_len: 2048
    max_num_seqs: {MAX_SEQS}
tiers:
  gold:
    priority: 0
    max_queue_wait_ms: 120000
    max_tokens: 2000
  bronze:
    priority: 2
    max_queue_wait_ms: 120000
    max_tokens: 256
tenants:
  - id: g
    tier: gold
    api_keys: ["sha256:{digest(KEYS['gold'])}"]
  - id: b
    tier: bronze
    api_keys: ["sha256:{digest(KEYS['bronze'])}"]
"""


class Watch:
    """Records what the engine is asked: each request's priority, aborts, and
    how many requests it held at each new one."""

    def __init__(self, backend: VllmBackend) -> None:
        self.priorities: dict[str, int] = {}
        self.aborted: list[str] = []
        self._abort_waiters: dict[str, asyncio.Event] = {}
        self.held_at_submit: list[int] = []
        engine = backend.engine
        generate, abort = engine.generate, engine.abort

        def watched_generate(prompt: Any, params: Any, request_id: str, **kw: Any):
            self.priorities[request_id] = kw.get("priority", 0)
            self.held_at_submit.append(engine.get_num_unfinished_requests())
            return generate(prompt, params, request_id, **kw)

        async def watched_abort(request_id: Any, internal: bool = False) -> None:
            ids = [request_id] if isinstance(request_id, str) else list(request_id)
            self.aborted.extend(ids)
            for prefix, event in self._abort_waiters.items():
                if any(rid.startswith(prefix) for rid in ids):
                    event.set()
            await abort(request_id, internal)

        engine.generate = watched_generate
        engine.abort = watched_abort

    def abort_event(self, request_id: str) -> asyncio.Event:
        """Set once the engine is asked to abort the request (vLLM may add a
        suffix of its own to the id)."""
        event = self._abort_waiters.setdefault(request_id, asyncio.Event())
        if any(rid.startswith(request_id) for rid in self.aborted):
            event.set()
        return event


@pytest_asyncio.fixture(scope="module", loop_scope="module")
async def live(tiny_model):
    policy = make_policy(policy_yaml(tiny_model))
    from qosgate.backends import build_backend

    backend = build_backend(policy.backend)
    async with live_app(policy, backend) as app:
        async with aiohttp.ClientSession() as http:
            async with http.get(app.url + "/readyz") as r:
                # The engine loads in the background: not ready yet.
                assert r.status == 503
        await backend.wait_ready()
        app.watch = Watch(backend)  # type: ignore[attr-defined]
        yield app


def client(live, tier: str = "gold") -> openai.AsyncOpenAI:
    return openai.AsyncOpenAI(base_url=live.url + "/v1", api_key=KEYS[tier], max_retries=0)


async def test_ready_once_the_engine_is_up(live):
    # Warmed up first: its logprobs path is built at its first use, which
    # would otherwise be a client's wait.
    assert live.gateway.backend.warm_ups == 1 and live.gateway.backend.warm_up_s is not None
    async with aiohttp.ClientSession() as http:
        async with http.get(live.url + "/readyz") as r:
            assert r.status == 200
        async with http.get(live.url + "/v1/models", headers={"Authorization": "Bearer "
                                                             + KEYS["gold"]}) as r:
            assert [m["id"] for m in (await r.json())["data"]] == ["tiny"]


async def test_an_automatic_prefill_budget_counts_the_engines_own_step(live):
    """engine_args set no max_num_batched_tokens: the prefill budget (`auto`)
    is PREFILL_BUDGET_STEPS of the steps the engine took, learned once it is up."""
    step = live.gateway.backend.engine.vllm_config.scheduler_config.max_num_batched_tokens
    assert live.gateway.backend.step_tokens == step > 0
    # Served after the engine came up: the dispatcher has run since.
    await client(live).chat.completions.create(
        model="tiny", messages=[{"role": "user", "content": "hi"}], max_tokens=2)
    assert live.gateway.scheduler.policy.prefill_budget_tokens == PREFILL_BUDGET_STEPS * step


async def test_the_openai_client_chat_and_completions_streamed_and_not(live):
    c = client(live)
    chat = await c.chat.completions.create(
        model="tiny", messages=[{"role": "user", "content": "hello world"}], max_tokens=12,
        extra_body={"ignore_eos": True},
    )
    assert chat.choices[0].finish_reason == "length"
    assert chat.usage.completion_tokens == 12 and chat.usage.prompt_tokens > 0
    assert isinstance(chat.choices[0].message.content, str)

    text = []
    finish = None
    stream = await c.chat.completions.create(
        model="tiny", messages=[{"role": "user", "content": "hello"}], max_tokens=10,
        stream=True, stream_options={"include_usage": True}, extra_body={"ignore_eos": True},
    )
    usage = None
    async for chunk in stream:
        if chunk.choices:
            text.append(chunk.choices[0].delta.content or "")
            finish = chunk.choices[0].finish_reason or finish
        if chunk.usage:
            usage = chunk.usage
    assert finish == "length" and usage is not None and usage.completion_tokens == 10

    done = await c.completions.create(model="tiny", prompt="the quick brown fox", max_tokens=8,
                                      extra_body={"ignore_eos": True})
    assert done.usage.completion_tokens == 8
    pieces = []
    async for chunk in await c.completions.create(model="tiny", prompt="hello", max_tokens=6,
                                                  stream=True, extra_body={"ignore_eos": True}):
        pieces.append(chunk.choices[0].text if chunk.choices else "")
    assert len("".join(pieces)) > 0
    await c.close()


async def test_the_prompt_is_counted_with_the_models_tokenizer(live):
    backend: VllmBackend = live.gateway.backend
    tokenizer = backend.engine.tokenizer
    body = {"messages": [{"role": "user", "content": "hello world"}]}
    expected = tokenizer.apply_chat_template(
        body["messages"], tokenize=False, add_generation_prompt=True
    )
    assert backend.count_prompt_tokens("chat", body) == len(
        tokenizer.encode(expected, add_special_tokens=False)
    )
    assert expected.startswith("<|user|>hello world")  # the model's own template


async def test_a_client_that_leaves_is_aborted_inside_the_engine(live):
    engine = live.gateway.backend.engine
    async with aiohttp.ClientSession() as http:
        response = await http.post(
            live.url + "/v1/completions",
            # Long enough (seconds on these cores) to be running when the
            # client leaves.
            json={"model": "tiny", "prompt": "hello", "max_tokens": 2000, "stream": True,
                  "ignore_eos": True},
            headers={"Authorization": "Bearer " + KEYS["gold"]},
        )
        assert response.status == 200
        await response.content.readline()  # it is generating
        request_id = live.gateway.streams[-1].request.id
        response.close()  # the client hangs up mid-stream
        await asyncio.wait_for(live.gateway.aclosed.wait(), 30)
        await asyncio.wait_for(live.watch.abort_event(request_id).wait(), 30)
    await asyncio.wait_for(live.gateway.aclosed.wait(), 30)
    assert live.gateway.streams[-1].request.outcome.value == "cancelled"
    assert request_id not in live.gateway.backend._runs
    assert engine.get_num_unfinished_requests() == 0


async def test_the_engine_holds_no_more_than_its_slots_and_qosgate_queues_the_rest(live):
    watch = live.watch
    watch.held_at_submit.clear()
    queued_seen = []
    gateway = live.gateway
    original_submit = gateway.submit

    def submit(**kw):
        stream = original_submit(**kw)
        queued_seen.append(gateway.scheduler.queued_count)
        return stream

    gateway.submit = submit
    try:
        c = client(live)
        replies = await asyncio.gather(*(
            c.completions.create(model="tiny", prompt=f"request {i}", max_tokens=24,
                                 extra_body={"ignore_eos": True})
            for i in range(4 * MAX_SEQS)
        ))  # fmt: skip
        await c.close()
    finally:
        gateway.submit = original_submit
    assert all(r.usage.completion_tokens == 24 for r in replies)
    # Every request reached the engine, and none while it already held all
    # its sequence slots: the backlog waited in qosgate's queue.
    assert len(watch.held_at_submit) == 4 * MAX_SEQS
    assert max(watch.held_at_submit) < MAX_SEQS
    assert max(queued_seen) >= 2 * MAX_SEQS


async def test_the_tiers_priority_reaches_the_engine(live):
    watch = live.watch
    gold, bronze = client(live, "gold"), client(live, "bronze")
    await gold.completions.create(model="tiny", prompt="a", max_tokens=2)
    gold_req = live.gateway.streams[-1].request
    await bronze.completions.create(model="tiny", prompt="b", max_tokens=2)
    bronze_req = live.gateway.streams[-1].request
    # The client may lower its priority, never raise it.
    await bronze.completions.create(model="tiny", prompt="c", max_tokens=2,
                                    extra_body={"priority": 1})
    lowered_req = live.gateway.streams[-1].request
    # Its level (gold 0, bronze 2, lowered 3), then its prompt's size class.
    for req, level in ((gold_req, 0), (bronze_req, 2), (lowered_req, 3)):
        assert watch.priorities[req.id] == engine_priority(level, req.prompt_tokens)
    assert (watch.priorities[gold_req.id] < watch.priorities[bronze_req.id]
            < watch.priorities[lowered_req.id])
    await gold.close()
    await bronze.close()


# -- hostile input through the real engine -------------------------------------

CHAT_URL = "/v1/chat/completions"
COMPLETIONS_URL = "/v1/completions"
HOSTILE_SAMPLING = [
    # (field, value): each must be a 400 naming the field, before the engine.
    ("seed", "abc"), ("seed", 1.5), ("seed", 2**64), ("seed", [1]), ("seed", True),
    ("temperature", "hot"), ("temperature", -1), ("temperature", 2.5), ("temperature", {}),
    ("top_p", 1.5), ("top_p", "1"), ("top_k", -2), ("top_k", 0.5), ("top_k", "5"),
    ("min_p", 2), ("min_p", "x"), ("presence_penalty", 50),
    ("presence_penalty", "0"), ("frequency_penalty", -3), ("frequency_penalty", [0]),
    ("repetition_penalty", 0), ("repetition_penalty", "1"), ("min_tokens", -1),
    ("min_tokens", "2"), ("max_tokens", 0), ("max_tokens", "8"), ("max_tokens", 10**12),
    ("n", 2), ("n", "1"), ("stop", {"a": 1}), ("stop", ["a"] * 100), ("stop", [1, 2]),
    ("stop", 7), ("stop_token_ids", [-1]), ("stop_token_ids", "1"),
    ("stop_token_ids", [1.5]), ("logit_bias", {"abc": 1}), ("logit_bias", {"1": 500}),
    ("logit_bias", [1, 2]), ("logprobs", "yes"), ("top_logprobs", 50),
    ("ignore_eos", "yes"), ("skip_special_tokens", 1), ("stream", "true"),
    ("stream_options", {"include_usage": "yes"}), ("response_format", "json"),
    ("response_format", {"type": "xml"}), ("tools", "all"),
    ("tools", [{"type": "function"}]), ("tool_choice", "maybe"), ("user", 5),
    ("metadata", {"k": 1}),
]  # fmt: skip
UNHONOURED = [
    # What this backend cannot honour: refused by name, never dropped.
    ("tools", {"tools": [{"type": "function", "function": {"name": "f"}}]}, "tools"),
    ("tool_choice", {"tool_choice": "required"}, "tool_choice"),
    ("image", {"messages": [{"role": "user", "content": [
        {"type": "image_url", "image_url": {"url": "http://127.0.0.1:9/x.png"}}]}]},
     "messages.0.content.0"),
    ("unknown", {"frobnicate": 1}, "frobnicate"),
]  # fmt: skip
ENGINE_REFUSED = [
    # Valid to OpenAI's model, refused by the engine itself: still a 400.
    ("top_p", {"top_p": 0}, "top_p"),
    ("logit_bias past the vocabulary", {"logit_bias": {"99999": 1}}, "logit_bias"),
    ("stop token past the vocabulary", {"stop_token_ids": [99999]}, "stop_token_ids"),
]


async def _post(http: aiohttp.ClientSession, live, path: str, body: dict) -> tuple[int, dict]:
    async with http.post(
        live.url + path, json=body, headers={"Authorization": "Bearer " + KEYS["gold"]}
    ) as r:
        return r.status, await r.json(content_type=None)


def _chat(**fields: Any) -> dict[str, Any]:
    return {"model": "tiny", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 4,
            **fields}


async def _serves(http: aiohttp.ClientSession, live) -> None:
    status, reply = await _post(http, live, CHAT_URL, _chat())
    assert status == 200, reply
    assert reply["usage"]["completion_tokens"] >= 1
    async with http.get(live.url + "/readyz") as r:
        assert r.status == 200


async def test_wrong_sampling_fields_are_400s_and_the_engine_still_serves(live):
    assert len(HOSTILE_SAMPLING) >= 30
    failures = []
    async with aiohttp.ClientSession() as http:
        for field, value in HOSTILE_SAMPLING:
            status, reply = await _post(http, live, CHAT_URL, _chat(**{field: value}))
            error = reply.get("error") or {}
            if status != 400 or not error.get("message") or field not in (error.get("param") or ""):
                failures.append(f"{field}={value!r}: {status} {reply}")
        # The engine took none of them, and serves every tenant after them.
        await _serves(http, live)
    assert not failures, "\n".join(failures)


@pytest.mark.parametrize(("name", "fields", "param"), UNHONOURED + ENGINE_REFUSED,
                         ids=[c[0] for c in UNHONOURED + ENGINE_REFUSED])
async def test_what_the_engine_cannot_honour_is_a_400_naming_the_field(live, name, fields, param):
    async with aiohttp.ClientSession() as http:
        status, reply = await _post(http, live, CHAT_URL, _chat(**fields))
        assert status == 400, reply
        assert reply["error"]["param"] == param, reply
        assert reply["error"]["type"] == "invalid_request_error"
        await _serves(http, live)


async def test_token_id_prompts_and_content_parts_reach_the_engine_as_vllm_renders_them(live):
    backend: VllmBackend = live.gateway.backend
    async with aiohttp.ClientSession() as http:
        status, reply = await _post(http, live, COMPLETIONS_URL,
                                    {"model": "tiny", "prompt": [5, 6, 7], "max_tokens": 2})
        assert status == 200, reply
        assert reply["usage"]["prompt_tokens"] == 3
        status, reply = await _post(http, live, COMPLETIONS_URL,
                                    {"model": "tiny", "prompt": [[5, 6, 7, 8]], "max_tokens": 2})
        assert status == 200 and reply["usage"]["prompt_tokens"] == 4, reply
        # Text parts are joined as vLLM's server joins them, not printed as a list.
        parts = [{"type": "text", "text": "hello"}, {"type": "text", "text": "world"}]
        status, reply = await _post(http, live, CHAT_URL, _chat(messages=[
            {"role": "user", "content": parts}]))
        assert status == 200, reply
    tokenizer = backend.engine.tokenizer
    text = tokenizer.apply_chat_template(
        [{"role": "user", "content": "hello\nworld"}], tokenize=False, add_generation_prompt=True
    )
    assert reply["usage"]["prompt_tokens"] == len(tokenizer.encode(text, add_special_tokens=False))
    assert "[{" not in text


async def test_a_json_schema_response_format_constrains_the_output(live):
    schema = {"type": "object", "properties": {"ok": {"type": "boolean"}}, "required": ["ok"],
              "additionalProperties": False}
    async with aiohttp.ClientSession() as http:
        status, reply = await _post(http, live, CHAT_URL, _chat(
            max_tokens=200,
            response_format={"type": "json_schema", "json_schema": {"name": "r", "schema": schema}},
        ))
    assert status == 200, reply
    text = reply["choices"][0]["message"]["content"]
    # Random weights, but the grammar holds them to the schema: a JSON object
    # whose only key is "ok" (whole, unless it ran out of tokens in spaces).
    assert text.lstrip().startswith("{"), text
    if reply["choices"][0]["finish_reason"] == "stop":
        import json

        assert set(json.loads(text)) == {"ok"}, text


async def test_max_tokens_past_the_context_is_a_400(live):
    async with aiohttp.ClientSession() as http:
        status, reply = await _post(http, live, CHAT_URL, _chat(max_tokens=4096))
    assert status == 400 and reply["error"]["code"] == "context_length_exceeded", reply
    assert reply["error"]["param"] == "max_tokens"


async def test_logprobs_come_back_from_the_engine_streamed_and_whole(live):
    c = client(live)
    chat = await c.chat.completions.create(
        model="tiny", messages=[{"role": "user", "content": "hi"}], max_tokens=5,
        logprobs=True, top_logprobs=3, extra_body={"ignore_eos": True},
    )
    content = chat.choices[0].logprobs.content
    assert len(content) == 5
    assert all(len(entry.top_logprobs) == 3 and entry.logprob <= 0 for entry in content)
    # Token by token, the answer (a token that ends inside a character decodes
    # to a replacement character in the text).
    joined = "".join(entry.token for entry in content).replace("\ufffd", "")
    assert joined == chat.choices[0].message.content.replace("\ufffd", "")

    streamed = []
    async for chunk in await c.chat.completions.create(
        model="tiny", messages=[{"role": "user", "content": "hi"}], max_tokens=6, stream=True,
        logprobs=True, extra_body={"ignore_eos": True},
    ):
        if chunk.choices and chunk.choices[0].logprobs:
            streamed += chunk.choices[0].logprobs.content
    assert len(streamed) == 6

    done = await c.completions.create(model="tiny", prompt="the quick", max_tokens=4, logprobs=2,
                                      extra_body={"ignore_eos": True})
    lp = done.choices[0].logprobs
    assert len(lp.tokens) == len(lp.token_logprobs) == len(lp.text_offset) == 4
    # A mapping of token text to logprob, OpenAI's shape for completions: two
    # alternatives that decode alike (pieces of one character) share a key.
    assert all(1 <= len(alts) <= 2 for alts in lp.top_logprobs)
    assert lp.text_offset[0] == 0
    await c.close()


async def test_the_engines_own_metrics_are_served_on_the_gateways(live):
    async with aiohttp.ClientSession() as http:
        async with http.get(live.url + "/metrics") as r:
            assert r.status == 200
            text = await r.text()
    # vLLM's v1 engine metrics, beside qosgate's, from the one /metrics.
    assert "vllm:num_requests_running{" in text
    assert "vllm:kv_cache_usage_perc{" in text
    assert "qosgate_requests_total" in text
