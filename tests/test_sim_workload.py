"""Scenario validation and workload generation for `qosgate simulate`."""

from __future__ import annotations

import json
import statistics

import pytest
import yaml
from pydantic import ValidationError

from qosgate.config import ConfigError
from qosgate.config.models import PolicyConfig
from qosgate.sim.scenario import Scenario, load_scenario
from qosgate.sim.workload import (
    Arrival,
    TraceError,
    capacity_workload,
    class_rates,
    generate_arrivals,
    load_trace,
)

POLICY = {
    "tiers": {
        "interactive": {"priority": 0, "ttft_slo_ms": 500, "max_tokens": 1024},
        "standard": {"priority": 1, "ttft_slo_ms": 2000, "max_tokens": 2048},
        "batch": {"priority": 2, "e2e_slo_ms": 60000, "default_max_tokens": 512},
    },
    "tenants": [
        {"id": "alice", "tier": "interactive"},
        {"id": "bob", "tier": "standard"},
        {"id": "carol", "tier": "batch"},
    ],
}
LENGTHS = {
    "prompt": {"median": 1000, "sigma": 1.0, "min": 10, "max": 4096},
    "output": {"median": 150, "sigma": 0.9, "min": 1, "max": 1024},
}


def scenario(**overrides) -> Scenario:
    data = {
        "name": "test",
        "duration_s": 100.0,
        "policy": POLICY,
        "arrivals": {"rate_rps": 10.0},
        "lengths": LENGTHS,
        "classes": [
            {"tenant": "alice", "share": 1},
            {"tenant": "bob", "share": 6},
            {"tenant": "carol", "share": 3},
        ],
    }
    data.update(overrides)
    return Scenario.model_validate(data)


@pytest.fixture
def policy() -> PolicyConfig:
    return PolicyConfig.model_validate(POLICY)


def test_same_seed_same_arrivals_and_other_seed_differs(policy):
    s = scenario()
    first = generate_arrivals(s, policy, 10.0, seed=7)
    assert first == generate_arrivals(s, policy, 10.0, seed=7)
    assert first != generate_arrivals(s, policy, 10.0, seed=8)
    assert [a.t for a in first] == sorted(a.t for a in first)
    assert len({a.id for a in first}) == len(first)
    assert all(0 <= a.t < s.duration_s for a in first)
    assert all(isinstance(a, Arrival) for a in first)


def test_rate_and_shares_match_configuration(policy):
    s = scenario(duration_s=2000.0)
    arrivals = generate_arrivals(s, policy, 10.0, seed=1)
    assert len(arrivals) == pytest.approx(20_000, rel=0.03)
    share = {t: sum(a.tenant == t for a in arrivals) / len(arrivals) 
             for t in ("alice", "bob", "carol")}
    assert share["alice"] == pytest.approx(0.1, abs=0.01)
    assert share["bob"] == pytest.approx(0.6, abs=0.01)
    assert share["carol"] == pytest.approx(0.3, abs=0.01)
    tiers = {a.tenant: a.tier for a in arrivals}
    assert tiers == {"alice": "interactive", "bob": "standard", "carol": "batch"}


def test_absolute_rate_class_ignores_total_rate(policy):
    s = scenario(
        duration_s=1000.0,
        classes=[{"tenant": "alice", "share": 1}, {"tenant": "carol", "rate_rps": 2.0}],
    )
    assert class_rates(s, 5.0) == [5.0, 2.0]
    arrivals = generate_arrivals(s, policy, 5.0, seed=3)
    assert sum(a.tenant == "carol" for a in arrivals) == pytest.approx(2000, rel=0.07)
    assert sum(a.tenant == "alice" for a in arrivals) == pytest.approx(5000, rel=0.05)


def test_on_off_class_is_silent_when_off(policy):
    s = scenario(
        duration_s=600.0,
        classes=[
            {"tenant": "alice", "share": 1},
            {"tenant": "bob", "rate_rps": 20.0, "on_s": 10, "off_s": 20, "phase_s": 5},
        ],
    )
    arrivals = generate_arrivals(s, policy, 1.0, seed=11)
    bob = [a.t for a in arrivals if a.tenant == "bob"]
    assert bob and all((t - 5) % 30 < 10 for t in bob)
    # 20 on-periods of 10 s at 20 req/s
    assert len(bob) == pytest.approx(4000, rel=0.05)
    assert any(t < 5 for t in [a.t for a in arrivals if a.tenant == "alice"])
    assert min(bob) >= 5


