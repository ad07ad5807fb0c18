"""benchmarks/batch_beside.py's pieces, without the long run: its arguments
are checked, its gateway policy, bench scenario and job file are what the
gateway and the bench accept, and its rules judge figures, a missing or zero
baseline being an error."""

from __future__ import annotations

import importlib.util
import json
import sys
from pathlib import Path

import pytest

from qosgate.backends.tokens import estimate_prompt_tokens
from qosgate.batch.files import check_endpoint, check_input
from qosgate.bench.scenario import BenchScenario
from qosgate.config.models import PolicyConfig

ROOT = Path(__file__).resolve().parent.parent
_SPEC = importlib.util.spec_from_file_location(
    "batch_beside", ROOT / "benchmarks" / "batch_beside.py"
)
beside = importlib.util.module_from_spec(_SPEC)
sys.modules[_SPEC.name] = beside
_SPEC.loader.exec_module(beside)
BASE = beside.load_scenario(beside.sweep.SCENARIO)


def run(attainment=1.0, p99=0.5, busy=1.0, rate=5.0) -> dict:
    """A run's figures in the shape `run_one` returns them."""
    tier = {"ttft_slo_attainment": attainment, "ttft_p99_s": p99}
    return {"report": {"tiers": {"interactive": dict(tier), "standard": dict(tier)}},
            "busy_fraction": busy, "job_lines_per_s": rate,
            "job": {"status": "in_progress"}}  # fmt: skip


def failed(checks) -> list[str]:
    return [c.rule for c in checks if not c.passed]


def test_the_defaults_are_five_modelled_minutes_of_0_7x_beside_20000_lines():
    args = beside.parse_args([])
    assert (args.duration, args.load, args.lines) == (300.0, 0.7, 20_000)


@pytest.mark.parametrize("argv, message", [
    (["--speed", "0"], "--speed must be a positive number"),
    (["--speed", "nan"], "--speed must be a positive number"),
    (["--duration", "-5"], "--duration must be a positive number"),
    (["--duration", "20", "--warmup", "20"], "--warmup must be at least 0"),
    (["--load", "1"], "--load must be between 0 and 1"),
    (["--load", "0"], "--load must be between 0 and 1"),
    (["--lines", "0"], "--lines must be at least 1"),
    (["--in-flight", "5000"], "--in-flight must be between 1 and 4096"),
    (["--timeout", "0"], "--timeout must be a positive number"),
])  # fmt: skip
def test_bad_arguments_exit_2_naming_the_flag(argv, message, capsys):
    with pytest.raises(SystemExit) as exited:
        beside.main(argv)
    assert exited.value.code == 2
    assert message in capsys.readouterr().err


def test_the_gateway_policy_runs_the_job_at_the_batch_tier_with_stretched_durations(tmp_path):
    args = beside.parse_args(["--speed", "0.5", "--in-flight", "64"])
    policy = PolicyConfig.model_validate(beside.gateway_policy(BASE, args, tmp_path))
    assert policy.batch.data_dir == str(tmp_path)
    assert policy.batch.in_flight_per_job == 64
    assert policy.batch.max_lines >= 20_000
    assert policy.backend.speed == 0.5
    assert policy.tiers["interactive"].ttft_slo_ms == 1000
    assert policy.tiers["batch"].on_timeout == "delay"
    assert {t.id: t.tier for t in policy.tenants}[beside.JOB_TENANT] == "batch"


def test_the_bench_sends_only_the_latency_classes_for_the_modelled_duration():
    args = beside.parse_args(["--speed", "2", "--duration", "300", "--warmup", "10"])
    scenario = BenchScenario.model_validate(beside.latency_bench(BASE, 22.0, args))
    tiers = {t.id: t.tier for t in BASE.policy.tenants}
    assert {tiers[c.tenant_id] for c in scenario.classes} == {"interactive", "standard"}
    assert (scenario.duration_s, scenario.warmup_s, scenario.timeout_s) == (150.0, 5.0, 150.0)
    assert scenario.arrivals.rate_rps == 22.0
    assert scenario.tiers["interactive"].ttft_slo_ms == 250


def test_the_job_file_is_one_the_gateway_accepts_with_b3s_lengths(tmp_path):
    path = tmp_path / "job.jsonl"
    path.write_bytes(beside.job_lines(BASE, 500))
    assert check_input(path, max_lines=500, max_line_bytes=1 << 20) == 500
    check_endpoint(path, "/v1/chat/completions")
    bodies = [json.loads(line)["body"] for line in path.read_text().splitlines()]
    prompts = sorted(estimate_prompt_tokens("chat", b) for b in bodies)
    outputs = sorted(b["max_tokens"] for b in bodies)
    lengths = BASE.lengths
    # Medians near B3's (log-normal draws; the prompt gains the chat template's framing).
    assert abs(prompts[250] / lengths.prompt.median - 1) < 0.2
    assert abs(outputs[250] / lengths.output.median - 1) < 0.2
    assert max(outputs) <= lengths.output.max


