"""The HTTP API end to end: the official `openai` client, unchanged, against a
live qosgate on the simulated GPU; the SSE wire format; max_tokens and
priority as the tier allows them; errors before and after the first byte;
clients that leave; `qosgate serve`."""

from __future__ import annotations

import asyncio
import json
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import aiohttp
import openai
import pytest
from http_support import (
    ALICE_KEY,
    BATCH_DEFAULT,
    BOB_KEY,
    INTERACTIVE_CAP,
    MODEL,
    POLICY_YAML,
    SECRET,
    ScriptedBackend,
    fail_after_one,
    hang_after_one,
    live_app,
    make_policy,
    words,
)

from qosgate.backends import build_backend
from qosgate.backends.base import BackendUnavailable, Chunk, GenerationJob
from qosgate.core.ordering import engine_priority
from qosgate.core.request import Outcome

ROOT = Path(__file__).resolve().parent.parent
CHAT = [{"role": "user", "content": "Say something."}]


def _client(url: str, key: str = ALICE_KEY) -> openai.AsyncOpenAI:
    # No retries: a failure must show as itself, not as a slow test.
    return openai.AsyncOpenAI(base_url=url + "/v1", api_key=key, max_retries=0, timeout=30)


# --------------------------------------------------------------------------
# The official client


async def test_openai_client_chat() -> None:
    async with live_app() as live:
        client = _client(live.url)
        reply = await client.chat.completions.create(model=MODEL, messages=CHAT, max_tokens=6)
        assert reply.object == "chat.completion"
        assert reply.id.startswith("chatcmpl-")
        assert reply.model == MODEL
        assert reply.choices[0].message.role == "assistant"
        assert reply.choices[0].message.content
        assert reply.choices[0].finish_reason in ("stop", "length")
        assert reply.usage is not None
        assert reply.usage.completion_tokens == 6
        assert reply.usage.prompt_tokens >= 1
        assert reply.usage.total_tokens == reply.usage.prompt_tokens + 6
        await client.close()
        assert [s.request.outcome for s in live.gateway.streams] == [Outcome.COMPLETED]


async def test_openai_client_chat_streaming() -> None:
    async with live_app() as live:
        client = _client(live.url)
        stream = await client.chat.completions.create(
            model=MODEL, messages=CHAT, max_tokens=5, stream=True,
            stream_options={"include_usage": True},
        )  # fmt: skip
        text = []
        usage = None
        finish = None
        async for chunk in stream:
            assert chunk.object == "chat.completion.chunk"
            if chunk.usage is not None:
                usage = chunk.usage
            for choice in chunk.choices:
                if choice.delta.content:
                    text.append(choice.delta.content)
                finish = choice.finish_reason or finish
        assert "".join(text)
        assert finish in ("stop", "length")
        assert usage is not None and usage.completion_tokens == 5
        await client.close()


async def test_openai_client_completions() -> None:
    async with live_app() as live:
        client = _client(live.url, BOB_KEY)
        reply = await client.completions.create(
            model=MODEL, prompt="Once upon a time", max_tokens=4
        )
        assert reply.object == "text_completion"
        assert reply.id.startswith("cmpl-")
        assert reply.choices[0].text
        assert reply.usage is not None and reply.usage.completion_tokens == 4
        await client.close()


async def test_openai_client_completions_streaming() -> None:
    async with live_app() as live:
        client = _client(live.url, BOB_KEY)
        stream = await client.completions.create(
            model=MODEL, prompt="Once upon a time", max_tokens=4, stream=True
        )
        pieces = []
        usage = None
        async for chunk in stream:
            pieces.extend(choice.text for choice in chunk.choices)
            usage = chunk.usage or usage
        assert "".join(pieces)
        # Usage rides on the final chunk even without stream_options.
        assert usage is not None and usage.completion_tokens == 4
        await client.close()


