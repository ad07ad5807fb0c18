"""Write deploy/k8s/schemas/ from the CustomResourceDefinitions of the
operators the manifests need, at the versions docs/DEPLOY.md installs:
`make k8s-schemas` (it downloads them), or, offline, with CRD files you have:

    python deploy/k8s/crd_schemas.py path/to/monitoring.coreos.com_servicemonitors.yaml ...

Each served version's openAPIV3Schema is written as it is upstream, in JSON,
to schemas/<group>/<kind>_<version>.json (kubeconform's layout), so that
tests/test_k8s.py validates the custom resources offline, as the API server
would."""

from __future__ import annotations

import json
import sys
import urllib.request
from pathlib import Path
from typing import Any

import yaml

TARGET = Path(__file__).resolve().parent / "schemas"

# Bump a version here, run `make k8s-schemas`, and change docs/DEPLOY.md's
# install commands to match (tests/test_k8s.py checks they agree).
OPERATORS = {
    "prometheus-operator": "v0.93.0",
    "keda": "v2.20.2",
}
SOURCES = [
    "https://raw.githubusercontent.com/prometheus-operator/prometheus-operator/"
    f"{OPERATORS['prometheus-operator']}/example/prometheus-operator-crd/"
    f"monitoring.coreos.com_{plural}.yaml"
    for plural in ("servicemonitors", "prometheusrules")
] + [
    f"https://raw.githubusercontent.com/kedacore/keda/{OPERATORS['keda']}/"
    "config/crd/bases/keda.sh_scaledobjects.yaml",
]


def schemas(crd: dict[str, Any]) -> dict[str, dict[str, Any]]:
    """The served versions' schemas of one CRD, by their path under schemas/."""
    spec = crd["spec"]
    return {
        f"{spec['group']}/{spec['names']['kind'].lower()}_{version['name']}.json":
            version["schema"]["openAPIV3Schema"]
        for version in spec["versions"] if version["served"]
    }  # fmt: skip


def read(source: str) -> str:
    if source.startswith("https://"):
        with urllib.request.urlopen(source, timeout=60) as answer:
            return answer.read().decode()
    return Path(source).read_text()


def main(sources: list[str]) -> None:
    for source in sources:
        for crd in yaml.safe_load_all(read(source)):
            if not crd or crd.get("kind") != "CustomResourceDefinition":
                continue
            for name, schema in schemas(crd).items():
                path = TARGET / name
                path.parent.mkdir(parents=True, exist_ok=True)
                path.write_text(json.dumps(schema, indent=1, ensure_ascii=False) + "\n")
                print(f"wrote {path.relative_to(TARGET.parents[2])}")


if __name__ == "__main__":
    main(sys.argv[1:] or SOURCES)
