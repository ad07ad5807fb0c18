"""benchmarks/b3_http.py's plumbing, without the long run: B3's policy and mix
become a gateway policy and a bench scenario that validate, with their
durations stretched by the speed factor, and the sweep's rules judge bench
reports, a missing policy being an error."""

from __future__ import annotations

import argparse
import importlib.util
import json
import sys
from pathlib import Path

import pytest

from qosgate.bench.plan import plan_open
from qosgate.bench.scenario import BenchScenario
from qosgate.config.models import PolicyConfig
from qosgate.sim.workload import generate_arrivals
from tests.fleet_support import with_fleet

ROOT = Path(__file__).resolve().parent.parent
_SPEC = importlib.util.spec_from_file_location("b3_http", ROOT / "benchmarks" / "b3_http.py")
http = importlib.util.module_from_spec(_SPEC)
sys.modules[_SPEC.name] = http
_SPEC.loader.exec_module(http)
sweep = http.sweep
BASE = http.load_scenario(sweep.SCENARIO)
ARGS = argparse.Namespace(speed=0.1, duration=60.0, warmup=20.0, timeout=90.0, mix="b3")


def bench_report(interactive=1.0, standard=1.0, goodput=1.0, throughput=300.0) -> dict:
    """The slice of a `qosgate bench` report the rules read: the client sees
    no queue wait, so served_wait_max_s is None as the bench writes it."""
    tier = {"served_wait_max_s": None}
    return {
        "tiers": {"interactive": {**tier, "ttft_slo_attainment": interactive},
                  "standard": {**tier, "ttft_slo_attainment": standard},
                  "batch": {**tier, "ttft_slo_attainment": None}},
        "totals": {"goodput_rps": goodput, "throughput_tokens_per_s": throughput, "lost": 0},
    }  # fmt: skip


def table(policies=sweep.POLICIES, loads=(1.0, 2.0), seeds=(BASE.seed,), **qos) -> dict:
    """{cell: {seed: entry}}; qos's figures as given (a list: one per seed)."""
    def qos_on(index: int) -> dict:
        return {k: v[index] if isinstance(v, list) else v for k, v in qos.items()}

    return {
        sweep.Cell(http.MIX, http.ARRIVALS, load): {seed: {
            "capacity_rps": 1.6, "rate_rps": 1.6 * load, "interactive_demand": 0.1 * load,
            "bounds": {},
            "policies": {p: bench_report(**qos_on(index)) if p == "qos" else bench_report()
                         for p in policies},
        } for index, seed in enumerate(seeds)}
        for load in loads
    }  # fmt: skip


def test_the_gateway_policy_is_b3s_stretched_by_the_speed():
    policy = PolicyConfig.model_validate(http.serve_policy(BASE, "strict", 0.1))
    assert policy.scheduler.policy == "strict"
    assert policy.backend.speed == 0.1
    assert policy.tiers["interactive"].ttft_slo_ms == 5000
    assert policy.tiers["standard"].max_queue_wait_ms == 15000
    assert policy.scheduler.aging.interval_ms == 20000
    # Durations given in seconds, and those left at their defaults, stretch too.
    assert policy.scheduler.drain_rate_tau_s == 100
    assert policy.tiers["batch"].delivery_window_s == 600
    # A rate shrinks: the tier's delivery floor is per second of the slower engine.
    assert policy.tiers["batch"].min_delivery_bytes_per_s == pytest.approx(102.4)
    assert [t.id for t in policy.tenants] == [t.id for t in BASE.policy.tenants]
    assert all(len(t.api_keys) == 1 for t in policy.tenants)


def test_the_bench_scenario_sends_b3s_mix_with_stretched_slos():
    scenario = BenchScenario.model_validate(http.bench_scenario(BASE, 3.2, ARGS, 3))
    assert scenario.arrivals.rate_rps == 3.2
    assert [c.tenant_id for c in scenario.classes] == [c.tenant for c in BASE.classes]
    assert scenario.tiers["interactive"].ttft_slo_ms == 5000
    assert scenario.tiers["batch"].e2e_slo_ms == 600000
    assert scenario.lengths == BASE.lengths


