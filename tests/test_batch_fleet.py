"""Gateway replicas sharing their batches: two batch services, each over its
own gateway and backend, on one real redis-server and one files directory.
Either answers for any job; the one holding a job's lease drives it, and
only that one (its backend alone runs the lines); a cancel asked on the
other reaches it; a replica that stops, or finds its lease taken, lets the
job go and the other finishes it with every line once. A driver's writes
after its lease is gone are refused by the store itself.

Nothing sleeps: the tests wait on the jobs' ends, on events the backends
and the stores set, and on the lease timer's rounds."""

from __future__ import annotations

import asyncio
import uuid
from collections.abc import AsyncIterator, Callable
from pathlib import Path

import orjson
import pytest
import redis.asyncio as aioredis
from http_support import ScriptedBackend, words
from test_batch_runner import TENANT, ScriptedGateway, _line, _policy, _submit

from qosgate.backends.base import Chunk, GenerationJob
from qosgate.batch.redis_store import RedisBatchStore
from qosgate.batch.runner import BatchService
from qosgate.batch.store import BatchRecord, LeaseLost, LineResult
from qosgate.runtime.errors import BatchNotCancellable, BatchStoreUnavailable

LEASE_S = 0.6
"""Short, so that a takeover comes within a second; renewed every 0.2 s."""
LIMIT_S = 20.0
LINES = 12


class WatchedStore(RedisBatchStore):
    """Counts its lease timer's rounds (each looks for jobs to take over)."""

    def __init__(self, *args: object, **kwargs: object) -> None:
        super().__init__(*args, **kwargs)  # type: ignore[arg-type]
        self.rounds = 0
        self.round = asyncio.Event()

    async def take(self, exclude: set[str]) -> list[BatchRecord]:
        taken = await super().take(exclude)
        self.rounds += 1
        self.round.set()
        return taken

    async def rounds_pass(self, count: int) -> None:
        """Until `count` more rounds have ended."""
        target = self.rounds + count
        while self.rounds < target:
            self.round.clear()
            await self.round.wait()


class Replica:
    def __init__(self, service: BatchService, backend: ScriptedBackend) -> None:
        self.service = service
        self.backend = backend
        store = service.store
        assert isinstance(store, WatchedStore)
        self.store = store

    def ran(self) -> list[str]:
        """The prompts its backend was given."""
        return [job.body["prompt"] for job in self.backend.jobs]


@pytest.fixture
async def replicas(redis_server, tmp_path: Path) -> AsyncIterator[
    Callable[..., object]
]:  # fmt: skip
    prefix = f"batch-fleet-{uuid.uuid4().hex[:8]}:"
    started: list[Replica] = []

    async def start(name: str, script=words, *, in_flight: int = 4,
                    store_class: type[WatchedStore] = WatchedStore) -> Replica:  # fmt: skip
        policy = _policy(in_flight)
        backend = ScriptedBackend(script, free_slots=16)
        gateway = ScriptedGateway(policy, backend)
        await gateway.start()
        store = store_class(redis_server.url, tmp_path / "files", key_prefix=prefix,
                            owner=name, lease_s=LEASE_S)  # fmt: skip
        service = BatchService(gateway, lambda: policy, store, leases=store)
        await service.start()
        replica = Replica(service, backend)
        started.append(replica)
        return replica

    yield start
    for replica in started:
        await replica.service.stop()
        await replica.service.gateway.close()


def _held_until(gate: asyncio.Event) -> Callable[[GenerationJob], AsyncIterator[Chunk]]:
    async def held(job: GenerationJob) -> AsyncIterator[Chunk]:
        await gate.wait()
        async for chunk in words(job, 2):
            yield chunk

    return held


async def _ids(replica: Replica, file_id: str | None) -> list[str]:
    if file_id is None:
        return []
    record = await replica.service.file(TENANT, file_id)
    text = replica.service.file_path(record).read_bytes()
    return [orjson.loads(line)["custom_id"] for line in text.splitlines()]