async def test_openai_client_models_and_errors() -> None:
    async with live_app() as live:
        client = _client(live.url)
        models = await client.models.list()
        assert [m.id for m in models.data] == [MODEL]
        with pytest.raises(openai.NotFoundError) as not_found:
            await client.chat.completions.create(model="gpt-nope", messages=CHAT)
        assert not_found.value.code == "model_not_found"
        with pytest.raises(openai.BadRequestError) as bad:
            await client.chat.completions.create(model=MODEL, messages=CHAT, max_tokens=0)
        assert bad.value.param == "max_tokens"
        with pytest.raises(openai.AuthenticationError):
            await _client(live.url, "sk-wrong").chat.completions.create(model=MODEL, messages=CHAT)
        await client.close()


_SIM_BACKEND = f"backend:\n  kind: sim\n  speed: 200\n  model: {MODEL}\n"


@pytest.mark.parametrize(
    ("backend_yaml", "root"),
    [
        (_SIM_BACKEND, MODEL),
        # The served name hides the path the engine loaded; `root` shows it.
        (f"backend:\n  kind: vllm\n  model: /models/Llama-3-8B\n  served_model_name: {MODEL}\n",
         "/models/Llama-3-8B"),
    ],
    ids=["sim", "vllm"],
)
async def test_models_are_listed_as_vllm_lists_them(backend_yaml: str, root: str) -> None:
    """vLLM's benchmark client reads each entry's `root` (KeyError without it)."""
    assert _SIM_BACKEND in POLICY_YAML
    policy = make_policy(POLICY_YAML.replace(_SIM_BACKEND, backend_yaml))
    backend = ScriptedBackend(words)
    # The roots are the backend's to know: those of the one the policy builds
    # (a vllm backend loads nothing until started).
    backend.model_roots = build_backend(policy.backend).model_roots
    async with (
        live_app(policy, backend=backend) as live,
        aiohttp.ClientSession() as http,
    ):
        headers = {"Authorization": f"Bearer {ALICE_KEY}"}
        async with http.get(live.url + "/v1/models", headers=headers) as r:
            assert r.status == 200
            (entry,) = (await r.json())["data"]
        async with http.get(live.url + "/openapi.json") as r:
            schemas = (await r.json())["components"]["schemas"]
    assert entry == {
        "id": MODEL, "object": "model", "created": entry["created"], "owned_by": "qosgate",
        "root": root, "parent": None,
    }  # fmt: skip
    assert isinstance(entry["created"], int) and entry["created"] > 0
    ref = schemas["ModelList"]["properties"]["data"]["items"]["$ref"]
    described = schemas[ref.rsplit("/", 1)[-1]]
    assert set(described["required"]) == set(entry) == set(described["properties"])


async def test_sync_openai_client_in_a_thread() -> None:
    """The blocking client too, as most scripts use it."""
    async with live_app() as live:

        def call() -> tuple[str, int]:
            client = openai.OpenAI(base_url=live.url + "/v1", api_key=ALICE_KEY, max_retries=0)
            reply = client.chat.completions.create(model=MODEL, messages=CHAT, max_tokens=3)
            streamed = "".join(
                c.choices[0].delta.content or ""
                for c in client.chat.completions.create(
                    model=MODEL, messages=CHAT, max_tokens=3, stream=True
                )
                if c.choices
            )
            client.close()
            assert reply.usage is not None
            return streamed, reply.usage.completion_tokens

        streamed, tokens = await asyncio.to_thread(call)
        assert streamed and tokens == 3


# --------------------------------------------------------------------------
# Wire format


async def _sse_events(response: aiohttp.ClientResponse) -> list[str]:
    text = await response.text()
    assert text.endswith("\n\n")
    events = text.split("\n\n")[:-1]
    assert all(event.startswith("data: ") for event in events)
    return [event.removeprefix("data: ") for event in events]


