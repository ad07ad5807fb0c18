"""Policy loading: good files load, bad files name the field and the line."""

from __future__ import annotations

import json
import textwrap
from pathlib import Path

import pytest
import yaml
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from pydantic import BaseModel, ConfigDict, ValidationError, field_validator

from qosgate.cli import main
from qosgate.config import (
    ConfigError,
    ConfigIssue,
    PolicyConfig,
    load_model,
    load_policy,
    load_policy_text,
)
from qosgate.config.commands import policy_warnings

POLICIES = Path(__file__).resolve().parent.parent / "policies"

GOOD = textwrap.dedent(
    """\
    scheduler:
      aging:
        interval_ms: 1000
        max_boost: 1
    tiers:
      fast:
        priority: 0
        ttft_slo_ms: 500
        batch:
          max_wait_ms: 0
      slow:
        priority: 1
        e2e_slo_ms: 60000
        on_timeout: delay
    tenants:
      - id: alice
        tier: fast
      - id: bob
        tier: slow
    """
)


def issues_of(text: str) -> list[ConfigIssue]:
    with pytest.raises(ConfigError) as caught:
        load_policy_text(text, source="bad.yaml")
    assert caught.value.issues, "a ConfigError must carry at least one issue"
    return caught.value.issues


def line_of(text: str, needle: str, occurrence: int = 1) -> int:
    """1-based line of the n-th line containing `needle`."""
    hits = [number for number, line in enumerate(text.splitlines(), start=1) if needle in line]
    return hits[occurrence - 1]


def the_issue(text: str, path: str) -> ConfigIssue:
    issues = issues_of(text)
    matching = [issue for issue in issues if issue.path == path]
    assert matching, f"no issue at {path!r}; got {issues}"
    return matching[0]


# --- good files ------------------------------------------------------------------------


@pytest.mark.parametrize("name", ["example.yaml", "multi-tenant.yaml"])
def test_shipped_policies_load(name: str) -> None:
    policy = load_policy(POLICIES / name)
    assert isinstance(policy, PolicyConfig)
    assert policy.tenants
    assert all(tenant.tier in policy.tiers for tenant in policy.tenants)


def test_example_policy_has_the_documented_tiers() -> None:
    policy = load_policy(str(POLICIES / "example.yaml"))
    assert list(policy.tiers) == ["interactive", "standard", "batch"]
    interactive, standard, batch = (policy.tiers[name] for name in policy.tiers)
    assert (interactive.priority, interactive.ttft_slo_ms, interactive.max_queue_wait_ms) == (
        0,
        500,
        300,
    )
    assert (interactive.on_timeout, interactive.max_tokens) == ("reject", 1024)
    assert (standard.priority, standard.ttft_slo_ms, standard.max_queue_wait_ms) == (1, 2000, 1500)
    assert (batch.priority, batch.e2e_slo_ms, batch.max_queue_wait_ms) == (2, 60000, 20000)
    assert (batch.on_timeout, batch.preemptible) == ("delay", True)
    assert (policy.scheduler.aging.interval_ms, policy.scheduler.aging.max_boost) == (2000, 2)
    assert policy.backend.kind == "sim" and policy.backend.profile == "h100-llama3-8b"


def test_example_policy_demo_keys_are_their_sha256() -> None:
    import hashlib

    policy = load_policy(POLICIES / "example.yaml")
    keys = {key for tenant in policy.tenants for key in tenant.api_keys}
    for demo in ("demo-interactive-key", "demo-standard-key", "demo-batch-key"):
        assert "sha256:" + hashlib.sha256(demo.encode()).hexdigest() in keys


def test_shipped_policies_have_no_warnings() -> None:
    for name in ("example.yaml", "multi-tenant.yaml"):
        assert policy_warnings(load_policy(POLICIES / name)) == []


def test_yaml_anchors_and_merge_keys_work() -> None:
    text = textwrap.dedent(
        """\
        tiers:
          fast: &fast
            priority: 0
            ttft_slo_ms: 500
          fast-eu:
            <<: *fast
            priority: 1   # overriding a merged key is not a duplicate
        """
    )
    policy = load_policy_text(text)
    assert policy.tiers["fast-eu"].priority == 1
    assert policy.tiers["fast-eu"].ttft_slo_ms == 500


