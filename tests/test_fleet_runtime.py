"""The fleet's runtime in one event loop: a gateway replica (the real
`Gateway` over `FleetBackend`) and engine nodes (`EngineNode` over the
simulated GPU), talking through a real redis-server.

What a client of a replica sees must be what it would see on one node: the
answer in full, the request's one outcome, its queue budget, its tier's cap,
and a disconnect that takes its work out of the fleet. Every wait is on an
event, bounded by LIMIT_S; nothing sleeps.
"""

from __future__ import annotations

import asyncio
import contextlib
import time
import uuid
from collections.abc import AsyncIterator
from typing import Any

import aiohttp
import pytest
from aiohttp.test_utils import TestServer
from prometheus_client.parser import text_string_to_metric_families

from qosgate.backends.base import BackendRejected, Chunk, GenerationJob
from qosgate.backends.sim_live import SimBackend, filler_text
from qosgate.config.models import PolicyConfig
from qosgate.core.arrivals_hold import expected_arrivals
from qosgate.core.request import Outcome
from qosgate.core.scheduler import BackendCapacity
from qosgate.fleet import engine as engine_module
from qosgate.fleet import Prefill, wire
from qosgate.fleet.engine import EngineNode
from qosgate.fleet.gateway import FleetBackend
from qosgate.http.app import build_app
from qosgate.runtime.errors import (
    BadRequest, ContextLengthExceeded, Expired, GatewayError, Overloaded, QueueFull,
)
from qosgate.runtime.gate import Gateway, RequestStream
from tests.redis_server import free_port

LIMIT_S = 20.0


def make_policy(
    redis_url: str, prefix: str, scheduler: dict[str, Any] | None = None,
    batch: dict[str, Any] | None = None, tenants: list[dict[str, Any]] | None = None,
    quota_store: dict[str, Any] | None = None, **tier_overrides: Any,
) -> PolicyConfig:  # fmt: skip
    interactive = {"priority": 0, "max_queue_wait_ms": 60_000, **tier_overrides}
    return PolicyConfig.model_validate({
        "tenants": tenants or [],
        "scheduler": scheduler or {},
        "backend": {"kind": "sim", "speed": 4.0, "max_num_seqs": 2},
        "tiers": {
            "interactive": interactive,
            "batch": {"priority": 2, "on_timeout": "delay", **(batch or {})},
        },
        "default_tier": "interactive",
        "fleet": {"role": "gateway", "url": redis_url, "key_prefix": prefix, "lease_s": 1.0},
        "quota_store": quota_store or {},
    })  # fmt: skip


class Fleet:
    """One replica and `engines` engine nodes, started and stopped together."""

    def __init__(
        self, policy: PolicyConfig, engines: int = 1, seqs: int = 2,
        backend: type[SimBackend] = SimBackend,
    ) -> None:  # fmt: skip
        assert policy.fleet is not None
        self.policy = policy
        self.backend = FleetBackend(
            policy, policy.fleet.model_copy(update={"node_id": "gw"}),
            models=("sim-llama3-8b",), count_prompt_tokens=lambda e, b: 8,
        )  # fmt: skip
        self.gateway = Gateway(policy, self.backend)
        engine_cfg = policy.backend.model_copy(update={"max_num_seqs": seqs})
        self.engines = [
            EngineNode(
                policy, policy.fleet.model_copy(update={"node_id": f"e{i}", "role": "engine"}),
                backend(engine_cfg),
            )
            for i in range(engines)
        ]  # fmt: skip

    async def __aenter__(self) -> Fleet:
        await self.gateway.start()
        for engine in self.engines:
            await engine.start()
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.gateway.close()
        for engine in self.engines:
            await engine.stop(0.0)

    def submit(self, tier: str = "interactive", max_tokens: int = 8,
               stream: bool = True, session: str | None = None,
               tenant: str = "t", prompt_tokens: int = 8) -> RequestStream:  # fmt: skip
        return self.gateway.submit(
            request_id=uuid.uuid4().hex, tenant=tenant, tier=tier, endpoint="chat",
            body={"model": "sim-llama3-8b", "messages": [], "max_tokens": max_tokens,
                  "stream": stream},
            prompt_tokens=prompt_tokens, max_tokens=max_tokens, session=session,
        )  # fmt: skip


@pytest.fixture
async def prefix() -> AsyncIterator[str]:
    yield f"t{uuid.uuid4().hex[:8]}:"


class Enqueues:
    """Counts the wakes every enqueue publishes: how a test knows an item is
    in the shared queue without asking Redis over and over."""

    def __init__(self, fleet: Fleet) -> None:
        self._pubsub = fleet.backend.store.redis.pubsub()
        self._channel = fleet.backend.store.wake_channel

    async def __aenter__(self) -> Enqueues:
        await self._pubsub.subscribe(self._channel)
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self._pubsub.aclose()

    async def wait(self, count: int = 1) -> None:
        async for message in self._pubsub.listen():
            if message["type"] == "message":
                count -= 1
                if count == 0:
                    return


async def chores(fleet: Fleet) -> None:
    """The replica's cancellations, which run in tasks of their own."""
    await asyncio.gather(*list(fleet.backend._chores))


async def runs_done(node) -> None:
    """A node's runs have ended on the node too: a client reads a run's end
    as soon as the store delivers it, a moment before the node counts it."""
    await asyncio.gather(*list(node._runs.values()), return_exceptions=True)


async def read_all(stream: RequestStream) -> tuple[str, int]:
    text, tokens = "", 0
    async for chunk in stream:
        text += chunk.text
        tokens += chunk.tokens
    return text, tokens


async def first_chunk(stream: RequestStream) -> str:
    async for chunk in stream:
        return chunk.text
    raise AssertionError("the stream ended without output")


def fleet_waits(fleet: Fleet, tier: str = "interactive") -> float | None:
    """How many of the replica's requests engine nodes started (the count of
    qosgate_fleet_queue_wait_seconds)."""
    registry = fleet.gateway.observer.metrics.registry
    return registry.get_sample_value(
        "qosgate_fleet_queue_wait_seconds_count", {"tier": tier, "model": "sim-llama3-8b"}
    )


async def crash(backend: FleetBackend) -> None:
    """What a replica that dies leaves behind: nothing subscribed to its reply
    channel any more, and nothing of its own cancelled."""
    assert backend._reader is not None
    backend._reader.cancel()
    with contextlib.suppress(asyncio.CancelledError):
        await backend._reader
    await backend._replies.close()


