"""`qosgate bench` end to end: the CLI entry point, its worker processes and a
live endpoint (the real gateway on the simulated GPU, or a fake upstream that
refuses, breaks and answers on purpose).

The CLI blocks, so it runs in a thread while the test's event loop serves the
endpoint. Open-loop runs last a fraction of a second of real time: that is the
scenario's length, not a wait for something to happen.
"""

from __future__ import annotations

import asyncio
import itertools
import json
from pathlib import Path
from typing import Any, Self

import pytest
import yaml
import aiohttp
from aiohttp import web
from http_support import ALICE_KEY, BOB_KEY, MODEL, live_app

from qosgate.bench.client import COMPLETED, Job
from qosgate.bench.commands import BenchUsageError, api_base, api_bases
from qosgate.bench.plan import plan_open, sweep_pool
from qosgate.bench.pool import split_open, split_users
from qosgate.bench.report import Record, build_bench_report
from qosgate.bench.scenario import BenchScenario, load_bench_scenario
from qosgate.cli import main

TIER_KEYS = (
    "requests", "completed", "rejected", "expired", "errors", "ttft_slo_attainment",
    "ttft_p50_s", "ttft_p99_s", "e2e_p50_s", "e2e_p99_s", "tpot_p50_s", "itl_p99_s",
    "queue_wait_p99_s", "queue_wait_max_s", "goodput_rps",
)  # fmt: skip
TOTAL_KEYS = (
    "requests", "completed", "rejected", "errors", "throughput_tokens_per_s",
    "output_tokens_per_s", "throughput_rps", "goodput_rps", "max_service_difference",
    "avg_service_difference", "lost",
)  # fmt: skip


def write(tmp_path: Path, data: dict[str, Any], name: str = "bench.yaml") -> Path:
    path = tmp_path / name
    path.write_text(yaml.safe_dump(data, sort_keys=False))
    return path


async def bench(*argv: str) -> int:
    return await asyncio.to_thread(main, ["bench", *argv, "--quiet"])


def open_scenario(**overrides: Any) -> dict[str, Any]:
    data: dict[str, Any] = {
        "kind": "bench",
        "name": "mini-open",
        "model": MODEL,
        "stream": True,
        "seed": 3,
        "duration_s": 0.6,
        "timeout_s": 20,
        "arrivals": {"process": "poisson", "rate_rps": 50},
        "lengths": {"prompt": {"median": 12}, "output": {"median": 4}},
        "classes": [
            {"name": "alice", "tier": "interactive", "api_key": ALICE_KEY, "share": 2},
            {"name": "bob", "tier": "batch", "api_key": BOB_KEY, "share": 1},
            {"name": "stranger", "tier": "batch", "api_key": "no-such-key", "share": 1},
        ],
        "tiers": {"interactive": {"ttft_slo_ms": 5000}, "batch": {"e2e_slo_ms": 60000}},
    }
    data.update(overrides)
    return data


# -- against the real gateway -------------------------------------------------------------


async def test_open_loop_against_the_gateway_counts_every_request(tmp_path: Path) -> None:
    path = write(tmp_path, open_scenario())
    scenario = load_bench_scenario(path)
    planned = plan_open(scenario)
    strangers = sum(1 for spec in planned if spec[2] == 2)
    assert len(planned) >= 15 and strangers >= 1
    out = tmp_path / "out.json"
    plot = tmp_path / "out.png"

    async with live_app() as live:
        rc = await bench(live.url, str(path), "--json", str(out), "--plot", str(plot),
                         "--workers", "2", "--label", "gw")
    assert rc == 0
    result = json.loads(out.read_text())
    assert result["scenario"] == "mini-open" and result["mode"] == "open"
    assert result["url"] == live.url + "/v1"
    assert result["urls"] == [live.url + "/v1"]
    run = result["policies"]["gw"]
    for tier in ("interactive", "batch"):
        for key in TIER_KEYS:
            assert key in run["tiers"][tier], (tier, key)
    for key in TOTAL_KEYS:
        assert key in run["totals"], key
    totals = run["totals"]
    assert totals["lost"] == 0
    assert totals["sent"] == totals["requests"] == len(planned)
    # The unknown key is an error (401), counted, never dropped.
    assert totals["errors"] == strangers
    assert totals["error_types"] == {"http_401": strangers}
    assert totals["completed"] == len(planned) - strangers
    assert run["tenants"]["stranger"]["errors"] == strangers
    interactive = run["tiers"]["interactive"]
    assert interactive["completed"] == interactive["requests"] > 0
    assert interactive["ttft_slo_attainment"] == 1.0
    assert interactive["queue_wait_p99_s"] is None  # invisible to a client
    assert 0 < interactive["ttft_p50_s"] <= interactive["e2e_p50_s"]
    assert plot.stat().st_size > 0


