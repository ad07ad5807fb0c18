"""docker/prometheus: the alert rules pass `promtool check rules`, every alert
has a promtool unit test that makes it fire (docker/prometheus/alerts_test.yml)
and those tests pass, and both Prometheus configs pass `promtool check config`.
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


def test_every_alert_fires_in_a_promtool_unit_test(promtool):
    alerts = {r["alert"] for g in yaml.safe_load((PROMETHEUS / "alerts.yml").read_text())["groups"]
              for r in g["rules"] if "alert" in r}  # fmt: skip
    tests = yaml.safe_load((PROMETHEUS / "alerts_test.yml").read_text())["tests"]
    fired = {case["alertname"] for test in tests for case in test["alert_rule_test"]
             if case["exp_alerts"]}  # fmt: skip
    quiet = {case["alertname"] for test in tests for case in test["alert_rule_test"]
             if not case["exp_alerts"]}  # fmt: skip
    assert alerts - fired == set(), "alerts no unit test makes fire"
    assert alerts - quiet == set(), "alerts no unit test holds back"
    assert "SUCCESS" in run(promtool, "test", "rules", "alerts_test.yml")


@pytest.mark.parametrize("config", ["prometheus.yml", "prometheus.fleet.yml"])
def test_the_prometheus_configs_pass_promtool_check(promtool, config):
    # Syntax only: the rule file is named by its path inside the container.
    run(promtool, "check", "config", "--syntax-only", config)
