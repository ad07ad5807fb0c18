"""Hot reload: POST /admin/reload and SIGHUP re-read the policy file and swap
tiers, tenants, keys and quotas at once; requests in flight are unaffected; a
bad file is refused with its reason and the old policy stays."""

from __future__ import annotations

import asyncio
import hashlib
import os
import queue
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


def start_server(path) -> tuple[subprocess.Popen[str], str]:
    """`qosgate serve` on `path` in a process of its own, and its base URL."""
    env = {**os.environ, **ENV}
    proc = subprocess.Popen(
        [sys.executable, "-m", "qosgate.cli", "serve", "--config", str(path),
         "--host", "127.0.0.1", "--port", "0"],
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env,
    )  # fmt: skip
    assert proc.stdout is not None
    return proc, proc.stdout.readline().strip().rsplit(" ", 1)[-1].removesuffix("/v1")


def test_sighup_reloads_a_running_server(tmp_path):
    path = tmp_path / "policy.yaml"
    path.write_text(BASE)
    proc, url = start_server(path)
    try:
        assert proc.stderr is not None
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


def configmap_dir(root, version: str, text: str) -> None:
    """Write `text` as the next version of a ConfigMap volume's policy.yaml,
    as the kubelet does: a new timestamped directory, then `..data` swapped
    to it by renaming a symlink over it; policy.yaml -> ..data/policy.yaml
    never changes."""
    (root / version).mkdir()
    (root / version / "policy.yaml").write_text(text)
    (root / "..data_tmp").symlink_to(version)
    os.replace(root / "..data_tmp", root / "..data")
    if not (root / "policy.yaml").is_symlink():
        (root / "policy.yaml").symlink_to("..data/policy.yaml")


def test_a_watched_policy_reloads_when_its_configmap_volume_is_swapped(tmp_path):
    watched = BASE.replace("server:\n", "server:\n  policy_watch_s: 0.2\n", 1)
    configmap_dir(tmp_path, "..2026_01_01_v1", watched)
    proc, url = start_server(tmp_path / "policy.yaml")
    try:
        assert proc.stderr is not None
        lines: queue.Queue[str] = queue.Queue()

        def pump_stderr() -> None:
            for line in proc.stderr:
                lines.put(line)

        threading.Thread(target=pump_stderr, daemon=True).start()

        def next_reload_line() -> str:
            while True:
                line = lines.get(timeout=20)
                if "reload" in line:
                    return line

        async def status_of(key: str) -> int:
            async with aiohttp.ClientSession() as http:
                return (await call(http, url, key))[0]

        assert asyncio.run(status_of(CAROL_KEY)) == 401
        # A bad version is refused and logged; the running policy stays.
        configmap_dir(tmp_path, "..2026_01_01_v2", watched + "  - id: broken\n")
        assert "reload refused" in next_reload_line()
        assert asyncio.run(status_of(CAROL_KEY)) == 401
        carol = WITH_CAROL.replace("server:\n", "server:\n  policy_watch_s: 0.2\n", 1)
        configmap_dir(tmp_path, "..2026_01_01_v3", carol)
        assert "policy reloaded" in next_reload_line()
        assert asyncio.run(status_of(CAROL_KEY)) == 200
    finally:
        proc.terminate()
        proc.wait(timeout=20)
