"""End to end: `qosgate simulate` through the CLI entry point, on small scenario
files written into tmp_path (each run is a fraction of a CPU second)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import yaml

from qosgate.cli import main

ROOT = Path(__file__).resolve().parent.parent

TIER_KEYS = (
    "requests",
    "completed",
    "rejected",
    "expired",
    "ttft_slo_attainment",
    "ttft_p50_s",
    "ttft_p99_s",
    "queue_wait_p99_s",
    "queue_wait_max_s",
)
TOTAL_KEYS = (
    "throughput_tokens_per_s",
    "goodput_rps",
    "max_service_difference",
    "avg_service_difference",
    "lost",
)

POLICY = {
    "tiers": {
        "interactive": {"priority": 0, "ttft_slo_ms": 500, "max_queue_wait_ms": 250,
                        "on_timeout": "reject", "max_tokens": 1024},
        "standard": {"priority": 1, "ttft_slo_ms": 2000, "max_queue_wait_ms": 1500,
                     "on_timeout": "reject", "max_tokens": 1024},
        "batch": {"priority": 2, "e2e_slo_ms": 60000, "max_queue_wait_ms": 20000,
                  "on_timeout": "delay", "max_tokens": 1024},
    },
    "tenants": [
        {"id": "chat", "tier": "interactive"},
        {"id": "search", "tier": "standard"},
        {"id": "docs", "tier": "standard"},
        {"id": "eval", "tier": "batch"},
    ],
    "scheduler": {"policy": "qos", "fairness": "vtc",
                  "aging": {"interval_ms": 2000, "max_boost": 2}, "reserve": {"slots": 6}},
}


def three_tier(**overrides) -> dict:
    """B3 in miniature: three tiers at 2x capacity for 60 simulated seconds."""
    data = {
        "name": "mini",
        "seed": 1,
        "duration_s": 60,
        "warmup_s": 10,
        "drain_s": 30,
        "policies": ["fcfs", "strict", "qos"],
        "arrivals": {"load": 2.0},
        "lengths": {
            "prompt": {"median": 1000, "sigma": 1.0, "min": 4, "max": 4096},
            "output": {"median": 150, "sigma": 0.9, "min": 1, "max": 1024},
        },
        "classes": [
            {"tenant": "chat", "share": 1},
            {"tenant": "search", "share": 3},
            {"tenant": "docs", "share": 3},
            {"tenant": "eval", "share": 3},
        ],
        "policy": POLICY,
        "targets": [
            {"name": "nothing lost", "metric": "policies.qos.totals.lost", "op": "==", "value": 0},
        ],
    }
    data.update(overrides)
    return data


def write(tmp_path: Path, data: dict | str, name: str = "scenario.yaml") -> Path:
    path = tmp_path / name
    path.write_text(data if isinstance(data, str) else yaml.safe_dump(data, sort_keys=False))
    return path


def simulate(*args: str | Path) -> int:
    return main(["simulate", *map(str, args), "--quiet"])


def test_json_has_the_benchmark_keys_for_every_policy(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    out = tmp_path / "out.json"
    assert simulate(write(tmp_path, three_tier()), "--json", out) == 0
    assert "PASS" in capsys.readouterr().out
    result = json.loads(out.read_text())
    assert result["scenario"] == "mini"
    assert set(result["policies"]) == {"fcfs", "strict", "qos"}
    for name, run in result["policies"].items():
        assert set(run["tiers"]) == {"interactive", "standard", "batch"}, name
        for tier, stats in run["tiers"].items():
            missing = [key for key in TIER_KEYS if key not in stats]
            assert not missing, (name, tier, missing)
            assert stats["requests"] > 0
        assert [key for key in TOTAL_KEYS if key not in run["totals"]] == []
        assert run["totals"]["lost"] == 0
        assert run["totals"]["throughput_tokens_per_s"] > 0
        # Tiers with a TTFT SLO have an attainment; batch (end to end only) has none.
        assert 0.0 <= run["tiers"]["interactive"]["ttft_slo_attainment"] <= 1.0
        assert run["tiers"]["batch"]["ttft_slo_attainment"] is None
    # Same arrivals for every policy.
    counts = {name: run["totals"]["requests"] for name, run in result["policies"].items()}
    assert len(set(counts.values())) == 1, counts


def test_policies_filter(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    out = tmp_path / "out.json"
    assert simulate(write(tmp_path, three_tier()), "--policies", "qos,fcfs", "--json", out) == 0
    assert set(json.loads(out.read_text())["policies"]) == {"qos", "fcfs"}
    assert "policy strict" not in capsys.readouterr().out


def test_policies_filter_rejects_an_unknown_policy(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    assert simulate(write(tmp_path, three_tier()), "--policies", "qos,lifo") == 2
    assert "lifo" in capsys.readouterr().err


def test_repeated_load_writes_one_run_per_load(tmp_path: Path) -> None:
    out = tmp_path / "out.json"
    path = write(tmp_path, three_tier(policies=["qos"]))
    assert simulate(path, "--load", "0.5", "--load", "1.5", "--json", out) == 0
    payload = json.loads(out.read_text())
    assert set(payload) == {"scenario", "runs"}
    assert payload["scenario"] == "mini"
    assert [run["load"] for run in payload["runs"]] == [0.5, 1.5]
    low, high = (run["policies"]["qos"]["totals"]["requests"] for run in payload["runs"])
    assert high > 2 * low
    for run in payload["runs"]:
        assert run["policies"]["qos"]["totals"]["lost"] == 0


def test_plot_writes_a_png(tmp_path: Path) -> None:
    png = tmp_path / "plot.png"
    assert simulate(write(tmp_path, three_tier(policies=["fcfs", "qos"])), "--plot", png) == 0
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_a_failing_target_exits_1_and_says_fail(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    targets = [
        {"name": "nothing lost", "metric": "policies.qos.totals.lost", "op": "==", "value": 0},
        {"name": "impossible goodput", "metric": "policies.qos.totals.goodput_rps",
         "op": ">=", "value": 1e9},
    ]
    out = tmp_path / "out.json"
    assert simulate(write(tmp_path, three_tier(policies=["qos"], targets=targets)),
                    "--json", out) == 1
    printed = capsys.readouterr().out
    assert "FAIL  impossible goodput" in printed
    assert "PASS  nothing lost" in printed
    checks = {t["name"]: t["passed"] for t in json.loads(out.read_text())["targets"]}
    assert checks == {"nothing lost": True, "impossible goodput": False}


def test_a_target_on_a_missing_metric_fails(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    targets = [{"name": "typo", "metric": "policies.qos.totals.nope", "op": "==", "value": 0}]
    assert simulate(write(tmp_path, three_tier(policies=["qos"], targets=targets))) == 1
    assert "FAIL  typo" in capsys.readouterr().out


def _bad_file(tmp_path: Path, capsys: pytest.CaptureFixture[str], text: str) -> str:
    path = write(tmp_path, text, "bad.yaml")
    assert simulate(path) == 2
    captured = capsys.readouterr()
    assert "Traceback" not in captured.out + captured.err
    return captured.err


def test_unknown_key_names_field_and_line(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    text = yaml.safe_dump(three_tier(), sort_keys=False).replace("duration_s:", "duraton_s:")
    line = next(i for i, row in enumerate(text.splitlines(), 1) if row.startswith("duraton_s:"))
    err = _bad_file(tmp_path, capsys, text)
    assert f"bad.yaml:{line}: duraton_s: unknown key" in err


def test_unknown_tenant_in_a_class_names_field_and_line(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    data = three_tier()
    data["classes"][2] = {"tenant": "mallory", "share": 3}
    text = yaml.safe_dump(data, sort_keys=False)
    line = next(i for i, row in enumerate(text.splitlines(), 1) if "mallory" in row)
    err = _bad_file(tmp_path, capsys, text)
    assert f"bad.yaml:{line}: classes.2.tenant: unknown tenant 'mallory'" in err


def test_bad_yaml_names_its_line(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    err = _bad_file(tmp_path, capsys, "name: mini\nduration_s: 60\nclasses: [\n  {tenant: a\n")
    assert "bad.yaml:" in err
    assert "invalid YAML" in err


def test_missing_scenario_file_exits_2(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    assert simulate(tmp_path / "nope.yaml") == 2
    captured = capsys.readouterr()
    assert "not found" in captured.err
    assert "Traceback" not in captured.out + captured.err


def test_seed_tables_file_runs_and_passes(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    out = tmp_path / "b10.json"
    assert simulate(ROOT / "benchmarks" / "b10_seed_tables.yaml", "--json", out) == 0
    result = json.loads(out.read_text())
    assert result["profiles"]
    assert all(p["all_within_10pct"] for p in result["profiles"].values())


def test_trace_scenario_replays_exactly_the_trace(tmp_path: Path) -> None:
    records = []
    for i in range(40):
        tenant = ("chat", "search", "docs", "eval")[i % 4]
        records.append({"t": round(0.25 * i, 3), "tenant": tenant,
                        "prompt_tokens": 100 + 7 * i, "output_tokens": 20 + i, "id": f"q{i}"})
    (tmp_path / "trace.jsonl").write_text("".join(json.dumps(r) + "\n" for r in records))
    data = three_tier(policies=["fcfs", "qos"], warmup_s=0, duration_s=30, drain_s=120,
                      trace="trace.jsonl")
    for key in ("arrivals", "lengths", "classes"):
        data.pop(key)
    out = tmp_path / "out.json"
    assert simulate(write(tmp_path, data), "--json", out) == 0
    result = json.loads(out.read_text())
    for name, run in result["policies"].items():
        assert run["totals"]["requests"] == len(records), name
        assert run["totals"]["completed"] == len(records), name
        assert run["totals"]["lost"] == 0
        for tenant in ("chat", "search", "docs", "eval"):
            mine = [r for r in records if r["tenant"] == tenant]
            stats = run["tenants"][tenant]
            assert stats["requests"] == len(mine)
            assert stats["prompt_tokens"] == sum(r["prompt_tokens"] for r in mine)
            assert stats["output_tokens"] == sum(r["output_tokens"] for r in mine)


def test_trace_with_an_unknown_tenant_exits_2(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    (tmp_path / "trace.jsonl").write_text(
        '{"t": 0, "tenant": "chat", "prompt_tokens": 10, "output_tokens": 5}\n'
        '{"t": 1, "tenant": "mallory", "prompt_tokens": 10, "output_tokens": 5}\n'
    )
    data = three_tier(trace="trace.jsonl")
    for key in ("arrivals", "lengths", "classes"):
        data.pop(key)
    assert simulate(write(tmp_path, data)) == 2
    captured = capsys.readouterr()
    assert "trace.jsonl:2" in captured.err
    assert "Traceback" not in captured.out + captured.err


def test_qos_protects_interactive_ttft_under_overload(tmp_path: Path) -> None:
    # A behavioural check (simulated time, not wall time): at 2x capacity the
    # interactive tier's TTFT tail under qos is far below what one FIFO gives it.
    out = tmp_path / "out.json"
    assert simulate(write(tmp_path, three_tier(policies=["fcfs", "qos"])), "--json", out) == 0
    runs = json.loads(out.read_text())["policies"]
    qos = runs["qos"]["tiers"]["interactive"]
    fcfs = runs["fcfs"]["tiers"]["interactive"]
    assert qos["ttft_p99_s"] < fcfs["ttft_p99_s"]
    assert qos["ttft_slo_attainment"] > fcfs["ttft_slo_attainment"]


@pytest.mark.parametrize("field", ["policy", "trace"])
def test_a_missing_referenced_file_is_named_relative_to_the_scenario(tmp_path: Path, field: str) -> None:
    from pydantic import ValidationError

    from qosgate.sim.scenario import Scenario

    data: dict = {"name": "x", "duration_s": 1, "policy": {"tiers": {"t": {"priority": 0}}}}
    data[field] = "missing.file"
    with pytest.raises(ValidationError) as error:
        Scenario.model_validate(data, context={"base_dir": tmp_path})
    assert f"{field} file {str(tmp_path / 'missing.file')!r} not found" in str(error.value)


def test_the_engine_block_says_how_much_of_its_time_the_engine_was_saturated(
    tmp_path: Path,
) -> None:
    # At 2x the engine's capacity it is saturated most of the time (not in the
    # drain, as it empties); at a twentieth it runs few sequences on few
    # tokens and hardly ever is.
    shares = {}
    for load in (2.0, 0.05):
        out = tmp_path / f"out-{load}.json"
        scenario = three_tier(policies=["qos"], arrivals={"load": load})
        assert simulate(write(tmp_path, scenario, f"s-{load}.yaml"), "--json", out) == 0
        engine = json.loads(out.read_text())["policies"]["qos"]["engine"]
        assert 0 <= engine["saturated_s"] <= engine["busy_s"]
        shares[load] = engine["saturated_s"] / engine["busy_s"]
    assert shares[2.0] > 0.6 and shares[0.05] < 0.1, shares
