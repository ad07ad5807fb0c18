"""docker/prometheus: the rules pass `promtool check rules`, every alert has
promtool unit tests that make it fire and hold it back, every recording rule
one that checks what it records (docker/prometheus/alerts_test.yml), and those
tests pass, and both Prometheus configs pass `promtool check config`.
`make test` installs promtool (Debian's prometheus package)."""

from __future__ import annotations

import subprocess
from pathlib import Path

import pytest
import yaml

from tests.system_tools import system_tool

PROMETHEUS = Path(__file__).resolve().parent.parent / "docker" / "prometheus"


@pytest.fixture(scope="module")
def promtool() -> str:
    return system_tool("promtool", "`make test` installs it (apt-get install prometheus)")


def run(promtool: str, *args: str) -> str:
    done = subprocess.run([promtool, *args], cwd=PROMETHEUS, capture_output=True, text=True,
                          timeout=120)  # fmt: skip
    assert done.returncode == 0, done.stdout + done.stderr
    return done.stdout


def test_the_rules_pass_promtool_check(promtool):
    assert "SUCCESS" in run(promtool, "check", "rules", "alerts.yml")


def rules(kind: str) -> set[str]:
    """The names of alerts.yml's rules of `kind`: "alert" or "record"."""
    return {r[kind] for g in yaml.safe_load((PROMETHEUS / "alerts.yml").read_text())["groups"]
            for r in g["rules"] if kind in r}  # fmt: skip


def test_every_alert_fires_in_a_promtool_unit_test(promtool):
    alerts = rules("alert")
    tests = yaml.safe_load((PROMETHEUS / "alerts_test.yml").read_text())["tests"]
    cases = [case for test in tests for case in test.get("alert_rule_test", [])]
    fired = {case["alertname"] for case in cases if case["exp_alerts"]}
    quiet = {case["alertname"] for case in cases if not case["exp_alerts"]}
    assert alerts - fired == set(), "alerts no unit test makes fire"
    assert alerts - quiet == set(), "alerts no unit test holds back"
    assert "SUCCESS" in run(promtool, "test", "rules", "alerts_test.yml")


def test_every_recording_rule_has_its_value_checked():
    tests = yaml.safe_load((PROMETHEUS / "alerts_test.yml").read_text())["tests"]
    cases = [case for test in tests for case in test.get("promql_expr_test", [])]
    checked = {sample["labels"].split("{")[0] for case in cases for sample in case["exp_samples"]}
    assert rules("record") - checked == set(), "recording rules no unit test checks a value of"


@pytest.mark.parametrize("config", ["prometheus.yml", "prometheus.fleet.yml"])
def test_the_prometheus_configs_pass_promtool_check(promtool, config):
    # Syntax only: the rule file is named by its path inside the container.
    run(promtool, "check", "config", "--syntax-only", config)
    # QosgateDown and QosgateAbsent read `up` of this job.
    scrapes = yaml.safe_load((PROMETHEUS / config).read_text())["scrape_configs"]
    assert "qosgate" in [scrape["job_name"] for scrape in scrapes]
