"""Hot reload: POST /admin/reload and SIGHUP re-read the policy file and swap
tiers, tenants, keys and quotas at once; requests in flight are unaffected; a
bad file is refused with its reason and the old policy stays."""

from __future__ import annotations

import asyncio
import hashlib
import os
import signal
import subprocess
import sys
import threading
from collections.abc import AsyncIterator

import aiohttp
import pytest

from qosgate.backends.base import Chunk, GenerationJob
from tests.http_support import (
    ALICE_KEY,
    ENV,
    MODEL,
    POLICY_YAML,
    ScriptedBackend,
    live_app,
    make_policy,
)

ADMIN = "reload-admin-token"
CAROL_KEY = "test-key-carol"
BASE = POLICY_YAML.replace("server:\n", "server:\n  admin_token_env: QG_TEST_ADMIN\n", 1)
WITH_CAROL = BASE + f"""  - id: carol
    tier: batch
    api_keys: ["sha256:{hashlib.sha256(CAROL_KEY.encode()).hexdigest()}"]
    quotas: {{requests_per_minute: 1}}
"""


@pytest.fixture
def admin_env(monkeypatch):
    monkeypatch.setitem(ENV, "QG_TEST_ADMIN", ADMIN)


def chat(max_tokens: int = 3) -> dict:
    return {"model": MODEL, "messages": [{"role": "user", "content": "hi"}],
            "max_tokens": max_tokens}


async def call(http, url, key, body=None):
    async with http.post(url + "/v1/chat/completions", json=body or chat(),
                         headers={"Authorization": f"Bearer {key}"}) as r:
        return r.status, await r.json()


async def reload(http, url, token=ADMIN):
    async with http.post(url + "/admin/reload",
                         headers={"Authorization": f"Bearer {token}"}) as r:
        return r.status, await r.json()


async def test_a_good_file_is_applied_without_dropping_a_request(admin_env, tmp_path):
    path = tmp_path / "policy.yaml"
    path.write_text(BASE)
    gate = asyncio.Event()

    async def held(job: GenerationJob) -> AsyncIterator[Chunk]:
        await gate.wait()
        yield Chunk(text="done", tokens=1, finish_reason="stop")

    backend = ScriptedBackend(held, free_slots=1)
    async with live_app(make_policy(BASE), backend, policy_path=str(path)) as live, \
            aiohttp.ClientSession() as http:
        # One running (held by the backend), one queued behind it.
        running = asyncio.create_task(call(http, live.url, ALICE_KEY))
        queued = asyncio.create_task(call(http, live.url, ALICE_KEY))
        while len(live.gateway.streams) < 2:
            await live.gateway.submitted.wait()
            live.gateway.submitted.clear()
        status, _ = await call(http, live.url, CAROL_KEY)
        assert status == 401  # carol is not in the running policy yet

        path.write_text(WITH_CAROL.replace("    priority: 2", "    priority: 3"))
        status, body = await reload(http, live.url)
        assert status == 200, body
        assert body["status"] == "reloaded" and body["tenants"] == 3

        gate.set()
        assert (await running)[0] == 200
        assert (await queued)[0] == 200
        # The new tenant, its tier's new priority and its quota are live.
        status, _ = await call(http, live.url, CAROL_KEY)
        assert status == 200
        assert live.gateway.streams[-1].request.tenant == "carol"
        assert live.gateway.scheduler.queue("batch").priority == 3
        status, body = await call(http, live.url, CAROL_KEY)
        assert status == 429 and "requests_per_minute" in body["error"]["message"]


async def test_a_bad_file_is_refused_naming_the_field_and_the_old_policy_stays(
    admin_env, tmp_path
):
    path = tmp_path / "policy.yaml"
    path.write_text(BASE)
    async with live_app(make_policy(BASE), policy_path=str(path)) as live, \
            aiohttp.ClientSession() as http:
        path.write_text(WITH_CAROL.replace("    priority: 2", "    priority: -1"))
        status, body = await reload(http, live.url)
        assert status == 400
        assert body["error"]["code"] == "policy_rejected"
        assert "tiers.batch.priority" in body["error"]["message"]
        assert (await call(http, live.url, CAROL_KEY))[0] == 401  # not applied
        assert (await call(http, live.url, ALICE_KEY))[0] == 200  # still serving

        path.write_text(BASE.replace("speed: 200", "speed: 100"))
        status, body = await reload(http, live.url)
        assert status == 400 and "backend: changed" in body["error"]["message"]

        status, _ = await reload(http, live.url, token="wrong")
        assert status == 401


def test_sighup_reloads_a_running_server(tmp_path):
    path = tmp_path / "policy.yaml"
    path.write_text(BASE)
    env = {**os.environ, **ENV}
    proc = subprocess.Popen(
        [sys.executable, "-m", "qosgate.cli", "serve", "--config", str(path),
         "--host", "127.0.0.1", "--port", "0"],
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env,
    )  # fmt: skip
    try:
        assert proc.stdout is not None and proc.stderr is not None
        url = proc.stdout.readline().strip().rsplit(" ", 1)[-1].removesuffix("/v1")
        reloaded = threading.Event()

        def watch_stderr() -> None:
            for line in proc.stderr:
                if "policy reloaded" in line:
                    reloaded.set()

        threading.Thread(target=watch_stderr, daemon=True).start()

        async def status_of(key: str) -> int:
            async with aiohttp.ClientSession() as http:
                return (await call(http, url, key))[0]

        assert asyncio.run(status_of(CAROL_KEY)) == 401
        path.write_text(WITH_CAROL)
        proc.send_signal(signal.SIGHUP)
        assert reloaded.wait(20), "no reload logged"
        assert asyncio.run(status_of(CAROL_KEY)) == 200
    finally:
        proc.terminate()
        proc.wait(timeout=20)