async def _a_job_on_a(replicas) -> tuple[asyncio.Event, Replica, Replica, BatchRecord]:
    """Replicas a and b, and a job created on a whose lines wait for the gate."""
    gate = asyncio.Event()
    a = await replicas("a", _held_until(gate))
    b = await replicas("b")
    return gate, a, b, await _submit(a.service, [_line(i) for i in range(LINES)])


async def _completed_once(replica: Replica, batch_id: str) -> None:
    """The job completed, as `replica` reads it: every line in its output once."""
    ended = await replica.service.batch(TENANT, batch_id)
    assert (ended.status, ended.completed, ended.failed) == ("completed", LINES, 0)
    ids = await _ids(replica, ended.output_file_id)
    assert sorted(ids) == sorted(f"c{i}" for i in range(LINES))


async def test_either_replica_answers_and_only_one_drives(replicas) -> None:
    gate, a, b, batch = await _a_job_on_a(replicas)

    # B sees the job, its input and its progress while A drives it, and its
    # timer looks for jobs to take without taking this one.
    await b.store.rounds_pass(3)
    seen = await b.service.batch(TENANT, batch.id)
    assert seen.status == "in_progress"
    assert [r.id for r in await b.service.list(TENANT, None, 10)] == [batch.id]
    assert (await b.service.file(TENANT, batch.input_file_id)).lines == LINES
    gate.set()
    async with asyncio.timeout(LIMIT_S):
        await a.service.wait(batch.id)

    await _completed_once(b, batch.id)
    # One driver: A's backend ran every line once, B's none.
    assert (a.service.driven, b.service.driven) == (1, 0)
    assert sorted(a.ran()) == sorted(f"p{i}" for i in range(LINES))
    assert b.ran() == []


async def test_a_cancel_asked_on_another_replica_reaches_the_driver(replicas) -> None:
    gate, a, b, batch = await _a_job_on_a(replicas)

    asked = await b.service.cancel(TENANT, batch.id)
    assert asked.status == "cancelling"
    assert (await a.service.batch(TENANT, batch.id)).status == "cancelling"
    async with asyncio.timeout(LIMIT_S):
        await a.service.wait(batch.id)
    ended = await b.service.batch(TENANT, batch.id)
    assert ended.status == "cancelled"
    assert "cancelling_at" in ended.times and "cancelled_at" in ended.times
    assert ended.output_file_id is None
    assert sorted(await _ids(b, ended.error_file_id)) == sorted(f"c{i}" for i in range(LINES))
    with pytest.raises(BatchNotCancellable):
        await b.service.cancel(TENANT, batch.id)


async def test_a_replica_that_stops_hands_its_job_over(replicas) -> None:
    gate, a, b, batch = await _a_job_on_a(replicas)
    async with asyncio.timeout(LIMIT_S):
        while len(a.backend.jobs) < 4:  # its lines admitted, none answered
            await a.store.rounds_pass(1)
        await a.service.stop()  # cuts them off, lets the lease go
        await b.store.rounds_pass(1)
        await b.service.wait(batch.id)
    await _completed_once(b, batch.id)
    assert (a.service.driven, b.service.driven) == (1, 1)
    assert sorted(b.ran()) == sorted(f"p{i}" for i in range(LINES))


class BlinkAtFinalize(WatchedStore):
    """Does not answer the first time a job's status is to become
    `finalizing`, as a Redis that stops answering for a moment."""

    blinked = False

    async def save_batch(self, record: BatchRecord) -> None:
        if record.status == "finalizing" and not self.blinked:
            self.blinked = True
            raise BatchStoreUnavailable("the store did not answer")
        await super().save_batch(record)