# --- bad files: each names the field and its line -----------------------------------------


def test_wrong_type_names_field_and_line() -> None:
    text = GOOD.replace("priority: 0", 'priority: "high"')
    issue = the_issue(text, "tiers.fast.priority")
    assert issue.line == line_of(text, 'priority: "high"')
    assert "integer" in issue.message and "'high'" in issue.message


def test_unknown_key_is_named_with_a_suggestion() -> None:
    text = GOOD.replace(
        "    ttft_slo_ms: 500\n", "    ttft_slo_ms: 500\n    max_queue_wiat_ms: 100\n"
    )
    issue = the_issue(text, "tiers.fast.max_queue_wiat_ms")
    assert issue.line == line_of(text, "max_queue_wiat_ms")
    assert "unknown key" in issue.message
    assert "max_queue_wait_ms" in issue.message  # the suggestion and the allowed keys


def test_unknown_tier_of_tenant() -> None:
    text = GOOD.replace("    tier: slow", "    tier: gold")
    issue = the_issue(text, "tenants.1.tier")
    assert issue.line == line_of(text, "tier: gold")
    assert "unknown tier 'gold'" in issue.message and "fast, slow" in issue.message
    assert str(issue.line) in str(ConfigError("bad.yaml", [issue]))


def test_negative_batch_window() -> None:
    text = GOOD.replace("max_wait_ms: 0", "max_wait_ms: -5")
    issue = the_issue(text, "tiers.fast.batch.max_wait_ms")
    assert issue.line == line_of(text, "max_wait_ms: -5")
    assert "greater than or equal to 0" in issue.message


@pytest.mark.parametrize(("batch", "fleet", "says"), [
    ("  data_dir: /tmp/b\n  store: redis\n", False, "needs a `fleet:` section"),
    ("  store: sqlite\n", False, "needs batch.data_dir"),
    ("  store: redis\n", True, "needs batch.data_dir"),
])  # fmt: skip
def test_a_batch_store_without_what_it_needs_names_the_field(
    batch: str, fleet: bool, says: str
) -> None:
    text = GOOD + "batch:\n" + batch
    if fleet:
        text += "fleet:\n  role: gateway\n"
    issue = the_issue(text, "batch.store")
    assert says in issue.message


def test_batch_jobs_are_in_redis_by_default_in_fleet_mode_only() -> None:
    alone = load_policy_text(GOOD + "batch:\n  data_dir: /tmp/b\n", source="x.yaml")
    assert alone.batch_store() == "sqlite"
    fleet = load_policy_text(
        GOOD + "batch:\n  data_dir: /tmp/b\nfleet:\n  role: gateway\n", source="x.yaml"
    )
    assert fleet.batch_store() == "redis"


def test_duplicate_tenant_id() -> None:
    text = GOOD.replace("  - id: bob\n    tier: slow", "  - tier: slow\n    id: alice")
    issue = the_issue(text, "tenants.1.id")
    assert issue.line == line_of(text, "id: alice", occurrence=2)
    assert "duplicate tenant 'alice'" in issue.message


def test_several_cross_field_errors_each_get_their_line() -> None:
    text = GOOD.replace("    tier: fast", "    tier: nope").replace(
        "    tier: slow", "    tier: gold"
    )
    text += "default_tier: missing\n"
    issues = issues_of(text)
    assert [(issue.path, issue.line) for issue in issues] == [
        ("tenants.0.tier", line_of(text, "tier: nope")),
        ("tenants.1.tier", line_of(text, "tier: gold")),
        ("default_tier", line_of(text, "default_tier")),
    ]


def test_duplicate_yaml_key() -> None:
    text = GOOD.replace("    ttft_slo_ms: 500\n", "    ttft_slo_ms: 500\n    priority: 3\n")
    issue = the_issue(text, "tiers.fast.priority")
    assert issue.line == line_of(text, "priority: 3")
    assert "duplicate key 'priority'" in issue.message
    assert f"line {line_of(text, 'priority: 0')}" in issue.message


def test_yaml_syntax_error_has_its_line() -> None:
    text = GOOD.replace("  slow:\n", "  slow:\n - broken\n")
    [issue] = issues_of(text)
    assert issue.line == line_of(text, "- broken")
    assert "invalid YAML" in issue.message