def test_on_off_phase_inside_an_on_period(policy):
    # Phase 25 with a 30 s period: at t=0 the class is 5 s into an on period.
    s = scenario(
        duration_s=300.0,
        classes=[{"tenant": "bob", "rate_rps": 10.0, "on_s": 10, "off_s": 20, "phase_s": 25}],
    )
    bob = [a.t for a in generate_arrivals(s, policy, None, seed=2)]
    assert all((t - 25) % 30 < 10 for t in bob)
    assert any(t < 5 for t in bob)


def test_lengths_respect_bounds_and_median(policy):
    s = scenario(duration_s=2000.0)
    arrivals = generate_arrivals(s, policy, 10.0, seed=5)
    prompts = [a.prompt_tokens for a in arrivals]
    assert min(prompts) >= 10 and max(prompts) <= 4096
    assert max(prompts) == 4096  # sigma 1.0 reaches the cap in 20k draws
    assert statistics.median(prompts) == pytest.approx(1000, rel=0.05)
    outputs = [a.output_tokens for a in arrivals if a.tenant == "carol"]
    # carol's tier caps max_tokens at 4096 (the default), so outputs are unclipped
    assert statistics.median(outputs) == pytest.approx(150, rel=0.07)
    assert all(1 <= o <= 1024 for o in outputs)


def test_fixed_lengths_with_sigma_zero(policy):
    s = scenario(lengths={"prompt": {"median": 256}, "output": {"median": 256}})
    arrivals = generate_arrivals(s, policy, 10.0, seed=0)
    assert {(a.prompt_tokens, a.output_tokens) for a in arrivals} == {(256, 256)}


def test_class_lengths_override(policy):
    s = scenario(
        classes=[
            {"tenant": "alice", "lengths": {"prompt": {"median": 50}}},
            {"tenant": "bob"},
        ]
    )
    arrivals = generate_arrivals(s, policy, 10.0, seed=0)
    assert {a.prompt_tokens for a in arrivals if a.tenant == "alice"} == {50}
    assert len({a.prompt_tokens for a in arrivals if a.tenant == "bob"}) > 10


def _cv(times: list[float]) -> float:
    gaps = [b - a for a, b in zip(times, times[1:])]
    return statistics.pstdev(gaps) / statistics.fmean(gaps)


def test_gamma_burstiness_raises_interarrival_cv(policy):
    one = [{"tenant": "alice"}]
    poisson = scenario(duration_s=2000.0, classes=one)
    bursty = scenario(
        duration_s=2000.0,
        classes=one,
        arrivals={"rate_rps": 10.0, "process": "gamma", "burstiness": 3.0},
    )
    t_poisson = [a.t for a in generate_arrivals(poisson, policy, 10.0, seed=4)]
    t_bursty = [a.t for a in generate_arrivals(bursty, policy, 10.0, seed=4)]
    assert _cv(t_poisson) == pytest.approx(1.0, abs=0.05)
    assert _cv(t_bursty) > 2.5
    # the rate is kept
    assert len(t_bursty) == pytest.approx(20_000, rel=0.1)


@pytest.mark.parametrize("cv", [2.0, 4.0])
def test_gamma_gaps_have_the_rate_and_cv_asked_for(policy, cv):
    # The B3 sweep's bursty arrivals: the rate must stay the asked one while the
    # gaps' coefficient of variation is the burstiness.
    bursty = scenario(
        duration_s=20_000.0,
        classes=[{"tenant": "alice"}],
        arrivals={"rate_rps": 5.0, "process": "gamma", "burstiness": cv},
    )
    times = [a.t for a in generate_arrivals(bursty, policy, 5.0, seed=7)]
    gaps = [b - a for a, b in zip(times, times[1:])]
    assert statistics.fmean(gaps) == pytest.approx(1 / 5.0, rel=0.05)
    assert _cv(times) == pytest.approx(cv, rel=0.1)


def test_max_tokens_rules(policy):
    cap = generate_arrivals(scenario(max_tokens="cap"), policy, 10.0, seed=0)
    caps = {"interactive": 1024, "standard": 2048, "batch": 4096}
    assert all(a.max_tokens == caps[a.tier] and a.output_tokens <= a.max_tokens for a in cap)
    exact = generate_arrivals(scenario(max_tokens="output"), policy, 10.0, seed=0)
    assert all(a.max_tokens == a.output_tokens for a in exact)
    fixed = generate_arrivals(scenario(max_tokens=100), policy, 10.0, seed=0)
    assert all(a.max_tokens == 100 and a.output_tokens <= 100 for a in fixed)
    assert any(a.output_tokens == 100 for a in fixed)  # long outputs are cut
    # the same draws underneath: only the cut differs
    assert [a.prompt_tokens for a in cap] == [a.prompt_tokens for a in fixed]


