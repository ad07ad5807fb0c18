"""`qosgate calibrate` against the real engine: `vllm serve` of the tiny model
with a context of 2048 tokens and 4 sequences. The sweep must fit itself to
that engine (prompts within the context the server's /v1/models gives, no
batch above --max-num-seqs: a 2048-token prompt or a batch of 24 would fail
or queue), and the profile it writes must load.

Its decode step must lie within what the engine itself times: batches of 1
to 4 streams are run here with the official `openai` client, and vLLM's
inter-token latency (its sum and count over each batch, timed in the
engine's process) gives each batch's mean step. A sanity bound, not a timing
target: the CPU engine on a shared machine is no timing reference, but a fit
that is off by a unit, fitted to a client's stalls or to a queue, is far
outside it.
"""

from __future__ import annotations

import asyncio
import random
from collections.abc import AsyncIterator
from pathlib import Path

import aiohttp
import openai
import pytest
import pytest_asyncio
from prometheus_client.parser import text_string_to_metric_families

from qosgate.cli import main
from qosgate.profiles import load_profile_file
from tests.vllm_engine.vllm_server import SERVED, VllmServer, serving

pytestmark = pytest.mark.asyncio(loop_scope="module")

MAX_SEQS = 4
CONTEXT = 2048
PROMPT_TOKENS = 128
OUTPUT_TOKENS = 96
ROUNDS = 3
BOUND = 2.0
"""How far outside the engine's measured range the fitted step may be, as a
factor either way."""


@pytest_asyncio.fixture(scope="module", loop_scope="module")
async def server(tiny_model) -> AsyncIterator[VllmServer]:
    async with serving(tiny_model, max_num_seqs=MAX_SEQS, max_model_len=CONTEXT) as server:
        yield server


async def engine_itl(http: aiohttp.ClientSession, url: str) -> tuple[float, float]:
    """vLLM's inter-token latency histogram: (sum in seconds, count)."""
    async with http.get(url + "/metrics") as response:
        assert response.status == 200
        text = await response.text()
    found = {}
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            if sample.name.startswith("vllm:inter_token_latency_seconds_"):
                key = sample.name.rsplit("_", 1)[1]
                found[key] = found.get(key, 0.0) + sample.value
    return found["sum"], found["count"]


async def stream(client: openai.AsyncOpenAI, rng: random.Random) -> int:
    """One streamed request; the output tokens its usage reports (a server
    that falls behind its engine sends several tokens in one chunk)."""
    tokens = 0
    response = await client.completions.create(
        model=SERVED, prompt=[rng.randrange(16, 500) for _ in range(PROMPT_TOKENS)],
        max_tokens=OUTPUT_TOKENS, stream=True, stream_options={"include_usage": True},
        extra_body={"ignore_eos": True},
    )  # fmt: skip
    async for chunk in response:
        if chunk.usage is not None:
            tokens = chunk.usage.completion_tokens
    return tokens


async def test_calibrate_fits_the_engine_and_its_step_is_the_engines(
    server: VllmServer, tmp_path: Path
) -> None:
    out = tmp_path / "tiny.yaml"
    rc = await asyncio.to_thread(main, [
        "calibrate", f"{server.url}/v1", "--model", SERVED, "--out", str(out),
        "--max-num-seqs", str(MAX_SEQS), "--quiet",
    ])  # fmt: skip
    assert rc == 0
    profile = load_profile_file(out)
    assert profile.max_num_seqs == MAX_SEQS
    assert profile.kv_capacity_tokens > 0  # from the server's vllm:cache_config_info
    assert "timed by the engine" in out.read_text()

    client = openai.AsyncOpenAI(base_url=f"{server.url}/v1", api_key="none", max_retries=0)
    rng = random.Random(7)
    async with aiohttp.ClientSession() as http:
        for seqs in range(1, MAX_SEQS + 1):
            means = []
            for _ in range(ROUNDS):
                total, count = await engine_itl(http, server.url)
                streamed = await asyncio.gather(*(stream(client, rng) for _ in range(seqs)))
                assert streamed == [OUTPUT_TOKENS] * seqs
                after_total, after_count = await engine_itl(http, server.url)
                assert after_count - count == seqs * (OUTPUT_TOKENS - 1)
                means.append((after_total - total) / (after_count - count) * 1000.0)
            context = seqs * (PROMPT_TOKENS + OUTPUT_TOKENS // 2)
            fitted = profile.step_ms([], seqs, context)
            assert min(means) / BOUND <= fitted <= max(means) * BOUND, (seqs, fitted, means)
    await client.close()
