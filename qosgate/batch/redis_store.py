"""A `BatchStore` in Redis, for gateways that share their batches: the
records and journals in Redis (as durable as its persistence: an append-only
file synced on every write for a journal that survives Redis too), the file
contents on a directory every replica mounts. It is also the `JobLeases`
that say which replica drives each job.

Every write that must be whole (a result with its counts; a status with the
counts by status) is one Lua script (in `lua/`), and so is every write a
driver makes for its job: it carries the job's lease, and lands only while
the lease is still the driver's (`lua/fence.lua`).

Keys, under `<prefix>batch:`: `seq` (the order of records), `file:<id>`,
`files:<tenant>`, `batch:<id>` (the record; `cancel_at` once a cancel was
asked), `batches:<tenant>`, `statuses`, `active`, `sent:<id>` (the journal),
`results:<id>` and `resultidx:<id>`, `lease:<id>` (the driver's token).
"""

from __future__ import annotations

import functools
import secrets
from collections.abc import AsyncIterator, Awaitable, Callable
from pathlib import Path
from typing import Any, TypeVar

import orjson
import redis.asyncio as aioredis

from qosgate.quotas.redis_client import (
    REDIS_FAILURES, connection_pool, failure, guarded, register_scripts,
)  # fmt: skip
from qosgate.runtime.errors import BatchStoreUnavailable

from .store import ACTIVE, BatchRecord, FileRecord, JournalEntry, LeaseLost, LineResult

_PAGE = 1000

T = TypeVar("T")


def _answers(method: Callable[..., Awaitable[T]]) -> Callable[..., Awaitable[T]]:
    """A store method whose Redis failures are BatchStoreUnavailable (503 at the API)."""

    @functools.wraps(method)
    async def call(self: RedisBatchStore, *args: Any, **kwargs: Any) -> T:
        return await guarded(method(self, *args, **kwargs), BatchStoreUnavailable)

    return call


def _streams(method: Callable[..., AsyncIterator[T]]) -> Callable[..., AsyncIterator[T]]:
    """`_answers` for a method that yields."""

    @functools.wraps(method)
    async def stream(self: RedisBatchStore, *args: Any, **kwargs: Any) -> AsyncIterator[T]:
        try:
            async for item in method(self, *args, **kwargs):
                yield item
        except REDIS_FAILURES as exc:
            raise failure(exc, BatchStoreUnavailable) from exc

    return stream


_FILE_FIELDS = ("id", "tenant", "filename", "purpose", "bytes", "created_at", "lines")