def record_starts(engine: EngineNode) -> asyncio.Queue[str]:
    """The ids of the items `engine` starts, in order."""
    started: asyncio.Queue[str] = asyncio.Queue()
    take = engine._start

    def start(lease: Any) -> None:
        take(lease)
        started.put_nowait(lease.item.id)

    engine._start = start  # type: ignore[method-assign]
    return started


def record_releases(engine: EngineNode) -> asyncio.Queue[dict[str, list[str]]]:
    """Each batch of quota slots `engine` asked to release (tenant -> request
    ids), once the attempt is over, whether the store took it or not."""
    released: asyncio.Queue[dict[str, list[str]]] = asyncio.Queue()
    release = engine._release_quotas

    async def record(stopped: dict[str, list[str]]) -> None:
        await release(stopped)
        if stopped:
            released.put_nowait(stopped)

    engine._release_quotas = record  # type: ignore[method-assign]
    return released


def second_replica(policy: PolicyConfig, node_id: str = "gw2") -> Gateway:
    assert policy.fleet is not None
    return Gateway(policy, FleetBackend(
        policy, policy.fleet.model_copy(update={"node_id": node_id}),
        models=("sim-llama3-8b",), count_prompt_tokens=lambda e, b: 8,
    ))  # fmt: skip


async def ended(engine: EngineNode, item_id: str) -> None:
    task = engine._runs.get(item_id)
    if task is not None:
        with contextlib.suppress(asyncio.CancelledError):
            await task


async def test_the_answer_comes_back_whole_streamed_or_not(redis_server, prefix):
    async with Fleet(make_policy(redis_server.url, prefix), engines=2) as fleet:
        async with asyncio.timeout(LIMIT_S):
            streams = [fleet.submit(max_tokens=12, stream=i % 2 == 0) for i in range(6)]
            answers = await asyncio.gather(*(read_all(s) for s in streams))
        assert answers == [(filler_text(0, 12), 12)] * 6
        assert {s.request.outcome for s in streams} == {Outcome.COMPLETED}
        assert sum(e.completed for e in fleet.engines) == 6
        # Each one's wait in the shared queue, as the replica saw it end.
        assert fleet_waits(fleet) == 6
        assert await fleet.backend.store.leased() == 0
        assert sum((await fleet.backend.store.depth()).values()) == 0


async def test_a_node_held_at_its_reserve_is_full_to_its_drain_estimate(redis_server, prefix):
    """A node whose free slots are all kept for top-level work, while lower
    work waits for them, runs at what it can do: its drain estimate counts
    that time, as one node's scheduler counts a release the reserve blocks.
    Counted only while it has room, it stayed at its prior under overload,
    and the fleet's admission refused far more than one node does."""
    policy = make_policy(redis_server.url, prefix, scheduler={"reserve": {"slots": 1}})
    async with Fleet(policy, engines=1, seqs=2) as fleet:
        node = fleet.engines[0]
        async with asyncio.timeout(LIMIT_S), Enqueues(fleet) as enqueues:
            running = fleet.submit(tier="batch", max_tokens=5000)
            await first_chunk(running)
            # One slot free, nothing waits for it: not full, nothing measured.
            assert node.status()["free_slots"] == 1 and not node.drain.counting
            waiting = fleet.submit(tier="batch", max_tokens=5000)
            reader = asyncio.ensure_future(read_all(waiting))
            await enqueues.wait(2)
            await node._claim()
            assert (await fleet.backend.store.depth())["batch"] == 1
            assert node.status()["free_slots"] == 1 and node.drain.counting
            reader.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await reader
            await running.aclose()


class FirstTokenGate(SimBackend):
    """The simulated GPU, whose runs' first output reaches the node only once
    `gate` is set (until then every run it was given is in prefill), and the
    rest only once `rest` is. It never calls its capacity listener."""

    gate: asyncio.Event
    rest: asyncio.Event

    def _notify(self) -> None:
        # The simulated GPU says it may have room at every step; a real
        # engine, when a sequence ends. Nothing ends here until `rest`.
        pass

    def generate(self, job: GenerationJob) -> AsyncIterator[Chunk]:
        output = super().generate(job)
        gate, rest = self.gate, self.rest

        async def gated() -> AsyncIterator[Chunk]:
            await gate.wait()
            async for chunk in output:
                yield chunk
                await rest.wait()

        return gated()


async def test_an_engine_node_holds_lower_tiers_for_its_prefill_budget_until_a_first_token(
    redis_server, prefix
):
    """As one node's scheduler does: below the top level, a node claims no
    prompt that would take what its backend has in prefill past the budget;
    top-level work still goes; the first token lets the held work go, with
    no other wake. Admission meanwhile reads the node as full below the top."""
    policy = make_policy(redis_server.url, prefix, scheduler={
        "prefill_budget_tokens": 100, "delay_prefill_tokens": None})  # fmt: skip
    # Leases longer than the test: no lease timer wakes the node in it.
    assert policy.fleet is not None
    policy = policy.model_copy(update={"fleet": policy.fleet.model_copy(update={"lease_s": 60.0})})
    FirstTokenGate.gate, FirstTokenGate.rest = asyncio.Event(), asyncio.Event()
    async with Fleet(policy, engines=1, seqs=3, backend=FirstTokenGate) as fleet:
        node, store = fleet.engines[0], fleet.backend.store
        started = record_starts(node)
        async with asyncio.timeout(LIMIT_S), Enqueues(fleet) as enqueues:
            readers = []

            def submit(**kw: Any) -> RequestStream:
                stream = fleet.submit(max_tokens=4, **kw)
                readers.append(asyncio.ensure_future(read_all(stream)))
                return stream

            first = submit(tier="batch", prompt_tokens=80)
            assert await started.get() == first.request.id
            held = submit(tier="batch", prompt_tokens=80)
            await enqueues.wait(2)
            await node._claim()
            assert started.empty() and (await store.depth())["batch"] == 1
            assert node.status()["prefill_tokens"] == 80
            # (The simulated GPU may have finished the gated run already: how
            # many slots it has free is not the point.)
            load = await store.load(time.time())
            assert load.rooms == () and len(load.held_rooms) == 1
            # The top level is never held.
            top = submit(prompt_tokens=500)
            assert await started.get() == top.request.id
            assert node.status()["prefill_tokens"] == 580
            # First tokens, and nothing ends: the first token alone lets it go.
            FirstTokenGate.gate.set()
            assert await started.get() == held.request.id
            FirstTokenGate.rest.set()
            answers = await asyncio.gather(*readers)
        assert [tokens for _, tokens in answers] == [4, 4, 4]
        await runs_done(node)
        assert node.status()["prefill_tokens"] == 0