async def test_sse_wire_format() -> None:
    async with (
        live_app() as live,
        aiohttp.ClientSession() as http,
        http.post(
            live.url + "/v1/chat/completions",
            json={"model": MODEL, "messages": CHAT, "max_tokens": 3, "stream": True},
            headers={"Authorization": f"Bearer {ALICE_KEY}"},
        ) as response,
    ):
        assert response.status == 200
        assert response.headers["Content-Type"].startswith("text/event-stream")
        request_id = response.headers["x-request-id"]
        events = await _sse_events(response)
    assert events[-1] == "[DONE]"
    chunks = [json.loads(event) for event in events[:-1]]
    assert {c["id"] for c in chunks} == {"chatcmpl-" + request_id}
    assert chunks[0]["choices"][0]["delta"]["role"] == "assistant"
    final = chunks[-1]
    assert final["choices"][0]["finish_reason"] == "length"
    assert final["usage"]["completion_tokens"] == 3
    assert all(c["choices"][0]["finish_reason"] is None for c in chunks[:-1])


async def _logprob_pieces(job: GenerationJob) -> AsyncIterator[Chunk]:
    """Three chunks, each with its token's logprobs, in the endpoint's shape."""
    offset = 0
    for i, token in enumerate(["a", "bc", "d"]):
        if job.endpoint == "chat":
            entry = {"token": token, "logprob": -1.0 * i, "bytes": list(token.encode())}
            logprobs: dict[str, Any] = {"content": [{**entry, "top_logprobs": [entry]}]}
        else:
            logprobs = {"tokens": [token], "token_logprobs": [-1.0 * i],
                        "top_logprobs": [{token: -1.0 * i}], "text_offset": [offset]}  # fmt: skip
        offset += len(token)
        yield Chunk(text=token, tokens=1, finish_reason="stop" if i == 2 else None,
                    raw={"logprobs": logprobs})  # fmt: skip


async def test_a_whole_answer_joins_the_logprobs_of_every_chunk() -> None:
    async with live_app(backend=ScriptedBackend(_logprob_pieces)) as live:
        client = _client(live.url)
        chat = await client.chat.completions.create(model=MODEL, messages=CHAT)
        text = await client.completions.create(model=MODEL, prompt="x")
        await client.close()
    logprobs = chat.choices[0].logprobs
    assert logprobs is not None and logprobs.content is not None
    assert [(t.token, t.logprob) for t in logprobs.content] == [("a", 0), ("bc", -1), ("d", -2)]
    assert [t.top_logprobs[0].token for t in logprobs.content] == ["a", "bc", "d"]
    joined = text.choices[0].logprobs
    assert joined is not None and text.choices[0].text == "abcd"
    assert joined.tokens == ["a", "bc", "d"] and joined.token_logprobs == [0, -1, -2]
    assert joined.top_logprobs == [{"a": 0}, {"bc": -1}, {"d": -2}]
    assert joined.text_offset == [0, 1, 3]


# --------------------------------------------------------------------------
# What the tier allows


async def test_max_tokens_clamped_and_defaulted_by_tier() -> None:
    backend = ScriptedBackend(words)
    async with live_app(backend=backend) as live:
        client = _client(live.url)
        huge = await client.chat.completions.create(model=MODEL, messages=CHAT, max_tokens=10**12)
        assert huge.usage is not None and huge.usage.completion_tokens == INTERACTIVE_CAP
        await client.chat.completions.create(
            model=MODEL, messages=CHAT, extra_body={"max_completion_tokens": 10**30}
        )
        await client.chat.completions.create(model=MODEL, messages=CHAT)  # interactive: the cap
        bob = _client(live.url, BOB_KEY)
        await bob.completions.create(model=MODEL, prompt="x")  # batch: its default
        await client.close()
        await bob.close()
    assert [job.max_tokens for job in backend.jobs] == [
        INTERACTIVE_CAP, INTERACTIVE_CAP, INTERACTIVE_CAP, BATCH_DEFAULT
    ]  # fmt: skip
    # The backend sees the clamped value wherever the client put its limit.
    assert backend.jobs[0].body["max_tokens"] == INTERACTIVE_CAP
    assert backend.jobs[1].body["max_completion_tokens"] == INTERACTIVE_CAP