def test_the_long_prompt_mix_sends_its_tenants_8k_prompts_beside_short_chat():
    scenario = BenchScenario.model_validate(http.bench_scenario(BASE, 3.2, ARGS, 3, "long"))
    prompts = {c.tenant_id: scenario.class_lengths(c).prompt.median for c in scenario.classes}
    assert {t for t, mean in prompts.items() if mean > 4000} == sweep.LONG_PROMPT_TENANTS


def test_good_figures_pass_and_a_bad_one_fails():
    status, checks = http.judge(table())
    assert status == 0
    # per cell: demand rule, 2 x vs strict, throughput, 3 x lost, plus goodput at 1x and 2x;
    # no stated bound (the client cannot see queue waits)
    assert len(checks) == 2 * 7 + 2
    assert http.judge(table(interactive=0.9))[0] == 1


def test_on_several_seeds_qos_against_strict_is_the_paired_difference():
    seeds = tuple(range(BASE.seed, BASE.seed + 5))
    # One run a request below strict, the others above: noise, not a shortfall.
    noisy = [0.996, 1.0, 1.0, 1.0, 1.0]
    assert http.judge(table(seeds=seeds, standard=noisy))[0] == 0
    assert http.judge(table(standard=0.996))[0] == 1
    # Below on every seed: a shortfall, however small.
    assert http.judge(table(seeds=seeds, standard=[0.996, 0.995, 0.997, 0.996, 0.998]))[0] == 1


def test_a_seed_missing_from_one_cell_is_an_error():
    cells = table(seeds=(BASE.seed, BASE.seed + 1))
    del cells[sweep.Cell(http.MIX, http.ARRIVALS, 2.0)][BASE.seed + 1]
    assert http.judge(cells)[0] == 2


def test_a_policy_not_run_is_an_error():
    assert http.judge(table(policies=("qos", "fcfs")))[0] == 2


def test_on_a_subset_the_rules_that_can_be_evaluated_still_are(capsys):
    # 2x alone, qos and strict: no 1x baseline, no fcfs; qos against strict is judged.
    status, checks = http.judge(table(policies=("qos", "strict"), loads=(2.0,), standard=0.9))
    assert status == 2
    assert [c.rule for c in checks if not c.passed] == ["standard attainment qos >= strict"]
    out = capsys.readouterr().out
    assert "ERROR  mix=b3 arrivals=poisson load=2x: qos goodput is compared with qos at 1x" in out
    assert "a rule needs policy 'fcfs'" in out


def test_no_baseline_load_is_an_error():
    assert http.judge(table(loads=(2.0, 4.0)))[0] == 2


def test_an_unknown_policy_on_the_command_line_is_an_error():
    assert http.main(["--policies", "qos,lifo"]) == 2


@pytest.mark.parametrize("mix", sweep.MIXES)
def test_the_simulator_replays_the_benchs_own_requests(mix):
    # The simulator's figures beside each HTTP figure are for the very requests
    # the bench sends, at the modelled GPU's pace.
    args = argparse.Namespace(speed=0.5, duration=20.0, warmup=5.0, timeout=90.0, mix=mix)
    rate = 8.0
    bench = BenchScenario.model_validate(
        http.bench_scenario(BASE, rate * args.speed, args, BASE.seed, mix))
    planned = plan_open(bench)
    twin = http.twin_scenario(BASE, args)
    arrivals = generate_arrivals(twin, twin.policy, rate, BASE.seed)
    assert len(arrivals) == len(planned) > 100
    assert [(a.tenant, a.prompt_tokens, a.output_tokens, a.max_tokens) for a in arrivals] == [
        (bench.classes[cls].tenant_id, prompt, output, output)
        for _, _, cls, prompt, output in planned
    ]
    assert [a.t for a in arrivals] == pytest.approx([t * args.speed for _, t, *_ in planned])


