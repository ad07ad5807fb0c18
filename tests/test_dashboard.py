"""/dashboard in a real headless browser (Debian's chromium, driven by
Playwright): the page loads offline, its charts change while load runs, and
a screenshot is saved as a test artifact (test-artifacts/dashboard.png)."""

from __future__ import annotations

import asyncio
import shutil
from collections.abc import AsyncIterator
from pathlib import Path

import aiohttp
import pytest
from playwright.async_api import async_playwright

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

ADMIN = "dashboard-token"
ARTIFACTS = Path(__file__).resolve().parent.parent / "test-artifacts"
POLICY = POLICY_YAML.replace("server:\n", "server:\n  admin_token_env: QG_TEST_ADMIN\n", 1).replace(
    '    api_keys: ["sha256:', "    quotas: {tokens_per_minute: 2000}\n    api_keys: [\"sha256:", 1
)


def chromium() -> str:
    path = shutil.which("chromium") or shutil.which("chromium-browser")
    if path is None:
        raise RuntimeError("chromium is not installed; `make test` installs it (apt-get install chromium)")
    return path


@pytest.fixture
def admin_env(monkeypatch):
    monkeypatch.setitem(ENV, "QG_TEST_ADMIN", ADMIN)


async def chart(page, canvas_id: str) -> str:
    return await page.evaluate(f"document.getElementById('{canvas_id}').toDataURL()")


async def test_the_dashboard_shows_the_load_as_it_runs(admin_env):
    gate = asyncio.Event()

    async def held(job: GenerationJob) -> AsyncIterator[Chunk]:
        await gate.wait()
        yield Chunk(text="ok", tokens=1, finish_reason="stop")

    backend = ScriptedBackend(held, free_slots=2)
    async with live_app(make_policy(POLICY), backend) as live, aiohttp.ClientSession() as http, \
            async_playwright() as pw:
        browser = await pw.chromium.launch(
            executable_path=chromium(), headless=True, args=["--no-sandbox"]
        )
        # The test reads the page's state with evaluated JS, which the page's
        # own Content-Security-Policy forbids; the second test runs it under
        # that policy.
        context = await browser.new_context(
            viewport={"width": 1400, "height": 1000}, bypass_csp=True
        )
        page = await context.new_page()
        # Everything the page needs comes from qosgate itself.
        outside = []
        page.on("request", lambda r: None if r.url.startswith(live.url) else outside.append(r.url))
        await page.goto(f"{live.url}/dashboard#token={ADMIN}")
        await page.wait_for_function("window.qosgate && window.qosgate.updates >= 1", timeout=15000)
        assert "token=" not in page.url  # the token leaves the address bar
        idle_queue = await chart(page, "queue-chart")

        async def call() -> int:
            body = {"model": MODEL, "messages": [{"role": "user", "content": "hi"}],
                    "max_tokens": 4}
            async with http.post(live.url + "/v1/chat/completions", json=body,
                                 headers={"Authorization": f"Bearer {ALICE_KEY}"}) as r:
                return r.status

        calls = [asyncio.create_task(call()) for _ in range(6)]
        # Two run (held by the backend), four wait: the page must show them.
        await page.wait_for_function(
            "window.qosgate.last && window.qosgate.last.tiers.interactive.queued === 4",
            timeout=15000,
        )
        await page.wait_for_function(
            "window.qosgate.series.queue.interactive.includes(4)", timeout=15000
        )
        busy_queue = await chart(page, "queue-chart")
        assert busy_queue != idle_queue
        legend = await page.inner_text("#queue-legend")
        assert "interactive 4" in legend and "(fleet)" not in legend

        gate.set()
        assert await asyncio.gather(*calls) == [200] * 6
        await page.wait_for_function(
            "(window.qosgate.last.requests.interactive || {}).completed === 6", timeout=15000
        )
        await page.wait_for_function(
            "document.querySelector('#ttft-table tbody').innerText.includes('ms')", timeout=15000
        )
        ttft = await page.inner_text("#ttft-table")
        assert "interactive" in ttft and "500 ms" in ttft
        quotas = await page.inner_text("#quota-table")
        assert "alice" in quotas and "tokens_per_minute" in quotas and "2000" in quotas
        outcome_legend = await page.inner_text("#outcome-legend")
        assert "completed" in outcome_legend

        ARTIFACTS.mkdir(exist_ok=True)
        shot = ARTIFACTS / "dashboard.png"
        await page.screenshot(path=str(shot), full_page=True)
        assert shot.stat().st_size > 10_000
        assert outside == []
        await browser.close()


async def test_without_the_token_the_page_says_so(admin_env):
    async with live_app(make_policy(POLICY)) as live, async_playwright() as pw:
        browser = await pw.chromium.launch(
            executable_path=chromium(), headless=True, args=["--no-sandbox"]
        )
        page = await browser.new_page()
        await page.goto(f"{live.url}/dashboard")
        # Under the page's own Content-Security-Policy, its script runs.
        await page.wait_for_selector("#token-form:not([hidden])", timeout=15000)
        assert "admin token" in (await page.inner_text("#status")).lower()
        await browser.close()


