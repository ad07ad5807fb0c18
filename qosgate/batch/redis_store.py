"""A `BatchStore` in Redis, for gateways that share their batches: the
records and journals in Redis (as durable as its persistence: an append-only
file synced on every write for a journal that survives Redis too), the file
contents on a directory every replica mounts.

Every write that must be whole (a result with its counts and its journal
entry; a status with the counts by status) is one Lua script.
"""

from __future__ import annotations

from collections.abc import AsyncIterator
from pathlib import Path

import orjson
import redis.asyncio as aioredis

from .store import ACTIVE, BatchRecord, FileRecord, JournalEntry, LineResult

_PAGE = 1000

# KEYS: the batch hash, the results hash, the results index.
# ARGV: line number, the result (JSON), "completed" or "failed".
_RECORD = """
if redis.call('HSETNX', KEYS[2], ARGV[1], ARGV[2]) == 1 then
  redis.call('ZADD', KEYS[3], ARGV[1], ARGV[1])
  redis.call('HINCRBY', KEYS[1], ARGV[3], 1)
end
return 1
"""

# KEYS: the batch hash, the counts by status, the active set.
# ARGV: status, doc, whether the status is active, the batch id.
_SAVE = """
local before = redis.call('HGET', KEYS[1], 'status')
if before ~= ARGV[1] then
  if before then redis.call('HINCRBY', KEYS[2], before, -1) end
  redis.call('HINCRBY', KEYS[2], ARGV[1], 1)
end
redis.call('HSET', KEYS[1], 'status', ARGV[1], 'doc', ARGV[2])
if ARGV[3] == '1' then
  redis.call('ZADD', KEYS[3], redis.call('HGET', KEYS[1], 'seq'), ARGV[4])
else
  redis.call('ZREM', KEYS[3], ARGV[4])
end
return 1
"""

# The counts are fields of their own, moved only with the results they count.
_DOC_FIELDS = ("tier", "endpoint", "input_file_id", "completion_window", "created_at",
               "expires_at", "total", "output_file_id", "error_file_id", "metadata", "errors",
               "times", "outcome")  # fmt: skip
_FILE_FIELDS = ("id", "tenant", "filename", "purpose", "bytes", "created_at", "lines")


class RedisBatchStore:
    def __init__(self, url: str, files_dir: str | Path, *, key_prefix: str = "qosgate:") -> None:
        self.files_dir = Path(files_dir)
        self._url = url
        self._prefix = key_prefix + "batch:"
        self._redis: aioredis.Redis | None = None

    def _key(self, *parts: str) -> str:
        return self._prefix + ":".join(parts)

    @property
    def redis(self) -> aioredis.Redis:
        if self._redis is None:
            raise RuntimeError("the batch store is not open")
        return self._redis

    async def open(self) -> None:
        self.files_dir.mkdir(parents=True, exist_ok=True)
        self._redis = aioredis.Redis.from_url(self._url)
        self._record = self._redis.register_script(_RECORD)
        self._save = self._redis.register_script(_SAVE)

    async def close(self) -> None:
        if self._redis is not None:
            await self._redis.aclose()
            self._redis = None

    # -- files -----------------------------------------------------------------

    async def add_file(self, record: FileRecord) -> None:
        seq = await self.redis.incr(self._key("seq"))
        fields = {name: getattr(record, name) for name in _FILE_FIELDS}
        async with self.redis.pipeline(transaction=True) as pipe:
            pipe.hset(self._key("file", record.id), mapping={**fields, "seq": seq, "deleted": 0})
            pipe.zadd(self._key("files", record.tenant), {record.id: seq})
            await pipe.execute()

    async def get_file(self, tenant: str, file_id: str) -> FileRecord | None:
        raw = await self.redis.hgetall(self._key("file", file_id))
        return _file(raw, tenant)

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

    async def add_batch(self, record: BatchRecord) -> None:
        seq = await self.redis.incr(self._key("seq"))
        key = self._key("batch", record.id)
        async with self.redis.pipeline(transaction=True) as pipe:
            pipe.hset(key, mapping={"tenant": record.tenant, "seq": seq, "completed": 0,
                                    "failed": 0})  # fmt: skip
            pipe.zadd(self._key("batches", record.tenant), {record.id: seq})
            await pipe.execute()
        await self.save_batch(record)

    async def get_batch(self, tenant: str, batch_id: str) -> BatchRecord | None:
        raw = await self.redis.hgetall(self._key("batch", batch_id))
        if not raw or raw.get(b"tenant", b"").decode() != tenant or b"doc" not in raw:
            return None
        return _batch(batch_id, raw)

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

    async def save_batch(self, record: BatchRecord) -> None:
        doc = orjson.dumps({name: getattr(record, name) for name in _DOC_FIELDS}).decode()
        await self._save(
            keys=[self._key("batch", record.id), self._key("statuses"), self._key("active")],
            args=[record.status, doc, "1" if record.status in ACTIVE else "0", record.id],
        )

    async def active_batches(self) -> list[BatchRecord]:
        found = []
        for raw_id in await self.redis.zrange(self._key("active"), 0, -1):
            raw = await self.redis.hgetall(self._key("batch", raw_id.decode()))
            if raw:
                found.append(_batch(raw_id.decode(), raw))
        return found

    async def status_counts(self) -> dict[str, int]:
        raw = await self.redis.hgetall(self._key("statuses"))
        return {k.decode(): int(v) for k, v in raw.items() if int(v)}

    # -- the journal -------------------------------------------------------------

    async def line_sent(self, batch_id: str, line_no: int, request_id: str, tenant: str) -> None:
        await self.redis.hset(
            self._key("sent", batch_id), request_id, orjson.dumps([line_no, tenant])
        )

    async def line_unsent(self, batch_id: str, request_id: str) -> None:
        await self.redis.hdel(self._key("sent", batch_id), request_id)

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

    async def record(self, batch_id: str, result: LineResult) -> None:
        value = orjson.dumps(
            [result.custom_id, result.ok, result.text, result.tokens, result.request_id]
        )
        await self._record(
            keys=[self._key("batch", batch_id), self._key("results", batch_id),
                  self._key("resultidx", batch_id)],
            args=[result.line_no, value, "completed" if result.ok else "failed"],
        )  # fmt: skip

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

    async def recorded(self, batch_id: str) -> AsyncIterator[int]:
        async for page in self._numbers(batch_id):
            for number in page:
                yield number

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
    return BatchRecord(
        id=batch_id, tenant=raw[b"tenant"].decode(), status=raw[b"status"].decode(),
        completed=int(raw.get(b"completed", 0)), failed=int(raw.get(b"failed", 0)),
        **orjson.loads(raw[b"doc"]),
    )  # fmt: skip
