"""benchmarks/b3_sweep.py: its pass rules fail when they should, and a rule that
cannot be evaluated is an error, never a pass."""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
_SPEC = importlib.util.spec_from_file_location("b3_sweep", ROOT / "benchmarks" / "b3_sweep.py")
sweep = importlib.util.module_from_spec(_SPEC)
# dataclasses look their module up in sys.modules while the class is built.
sys.modules[_SPEC.name] = sweep
_SPEC.loader.exec_module(sweep)
Cell, SweepError = sweep.Cell, sweep.SweepError


def report(interactive=1.0, standard=1.0, goodput=10.0, throughput=1000.0, lost=0) -> dict:
    return {
        "tiers": {
            "interactive": {"ttft_slo_attainment": interactive, "served_wait_max_s": 0.1},
            "standard": {"ttft_slo_attainment": standard, "served_wait_max_s": 1.0},
            "batch": {"ttft_slo_attainment": None, "served_wait_max_s": 20.0},
        },
        "totals": {"goodput_rps": goodput, "throughput_tokens_per_s": throughput, "lost": lost},
    }


def table(loads=(1.0, 2.0), demand=0.2, **qos) -> dict:
    return {
        Cell("b3", "poisson", load): {
            "capacity_rps": 10.0, "rate_rps": 10.0 * load, "interactive_demand": demand,
            "bounds": {"interactive": 0.25, "standard": 1.5, "batch": 30.0},
            "policies": {"qos": report(**qos), "strict": report(), "fcfs": report()},
        }
        for load in loads
    }


def test_rules_pass_on_good_figures():
    checks = sweep.evaluate(table())
    # 2 cells: demand rule, 2 x vs strict, throughput, 3 x bound, 3 x lost, plus goodput at
    # 1x and 2x
    assert len(checks) == 2 * 10 + 2
    assert all(check.passed for check in checks)


@pytest.mark.parametrize(
    ("arrivals", "attainment", "passed"),
    [("poisson", 0.985, False), ("gamma2", 0.985, False), ("gamma4", 0.96, True),
     ("gamma4", 0.94, False)],
)
def test_interactive_floor_depends_on_the_arrivals(arrivals, attainment, passed):
    cells = table(interactive=attainment)
    cells = {Cell(c.mix, arrivals, c.load): v for c, v in cells.items()}
    for entry in cells.values():
        entry["policies"]["strict"]["tiers"]["interactive"]["ttft_slo_attainment"] = 0.0
    floor = [c for c in sweep.evaluate(cells) if c.rule.startswith("interactive attainment (qos)")]
    assert [c.passed for c in floor] == [passed, passed]


def test_interactive_floor_only_where_its_demand_fits():
    checks = sweep.evaluate(table(demand=0.81, interactive=0.5))
    assert not any(c.rule.startswith("interactive attainment (qos)") for c in checks)
    # ... but qos must still do as well as strict there
    assert [c.passed for c in checks if c.rule == "interactive attainment qos >= strict"] == [
        False, False]


def test_each_rule_fails_with_its_cell_and_figures():
    bad = table(standard=0.5, goodput=5.0, throughput=900.0, lost=2)
    bad[Cell("b3", "poisson", 1.0)]["policies"]["qos"] = report()
    failed = [sweep.format_check(c) for c in sweep.evaluate(bad) if not c.passed]
    assert failed == [
        "FAIL  mix=b3 arrivals=poisson load=2x: standard attainment qos >= strict: 0.500 >= 1.000",
        "FAIL  mix=b3 arrivals=poisson load=2x: qos goodput / qos goodput at 1x: 0.500 >= 0.900",
        "FAIL  mix=b3 arrivals=poisson load=2x: qos throughput / fcfs throughput: 0.900 >= 0.980",
        "FAIL  mix=b3 arrivals=poisson load=2x: requests lost (qos): 2.000 == 0.000",
    ]


def test_a_served_wait_past_its_tiers_stated_bound_fails():
    cells = table()
    cells[Cell("b3", "poisson", 2.0)]["policies"]["qos"]["tiers"]["batch"][
        "served_wait_max_s"] = 30.5
    failed = [sweep.format_check(c) for c in sweep.evaluate(cells) if not c.passed]
    assert failed == ["FAIL  mix=b3 arrivals=poisson load=2x: batch max served wait (qos) "
                      "within its stated bound: 30.500 <= 30.000"]


def test_a_rule_on_a_policy_not_run_is_an_error():
    cells = table()
    for entry in cells.values():
        del entry["policies"]["fcfs"]
    with pytest.raises(SweepError, match="policy 'fcfs', which was not run"):
        sweep.evaluate(cells)


def test_no_baseline_load_in_the_selection_is_an_error():
    with pytest.raises(SweepError, match="qos at 1x, which is not in the selection"):
        sweep.evaluate(table(loads=(2.0, 4.0)))


def test_a_zero_denominator_is_an_error():
    cells = table()
    cells[Cell("b3", "poisson", 1.0)]["policies"]["fcfs"]["totals"][
        "throughput_tokens_per_s"] = 0.0
    with pytest.raises(SweepError, match="fcfs throughput: the denominator is 0"):
        sweep.evaluate(cells)


def test_a_missing_figure_is_an_error():
    with pytest.raises(SweepError, match="interactive.ttft_slo_attainment is missing"):
        sweep.evaluate(table(interactive=None))


def test_main_exit_status_and_output(monkeypatch, capsys):
    results = {"cells": table()}
    monkeypatch.setattr(sweep, "run_sweep", lambda *args: results["cells"])
    assert sweep.main(["--loads", "1,2", "--mix", "b3", "--arrivals", "poisson"]) == 0
    results["cells"] = table(standard=0.5)
    assert sweep.main([]) == 1
    assert "FAIL  mix=b3 arrivals=poisson load=1x: standard attainment" in capsys.readouterr().out
    results["cells"] = table(loads=(2.0,))
    assert sweep.main([]) == 2
    assert "ERROR  mix=b3 arrivals=poisson load=2x: qos goodput" in capsys.readouterr().out
    assert sweep.main(["--mix", "b4"]) == 2
    assert "unknown ['b4']" in capsys.readouterr().err


def test_long_mix_puts_8k_prompts_beside_short_chat():
    base = sweep.load_scenario(sweep.SCENARIO)
    long = sweep.cell_scenario(base, "long", "gamma4")
    assert (long.arrivals.process, long.arrivals.burstiness) == ("gamma", 4.0)
    medians = {c.tenant: long.class_lengths(c).prompt.median for c in long.classes}
    assert medians["docs-qa"] == medians["nightly-eval"] == 8000
    assert medians["chat-app"] == medians["search"] == 300
    assert sweep.cell_scenario(base, "b3", "poisson").classes == base.classes


def test_one_real_cell_runs_every_policy(monkeypatch):
    monkeypatch.setattr(sweep, "DURATION_S", 20.0)
    monkeypatch.setattr(sweep, "WARMUP_S", 5.0)
    monkeypatch.setattr(sweep, "DRAIN_S", 10.0)
    base = sweep.load_scenario(sweep.SCENARIO)
    cells = sweep.run_sweep(base, ["b3"], ["poisson"], [1.0], sweep.POLICIES, 3)
    entry = cells[Cell("b3", "poisson", 1.0)]
    assert set(entry["policies"]) == set(sweep.POLICIES)
    assert entry["interactive_demand"] == pytest.approx(0.1, rel=0.2)
    checks = sweep.evaluate(cells)
    assert {c.rule for c in checks} >= {"qos throughput / fcfs throughput",
                                        "requests lost (strict)"}