# -- against a fake upstream ---------------------------------------------------------------


class Upstream:
    """Answers request n (in arrival order) by `script[n % len(script)]`:
    ok, 429, 503, cut (a stream that breaks off), error_event, long_tail
    (a long body after [DONE]) or bad_usage (ok, but its usage counts are
    JSON's true and a negative number)."""

    def __init__(self, script: tuple[str, ...]) -> None:
        self.script = script
        self.count = 0
        self.active = 0
        self.max_active = 0
        self.seen: dict[str, int] = {}
        self.rids: list[int] = []
        """The request number of each request received (from its prompt's "[rid] ")."""
        self.sessions: list[tuple[int, str | None]] = []
        """(request number, the X-Session-Id it carried) per request received."""
        self.connections: set[Any] = set()
        """The client addresses (one per connection) requests came from."""
        self._runner: web.AppRunner | None = None
        self.url = ""

    async def __aenter__(self) -> Self:
        app = web.Application()
        app.router.add_post("/v1/chat/completions", self._handle)
        self._runner = web.AppRunner(app)
        await self._runner.setup()
        site = web.TCPSite(self._runner, "127.0.0.1", 0)
        await site.start()
        self.url = f"http://127.0.0.1:{self._runner.addresses[0][1]}/v1"
        return self

    async def __aexit__(self, *exc: object) -> None:
        assert self._runner is not None
        await self._runner.cleanup()

    async def _handle(self, request: web.Request) -> web.StreamResponse:
        body = await request.json()
        prompt = body["messages"][0]["content"]
        self.rids.append(int(prompt[1 : prompt.index("]")]))
        self.sessions.append((self.rids[-1], request.headers.get("X-Session-Id")))
        assert request.transport is not None
        self.connections.add(request.transport.get_extra_info("peername"))
        action = self.script[self.count % len(self.script)]
        self.count += 1
        self.seen[action] = self.seen.get(action, 0) + 1
        self.active += 1
        self.max_active = max(self.max_active, self.active)
        try:
            # Let the other users' requests arrive while this one is in flight.
            await asyncio.sleep(0)
            if action in ("429", "503"):
                return web.json_response(
                    {"error": {"message": "busy", "type": "server_error",
                               "code": "queue_full" if action == "429" else "overloaded"}},
                    status=int(action), headers={"Retry-After": "1"},
                )
            usage: dict[str, Any] = {"prompt_tokens": 3, "completion_tokens": 3, "total_tokens": 6}
            if action == "bad_usage":
                usage = {"prompt_tokens": True, "completion_tokens": -1, "total_tokens": 0}
            if not body.get("stream"):
                return web.json_response({
                    "choices": [{"index": 0, "message": {"role": "assistant", "content": "a b c"},
                                 "finish_reason": "stop"}],
                    "usage": usage,
                })
            response = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
            await response.prepare(request)
            for word in ("a ", "b "):
                event = {"choices": [{"index": 0, "delta": {"content": word}}]}
                await response.write(f"data: {json.dumps(event)}\n\n".encode())
            if action == "cut":
                assert request.transport is not None
                request.transport.close()
                return response
            if action == "error_event":
                await response.write(b'data: {"error": {"message": "x", "code": "backend_error"}}\n\n')
                await response.write_eof()
                return response
            final = {"choices": [{"index": 0, "delta": {}, "finish_reason": "stop"}],
                     "usage": usage if action == "bad_usage" else
                     {"prompt_tokens": 3, "completion_tokens": 2, "total_tokens": 5}}
            await response.write(f"data: {json.dumps(final)}\n\ndata: [DONE]\n\n".encode())
            if action == "long_tail":
                # A megabyte of SSE comments after [DONE] (any client skips
                # them): more than a client buffers unread, so one that stops
                # at [DONE] leaves the body before its end, whatever the timing.
                for _ in range(1024):
                    await response.write(b": " + b"x" * 1021 + b"\n")
                await response.write(b"\n")
            await response.write_eof()
            return response
        finally:
            self.active -= 1


