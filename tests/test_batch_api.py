"""The Batch API end to end with the official `openai` client: files in,
a batch run through the gateway on the simulated GPU, the output and error
files read back in OpenAI's line format; bad files and bad lines; one
tenant's objects hidden from another; a gateway without batches."""

from __future__ import annotations

import asyncio
import hashlib
import json
from pathlib import Path
from typing import Any

import aiohttp
import openai
import pytest
from prometheus_client.parser import text_string_to_metric_families
from http_support import MODEL, ScriptedBackend, hang_after_one, live_app, make_policy

ALICE_KEY = "batch-key-alice"
BOB_KEY = "batch-key-bob"


def _policy_yaml(data_dir: Path | None, *, in_flight: int = 8, extra: str = "") -> str:
    batch = f"batch:\n  data_dir: {data_dir}\n  in_flight_per_job: {in_flight}\n{extra}" if data_dir else ""
    return f"""
version: 1
server: {{auth_failures_per_minute: 0, admin_token_env: null}}
backend: {{kind: sim, speed: 200, model: {MODEL}}}
tiers:
  interactive: {{priority: 0, ttft_slo_ms: 500, max_queue_wait_ms: 60000, max_tokens: 16}}
  bulk:
    priority: 2
    e2e_slo_ms: 600000
    max_queue_wait_ms: 60000
    on_timeout: delay
    max_tokens: 24
tenants:
  - id: alice
    tier: interactive
    api_keys: ["sha256:{hashlib.sha256(ALICE_KEY.encode()).hexdigest()}"]
  - id: bob
    tier: interactive
    api_keys: ["sha256:{hashlib.sha256(BOB_KEY.encode()).hexdigest()}"]
{batch}"""


def _client(url: str, key: str = ALICE_KEY) -> openai.AsyncOpenAI:
    return openai.AsyncOpenAI(base_url=url + "/v1", api_key=key, max_retries=0, timeout=30)


def _line(custom_id: str, *, url: str = "/v1/chat/completions", **body: Any) -> dict[str, Any]:
    if url == "/v1/chat/completions":
        payload = {"model": MODEL, "messages": [{"role": "user", "content": f"hi {custom_id}"}]}
    else:
        payload = {"model": MODEL, "prompt": f"hi {custom_id}"}
    payload.update(max_tokens=4)
    payload.update(body)
    return {"custom_id": custom_id, "method": "POST", "url": url, "body": payload}


def _jsonl(lines: list[Any]) -> bytes:
    return b"".join(
        (line if isinstance(line, bytes) else json.dumps(line).encode()) + b"\n" for line in lines
    )


async def _run(client: openai.AsyncOpenAI, live: Any, lines: list[Any], **create: Any) -> Any:
    """Upload, create, wait for the job to end, and the batch as the API
    then shows it."""
    uploaded = await client.files.create(file=("in.jsonl", _jsonl(lines)), purpose="batch")
    batch = await client.batches.create(
        input_file_id=uploaded.id, endpoint=create.pop("endpoint", "/v1/chat/completions"),
        completion_window=create.pop("completion_window", "24h"), **create,
    )  # fmt: skip
    assert batch.status == "validating"
    await live.batches.wait(batch.id)
    return await client.batches.retrieve(batch.id)


async def _lines_of(client: openai.AsyncOpenAI, file_id: str | None) -> list[dict[str, Any]]:
    if file_id is None:
        return []
    content = await client.files.content(file_id)
    return [json.loads(line) for line in content.text.splitlines()]


async def test_a_200_line_batch_round_trip(tmp_path: Path) -> None:
    policy = make_policy(_policy_yaml(tmp_path))
    async with live_app(policy) as live:
        client = _client(live.url)
        lines = [_line(f"req-{i}", max_tokens=1 + i % 4) for i in range(200)]
        batch = await _run(client, live, lines, metadata={"job": "nightly"})
        assert batch.status == "completed", batch
        assert batch.request_counts.total == 200
        assert batch.request_counts.completed == 200
        assert batch.request_counts.failed == 0
        assert batch.metadata == {"job": "nightly"}
        assert batch.error_file_id is None
        assert batch.in_progress_at and batch.finalizing_at and batch.completed_at
        out = await _lines_of(client, batch.output_file_id)
        assert sorted(o["custom_id"] for o in out) == sorted(f"req-{i}" for i in range(200))
        for o in out:
            assert o["id"].startswith("batch_req_")
            assert o["error"] is None
            response = o["response"]
            assert response["status_code"] == 200 and response["request_id"]
            body = response["body"]
            assert body["object"] == "chat.completion" and body["model"] == MODEL
            assert body["choices"][0]["message"]["role"] == "assistant"
            asked = 1 + int(o["custom_id"].split("-")[1]) % 4
            assert body["usage"]["completion_tokens"] == asked
        # Every line went through the gateway at the policy's delay tier.
        tiers = {s.request.tier for s in live.gateway.streams}
        assert tiers == {"bulk"}
        assert len(live.gateway.streams) == 200
        output = await client.files.retrieve(batch.output_file_id)
        assert output.purpose == "batch_output" and output.bytes > 0
        metrics = await _metrics(live.url)
        assert metrics[("qosgate_batch_lines_total", (("result", "completed"), ("tenant", "alice")))] == 200
        assert metrics[("qosgate_batch_jobs", (("status", "completed"),))] == 1
        assert metrics[("qosgate_batch_jobs", (("status", "in_progress"),))] == 0
        await client.close()


