"""Profile files: the built-in profiles are files of the format anyone can
write, and a path works wherever a profile name does (a policy's sim backend,
a scenario's engine, a seed table)."""

from __future__ import annotations

import itertools
import json
import tomllib
from pathlib import Path

import pytest
import yaml

from qosgate.backends.sim import SimEngine
from qosgate.cli import main
from qosgate.config.loader import ConfigError, load_policy
from qosgate.config.models import SimBackendConfig
from qosgate.profiles import PROFILES, CostProfile, get_profile, load_profile_file

ROOT = Path(__file__).resolve().parent.parent

# The profiles as they were written in qosgate/profiles.py before they became
# files: the files must give exactly these numbers.
BEFORE = {
    "h100-llama3-8b": dict(
        t0_ms=6.0, c_p=0.025, c_q=8e-7, c_d=0.006, c_kv=5.5e-5, kv_capacity_tokens=467_000,
        max_num_seqs=256, max_num_batched_tokens=2048,
    ),
    "a100x4-hermes3-70b": dict(
        t0_ms=22.81, c_p=0.22, c_q=2e-6, c_d=0.8769, c_kv=6e-5, kv_capacity_tokens=420_000,
        max_num_seqs=256, max_num_batched_tokens=2048,
    ),
    "a100-llama3-8b": dict(
        t0_ms=10.0, c_p=0.08, c_q=2.5e-6, c_d=23.49, c_kv=9.4e-5, kv_capacity_tokens=467_000,
        max_num_seqs=256, max_num_batched_tokens=2048, decode_exponent=0.1784,
    ),
}  # fmt: skip
CHUNKS = ([], [1], [512], [2048], [100, 900], [7, 300, 1500])
DECODES = (0, 1, 16, 64, 256)
CONTEXTS = (0, 640, 100_000, 467_000)


@pytest.mark.parametrize("name", sorted(BEFORE))
def test_each_builtin_file_gives_the_step_times_it_gave_before(name: str) -> None:
    before = CostProfile(name=name, **BEFORE[name])
    loaded = get_profile(name)
    for field, value in BEFORE[name].items():
        assert getattr(loaded, field) == value, field
    assert loaded.decode_exponent == before.decode_exponent
    assert loaded.enable_chunked_prefill is True
    for chunks, decodes, context in itertools.product(CHUNKS, DECODES, CONTEXTS):
        assert loaded.step_ms(chunks, decodes, context) == before.step_ms(
            chunks, decodes, context
        ), (chunks, decodes, context)


def test_the_builtins_are_the_shipped_files() -> None:
    folder = ROOT / "qosgate" / "sim_profiles"
    files = sorted(path.stem for path in folder.glob("*.yaml"))
    assert files == sorted(PROFILES) == sorted(BEFORE)
    for stem in files:
        assert load_profile_file(folder / f"{stem}.yaml") == PROFILES[stem]
    pyproject = tomllib.loads((ROOT / "pyproject.toml").read_text())
    assert "sim_profiles/*.yaml" in pyproject["tool"]["setuptools"]["package-data"]["qosgate"]


def write_profile(path: Path, **changes: object) -> Path:
    data = yaml.safe_load((ROOT / "qosgate" / "sim_profiles" / "h100-llama3-8b.yaml").read_text())
    data.update(changes)
    data = {k: v for k, v in data.items() if v is not None}
    path.write_text(yaml.safe_dump(data, sort_keys=False))
    return path


def test_a_policy_names_a_profile_file_relative_to_itself(tmp_path: Path) -> None:
    (tmp_path / "gpus").mkdir()
    write_profile(tmp_path / "gpus" / "mine.yaml", name="mine", max_num_seqs=8,
                  enable_chunked_prefill=False)
    policy = tmp_path / "policy.yaml"
    policy.write_text("backend: {kind: sim, profile: gpus/mine.yaml}\ntiers: {gold: {priority: 0}}\n")
    cfg = load_policy(policy).backend
    assert isinstance(cfg, SimBackendConfig)
    assert cfg.profile == str(tmp_path / "gpus" / "mine.yaml")
    engine = SimEngine.from_config(cfg)
    assert engine.profile.name == "mine"
    assert engine.max_num_seqs == 8
    # The profile's chunked prefill, unless the backend's settings say otherwise.
    assert engine.enable_chunked_prefill is False
    cfg_on = SimBackendConfig(profile=cfg.profile, enable_chunked_prefill=True)
    assert SimEngine.from_config(cfg_on).enable_chunked_prefill is True
    # The profile's own limits are what the backend's checks see.
    with pytest.raises(ValueError, match=r"max_num_batched_tokens \(4\) must be at least max_num_seqs \(8\)"):
        SimBackendConfig(profile=cfg.profile, max_num_batched_tokens=4)


