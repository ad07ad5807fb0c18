"""`vllm bench serve`, vLLM's own benchmark client, unchanged against qosgate.

The client runs as a subprocess (vLLM's command line, tests/vllm_engine/
vllm_cli.py) against:

- qosgate with the in-process `vllm` backend;
- qosgate with the `openai` backend in front of a real `vllm serve` of the
  same tiny model (a subprocess on a loopback port);
- that `vllm serve` alone: the engine's own prompt token counts.

Completions (`--backend openai`) and chat (`--backend openai-chat`), each with
`--model` and without it (the client then takes the first model of
/v1/models: `id` for requests, `root` for the tokenizer). The random dataset
with one seed gives the same prompts every run. Each run must complete every
request, and report per request the prompt token counts `vllm serve` alone
reports (the client's input_lens are the servers' usage.prompt_tokens); under
the in-process backend, qosgate's own count at admission (what quotas
reserve) must be the same too. `pytest -s` prints the figures
benchmarks/RESULTS.md quotes.
"""

from __future__ import annotations

import asyncio
import json
import os
import sys
from collections.abc import AsyncIterator, Iterator
from pathlib import Path
from typing import Any

import pytest
import pytest_asyncio
import yaml

from qosgate.backends import build_backend
from tests.http_support import Live, live_app, make_policy
from tests.vllm_engine.vllm_server import CLI, SERVED, VllmServer, tail

pytestmark = pytest.mark.asyncio(loop_scope="module")

KEY = "vllm-bench-serve-key"
MAX_SEQS = 4
ENGINE_ARGS = {"enforce_eager": True, "dtype": "bfloat16", "max_model_len": 2048,
               "max_num_seqs": MAX_SEQS}  # fmt: skip
NUM_PROMPTS, INPUT_LEN, OUTPUT_LEN, SEED = 8, 32, 8, 0
ENDPOINTS = {
    "completions": ("openai", "/v1/completions"),
    "chat": ("openai-chat", "/v1/chat/completions"),
}
# Guards against a hang, never waits: each await below ends on a process's exit.
BENCH_LIMIT_S = 180


def policy_text(backend: dict[str, Any]) -> str:
    import hashlib

    return yaml.safe_dump({
        "version": 1,
        "backend": backend,
        "tiers": {"gold": {"priority": 0, "max_queue_wait_ms": 120000, "max_tokens": 2000}},
        "tenants": [{"id": "bench", "tier": "gold",
                     "api_keys": ["sha256:" + hashlib.sha256(KEY.encode()).hexdigest()]}],
    })  # fmt: skip


async def bench_serve(
    base_url: str,
    endpoint: str,
    out: Path,
    name: str,
    *,
    key: str | None = None,
    model: str | None = None,
    tokenizer: str | None = None,
) -> dict[str, Any]:
    """One `vllm bench serve` run; its saved result (--save-detailed: the
    per-request input_lens and errors too)."""
    backend, path = ENDPOINTS[endpoint]
    argv = [
        sys.executable, CLI, "bench", "serve", "--backend", backend, "--base-url", base_url,
        "--endpoint", path, "--dataset-name", "random", "--num-prompts", str(NUM_PROMPTS),
        "--random-input-len", str(INPUT_LEN), "--random-output-len", str(OUTPUT_LEN),
        "--seed", str(SEED), "--ready-check-timeout-sec", "10", "--disable-tqdm",
        "--save-result", "--save-detailed", "--result-dir", str(out),
        "--result-filename", f"{name}.json",
    ]  # fmt: skip
    if model is not None:
        argv += ["--model", model]
    if tokenizer is not None:
        argv += ["--tokenizer", tokenizer]
    # Nothing may come from a model hub here: a tokenizer the client cannot
    # find locally fails at once.
    env = dict(os.environ, HF_HUB_OFFLINE="1")
    env.pop("OPENAI_API_KEY", None)
    if key is not None:
        env["OPENAI_API_KEY"] = key  # the client's Authorization on each request
        if model is None:
            # It asks /v1/models with the --header headers only (as against
            # vLLM's own server started with --api-key, which guards /v1 too).
            argv += ["--header", f"Authorization=Bearer {key}"]
    proc = await asyncio.create_subprocess_exec(
        *argv, stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.STDOUT, env=env,
        cwd=out,
    )  # fmt: skip
    try:
        output, _ = await asyncio.wait_for(proc.communicate(), BENCH_LIMIT_S)
    except TimeoutError:
        proc.kill()
        await proc.wait()
        raise
    text = output.decode(errors="replace")
    assert proc.returncode == 0, f"vllm bench serve exited {proc.returncode}:\n{tail(text)}"
    return json.loads((out / f"{name}.json").read_text())


# -- fixtures: the two engines start together --------------------------------


@pytest_asyncio.fixture(scope="module", loop_scope="module")
async def upstream(tiny_model) -> AsyncIterator[VllmServer]:
    """Started first and waited for last: it loads while the in-process
    engine does."""
    server = VllmServer(tiny_model, max_num_seqs=MAX_SEQS, max_model_len=2048)
    await server.start()
    try:
        yield server
    finally:
        await server.stop()