async def test_priority_lowers_never_raises() -> None:
    backend = ScriptedBackend(words)
    async with live_app(backend=backend) as live:
        client = _client(live.url, BOB_KEY)  # tier batch, priority 2
        for priority in (0, 3, 10**9):
            await client.completions.create(
                model=MODEL, prompt="x", max_tokens=1, extra_body={"priority": priority}
            )
        with pytest.raises(openai.BadRequestError) as bad:
            await client.completions.create(
                model=MODEL, prompt="x", max_tokens=1, extra_body={"priority": -1}
            )
        assert bad.value.param == "priority"
        await client.close()
    # The level (2, lowered by 3 and by the most a client may, 1,000), then the
    # prompt's size class.
    assert [job.priority for job in backend.jobs] == [
        engine_priority(level, job.prompt_tokens) for level, job in zip((2, 5, 1002), backend.jobs)]
    assert all("priority" not in job.body for job in backend.jobs)


async def test_trusted_header_identity() -> None:
    backend = ScriptedBackend(words)
    async with live_app(backend=backend) as live, aiohttp.ClientSession() as http:
        body = {"model": MODEL, "prompt": "x", "max_tokens": 1}
        headers = {"X-Tenant-Id": "bob", "X-Gateway-Secret": SECRET}
        async with http.post(live.url + "/v1/completions", json=body, headers=headers) as r:
            assert r.status == 200
        assert backend.jobs[-1].tenant == "bob"
        assert backend.jobs[-1].priority == engine_priority(2, backend.jobs[-1].prompt_tokens)


# --------------------------------------------------------------------------
# Failures and departures


async def test_backend_down_before_first_byte_is_a_json_503() -> None:
    async def unavailable(job: GenerationJob):
        raise BackendUnavailable("engine restarting", retry_after_s=2.5)
        yield Chunk()  # pragma: no cover - makes this an async generator

    async with live_app(backend=ScriptedBackend(unavailable)) as live:
        async with (
            aiohttp.ClientSession() as http,
            http.post(
                live.url + "/v1/chat/completions",
                json={"model": MODEL, "messages": CHAT, "stream": True},
                headers={"Authorization": f"Bearer {ALICE_KEY}"},
            ) as response,
        ):
            assert response.status == 503
            assert response.headers["Retry-After"] == "3"
            body = await response.json()
        assert body["error"]["code"] == "backend_unavailable"
        assert set(body["error"]) == {"message", "type", "code", "param"}
        assert live.gateway.streams[0].request.outcome is Outcome.BACKEND_ERROR


async def test_backend_failure_mid_stream_is_an_error_event() -> None:
    async with live_app(backend=ScriptedBackend(fail_after_one)) as live:
        async with (
            aiohttp.ClientSession() as http,
            http.post(
                live.url + "/v1/completions",
                json={"model": MODEL, "prompt": "x", "stream": True},
                headers={"Authorization": f"Bearer {ALICE_KEY}"},
            ) as response,
        ):
            assert response.status == 200
            events = await _sse_events(response)
        assert json.loads(events[0])["choices"][0]["text"] == "partial "
        assert json.loads(events[-1])["error"]["code"] == "backend_error"
        assert "[DONE]" not in events
        assert live.gateway.streams[0].request.outcome is Outcome.BACKEND_ERROR
        # The openai client surfaces the same event as an APIError.
        client = _client(live.url)
        with pytest.raises(openai.APIError):
            async for _ in await client.completions.create(model=MODEL, prompt="x", stream=True):
                pass
        await client.close()