def fake_scenario(**overrides: Any) -> dict[str, Any]:
    data = open_scenario(
        name="fake", model="m", duration_s=0.4, arrivals={"rate_rps": 60},
        classes=[{"name": "only", "tier": "standard", "api_key_env": "QG_BENCH_TEST_KEY"}],
        tiers={"standard": {"ttft_slo_ms": 2000}},
    )
    data.update(overrides)
    return data


async def test_refusals_are_rejected_and_failures_are_errors_never_lost(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("QG_BENCH_TEST_KEY", "k")
    path = write(tmp_path, fake_scenario())
    planned = len(plan_open(load_bench_scenario(path)))
    assert planned >= 10
    out = tmp_path / "out.json"
    async with Upstream(("429", "ok", "503", "cut", "error_event")) as upstream:
        rc = await bench(upstream.url, str(path), "--json", str(out), "--workers", "1")
    assert rc == 0
    totals = json.loads(out.read_text())["policies"]["run"]["totals"]
    seen = upstream.seen
    assert upstream.count == planned == totals["sent"] == totals["requests"]
    assert totals["lost"] == 0
    assert totals["rejected"] == seen.get("429", 0) + seen.get("503", 0)
    assert totals["rejected_by_status"] == {
        k: v for k, v in (("429", seen.get("429", 0)), ("503", seen.get("503", 0))) if v
    }
    assert totals["completed"] == seen.get("ok", 0)
    assert totals["errors"] == seen.get("cut", 0) + seen.get("error_event", 0)
    kinds = totals["error_types"]
    assert kinds.get("stream_error", 0) == seen.get("error_event", 0)
    assert sum(kinds.values()) == totals["errors"]


async def test_sessions_give_every_request_its_conversation_header(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("QG_BENCH_TEST_KEY", "k")
    async with Upstream(("ok",)) as upstream:
        path = write(tmp_path, fake_scenario(sessions=3))
        assert await bench(upstream.url, str(path), "--workers", "1", "--quiet") == 0
        path = write(tmp_path, fake_scenario(name="plain"))
        sent = len(upstream.sessions)
        assert await bench(upstream.url, str(path), "--workers", "1", "--quiet") == 0
    assert sent >= 6
    assert all(header == f"s{rid % 3}" for rid, header in upstream.sessions[:sent])
    assert len(upstream.sessions) > sent
    assert {header for _, header in upstream.sessions[sent:]} == {None}


async def test_a_stream_is_read_to_its_end_so_its_connection_is_kept(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("QG_BENCH_TEST_KEY", "k")
    data = fake_scenario(mode="sweep", sweep={"concurrency": [1], "requests": 6})
    del data["duration_s"]
    out = tmp_path / "out.json"
    async with Upstream(("long_tail",)) as upstream:
        rc = await bench(upstream.url, str(write(tmp_path, data)), "--json", str(out),
                         "--workers", "1")
    assert rc == 0
    assert json.loads(out.read_text())["policies"]["run"]["totals"]["completed"] == 6
    assert upstream.count == 6 and len(upstream.connections) == 1


async def test_sweep_gives_one_row_per_concurrency_level(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("QG_BENCH_TEST_KEY", "k")
    data = fake_scenario(mode="sweep", stream=False,
                         sweep={"concurrency": [1, 3, 4], "requests": 12})
    del data["duration_s"]
    path = write(tmp_path, data)
    out, plot = tmp_path / "sweep.json", tmp_path / "sweep.png"
    async with Upstream(("ok",)) as upstream:
        rc = await bench(upstream.url, str(path), "--json", str(out), "--plot", str(plot),
                         "--workers", "2")
    assert rc == 0
    run = json.loads(out.read_text())["policies"]["run"]
    rows = run["sweep"]
    assert [row["concurrency"] for row in rows] == [1, 3, 4]
    for row in rows:
        assert row["requests"] == row["completed"] == 12
        assert row["lost"] == 0 and row["errors"] == 0
        assert row["throughput_rps"] > 0 and row["e2e_p50_s"] > 0
    assert upstream.count == 36
    # Closed loop: never more in flight than the largest level's users.
    assert upstream.max_active <= 4
    assert run["totals"]["lost"] == 0 and run["totals"]["requests"] == 36
    assert plot.stat().st_size > 0


async def test_several_urls_split_requests_round_robin_by_request_number(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("QG_BENCH_TEST_KEY", "k")
    path = write(tmp_path, fake_scenario())
    planned = len(plan_open(load_bench_scenario(path)))
    assert planned >= 10
    out = tmp_path / "out.json"
    async with Upstream(("ok",)) as first, Upstream(("ok",)) as second:
        # Two workers: the split must follow the request number, not which
        # worker happened to send it.
        rc = await bench(f"{first.url},{second.url}/", str(path), "--json", str(out),
                         "--workers", "2")
    assert rc == 0
    result = json.loads(out.read_text())
    assert result["urls"] == [first.url, second.url]
    assert result["url"] == f"{first.url},{second.url}"
    assert result["policies"]["run"]["totals"]["completed"] == planned
    assert sorted(first.rids) == list(range(0, planned, 2))
    assert sorted(second.rids) == list(range(1, planned, 2))


async def test_a_sweep_over_several_urls_splits_every_level(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("QG_BENCH_TEST_KEY", "k")
    data = fake_scenario(mode="sweep", stream=False, sweep={"concurrency": [1, 3], "requests": 9})
    del data["duration_s"]
    path = write(tmp_path, data)
    async with (
        Upstream(("ok",)) as first, Upstream(("ok",)) as second, Upstream(("ok",)) as third
    ):
        # The first URL twice: a repeated entry weights its replica.
        urls = f"{first.url},{second.url},{first.url},{third.url}"
        rc = await bench(urls, str(path), "--workers", "2")
    assert rc == 0
    # Each level numbers its requests 0..8 again; 4 URLs, so first gets n % 4 in (0, 2).
    per_level = range(9)
    assert sorted(first.rids) == sorted(2 * [n for n in per_level if n % 4 in (0, 2)])
    assert sorted(second.rids) == sorted(2 * [n for n in per_level if n % 4 == 1])
    assert sorted(third.rids) == sorted(2 * [n for n in per_level if n % 4 == 3])


# -- bad input -------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "change, field",
    [
        (lambda d: d["classes"][0].update(tier="gold"), "classes.0.tier"),
        (lambda d: d["classes"][1].update(rate=5), "classes.1"),
        (lambda d: d.update(endpoint="embeddings"), "endpoint"),
        (lambda d: d.pop("duration_s"), "duration_s"),
        (lambda d: d["classes"][0].update(api_key_env="X_KEY"), "classes.0"),
        (lambda d: d.update(mode="sweep", sweep={"concurrency": [1]}), "sweep"),
    ],
)
def test_a_bad_scenario_exits_2_naming_the_field(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], change: Any, field: str
) -> None:
    data = open_scenario()
    change(data)
    path = write(tmp_path, data)
    assert main(["bench", "http://127.0.0.1:9/v1", str(path)]) == 2
    err = capsys.readouterr().err
    assert "not a valid bench scenario" in err
    assert f": {field}" in err


def test_unset_key_variable_and_bad_url_exit_2(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.delenv("QG_BENCH_TEST_KEY", raising=False)
    path = write(tmp_path, fake_scenario())
    assert main(["bench", "http://127.0.0.1:9/v1", str(path)]) == 2
    assert "classes.0.api_key_env: environment variable QG_BENCH_TEST_KEY is not set" in (
        capsys.readouterr().err
    )
    monkeypatch.setenv("QG_BENCH_TEST_KEY", "k")
    assert main(["bench", "ftp://example", str(path)]) == 2
    assert "URL:" in capsys.readouterr().err
    assert main(["bench", "http://127.0.0.1:9", str(path), "--workers", "0"]) == 2
    assert "--workers" in capsys.readouterr().err


def test_a_url_list_names_the_bad_or_empty_entry(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    assert api_bases("http://a:1") == ["http://a:1/v1"]
    assert api_bases("http://a:1/v1/, https://b:2/api") == ["http://a:1/v1", "https://b:2/api"]
    assert api_bases("http://a:1,http://a:1") == ["http://a:1/v1", "http://a:1/v1"]
    with pytest.raises(BenchUsageError, match=r"^URL: entry 3: expected http\(s\)://host:port"):
        api_bases("http://a:1,http://b:2,b:3")
    with pytest.raises(BenchUsageError, match=r"^URL: entry 2: no query or fragment"):
        api_bases("http://a:1,http://b:2/v1?x=1")
    for arg in ("http://a:1,,http://b:2", "http://a:1,", ",http://a:1", "http://a:1, ,http://b:2"):
        number = 1 if arg.startswith(",") else 2
        with pytest.raises(BenchUsageError, match=rf"^URL: entry {number}: empty"):
            api_bases(arg)
    # One URL keeps its old message, without an entry number.
    with pytest.raises(BenchUsageError, match=r"^URL: expected"):
        api_bases("ftp://x")

    monkeypatch.setenv("QG_BENCH_TEST_KEY", "k")
    path = write(tmp_path, fake_scenario())
    assert main(["bench", "http://127.0.0.1:9/v1,ftp://x", str(path)]) == 2
    assert ("URL: entry 2: expected http(s)://host:port[/v1], got 'ftp://x'"
            in capsys.readouterr().err)
    assert main(["bench", "http://127.0.0.1:9/v1,,http://127.0.0.1:10", str(path)]) == 2
    assert "URL: entry 2: empty" in capsys.readouterr().err


# -- pieces ----------------------------------------------------------------------------------


def test_plan_is_seeded_and_split_evenly() -> None:
    scenario = BenchScenario.model_validate(open_scenario(duration_s=5.0))
    first, again = plan_open(scenario), plan_open(scenario)
    assert first == again
    assert [spec[0] for spec in first] == list(range(len(first)))
    assert all(a[1] <= b[1] for a, b in itertools.pairwise(first))
    parts = split_open(first, 3)
    assert sorted(spec[0] for part in parts for spec in part) == list(range(len(first)))
    assert split_users(5, 2) == [[0, 2, 4], [1, 3]]
    assert split_users(2, 8) == [[0], [1]]
    assert api_base("http://h:1") == "http://h:1/v1"
    assert api_base("http://h:1/v1/") == "http://h:1/v1"
    sweep = BenchScenario.model_validate(
        {**open_scenario(mode="sweep", sweep={"concurrency": [2], "requests": 7}),
         "duration_s": None}
    )
    assert len(sweep_pool(sweep, 2)) == 7


def test_requests_without_a_record_are_lost() -> None:
    scenario = BenchScenario.model_validate(open_scenario())
    records = [
        Record(0, 0, 0.0, 0.01, 0.02, 200, "completed", None, None, 12, 4, (0.001,) * 3, 0.0),
        Record(1, 1, 0.1, None, 0.11, 503, "rejected_overload", "http_503", "overloaded", 12, 0,
               None, 0.0),
    ]
    report = build_bench_report(records, scenario, window=(0.0, 1.0), planned=5)
    assert report["totals"]["lost"] == 3
    assert report["totals"]["rejected"] == 1
    assert report["tiers"]["interactive"]["tpot_p50_s"] == pytest.approx(0.01 / 3)


def test_a_503_is_a_refusal_only_when_the_gateway_says_overloaded():
    from qosgate.bench.client import ERROR, error_outcome

    assert error_outcome(503, "overloaded") == "rejected_overload"
    assert error_outcome(503, None) == "rejected_overload"
    assert error_outcome(503, "backend_unavailable") == ERROR
    assert error_outcome(503, "shutting_down") == ERROR
    assert error_outcome(429, "queue_full") == "rejected_queue_full"
    assert error_outcome(504, "queue_timeout") == "expired"


# -- a run that measured nothing, and the live line ---------------------------------------


async def test_a_run_where_every_request_failed_exits_1(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    from tests.redis_server import free_port

    path = write(tmp_path, open_scenario(duration_s=0.3))
    rc = await bench(f"http://127.0.0.1:{free_port()}/v1", str(path), "--workers", "1")
    assert rc == 1
    err = capsys.readouterr().err
    assert "every request failed" in err and "connection x" in err


class _Terminal:
    """A stream that says it is a terminal, and keeps what is written."""

    def __init__(self, tty: bool) -> None:
        self.text = ""
        self.tty = tty

    def isatty(self) -> bool:
        return self.tty

    def write(self, text: str) -> None:
        self.text += text

    def flush(self) -> None:
        pass


def test_the_progress_line_is_rewritten_on_a_terminal_and_logged_now_and_then() -> None:
    from qosgate.bench.commands import ProgressLine

    now = [100.0]
    terminal = _Terminal(tty=True)
    line = ProgressLine(terminal, 50, clock=lambda: now[0])
    line(3, 2)
    now[0] += 2
    line(10, 9)
    line.end()
    assert terminal.text == (
        "\r  3/50 answered, 2 completed, 1 not, 0 s\x1b[K"
        "\r  10/50 answered, 9 completed, 1 not, 2 s\x1b[K\n"
    )
    log = _Terminal(tty=False)
    line = ProgressLine(log, None, log_every_s=10, clock=lambda: now[0])
    line(1, 1)
    now[0] += 10
    line(7, 7)
    line.end()
    assert log.text == "  7 answered, 7 completed, 0 not, 10 s\n"


async def test_the_workers_report_progress_while_a_job_runs(tmp_path: Path) -> None:
    from qosgate.bench.client import PROGRESS_INTERVAL_S
    from qosgate.bench.commands import job_config, resolve_keys
    from qosgate.bench.pool import WorkerPool

    # Long enough for a report or two: the scenario's length, not a wait.
    data = open_scenario(duration_s=3 * PROGRESS_INTERVAL_S)
    scenario = load_bench_scenario(write(tmp_path, data))
    specs = plan_open(scenario)
    reports: list[tuple[int, int]] = []
    async with live_app() as live:
        cfg = job_config(scenario, live.url + "/v1", resolve_keys(scenario), scenario.seed)

        def run() -> Any:
            with WorkerPool(2) as pool:
                return pool.run("open", cfg, split_open(specs, 2),
                                lambda done, ok: reports.append((done, ok)))  # fmt: skip

        job = await asyncio.to_thread(run)
    assert len(job.records) == len(specs)
    assert reports, "no progress reported"
    assert all(0 <= ok <= done <= len(specs) for done, ok in reports)
    assert [done for done, _ in reports] == sorted(done for done, _ in reports)


async def test_a_completions_token_with_no_text_yet_is_a_token() -> None:
    # A token that decodes to part of a character streams as empty text (vLLM
    # does so): it is a token, and a first one. An empty chunk that only
    # closes the answer is not a token.
    texts = ["", "a", "", "b"]

    async def handle(request: web.Request) -> web.StreamResponse:
        response = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
        await response.prepare(request)
        for text in texts:
            chunk = {"choices": [{"index": 0, "text": text, "finish_reason": None}]}
            await response.write(b"data: " + json.dumps(chunk).encode() + b"\n\n")
        await response.write(b'data: {"choices": [{"index": 0, "text": "", '
                             b'"finish_reason": "length"}]}\n\ndata: [DONE]\n\n')
        return response

    app = web.Application()
    app.router.add_post("/v1/completions", handle)
    runner = web.AppRunner(app)
    await runner.setup()
    site = web.TCPSite(runner, "127.0.0.1", 0)
    await site.start()
    port = site._server.sockets[0].getsockname()[1]  # type: ignore[union-attr]
    cfg = {"urls": [f"http://127.0.0.1:{port}/v1"], "endpoint": "completions", "model": "m",
           "stream": True, "timeout_s": 30, "extra_body": {}, "keys": [None],
           "priority": [None]}  # fmt: skip
    try:
        async with aiohttp.ClientSession() as session:
            job = Job(cfg, session, "words")
            record = await job.one((0, 0.0, 0, 4, 4), asyncio.get_running_loop().time(), 0.0)
    finally:
        await runner.cleanup()
    assert record[6] == COMPLETED
    assert record[10] == len(texts)  # output tokens: the chunks that carry one
    assert record[3] is not None and len(record[11]) == len(texts) - 1


async def _sent_to(script: tuple[str, ...], *, stream: bool, asked: int, count: int) -> list[tuple]:
    """The records of `count` requests of `asked` prompt tokens (4 output),
    sent one after another by the bench client to an Upstream playing `script`."""
    cfg = {"urls": [], "endpoint": "chat", "model": "m", "stream": stream, "timeout_s": 30,
           "extra_body": {}, "keys": [None], "priority": [None]}  # fmt: skip
    async with Upstream(script) as upstream:
        cfg["urls"] = [upstream.url]
        async with aiohttp.ClientSession() as session:
            job = Job(cfg, session, "words")
            start = asyncio.get_running_loop().time()
            return [await job.one((rid, 0.0, 0, asked, 4), start, 0.0) for rid in range(count)]


@pytest.mark.parametrize("stream", [True, False])
async def test_tokens_per_second_count_the_prompt_as_the_server_counted_it(stream: bool) -> None:
    # The client asks for prompts of about 4 characters a token; a model whose
    # tokenizer cuts them finer or coarser works on what it counted, which its
    # usage says (the fake upstream: 3 prompt tokens, whatever was sent).
    asked = 400
    raw = await _sent_to(("ok",), stream=stream, asked=asked, count=3)
    records = [Record(*row) for row in raw]
    assert all(r.outcome == COMPLETED for r in records)
    assert [(r.prompt_tokens, r.prompt_counted, r.prompt_served) for r in records] == [
        (asked, 3, 3)] * 3
    output = records[0].output_tokens
    assert output == (2 if stream else 3)
    scenario = BenchScenario.model_validate(open_scenario())
    end = max(r.end for r in records) + 1.0
    totals = build_bench_report(records, scenario, window=(0.0, end), planned=3)["totals"]
    assert totals["throughput_tokens_per_s"] * end == pytest.approx(3 * (3 + output))
    # A server that says nothing of the prompt: what was asked is what counts.
    silent = [Record(*row[:-1]) for row in raw]
    totals = build_bench_report(silent, scenario, window=(0.0, end), planned=3)["totals"]
    assert totals["throughput_tokens_per_s"] * end == pytest.approx(3 * (asked + output))


@pytest.mark.parametrize("stream", [True, False])
async def test_usage_counts_that_are_not_whole_numbers_are_not_taken(stream: bool) -> None:
    # JSON's true is a Python int; a count of true (1) or -1 tokens is a
    # broken server's, and the client's own count stands instead.
    record = Record(*(await _sent_to(("bad_usage",), stream=stream, asked=400, count=1))[0])
    assert record.outcome == COMPLETED
    assert record.prompt_counted is None
    assert record.prompt_served == 400
    # Streamed: the two tokens counted as they came; whole: "a b c" at about
    # 4 characters a token.
    assert record.output_tokens == 2
