"""deploy/k8s: every Kustomize overlay renders (`kubectl kustomize`), every
object it renders is valid against the Kubernetes schemas (kubernetes-validate,
offline), the policy in its ConfigMap passes `qosgate validate`, and the
objects agree with each other and with the policy: probes, secrets, grace
period, the alert rules of docker/prometheus/alerts.yml.

The custom resources (ServiceMonitor, PrometheusRule, ScaledObject) are
validated against their operators' CRD schemas, kept in deploy/k8s/schemas/
at the versions docs/DEPLOY.md installs, as strictly; an object with neither
kind of schema fails. Beyond their schemas: what they select or target
exists in the same render, and the rules are the alerts file's."""

from __future__ import annotations

import importlib.util
import json
import subprocess
import sys
from pathlib import Path
from types import ModuleType
from typing import Any

import jsonschema
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
CRD_SCHEMAS = K8S / "schemas"


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


def strict(schema: dict[str, Any]) -> dict[str, Any]:
    """The schema refusing the fields it does not name, as the API server's
    strict field validation and kubeconform -strict do: wherever it lists an
    object's properties and does not keep unknown fields. Not inside
    allOf/anyOf/oneOf: a structural schema names every field outside them."""
    schema = dict(schema)
    if "properties" in schema and not schema.get("x-kubernetes-preserve-unknown-fields"):
        schema.setdefault("additionalProperties", False)
    for key in ("properties", "patternProperties"):
        if key in schema:
            schema[key] = {name: strict(field) for name, field in schema[key].items()}
    for key in ("items", "additionalProperties"):
        if isinstance(schema.get(key), dict):
            schema[key] = strict(schema[key])
    return schema


def crd_schema(obj: dict[str, Any]) -> dict[str, Any] | None:
    group, _, version = obj["apiVersion"].rpartition("/")
    path = CRD_SCHEMAS / group / f"{obj['kind'].lower()}_{version}.json"
    return json.loads(path.read_text()) if group and path.is_file() else None


def problems(obj: dict[str, Any], version: str) -> list[str]:
    """What makes the object invalid for Kubernetes `version`, by its CRD's
    schema or by Kubernetes' own; no schema at all is a problem too."""
    schema = crd_schema(obj)
    if schema is None:
        try:
            kubernetes_validate.validate(obj, version, strict=True)
        except kubernetes_validate.ValidationError as exc:
            return [exc.message]
        except kubernetes_validate.SchemaNotFoundError:
            return [f"no schema for {obj['apiVersion']} {obj['kind']}: neither Kubernetes' "
                    "nor a CRD's in deploy/k8s/schemas/ (see its README)"]
        return []
    # Draft 4: what OpenAPI 3.0's schemas extend. jsonschema, not jsonschema-rs,
    # which refuses these schemas: their patterns are RE2's (`^(?i)...`), not ECMA's.
    found = [f"{e.json_path}: {e.message}"
             for e in jsonschema.Draft4Validator(strict(schema)).iter_errors(obj)]  # fmt: skip
    # A CRD's schema leaves metadata to the API server, which checks it as
    # every object's ObjectMeta: so does a ConfigMap's schema, needing no more.
    try:
        kubernetes_validate.validate({"apiVersion": "v1", "kind": "ConfigMap",
                                      "metadata": obj["metadata"]}, version, strict=True)
    except kubernetes_validate.ValidationError as exc:
        found.append(f"metadata: {exc.message}")
    return found


def test_every_object_is_valid_against_its_schema(rendered):
    _, objects = rendered
    for obj in objects:
        for version in VERSIONS:
            found = problems(obj, version)
            assert not found, f"{obj['kind']}/{obj['metadata']['name']} on {version}: {found}"


def misspell(obj: dict[str, Any], path: tuple[str | int, ...]) -> None:
    *parents, field = path
    for key in parents:
        obj = obj[key]
    obj[f"{field}s"] = obj.pop(field)


MISSPELT = [
    ("base", "Deployment", ("spec", "template", "spec", "containers", 0, "resources")),
    ("overlays/autoscaling", "ScaledObject", ("spec", "minReplicaCount")),
    ("overlays/autoscaling", "ScaledObject", ("spec", "triggers", 0, "metadata")),
    ("overlays/autoscaling", "ScaledObject", ("spec", "advanced", "horizontalPodAutoscalerConfig")),
    ("overlays/prometheus-operator", "ServiceMonitor", ("spec", "endpoints", 0, "interval")),
    ("overlays/prometheus-operator", "ServiceMonitor", ("spec", "selector", "matchLabels")),
    ("overlays/prometheus-operator", "ServiceMonitor", ("metadata", "labels")),
    ("overlays/prometheus-operator", "PrometheusRule", ("spec", "groups", 0, "rules", 0, "expr")),
]  # fmt: skip


@pytest.mark.parametrize(("target", "kind", "path"), MISSPELT,
                         ids=[f"{kind}.{'.'.join(map(str, path))}" for _, kind, path in MISSPELT])
def test_the_validation_refuses_a_misspelt_field(target, kind, path):
    """Every schema is strict, the CRDs' as Kubernetes' own: an unknown
    field fails, on the oldest Kubernetes as on the newest."""
    obj = named(render(target), kind)
    assert not problems(obj, VERSIONS[-1])
    misspell(obj, path)
    for version in VERSIONS:
        assert any(f"'{path[-1]}s'" in p for p in problems(obj, version)), (kind, path, version)


@pytest.mark.parametrize(("api_version", "kind"), [("keda.sh/v1beta1", "ScaledObject"),
                                                  ("example.com/v1", "Widget")])
def test_a_custom_resource_without_a_schema_fails(api_version, kind):
    obj = {"apiVersion": api_version, "kind": kind, "metadata": {"name": "qosgate"}}
    assert problems(obj, VERSIONS[-1]) == [
        f"no schema for {api_version} {kind}: neither Kubernetes' nor a CRD's in "
        "deploy/k8s/schemas/ (see its README)"]


def script(name: str) -> ModuleType:
    """One of deploy/k8s's scripts, which are no package's modules."""
    spec = importlib.util.spec_from_file_location(name, K8S / f"{name}.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_the_crd_schemas_are_of_the_operators_docs_deploy_installs():
    vendored = script("crd_schemas")
    deploy = (ROOT / "docs" / "DEPLOY.md").read_text()
    readme = (CRD_SCHEMAS / "README.md").read_text()
    for operator, version in vendored.OPERATORS.items():
        assert any(f"/{version}/" in source for source in vendored.SOURCES), operator
        assert f"releases/download/{version}/" in deploy, (operator, version)
        assert f"| {version} " in readme, (operator, version)


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
    generator = script("prometheusrule")
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
