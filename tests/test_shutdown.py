"""Graceful shutdown: a stop stops accepting, answers what is queued with 503
and Retry-After, lets running streams finish within the grace, ends the rest
with an error event, settles every reservation, and `qosgate serve` exits 0
on SIGTERM."""

from __future__ import annotations

import asyncio
import json
import signal
import subprocess
import sys
from pathlib import Path

import aiohttp
import pytest

from qosgate.core.request import Outcome
from qosgate.quotas import MemoryQuotaStore, QuotaGuard
from tests.fake_backend import FakeBackend
from tests.http_support import ALICE_KEY, POLICY_YAML, RecordingGateway, Served, make_policy

WAIT_S = 10.0
"""Bound on any one wait: a hang fails the test instead of stalling it."""


def policy_with(grace_s: float):
    text = POLICY_YAML.replace("server:\n", f"server:\n  shutdown_grace_s: {grace_s}\n", 1)
    text = text.replace(
        '    api_keys: ["sha256:', "    quotas: {tokens_per_minute: 100000}\n    api_keys: [\"sha256:", 1
    )
    return make_policy(text)


def body(stream: bool, max_tokens: int = 10) -> dict:
    return {
        "model": "fake-model",
        "messages": [{"role": "user", "content": "hi"}],
        "max_tokens": max_tokens,
        "stream": stream,
    }


HEADERS = {"Authorization": f"Bearer {ALICE_KEY}"}


class Harness(Served):
    """`qosgate serve` over a FakeBackend with two slots, and a quota store
    the test can read after the gateway is gone."""

    def __init__(self, grace_s: float) -> None:
        policy = policy_with(grace_s)
        self.backend = FakeBackend(slots=2)
        self.store = MemoryQuotaStore()
        self.recording = RecordingGateway(
            policy, self.backend, quotas=QuotaGuard.from_policy(policy, store=self.store)
        )
        super().__init__(policy, gateway=self.recording)

    async def admitted(self, n: int) -> None:
        """Until the gateway has admitted `n` requests."""
        async with asyncio.timeout(WAIT_S):
            while len(self.recording.streams) < n:
                self.recording.submitted.clear()
                await self.recording.submitted.wait()

    async def tokens_used(self) -> int:
        guard = QuotaGuard.from_policy(self.policy, store=self.store)
        (state,) = await guard.usage("alice")
        return state.used


async def read_stream(response: aiohttp.ClientResponse) -> list:
    events = []
    async for line in response.content:
        line = line.strip()
        if line.startswith(b"data: "):
            data = line.removeprefix(b"data: ")
            events.append("[DONE]" if data == b"[DONE]" else json.loads(data))
    return events


async def test_stop_answers_queued_503_lets_running_finish_and_settles_everything():
    async with Harness(grace_s=30) as h, aiohttp.ClientSession() as http:
        url = h.url + "/v1/chat/completions"
        # Two running streams (the backend's two slots), three queued.
        run_tasks = [asyncio.create_task(http.post(url, json=body(True), headers=HEADERS))
                     for _ in range(2)]  # fmt: skip
        started = [await asyncio.wait_for(h.backend.started.get(), WAIT_S) for _ in range(2)]
        for rid in started:
            h.backend.emit(rid, 3)  # headers go out with the first chunk
        running = [await asyncio.wait_for(t, WAIT_S) for t in run_tasks]
        assert [r.status for r in running] == [200, 200]
        queued = [
            asyncio.create_task(http.post(url, json=body(stream), headers=HEADERS))
            for stream in (True, False, False)
        ]
        await h.admitted(5)
        tokens_before_stop = await h.tokens_used()
        assert tokens_before_stop > 0  # the five reservations are held

        h.stop.set()
        # Queued requests are answered at once, while the running ones still run.
        for task in queued:
            response = await asyncio.wait_for(task, WAIT_S)
            assert response.status == 503
            assert response.headers["Retry-After"] == "1"
            assert (await response.json())["error"]["code"] == "shutting_down"
        # The listening socket is closed: a new client goes elsewhere.
        with pytest.raises(aiohttp.ClientConnectionError):
            async with aiohttp.ClientSession() as fresh:
                await fresh.get(h.url + "/healthz")
        assert h.task is not None and not h.task.done()

        # The running streams finish within the grace, whole.
        for rid in started:
            h.backend.finish(rid, 2)
        for response in running:
            events = await asyncio.wait_for(read_stream(response), WAIT_S)
            assert events[-1] == "[DONE]"
            assert events[-2]["usage"]["completion_tokens"] == 5
        async with asyncio.timeout(WAIT_S):
            await h.task

    outcomes = sorted(s.request.outcome for s in h.recording.streams)
    assert outcomes == sorted([Outcome.COMPLETED] * 2 + [Outcome.CANCELLED] * 3)
    # The three queued were refunded; the two served paid prompt + output.
    prompt = h.recording.streams[0].request.prompt_tokens
    assert await h.tokens_used() == 2 * (prompt + 5)
    assert h.backend.closed