async def _metrics(url: str) -> dict[tuple[str, tuple[tuple[str, str], ...]], float]:
    async with aiohttp.ClientSession() as http, http.get(url + "/metrics") as response:
        text = await response.text()
    return {
        (sample.name, tuple(sorted(sample.labels.items()))): sample.value
        for family in text_string_to_metric_families(text)
        for sample in family.samples
    }


async def test_completions_endpoint_and_error_lines(tmp_path: Path) -> None:
    policy = make_policy(_policy_yaml(tmp_path))
    async with live_app(policy) as live:
        client = _client(live.url)
        url = "/v1/completions"
        lines = [
            _line("fine", url=url),
            _line("clamped", url=url, max_tokens=10_000),  # over the tier: clamped, as over HTTP
            _line("too-long", url=url, max_tokens=200_000),  # past the model's context
            _line("bad-field", url=url, temperature=7),
            _line("no-model", url=url, model="gpt-nothing"),
            _line("streamed", url=url, stream=True),
        ]
        batch = await _run(client, live, lines, endpoint=url)
        assert batch.status == "completed"
        assert (batch.request_counts.completed, batch.request_counts.failed) == (2, 4)
        out = {o["custom_id"]: o for o in await _lines_of(client, batch.output_file_id)}
        errors = {o["custom_id"]: o for o in await _lines_of(client, batch.error_file_id)}
        assert set(out) == {"fine", "clamped"}
        assert out["fine"]["response"]["body"]["object"] == "text_completion"
        assert out["clamped"]["response"]["body"]["usage"]["completion_tokens"] == 24
        assert set(errors) == {"too-long", "bad-field", "no-model", "streamed"}
        codes = {k: (e["response"]["status_code"], e["response"]["body"]["error"]["code"])
                 for k, e in errors.items()}  # fmt: skip
        assert codes == {
            "too-long": (400, "context_length_exceeded"), "bad-field": (400, "invalid_request"),
            "no-model": (404, "model_not_found"), "streamed": (400, "invalid_request"),
        }  # fmt: skip
        assert all(e["error"] is None and e["id"].startswith("batch_req_") for e in errors.values())
        await client.close()


@pytest.mark.parametrize(
    "lines, where",
    [
        ([_line("a"), b"{not json", _line("c")], "line 2: not valid JSON"),
        ([_line("a"), {"method": "POST", "url": "/v1/completions", "body": {}}], "line 2: custom_id"),
        ([_line("a"), _line("b"), _line("a")], "line 3: custom_id 'a' is used by an earlier line"),
        ([_line("a"), [1, 2]], "line 2: each line must be a JSON object"),
        ([_line("a"), _line("b", url="/v1/embeddings")], "line 2: url must be one of"),
        ([{**_line("a"), "method": "GET"}], "line 1: method"),
        ([{**_line("a"), "body": "x"}], "line 1: body must be a JSON object"),
        ([b"", b"  "], "the file holds no requests"),
    ],
)
async def test_bad_files_are_refused_at_upload_naming_the_line(
    tmp_path: Path, lines: list[Any], where: str
) -> None:
    async with live_app(make_policy(_policy_yaml(tmp_path))) as live:
        client = _client(live.url)
        with pytest.raises(openai.BadRequestError) as caught:
            await client.files.create(file=("in.jsonl", _jsonl(lines)), purpose="batch")
        error = caught.value.body
        assert caught.value.status_code == 400
        assert where in error["message"], error
        assert error["code"] == "invalid_file"
        # Nothing of it is kept.
        assert (await client.files.list()).data == []
        await client.close()


