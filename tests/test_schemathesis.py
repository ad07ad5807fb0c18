"""Schemathesis against a live gateway, driven by the gateway's own /openapi.json.

Schemathesis' CLI runs in a subprocess against the real stack (app, gateway,
backend) listening on a loopback port in this test's event loop, over each
backend: the simulated GPU, and the openai backend in front of an upstream
that judges requests as vLLM does (upstream_support.VllmUpstream).
It sends what the document allows and what it forbids, with every check it
has: no 5xx, status codes, content types, headers and bodies as documented,
schema-valid requests accepted and invalid ones refused, 405 with Allow for
undocumented methods, 401 without credentials. One run has a tenant's key
and the admin token (its negative cases still drop them); a second, on the
sim only, has no credentials at all.

The counts go to test-artifacts/schemathesis.json (the sim) and
schemathesis-openai.json. The run is seeded and
keeps no example database, so a failure reproduces with the same command.
"""

from __future__ import annotations

import asyncio
import base64
import hashlib
import json
import os
import sys
from collections import Counter, defaultdict
from pathlib import Path
from typing import Any

import aiohttp
import pytest
import schemathesis
from aiohttp.test_utils import TestServer
from http_support import ALICE_KEY, ENV, MODEL, assert_still_serves, live_app
from upstream_support import BACKENDS, backend_policy

from qosgate.backends import build_backend
from qosgate.config.loader import load_policy_text
from qosgate.http.app import build_app
from qosgate.http.validation import validate_body
from qosgate.runtime.gate import Gateway

ADMIN_TOKEN = "test-admin-token"
SEED = 20240611
# About 20 s for the sim's two runs on a 2-core machine, most of it on the
# two completion routes (which also get ~200 boundary cases each from the
# coverage phase, whatever this says); the openai backend's requests each
# cross one more HTTP hop.
AUTH_EXAMPLES = {"sim": 200, "openai": 100}
ANON_EXAMPLES = 20
_OPEN_PATHS = {"/healthz", "/readyz", "/metrics", "/dashboard", "/openapi.json"}
"""The paths that need no credentials."""
ARTIFACTS = Path(__file__).resolve().parent.parent / "test-artifacts"

POLICY_YAML = f"""
version: 1
server:
  max_body_bytes: 65536
  trusted_header_secret_env: QG_TEST_SECRET
  admin_token_env: QG_TEST_ADMIN_TOKEN
  # Negative cases drop the key hundreds of times from one address; at the
  # default allowance every later request would get 429 without reaching
  # its handler.
  auth_failures_per_minute: 1000000
backend:
  kind: sim
  speed: 200
  model: {MODEL}
tiers:
  interactive:
    priority: 0
    max_queue_wait_ms: 60000
    max_tokens: 16
tenants:
  - id: alice
    tier: interactive
    api_keys: ["sha256:{hashlib.sha256(ALICE_KEY.encode()).hexdigest()}"]
    # Never reached, but present: every answer then carries x-ratelimit-*.
    quotas:
      tokens_per_minute: 1000000000
      requests_per_minute: 1000000
"""

AUTH_CONFIG = f"""
[auth.openapi.apiKey]
bearer = "{ALICE_KEY}"

[auth.openapi.adminToken]
bearer = "{ADMIN_TOKEN}"
"""
# The openai backend's document takes what OpenAI's request model takes; its
# upstream judges the rest, and refuses some of it as vLLM does (top_p 0, a
# token id past its vocabulary). Such a 400 is the upstream's, which the test
# checks after the run, so that a 400 of the gateway's own still fails it.
UPSTREAM_ACCEPTANCE = """
[checks.positive_data_acceptance]
expected-statuses = ["2xx", "400", "401", "403", "404", "409", "429", "5xx"]
"""


