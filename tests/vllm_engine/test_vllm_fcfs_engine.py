"""An engine started first come, first served gets no priorities.

vLLM honours a request's priority only when started with
`scheduling_policy: priority` (the backend's default); its OpenAI server
documents any other priority than 0 as an error elsewhere, and some of its
versions refuse one. An operator who sets `fcfs` in `engine_args` gives up
the engine-side order, not the service: the backend sends no priority there,
and every tier's request is served, qosgate's own queues still ordering
what goes in.
"""

from __future__ import annotations

import openai
import pytest
import pytest_asyncio

from tests.http_support import live_app, make_policy
from tests.vllm_engine.test_vllm_backend import KEYS, Watch, policy_yaml

pytestmark = pytest.mark.asyncio(loop_scope="module")


@pytest_asyncio.fixture(scope="module", loop_scope="module")
async def live(tiny_model):
    from qosgate.backends import build_backend

    yaml_text = policy_yaml(tiny_model).replace(
        "    enforce_eager: true\n", "    enforce_eager: true\n    scheduling_policy: fcfs\n")
    assert "scheduling_policy: fcfs" in yaml_text
    policy = make_policy(yaml_text)
    backend = build_backend(policy.backend)
    async with live_app(policy, backend) as app:
        await backend.wait_ready()
        assert backend.engine.vllm_config.scheduler_config.policy == "fcfs"
        app.watch = Watch(backend)  # type: ignore[attr-defined]
        yield app


async def test_every_tier_is_served_by_an_fcfs_engine_without_a_priority(live):
    served = []
    for tier, prompt in (("gold", "a " * 40), ("bronze", "b"), ("bronze", "c " * 300)):
        client = openai.AsyncOpenAI(base_url=live.url + "/v1", api_key=KEYS[tier],
                                    max_retries=0)
        completion = await client.completions.create(model="tiny", prompt=prompt, max_tokens=2)
        await client.close()
        assert completion.usage is not None and completion.usage.completion_tokens >= 1
        served.append(live.gateway.streams[-1].request)
    # Under a priority engine each of these would carry a nonzero priority
    # (its level, then its prompt's size class); this engine refuses any.
    assert {live.watch.priorities[req.id] for req in served} == {0}
    assert len({req.prompt_tokens.bit_length() for req in served}) > 1