async def test_a_job_the_store_fails_under_stops_and_is_taken_over_not_failed(replicas) -> None:
    a = await replicas("a", store_class=BlinkAtFinalize)
    batch = await _submit(a.service, [_line(i) for i in range(LINES)])
    async with asyncio.timeout(LIMIT_S):
        await a.service.wait(batch.id)  # the first run stops at the failed write
        assert a.store.blinked
        while (await a.service.batch(TENANT, batch.id)).status != "completed":
            await a.store.rounds_pass(1)
    await _completed_once(a, batch.id)
    assert a.service.driven == 2  # taken over by a lease round, here
    assert sorted(a.ran()) == sorted(f"p{i}" for i in range(LINES))  # no line ran twice


async def test_a_driver_whose_lease_is_taken_stops_and_the_holder_finishes(
    replicas, redis_server
) -> None:
    gate = asyncio.Event()
    a = await replicas("a", _held_until(gate))
    batch = await _submit(a.service, [_line(i) for i in range(LINES)])
    lease = a.store._key("lease", batch.id)
    async with asyncio.timeout(LIMIT_S):
        while len(a.backend.jobs) < 4:
            await a.store.rounds_pass(1)
        # As a replica that took the job over after A stalled past its lease.
        redis = aioredis.Redis.from_url(redis_server.url)
        await redis.set(lease, "thief:0", px=round(LEASE_S * 1000))
        await redis.aclose()
        await a.service.wait(batch.id)  # A's next renewal finds it lost
        assert a.service.driven == 1
        await a.service.stop()  # or, the thief's lease run out, A would take it back
        gate.set()
        # The thief never comes back: once its lease runs out, B takes over.
        b = await replicas("b")
        await b.store.rounds_pass(1)
        while b.service.driven == 0:
            await b.store.rounds_pass(1)
        await b.service.wait(batch.id)
    await _completed_once(b, batch.id)
    # What A had running was cut off, not recorded: B ran every line.
    assert sorted(b.ran()) == sorted(f"p{i}" for i in range(LINES))


async def test_a_driver_without_its_lease_cannot_write(redis_server, tmp_path: Path) -> None:
    prefix = f"batch-fence-{uuid.uuid4().hex[:8]}:"
    mine = RedisBatchStore(redis_server.url, tmp_path, key_prefix=prefix, owner="a")
    theirs = RedisBatchStore(redis_server.url, tmp_path, key_prefix=prefix, owner="b")
    await mine.open()
    await theirs.open()
    try:
        record = BatchRecord(
            id="batch_x", tenant=TENANT, tier="bulk", endpoint="/v1/completions",
            input_file_id="file-in", completion_window="24h", created_at=1, expires_at=2,
            total=1,
        )  # fmt: skip
        await mine.add_batch(record)
        assert await mine.acquire("batch_x")
        assert not await theirs.acquire("batch_x")
        assert await mine.renew(["batch_x"]) == {"batch_x": 0}
        await mine.line_sent("batch_x", 1, "r1", TENANT)
        # Taken over: the lease ran out and another replica holds it now.
        await mine.redis.delete(mine._key("lease", "batch_x"))
        assert await theirs.acquire("batch_x")
        assert await mine.renew(["batch_x"]) == {"batch_x": None}
        with pytest.raises(LeaseLost):
            await mine.record("batch_x", LineResult(1, "c1", True, "{}", 7, "r1"))
        with pytest.raises(LeaseLost):
            await mine.line_sent("batch_x", 1, "r2", TENANT)
        with pytest.raises(LeaseLost):
            await mine.save_batch(record)
        await mine.release("batch_x")  # not its to end
        assert await theirs.renew(["batch_x"]) == {"batch_x": 0}
        await theirs.record("batch_x", LineResult(1, "c1", True, "{}", 7, "r1"))
        assert (await theirs.get_batch(TENANT, "batch_x")).completed == 1  # type: ignore[union-attr]
        # A cancel asked anywhere: read as cancelling, and its driver hears of it.
        assert await mine.request_cancel("batch_x", 42)
        assert (await mine.get_batch(TENANT, "batch_x")).status == "cancelling"  # type: ignore[union-attr]
        assert await theirs.renew(["batch_x"]) == {"batch_x": 42}
    finally:
        await mine.close()
        await theirs.close()
