"""Schemathesis and a fuzz of every sampling field, through the gateway to the
real engine (vLLM's CPU build, tiny model): the same runs that hold the
simulated GPU and an OpenAI-compatible upstream to the OpenAPI document, here
with the in-process vLLM backend. No 5xx, every error in OpenAI's shape, and
after them the engine still serves and /readyz says so.

The engine is stricter than OpenAI's request model in a few values the
document cannot know (a token id past this model's vocabulary, `top_p` 0):
those schema-valid requests are 400s in the engine's own words, which the
schemathesis run checks after the fact.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import aiohttp
import pytest
import pytest_asyncio
from hypothesis import given

from tests.http_support import ALICE_KEY, ENV, MODEL, assert_still_serves, live_app
from tests.test_fuzz_inputs import HTTP_FUZZ, _check_answer, sampling_bodies
from tests.test_schemathesis import (
    ADMIN_TOKEN,
    AUTH_CONFIG,
    POLICY_YAML,
    UPSTREAM_ACCEPTANCE,
    _positive_refusals,
    _schemathesis,
    _summary,
)

pytestmark = pytest.mark.asyncio(loop_scope="module")

ENGINE_REFUSAL = "The vLLM engine refused the request"
"""How every 400 the engine (not the gateway's door) gives begins."""


def vllm_policy(model_dir: str) -> str:
    """Schemathesis' policy over the vLLM backend, serving the tiny model
    under the name the fuzzed bodies use."""
    sim = "backend:\n  kind: sim\n  speed: 200\n  model: " + MODEL + "\n"
    assert sim in POLICY_YAML
    return POLICY_YAML.replace(
        sim,
        f"backend:\n  kind: vllm\n  model: {model_dir}\n  served_model_name: {MODEL}\n"
        "  engine_args:\n    enforce_eager: true\n    dtype: bfloat16\n"
        "    max_model_len: 2048\n    max_num_seqs: 8\n",
    )


@pytest_asyncio.fixture(scope="module", loop_scope="module")
async def live(tiny_model, tmp_path_factory):
    from qosgate.backends import build_backend
    from qosgate.config.loader import load_policy_text

    work = tmp_path_factory.mktemp("vllm-fuzz")
    path = work / "policy.yaml"
    path.write_text(vllm_policy(tiny_model))
    policy = load_policy_text(path.read_text(), str(path))
    backend = build_backend(policy.backend)
    async with live_app(
        policy, backend, environ={**ENV, "QG_TEST_ADMIN_TOKEN": ADMIN_TOKEN},
        policy_path=str(path),
    ) as app:  # fmt: skip
        await backend.wait_ready()
        await warm_up(app.url)
        app.work = work  # type: ignore[attr-defined]
        yield app


async def warm_up(url: str) -> None:
    """One request with logprobs on each endpoint, whose paths are built at
    their first use: the first with logprobs took 2.7 s on the CI kind's 2
    cores (30 ms after), under load past schemathesis' 10 s read timeout. The
    backend's own warm-up covers the engine's; this covers each endpoint's
    rendering too. What is checked here is the answers, not a cold start."""
    async with aiohttp.ClientSession(headers={"Authorization": f"Bearer {ALICE_KEY}"}) as http:
        for path, body in (
            ("/v1/completions", {"model": MODEL, "prompt": "hi", "max_tokens": 2, "logprobs": 2}),
            ("/v1/chat/completions", {"model": MODEL, "max_tokens": 2, "logprobs": True,
                                      "top_logprobs": 2,
                                      "messages": [{"role": "user", "content": "hi"}]}),
        ):  # fmt: skip
            async with http.post(url + path, json=body) as response:
                assert response.status == 200, await response.text()


async def test_schemathesis_finds_nothing_against_the_vllm_backend(live) -> None:
    work: Path = live.work
    run = await _schemathesis(live.url, work, "vllm", 60, AUTH_CONFIG + UPSTREAM_ACCEPTANCE)
    await assert_still_serves(live.url)
    summary = _summary(run)
    print(f"schemathesis tried {summary['generated']} cases against the vLLM backend")
    assert run["exit_code"] == 0 and not run["report"]["failures"], (
        f"schemathesis found problems:\n{run['output'][-20000:]}"
    )
    for label in ("POST /v1/chat/completions", "POST /v1/completions"):
        statuses = summary["operations"][label]["statuses"]
        assert statuses.get("200", 0) >= 10, (label, statuses)
        assert statuses.get("400", 0) >= 10, (label, statuses)
    # Each schema-valid request refused was refused by the engine itself.
    refused = _positive_refusals(run["events"])
    assert all(message.startswith(ENGINE_REFUSAL) for message in refused), [
        m for m in refused if not m.startswith(ENGINE_REFUSAL)
    ]


@pytest_asyncio.fixture(scope="module", loop_scope="module")
async def http(live):
    async with aiohttp.ClientSession(headers={"Authorization": f"Bearer {ALICE_KEY}"}) as session:
        yield session
    await assert_still_serves(live.url)


@HTTP_FUZZ.__class__(HTTP_FUZZ, max_examples=120)
@given(sampling_bodies)
async def test_every_sampling_field_gets_200_or_a_4xx_through_the_engine(
    live, http, drawn: tuple[str, dict[str, Any]]
) -> None:
    endpoint, body = drawn
    path = "/v1/chat/completions" if endpoint == "chat" else "/v1/completions"
    async with http.post(live.url + path, json=body) as response:
        _check_answer(body, response.status, response.content_type, await response.read())


async def test_the_hostile_corpus_gets_exact_4xx_through_the_engine(live) -> None:
    from tests.test_http_hostile import CASES, _check, _send

    failures = []
    async with aiohttp.ClientSession(skip_auto_headers={"Content-Type"}) as http:
        for case in CASES:
            async with await _send(http, live.url, case) as response:
                raw = await response.read()
                problem = _check(case, "vllm", response.status, raw, response.headers)
            if problem is not None:
                failures.append(f"{case.name}: {problem}")
    await assert_still_serves(live.url)
    assert not failures, "\n".join(failures)