async def test_the_token_box_hides_once_a_valid_token_is_given(admin_env):
    async with live_app(make_policy(POLICY)) as live, async_playwright() as pw:
        browser = await pw.chromium.launch(
            executable_path=chromium(), headless=True, args=["--no-sandbox"]
        )
        page = await browser.new_page(viewport={"width": 1400, "height": 1000})
        await page.goto(f"{live.url}/dashboard")
        await page.wait_for_selector("#token-form:not([hidden])", timeout=15000)
        assert await page.is_visible("#token-form")
        await page.fill("#token", ADMIN)
        await page.click("#token-form button")
        await page.wait_for_selector("#status:not(.down)", timeout=15000)
        # Hidden as drawn, not only as marked: the form's own display rule
        # must not outrank [hidden].
        await page.wait_for_selector("#token-form", state="hidden", timeout=15000)
        assert not await page.is_visible("#token-form")
        ARTIFACTS.mkdir(exist_ok=True)
        shot = ARTIFACTS / "dashboard-token-given.png"
        await page.screenshot(path=str(shot))
        assert shot.stat().st_size > 10_000
        # The charts' history goes up to an hour.
        await page.select_option("#history", "3600")
        assert await page.evaluate("window.qosgate.shown") == 2400
        title = await page.inner_text("#outcome-chart >> xpath=preceding-sibling::h2")
        assert "per tier" not in title
        await browser.close()


class _ReplicaBackend(ScriptedBackend):
    """A fleet replica's backend, as the dashboard sees it: the shared queue."""

    def __init__(self) -> None:
        async def answer(job: GenerationJob) -> AsyncIterator[Chunk]:
            yield Chunk(text="ok", tokens=1, finish_reason="stop")

        super().__init__(answer)

    async def fleet_levels(self) -> dict:
        return {"queued": {"interactive": 7, "batch": 0}, "running": 3}


async def test_a_fleet_replica_draws_the_shared_queue_beside_its_own(admin_env):
    async with live_app(make_policy(POLICY), _ReplicaBackend()) as live, \
            aiohttp.ClientSession() as http, async_playwright() as pw:
        async with http.get(live.url + "/admin/stats",
                            headers={"Authorization": f"Bearer {ADMIN}"}) as r:
            assert (await r.json())["fleet"] == {
                "queued": {"interactive": 7, "batch": 0}, "running": 3,
            }
        browser = await pw.chromium.launch(
            executable_path=chromium(), headless=True, args=["--no-sandbox"]
        )
        context = await browser.new_context(bypass_csp=True)
        page = await context.new_page()
        await page.goto(f"{live.url}/dashboard#token={ADMIN}")
        await page.wait_for_function(
            "window.qosgate && (window.qosgate.series.queue['interactive (fleet)'] || []).includes(7)",
            timeout=15000,
        )
        legend = await page.inner_text("#queue-legend")
        assert "interactive (fleet) 7" in legend and "interactive 0" in legend
        backend = await page.inner_text("#backend-table")
        assert "running on engine nodes" in backend and "3" in backend
        await browser.close()


async def test_the_dashboard_shows_batch_jobs_and_their_lines(admin_env, tmp_path: Path):
    gate = asyncio.Event()

    async def held(job: GenerationJob) -> AsyncIterator[Chunk]:
        await gate.wait()
        yield Chunk(text="ok", tokens=1, finish_reason="stop")

    policy = make_policy(POLICY + f"batch:\n  data_dir: {tmp_path}\n  in_flight_per_job: 1\n")
    async with live_app(policy, ScriptedBackend(held)) as live, aiohttp.ClientSession(
        headers={"Authorization": f"Bearer {ALICE_KEY}"}
    ) as http, async_playwright() as pw:
        line = ('{"custom_id": "%d", "method": "POST", "url": "/v1/completions", '
                '"body": {"model": "%s", "prompt": "hi", "max_tokens": 2}}\n')  # fmt: skip
        form = aiohttp.FormData()
        form.add_field("purpose", "batch")
        form.add_field("file", "".join(line % (i, MODEL) for i in range(3)).encode(),
                       filename="in.jsonl")  # fmt: skip
        async with http.post(live.url + "/v1/files", data=form) as r:
            uploaded = await r.json()
        body = {"input_file_id": uploaded["id"], "endpoint": "/v1/completions",
                "completion_window": "24h"}  # fmt: skip
        async with http.post(live.url + "/v1/batches", json=body) as r:
            batch = await r.json()
        browser = await pw.chromium.launch(
            executable_path=chromium(), headless=True, args=["--no-sandbox"]
        )
        # Read with evaluated JS, which the page's own policy forbids (as above).
        page = await (await browser.new_context(bypass_csp=True)).new_page()
        await page.goto(f"{live.url}/dashboard#token={ADMIN}")
        table = "document.querySelector('#batch-jobs-table tbody').innerText"
        await page.wait_for_function(f"{table}.includes('in_progress')", timeout=15000)
        shown = await page.inner_text("#batch-jobs-table")
        assert "alice lines to run\t3" in shown, shown
        gate.set()
        await live.batches.wait(batch["id"])
        await page.wait_for_function(f"{table}.includes('completed')", timeout=15000)
        shown = await page.inner_text("#batch-jobs-table")
        assert "in_progress" not in shown and "lines to run" not in shown, shown
        await browser.close()