@pytest.mark.parametrize("policy_kind", ["qos", "fcfs"])
async def test_an_engine_node_counts_its_prefill_budget_in_its_own_engines_steps(
    redis_server, prefix, policy_kind
):
    """`auto` resolves against the node's backend, again once a backend that
    loads in the background knows its step; fcfs has no budget and no pace."""

    class LearnsItsStep(SimBackend):
        step: int | None = None

        @property
        def step_tokens(self) -> int | None:
            return self.step

    policy = make_policy(redis_server.url, prefix, scheduler={"policy": policy_kind})
    assert policy.fleet is not None
    backend = LearnsItsStep(policy.backend)
    node = EngineNode(policy, policy.fleet.model_copy(update={"node_id": "e0", "role": "engine"}),
                      backend)  # fmt: skip
    try:
        assert node._prefill() == Prefill(0, None, None)
        backend.step = 256
        want = (1024, 1024) if policy_kind == "qos" else (None, None)
        assert (node._prefill().budget, node._prefill().pace) == want
    finally:
        await node.store.close()


async def test_a_client_gone_while_queued_takes_its_item_out(redis_server, prefix):
    async with Fleet(make_policy(redis_server.url, prefix), engines=1, seqs=1) as fleet:
        store = fleet.backend.store
        async with asyncio.timeout(LIMIT_S), Enqueues(fleet) as enqueues:
            running = fleet.submit(max_tokens=400)
            await first_chunk(running)
            queued = fleet.submit(tier="batch")
            reader = asyncio.ensure_future(read_all(queued))
            await enqueues.wait(2)
            assert (await store.depth())["batch"] == 1
            reader.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await reader
            assert queued.request.outcome is Outcome.CANCELLED
            await chores(fleet)
            assert (await store.depth())["batch"] == 0
            assert await store.status(queued.request.id) == "completed"
            await running.aclose()
        assert fleet.engines[0].completed == 0, "the cancelled items must not have run"


async def test_a_client_gone_mid_stream_stops_the_engine(redis_server, prefix):
    async with Fleet(make_policy(redis_server.url, prefix), engines=1) as fleet:
        engine = fleet.engines[0]
        async with asyncio.timeout(LIMIT_S):
            stream = fleet.submit(max_tokens=5000)
            await first_chunk(stream)
            assert engine.status()["running"] == 1
            await stream.aclose()
            task = next(iter(engine._runs.values()), None)
            if task is not None:
                with contextlib.suppress(asyncio.CancelledError):
                    await task
        assert stream.request.outcome is Outcome.CANCELLED
        assert engine.status()["running"] == 0
        assert engine.backend.capacity().free_slots == 2
        assert engine.completed == 0


@pytest.mark.parametrize("over_context", [False, True])
async def test_a_request_an_engines_backend_rejects_is_the_clients_400(
    redis_server, prefix, over_context
):
    """As on one node: the backend's word that the request is invalid (an
    upstream's 400) reaches the replica as such, param and all, and whether
    it is the model's context that the request exceeds (OpenAI's code)."""
    async with Fleet(make_policy(redis_server.url, prefix), engines=1) as fleet:
        engine = fleet.engines[0]

        async def reject(job: GenerationJob) -> AsyncIterator[Chunk]:
            raise BackendRejected("temperature is out of range", param="temperature",
                                  context_length=over_context)
            yield Chunk()  # an async generator, like a backend's stream

        engine.backend.generate = reject  # type: ignore[method-assign]
        stream = fleet.submit()
        async with asyncio.timeout(LIMIT_S):
            with pytest.raises(BadRequest) as info:
                await read_all(stream)
        assert (info.value.message, info.value.param) == ("temperature is out of range",
                                                          "temperature")  # fmt: skip
        assert isinstance(info.value, ContextLengthExceeded) is over_context
        assert stream.request.outcome is Outcome.BAD_REQUEST


async def test_queue_budget_expires_an_item_no_node_took(redis_server, prefix):
    policy = make_policy(redis_server.url, prefix, max_queue_wait_ms=200)
    async with Fleet(policy, engines=1, seqs=1) as fleet:
        async with asyncio.timeout(LIMIT_S):
            running = fleet.submit(max_tokens=400)
            head = await first_chunk(running)
            late = fleet.submit()
            with pytest.raises(Expired):
                await read_all(late)
            assert late.request.outcome is Outcome.EXPIRED
            assert await fleet.backend.store.status(late.request.id) == "completed"
            # The running one is past its budget too, but it was taken in
            # time: it runs to its end.
            assert running.request.outcome is None
            text, _ = await read_all(running)
            assert head + text == filler_text(0, 400)
            assert running.request.outcome is Outcome.COMPLETED


async def test_a_tier_full_across_the_fleet_refuses_with_429(redis_server, prefix):
    policy = make_policy(redis_server.url, prefix, max_queue_len=2)
    async with Fleet(policy, engines=1, seqs=1) as fleet:
        async with asyncio.timeout(LIMIT_S), Enqueues(fleet) as enqueues:
            running = fleet.submit(max_tokens=5000)
            await first_chunk(running)
            waiting = [fleet.submit() for _ in range(2)]
            readers = [asyncio.ensure_future(read_all(s)) for s in waiting]
            await enqueues.wait(3)
            assert (await fleet.backend.store.depth())["interactive"] == 2
            refused = fleet.submit()
            with pytest.raises(QueueFull):
                await read_all(refused)
            assert refused.request.outcome is Outcome.REJECTED_QUEUE_FULL
            await running.aclose()
            assert [r[1] for r in await asyncio.gather(*readers)] == [8, 8]