def test_an_override_reaches_the_gateway_and_the_simulator_twin_alike():
    # The twin replays the experiment, not B3: the scheduler's settings in
    # the modelled GPU's time, stretched for the gateway like B3's own.
    override = {"scheduler": {"aging": {"interval_ms": 1000}, "prefill_budget_tokens": 1024},
                "backend": {"max_num_seqs": 64}}
    base = http.with_modelled_override(BASE, override)
    twin = http.twin_scenario(base, ARGS)
    assert twin.policy.scheduler.aging.interval_ms == 1000
    assert twin.policy.scheduler.prefill_budget_tokens == 1024
    served = PolicyConfig.model_validate(
        sweep.merged(http.serve_policy(base, "qos", 0.1), http.gateway_only(override)))
    assert served.scheduler.aging.interval_ms == 10000
    assert served.scheduler.prefill_budget_tokens == 1024
    assert served.backend.max_num_seqs == 64 and served.backend.speed == 0.1
    # What the twin does not model stays out of it.
    assert twin.engine.max_num_seqs is None


def test_an_engine_reaches_the_gateway_the_simulator_twin_and_the_load_unit_alike():
    base = http.b3_scenario({}, engine={"scheduling_policy": "fcfs", "max_num_seqs": 64})
    served = PolicyConfig.model_validate(http.serve_policy(base, "qos", 0.1))
    assert served.backend.scheduling_policy == "fcfs" and served.backend.max_num_seqs == 64
    assert served.backend.speed == 0.1
    twin = http.twin_scenario(base, ARGS)
    assert (twin.engine.scheduling_policy, twin.engine.max_num_seqs) == ("fcfs", 64)
    # B3's own engine is left as it is.
    assert BASE.engine.scheduling_policy == "priority" and BASE.engine.max_num_seqs is None


def test_a_bad_engine_is_refused_naming_the_field(capsys):
    assert http.main(["--engine", '{"max_num_sqs": 64}', "--loads", "1"]) == 2
    err = capsys.readouterr().err
    assert "--engine" in err and "max_num_sqs" in err


def test_an_override_to_null_reaches_the_gateway_as_null():
    # Dropped, the gateway's default ("auto") would stand in for "no budget".
    override = {"scheduler": {"prefill_budget_tokens": None, "delay_prefill_tokens": None}}
    base = http.with_modelled_override(BASE, override)
    served = PolicyConfig.model_validate(
        sweep.merged(http.serve_policy(base, "qos", 0.1), http.gateway_only(override)))
    assert served.scheduler.prefill_budget_tokens is None
    assert served.scheduler.delay_prefill_tokens is None
    assert http.twin_scenario(base, ARGS).policy.scheduler.prefill_budget_tokens is None
    # Without the override both keep their default.
    default = PolicyConfig.model_validate(http.serve_policy(BASE, "qos", 0.1))
    assert default.scheduler.prefill_budget_tokens == "auto"


def test_seeds_count_from_the_first_one_given():
    assert http.b3_scenario({}).seed == BASE.seed
    assert http.b3_scenario({}, 5).seed == 5
    args = argparse.Namespace(speed=0.5, duration=20.0, warmup=5.0, timeout=90.0, mix="b3")
    # The bench draws a different run on another seed.
    assert (http.bench_scenario(BASE, 4.0, args, 5)["seed"]
            != http.bench_scenario(BASE, 4.0, args, BASE.seed)["seed"])


