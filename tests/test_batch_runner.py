"""The batch runner over a real gateway and a scripted backend: a job holds
no more lines than its bound, waits out refusals and comes back, records a
line's result before its quota settles, expires on its window (the wall
clock is the test's), and a service stopped mid-job resumes on its data
directory with every line once. Nothing sleeps: tests wait on the job's
end or on events the backend and the store set."""

from __future__ import annotations

import asyncio
import json
from collections.abc import AsyncIterator, Callable
from pathlib import Path
from typing import Any

import pytest
from http_support import MODEL, ScriptedBackend, words

from qosgate.backends.base import Chunk, GenerationJob
from qosgate.batch.runner import BatchService
from qosgate.batch.sqlite_store import SqliteBatchStore
from qosgate.batch.store import BatchRecord, LineResult
from qosgate.config.models import PolicyConfig
from qosgate.runtime.ask import Ask
from qosgate.runtime.errors import BatchStoreUnavailable, Overloaded, QuotaExceeded
from qosgate.runtime.gate import Gateway, RequestStream

TENANT = "t"
PROMPT_TOKENS = 5  # what ScriptedBackend counts for every prompt


class Clock:
    def __init__(self) -> None:
        self.now = 1_800_000_000.0

    def __call__(self) -> float:
        return self.now


def _policy(in_flight: int, *, limit: int | None = None, waiting: int = 16) -> PolicyConfig:
    quotas = {"tokens_per_minute": limit} if limit else {}
    return PolicyConfig.model_validate({
        "backend": {"kind": "sim", "model": MODEL},
        "tiers": {"interactive": {"priority": 0},
                  "bulk": {"priority": 3, "on_timeout": "delay", "max_queue_wait_ms": 60000}},
        "tenants": [{"id": TENANT, "tier": "interactive", "quotas": quotas}],
        "batch": {"in_flight_per_job": in_flight, "waiting_per_job": waiting,
                  "retry_initial_s": 0.05, "retry_max_s": 1},
    })  # fmt: skip


def _line(i: int, max_tokens: int = 8) -> bytes:
    return json.dumps({
        "custom_id": f"c{i}", "method": "POST", "url": "/v1/completions",
        "body": {"model": MODEL, "prompt": f"p{i}", "max_tokens": max_tokens},
    }).encode() + b"\n"  # fmt: skip