@pytest.mark.parametrize(
    ("changes", "message"),
    [
        ({"c_p": -0.1}, "c_p: Input should be greater than or equal to 0"),
        ({"max_num_seqs": True}, "max_num_seqs: Value error, Input should be a number, not true"),
        ({"t0_ms": ".inf"}, "t0_ms: Input should be a finite number"),
        ({"c_dd": 1.0}, "c_dd: Extra inputs are not permitted"),
        ({"c_d": None}, "c_d: Field required"),
        ({"decode_exponent": 0}, "decode_exponent: Input should be greater than 0"),
    ],
)
def test_a_bad_profile_file_is_refused_naming_the_field(
    tmp_path: Path, changes: dict, message: str
) -> None:
    if changes.get("t0_ms") == ".inf":
        changes = {"t0_ms": float("inf")}
    write_profile(tmp_path / "bad.yaml", **changes)
    policy = tmp_path / "policy.yaml"
    policy.write_text("backend:\n  kind: sim\n  profile: bad.yaml\ntiers: {gold: {priority: 0}}\n")
    with pytest.raises(ConfigError) as info:
        load_policy(policy)
    text = str(info.value)
    assert "policy.yaml:3: backend.profile: " in text
    assert "bad.yaml" in text and message in text


def test_a_missing_or_unknown_profile_says_so(tmp_path: Path) -> None:
    policy = tmp_path / "policy.yaml"
    policy.write_text("backend: {kind: sim, profile: nowhere.yaml}\ntiers: {gold: {priority: 0}}\n")
    with pytest.raises(ConfigError, match="backend.profile: profile file .*nowhere.yaml' not found"):
        load_policy(policy)
    policy.write_text("backend: {kind: sim, profile: tpu-v9}\ntiers: {gold: {priority: 0}}\n")
    with pytest.raises(ConfigError, match="unknown profile 'tpu-v9'.*h100-llama3-8b"):
        load_policy(policy)
    (tmp_path / "list.yaml").write_text("- 1\n")
    with pytest.raises(ValueError, match="must be a mapping"):
        load_profile_file(tmp_path / "list.yaml")


def capacity(tmp_path: Path, profile: str, name: str) -> float:
    scenario = {
        "name": name, "seed": 2, "duration_s": 20, "warmup_s": 0,
        "policy": {"tiers": {"gold": {"priority": 0}}, "tenants": [{"id": "a", "tier": "gold"}]},
        "policies": ["fcfs"],
        "engine": {"kind": "sim", "profile": profile},
        "arrivals": {"load": 0.5},
        "lengths": {"prompt": {"median": 500, "sigma": 0.5}, "output": {"median": 200, "sigma": 0.5}},
        "classes": [{"tenant": "a"}],
    }  # fmt: skip
    path = tmp_path / f"scenario-{name}.yaml"
    path.write_text(yaml.safe_dump(scenario, sort_keys=False))
    out = tmp_path / f"scenario-{name}.json"
    assert main(["simulate", str(path), "--json", str(out), "--quiet"]) == 0
    return json.loads(out.read_text())["capacity_rps"]


def test_a_scenario_runs_a_profile_file(tmp_path: Path) -> None:
    write_profile(tmp_path / "same.yaml", name="same")
    slow = {k: 2 * v for k, v in BEFORE["h100-llama3-8b"].items() if k.startswith(("t0", "c_"))}
    write_profile(tmp_path / "slow.yaml", name="slow", **slow)
    builtin = capacity(tmp_path, "h100-llama3-8b", "builtin")
    # Relative to the scenario file.
    assert capacity(tmp_path, "same.yaml", "same") == builtin
    # Every cost doubled: every step takes twice as long, half the capacity.
    assert capacity(tmp_path, "./slow.yaml", "slow") == pytest.approx(builtin / 2, rel=0.02)