@pytest_asyncio.fixture(scope="module", loop_scope="module")
async def in_process(tiny_model, upstream) -> AsyncIterator[Live]:
    policy = make_policy(policy_text({
        "kind": "vllm", "model": tiny_model, "served_model_name": SERVED,
        "engine_args": ENGINE_ARGS,
    }))  # fmt: skip
    backend = build_backend(policy.backend)
    async with live_app(policy, backend) as app:
        await backend.wait_ready()
        yield app


@pytest_asyncio.fixture(scope="module", loop_scope="module")
async def direct(upstream, tmp_path_factory) -> dict[str, dict[str, Any]]:
    """The engine's own counts: the same runs straight against `vllm serve`."""
    await upstream.ready()
    out = tmp_path_factory.mktemp("bench-direct")
    runs = {}
    for endpoint in ENDPOINTS:
        runs[endpoint] = run = await bench_serve(upstream.url, endpoint, out, f"direct-{endpoint}")
        assert (run["completed"], run["failed"]) == (NUM_PROMPTS, 0)
    # The counts are the server's, not the dataset's: the model's chat
    # template adds <|user|>, <|end|> and <|assistant|> to each prompt.
    assert [n + 3 for n in runs["completions"]["input_lens"]] == runs["chat"]["input_lens"]
    return runs


@pytest_asyncio.fixture(scope="module", loop_scope="module")
async def proxied(upstream) -> AsyncIterator[Live]:
    """qosgate's openai backend in front of `vllm serve`; the models (and
    their root) it learns from the upstream."""
    await upstream.ready()
    policy = make_policy(policy_text({"kind": "openai",
                                      "upstreams": [{"url": upstream.url + "/v1"}]}))
    async with live_app(policy) as app:
        yield app


@pytest.fixture(scope="module")
def figures(direct) -> Iterator[list[tuple[str, ...]]]:
    rows: list[tuple[str, ...]] = []
    yield rows
    d = {e: r["total_input_tokens"] for e, r in direct.items()}
    print(f"\nvllm bench serve: {NUM_PROMPTS} prompts, random input {INPUT_LEN}, output "
          f"{OUTPUT_LEN}, seed {SEED}; vllm serve alone: completions {d['completions']} "
          f"input tokens, chat {d['chat']}")
    print("| target | endpoint | --model | completed | failed | input tokens | vllm serve "
          "alone | ratio |")
    for row in rows:
        print("| " + " | ".join(row) + " |")


async def run_and_check(
    live: Live,
    direct: dict[str, dict[str, Any]],
    figures: list[tuple[str, ...]],
    target: str,
    endpoint: str,
    with_model: bool,
    tiny_model: str,
    out: Path,
) -> dict[str, Any]:
    name = f"{target}-{endpoint}-{'model' if with_model else 'no-model'}"
    if with_model:
        # The served name is no tokenizer: as against vLLM, name one.
        run = await bench_serve(live.url, endpoint, out, name, key=KEY, model=SERVED,
                                tokenizer=tiny_model)  # fmt: skip
        assert run["model_id"] == SERVED
    else:
        # Nothing but the address and the key: the client lists the models
        # and loads the tokenizer from the first one's root.
        run = await bench_serve(live.url, endpoint, out, name, key=KEY)
        assert (run["model_id"], run["tokenizer_id"]) == (tiny_model, tiny_model)
    alone = direct[endpoint]
    assert (run["completed"], run["failed"]) == (NUM_PROMPTS, 0), run["errors"]
    # Request by request, the prompt tokens the engine counts for the same
    # prompts served alone.
    assert run["input_lens"] == alone["input_lens"]
    assert run["total_input_tokens"] == alone["total_input_tokens"]
    assert run["total_output_tokens"] == NUM_PROMPTS * OUTPUT_LEN
    figures.append((
        target, endpoint, "yes" if with_model else "no", str(run["completed"]),
        str(run["failed"]), str(run["total_input_tokens"]), str(alone["total_input_tokens"]),
        f"{run['total_input_tokens'] / alone['total_input_tokens']:.3f}",
    ))  # fmt: skip
    return run


MODES = [pytest.param(False, id="no-model"), pytest.param(True, id="model")]


@pytest.mark.parametrize("with_model", MODES)
@pytest.mark.parametrize("endpoint", list(ENDPOINTS))
async def test_against_the_in_process_engine(
    in_process, direct, figures, tiny_model, tmp_path, endpoint, with_model
):
    streams = len(in_process.gateway.streams)
    run = await run_and_check(in_process, direct, figures, "qosgate + in-process engine",
                              endpoint, with_model, tiny_model, tmp_path)  # fmt: skip
    # The client's readiness probe (its first prompt) and then the run.
    ran = in_process.gateway.streams[streams:]
    assert len(ran) == NUM_PROMPTS + 1
    assert all(s.request.outcome.value == "completed" for s in ran)
    # qosgate's own count at admission (the engine's renderer and tokenizer:
    # what quotas reserve) is the engine's.
    assert sorted(s.request.prompt_tokens for s in ran[1:]) == sorted(run["input_lens"])


@pytest.mark.parametrize("with_model", MODES)
@pytest.mark.parametrize("endpoint", list(ENDPOINTS))
async def test_against_an_upstream_vllm_server(
    proxied, direct, figures, tiny_model, tmp_path, endpoint, with_model
):
    await run_and_check(proxied, direct, figures, "qosgate + vllm serve upstream", endpoint,
                        with_model, tiny_model, tmp_path)  # fmt: skip