def test_an_hour_of_arrivals_is_generated_whole(policy):
    # How fast is B9's business (benchmarks/b9_hour.yaml), not a unit test's.
    s = scenario(duration_s=3600.0)
    arrivals = generate_arrivals(s, policy, 5.0, seed=0)
    assert len(arrivals) > 17_000
    assert arrivals[-1].t < 3600.0 <= arrivals[-1].t + 10.0


def test_capacity_workload_mix(policy):
    s = scenario()
    work = capacity_workload(s, policy, 5000, seed=1)
    assert len(work) == 5000 and all(a.t == 0.0 for a in work)
    assert len({a.id for a in work}) == 5000
    assert sum(a.tenant == "bob" for a in work) / 5000 == pytest.approx(0.6, abs=0.03)
    assert work == capacity_workload(s, policy, 5000, seed=1)


def test_capacity_workload_weighs_on_off_classes(policy):
    s = scenario(
        classes=[
            {"tenant": "alice", "share": 1},
            {"tenant": "bob", "share": 1, "on_s": 10, "off_s": 30},
        ]
    )
    work = capacity_workload(s, policy, 10_000, seed=1)
    assert sum(a.tenant == "bob" for a in work) / 10_000 == pytest.approx(0.2, abs=0.02)


# -- traces ------------------------------------------------------------------------------


def _write(path, lines):
    path.write_text("\n".join(lines) + "\n")
    return path


def test_load_trace(tmp_path, policy):
    trace = _write(
        tmp_path / "t.jsonl",
        [
            json.dumps({"t": 2.5, "tenant": "alice", "prompt_tokens": 10, "output_tokens": 2000}),
            "",
            json.dumps({"t": 1.0, "tenant": "carol", "prompt_tokens": 20, "output_tokens": 700,
                        "id": "x"}),
            json.dumps({"t": 3, "tenant": "bob", "prompt_tokens": 5, "output_tokens": 50,
                        "max_tokens": 40}),
        ],
    )
    arrivals = load_trace(trace, policy)
    assert [a.id for a in arrivals] == ["x", "line1", "line4"]
    carol, alice, bob = arrivals
    assert (carol.tier, carol.max_tokens, carol.output_tokens) == ("batch", 512, 512)
    assert (alice.tier, alice.max_tokens, alice.output_tokens) == ("interactive", 1024, 1024)
    assert (bob.max_tokens, bob.output_tokens, bob.t) == (40, 40, 3.0)


@pytest.mark.parametrize(
    ("line", "message"),
    [
        ("{not json", "line 2|:2:"),
        (json.dumps({"t": 1, "tenant": "mallory", "prompt_tokens": 1, "output_tokens": 1}),
         "unknown tenant 'mallory'"),
        (json.dumps({"t": 1, "tenant": "bob", "output_tokens": 1}), "missing keys"),
        (json.dumps({"t": -1, "tenant": "bob", "prompt_tokens": 1, "output_tokens": 1}), "t: must"),
        (json.dumps({"t": 1, "tenant": "bob", "prompt_tokens": 1.5, "output_tokens": 1}),
         "prompt_tokens"),
        (json.dumps({"t": 1, "tenant": "bob", "prompt_tokens": 1, "output_tokens": 1, "x": 1}),
         "unknown keys"),
        (json.dumps({"t": 1, "tenant": "bob", "prompt_tokens": 1, "output_tokens": 1, "id": "a"}),
         "duplicate 'a'"),
        ("[1, 2]", "JSON object"),
    ],
)
def test_bad_trace_lines_name_the_line(tmp_path, policy, line, message):
    good = json.dumps({"t": 0, "tenant": "bob", "prompt_tokens": 1, "output_tokens": 1, "id": "a"})
    trace = _write(tmp_path / "bad.jsonl", [good, line])
    with pytest.raises(TraceError, match=r"bad\.jsonl:2: ") as info:
        load_trace(trace, policy)
    assert any(part in str(info.value) for part in message.split("|"))


def test_scenario_file_with_policy_and_trace_paths(tmp_path, policy):
    (tmp_path / "policies").mkdir()
    (tmp_path / "policies" / "p.yaml").write_text(yaml.safe_dump(POLICY))
    _write(
        tmp_path / "trace.jsonl",
        [
            json.dumps({"t": t, "tenant": "bob", "prompt_tokens": 8, "output_tokens": 8})
            for t in (0.5, 1.5, 9.0, 12.0)
        ],
    )
    (tmp_path / "s.yaml").write_text(
        yaml.safe_dump(
            {
                "name": "replay",
                "duration_s": 10,
                "policy": "policies/p.yaml",
                "trace": "trace.jsonl",
                "policies": ["fcfs", "qos"],
                "targets": [{"name": "lost", "metric": "policies.qos.totals.lost", "op": "==",
                             "value": 0}],
            }
        )
    )
    s = load_scenario(tmp_path / "s.yaml")
    assert s.policy == policy
    assert s.policies == ("fcfs", "qos")
    arrivals = generate_arrivals(s, s.policy, None, seed=0)
    assert [a.t for a in arrivals] == [0.5, 1.5, 9.0]
    work = capacity_workload(s, s.policy, 10, seed=0)
    assert len(work) == 10 and {a.prompt_tokens for a in work} == {8}


