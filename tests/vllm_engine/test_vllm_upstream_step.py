"""The openai backend learns the step of a real `vllm serve` from its metrics
(vLLM's tokens-per-step histogram), the unit of an automatic prefill budget
in front of it, and converts it to the gateway's count of prompt tokens by
the usage the server reports."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator

import pytest
import pytest_asyncio

from qosgate.backends.base import GenerationJob
from qosgate.backends.openai import OpenAIBackend
from qosgate.config.models import OpenAIBackendConfig
from tests.vllm_engine.vllm_server import SERVED, VllmServer, serving

pytestmark = pytest.mark.asyncio(loop_scope="module")

SERVER_STEP = 2048
"""vLLM's default max_num_batched_tokens for its OpenAI server on a CPU."""
PROMPT = 200
# A guard against a hang, never a wait: every await below ends on an answer.
LIMIT_S = 60.0


@pytest_asyncio.fixture(scope="module", loop_scope="module")
async def server(tiny_model) -> AsyncIterator[VllmServer]:
    async with serving(tiny_model, max_num_seqs=16, max_model_len=512) as server:
        yield server


async def run(backend: OpenAIBackend, i: int, prompt: list[int] | str) -> None:
    """One streamed request, its prompt counted as the gateway counts it."""
    body = {"model": SERVED, "prompt": prompt, "stream": True, "ignore_eos": True}
    job = GenerationJob(request_id=f"s{i}", endpoint="completions", body=body,
                        prompt_tokens=backend.count_prompt_tokens("completions", body),
                        max_tokens=4, priority=0)  # fmt: skip
    async for _ in backend.generate(job):
        pass


async def test_the_step_is_learned_from_the_servers_metrics_as_an_upper_bound(server):
    backend = OpenAIBackend(OpenAIBackendConfig(
        upstreams=[{"url": f"{server.url}/v1", "max_concurrency": 16}],
        health_interval_s=3600.0, metrics_interval_s=3600.0,
    ))  # fmt: skip
    await backend.start()
    try:
        async with asyncio.timeout(LIMIT_S):
            # Prompts of token ids, counted alike on both sides: more prompt
            # than one step takes, sent at once, so steps fill the budget.
            await asyncio.gather(*(run(backend, i, [(i * 7 + k) % 400 + 16 for k in range(PROMPT)])
                                   for i in range(16)))  # fmt: skip
            await backend._read_all_metrics()
            step = backend.step_tokens
            # Never below the server's step once a step filled it; at most the
            # next power of two, where a prompt that straddled two steps was
            # counted whole in the second.
            assert step in (SERVER_STEP, 2 * SERVER_STEP), step
            # Text prompts, which the gateway estimates at 4 characters a
            # token and the test model's tokenizer counts a token a
            # character (digits and signs it was not trained on): the step is
            # converted to the gateway's count by the server's usage.
            text = "".join(f"{i % 10}#{chr(97 + i * 7 % 26)};" for i in range(64))
            for i in range(40):
                await run(backend, 100 + i, text)
            await backend._read_all_metrics()
            ratio = backend._counted_prompts / backend._reported_prompts
            assert ratio < 0.5, ratio
            learned = backend._upstreams[0].step
            assert learned in (SERVER_STEP, 2 * SERVER_STEP), learned
            assert backend.step_tokens == round(learned * ratio)
    finally:
        await backend.close()