async def test_the_fleet_refuses_at_the_door_what_would_wait_past_its_budget(
    redis_server, prefix
):
    # The node is taken to drain 10 tokens/s, and nothing completes during
    # the test to teach it otherwise. Each request is 8 prompt + 8 output
    # tokens; interactive's budget is 2 s.
    policy = make_policy(
        redis_server.url, prefix, scheduler={"initial_drain_rate": 10.0}, max_queue_wait_ms=2000
    )
    async with Fleet(policy, engines=1, seqs=1) as fleet:
        async with asyncio.timeout(LIMIT_S), Enqueues(fleet) as enqueues:
            running = fleet.submit(max_tokens=5000)
            await first_chunk(running)  # the node is full from here on
            # What the node reports: its prior, as nothing has completed.
            assert (await fleet.backend.store.load(time.time())).drain == 10.0
            # Its own 16 tokens: 1.6 s.
            admitted = fleet.submit()
            reader = asyncio.ensure_future(read_all(admitted))
            await enqueues.wait(2)
            # 16 queued + its own 16: 3.2 s, over the budget by 1.2 s.
            refused = fleet.submit()
            with pytest.raises(Overloaded) as error:
                await read_all(refused)
            assert refused.request.outcome is Outcome.REJECTED_OVERLOAD
            assert error.value.retry_after_s == pytest.approx(1.2)
            assert error.value.retry_after_header == "2"
            assert await fleet.backend.store.status(refused.request.id) is None
            # A delay tier is never refused: it waits, and ages.
            patient = fleet.submit(tier="batch")
            patient_reader = asyncio.ensure_future(read_all(patient))
            await enqueues.wait(1)
            assert (await fleet.backend.store.depth()) == {"interactive": 1, "batch": 1}
            await running.aclose()
            assert (await reader)[1] == 8 and (await patient_reader)[1] == 8
        assert admitted.request.outcome is Outcome.COMPLETED
        assert patient.request.outcome is Outcome.COMPLETED


def rejected_overload(gateway: Gateway) -> float:
    """How many of a replica's requests ended rejected_overload, as its
    qosgate_requests_total counts them."""
    return sum(
        sample.value
        for family in gateway.observer.metrics.registry.collect()
        for sample in family.samples
        if sample.name == "qosgate_requests_total"
        and sample.labels.get("outcome") == "rejected_overload"
    )  # fmt: skip


async def test_a_newcomer_takes_a_floods_newest_place_whose_client_gets_503_refunded(
    redis_server, prefix
):
    # The node is taken to drain 10 tokens/s, and nothing completes during
    # the test to teach it otherwise. Each queued request is 8 prompt + 8
    # output tokens; interactive's budget is 5 s. Tenant a floods it through
    # this replica, b sends through another.
    policy = make_policy(
        redis_server.url, prefix, scheduler={"initial_drain_rate": 10.0}, max_queue_wait_ms=5000,
        tenants=[{"id": "a", "tier": "interactive", "quotas": {"tokens_per_minute": 1_000_000}},
                 {"id": "b", "tier": "interactive"}],
    )  # fmt: skip
    body = {"model": "sim-llama3-8b", "messages": [], "max_tokens": 8, "stream": True}
    async with Fleet(policy, engines=1, seqs=1) as fleet:
        started = record_starts(fleet.engines[0])
        other = second_replica(policy)
        await other.start()
        reservations = []

        async def flood() -> RequestStream:
            request_id = uuid.uuid4().hex
            decision = await fleet.gateway.quotas.reserve("a", 16, request_id)
            assert decision is not None and decision.admitted
            reservations.append(decision.reservation)
            return fleet.gateway.submit(
                request_id=request_id, tenant="a", tier="interactive", endpoint="chat",
                body=body, prompt_tokens=8, max_tokens=8, reservation=decision.reservation,
            )  # fmt: skip

        try:
            async with asyncio.timeout(LIMIT_S), Enqueues(fleet) as enqueues:
                filler = fleet.submit(max_tokens=5000, tenant="a")
                await first_chunk(filler)  # the node is full from here on
                queued = [await flood() for _ in range(3)]  # 1.6, 3.2 and 4.8 s
                readers = [asyncio.ensure_future(read_all(s)) for s in queued]
                await enqueues.wait(4)
                # a's next would wait 6.4 s, and no tenant stands behind a.
                with pytest.raises(Overloaded):
                    await read_all(await flood())
                # b's would too, but a stands ahead of b by what it has
                # queued, and its newest leaving makes room: 4.8 s.
                light = other.submit(
                    request_id=uuid.uuid4().hex, tenant="b", tier="interactive",
                    endpoint="chat", body=body, prompt_tokens=8, max_tokens=8,
                )  # fmt: skip
                light_reader = asyncio.ensure_future(read_all(light))
                with pytest.raises(Overloaded) as error:
                    await readers[2]
                pushed_out = queued[2].request
                assert pushed_out.outcome is Outcome.REJECTED_OVERLOAD
                assert (error.value.status, error.value.retry_after_header) == (503, "5")
                assert await fleet.backend.store.status(pushed_out.id) == "completed"
                await filler.aclose()
                assert [(await r)[1] for r in readers[:2]] == [8, 8]
                assert (await light_reader)[1] == 8
            # By arrival: a's first two, then b's, which took the third's place.
            ids = [await started.get() for _ in range(4)]
            assert ids == [filler.request.id, queued[0].request.id, queued[1].request.id,
                           light.request.id]  # fmt: skip
            assert started.empty()
            # Counted once, with the refusal before it, and never started.
            assert rejected_overload(fleet.gateway) == 2
            assert rejected_overload(other) == 0
            assert fleet_waits(fleet) == 3
        finally:
            await other.close()
    [first, second, taken, refused] = reservations
    assert (taken.settled, taken.charged) == (True, 0), "it never ran"
    assert (refused.settled, refused.charged) == (True, 0)
    assert first.settled and first.charged == 16


async def test_a_full_node_sends_back_a_preemptible_run_for_more_urgent_work(
    redis_server, prefix
):
    policy = make_policy(
        redis_server.url, prefix, scheduler={"preemption": True}, batch={"preemptible": True}
    )
    async with Fleet(policy, engines=1, seqs=1) as fleet:
        engine = fleet.engines[0]
        started = record_starts(engine)
        async with asyncio.timeout(LIMIT_S):
            # A long prompt: the batch run spends about a second in prefill,
            # with no output yet, filling the node's one slot.
            batch = fleet.submit(tier="batch", prompt_tokens=150_000, max_tokens=4)
            batch_reader = asyncio.ensure_future(read_all(batch))
            assert await started.get() == batch.request.id
            urgent = fleet.submit(max_tokens=8)
            assert await read_all(urgent) == (filler_text(0, 8), 8)
            assert not batch_reader.done(), "interactive went first"
            assert await batch_reader == (filler_text(0, 4), 4)
        assert engine.preempted == 1
        # Taken, sent back, taken again, the urgent one in between.
        assert [await started.get() for _ in range(2)] == [urgent.request.id, batch.request.id]
        assert {batch.request.outcome, urgent.request.outcome} == {Outcome.COMPLETED}