class ScriptedGateway(Gateway):
    """Refuses the tries `refusals` names (custom prompt -> errors to raise,
    one per try) and notes when each try came."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.refusals: dict[str, list[Exception]] = {}
        self.tries: dict[str, list[float]] = {}

    async def admit(self, ask: Ask, **kwargs: Any) -> RequestStream:
        prompt = ask.body["prompt"]
        self.tries.setdefault(prompt, []).append(asyncio.get_running_loop().time())
        planned = self.refusals.get(prompt)
        if planned:
            raise planned.pop(0)
        return await super().admit(ask, **kwargs)


async def _service(
    tmp_path: Path, policy: PolicyConfig, backend: ScriptedBackend, *,
    clock: Callable[[], float] = Clock(), store: SqliteBatchStore | None = None,
) -> BatchService:  # fmt: skip
    gateway = ScriptedGateway(policy, backend)
    await gateway.start()
    service = BatchService(gateway, lambda: policy, store or SqliteBatchStore(tmp_path),
                           clock=clock)  # fmt: skip
    await service.start()
    return service


async def _submit(service: BatchService, lines: list[bytes], window: str = "24h") -> BatchRecord:
    async def chunks() -> AsyncIterator[bytes]:
        for line in lines:
            yield line

    part, size = await service.receive(chunks())
    uploaded = await service.add_file(TENANT, "in.jsonl", "batch", part, size)
    return await service.create(TENANT, "interactive", uploaded.id, "/v1/completions", window,
                                None)  # fmt: skip


def _results(service: BatchService, batch_id: str) -> AsyncIterator[LineResult]:
    return service.store.results(batch_id)


async def _close(service: BatchService) -> None:
    await service.stop()
    await service.gateway.close()


async def test_a_job_holds_at_most_its_bound_of_lines(tmp_path: Path) -> None:
    gate = asyncio.Event()
    running = asyncio.Event()
    backend: ScriptedBackend

    async def held(job: GenerationJob) -> AsyncIterator[Chunk]:
        if backend._running >= 3:
            running.set()
        await gate.wait()
        async for chunk in words(job, 2):
            yield chunk

    backend = ScriptedBackend(held, free_slots=16)
    service = await _service(tmp_path, _policy(3), backend)
    batch = await _submit(service, [_line(i) for i in range(20)])
    await running.wait()
    # Held by the backend, the job has taken its three and no more.
    assert len(backend.jobs) == 3
    assert {job.tier for job in backend.jobs} == {"bulk"}  # the policy's delay tier
    jobs, queued = service.levels()  # what the metrics show
    assert jobs["in_progress"] == 1 and sum(jobs.values()) == 1 and queued == {TENANT: 20}
    gate.set()
    await service.wait(batch.id)
    ended = await service.batch(TENANT, batch.id)
    assert (ended.status, ended.completed, ended.failed) == ("completed", 20, 0)
    assert len(backend.jobs) == 20
    jobs, queued = service.levels()
    assert jobs["completed"] == 1 and sum(jobs.values()) == 1 and queued == {}
    await _close(service)


async def test_a_job_fills_every_free_slot_and_keeps_its_few_waiting(tmp_path: Path) -> None:
    # Four slots; each line answers its first token, then holds its slot.
    gate = asyncio.Event()
    answering = asyncio.Event()
    first_outputs = 0

    async def held(job: GenerationJob) -> AsyncIterator[Chunk]:
        nonlocal first_outputs
        yield Chunk(text="first ", tokens=1)
        first_outputs += 1
        if first_outputs == 4:
            answering.set()
        await gate.wait()
        yield Chunk(text="last", tokens=1, finish_reason="length")

    backend = ScriptedBackend(held, free_slots=4)
    service = await _service(tmp_path, _policy(100, waiting=2), backend)
    batch = await _submit(service, [_line(i) for i in range(20)])
    await answering.wait()
    tries = service.gateway.tries  # type: ignore[attr-defined]
    # Let whatever the four first outputs set going run its course.
    for _ in range(50):
        await asyncio.sleep(0)
    # Every slot is taken, and behind them only the two the job may keep
    # waiting: not the 100 its in-flight bound would allow.
    assert len(backend.jobs) == 4
    assert service.gateway.scheduler.queued_count == 2
    assert len(tries) == 6
    gate.set()
    await service.wait(batch.id)
    ended = await service.batch(TENANT, batch.id)
    assert (ended.status, ended.completed, ended.failed) == ("completed", 20, 0)
    await _close(service)


async def test_refused_lines_wait_their_backoff_and_come_back(tmp_path: Path) -> None:
    service = await _service(tmp_path, _policy(4), ScriptedBackend(words))
    gateway = service.gateway
    assert isinstance(gateway, ScriptedGateway)
    gateway.refusals = {
        "p1": [Overloaded("busy"), Overloaded("busy")],
        "p2": [QuotaExceeded("later", retry_after_s=0.2)],
        "p3": [QuotaExceeded("the request alone is over the limit")],  # no wait can help
    }
    batch = await _submit(service, [_line(i) for i in range(5)])
    await service.wait(batch.id)
    ended = await service.batch(TENANT, batch.id)
    assert (ended.completed, ended.failed) == (4, 1)
    first, second, third = gateway.tries["p1"]
    assert second - first >= 0.05 and third - second >= 0.1  # doubling from retry_initial_s
    retried = gateway.tries["p2"]
    assert len(retried) == 2 and retried[1] - retried[0] >= 0.2  # its Retry-After
    failed = [r async for r in _results(service, batch.id) if not r.ok]
    assert [r.custom_id for r in failed] == ["c3"]
    line = json.loads(failed[0].text)
    assert line["response"]["status_code"] == 429
    assert line["response"]["body"]["error"]["code"] == "rate_limit_exceeded"
    await _close(service)


class WatchedStore(SqliteBatchStore):
    """Reads the tenant's quota use each time a result is recorded."""

    def __init__(self, path: Path) -> None:
        super().__init__(path)
        self.gateway: Gateway | None = None
        self.used_at_record: list[int] = []
        self.recorded_count = 0
        self.reached = asyncio.Event()
        self.reach = 0

    async def record(self, batch_id: str, result: LineResult) -> None:
        assert self.gateway is not None
        for state in await self.gateway.quotas.usage(TENANT):
            self.used_at_record.append(state.used)
        await super().record(batch_id, result)
        self.recorded_count += 1
        if self.recorded_count >= self.reach:
            self.reached.set()


async def test_a_result_is_recorded_before_its_quota_settles(tmp_path: Path) -> None:
    async def three(job: GenerationJob) -> AsyncIterator[Chunk]:
        async for chunk in words(job, 3):
            yield chunk

    store = WatchedStore(tmp_path)
    service = await _service(tmp_path, _policy(1, limit=10**6), ScriptedBackend(three),
                             store=store)  # fmt: skip
    store.gateway = service.gateway
    batch = await _submit(service, [_line(i, max_tokens=8) for i in range(6)])
    await service.wait(batch.id)
    reserved, charged = PROMPT_TOKENS + 8, PROMPT_TOKENS + 3
    # One line at a time: when each is recorded, those before it are settled
    # and it still holds its whole reservation.
    assert store.used_at_record == [charged * k + reserved for k in range(6)]
    (state,) = await service.gateway.quotas.usage(TENANT)
    assert state.used == charged * 6
    assert [r.tokens async for r in _results(service, batch.id)] == [charged] * 6
    await _close(service)


