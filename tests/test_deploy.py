"""docker/: the Grafana dashboard and the Prometheus rules query only
metrics qosgate exports (checked against a live /metrics), the compose file's
mounts exist, and the compose policy is valid."""

from __future__ import annotations

import json
import re
from pathlib import Path

import aiohttp
import yaml
from prometheus_client.parser import text_string_to_metric_families

from qosgate.config.loader import load_policy
from tests.http_support import ALICE_KEY, MODEL, live_app
from tests.test_metrics import DESIGN_METRICS

DOCKER = Path(__file__).resolve().parent.parent / "docker"
METRIC = re.compile(r"\bqosgate_[a-z0-9_]+\b")
# level:metric:operations, the names of recorded series
RECORDED = re.compile(r"\b[a-z_]+:[a-z0-9_]+:[a-z0-9_]+\b")


def dashboard_exprs() -> list[str]:
    dash = json.loads((DOCKER / "grafana" / "dashboards" / "qosgate.json").read_text())
    exprs = [t["expr"] for p in dash["panels"] for t in p.get("targets", [])]
    assert len(exprs) >= 12
    return exprs


def alert_rules() -> list[dict]:
    rules = yaml.safe_load((DOCKER / "prometheus" / "alerts.yml").read_text())
    return [r for g in rules["groups"] for r in g["rules"]]


def alert_exprs() -> list[str]:
    """The rules' expressions, each recorded series they read replaced by
    the expression that records it, so that only exported names remain."""
    rules = alert_rules()
    assert {r["alert"] for r in rules if "alert" in r} >= {
        "QosgateSloBurn", "QosgateStarvation", "QosgateQueueGrowing", "QosgateDown",
        "QosgateQuotaStoreDown",
    }
    recorded = {r["record"]: r["expr"] for r in rules if "record" in r}

    def expand(expr: str) -> str:
        def inline(match: re.Match[str]) -> str:
            assert match[0] in recorded, f"{expr!r} reads {match[0]}, which no rule records"
            return f"({expand(recorded[match[0]])})"

        return RECORDED.sub(inline, expr)

    # Prometheus' own `up` of the scrape job names no qosgate metric.
    return [expand(r["expr"]) for r in rules
            if r["expr"] not in ('up{job="qosgate"} == 0', 'absent(up{job="qosgate"})')
            and not r["expr"].startswith("vector(")]  # fmt: skip


async def exported_sample_names() -> set[str]:
    """Every sample name /metrics has once a request has gone through."""
    return set(await exported_samples())


async def exported_samples() -> dict[str, set[str]]:
    """Every sample name /metrics has once a request has gone through, and
    the label names its samples carry (none for a declared family without a
    sample yet)."""
    async with live_app() as live, aiohttp.ClientSession() as http:
        body = {"model": MODEL, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2}
        async with http.post(live.url + "/v1/chat/completions", json=body,
                             headers={"Authorization": f"Bearer {ALICE_KEY}"}) as r:
            assert r.status == 200
        async with http.get(live.url + "/metrics") as r:
            text = await r.text()
    names: dict[str, set[str]] = {}
    suffixes = {"histogram": ("_bucket", "_sum", "_count"), "counter": ("_total",), "gauge": ("",)}
    for family in text_string_to_metric_families(text):
        # A declared family counts even before its first labelled series (a
        # counter of SLO misses before the first miss).
        for suffix in suffixes.get(family.type, ()):
            names.setdefault(family.name + suffix, set())
        for sample in family.samples:
            names.setdefault(sample.name, set()).update(sample.labels)
    return names


async def test_grafana_and_alerts_query_only_metrics_that_exist():
    exported = await exported_sample_names()
    for expr in dashboard_exprs() + alert_exprs():
        used = set(METRIC.findall(expr))
        assert used, expr
        missing = used - exported
        assert not missing, f"{expr!r} queries {sorted(missing)}, which /metrics does not export"


