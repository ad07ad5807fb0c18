"""Write components/prometheus-operator/prometheusrule.yaml from
docker/prometheus/alerts.yml, the one place the alert rules are written:
`make k8s-rules` (tests/test_k8s.py fails when the two differ)."""

from __future__ import annotations

import sys
from pathlib import Path

import yaml

ROOT = Path(__file__).resolve().parents[2]
SOURCE = ROOT / "docker" / "prometheus" / "alerts.yml"
TARGET = Path(__file__).resolve().parent / "components" / "prometheus-operator" / "prometheusrule.yaml"

HEADER = """\
# Generated from docker/prometheus/alerts.yml by `make k8s-rules`: edit that
# file, not this one (tests/test_k8s.py checks they agree).
"""


class _Dumper(yaml.SafeDumper):
    pass


def _text(dumper: yaml.SafeDumper, value: str) -> yaml.ScalarNode:
    # Multi-line expressions stay readable as block scalars.
    style = "|" if "\n" in value else None
    return dumper.represent_scalar("tag:yaml.org,2002:str", value, style=style)


_Dumper.add_representer(str, _text)


def render() -> str:
    groups = yaml.safe_load(SOURCE.read_text())["groups"]
    rule = {
        "apiVersion": "monitoring.coreos.com/v1",
        "kind": "PrometheusRule",
        "metadata": {"name": "qosgate", "labels": {"app.kubernetes.io/component": "gateway"}},
        "spec": {"groups": groups},
    }
    return HEADER + yaml.dump(rule, Dumper=_Dumper, sort_keys=False, width=100)


if __name__ == "__main__":
    TARGET.write_text(render())
    sys.exit(0)