async def test_client_leaving_mid_stream_cancels_and_aborts() -> None:
    backend = ScriptedBackend(hang_after_one)
    async with live_app(backend=backend) as live:
        async with aiohttp.ClientSession() as http:
            response = await http.post(
                live.url + "/v1/chat/completions",
                json={"model": MODEL, "messages": CHAT, "stream": True},
                headers={"Authorization": f"Bearer {ALICE_KEY}"},
            )
            assert response.status == 200
            # Read up to the first content chunk, then hang up.
            seen = b""
            while b"first" not in seen:
                seen += await response.content.readany()
            response.close()
        request_id = backend.jobs[0].request_id
        await asyncio.wait_for(live.gateway.aclosed.wait(), 10)
        assert live.gateway.streams[0].request.outcome is Outcome.CANCELLED
        # The backend's stream was closed (its work aborted), not left running.
        assert backend.closed[request_id].is_set()


async def test_client_leaving_while_queued_leaves_the_queue() -> None:
    backend = ScriptedBackend(words, free_slots=0)  # nothing is ever dispatched
    async with live_app(backend=backend) as live:
        async with aiohttp.ClientSession() as http:
            task = asyncio.create_task(http.post(
                live.url + "/v1/chat/completions",
                json={"model": MODEL, "messages": CHAT},
                headers={"Authorization": f"Bearer {ALICE_KEY}"},
            ))  # fmt: skip
            await asyncio.wait_for(live.gateway.submitted.wait(), 10)
            task.cancel()
            with pytest.raises(asyncio.CancelledError):
                await task
        # The server sees the connection close, cancels the handler, and the
        # handler closes the stream, which takes the request out of its queue.
        await asyncio.wait_for(live.gateway.aclosed.wait(), 10)
        request = live.gateway.streams[0].request
        assert request.outcome is Outcome.CANCELLED
        assert live.gateway.scheduler.snapshot(0.0)["tiers"]["interactive"]["queued"] == 0
        assert backend.jobs == []


# --------------------------------------------------------------------------
# Probes and the CLI


async def test_probes() -> None:
    async with live_app() as live, aiohttp.ClientSession() as http:
        async with http.get(live.url + "/healthz") as r:
            assert r.status == 200
        async with http.get(live.url + "/readyz") as r:
            assert r.status == 200


async def test_serve_runs_and_stops() -> None:
    from http_support import ENV, make_policy

    from qosgate.http.server import serve

    ready: asyncio.Future[str] = asyncio.get_running_loop().create_future()
    stop = asyncio.Event()
    policy = make_policy()
    task = asyncio.create_task(
        serve(policy, "127.0.0.1", 0, environ=ENV, on_ready=ready.set_result, stop=stop)
    )
    url = await asyncio.wait_for(ready, 30)
    client = openai.AsyncOpenAI(base_url=url, api_key=ALICE_KEY, max_retries=0)
    reply = await client.chat.completions.create(model=MODEL, messages=CHAT, max_tokens=2)
    assert reply.usage is not None and reply.usage.completion_tokens == 2
    await client.close()
    stop.set()
    await asyncio.wait_for(task, 30)


