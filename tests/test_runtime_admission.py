"""Admission in the live gateway: a burst the backend has room for is admitted whole."""

from __future__ import annotations

import asyncio

from qosgate.backends.sim_live import SimBackend
from qosgate.config import load_policy
from qosgate.core.request import Outcome
from qosgate.runtime import Gateway


async def test_a_burst_within_the_backends_room_is_not_refused() -> None:
    # The example policy holds standard requests in a 20 ms batch window; 40
    # arriving in the same loop turn must not count each other as backlog
    # while the engine has 256 free slots.
    policy = load_policy("policies/example.yaml")
    backend = SimBackend(policy.backend.model_copy(update={"speed": 50.0}))
    gateway = Gateway(policy, backend)
    await gateway.start()
    try:
        streams = [
            gateway.submit(
                request_id=f"b{k}", tenant="demo-app", tier="standard", endpoint="chat",
                body={"model": "sim-llama3-8b", "messages": [{"role": "user", "content": "hi"}]},
                prompt_tokens=800, max_tokens=16,
            )
            for k in range(40)
        ]

        async def drain(stream) -> None:
            async for _ in stream:
                pass

        await asyncio.gather(*(drain(s) for s in streams))
        assert all(s.request.outcome is Outcome.COMPLETED for s in streams)
    finally:
        await gateway.close()