async def test_a_stopping_node_gives_its_work_to_another(redis_server, prefix):
    async with Fleet(make_policy(redis_server.url, prefix), engines=2, seqs=1) as fleet:
        first, second = fleet.engines
        async with asyncio.timeout(LIMIT_S):
            streams = [fleet.submit(max_tokens=200) for _ in range(2)]
            heads = await asyncio.gather(*(first_chunk(s) for s in streams))
            await first.stop(0.0)  # gives its item back at once, at its arrival
            answers = await asyncio.gather(*(read_all(s) for s in streams))
        # Each client got its whole answer once: the part it had, then the
        # rest from the re-run, nothing repeated, nothing missing.
        assert [h + text for h, (text, _) in zip(heads, answers)] == [filler_text(0, 200)] * 2
        assert {s.request.outcome for s in streams} == {Outcome.COMPLETED}
        assert first.completed == 0 and second.completed == 2
        fleet.engines = [second]


async def test_a_session_keeps_its_node_and_spills_only_while_that_node_is_full(
    redis_server, prefix
):
    async with Fleet(make_policy(redis_server.url, prefix), engines=2, seqs=1) as fleet:
        store = fleet.backend.store
        async with asyncio.timeout(LIMIT_S):
            # Whichever node takes `filler` is full, so the session's first
            # request, and with it the session, goes to the other one.
            filler = fleet.submit(max_tokens=5000)
            await first_chunk(filler)
            [busy] = [e for e in fleet.engines if e.status()["running"]]
            [home] = [e for e in fleet.engines if e is not busy]
            await read_all(fleet.submit(session="chat-1"))
            assert await store.bound_node("session:chat-1") == home.node
            await filler.aclose()
            await chores(fleet)
            # Both nodes idle and woken alike: the session's turns go home.
            for _ in range(4):
                await read_all(fleet.submit(session="chat-1"))
            await runs_done(home)
            assert (home.completed, busy.completed) == (5, 0)
            assert home.status()["affinity"] == {"home": 4, "away": 0, "new": 1}
            # Home full: the next turn runs on the other node, and the
            # session stays bound to home.
            long_turn = fleet.submit(max_tokens=5000, session="chat-1")
            await first_chunk(long_turn)
            assert home.status()["running"] == 1
            assert await read_all(fleet.submit(session="chat-1")) == (filler_text(0, 8), 8)
            await runs_done(busy)
            assert busy.completed == 1
            assert busy.status()["affinity"] == {"home": 0, "away": 1, "new": 0}
            assert await store.bound_node("session:chat-1") == home.node
            await long_turn.aclose()


async def test_tenants_of_a_tier_share_the_fleet_by_service_not_arrival(redis_server, prefix):
    # In a delay tier; one with a latency objective goes by arrival (below).
    policy = make_policy(redis_server.url, prefix)
    assert policy.scheduler.fairness == "vtc"
    async with Fleet(policy, engines=1, seqs=1) as fleet:
        store = fleet.backend.store
        async with asyncio.timeout(LIMIT_S), Enqueues(fleet) as enqueues:
            filler = fleet.submit(tier="batch", max_tokens=5000, tenant="a")
            await first_chunk(filler)
            queued = [fleet.submit(tier="batch", tenant="a") for _ in range(4)]
            queued.append(fleet.submit(tier="batch", tenant="b"))
            order: list[str] = []

            async def read(stream: RequestStream, tenant: str) -> None:
                await read_all(stream)
                order.append(tenant)

            readers = [
                asyncio.ensure_future(read(s, t)) for s, t in zip(queued, "aaaab", strict=True)
            ]
            await enqueues.wait(6)
            await filler.aclose()
            await asyncio.gather(*readers)
        # One slot, so they ran in this order. a's first waiting request
        # goes first (b is lifted to a's counter and the tie goes by name);
        # then b, which has had no service, before a's other three.
        assert order == ["a", "b", "a", "a", "a"]
        counters = await store.counters("batch")
        assert counters["a"] > counters["b"] > 0


async def test_a_replicas_metrics_show_the_fleet_queue_read_from_redis(redis_server, prefix):
    policy = make_policy(redis_server.url, prefix)
    async with Fleet(policy, engines=1, seqs=1) as fleet:
        server = TestServer(build_app(fleet.gateway, policy, environ={}))
        await server.start_server()
        readers: list[asyncio.Future[Any]] = []
        try:
            async with asyncio.timeout(LIMIT_S), Enqueues(fleet) as enqueues:
                held = fleet.submit(max_tokens=5000)
                await first_chunk(held)
                queued = [fleet.submit(), fleet.submit(), fleet.submit(tier="batch")]
                readers = [asyncio.ensure_future(read_all(s)) for s in queued]
                await enqueues.wait(4)
                async with aiohttp.ClientSession() as http:
                    async with http.get(str(server.make_url("/metrics"))) as response:
                        assert response.status == 200
                        text = await response.text()
            samples = {
                (s.name, s.labels.get("tier")): s.value
                for family in text_string_to_metric_families(text)
                for s in family.samples
                if s.name in ("qosgate_fleet_queue_depth", "qosgate_fleet_running")
            }
            # Only the held one has been started by a node, and has its wait.
            waits = [
                (s.name, s.labels.get("tier"), s.labels.get("model"), s.value)
                for family in text_string_to_metric_families(text)
                for s in family.samples
                if s.name == "qosgate_fleet_queue_wait_seconds_count"
            ]
            assert waits == [
                ("qosgate_fleet_queue_wait_seconds_count", "interactive", "sim-llama3-8b", 1.0)
            ]
            # The replica's own queue is empty: everything waits in Redis.
            assert samples == {
                ("qosgate_fleet_queue_depth", "interactive"): 2.0,
                ("qosgate_fleet_queue_depth", "batch"): 1.0,
                ("qosgate_fleet_running", None): 1.0,
            }
            assert "qosgate_queue_depth" not in {
                s.name for f in text_string_to_metric_families(text) for s in f.samples
                if s.value > 0
            }
        finally:
            for reader in readers:
                reader.cancel()
            await asyncio.gather(*readers, return_exceptions=True)
            await server.close()