def test_cli_serve_rejects_a_bad_policy(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    from qosgate.cli import main

    bad = tmp_path / "bad.yaml"
    bad.write_text("tiers: {}\n")
    assert main(["serve", "--config", str(bad)]) == 2
    assert "invalid policy" in capsys.readouterr().err


def test_cli_serve_reports_a_backend_that_cannot_start(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    from qosgate.cli import main

    monkeypatch.delenv("QOSGATE_TEST_UNSET_KEY", raising=False)
    policy = tmp_path / "upstream.yaml"
    policy.write_text(
        "tiers: {a: {priority: 0}}\n"
        "default_tier: a\n"
        "backend:\n"
        "  kind: openai\n"
        "  upstreams: [{url: 'http://127.0.0.1:9/v1', api_key_env: QOSGATE_TEST_UNSET_KEY}]\n"
    )
    assert main(["serve", "--config", str(policy), "--port", "0"]) == 1
    err = capsys.readouterr().err
    assert "QOSGATE_TEST_UNSET_KEY" in err and "Traceback" not in err


def test_demo_banner_has_working_examples() -> None:
    from qosgate.cli import DEMO_KEY, demo_banner

    banner = demo_banner("http://127.0.0.1:8080/v1", "sim-llama3-8b")
    assert "curl" in banner and "from openai import OpenAI" in banner
    assert DEMO_KEY in banner and "sim-llama3-8b" in banner
    # The demo key really is the interactive tenant's key in the example policy.
    from qosgate.config.loader import load_policy
    from qosgate.http.identity import KeyRing

    ring = KeyRing.from_policy(load_policy(ROOT / "policies" / "example.yaml"), {})
    assert ring.identify({"Authorization": f"Bearer {DEMO_KEY}"}).tier == "interactive"
    with_admin = demo_banner("http://127.0.0.1:8080/v1", "sim-llama3-8b", "tok123")
    assert "http://127.0.0.1:8080/dashboard#token=tok123" in with_admin
    assert "http://127.0.0.1:8080/metrics" in with_admin


# --------------------------------------------------------------------------
# Refusals and bugs


async def test_full_queue_is_a_429_with_retry_after() -> None:
    from http_support import POLICY_YAML, make_policy

    policy = make_policy(
        POLICY_YAML.replace("max_tokens: 16", "max_tokens: 16\n    max_queue_len: 1")
    )
    backend = ScriptedBackend(words, free_slots=0)  # the first request stays queued
    async with live_app(policy, backend) as live, aiohttp.ClientSession() as http:
        body = {"model": MODEL, "messages": CHAT}
        headers = {"Authorization": f"Bearer {ALICE_KEY}"}
        first = asyncio.create_task(
            http.post(live.url + "/v1/chat/completions", json=body, headers=headers)
        )
        await asyncio.wait_for(live.gateway.submitted.wait(), 10)
        async with http.post(live.url + "/v1/chat/completions", json=body, headers=headers) as r:
            assert r.status == 429
            assert int(r.headers["Retry-After"]) >= 1
            error = (await r.json())["error"]
        assert error["code"] == "queue_full" and error["type"] == "rate_limit_error"
        first.cancel()
        with pytest.raises(asyncio.CancelledError):
            await first


async def test_a_bug_is_a_json_500_that_logs_no_prompt(caplog: pytest.LogCaptureFixture) -> None:
    class Broken(ScriptedBackend):
        def count_prompt_tokens(self, endpoint, body):
            raise RuntimeError(f"cannot count {body['messages'][0]['content']}")

    async with live_app(backend=Broken(words)) as live, aiohttp.ClientSession() as http:
        secret_prompt = [{"role": "user", "content": "my secret prompt"}]
        async with http.post(
            live.url + "/v1/chat/completions",
            json={"model": MODEL, "messages": secret_prompt},
            headers={"Authorization": f"Bearer {ALICE_KEY}"},
        ) as r:
            assert r.status == 500
            error = (await r.json())["error"]
        assert error["code"] == "internal_error"
        assert "secret" not in error["message"]
        logged = "\n".join(record.getMessage() for record in caplog.records)
        assert "RuntimeError" in logged and "my secret prompt" not in logged


async def test_oversized_chunked_upload_is_a_413() -> None:
    from http_support import MAX_BODY

    async def body():
        yield b'{"model": "' + MODEL.encode() + b'", "messages": [{"role": "user", "content": "'
        for _ in range(MAX_BODY // 4096 + 2):
            yield b"x" * 4096
        yield b'"}]}'

    async with (
        live_app() as live,
        aiohttp.ClientSession() as http,
        http.post(
            live.url + "/v1/chat/completions",
            data=body(),
            headers={"Authorization": f"Bearer {ALICE_KEY}", "Content-Type": "application/json"},
        ) as r,
    ):
        assert r.status == 413
        assert (await r.json())["error"]["code"] == "request_too_large"