def test_a_sample_short_of_slots_is_counted_by_how_many():
    samples = [{"capacity": 256, "inflight": n} for n in (250, 251, 249, 249, 240)]
    assert beside.slots_full_fraction(samples, 6) == 0.4
    assert beside.slots_short(samples, 6) == {1: 2, 10: 1}


def test_figures_within_the_rules_pass():
    checks = beside.evaluate(run(), run(rate=4.5), idle_rps=5.0)
    assert len(checks) == 6
    assert failed(checks) == []


def test_each_rule_can_fail():
    assert failed(beside.evaluate(run(), run(attainment=0.9, rate=5.0), 5.0)) == [
        "interactive TTFT attainment beside the job / alone",
        "standard TTFT attainment beside the job / alone",
    ]
    assert failed(beside.evaluate(run(), run(p99=0.6), 5.0)) == [
        "interactive TTFT p99 alone / beside the job",
        "standard TTFT p99 alone / beside the job",
    ]
    assert failed(beside.evaluate(run(), run(busy=0.94), 5.0)) == [
        "engine saturated share of the time while the job runs"]
    assert failed(beside.evaluate(run(), run(rate=4.4), 5.0)) == ["job lines/s / idle capacity"]


@pytest.mark.parametrize("alone, with_job, idle", [
    (run(attainment=0.0), run(), 5.0),
    (run(attainment=None), run(), 5.0),
    (run(), run(attainment=None), 5.0),
    (run(), run(p99=0.0), 5.0),
    (run(), run(p99=None), 5.0),
    (run(), run(busy=None), 5.0),
    (run(), run(rate=None), 5.0),
    (run(), run(), 0.0),
])  # fmt: skip
def test_a_missing_figure_or_zero_baseline_cannot_be_judged(alone, with_job, idle):
    with pytest.raises(beside.BenchError):
        beside.evaluate(alone, with_job, idle)


def test_a_tier_missing_from_a_report_cannot_be_judged():
    alone = run()
    del alone["report"]["tiers"]["standard"]
    with pytest.raises(beside.BenchError, match="standard attainment"):
        beside.evaluate(alone, run(), 5.0)


def test_a_job_that_ended_before_the_latency_traffic_cannot_be_judged():
    with_job = run()
    with_job["job"]["status"] = "completed"
    with pytest.raises(beside.BenchError, match="more --lines"):
        beside.evaluate(run(), with_job, 5.0)


def test_slots_full_counts_samples_with_every_slot_below_the_reserve_running():
    samples = [{"inflight": 250, "capacity": 256}, {"inflight": 249, "capacity": 256},
               {"inflight": 0, "capacity": 0}, {"inflight": 251, "capacity": 257}]  # fmt: skip
    assert beside.slots_full_fraction(samples, reserved_slots=6) == 0.5
    assert beside.slots_full_fraction([], reserved_slots=6) is None


def test_busy_is_the_engines_saturated_seconds_over_the_window_in_modelled_time():
    samples = [{"t": 100.0, "saturated_s": 10.0}, {"t": 110.0, "saturated_s": 14.0},
               {"t": 120.0, "saturated_s": 28.0}]  # fmt: skip
    # 18 modelled seconds saturated over 20 wall seconds at speed 1, 40 at speed 2.
    assert beside.busy_fraction(samples, speed=1.0) == pytest.approx(0.9)
    assert beside.busy_fraction(samples, speed=2.0) == pytest.approx(0.45)
    assert beside.busy_fraction(samples[:1], speed=1.0) is None
    # A gateway whose backend serves no such series (not the sim) cannot be judged.
    unknown = [{"t": 100.0, "saturated_s": float("nan")}, {"t": 110.0, "saturated_s": float("nan")}]
    assert beside.busy_fraction(unknown, speed=1.0) is None


def test_the_job_rate_is_lines_completed_over_the_window():
    samples = [{"job_completed": 100.0}, {"job_completed": 130.0}, {"job_completed": 160.0}]
    assert beside.job_rate(samples, 10.0, 30.0) == 3.0
    assert beside.job_rate(samples[:1], 10.0, 30.0) is None
    assert beside.job_rate(samples, 30.0, 30.0) is None


def test_an_override_reaches_the_gateways_policy_of_both_runs(tmp_path):
    args = beside.parse_args(["--override", '{"scheduler": {"prefill_budget_tokens": 2048}}'])
    base = beside.sweep.with_override(BASE, args.override)
    policy = PolicyConfig.model_validate(beside.gateway_policy(base, args, tmp_path))
    assert policy.scheduler.prefill_budget_tokens == 2048
    assert beside.sweep.with_override(BASE, {}) is BASE
    with pytest.raises(SystemExit):
        beside.parse_args(["--override", "[1]"])