@pytest.mark.parametrize("text", ["", "\n\n", "# only a comment\n", "---\n"])
def test_empty_file(text: str) -> None:
    [issue] = issues_of(text)
    assert issue.line is None and issue.path == ""
    assert "empty" in issue.message


def test_top_level_list() -> None:
    [issue] = issues_of("# policy\n- tiers\n- tenants\n")
    assert issue.line == 2
    assert "mapping" in issue.message and "list" in issue.message


def test_missing_required_field_points_at_its_parent() -> None:
    text = GOOD.replace("  - id: bob\n    tier: slow", "  - id: bob")
    issue = the_issue(text, "tenants.1.tier")
    assert issue.line == line_of(text, "- id: bob")
    assert "missing" in issue.message


def test_discriminated_backend_reports_the_real_field_path() -> None:
    text = (
        GOOD + "backend:\n  kind: openai\n  upstreams:\n    - url: http://x/v1\n      wieght: 2\n"
    )
    issue = the_issue(text, "backend.upstreams.0.wieght")
    assert issue.line == line_of(text, "wieght")
    assert "did you mean 'weight'" in issue.message


def test_unreadable_scalar_is_an_issue_not_a_crash() -> None:
    text = GOOD.replace("ttft_slo_ms: 500", "ttft_slo_ms: 2001-02-30")
    issue = the_issue(text, "tiers.fast.ttft_slo_ms")
    assert issue.line == line_of(text, "2001-02-30")


@pytest.mark.parametrize(
    "text", ["[" * 5000, "a: &a [*a]\n", "tiers: {a: {priority: 0}}\n---\nx: 1\n"]
)
def test_pathological_yaml_is_a_config_error(text: str) -> None:
    issues_of(text)


def test_error_renders_one_line_per_issue_with_source_and_line() -> None:
    text = GOOD.replace("priority: 0", "priority: high").replace(
        "max_wait_ms: 0", "max_wait_ms: -5"
    )
    with pytest.raises(ConfigError) as caught:
        load_policy_text(text, source="policies/x.yaml")
    assert isinstance(caught.value, ValueError)
    rendered = str(caught.value).splitlines()
    assert rendered[0].startswith(
        f"policies/x.yaml:{line_of(text, 'priority: high')}: tiers.fast.priority: "
    )
    assert rendered[1].startswith(
        f"policies/x.yaml:{line_of(text, 'max_wait_ms')}: tiers.fast.batch.max_wait_ms: "
    )


def test_missing_file(tmp_path: Path) -> None:
    with pytest.raises(ConfigError) as caught:
        load_policy(tmp_path / "nope.yaml")
    assert "not found" in str(caught.value)


# --- the generic loader -------------------------------------------------------------------


class _Scenario(BaseModel):
    model_config = ConfigDict(frozen=True, extra="forbid")
    name: str
    duration_s: float


def test_load_model_reads_text_or_path(tmp_path: Path) -> None:
    text = "name: burst\nduration_s: 30\n"
    assert load_model(_Scenario, text).duration_s == 30
    path = tmp_path / "s.yaml"
    path.write_text(text)
    assert load_model(_Scenario, path).name == "burst"
    assert load_model(_Scenario, str(path)).name == "burst"
    with pytest.raises(ConfigError) as caught:
        load_model(_Scenario, "name: burst\nduration_s: soon\n")
    [issue] = caught.value.issues
    assert (issue.path, issue.line) == ("duration_s", 2)


class _ScenarioWithPolicy(BaseModel):
    model_config = ConfigDict(frozen=True, extra="forbid")
    name: str
    policy: PolicyConfig

    @field_validator("policy", mode="before")
    @classmethod
    def _load_policy_file(cls, value: object) -> object:
        return load_policy(value) if isinstance(value, str) else value


def test_issues_of_a_referenced_file_are_kept_whole(tmp_path: Path) -> None:
    policy = tmp_path / "policy.yaml"
    policy.write_text(GOOD.replace("priority: 0", "priority: high"))
    with pytest.raises(ConfigError) as caught:
        load_model(_ScenarioWithPolicy, f"name: burst\npolicy: {policy}\n")
    [issue] = caught.value.issues
    assert (issue.path, issue.line) == ("policy", 2)
    assert issue.message.startswith(
        f"{policy}:{line_of(policy.read_text(), 'priority: high')}: tiers.fast.priority:"
    )