async def test_the_run_of_a_replica_that_crashed_stops_at_the_next_renewal(
    redis_server, prefix, monkeypatch
):
    # The replica holding the client dies mid-stream (OOM-killed, its host
    # lost): nobody can receive the output, so the node stops generating it
    # instead of filling a sequence slot for nobody until the end.
    def no_store(_: Any) -> None:
        raise AssertionError("a memory quota store died with its replica: nothing to release")

    monkeypatch.setattr(engine_module, "build_store", no_store)
    async with Fleet(make_policy(redis_server.url, prefix), engines=1) as fleet:
        engine = fleet.engines[0]
        store = fleet.backend.store
        async with asyncio.timeout(LIMIT_S):
            stream = fleet.submit(max_tokens=5000)
            await first_chunk(stream)
            item_id = stream.request.id
            assert engine.status()["running"] == 1
            await crash(fleet.backend)
            await ended(engine, item_id)
            assert engine.status()["running"] == 0
            assert engine.completed == 0, "it ran to its end for nobody"
            assert engine.orphaned == 1
            assert engine.backend.capacity().free_slots == 2
            # Ended in the store too: no other node takes it over and runs it
            # again once the lease would have run out.
            assert await store.status(item_id) == "completed"
            assert await store.leased() == 0


async def test_an_item_queued_by_a_replica_that_crashed_is_dropped_when_claimed(
    redis_server, prefix
):
    policy = make_policy(redis_server.url, prefix)
    assert policy.fleet is not None
    async with Fleet(policy, engines=1, seqs=1) as fleet:
        engine = fleet.engines[0]
        store = fleet.backend.store
        other = FleetBackend(
            policy, policy.fleet.model_copy(update={"node_id": "gw2"}),
            models=("sim-llama3-8b",), count_prompt_tokens=lambda e, b: 8,
        )  # fmt: skip
        doomed = Gateway(policy, other)
        await doomed.start()
        restarted = FleetBackend(
            policy, policy.fleet.model_copy(update={"node_id": "gw2"}),
            models=("sim-llama3-8b",), count_prompt_tokens=lambda e, b: 8,
        )  # fmt: skip
        started = record_starts(engine)
        reader: asyncio.Future[Any] | None = None
        try:
            async with asyncio.timeout(LIMIT_S), Enqueues(fleet) as enqueues:
                running = fleet.submit(max_tokens=400)
                await first_chunk(running)
                assert await started.get() == running.request.id
                orphan = doomed.submit(
                    request_id=uuid.uuid4().hex, tenant="t", tier="interactive",
                    endpoint="chat", body={"model": "sim-llama3-8b", "messages": []},
                    prompt_tokens=8, max_tokens=400,
                )  # fmt: skip
                reader = asyncio.ensure_future(read_all(orphan))
                await enqueues.wait(2)
                assert await store.status(orphan.request.id) == "queued"
                await crash(other)
                # Restarted under the same name (a fixed node_id, a pod that kept
                # its name), it waits for none of what its old self queued.
                await restarted.start()
                # The node's one slot frees, and it claims the dead replica's item.
                await running.aclose()
                assert await started.get() == orphan.request.id
                await ended(engine, orphan.request.id)
            assert engine.completed == 0, "it ran to its end for nobody"
            assert engine.orphaned == 1
            assert await store.status(orphan.request.id) == "completed"
            assert await store.leased() == 0
            assert engine.backend.capacity().free_slots == 1
        finally:
            if reader is not None:
                reader.cancel()
                await asyncio.gather(reader, return_exceptions=True)
            await doomed.close()
            await restarted.close()


async def test_a_dropped_item_of_a_replica_that_crashed_gives_its_quota_slot_back(
    redis_server, prefix
):
    # The tenant's one slot is held by a request queued on a replica that
    # then dies: once the node drops the item, the surviving replica admits
    # the tenant again, long before the quota lease (30 s) would run out.
    policy = make_policy(
        redis_server.url, prefix,
        tenants=[{"id": "t", "tier": "interactive", "quotas": {"max_concurrency": 1}}],
        quota_store={"kind": "redis", "url": redis_server.url, "key_prefix": prefix},
    )  # fmt: skip
    async with Fleet(policy, engines=1, seqs=1) as fleet:
        engine = fleet.engines[0]
        released = record_releases(engine)
        doomed = second_replica(policy)
        await doomed.start()
        reader: asyncio.Future[Any] | None = None
        try:
            async with asyncio.timeout(LIMIT_S), Enqueues(fleet) as enqueues:
                running = fleet.submit(max_tokens=400, tenant="u")
                await first_chunk(running)
                request_id = uuid.uuid4().hex
                held = await doomed.quotas.reserve("t", 16, request_id)
                assert held is not None and held.admitted
                orphan = doomed.submit(
                    request_id=request_id, tenant="t", tier="interactive", endpoint="chat",
                    body={"model": "sim-llama3-8b", "messages": []},
                    prompt_tokens=8, max_tokens=8, reservation=held.reservation,
                )  # fmt: skip
                reader = asyncio.ensure_future(read_all(orphan))
                await enqueues.wait(2)
                refused = await fleet.gateway.quotas.reserve("t", 16, uuid.uuid4().hex)
                assert refused is not None and not refused.admitted
                await crash(doomed.backend)  # type: ignore[arg-type]
                # The node's one slot frees, and it claims the dead replica's item.
                await running.aclose()
                assert await released.get() == {"t": [request_id]}
                again = await fleet.gateway.quotas.reserve("t", 16, uuid.uuid4().hex)
                assert again is not None and again.admitted, again.reason
            assert engine.orphaned == 1
            assert engine.completed == 0
        finally:
            if reader is not None:
                reader.cancel()
                await asyncio.gather(reader, return_exceptions=True)
            await doomed.close()


async def test_a_quota_release_that_fails_leaves_the_node_serving(redis_server, prefix, caplog):
    # The quota store's Redis is down: the run of the dead replica is still
    # stopped, the failure is logged (its slot comes back when its lease runs
    # out), and the node goes on taking work.
    policy = make_policy(redis_server.url, prefix, quota_store={
        "kind": "redis", "url": f"redis://127.0.0.1:{free_port()}/0", "timeout_ms": 200,
    })  # fmt: skip
    async with Fleet(policy, engines=1) as fleet:
        engine = fleet.engines[0]
        released = record_releases(engine)
        survivor = second_replica(policy)
        await survivor.start()
        try:
            async with asyncio.timeout(LIMIT_S):
                stream = fleet.submit(max_tokens=5000)
                await first_chunk(stream)
                await crash(fleet.backend)
                assert await released.get() == {"t": [stream.request.id]}
                assert "could not release the quota slots of 1 stopped runs" in caplog.text
                assert engine.orphaned == 1
                answer = survivor.submit(
                    request_id=uuid.uuid4().hex, tenant="t", tier="interactive",
                    endpoint="chat", body={"model": "sim-llama3-8b", "messages": []},
                    prompt_tokens=8, max_tokens=8,
                )  # fmt: skip
                assert await read_all(answer) == (filler_text(0, 8), 8)
            assert engine.completed == 1
        finally:
            await survivor.close()


