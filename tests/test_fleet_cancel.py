"""A client that leaves while its item runs on an engine node makes that node
abort it at once: the replica tells the nodes on the fleet's cancel channel
(docs/FLEET.md), not by letting the run's lease lapse. With a 60 s lease the
node would only find the item gone at its next renewal, 20 s later, so an
abort within ABORT_S can only come from the message."""

from __future__ import annotations

import asyncio
import uuid

from qosgate.core.request import Outcome
from tests.test_fleet_runtime import LIMIT_S, Fleet, chores, ended, first_chunk, make_policy

LEASE_S = 60.0
ABORT_S = 5.0


async def test_a_client_gone_mid_run_makes_the_engine_node_abort_it(redis_server):
    policy = make_policy(redis_server.url, f"c{uuid.uuid4().hex[:8]}:")
    assert policy.fleet is not None
    # A slow GPU: the run's 5000 tokens take far longer than ABORT_S.
    policy = policy.model_copy(update={
        "fleet": policy.fleet.model_copy(update={"lease_s": LEASE_S}),
        "backend": policy.backend.model_copy(update={"speed": 0.02}),
    })  # fmt: skip
    async with Fleet(policy, engines=1) as fleet:
        engine = fleet.engines[0]
        async with asyncio.timeout(LIMIT_S):
            stream = fleet.submit(max_tokens=5000)
            await first_chunk(stream)
            assert engine.status()["running"] == 1
            await stream.aclose()  # the client leaves mid-stream
            await chores(fleet)  # the replica's cancellation has reached Redis
        # Shielded: a timeout must not cancel the run itself (that would pass).
        await asyncio.wait_for(asyncio.shield(ended(engine, stream.request.id)), ABORT_S)
        assert stream.request.outcome is Outcome.CANCELLED
        assert engine.status()["running"] == 0 and engine.completed == 0
        assert engine.backend.capacity().free_slots == 2
