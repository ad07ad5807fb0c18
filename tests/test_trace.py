"""The request trace: the gateway's (`observability.trace`) and the load
generator's (`qosgate bench --record`), and their replay in `qosgate simulate`.

The gateway runs in the test's loop (the real app on the simulated GPU); the
bench CLI runs in a thread against it, as in test_bench.py.
"""

from __future__ import annotations

import asyncio
import json
import logging
from pathlib import Path
from typing import Any

import pytest
import yaml
from http_support import ALICE_KEY, BOB_KEY, MODEL, POLICY_YAML, live_app, make_policy

from qosgate.cli import main
from qosgate.config.loader import ConfigError, load_policy_text
from qosgate.config.models import TraceConfig
from qosgate.observability.trace import TraceWriter
from qosgate.sim.workload import TraceError, load_trace

BOB_REQUESTS_PER_MINUTE = 3


def traced_policy_yaml(trace_path: Path, **trace: Any) -> str:
    """The HTTP tests' policy, tracing to `trace_path`, and bob held to a few
    requests a minute so that some are refused by quota (still arrivals)."""
    text = POLICY_YAML.replace(
        '    api_keys: ["env:QG_TEST_BOB_KEY"]\n',
        '    api_keys: ["env:QG_TEST_BOB_KEY"]\n'
        f"    quotas: {{requests_per_minute: {{limit: {BOB_REQUESTS_PER_MINUTE}}}}}\n",
    )
    section = {"path": str(trace_path), **trace}
    return text + f"observability:\n  trace: {json.dumps(section)}\n"


def bench_scenario(tmp_path: Path) -> Path:
    data = {
        "kind": "bench",
        "name": "traced",
        "model": MODEL,
        # The completions endpoint: the simulated GPU counts a bench prompt as
        # exactly the tokens planned, so both traces hold the same lengths.
        "endpoint": "completions",
        "stream": True,
        "seed": 5,
        "duration_s": 0.8,
        "timeout_s": 20,
        "arrivals": {"process": "poisson", "rate_rps": 40},
        "lengths": {"prompt": {"median": 20, "sigma": 0.6, "max": 200},
                    "output": {"median": 6, "sigma": 0.5, "max": 16}},
        "classes": [
            {"name": "alice", "tier": "interactive", "api_key": ALICE_KEY, "share": 2},
            {"name": "bob", "tier": "batch", "api_key": BOB_KEY, "share": 1},
        ],
        "tiers": {"interactive": {"ttft_slo_ms": 5000}, "batch": {"e2e_slo_ms": 60000}},
    }  # fmt: skip
    path = tmp_path / "bench.yaml"
    path.write_text(yaml.safe_dump(data, sort_keys=False))
    return path


def read_lines(path: Path) -> list[dict[str, Any]]:
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


def simulate_trace(tmp_path: Path, trace: Path, policy_yaml: str, name: str) -> dict[str, Any]:
    """`qosgate simulate` on the trace under fcfs and qos; the result JSON."""
    policy = yaml.safe_load(policy_yaml)
    # The simulation runs its own engine; the policy's server, keys and trace
    # play no part there.
    policy.pop("observability")
    policy["tenants"] = [{"id": t["id"], "tier": t["tier"]} for t in policy["tenants"]]
    scenario = {
        "name": name, "duration_s": 60, "warmup_s": 0, "drain_s": 300,
        "trace": str(trace), "policies": ["fcfs", "qos"], "policy": policy,
        "engine": {"kind": "sim", "max_num_seqs": 16},
    }  # fmt: skip
    path = tmp_path / f"{name}.yaml"
    path.write_text(yaml.safe_dump(scenario, sort_keys=False))
    out = tmp_path / f"{name}.json"
    assert main(["simulate", str(path), "--json", str(out), "--quiet"]) == 0
    return json.loads(out.read_text())