SELECTOR = re.compile(r"\b(qosgate_[a-z0-9_]+)\{([^}]*)\}")
MATCHER = re.compile(r"([a-zA-Z_][a-zA-Z0-9_]*)\s*(?:=~|!~|!=|=)")
BY = re.compile(r"\bby \(([^)]*)\)")


async def test_grafana_and_alerts_select_and_group_by_labels_the_metrics_carry():
    """A filter or a grouping on a label a metric lacks (`model` on a queue
    gauge) draws nothing rather than failing: checked against the labels of
    a live /metrics, for each metric that has samples there."""
    exported = await exported_samples()
    checked = 0
    for expr in dashboard_exprs() + alert_exprs():
        for name, matchers in SELECTOR.findall(expr):
            if exported[name]:
                missing = set(MATCHER.findall(matchers)) - exported[name]
                assert not missing, f"{expr!r} selects {name} by {sorted(missing)}"
                checked += 1
        grouped = {label.strip() for labels in BY.findall(expr) for label in labels.split(",")}
        for name in set(METRIC.findall(expr)):
            if exported[name]:
                missing = grouped - exported[name] - {""}
                assert not missing, f"{expr!r} groups {name} by {sorted(missing)}"
    assert checked >= 10


def test_every_design_metric_is_on_the_dashboard():
    shown = {m for e in dashboard_exprs() for m in METRIC.findall(e)}
    base = {re.sub(r"_(bucket|sum|count|total)$", "", m) for m in shown}
    design = DESIGN_METRICS
    assert design <= base, sorted(design - base)


def test_compose_wires_what_exists():
    compose = yaml.safe_load((DOCKER / "compose.yaml").read_text())
    services = compose["services"]
    assert {"qosgate", "redis", "prometheus", "grafana"} <= set(services)
    for service in services.values():
        for volume in service.get("volumes", []):
            source = volume.split(":", 1)[0]
            if source.startswith("."):
                assert (DOCKER / source).exists(), f"{source} is mounted but missing"
    build = services["qosgate"]["build"]
    assert (DOCKER / build["context"] / build["dockerfile"]).exists()
    scrape = yaml.safe_load((DOCKER / "prometheus" / "prometheus.yml").read_text())
    assert scrape["scrape_configs"][0]["static_configs"][0]["targets"] == ["qosgate:8080"]
    policy = load_policy(DOCKER / "policy.yaml")
    assert policy.quota_store.kind == "redis" and policy.quota_store.url.startswith("redis://redis:")


def test_fleet_compose_runs_replicas_and_engine_nodes_on_one_policy():
    compose = yaml.safe_load((DOCKER / "compose.fleet.yaml").read_text())
    services = compose["services"]
    gateways = [s for name, s in services.items() if name.startswith("gateway-")]
    engines = [s for name, s in services.items() if name.startswith("engine-")]
    assert len(gateways) == 3 and len(engines) == 2 and "redis" in services
    for service in [*gateways, *engines]:
        for volume in service["volumes"]:
            source = volume.split(":", 1)[0]
            assert (DOCKER / source).exists(), f"{source} is mounted but missing"
        assert (DOCKER / service["build"]["context"] / service["build"]["dockerfile"]).exists()
    assert all("--role engine" in " ".join(e["command"]) for e in engines)
    assert all("--role" not in g["command"] for g in gateways)  # the policy's role
    policy = load_policy(DOCKER / "fleet-policy.yaml")
    assert policy.fleet is not None and policy.fleet.role == "gateway"
    assert policy.fleet.url.startswith("redis://redis:")
    assert policy.quota_store.kind == "redis"
    scrape = yaml.safe_load((DOCKER / "prometheus" / "prometheus.fleet.yml").read_text())
    targets = scrape["scrape_configs"][0]["static_configs"][0]["targets"]
    assert targets == [f"gateway-{i}:8080" for i in (1, 2, 3)]
    prometheus = services["prometheus"]["volumes"]
    assert "./prometheus/prometheus.fleet.yml:/etc/prometheus/prometheus.yml:ro" in prometheus