async def _schemathesis(
    url: str, work: Path, name: str, max_examples: int, config: str | None
) -> dict[str, Any]:
    """One CLI run; returns its exit code, output, JSON report and events."""
    report_json = work / f"{name}.json"
    report_ndjson = work / f"{name}.ndjson"
    args = [sys.executable, "-m", "schemathesis.cli"]
    if config is not None:
        (work / f"{name}.toml").write_text(config)
        args += ["--config-file", str(work / f"{name}.toml")]
    args += [
        "run",
        f"{url}/openapi.json",
        "--checks=all",
        f"--max-examples={max_examples}",
        f"--seed={SEED}",
        "--workers=1",
        "--generation-database=none",
        "--report=json,ndjson",
        f"--report-json-path={report_json}",
        f"--report-ndjson-path={report_ndjson}",
        "--no-color",
    ]
    process = await asyncio.create_subprocess_exec(
        *args,
        cwd=work,
        stdout=asyncio.subprocess.PIPE,
        stderr=asyncio.subprocess.STDOUT,
        # A wide terminal keeps the failure report readable in pytest's output.
        env={**os.environ, "COLUMNS": "160"},
    )
    # The server runs in this event loop, so the CLI must be awaited, not waited on.
    output, _ = await process.communicate()
    if not report_ndjson.exists() or not report_json.exists():
        pytest.fail(f"schemathesis wrote no report:\n{output.decode(errors='replace')[-20000:]}")
    events = [json.loads(line) for line in report_ndjson.read_text().splitlines() if line]
    return {
        "command": " ".join(args[1:]),
        "exit_code": process.returncode,
        "output": output.decode(errors="replace"),
        "report": json.loads(report_json.read_text()),
        "events": events,
    }


def _per_operation(events: list[dict[str, Any]]) -> dict[str, dict[str, Any]]:
    """Cases per operation, by phase, by response status and by whether the
    request carried credentials."""
    operations: dict[str, dict[str, Any]] = defaultdict(
        lambda: {"cases": 0, "phases": Counter(), "statuses": Counter(), "without_credentials": 0}
    )
    for event in events:
        finished = event.get("ScenarioFinished")
        if finished is None:
            continue
        recorder = finished["recorder"]
        entry = operations[recorder["label"]]
        cases = recorder.get("cases", {})
        entry["cases"] += len(cases)
        entry["phases"][finished["phase"]] += len(cases)
        for interaction in recorder.get("interactions", {}).values():
            response = interaction.get("response")
            entry["statuses"][str(response["status_code"]) if response else "none"] += 1
            headers = {key.lower() for key in interaction["request"].get("headers", {})}
            if not headers & {"authorization", "x-tenant-id"}:
                entry["without_credentials"] += 1
    return {
        label: {**entry, "phases": dict(entry["phases"]), "statuses": dict(entry["statuses"])}
        for label, entry in sorted(operations.items())
    }


def _summary(run: dict[str, Any]) -> dict[str, Any]:
    return {
        "command": run["command"],
        "exit_code": run["exit_code"],
        "generated": run["report"]["test_cases"]["generated"],
        "with_failures": run["report"]["test_cases"]["with_failures"],
        "operations": _per_operation(run["events"]),
    }


def _positive_refusals(events: list[dict[str, Any]]) -> list[str]:
    """The messages of the 400s that answered schema-valid requests."""
    messages = []
    for event in events:
        recorder = event.get("ScenarioFinished", {}).get("recorder", {})
        cases = recorder.get("cases", {})
        for case_id, interaction in recorder.get("interactions", {}).items():
            response = interaction.get("response")
            meta = cases.get(case_id, {}).get("value", {}).get("meta") or {}
            if meta.get("generation", {}).get("mode") != "positive" or response is None:
                continue
            if response["status_code"] == 400:
                content = base64.b64decode(response["content"]["$base64"])
                messages.append(json.loads(content)["error"]["message"])
    return messages