# --- the CLI -------------------------------------------------------------------------------


def test_validate_bad_file_exits_2_without_traceback(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    path = tmp_path / "bad.yaml"
    path.write_text(GOOD.replace("    tier: slow", "    tier: gold"))
    assert main(["validate", str(path)]) == 2
    captured = capsys.readouterr()
    assert "Traceback" not in captured.out + captured.err
    assert (
        f"{path}:{line_of(path.read_text(), 'tier: gold')}: tenants.1.tier: unknown tier 'gold'"
        in captured.err
    )


@pytest.mark.parametrize("text", ["", "- a\n", "tiers: [\n", "tiers: {a: {priority: x}}\n"])
def test_validate_never_tracebacks(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], text: str
) -> None:
    path = tmp_path / "bad.yaml"
    path.write_text(text)
    assert main(["validate", str(path)]) == 2
    captured = capsys.readouterr()
    assert "Traceback" not in captured.out + captured.err
    assert str(path) in captured.err


def test_validate_missing_file(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["validate", str(tmp_path / "absent.yaml")]) == 2
    assert "not found" in capsys.readouterr().err


def test_validate_good_file_prints_summary(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["validate", str(POLICIES / "example.yaml")]) == 0
    out = capsys.readouterr().out
    for expected in (
        "valid policy",
        "h100-llama3-8b",
        "qos",
        "vtc",
        "interactive",
        "standard",
        "batch",
        "500 ms",
        "reject",
        "delay",
        "tokens_per_minute",
    ):
        assert expected in out, expected
    assert "warning" not in out


@pytest.mark.parametrize(("backend", "says"), [
    ({"kind": "sim", "max_num_batched_tokens": 512},
     "prefill budget auto (2048 tokens: 4 steps of 512)"),
    ({"kind": "vllm", "model": "m"},
     "prefill budget auto (4 steps of the engine's max_num_batched_tokens, read once it is up)"),
    ({"kind": "sim", "max_num_batched_tokens": 512, "scheduling_policy": "fcfs"},
     "prefill budget auto (512 tokens: 1 step of 512)"),
    ({"kind": "vllm", "model": "m", "engine_args": {"scheduling_policy": "fcfs"}},
     "prefill budget auto (1 step of the engine's max_num_batched_tokens, read once it is up)"),
    ({"kind": "openai", "upstreams": [{"url": "http://u:8000"}]},
     "prefill budget auto (1 step of the upstreams' engines: their step_tokens, or else learned "
     "from their vLLM metrics; off while none has one)"),
    ({"kind": "openai", "upstreams": [{"url": "http://u:8000", "step_tokens": 2048},
                                      {"url": "http://v:8000", "step_tokens": 8192}]},
     "prefill budget auto (1 step of the upstreams' engines: 10240 tokens as they count them, "
     "converted to the gateway's count by their usage)"),
])  # fmt: skip
def test_validate_says_what_the_automatic_prefill_budget_comes_to(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], backend: dict, says: str
) -> None:
    path = tmp_path / "policy.yaml"
    path.write_text(yaml.safe_dump({"backend": backend, "tiers": {"gold": {"priority": 0}}}))
    assert main(["validate", str(path)]) == 0
    assert says in capsys.readouterr().out