class RedisBatchStore:
    def __init__(
        self,
        url: str,
        files_dir: str | Path,
        *,
        key_prefix: str = "qosgate:",
        owner: str = "",
        lease_s: float = 10.0,
        password: str | None = None,
        timeout_s: float | None = None,
    ) -> None:
        """`owner`: this replica's name, the start of its lease tokens (so
        that Redis shows who drives a job). `password`: used where `url`
        carries none."""
        self.files_dir = Path(files_dir)
        self.lease_s = lease_s
        self._url = url
        self._prefix = key_prefix + "batch:"
        self._owner = owner
        self._password = password
        self._timeout_s = timeout_s
        self._redis: aioredis.Redis | None = None
        self._tokens: dict[str, str] = {}
        """The token of each lease held here, by job: what its writes carry."""

    def _key(self, *parts: str) -> str:
        return self._prefix + ":".join(parts)

    @property
    def redis(self) -> aioredis.Redis:
        if self._redis is None:
            raise RuntimeError("the batch store is not open")
        return self._redis

    async def open(self) -> None:
        self.files_dir.mkdir(parents=True, exist_ok=True)
        # The client owns its pool, so close() disconnects it too.
        self._redis = client = aioredis.Redis.from_pool(connection_pool(
            self._url, timeout_s=self._timeout_s, password=self._password))
        # A fenced script writes only under the lease's token (fence.lua first).
        self._record, self._save, self._sent = register_scripts(
            client, __package__, ("record", "save", "sent"), prelude=("fence",))
        self._renew, self._release, self._cancel = register_scripts(
            client, __package__, ("renew", "release", "cancel"))

    async def close(self) -> None:
        if self._redis is not None:
            await self._redis.aclose()
            self._redis = None

    # -- files -----------------------------------------------------------------

    @_answers
    async def add_file(self, record: FileRecord) -> None:
        seq = await self.redis.incr(self._key("seq"))
        fields = {name: getattr(record, name) for name in _FILE_FIELDS}
        async with self.redis.pipeline(transaction=True) as pipe:
            pipe.hset(self._key("file", record.id), mapping={**fields, "seq": seq, "deleted": 0})
            pipe.zadd(self._key("files", record.tenant), {record.id: seq})
            await pipe.execute()

    @_answers
    async def get_file(self, tenant: str, file_id: str) -> FileRecord | None:
        raw = await self.redis.hgetall(self._key("file", file_id))
        return _file(raw, tenant)

    @_answers
    async def list_files(
        self, tenant: str, *, after: str | None, limit: int, purpose: str | None, newest_first: bool
    ) -> list[FileRecord]:
        index = self._key("files", tenant)
        found: list[FileRecord] = []
        async for file_id in self._walk(index, after, newest_first):
            record = await self.get_file(tenant, file_id)
            if record is not None and (purpose is None or record.purpose == purpose):
                found.append(record)
                if len(found) >= limit:
                    break
        return found

    @_answers
    async def delete_file(self, tenant: str, file_id: str) -> bool:
        if await self.get_file(tenant, file_id) is None:
            return False
        async with self.redis.pipeline(transaction=True) as pipe:
            pipe.hset(self._key("file", file_id), "deleted", 1)
            pipe.zrem(self._key("files", tenant), file_id)
            await pipe.execute()
        return True

    async def _walk(self, index: str, after: str | None, newest_first: bool) -> AsyncIterator[str]:
        """The ids of a per-tenant index in order, past `after` (none when
        `after` is not in it)."""
        redis = self.redis
        if after is None:
            start = "+inf" if newest_first else "-inf"
        else:
            score = await redis.zscore(index, after)
            if score is None:
                return
            start = f"({int(score)}"
        while True:
            if newest_first:
                ids = await redis.zrevrangebyscore(index, start, "-inf", start=0, num=_PAGE)
            else:
                ids = await redis.zrangebyscore(index, start, "+inf", start=0, num=_PAGE)
            for raw in ids:
                yield raw.decode()
            if len(ids) < _PAGE:
                return
            start = f"({int(await redis.zscore(index, ids[-1]))}"

    # -- batches ---------------------------------------------------------------

    @_answers
    async def add_batch(self, record: BatchRecord) -> None:
        seq = await self.redis.incr(self._key("seq"))
        key = self._key("batch", record.id)
        async with self.redis.pipeline(transaction=True) as pipe:
            pipe.hset(key, mapping={"tenant": record.tenant, "seq": seq, "completed": 0,
                                    "failed": 0})  # fmt: skip
            pipe.zadd(self._key("batches", record.tenant), {record.id: seq})
            await pipe.execute()
        await self.save_batch(record)

    @_answers
    async def get_batch(self, tenant: str, batch_id: str) -> BatchRecord | None:
        raw = await self.redis.hgetall(self._key("batch", batch_id))
        if not raw or raw.get(b"tenant", b"").decode() != tenant or b"doc" not in raw:
            return None
        return _batch(batch_id, raw)

    @_answers
    async def list_batches(
        self, tenant: str, *, after: str | None, limit: int
    ) -> list[BatchRecord]:
        found: list[BatchRecord] = []
        async for batch_id in self._walk(self._key("batches", tenant), after, True):
            record = await self.get_batch(tenant, batch_id)
            if record is not None:
                found.append(record)
                if len(found) >= limit:
                    break
        return found

    @_answers
    async def save_batch(self, record: BatchRecord) -> None:
        await self._fenced(
            self._save, record.id,
            [self._key("batch", record.id), self._key("statuses"), self._key("active")],
            [record.status, record.doc(), "1" if record.status in ACTIVE else "0", record.id],
        )  # fmt: skip

    async def _fenced(self, script: Any, batch_id: str, keys: list[str], args: list[Any]) -> None:
        """Run a fenced write for the job: it carries the job's lease when one
        is held here, and LeaseLost is raised if that lease is gone."""
        token = self._tokens.get(batch_id, "")
        landed = await script(keys=[self._key("lease", batch_id), *keys], args=[token, *args])
        if landed == -1:
            raise LeaseLost(f"batch {batch_id}: its lease was taken over")

    @_answers
    async def active_batches(self) -> list[BatchRecord]:
        found = []
        for raw_id in await self.redis.zrange(self._key("active"), 0, -1):
            raw = await self.redis.hgetall(self._key("batch", raw_id.decode()))
            if raw:
                found.append(_batch(raw_id.decode(), raw))
        return found

    @_answers
    async def status_counts(self) -> dict[str, int]:
        raw = await self.redis.hgetall(self._key("statuses"))
        return {k.decode(): int(v) for k, v in raw.items() if int(v)}

    # -- the journal -------------------------------------------------------------

    @_answers
    async def line_sent(self, batch_id: str, line_no: int, request_id: str, tenant: str) -> None:
        await self._fenced(self._sent, batch_id, [self._key("sent", batch_id)],
                           [request_id, orjson.dumps([line_no, tenant])])  # fmt: skip

    @_answers
    async def line_unsent(self, batch_id: str, request_id: str) -> None:
        await self.redis.hdel(self._key("sent", batch_id), request_id)

    @_answers
    async def journal(self, batch_id: str) -> list[JournalEntry]:
        sent = await self.redis.hgetall(self._key("sent", batch_id))
        entries = []
        for raw_id, raw in sent.items():
            line_no, tenant = orjson.loads(raw)
            result = await self.redis.hget(self._key("results", batch_id), str(line_no))
            charged = None
            if result is not None:
                _, _, _, tokens, request_id = orjson.loads(result)
                charged = tokens if request_id == raw_id.decode() else None
            entries.append(JournalEntry(line_no, raw_id.decode(), tenant, charged))
        return sorted(entries, key=lambda e: (e.line_no, e.request_id))

    @_answers
    async def record(self, batch_id: str, result: LineResult) -> None:
        value = orjson.dumps(
            [result.custom_id, result.ok, result.text, result.tokens, result.request_id]
        )
        await self._fenced(
            self._record, batch_id,
            [self._key("batch", batch_id), self._key("results", batch_id),
             self._key("resultidx", batch_id)],
            [result.line_no, value, "completed" if result.ok else "failed"],
        )  # fmt: skip

    # -- leases ------------------------------------------------------------------

    def _lease_ms(self) -> int:
        return max(1, round(self.lease_s * 1000))

    @_answers
    async def acquire(self, batch_id: str) -> bool:
        token = f"{self._owner}:{secrets.token_hex(8)}"
        taken = await self.redis.set(
            self._key("lease", batch_id), token, nx=True, px=self._lease_ms()
        )
        if taken:
            self._tokens[batch_id] = token
        return bool(taken)

    @_answers
    async def take(self, exclude: set[str]) -> list[BatchRecord]:
        ids = [raw.decode() for raw in await self.redis.zrange(self._key("active"), 0, -1)]
        taken = []
        for batch_id in ids:
            if batch_id in exclude or not await self.acquire(batch_id):
                continue
            # Read once held: until then its last driver could still move it.
            raw = await self.redis.hgetall(self._key("batch", batch_id))
            record = _batch(batch_id, raw) if raw and b"doc" in raw else None
            if record is None or record.status not in ACTIVE:
                await self.release(batch_id)
                continue
            taken.append(record)
        return taken

    @_answers
    async def renew(self, batch_ids: list[str]) -> dict[str, int | None]:
        held = [batch_id for batch_id in batch_ids if batch_id in self._tokens]
        if not held:
            return {}
        keys = [key for b in held for key in (self._key("lease", b), self._key("batch", b))]
        answers = await self._renew(
            keys=keys, args=[self._lease_ms(), *(self._tokens[b] for b in held)]
        )
        return {b: None if a == -1 else int(a) for b, a in zip(held, answers, strict=True)}

    @_answers
    async def release(self, batch_id: str) -> None:
        token = self._tokens.pop(batch_id, None)
        if token is None:
            return
        # Unanswered, it runs out on its own within lease_s.
        await self._release(keys=[self._key("lease", batch_id)], args=[token])

    @_answers
    async def request_cancel(self, batch_id: str, at: int) -> bool:
        return bool(await self._cancel(keys=[self._key("batch", batch_id)], args=[at]))

    async def _numbers(self, batch_id: str) -> AsyncIterator[list[int]]:
        index = self._key("resultidx", batch_id)
        start = "-inf"
        while True:
            page = await self.redis.zrangebyscore(index, start, "+inf", start=0, num=_PAGE)
            if page:
                yield [int(n) for n in page]
            if len(page) < _PAGE:
                return
            start = f"({int(page[-1])}"

    @_streams
    async def recorded(self, batch_id: str) -> AsyncIterator[int]:
        async for page in self._numbers(batch_id):
            for number in page:
                yield number

    @_streams
    async def results(self, batch_id: str) -> AsyncIterator[LineResult]:
        key = self._key("results", batch_id)
        async for page in self._numbers(batch_id):
            for number, raw in zip(page, await self.redis.hmget(key, [str(n) for n in page])):
                custom_id, ok, text, tokens, request_id = orjson.loads(raw)
                yield LineResult(number, custom_id, ok, text, tokens, request_id)


def _file(raw: dict[bytes, bytes], tenant: str) -> FileRecord | None:
    if not raw or raw.get(b"deleted") == b"1" or raw.get(b"tenant", b"").decode() != tenant:
        return None
    text = {k.decode(): v.decode() for k, v in raw.items()}
    return FileRecord(
        text["id"], text["tenant"], text["filename"], text["purpose"], int(text["bytes"]),
        int(text["created_at"]), int(text["lines"]),
    )  # fmt: skip


def _batch(batch_id: str, raw: dict[bytes, bytes]) -> BatchRecord:
    record = BatchRecord.stored(
        batch_id, raw[b"tenant"].decode(), raw[b"status"].decode(), raw[b"doc"],
        int(raw.get(b"completed", 0)), int(raw.get(b"failed", 0)),
    )  # fmt: skip
    cancel_at = raw.get(b"cancel_at")
    if cancel_at is not None and record.status in ("validating", "in_progress"):
        # Asked on some replica; its driver has not acted on it yet.
        record.status = "cancelling"
        record.times.setdefault("cancelling_at", int(cancel_at))
    return record