def test_scenario_file_errors_name_file_line_and_field(tmp_path):
    (tmp_path / "p.yaml").write_text(
        "tiers:\n  a: {priority: 0}\ntenants:\n  - {id: t1, tier: b}\n"
    )
    (tmp_path / "s.yaml").write_text(
        "name: x\n"
        "duration_s: 10\n"
        "policy: p.yaml\n"
        "arrivals: {rate_rps: 1}\n"
        "lengths: {prompt: {median: 10}, output: {median: 10}}\n"
        "classes:\n"
        "  - {tenant: t1}\n"
    )
    with pytest.raises(ConfigError) as info:
        load_scenario(tmp_path / "s.yaml")
    message = str(info.value)
    assert "s.yaml:3: policy:" in message
    assert "p.yaml:4: tenants.0.tier: unknown tier 'b'" in message

    (tmp_path / "p.yaml").write_text(yaml.safe_dump(POLICY))
    (tmp_path / "s.yaml").write_text(
        "name: x\n"
        "duration_s: 10\n"
        "policy: p.yaml\n"
        "arrivals: {rate_rps: 1}\n"
        "lengths: {prompt: {median: 10}, output: {median: 10}}\n"
        "classes:\n"
        "  - {tenant: alice}\n"
        "  - {tenant: mallory}\n"
        "targets:\n"
        "  - {name: t, metric: a.b, op: '>', value: 1}\n"
    )
    with pytest.raises(ConfigError) as info:
        load_scenario(tmp_path / "s.yaml")
    assert "s.yaml:10: targets.0.op:" in str(info.value)
    (tmp_path / "s.yaml").write_text(
        (tmp_path / "s.yaml").read_text().replace("op: '>'", "op: '>='")
    )
    expected = r"s\.yaml:8: classes\.1\.tenant: unknown tenant 'mallory'"
    with pytest.raises(ConfigError, match=expected):
        load_scenario(tmp_path / "s.yaml")


# -- scenario validation ---------------------------------------------------------------


@pytest.mark.parametrize(
    ("overrides", "message"),
    [
        ({"classes": [{"tenant": "alice"}, {"tenant": "zed"}]},
         "classes.1.tenant: unknown tenant 'zed'"),
        ({"classes": [{"tenant": "alice", "share": 0}]}, "greater than 0"),
        ({"classes": [{"tenant": "alice", "share": 1, "rate_rps": 2}]}, "share or rate_rps"),
        ({"classes": [{"tenant": "alice", "on_s": 5}]}, "on_s and off_s"),
        ({"classes": []}, "exactly one of generated classes or a trace"),
        ({"arrivals": {}}, "need arrivals.rate_rps or arrivals.load"),
        ({"arrivals": {"rate_rps": 1, "load": 2}}, "not both"),
        ({"lengths": None}, "classes.0.lengths"),
        ({"warmup_s": 100}, "warmup_s"),
        ({"policies": ["qos", "qos"]}, "once"),
        ({"policies": ["lottery"]}, "policies.0"),
        ({"lengths": {"prompt": {"median": 10, "max": 5}, "output": {"median": 1}}}, "median"),
        ({"surprise": 1}, "surprise"),
        ({"engine": {"profile": "tpu-v9"}}, "unknown profile 'tpu-v9'"),
        ({"targets": [{"name": "x", "metric": "a..b", "op": ">=", "value": 1}]}, "targets.0"),
        ({"targets": [{"name": "x", "metric": "a", "op": ">", "value": 1}]}, "op"),
    ],
)
def test_scenario_validation_errors(overrides, message):
    with pytest.raises(ValidationError) as info:
        scenario(**overrides)
    assert message in str(info.value)


def test_scenario_defaults_and_load():
    s = scenario(arrivals={"load": 2.0})
    assert s.kind == "traffic"
    assert s.policies == ("fcfs", "strict", "qos")
    assert s.arrivals.total_rate() is None
    assert s.arrivals.total_rate(4.0) == 8.0
    assert scenario(arrivals={"load": 1.5, "capacity_rps": 2.0}).arrivals.total_rate() == 3.0
    assert s.engine.profile == "h100-llama3-8b"
    assert s.metrics.window_s == 60.0