def test_validate_warns_about_unbounded_waits_and_missing_slos(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    text = GOOD.replace("    priority: 1\n", "    priority: 5\n    min_share: 0\n").replace(
        "    e2e_slo_ms: 60000\n", ""
    )
    path = tmp_path / "warn.yaml"
    path.write_text(text)
    assert main(["validate", str(path)]) == 0
    out = capsys.readouterr().out
    assert "tier 'slow' (on_timeout: delay) never expires" in out
    assert "neither ttft_slo_ms nor e2e_slo_ms" in out
    # Nothing expires under fcfs, and no tier waits for another.
    path.write_text(text.replace("scheduler:\n", "scheduler:\n  policy: fcfs\n"))
    assert main(["validate", str(path)]) == 0
    assert "never expires" not in capsys.readouterr().out


def test_validate_warns_that_a_reject_tiers_share_has_no_effect(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    path = tmp_path / "share.yaml"
    path.write_text(GOOD.replace("    priority: 0\n", "    priority: 0\n    min_share: 0.1\n"))
    assert main(["validate", str(path)]) == 0
    assert "has min_share 0.1: a share never passes" in capsys.readouterr().out


@pytest.mark.parametrize(("backend", "slots"), [
    ("backend: {kind: sim, max_num_seqs: 8}\n", 8),
    ("backend: {kind: sim}\n", 256),  # the default profile's
    ("backend: {kind: vllm, model: /m, engine_args: {max_num_seqs: 8}}\n", 8),
    ("backend: {kind: openai, upstreams: [{url: 'http://a/v1', max_concurrency: 4},"
     " {url: 'http://b/v1', max_concurrency: 4}]}\n", 8),
])  # fmt: skip
def test_validate_warns_when_the_reserve_holds_every_slot_or_half_of_them(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], backend: str, slots: int
) -> None:
    path = tmp_path / "reserve.yaml"
    warning = f"holds all {slots} of the backend's sequence slots"
    for reserve, warned in ((slots - 1, False), (slots, True)):
        path.write_text(backend + GOOD.replace(
            "scheduler:\n", f"scheduler:\n  reserve: {{slots: {reserve}}}\n"))
        assert main(["validate", str(path)]) == 0
        assert (warning in capsys.readouterr().out) is warned, reserve
    # Half of them or more: a warning of its own (not both).
    half = "holds at least half of the backend's"
    for reserve, warned in ((slots // 2 - 1, False), (slots // 2, True), (slots - 1, True),
                            (slots, False)):
        path.write_text(backend + GOOD.replace(
            "scheduler:\n", f"scheduler:\n  reserve: {{slots: {reserve}}}\n"))
        assert main(["validate", str(path)]) == 0
        out = capsys.readouterr().out
        assert (half in out) is warned, reserve
        assert f"runs on at most {slots - reserve}," in out or not warned
    # An upstream's room is learned as it runs, and the engine's default is vLLM's.
    for unknown in ("backend: {kind: openai, upstreams: [{url: 'http://a/v1'}]}\n",
                    "backend: {kind: vllm, model: /m}\n"):
        path.write_text(unknown + GOOD.replace("scheduler:\n", "scheduler:\n  reserve: {slots: 999}\n"))
        assert main(["validate", str(path)]) == 0
        assert "sequence slots" not in capsys.readouterr().out


def test_shares_and_expiry_are_checked_naming_the_field(tmp_path: Path) -> None:
    third = ("  bulk:\n    priority: 2\n    on_timeout: delay\n"
             "    e2e_slo_ms: 60000\n    min_share: 0.25\ntenants:\n")
    many = GOOD.replace("    priority: 1\n", "    priority: 1\n    min_share: 0.3\n").replace(
        "tenants:\n", third)
    with pytest.raises(ConfigError, match="tiers: the delay tiers' min_share add up to 0.55"):
        load_policy_text(many)
    # A reject tier's share never acts, so it does not count against the cap.
    reject = GOOD.replace("    priority: 1\n", "    priority: 1\n    min_share: 0.3\n").replace(
        "    priority: 0\n", "    priority: 0\n    min_share: 0.25\n")
    assert load_policy_text(reject).tiers["slow"].share == 0.3
    early = GOOD.replace("    priority: 1\n", "    priority: 1\n    expire_after_ms: 1\n")
    with pytest.raises(ConfigError, match="expire_after_ms must not be less than"):
        load_policy_text(early)


def test_schema_is_json_with_field_descriptions(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["schema"]) == 0
    schema = json.loads(capsys.readouterr().out)
    tier = schema["$defs"]["TierConfig"]["properties"]
    assert (
        tier["priority"]["description"]
        == "0 is the most important; larger numbers are served later."
    )
    assert "tiers" in schema["required"]


# --- fuzzing: any input gives a PolicyConfig or a ConfigError, nothing else ---------------


def _loads_or_config_error(text: str) -> None:
    try:
        result = load_policy_text(text)
    except ConfigError as exc:
        assert exc.issues
        last_line = len(text.splitlines()) + 1  # YAML may point just past the end
        for issue in exc.issues:
            assert issue.line is None or 1 <= issue.line <= last_line, issue
            assert issue.message
        str(exc)
    else:
        assert isinstance(result, PolicyConfig)


_FUZZ = settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow])
_YAMLISH = st.text(alphabet=list("abtier:-_ {}[],#&*!|>'\"\n\t0123456789.<~@%?"), max_size=200)
_FIELD_NAMES = st.sampled_from(
    [
        "tiers",
        "tenants",
        "priority",
        "id",
        "tier",
        "batch",
        "max_wait_ms",
        "quotas",
        "tokens_per_minute",
        "backend",
        "kind",
        "sim",
        "openai",
        "upstreams",
        "scheduler",
        "aging",
        "default_tier",
        "a",
        "b",
        "<<",
    ]
)
_SCALARS = (
    st.none() | st.booleans() | st.integers() | st.floats() | st.text(max_size=10) | _FIELD_NAMES
)
_NESTED = st.recursive(
    _SCALARS,
    lambda children: (
        st.lists(children, max_size=4)
        | st.dictionaries(_FIELD_NAMES | st.text(max_size=5), children, max_size=4)
    ),
    max_leaves=30,
)
_EXAMPLE_LINES = (POLICIES / "example.yaml").read_text().splitlines()