class BlinkingStore(SqliteBatchStore):
    """Fails the first try to record each line in `blink`, as a shared
    store that stops answering for a moment does."""

    def __init__(self, path: Path, blink: set[str]) -> None:
        super().__init__(path)
        self.blink = set(blink)

    async def record(self, batch_id: str, result: LineResult) -> None:
        if result.custom_id in self.blink:
            self.blink.discard(result.custom_id)
            raise BatchStoreUnavailable("the store did not answer")
        await super().record(batch_id, result)


async def test_a_result_the_store_could_not_record_runs_again_and_is_charged_once(
    tmp_path: Path,
) -> None:
    async def three(job: GenerationJob) -> AsyncIterator[Chunk]:
        async for chunk in words(job, 3):
            yield chunk

    store = BlinkingStore(tmp_path, {"c1", "c3"})
    service = await _service(tmp_path, _policy(2, limit=10**6), ScriptedBackend(three),
                             store=store)  # fmt: skip
    batch = await _submit(service, [_line(i) for i in range(5)])
    await service.wait(batch.id)
    ended = await service.batch(TENANT, batch.id)
    assert (ended.status, ended.completed, ended.failed) == ("completed", 5, 0)
    results = [r async for r in _results(service, batch.id)]
    assert sorted(r.custom_id for r in results) == [f"c{i}" for i in range(5)]
    gateway = service.gateway
    assert isinstance(gateway, ScriptedGateway)
    assert [len(gateway.tries[f"p{i}"]) for i in range(5)] == [1, 2, 1, 2, 1]
    # The try whose result was lost is refunded: each line is charged once.
    (state,) = await gateway.quotas.usage(TENANT)
    assert state.used == (PROMPT_TOKENS + 3) * 5
    await _close(service)


async def test_a_window_gone_by_expires_what_is_left(tmp_path: Path) -> None:
    clock = Clock()
    service = await _service(tmp_path, _policy(2), ScriptedBackend(words), clock=clock)
    batch = await _submit(service, [_line(i) for i in range(10)], window="1h")
    assert batch.expires_at == int(clock.now) + 3600
    clock.now += 7200  # the job first looks at the clock past its window
    await service.wait(batch.id)
    ended = await service.batch(TENANT, batch.id)
    assert (ended.status, ended.completed, ended.failed) == ("expired", 0, 10)
    assert ended.times["expired_at"] == int(clock.now)
    lines = [json.loads(r.text) async for r in _results(service, batch.id)]
    assert [line["custom_id"] for line in lines] == [f"c{i}" for i in range(10)]
    assert {line["error"]["code"] for line in lines} == {"batch_expired"}
    assert all(line["response"] is None for line in lines)
    await _close(service)


@pytest.mark.parametrize("limit", [None, 10**6])
async def test_a_stopped_service_resumes_every_line_once(tmp_path: Path, limit: int | None) -> None:
    async def first_half(job: GenerationJob) -> AsyncIterator[Chunk]:
        if int(job.body["prompt"][1:]) >= 5:
            await asyncio.Event().wait()  # until the stop cuts it off
        async for chunk in words(job, 2):
            yield chunk

    store = WatchedStore(tmp_path)
    store.reach = 5
    policy = _policy(3, limit=limit)
    service = await _service(tmp_path, policy, ScriptedBackend(first_half), store=store)
    store.gateway = service.gateway
    batch = await _submit(service, [_line(i) for i in range(12)])
    await store.reached.wait()
    await _close(service)
    if limit is not None:
        # What was cut off was refunded; what was recorded stays charged.
        (state,) = await service.gateway.quotas.usage(TENANT)
        assert state.used == 5 * (PROMPT_TOKENS + 2)

    again = await _service(tmp_path, policy, ScriptedBackend(words))
    await again.wait(batch.id)
    assert await again.store.journal(batch.id) == []  # each try settled, then let go
    ended = await again.batch(TENANT, batch.id)
    assert (ended.status, ended.completed, ended.failed) == ("completed", 12, 0)
    assert sorted([r.custom_id async for r in _results(again, batch.id)]) == sorted(
        f"c{i}" for i in range(12)
    )
    gateway = again.gateway
    assert isinstance(gateway, ScriptedGateway)
    assert sorted(gateway.tries) == sorted(f"p{i}" for i in range(5, 12))
    await _close(again)