async def test_the_gateways_trace_and_the_benchs_replay_in_simulate(tmp_path: Path) -> None:
    trace = tmp_path / "gateway.jsonl"
    recorded = tmp_path / "bench.jsonl"
    policy_yaml = traced_policy_yaml(trace, flush_interval_s=0.05)
    policy = make_policy(policy_yaml)
    async with live_app(policy) as live:
        rc = await asyncio.to_thread(main, [
            "bench", live.url, str(bench_scenario(tmp_path)), "--record", str(recorded),
            "--workers", "1", "--quiet",
        ])  # fmt: skip
        assert rc == 0
        admitted = [stream.request for stream in live.gateway.streams]
    # Closing the gateway wrote the last lines.
    lines = read_lines(trace)
    sent = read_lines(recorded)
    assert len(lines) == len(sent) >= 20
    assert set(lines[0]) == {"t", "tenant", "tier", "prompt_tokens", "max_tokens",
                             "output_tokens", "outcome"}

    # The gateway's lines are its requests: the admitted ones with their
    # arrival (to the microsecond), tier, lengths and outcome...
    by_arrival = sorted(admitted, key=lambda r: r.arrival)
    served = sorted((line for line in lines if line["outcome"] != "rejected_quota"),
                    key=lambda line: line["t"])
    assert len(served) == len(by_arrival)
    for line, req in zip(served, by_arrival):
        assert line["t"] - served[0]["t"] == pytest.approx(
            req.arrival - by_arrival[0].arrival, abs=2e-6)
        assert (line["tenant"], line["tier"], line["prompt_tokens"], line["max_tokens"],
                line["output_tokens"], line["outcome"]) == (
            req.tenant, req.tier, req.prompt_tokens, req.max_tokens, req.output_tokens,
            req.outcome.value)  # fmt: skip
        assert line["outcome"] == "completed"
    # ... and those quota refused, as arrivals too.
    refused = [line for line in lines if line["outcome"] == "rejected_quota"]
    bobs = sum(1 for line in lines if line["tenant"] == "bob")
    assert len(refused) == bobs - BOB_REQUESTS_PER_MINUTE > 0
    assert all(line["tier"] == "batch" and line["output_tokens"] == 0 for line in refused)
    # The client saw the same requests.
    key = ("tenant", "tier", "prompt_tokens", "max_tokens", "output_tokens", "outcome")
    assert sorted(tuple(line[k] for k in key) for line in lines) == sorted(
        tuple(line[k] for k in key) for line in sent
    )

    # Replayed, each trace is the same arrivals, tenants, tiers and lengths.
    replay = load_trace(trace, policy)
    assert [(a.t, a.tenant, a.tier, a.prompt_tokens, a.max_tokens) for a in replay] == sorted(
        (line["t"], line["tenant"], line["tier"], line["prompt_tokens"], line["max_tokens"])
        for line in lines
    )
    # A refused request never showed its length: it replays asking its max_tokens.
    assert [a.output_tokens for a in replay] == [
        line["output_tokens"] if line["outcome"] == "completed" else line["max_tokens"]
        for line in sorted(lines, key=lambda line: line["t"])
    ]
    for name, path in (("gateway", trace), ("bench", recorded)):
        records = read_lines(path)
        result = simulate_trace(tmp_path, path, policy_yaml, name)
        # Recorded under qos, replayed under fcfs and qos: every arrival, and
        # quotas are not simulated, so each completes with the length it asked.
        for run_name, run in result["policies"].items():
            totals = run["totals"]
            assert totals["requests"] == totals["completed"] == len(records), (name, run_name)
            assert totals["lost"] == 0
            for tenant in ("alice", "bob"):
                mine = [a for a in load_trace(path, policy) if a.tenant == tenant]
                stats = run["tenants"][tenant]
                assert stats["requests"] == len(mine)
                assert stats["prompt_tokens"] == sum(a.prompt_tokens for a in mine)
                assert stats["output_tokens"] == sum(a.output_tokens for a in mine)