async def test_upload_limits_and_create_checks(tmp_path: Path) -> None:
    extra = "  max_lines: 3\n  max_file_bytes: 2000\n"
    async with live_app(make_policy(_policy_yaml(tmp_path, extra=extra))) as live:
        client = _client(live.url)
        with pytest.raises(openai.BadRequestError, match="line 4: the file holds more than 3"):
            await client.files.create(
                file=("in.jsonl", _jsonl([_line(str(i)) for i in range(4)])), purpose="batch"
            )
        big = _jsonl([_line("a", padding="x" * 3000)])
        with pytest.raises(openai.APIStatusError) as caught:
            await client.files.create(file=("in.jsonl", big), purpose="batch")
        assert caught.value.status_code == 413
        with pytest.raises(openai.BadRequestError, match="purpose"):
            await client.files.create(
                file=("in.jsonl", _jsonl([_line("a")])), purpose="fine-tune"
            )
        mixed = await client.files.create(
            file=("in.jsonl", _jsonl([_line("a"), _line("b", url="/v1/completions")])),
            purpose="batch",
        )
        with pytest.raises(openai.BadRequestError, match="line 2: url '/v1/completions' is not"):
            await client.batches.create(
                input_file_id=mixed.id, endpoint="/v1/chat/completions", completion_window="24h"
            )
        with pytest.raises(openai.BadRequestError, match="completion_window"):
            await client.batches.create(
                input_file_id=mixed.id, endpoint="/v1/chat/completions", completion_window="soon"
            )
        with pytest.raises(openai.BadRequestError, match="endpoint"):
            await client.batches.create(
                input_file_id=mixed.id, endpoint="/v1/embeddings",  # type: ignore[arg-type]
                completion_window="24h",
            )  # fmt: skip
        with pytest.raises(openai.NotFoundError):
            await client.batches.create(
                input_file_id="file-nothing", endpoint="/v1/completions", completion_window="24h"
            )
        await client.close()


async def test_a_line_is_no_longer_than_a_request_body(tmp_path: Path) -> None:
    text = _policy_yaml(tmp_path).replace("server: {", "server: {max_body_bytes: 1000, ")
    async with live_app(make_policy(text)) as live:
        client = _client(live.url)
        lines = [_line("short"), _line("long", padding="x" * 1000)]
        with pytest.raises(openai.BadRequestError, match="line 2: longer than 1000 bytes"):
            await client.files.create(file=("in.jsonl", _jsonl(lines)), purpose="batch")
        await client.close()


async def test_an_upload_that_stalls_gets_408(tmp_path: Path) -> None:
    text = _policy_yaml(tmp_path).replace("server: {", "server: {body_timeout_s: 0.3, ")
    async with live_app(make_policy(text)) as live:
        host, port = live.url.removeprefix("http://").split(":")
        form = (b"--b\r\nContent-Disposition: form-data; name=\"purpose\"\r\n\r\nbatch\r\n"
                b"--b\r\nContent-Disposition: form-data; name=\"file\"; filename=\"x\"\r\n\r\n")
        head = (f"POST /v1/files HTTP/1.1\r\nHost: x\r\nAuthorization: Bearer {ALICE_KEY}\r\n"
                "Content-Type: multipart/form-data; boundary=b\r\n"
                "Content-Length: 100000\r\n\r\n").encode()  # fmt: skip
        reader, writer = await asyncio.open_connection(host, int(port))
        writer.write(head + form + b'{"custom_id": ')  # and then nothing
        async with asyncio.timeout(10):
            head = await reader.readuntil(b"\r\n\r\n")
            length = int(head.lower().split(b"content-length: ", 1)[1].split(b"\r\n", 1)[0])
            body = await reader.readexactly(length)
        writer.close()
        assert head.startswith(b"HTTP/1.1 408 Request Timeout\r\n"), head
        assert b"Connection: close" in head
        assert json.loads(body)["error"]["code"] == "request_timeout"
        assert [p.name for p in (tmp_path / "files").iterdir()] == []  # nothing kept


