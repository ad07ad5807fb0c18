"""benchmarks/batch_tradeoff.py's pieces: its arguments, its scenarios (the
same latency arrivals with and without the job, a job that never expires),
and its rules, a missing figure or zero baseline being an error."""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

import pytest

from qosgate.sim.workload import generate_arrivals

ROOT = Path(__file__).resolve().parent.parent
_SPEC = importlib.util.spec_from_file_location(
    "batch_tradeoff", ROOT / "benchmarks" / "batch_tradeoff.py"
)
tradeoff = importlib.util.module_from_spec(_SPEC)
sys.modules[_SPEC.name] = tradeoff
_SPEC.loader.exec_module(tradeoff)
BASE = tradeoff.load_scenario(tradeoff.sweep.SCENARIO)


def run(p99=0.3, attainment=1.0, rate=0.0) -> dict:
    tier = {"ttft_p99_s": p99, "ttft_slo_attainment": attainment}
    return {"tiers": {"interactive": dict(tier), "standard": dict(tier)},
            "job_lines_per_s": rate}  # fmt: skip


@pytest.mark.parametrize("argv, message", [
    (["--seeds", "0"], "--seeds must be between 1 and 100"),
    (["--load", "1"], "--load must be between 0 and 1"),
    (["--duration", "0"], "--duration must be a positive number"),
    (["--warmup", "300"], "--warmup must be at least 0"),
    (["--fractions", "a,b"], "--fractions must be numbers"),
    (["--fractions", "11"], "every fraction must be between 0 and 10"),
])  # fmt: skip
def test_bad_arguments_exit_2_naming_the_flag(argv, message, capsys):
    with pytest.raises(SystemExit) as exited:
        tradeoff.main(argv)
    assert exited.value.code == 2
    assert message in capsys.readouterr().err


def test_the_run_without_the_job_is_always_among_the_fractions():
    assert tradeoff.parse_args(["--fractions", "0.5,1"]).fractions == (0.0, 0.5, 1.0)


def test_the_latency_arrivals_are_the_same_with_and_without_the_job():
    args = tradeoff.parse_args(["--duration", "60", "--warmup", "5"])
    alone = tradeoff.cell_scenario(BASE, args, 10.0, 0.0)
    beside = tradeoff.cell_scenario(BASE, args, 10.0, 3.0)
    without = generate_arrivals(alone, alone.policy, 10.0, 1)
    with_job = generate_arrivals(beside, beside.policy, 10.0, 1)
    latency = [(a.t, a.tenant, a.prompt_tokens) for a in with_job
               if a.tenant != tradeoff.JOB_TENANT]  # fmt: skip
    assert latency == [(a.t, a.tenant, a.prompt_tokens) for a in without]
    job = [a for a in with_job if a.tenant == tradeoff.JOB_TENANT]
    assert 3.0 * 60 * 0.7 < len(job) < 3.0 * 60 * 1.3
    # The job's tier keeps its lines for a day: none expires in a run.
    tier = beside.policy.tiers["batch"]
    assert tier.max_queue_wait_ms == tradeoff.JOB_KEEPS_MS and tier.e2e_slo_ms is None


def test_a_fraction_passes_only_with_the_job_rate_and_every_ratio_met():
    runs = {0.0: {1: run(p99=0.3)}, 1.0: {1: run(p99=0.3, rate=4.5)},
            0.5: {1: run(p99=0.303, rate=2.5)}, 2.0: {1: run(p99=0.31, rate=5.0)}}  # fmt: skip
    rows = {r["fraction"]: r for r in tradeoff.summarise(runs, idle_rps=5.0)}
    assert rows[1.0]["passed"] and rows[1.0]["job_rate"] == pytest.approx(0.9)
    assert not rows[0.5]["passed"]  # p99 within 1%, but the job takes half the idle capacity
    assert not rows[2.0]["passed"]  # the idle capacity taken, p99 0.968 of alone
    assert rows[2.0]["interactive_p99_ratio"] == pytest.approx(0.3 / 0.31)
    worse = {0.0: {1: run()}, 1.0: {1: run(attainment=0.98, rate=5.0)}}
    assert not tradeoff.summarise(worse, 5.0)[1]["passed"]


@pytest.mark.parametrize("beside, idle", [
    (run(p99=None, rate=5.0), 5.0),
    (run(p99=0.0, rate=5.0), 5.0),
    (run(rate=5.0), 0.0),
])  # fmt: skip
def test_a_missing_figure_or_zero_baseline_cannot_be_judged(beside, idle):
    with pytest.raises(tradeoff.TradeoffError):
        tradeoff.summarise({0.0: {1: run()}, 1.0: {1: beside}}, idle)


def test_a_zero_alone_attainment_cannot_be_judged():
    with pytest.raises(tradeoff.TradeoffError, match="baseline is 0"):
        tradeoff.summarise({0.0: {1: run(attainment=0.0)}, 1.0: {1: run(rate=5.0)}}, 5.0)


def test_the_saturated_share_is_of_the_window_between_the_samples_at_its_edges():
    saturation = [(0.0, 0.0), (10.0, 2.0), (20.0, 9.0), (30.0, 19.0)]
    assert tradeoff.saturated_share(saturation, 10.0, 30.0) == pytest.approx(17 / 20)
    # Edges between samples take the last sample at or before each.
    assert tradeoff.saturated_share(saturation, 12.5, 25.0) == pytest.approx(7 / 10)
    # A run that ended before the window's end: up to its last sample.
    assert tradeoff.saturated_share(saturation, 10.0, 40.0) == pytest.approx(17 / 20)
    assert tradeoff.saturated_share(saturation, 20.0, 25.0) is None  # one sample
    assert tradeoff.saturated_share(saturation, -1.0, 30.0) is None  # none before the start


def test_a_cell_reports_the_job_the_latency_tiers_and_the_engines_saturation():
    args = tradeoff.parse_args(["--duration", "40", "--warmup", "5"])
    cell = tradeoff.run_cell(tradeoff.cell_scenario(BASE, args, 8.0, 6.0), 8.0, 1)
    assert set(cell["tiers"]) == {"interactive", "standard"}
    assert cell["job_lines_per_s"] > 0
    assert 0 < cell["saturated_share"] <= 1


def test_an_override_is_merged_into_the_policy_of_every_cell():
    args = tradeoff.parse_args(["--override", '{"scheduler": {"reserve": {"slots": 0}}}'])
    base = tradeoff.sweep.with_override(BASE, args.override)
    scenario = tradeoff.cell_scenario(base, args, 10.0, 3.0)
    assert scenario.policy.scheduler.reserve.slots == 0
    assert tradeoff.cell_scenario(BASE, tradeoff.parse_args([]), 10.0, 3.0) \
        .policy.scheduler.reserve.slots == BASE.policy.scheduler.reserve.slots
