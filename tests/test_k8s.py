"""deploy/k8s: every Kustomize overlay renders (`kubectl kustomize`), every
object it renders is valid against the Kubernetes schemas (kubernetes-validate,
offline), the policy in its ConfigMap passes `qosgate validate`, and the
objects agree with each other and with the policy: probes, secrets, grace
period, the alert rules of docker/prometheus/alerts.yml.

The custom resources (ServiceMonitor, PrometheusRule, ScaledObject) have no
schema in kubernetes-validate; their schemas ship with their operators'
CRDs. They are checked here for what qosgate relies on instead: what they
select or target exists in the same render, and the rules are the alerts
file's."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import yaml

from qosgate.config.loader import load_policy
from tests.system_tools import system_tool
from tests.test_deploy import METRIC, exported_sample_names

kubernetes_validate = pytest.importorskip(
    "kubernetes_validate", reason="pip install -e '.[dev]' (kubernetes-validate)"
)

ROOT = Path(__file__).resolve().parent.parent
K8S = ROOT / "deploy" / "k8s"
TARGETS = ["base", *sorted(f"overlays/{p.name}" for p in (K8S / "overlays").iterdir())]
# The oldest Kubernetes the manifests are meant for, and the newest schemas at hand.
VERSIONS = ("1.29.0", kubernetes_validate.latest_version())
CUSTOM = {"ServiceMonitor", "PrometheusRule", "ScaledObject"}


def kubectl() -> str:
    return system_tool(
        "kubectl", "it renders the overlays (`kubectl kustomize`): install it from "
        "https://kubernetes.io/docs/tasks/tools/", optional=True,
    )  # fmt: skip


def render(target: str) -> list[dict[str, Any]]:
    done = subprocess.run([kubectl(), "kustomize", str(K8S / target)],
                          capture_output=True, text=True, timeout=60)  # fmt: skip
    assert done.returncode == 0, done.stderr
    return [doc for doc in yaml.safe_load_all(done.stdout) if doc]


@pytest.fixture(scope="module", params=TARGETS)
def rendered(request) -> tuple[str, list[dict[str, Any]]]:
    return request.param, render(request.param)


def test_the_overlays_under_test_are_all_there():
    assert TARGETS == ["base", "overlays/autoscaling", "overlays/fleet",
                       "overlays/prometheus-operator"]


def test_every_object_is_valid_against_the_kubernetes_schemas(rendered):
    _, objects = rendered
    for obj in objects:
        if obj["kind"] in CUSTOM:
            continue
        for version in VERSIONS:
            try:
                kubernetes_validate.validate(obj, version, strict=True)
            except kubernetes_validate.ValidationError as exc:
                pytest.fail(f"{obj['kind']}/{obj['metadata']['name']} on {version}: {exc.message}")


def test_the_validator_refuses_what_kubernetes_would():
    """It has its schemas offline and is strict: an unknown field fails."""
    deployment = next(o for o in render("base") if o["kind"] == "Deployment")
    container = deployment["spec"]["template"]["spec"]["containers"][0]
    container["resource"] = container.pop("resources")
    with pytest.raises(kubernetes_validate.ValidationError):
        kubernetes_validate.validate(deployment, VERSIONS[-1], strict=True)


def named(objects: list[dict[str, Any]], kind: str, name: str | None = None) -> dict[str, Any]:
    found = [o for o in objects if o["kind"] == kind
             and (name is None or o["metadata"]["name"] == name)]  # fmt: skip
    assert len(found) == 1, (kind, name, len(found))
    return found[0]


def pods(objects: list[dict[str, Any]]) -> dict[str, dict[str, Any]]:
    return {o["metadata"]["name"]: o["spec"]["template"]["spec"]
            for o in objects if o["kind"] in ("Deployment", "StatefulSet")}  # fmt: skip


def test_the_configmap_policy_passes_qosgate_validate(rendered, tmp_path):
    _, objects = rendered
    policy = tmp_path / "policy.yaml"
    policy.write_text(named(objects, "ConfigMap", "qosgate-policy")["data"]["policy.yaml"])
    done = subprocess.run([sys.executable, "-m", "qosgate.cli", "validate", str(policy)], cwd=ROOT,
                          capture_output=True, text=True, timeout=60)  # fmt: skip
    assert done.returncode == 0, done.stderr


def test_every_qosgate_pod_reads_the_policy_and_its_secrets(rendered, tmp_path):
    _, objects = rendered
    policy_file = tmp_path / "policy.yaml"
    policy_file.write_text(named(objects, "ConfigMap", "qosgate-policy")["data"]["policy.yaml"])
    policy = load_policy(policy_file)
    needed = {policy.server.admin_token_env, policy.quota_store.password_env,
              policy.fleet.password_env if policy.fleet else None} - {None}  # fmt: skip
    qosgate = {n: p for n, p in pods(objects).items() if n.startswith("qosgate-")
               and n != "qosgate-redis"}  # fmt: skip
    assert "qosgate-gateway" in qosgate
    for name, pod in qosgate.items():
        (container,) = pod["containers"]
        args = container["args"]
        assert args[args.index("--config") + 1] == "/etc/qosgate/policy.yaml", name
        mount = next(m for m in container["volumeMounts"] if m["name"] == "policy")
        # A subPath mount never sees a ConfigMap update.
        assert mount["mountPath"] == "/etc/qosgate" and "subPath" not in mount, name
        volume = next(v for v in pod["volumes"] if v["name"] == "policy")
        assert volume["configMap"]["name"] == "qosgate-policy", name
        secrets = {e["name"]: e["valueFrom"]["secretKeyRef"] for e in container["env"]
                   if "secretKeyRef" in e.get("valueFrom", {})}  # fmt: skip
        missing = needed - set(secrets) - ({policy.server.admin_token_env}
                                            if "--role" in args else set())  # fmt: skip
        assert not missing, f"{name} lacks {missing} from a Secret"
        assert all(ref["name"] == "qosgate" for ref in secrets.values()), name
        assert not any("value" in e for e in container["env"] if e["name"] in needed), name
        # The kubelet kills after the grace period: it must cover the
        # gateway's own drain, the preStop pause and a margin to exit.
        pre_stop = container.get("lifecycle", {}).get("preStop", {}).get("exec", {})
        pause = float(pre_stop["command"][1]) if pre_stop else 0.0
        grace = pod["terminationGracePeriodSeconds"]
        assert grace >= policy.server.shutdown_grace_s + pause + 5, (name, grace)
        assert container["readinessProbe"]["httpGet"]["path"] == "/readyz", name
        assert container["livenessProbe"]["httpGet"]["path"] == "/healthz", name
        assert container["resources"]["requests"]["cpu"], name
        assert pod["securityContext"]["runAsNonRoot"] is True, name
    if policy.server.policy_watch_s is None:
        pytest.fail("the ConfigMap's policy sets no server.policy_watch_s: edits would "
                    "reach the pods' files but never the running gateways")


def test_the_gateway_service_pdb_and_monitor_select_the_gateways(rendered):
    _, objects = rendered
    labels = named(objects, "Deployment", "qosgate-gateway")["spec"]["template"]["metadata"][
        "labels"]
    service = named(objects, "Service", "qosgate")
    assert service["spec"]["selector"].items() <= labels.items()
    pdb = named(objects, "PodDisruptionBudget")
    assert pdb["spec"]["selector"]["matchLabels"].items() <= labels.items()
    monitors = [o for o in objects if o["kind"] == "ServiceMonitor"]
    for monitor in monitors:
        assert monitor["spec"]["selector"]["matchLabels"].items() <= service["metadata"][
            "labels"].items()
        ports = {p["name"] for p in service["spec"]["ports"]}
        assert all(e["port"] in ports and e["path"] == "/metrics"
                   for e in monitor["spec"]["endpoints"])  # fmt: skip


def test_the_fleet_runs_engines_on_gpus_and_redis_with_a_password():
    objects = render("overlays/fleet")
    gateway = named(objects, "Deployment", "qosgate-gateway")
    assert gateway["spec"]["replicas"] >= 2
    engine = pods(objects)["qosgate-engine"]["containers"][0]
    assert "--role" in engine["args"] and engine["args"][engine["args"].index("--role") + 1] == "engine"
    assert engine["resources"]["requests"]["nvidia.com/gpu"] == 1
    assert engine["resources"]["limits"]["nvidia.com/gpu"] == 1
    redis = pods(objects)["qosgate-redis"]["containers"][0]
    assert redis["args"][redis["args"].index("--requirepass") + 1] == "$(REDIS_PASSWORD)"
    env = {e["name"]: e for e in redis["env"]}
    assert env["REDIS_PASSWORD"]["valueFrom"]["secretKeyRef"] == {
        "name": "qosgate", "key": "redis-password"}
    redis_service = named(objects, "Service", "qosgate-redis")
    data = named(objects, "ConfigMap", "qosgate-policy")["data"]["policy.yaml"]
    assert f"redis://{redis_service['metadata']['name']}:6379/0" in data


def test_the_prometheus_rule_is_the_alerts_file():
    import importlib.util

    spec = importlib.util.spec_from_file_location("prometheusrule", K8S / "prometheusrule.py")
    assert spec is not None and spec.loader is not None
    generator = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(generator)
    assert generator.TARGET.read_text() == generator.render(), "run `make k8s-rules`"
    rule = named(render("overlays/prometheus-operator"), "PrometheusRule")
    alerts = yaml.safe_load((ROOT / "docker" / "prometheus" / "alerts.yml").read_text())
    assert rule["spec"]["groups"] == alerts["groups"]


def test_autoscaling_targets_what_the_fleet_runs():
    objects = render("overlays/autoscaling")
    deployments = {o["metadata"]["name"] for o in objects if o["kind"] == "Deployment"}
    hpa = named(objects, "HorizontalPodAutoscaler")
    assert hpa["spec"]["scaleTargetRef"]["name"] in deployments
    assert hpa["spec"]["scaleTargetRef"]["name"] == "qosgate-gateway"
    scaled = named(objects, "ScaledObject")
    assert scaled["spec"]["scaleTargetRef"]["name"] == "qosgate-engine"
    assert scaled["spec"]["minReplicaCount"] >= 1
    queries = " ".join(t["metadata"]["query"] for t in scaled["spec"]["triggers"])
    assert "qosgate_fleet_queue_depth" in queries


async def test_the_scalers_query_only_metrics_that_exist():
    scaled = named(render("overlays/autoscaling"), "ScaledObject")
    exported = await exported_sample_names()
    for trigger in scaled["spec"]["triggers"]:
        used = set(METRIC.findall(trigger["metadata"]["query"]))
        assert used and used <= exported, (trigger["name"], sorted(used - exported))