async def test_a_tenant_sees_only_its_own(tmp_path: Path) -> None:
    async with live_app(make_policy(_policy_yaml(tmp_path))) as live:
        alice, bob = _client(live.url), _client(live.url, BOB_KEY)
        batch = await _run(alice, live, [_line("a"), _line("b")])
        assert batch.status == "completed"
        for call in (
            lambda: bob.batches.retrieve(batch.id),
            lambda: bob.batches.cancel(batch.id),
            lambda: bob.files.retrieve(batch.input_file_id),
            lambda: bob.files.content(batch.output_file_id),
            lambda: bob.files.delete(batch.input_file_id),
        ):
            with pytest.raises(openai.NotFoundError):
                await call()
        assert (await bob.batches.list()).data == []
        assert (await bob.files.list()).data == []
        assert [f.id for f in (await alice.files.list()).data] == [
            batch.output_file_id, batch.input_file_id
        ]
        deleted = await alice.files.delete(batch.input_file_id)
        assert deleted.deleted and deleted.id == batch.input_file_id
        with pytest.raises(openai.NotFoundError):
            await alice.files.retrieve(batch.input_file_id)
        with pytest.raises(openai.AuthenticationError):
            await _client(live.url, "wrong-key").batches.list()
        await alice.close()
        await bob.close()


async def test_listing_pages_like_openai(tmp_path: Path) -> None:
    async with live_app(make_policy(_policy_yaml(tmp_path))) as live:
        client = _client(live.url)
        uploaded = await client.files.create(file=("in.jsonl", _jsonl([_line("a")])),
                                             purpose="batch")  # fmt: skip
        ids = []
        for _ in range(5):
            batch = await client.batches.create(
                input_file_id=uploaded.id, endpoint="/v1/chat/completions",
                completion_window="24h",
            )  # fmt: skip
            ids.append(batch.id)
            await live.batches.wait(batch.id)
        newest_first = ids[::-1]
        first = await client.batches.list(limit=2)
        assert [b.id for b in first.data] == newest_first[:2]
        assert first.has_more and first.last_id == newest_first[1]
        rest = await client.batches.list(limit=10, after=first.last_id)
        assert [b.id for b in rest.data] == newest_first[2:] and not rest.has_more
        # The client's own paging walks them all.
        assert [b.id async for b in client.batches.list(limit=2)] == newest_first
        with pytest.raises(openai.BadRequestError):
            await client.batches.list(limit=0)
        await client.close()


async def test_cancel_and_expiry_write_the_lines_left(tmp_path: Path) -> None:
    # A backend that never finishes: lines stay running until the job ends them.
    policy = make_policy(_policy_yaml(tmp_path, in_flight=2))
    async with live_app(policy, ScriptedBackend(hang_after_one)) as live:
        client = _client(live.url)
        uploaded = await client.files.create(
            file=("in.jsonl", _jsonl([_line(f"r{i}") for i in range(5)])), purpose="batch"
        )
        batch = await client.batches.create(
            input_file_id=uploaded.id, endpoint="/v1/chat/completions", completion_window="24h"
        )
        cancelling = await client.batches.cancel(batch.id)
        assert cancelling.status == "cancelling" and cancelling.cancelling_at
        await live.batches.wait(batch.id)
        ended = await client.batches.retrieve(batch.id)
        assert ended.status == "cancelled" and ended.cancelled_at
        assert (ended.request_counts.completed, ended.request_counts.failed) == (0, 5)
        errors = await _lines_of(client, ended.error_file_id)
        assert sorted(e["custom_id"] for e in errors) == [f"r{i}" for i in range(5)]
        assert {e["error"]["code"] for e in errors} == {"batch_cancelled"}
        assert all(e["response"] is None for e in errors)
        with pytest.raises(openai.APIStatusError) as caught:
            await client.batches.cancel(batch.id)
        assert caught.value.status_code == 409

        expiring = await client.batches.create(
            input_file_id=uploaded.id, endpoint="/v1/chat/completions", completion_window="1s"
        )
        await live.batches.wait(expiring.id)
        ended = await client.batches.retrieve(expiring.id)
        assert ended.status == "expired" and ended.expired_at
        errors = await _lines_of(client, ended.error_file_id)
        assert sorted(e["custom_id"] for e in errors) == [f"r{i}" for i in range(5)]
        assert {e["error"]["code"] for e in errors} == {"batch_expired"}
        await client.close()


async def test_without_a_data_dir_the_routes_say_so() -> None:
    async with live_app(make_policy(_policy_yaml(None))) as live:
        client = _client(live.url)
        for call in (
            lambda: client.batches.list(),
            lambda: client.batches.retrieve("batch_x"),
            lambda: client.files.create(file=("in.jsonl", _jsonl([_line("a")])), purpose="batch"),
        ):
            with pytest.raises(openai.APIStatusError) as caught:
                await call()
            assert caught.value.status_code == 404
            assert caught.value.body["code"] == "batches_not_configured"
        await client.close()