@_FUZZ
@given(st.text(max_size=300))
def test_fuzz_arbitrary_text(text: str) -> None:
    _loads_or_config_error(text)


@_FUZZ
@given(_YAMLISH)
def test_fuzz_yamlish_text(text: str) -> None:
    _loads_or_config_error(text)


@_FUZZ
@given(st.dictionaries(_FIELD_NAMES, _NESTED, max_size=6))
def test_fuzz_nested_dicts(data: dict[object, object]) -> None:
    _loads_or_config_error(yaml.safe_dump(data))


@_FUZZ
@given(
    st.lists(
        st.tuples(
            st.integers(0, len(_EXAMPLE_LINES) - 1),
            st.sampled_from(["delete", "duplicate", "replace"]),
            st.text(alphabet=list(" :-{}[]#x0\"'"), max_size=4),
        ),
        min_size=1,
        max_size=4,
    )
)
def test_fuzz_mutated_example(edits: list[tuple[int, str, str]]) -> None:
    lines = list(_EXAMPLE_LINES)
    for index, action, junk in edits:
        index %= len(lines)
        if action == "delete":
            del lines[index]
        elif action == "duplicate":
            lines.insert(index, lines[index])
        else:
            lines[index] = lines[index][: len(lines[index]) // 2] + junk
        if not lines:
            lines.append("")
    _loads_or_config_error("\n".join(lines))


def test_backend_without_kind_is_the_simulated_gpu():
    policy = load_policy_text("tiers: {a: {priority: 0}}\nbackend: {profile: a100-llama3-8b}\n")
    assert policy.backend.kind == "sim" and policy.backend.profile == "a100-llama3-8b"


@pytest.mark.parametrize(
    ("backend", "needle"),
    [
        ("{profile: h100-nope}", "backend.profile: unknown profile 'h100-nope'"),
        ("{max_num_seqs: 512, max_num_batched_tokens: 100}", "must be at least max_num_seqs"),
    ],
)
def test_a_sim_backend_that_could_not_start_is_a_config_error(backend, needle):
    from qosgate.config import ConfigError

    with pytest.raises(ConfigError) as err:
        load_policy_text(f"tiers: {{a: {{priority: 0}}}}\nbackend: {backend}\n")
    assert needle in str(err.value)


# --- distributed mode ------------------------------------------------------------------


def test_fleet_section_is_optional_and_checked() -> None:
    assert load_policy_text(GOOD).fleet is None
    fleet = load_policy_text(GOOD + "fleet: {role: engine, lease_s: 3}\n").fleet
    assert fleet is not None and (fleet.role, fleet.lease_s) == ("engine", 3.0)
    issue = the_issue(GOOD + "fleet: {role: router}\n", "fleet.role")
    assert "gateway" in issue.message and "engine" in issue.message
    issue = the_issue(GOOD + "fleet: {role: gateway, node_id: 'a b'}\n", "fleet.node_id")
    assert "letters" in issue.message
    assert any(i.path == "fleet.role" for i in issues_of(GOOD + "fleet: {lease_s: 2}\n"))


def test_a_fleet_of_openai_upstreams_must_list_its_models() -> None:
    text = GOOD + "backend: {kind: openai, upstreams: [{url: 'http://u:8000/v1'}]}\n"
    assert load_policy_text(text).fleet is None
    issue = the_issue(text + "fleet: {role: gateway}\n", "backend.models")
    assert "distributed mode" in issue.message
    listed = text.replace("upstreams:", "models: [m], upstreams:") + "fleet: {role: gateway}\n"
    assert load_policy_text(listed).fleet is not None


def test_the_automatic_prefill_budget_is_four_of_the_engines_steps():
    from qosgate.config.scheduling import backend_step_tokens, scheduling_policy

    def policy(scheduler: dict, backend: dict | None = None) -> PolicyConfig:
        return PolicyConfig.model_validate({
            "tiers": {"t": {"priority": 0}}, "scheduler": scheduler,
            **({"backend": backend} if backend else {})})

    assert policy({}).scheduler.prefill_budget_tokens == "auto"  # where the step is known
    # Delay tiers go in at four steps' pace by default.
    assert scheduling_policy(policy({}), step_tokens=2048).delay_prefill_tokens == 8192
    assert scheduling_policy(policy({})).delay_prefill_tokens is None
    assert scheduling_policy(policy({"delay_prefill_tokens": None}),
                             step_tokens=2048).delay_prefill_tokens is None
    auto = policy({"prefill_budget_tokens": "auto"})
    assert scheduling_policy(auto, step_tokens=2048).prefill_budget_tokens == 8192
    # Where the engine's step is not known (an upstream server), none.
    assert scheduling_policy(auto).prefill_budget_tokens is None
    assert scheduling_policy(policy({"prefill_budget_tokens": 1000}),
                             step_tokens=2048).prefill_budget_tokens == 1000
    assert scheduling_policy(policy({"prefill_budget_tokens": None}),
                             step_tokens=2048).prefill_budget_tokens is None
    # What the backend section says of its engine's step.
    assert backend_step_tokens(policy({}, {"kind": "sim", "max_num_batched_tokens": 512})) == 512
    assert backend_step_tokens(policy({}, {"kind": "vllm", "model": "m", "engine_args": {
        "max_num_batched_tokens": 8192}})) == 8192
    assert backend_step_tokens(policy({}, {"kind": "vllm", "model": "m"})) is None
    assert backend_step_tokens(policy({}, {"kind": "openai", "upstreams": [
        {"url": "http://127.0.0.1:9/v1"}]})) is None
    with pytest.raises(ValidationError, match="prefill_budget_tokens"):
        policy({"prefill_budget_tokens": "lots"})


def test_the_automatic_prefill_budget_is_one_step_where_the_engine_takes_its_queue_in_order():
    """A top-level prompt waits behind every prompt sent before it in an
    engine that may take its queue first come, first served (an upstream
    server, an fcfs engine): one step of them, not four."""
    from qosgate.config.scheduling import backend_in_order, scheduling_policy

    def policy(backend: dict | None = None, **scheduler: object) -> PolicyConfig:
        return PolicyConfig.model_validate({
            "tiers": {"t": {"priority": 0}}, "scheduler": scheduler,
            **({"backend": backend} if backend else {})})

    rules = scheduling_policy(policy(), step_tokens=2048, in_order=True)
    assert (rules.prefill_budget_tokens, rules.delay_prefill_tokens) == (2048, 2048)
    # A number is a number, and unknown is none, in any order.
    assert scheduling_policy(policy(prefill_budget_tokens=1000), step_tokens=2048,
                             in_order=True).prefill_budget_tokens == 1000
    assert scheduling_policy(policy(), in_order=True).prefill_budget_tokens is None
    # Which backends' engines may: as each backend says of itself when it runs.
    assert backend_in_order(policy({"kind": "openai", "upstreams": [
        {"url": "http://127.0.0.1:9/v1"}]}))
    assert not backend_in_order(policy({"kind": "sim"}))
    assert backend_in_order(policy({"kind": "sim", "scheduling_policy": "fcfs"}))
    assert not backend_in_order(policy({"kind": "vllm", "model": "m"}))
    assert backend_in_order(policy({"kind": "vllm", "model": "m", "engine_args": {
        "scheduling_policy": "fcfs"}}))