async def test_streams_still_running_after_the_grace_end_with_an_error_event():
    async with Harness(grace_s=0.2) as h, aiohttp.ClientSession() as http:
        task = asyncio.create_task(
            http.post(h.url + "/v1/chat/completions", json=body(True), headers=HEADERS)
        )
        rid = await asyncio.wait_for(h.backend.started.get(), WAIT_S)
        h.backend.emit(rid, 2)
        response = await asyncio.wait_for(task, WAIT_S)
        h.stop.set()
        # The backend never finishes it: the grace runs out.
        events = await asyncio.wait_for(read_stream(response), WAIT_S)
        assert events[-1]["error"]["code"] == "shutting_down"
        async with asyncio.timeout(WAIT_S):
            await h.task
    (stream,) = h.recording.streams
    assert stream.request.outcome is Outcome.CANCELLED
    assert rid in h.backend.aborted
    # What ran is paid for: the prompt and the two tokens sent.
    assert await h.tokens_used() == stream.request.prompt_tokens + 2


async def test_a_draining_gateway_is_unready_and_closes_keep_alive_connections():
    async with Harness(grace_s=30) as h, aiohttp.ClientSession() as http, \
            aiohttp.ClientSession() as probe, aiohttp.ClientSession() as client:  # fmt: skip
        task = asyncio.create_task(
            http.post(h.url + "/v1/chat/completions", json=body(True), headers=HEADERS)
        )
        rid = await asyncio.wait_for(h.backend.started.get(), WAIT_S)
        h.backend.emit(rid, 1)
        response = await asyncio.wait_for(task, WAIT_S)
        # Two clients holding keep-alive connections from before the stop.
        for session in (probe, client):
            async with session.get(h.url + "/readyz") as ready:
                assert ready.status == 200
        h.stop.set()
        # Their connections still reach the gateway, which says it is going
        # and closes them.
        async with probe.get(h.url + "/readyz") as ready:
            assert ready.status == 503
            assert (await ready.json())["error"]["code"] == "shutting_down"
            assert ready.headers["Connection"] == "close"
        async with client.post(
            h.url + "/v1/chat/completions", json=body(False), headers=HEADERS
        ) as refused:
            assert refused.status == 503
            assert refused.headers["Retry-After"] == "1"
            assert (await refused.json())["error"]["code"] == "shutting_down"
            assert refused.headers["Connection"] == "close"
        h.backend.finish(rid, 1)
        events = await asyncio.wait_for(read_stream(response), WAIT_S)
        assert events[-1] == "[DONE]"


POLICY_FILE = """
version: 1
server: {shutdown_grace_s: 30}
backend: {kind: sim, speed: 0.25, model: fake-model, max_num_seqs: 1}
tiers:
  interactive: {priority: 0, max_queue_wait_ms: 60000}
tenants: []
default_tier: interactive
"""


def test_sigterm_lets_the_running_stream_finish_and_exits_0(tmp_path: Path):
    policy = tmp_path / "policy.yaml"
    policy.write_text(POLICY_FILE)
    proc = subprocess.Popen(
        [sys.executable, "-m", "qosgate.cli", "serve", "--config", str(policy), "--port", "0"],
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
    )
    try:
        assert proc.stdout is not None
        seen = []
        for line in proc.stdout:
            seen.append(line)
            if "serving the OpenAI API at" in line:
                break
        else:
            raise AssertionError("".join(seen))
        api = line.rsplit(" ", 1)[1].strip()

        async def scenario() -> tuple[list, str]:
            async with aiohttp.ClientSession() as http:
                response = await http.post(
                    api + "/chat/completions", json=body(True, max_tokens=40)
                )
                assert response.status == 200
                # The first event is out: the request runs. Stop the server now.
                first = await response.content.readline()
                assert first.startswith(b"data: ")
                proc.send_signal(signal.SIGTERM)
                events = await read_stream(response)
                return events, api

        events, _ = asyncio.run(asyncio.wait_for(scenario(), 60))
        assert events[-1] == "[DONE]"
        assert events[-2]["choices"][0]["finish_reason"] == "length"
        assert proc.wait(timeout=30) == 0
        output = proc.stdout.read()
        assert "stopping: 0 queued requests answered 503, 1 running" in output, output
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