async def test_hostile_requests_get_a_clear_4xx(tmp_path: Path) -> None:
    """Bodies, forms and parameters no client should send: each a 4xx in
    OpenAI's error shape, never a 5xx; the gateway still serves after."""
    async with live_app(make_policy(_policy_yaml(tmp_path, in_flight=1))) as live:
        client = _client(live.url)
        running = await client.files.create(
            file=("in.jsonl", _jsonl([_line(f"r{i}") for i in range(50)])), purpose="batch"
        )
        batch = await client.batches.create(
            input_file_id=running.id, endpoint="/v1/chat/completions", completion_window="24h"
        )
        headers = {"Authorization": f"Bearer {ALICE_KEY}"}
        form = aiohttp.FormData()
        form.add_field("file", b"{}", filename="x.jsonl")
        no_purpose = aiohttp.FormData()
        no_purpose.add_field("file", _jsonl([_line("a")]), filename="x.jsonl")
        cases: list[tuple[str, str, dict[str, Any], int]] = [
            ("POST", "/v1/files", {"json": {"purpose": "batch"}}, 400),
            ("POST", "/v1/files", {"data": b"--x\r\nbroken", "headers": {
                "Content-Type": "multipart/form-data; boundary=x"}}, 400),
            ("POST", "/v1/files", {"data": form}, 400),
            ("POST", "/v1/files", {"data": no_purpose}, 400),
            ("GET", "/v1/files?limit=abc", {}, 400),
            ("GET", "/v1/files?limit=10001", {}, 400),
            ("GET", "/v1/files?order=sideways", {}, 400),
            ("GET", "/v1/batches?limit=-1", {}, 400),
            ("GET", "/v1/files/" + "x" * 5000, {}, 404),
            ("DELETE", f"/v1/files/{running.id}", {}, 409),
            ("POST", "/v1/batches", {"data": b"{not json",
                                     "headers": {"Content-Type": "application/json"}}, 400),
            ("POST", "/v1/batches", {"json": [1]}, 400),
            ("POST", "/v1/batches", {"json": {"input_file_id": running.id}}, 400),
            ("POST", "/v1/batches", {"json": {
                "input_file_id": running.id, "endpoint": "/v1/chat/completions",
                "completion_window": "24h", "surprise": 1}}, 400),
            ("POST", "/v1/batches", {"json": {
                "input_file_id": running.id, "endpoint": "/v1/chat/completions",
                "completion_window": "24h", "metadata": {"k": 1}}}, 400),
            ("POST", "/v1/batches", {"json": {
                "input_file_id": running.id, "endpoint": "/v1/chat/completions",
                "completion_window": "9999999d"}}, 400),
            ("POST", "/v1/batches", {"data": b"{}", "headers": {"Content-Type": "text/plain"}}, 415),
            ("POST", "/v1/batches/batch_nothing/cancel", {}, 404),
            ("PUT", "/v1/batches", {}, 405),
        ]  # fmt: skip
        async with aiohttp.ClientSession(headers=headers) as http:
            for method, path, kwargs, status in cases:
                async with http.request(method, live.url + path, **kwargs) as response:
                    body = await response.json()
                    assert response.status == status, (method, path, body)
                    assert set(body["error"]) == {"message", "type", "code", "param"}
        await client.batches.cancel(batch.id)
        await live.batches.wait(batch.id)
        assert (await client.files.delete(running.id)).deleted
        await client.close()


async def test_a_batch_store_that_does_not_answer_is_a_503_to_retry(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """Batches in a fleet's Redis that is down: every call of the Batch API
    is a 503 `batch_store_unavailable` with a Retry-After, naming no host;
    never a 500."""
    from tests.redis_server import free_port

    dead = f"redis://127.0.0.1:{free_port()}/0"
    extra = f"  store: redis\nfleet: {{role: gateway, url: '{dead}', timeout_ms: 500}}\n"
    async with live_app(make_policy(_policy_yaml(tmp_path, extra=extra))) as live:
        client = _client(live.url)
        for call in (
            lambda: client.batches.list(),
            lambda: client.batches.retrieve("batch_x"),
            lambda: client.files.list(),
            lambda: client.files.create(file=("in.jsonl", _jsonl([_line("a")])), purpose="batch"),
        ):
            with pytest.raises(openai.APIStatusError) as caught:
                await call()
            assert caught.value.status_code == 503
            assert caught.value.body["code"] == "batch_store_unavailable"
            assert caught.value.response.headers["Retry-After"] == "1"
            assert "127.0.0.1" not in caught.value.body["message"]
        await client.close()
    # The operator's log says why (the client's answer does not).
    logged = [r.getMessage() for r in caplog.records if r.name == "qosgate.http"]
    assert any(m.startswith("batch_store_unavailable: redis unreachable") for m in logged), logged