async def test_a_client_gone_while_its_item_waits_in_redis_is_not_charged(redis_server, prefix):
    # As on one node (docs/QUOTAS.md): cancelled while queued is refunded in
    # full; once a node has started the request, its prompt is charged.
    policy = make_policy(redis_server.url, prefix, tenants=[
        {"id": "t", "tier": "interactive", "quotas": {"tokens_per_minute": 1_000_000}},
    ])  # fmt: skip
    async with Fleet(policy, engines=1, seqs=1) as fleet:
        quotas = fleet.gateway.quotas

        async def submit(max_tokens: int) -> tuple[RequestStream, Any]:
            request_id = uuid.uuid4().hex
            decision = await quotas.reserve("t", 8 + max_tokens, request_id)
            assert decision is not None and decision.admitted
            stream = fleet.gateway.submit(
                request_id=request_id, tenant="t", tier="interactive", endpoint="chat",
                body={"model": "sim-llama3-8b", "messages": [], "stream": True},
                prompt_tokens=8, max_tokens=max_tokens, reservation=decision.reservation,
            )  # fmt: skip
            return stream, decision.reservation

        replies = fleet.backend.store.redis.pubsub()
        await replies.subscribe(fleet.backend.reply_channel)
        async with asyncio.timeout(LIMIT_S), Enqueues(fleet) as enqueues:
            running, held = await submit(400)
            await first_chunk(running)
            # The node said it started the run before it sent any output.
            async for message in replies.listen():
                if message["type"] == "message":
                    events = wire.decode_events(message["data"])
                    assert events[0][:3] == (running.request.id, events[0][1], wire.STARTED)
                    break
            await replies.aclose()
            queued, waited = await submit(8)
            reader = asyncio.ensure_future(read_all(queued))
            await enqueues.wait(2)
            reader.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await reader
            await running.aclose()
        assert queued.request.outcome is Outcome.CANCELLED
        assert (waited.settled, waited.charged) == (True, 0), "it never ran"
        assert fleet_waits(fleet) == 1, "only the one a node started waited its turn out"
        assert running.request.outcome is Outcome.CANCELLED
        assert held.settled and held.charged is not None and held.charged > 8


def test_a_message_keeps_its_events_when_one_is_of_a_kind_not_known_yet():
    # An engine node of a newer version may send a kind this replica does not
    # know; dropping the whole message would lose the output beside it.
    chunk = wire.chunk_event("a", 1, Chunk(text="x", tokens=1))
    started = wire.started_event("a", 1)
    later = ("a", 1, "a-later-kind", {"anything": 1})
    assert wire.decode_events(wire.encode_events([started, later, chunk])) == [started, chunk]
    # A broken event still breaks its message.
    with pytest.raises(ValueError):
        wire.decode_events(b'[["a", "1", "c", null]]')
    with pytest.raises(ValueError):
        wire.decode_events(b'[["a", 1, 7, null]]')


def test_the_end_of_an_item_whose_place_was_taken_is_an_error_event_older_replicas_read():
    # An error event as every replica parses it: a replica from before reads
    # its kind as a backend failure (docs/FLEET.md, "Upgrading a fleet").
    event = wire.pushed_out_event("a", "full", 5.0)
    assert wire.decode_events(wire.encode_events([event])) == [
        ("a", wire.LOCAL_TOKEN, wire.ERROR, ["overloaded", "full", 5.0])
    ]
    kind, message, *more = event[3]
    assert (kind, message, more) == ("overloaded", "full", [5.0])


def test_a_job_goes_on_the_wire_with_an_integer_past_64_bits_where_nothing_types_it():
    """Regression (schemathesis, through the openai backend): orjson cannot
    write such an integer, and a message's extra key may hold one; the job
    failed with 502 before it was queued."""
    message = {"role": "user", "content": "hi", "x": 10**30}
    job = GenerationJob(request_id="a", endpoint="chat", body={"messages": [message]},
                        prompt_tokens=1, max_tokens=1, priority=0)  # fmt: skip
    decoded, reply_to = wire.decode_job(wire.encode_job(job, "channel"))
    assert reply_to == "channel" and decoded.body["messages"][0]["x"] == 10**30


class _GatedPipelines:
    """The node's Redis client, whose pipelines wait at `execute` until let go:
    a test's way to act while a publish is on its way."""

    def __init__(self, redis: Any) -> None:
        self._redis = redis
        self.entered = asyncio.Event()
        self.release = asyncio.Event()

    def pipeline(self, **kwargs: Any) -> Any:
        gate = self
        pipe = self._redis.pipeline(**kwargs)
        execute = pipe.execute

        async def gated() -> Any:
            gate.entered.set()
            await gate.release.wait()
            return await execute()

        pipe.execute = gated
        return pipe


async def test_cancelling_a_run_as_it_ends_does_not_drop_other_runs_output(redis_server, prefix):
    # A run's last step publishes whatever output is pending for every
    # gateway. Its own gateway going away cancels it there; the other
    # gateways' output must still go out.
    async with Fleet(make_policy(redis_server.url, prefix), engines=1) as fleet:
        engine = fleet.engines[0]
        redis = fleet.backend.store.redis
        listener = redis.pubsub()
        await listener.subscribe("other-replica")
        gated = _GatedPipelines(redis)
        engine._outbox._redis = gated
        try:
            async with asyncio.timeout(LIMIT_S):
                theirs = wire.chunk_event("their-item", 1, Chunk(text="kept", tokens=1))
                engine._outbox.put("other-replica", theirs)
                ending = asyncio.ensure_future(engine._end(
                    None, "gone-replica", wire.error_event("my-item", 1, "backend_error", "x"),
                ))  # type: ignore[arg-type]  # fmt: skip
                await gated.entered.wait()
                ending.cancel()
                with contextlib.suppress(asyncio.CancelledError):
                    await ending
                gated.release.set()
                async for message in listener.listen():
                    if message["type"] == "message":
                        assert wire.decode_events(message["data"]) == [theirs]
                        break
        finally:
            gated.release.set()
            await listener.aclose()


