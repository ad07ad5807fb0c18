"""The files in examples/ and docker/ work as their comments say."""

from __future__ import annotations

import asyncio
import os
import sys
from pathlib import Path

from qosgate.config import load_policy
from qosgate.config.models import PolicyConfig

from tests.http_support import live_app

ROOT = Path(__file__).resolve().parent.parent


def _demo_policy(data_dir: Path) -> PolicyConfig:
    """policies/example.yaml on a faster simulated GPU, its batches kept
    under `data_dir` rather than the working directory."""
    policy = load_policy(ROOT / "policies" / "example.yaml")
    fast = policy.backend.model_copy(update={"speed": 50.0})
    batch = policy.batch.model_copy(update={"data_dir": str(data_dir)})
    return policy.model_copy(update={"backend": fast, "batch": batch})


async def _run_example(url: str, name: str, *args: str) -> str:
    """Run examples/`name` against the gateway at `url`; its output."""
    env = {**os.environ, "QOSGATE_URL": f"{url}/v1"}
    proc = await asyncio.create_subprocess_exec(
        sys.executable, str(ROOT / "examples" / name), *args,
        env=env, stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.PIPE,
    )
    out, err = await asyncio.wait_for(proc.communicate(), timeout=60)
    assert proc.returncode == 0, err.decode()
    return out.decode()


def test_the_api_gateway_policy_is_valid():
    policy = load_policy(ROOT / "examples" / "behind-api-gateway.yaml")
    assert policy.server.trusted_header_secret_env == "QOSGATE_GATEWAY_SECRET"
    assert policy.default_tier in policy.tiers


async def test_the_openai_client_example_runs_against_the_demo_policy(tmp_path: Path):
    async with live_app(_demo_policy(tmp_path)) as live:
        out = await _run_example(live.url, "openai_client.py")
    text = out
    assert "reply:" in text and "usage:" in text and "stream:" in text


def test_the_dockerfile_serves_a_policy_on_all_interfaces():
    dockerfile = (ROOT / "docker" / "Dockerfile").read_text()
    assert "qosgate serve" in dockerfile and "--host 0.0.0.0" in dockerfile
    # The image's default policy is the repository's example, copied in
    # (from the package: policies/example.yaml is a link, and COPY keeps links).
    assert "COPY qosgate/policies/example.yaml" in dockerfile
    assert "QOSGATE_POLICY=/etc/qosgate/example.yaml" in dockerfile
    assert (ROOT / "policies" / "example.yaml").is_file()


async def test_the_multi_tenant_load_script_runs_against_the_demo_policy(tmp_path: Path):
    async with live_app(_demo_policy(tmp_path)) as live:
        out = await _run_example(
            live.url, "multi_tenant_load.py", "--seconds", "2", "--scale", "2"
        )
    lines = out.splitlines()
    assert len(lines) == 4
    assert all("completed" in line for line in lines)
    assert sum(int(line.split("completed")[1].split()[0]) for line in lines) > 0


async def test_the_batch_example_runs_against_the_demo_policy(tmp_path: Path):
    async with live_app(_demo_policy(tmp_path)) as live:
        out = await _run_example(live.url, "batch_client.py")
        # Its lines ran at the lowest delay tier, as the demo-batch tenant's.
        assert {s.request.tier for s in live.gateway.streams} == {"batch"}
        assert {s.request.tenant for s in live.gateway.streams} == {"demo-batch"}
    text = out
    assert "completed" in text
    assert sorted(line.split()[0] for line in text.splitlines()[1:]) == sorted(
        f"question-{i}" for i in range(10)
    )