@pytest.mark.parametrize("backend", BACKENDS)
async def test_schemathesis_finds_nothing_against_a_live_gateway(
    tmp_path: Path, backend: str
) -> None:
    async with backend_policy(backend, POLICY_YAML) as (policy_text, upstream):
        policy_path = tmp_path / "policy.yaml"
        policy_path.write_text(policy_text)
        async with live_app(
            load_policy_text(policy_text, str(policy_path)),
            environ={**ENV, "QG_TEST_ADMIN_TOKEN": ADMIN_TOKEN},
            policy_path=str(policy_path),
        ) as live:
            config = AUTH_CONFIG if upstream is None else AUTH_CONFIG + UPSTREAM_ACCEPTANCE
            runs = {"authenticated": await _schemathesis(
                live.url, tmp_path, "auth", AUTH_EXAMPLES[backend], config
            )}  # fmt: skip
            if backend == "sim":
                # Credentials are checked before any backend is: one backend's
                # run without them says it for every backend.
                runs["anonymous"] = await _schemathesis(
                    live.url, tmp_path, "anonymous", ANON_EXAMPLES, None
                )
            # The gateway came through it, still serves and says so.
            await assert_still_serves(live.url)

    summaries = {name: _summary(run) for name, run in runs.items()}
    total = sum(summary["generated"] for summary in summaries.values())
    name = "schemathesis.json" if backend == "sim" else f"schemathesis-{backend}.json"
    artifact = ARTIFACTS / name
    artifact.parent.mkdir(exist_ok=True)
    artifact.write_text(
        json.dumps(
            {
                "schemathesis_version": schemathesis.__version__,
                "backend": backend,
                "seed": SEED,
                "cases": total,
                "runs": summaries,
            },
            indent=2,
        )
        + "\n"
    )
    print(f"schemathesis tried {total} cases ({artifact})")

    for name, run in runs.items():
        assert run["exit_code"] == 0 and not run["report"]["failures"], (
            f"schemathesis ({name} run) found problems:\n{run['output'][-20000:]}"
        )
        assert run["report"]["operations"]["tested"] == run["report"]["operations"]["selected"]

    # A run whose requests never got past the door would pass every check
    # above; these say it did get through.
    ops = summaries["authenticated"]["operations"]
    for label in ("POST /v1/chat/completions", "POST /v1/completions"):
        statuses = ops[label]["statuses"]
        assert statuses.get("200", 0) >= 20, (label, statuses)
        assert statuses.get("400", 0) >= 20, (label, statuses)
        assert statuses.get("401", 0) >= 1, (label, statuses)
    for label in ("GET /admin/stats", "GET /admin/quotas", "POST /admin/reload", "GET /v1/models"):
        assert ops[label]["statuses"].get("200", 0) >= 1, (label, ops[label]["statuses"])
    for label, entry in summaries.get("anonymous", {"operations": {}})["operations"].items():
        if label.split()[1] not in _OPEN_PATHS:
            assert set(entry["statuses"]) <= {"401", "405"}, (label, entry["statuses"])
    refused = _positive_refusals(runs["authenticated"]["events"])
    if upstream is None:
        assert not refused
    else:
        # Each schema-valid request refused was refused by the upstream, in
        # its words: the gateway's door took every one.
        assert refused and set(refused) <= set(upstream.refusals), (
            set(refused) - set(upstream.refusals)
        )


async def test_openapi_document_lists_every_route_and_needs_no_key() -> None:
    policy = load_policy_text(POLICY_YAML)
    gateway = Gateway(policy, build_backend(policy.backend))
    await gateway.start()
    server = TestServer(build_app(gateway, policy, environ=ENV), host="127.0.0.1")
    await server.start_server()
    try:
        async with (
            aiohttp.ClientSession() as http,
            http.get(server.make_url("/openapi.json")) as response,
        ):
            assert response.status == 200
            assert response.content_type == "application/json"
            document = await response.json()
        routes = {
            (route.method.lower(), route.resource.canonical)
            for route in server.app.router.routes()
            if route.method != "HEAD" and route.resource is not None
        }
    finally:
        await server.close()
        await gateway.close()
    documented = {(method, path) for path, item in document["paths"].items() for method in item}
    assert documented == routes
    assert document["openapi"].startswith("3.")
    chat = document["components"]["schemas"]["ChatCompletionRequest"]
    assert chat["properties"]["model"]["enum"] == [MODEL]
    for path, methods in document["paths"].items():
        for operation in methods.values():
            assert ("security" in operation and operation["security"] == []) == (
                path in _OPEN_PATHS
            ), path


@pytest.mark.parametrize("value", [2.0, 16.0, 1e300])
async def test_whole_float_integers_are_taken_and_passed_on_as_integers(value: float) -> None:
    """Regression (schemathesis): `"max_tokens": 717392.0` is an integer to
    JSON Schema, and so to the OpenAPI document, but was refused with 400."""
    body: dict[str, Any] = {
        "model": MODEL,
        "messages": [{"role": "user", "content": "hi"}],
        "max_tokens": value,
        "max_completion_tokens": value,
        "n": 1.0,
        "priority": 0.0,
    }
    parsed = validate_body("chat", body, [MODEL])
    assert parsed.max_tokens == int(value) and type(parsed.max_tokens) is int
    # The backend gets integers too: a strict reader would refuse `1.0`.
    for name in ("max_tokens", "max_completion_tokens", "n", "priority"):
        assert type(body[name]) is int, name
    assert body["n"] == 1 and body["priority"] == 0