async def test_replica_and_node_come_back_when_redis_does(own_redis_server, prefix):
    # Redis restarts (a failover, an upgrade): the requests in flight then end
    # with an error, and the fleet serves again once Redis is back, with no
    # process restarted.
    policy = make_policy(own_redis_server.url, prefix)
    async with Fleet(policy, engines=1) as fleet:
        changed = asyncio.Event()
        gateway_listener = fleet.backend._listener
        assert gateway_listener is not None

        def listener() -> None:
            gateway_listener()
            changed.set()

        async def until_ready(ready: bool) -> None:
            while fleet.backend.ready() != ready:
                changed.clear()
                await changed.wait()

        fleet.backend.set_capacity_listener(listener)
        async with asyncio.timeout(LIMIT_S):
            assert await read_all(fleet.submit(max_tokens=4)) == (filler_text(0, 4), 4)
            own_redis_server.stop()
            lost = fleet.submit(max_tokens=4)
            with pytest.raises(GatewayError):
                await read_all(lost)
            assert lost.request.outcome is Outcome.BACKEND_ERROR
            await until_ready(False)
            own_redis_server.start()
            # Queued at the replica until it is connected again, then run by
            # the node once it is too.
            again = [fleet.submit(max_tokens=4) for _ in range(2)]
            answers = await asyncio.gather(*(read_all(s) for s in again))
            assert fleet.backend.ready()
        assert answers == [(filler_text(0, 4), 4)] * 2
        assert {s.request.outcome for s in again} == {Outcome.COMPLETED}
        assert fleet.engines[0].ready()


async def test_a_replica_judges_requests_by_its_engines_backend(redis_server, prefix):
    """A replica validates requests against the engine nodes' backend, as one
    node does (the HTTP layer reads these two): what the simulated GPU cannot
    honour, and asks past its model's context, are the client's 400 before
    anything reaches Redis."""
    from qosgate.backends.support import SIM
    from qosgate.backends.sim_live import SIM_MAX_MODEL_LEN
    from qosgate.wiring import gateway_backend

    backend = gateway_backend(make_policy(redis_server.url, prefix))
    assert isinstance(backend, FleetBackend)
    assert backend.support is SIM
    assert backend.max_model_len == SIM_MAX_MODEL_LEN
    await backend.store.redis.aclose()


async def test_a_run_cancelled_before_it_starts_lets_its_item_go(redis_server, prefix):
    """A run's task cancelled in the claim's own step (a cancel, a
    preemption, a lost lease) never starts: its item is let go all the same,
    not renewed forever, and its work is not left unawaited."""
    import gc
    import warnings

    policy = make_policy(redis_server.url, prefix)
    assert policy.fleet is not None
    node = EngineNode(
        policy, policy.fleet.model_copy(update={"node_id": "e0", "role": "engine"}),
        SimBackend(policy.backend),
    )  # fmt: skip
    ran: list[str] = []

    async def work() -> None:
        ran.append("x")

    node._leases["x"] = None  # type: ignore[assignment]
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        node._hold("x", work())
        task = node._runs["x"]
        task.cancel()
        # Its done callbacks run in order: the letting go first.
        await asyncio.gather(task, return_exceptions=True)
        gc.collect()
    assert ran == [] and task.cancelled()
    assert "x" not in node._runs and "x" not in node._leases
    assert not [w for w in caught if "never awaited" in str(w.message)]
    await node.store.close()


@pytest.mark.parametrize("policy_kind", ["qos", "strict"])
async def test_an_engine_node_keeps_slots_for_its_top_levels_expected_arrivals(
    redis_server, prefix, policy_kind
):
    """Under qos a node keeps free, over its own runs, the slots its top-level
    arrivals are expected to need before those runs end (core.arrivals_hold),
    which its claims add to the reserve; strict keeps none. The backend's
    report that a slot is free counts before the run's end reaches the node."""
    report = {"free": 6}

    class EightSlots(SimBackend):
        def capacity(self) -> BackendCapacity:
            return BackendCapacity(report["free"], 1 << 30, None, 8)

    policy = make_policy(redis_server.url, prefix, scheduler={"policy": policy_kind},
                         max_queue_wait_ms=300)  # fmt: skip
    assert policy.fleet is not None
    node = EngineNode(policy, policy.fleet.model_copy(update={"node_id": "e0", "role": "engine"}),
                      EightSlots(policy.backend))  # fmt: skip
    try:
        now = asyncio.get_running_loop().time()
        node._started.update({"a": now - 2.0, "b": now - 2.0})
        if policy_kind == "strict":
            assert node._arrivals_hold is None and node._held_for_arrivals() == 0
            return
        hold = node._arrivals_hold
        assert hold is not None
        assert node._held_for_arrivals() == 0  # nothing measured yet
        for i in range(50):  # top-level work at 5 a second, each run held 6 s
            hold.arrived(now - 10.0 + 0.2 * i)
            hold.ended(now - 10.0 + 0.2 * i, now - 16.0 + 0.2 * i)
        # The two runs end in 4 s: more arrivals come by then than half the
        # node's 8 slots, the most kept by default.
        assert expected_arrivals(5.0, 4.0 - 0.3) > 4
        assert node._held_for_arrivals() == 4
        # The backend says both runs' slots are free already: no end is
        # ahead to wait for, and one slot is kept for an arrival now.
        report["free"] = 8
        assert node._held_for_arrivals() == 1
    finally:
        await node.store.close()


@pytest.mark.parametrize(("policy_kind", "held"), [("qos", 3), ("strict", 3), ("fcfs", 0)])
async def test_an_engine_node_tells_its_backend_what_its_reserve_holds(
    redis_server, prefix, policy_kind, held
):
    """A node's claims keep `scheduler.reserve.slots` free for top-level work,
    as one gateway does (fcfs has no reserve): a backend that learns its room
    from what is used (an upstream's) must count them as used."""
    told: list[int] = []

    class Told(SimBackend):
        def hold_room(self, slots: int) -> None:
            told.append(slots)

    policy = make_policy(redis_server.url, prefix,
                         scheduler={"policy": policy_kind, "reserve": {"slots": 3}})
    assert policy.fleet is not None
    node = EngineNode(
        policy, policy.fleet.model_copy(update={"node_id": "e0", "role": "engine"}),
        Told(policy.backend),
    )  # fmt: skip
    assert told == [held]
    # Its slots kept for expected arrivals count the reserve's as one
    # node's scheduler does (core.arrivals_hold).
    hold = node._arrivals_hold
    assert (hold.reserve if hold is not None else None) == (3 if policy_kind == "qos" else None)
    await node.store.close()