def test_twin_only_runs_no_gateway_and_judges_the_simulators_table(monkeypatch, tmp_path, capsys):
    def no_gateway(*args, **kwargs):
        raise AssertionError("--twin-only started a gateway run")

    monkeypatch.setattr(http, "run_cell", no_gateway)
    out = tmp_path / "twin.json"
    status = http.main(["--twin-only", "--loads", "1,2", "--duration", "20", "--warmup", "5",
                        "--seeds", "2", "--seed", "4", "--json", str(out)])
    printed = capsys.readouterr().out
    assert status in (0, 1), printed  # every policy ran: each rule can be judged
    assert "no gateway run" in printed and "checks pass" in printed
    doc = json.loads(out.read_text())
    assert doc["twin_only"] is True and doc["seeds"] == [4, 5]
    assert [row["load"] for row in doc["simulator_cells"]] == [1.0, 2.0]
    assert "cells" not in doc
    # Every policy's twin report, on each seed, is what the rules judged.
    assert set(doc["runs"]) == {f"{sweep.Cell(http.MIX, http.ARRIVALS, load)} seed {seed}"
                                for load in (1.0, 2.0) for seed in (4, 5)}
    assert all(set(run) == set(sweep.POLICIES) for run in doc["runs"].values())
    assert len(doc["checks"]) > 0


def test_a_bad_override_is_refused_naming_the_field(capsys):
    assert http.main(["--override", '{"scheduler": {"agin": {}}}', "--loads", "1"]) == 2
    err = capsys.readouterr().err
    assert "--override" in err and "agin" in err


def test_a_fleet_serves_the_same_policy():
    doc = with_fleet(http.serve_policy(BASE, "qos", 0.1), "redis://127.0.0.1:1/0")
    policy = PolicyConfig.model_validate(doc)
    assert policy.fleet is not None and policy.fleet.url == "redis://127.0.0.1:1/0"
    assert policy.tiers == PolicyConfig.model_validate(http.serve_policy(BASE, "qos", 0.1)).tiers


def test_the_counts_behind_each_figure_are_printed_per_tier():
    cell = sweep.Cell(http.MIX, http.ARRIVALS, 2.0)
    tier = {"requests": 70, "completed": 50, "rejected_overload": 12, "rejected_queue_full": 0,
            "expired": 5, "errors": 3, "error_types": {"timeout": 2, "stream_error": 1},
            "ttft_p50_s": 0.2, "ttft_p99_s": 0.45, "ttft_slo_attainment": 0.7}
    report = {"tiers": {"interactive": tier}, "totals": {"sent": 70, "wall_s": 80.0},
              "gateway": {"outcomes": {"interactive": {"completed": 60, "expired": 7}},
                          "queue_wait": {"interactive": {"p50_s": 0.1, "p99_s": 0.3}},
                          "cpu_s": {"single": 12.5}}}
    sim = {"requests": 70, "completed": 55, "rejected_overload": 10, "rejected_queue_full": 0,
           "expired": 5, "cancelled": 0, "backend_error": 0, "ttft_p50_s": 0.02,
           "ttft_p99_s": 0.04, "queue_wait_p99_s": 0.03, "ttft_slo_attainment": 0.75}
    text = http.tier_counts({cell: {3: {"policies": {"qos": report}}}},
                            {cell: {3: {"policies": {"qos": {"tiers": {"interactive": sim}}}}}},
                            0.1)  # fmt: skip
    http_row, gw_row, sim_row = text.splitlines()[2:]
    assert http_row.split()[:10] == ["interactive", "http", "70", "50", "12", "0", "5", "2", "1",
                                     "0.2"]
    assert "stream_error" in http_row
    assert gw_row.split() == ["gw", "67", "60", "0", "0", "7", "0", "0", "0.1", "0.3"]
    # The simulator's times are the modelled GPU's: at speed 0.1, ten times as long here.
    assert sim_row.split()[:10] == ["sim", "70", "55", "10", "0", "5", "0", "0", "0.2", "0.4"]
    assert text.splitlines()[0].startswith(f"{cell} seed 3 qos:")
    assert "single 12.5" in text.splitlines()[0]