async def test_an_unwritable_trace_is_logged_once_and_counted_never_failing_a_request(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    trace = tmp_path / "no-such-dir" / "trace.jsonl"
    policy = make_policy(traced_policy_yaml(trace, flush_interval_s=0.01))
    caplog.set_level(logging.ERROR, logger="qosgate.observability.trace")
    async with live_app(policy) as live:
        import aiohttp

        async with aiohttp.ClientSession(headers={"Authorization": f"Bearer {ALICE_KEY}"}) as http:
            for _ in range(3):
                async with http.post(f"{live.url}/v1/completions",
                                     json={"model": MODEL, "prompt": "hi", "max_tokens": 2}) as r:
                    assert r.status == 200, await r.text()
                # Each request is flushed (and fails) on its own timer.
                await wait_flushed(live.gateway.observer.trace)
        writer = live.gateway.observer.trace
        metrics = live.gateway.observer.metrics
    assert writer is not None and writer.dropped == 3 and writer.written == 0
    assert metrics.registry.get_sample_value("qosgate_trace_dropped_lines_total") == 3
    errors = [r for r in caplog.records if "cannot write" in r.getMessage()]
    assert len(errors) == 1
    assert not trace.exists()


async def wait_flushed(writer: TraceWriter | None) -> None:
    """Until the writer's buffer has been flushed by its timer."""
    assert writer is not None
    flushed = asyncio.Event()
    flush = writer.flush

    def spy() -> None:
        flush()
        flushed.set()

    writer.flush = spy  # type: ignore[method-assign]
    try:
        if writer._lines:
            await asyncio.wait_for(flushed.wait(), 10)
    finally:
        writer.flush = flush  # type: ignore[method-assign]


async def test_lines_are_buffered_until_the_timer(tmp_path: Path) -> None:
    path = tmp_path / "t.jsonl"
    loop = asyncio.get_running_loop()
    writer = TraceWriter(TraceConfig(path=str(path), flush_interval_s=0.05))
    writer.start(loop.time)
    writer.record(arrival=loop.time(), tenant="a", tier="gold", prompt_tokens=3, max_tokens=4,
                  output_tokens=4, outcome="completed")
    # Nothing is written by the request itself.
    assert not path.exists() or path.read_text() == ""
    await wait_flushed(writer)
    assert len(read_lines(path)) == 1
    assert writer.written == 1


class Clock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


def test_rotation_keeps_the_newest_files_each_timed_from_its_own_start(tmp_path: Path) -> None:
    path = tmp_path / "t.jsonl"
    path.write_text('{"old": "run"}\n')
    clock = Clock()
    writer = TraceWriter(TraceConfig(path=str(path), rotate_bytes=4096, keep=2))
    writer.start(clock)
    # The old run's file was rotated away, not appended to.
    assert read_lines(tmp_path / "t.jsonl.1") == [{"old": "run"}]
    for n in range(200):
        clock.now = 100.0 + n
        # Outside a loop each line is written at once. Each arrived 0.5 s
        # before it ended.
        writer.record(arrival=clock.now - 0.5, tenant=f"t{n}", tier="gold", prompt_tokens=n + 1,
                      max_tokens=8, output_tokens=8, outcome="completed")
    assert writer.written == 200 and writer.dropped == 0
    files = sorted(p.name for p in tmp_path.iterdir())
    assert files == ["t.jsonl", "t.jsonl.1", "t.jsonl.2"]
    newest = read_lines(path)
    older = read_lines(tmp_path / "t.jsonl.1")
    oldest = read_lines(tmp_path / "t.jsonl.2")
    assert [line["tenant"] for line in oldest + older + newest] == [
        f"t{n}" for n in range(200 - len(oldest + older + newest), 200)
    ]
    for lines, name in ((oldest, "t.jsonl.2"), (older, "t.jsonl.1")):
        size = (tmp_path / name).stat().st_size
        assert 4096 <= size < 4096 + 200, name
        # A file's times count from its own start: the first request in it
        # arrived before it began (in flight across the rotation), at 0.
        assert lines[0]["t"] == 0.0
        assert [b["t"] - a["t"] for a, b in zip(lines[1:], lines[2:])] == [1.0] * (len(lines) - 2)
        assert lines[1]["t"] == 0.5


def test_trace_config_is_bounded_and_names_the_field() -> None:
    for bad, field in (
        ("{path: t.jsonl, rotate_bytes: 10}", "observability.trace.rotate_bytes"),
        ("{path: t.jsonl, keep: 5000}", "observability.trace.keep"),
        ("{path: ''}", "observability.trace.path"),
        ("{path: t.jsonl, flush_every: 1}", "observability.trace"),
    ):
        with pytest.raises(ConfigError) as info:
            load_policy_text(
                "tiers: {gold: {priority: 0}}\nobservability:\n  trace: " + bad + "\n", "p.yaml"
            )
        assert field in str(info.value), bad
    assert load_policy_text("tiers: {gold: {priority: 0}}\n").observability.trace is None


TRACE_POLICY = """
tiers:
  gold: {priority: 0, max_tokens: 100}
  bronze: {priority: 1, max_tokens: 50, default_max_tokens: 20}
tenants:
  - {id: alice, tier: gold}
default_tier: bronze
"""


def test_tier_and_outcome_in_a_trace(tmp_path: Path) -> None:
    policy = load_policy_text(TRACE_POLICY)
    path = tmp_path / "t.jsonl"
    rows = [
        # A policy tenant is served in its own tier, whatever the line says.
        {"t": 0, "tenant": "alice", "tier": "bronze", "prompt_tokens": 5, "output_tokens": 7},
        # Another tenant: the tier the line names, else the default tier.
        {"t": 1, "tenant": "carol", "tier": "gold", "prompt_tokens": 5, "output_tokens": 7},
        {"t": 2, "tenant": "dave", "prompt_tokens": 5, "output_tokens": 7},
        # Not completed: its length is unknown, so it asks for its max_tokens.
        {"t": 3, "tenant": "alice", "prompt_tokens": 5, "output_tokens": 0, "max_tokens": 30,
         "outcome": "expired"},
        {"t": 4, "tenant": "alice", "prompt_tokens": 5, "output_tokens": 2, "max_tokens": 30,
         "outcome": "cancelled"},
        {"t": 5, "tenant": "alice", "prompt_tokens": 5, "output_tokens": 9, "max_tokens": 30,
         "outcome": "completed"},
    ]
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    got = [(a.tenant, a.tier, a.output_tokens, a.max_tokens) for a in load_trace(path, policy)]
    assert got == [
        ("alice", "gold", 7, 100), ("carol", "gold", 7, 100), ("dave", "bronze", 7, 20),
        ("alice", "gold", 30, 30), ("alice", "gold", 30, 30), ("alice", "gold", 9, 30),
    ]


@pytest.mark.parametrize(
    ("line", "message"),
    [
        ('{"t": 0, "tenant": "alice", "tier": "silver", "prompt_tokens": 1, "output_tokens": 1}',
         "tier: unknown tier 'silver'"),
        ('{"t": 0, "tenant": "alice", "outcome": "done", "prompt_tokens": 1, "output_tokens": 1}',
         "outcome: unknown outcome 'done'"),
        # Without an outcome a length of 0 is still an error, as it always was.
        ('{"t": 0, "tenant": "alice", "prompt_tokens": 1, "output_tokens": 0}',
         "output_tokens: must be an integer >= 1"),
        ('{"t": 0, "tenant": ["alice"], "prompt_tokens": 1, "output_tokens": 1}',
         "tenant: must be a string"),
    ],
)
def test_bad_tier_or_outcome_names_the_line(tmp_path: Path, line: str, message: str) -> None:
    path = tmp_path / "bad.jsonl"
    path.write_text('{"t": 0, "tenant": "alice", "prompt_tokens": 1, "output_tokens": 1}\n'
                    + line + "\n")
    with pytest.raises(TraceError, match=r"bad\.jsonl:2: ") as info:
        load_trace(path, load_policy_text(TRACE_POLICY))
    assert message in str(info.value)


def test_an_unknown_tenant_without_a_tier_needs_a_default_tier(tmp_path: Path) -> None:
    path = tmp_path / "t.jsonl"
    path.write_text('{"t": 0, "tenant": "zed", "prompt_tokens": 1, "output_tokens": 1}\n')
    policy = load_policy_text("tiers: {gold: {priority: 0}}\ntenants: [{id: a, tier: gold}]\n")
    with pytest.raises(TraceError, match="unknown tenant 'zed'"):
        load_trace(path, policy)
