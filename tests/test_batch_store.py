"""The `BatchStore` port's contract, run over each store (SQLite, and Redis
on a real redis-server): files and batches per tenant, pages, the journal
of sent tries and recorded results, and everything still there after the
store is closed and opened again."""

from __future__ import annotations

import uuid
from collections.abc import AsyncIterator, Callable
from pathlib import Path

import pytest

from qosgate.batch.redis_store import RedisBatchStore
from qosgate.batch.sqlite_store import SqliteBatchStore
from qosgate.batch.store import (
    BatchRecord, BatchStore, FileRecord, JournalEntry, LineResult,
)  # fmt: skip
from qosgate.runtime.errors import BatchStoreUnavailable
from tests.redis_server import free_port


@pytest.fixture(params=["sqlite", "redis"])
async def make_store(request: pytest.FixtureRequest, tmp_path: Path) -> AsyncIterator[
    Callable[[], BatchStore]
]:  # fmt: skip
    """A maker of stores over the same data: each one made after another is
    closed sees what it left."""
    opened: list[BatchStore] = []
    prefix = f"batch-store-{uuid.uuid4().hex[:8]}:"
    url = request.getfixturevalue("redis_server").url if request.param == "redis" else ""

    def make() -> BatchStore:
        store: BatchStore
        if request.param == "redis":
            store = RedisBatchStore(url, tmp_path / "files", key_prefix=prefix)
        else:
            store = SqliteBatchStore(tmp_path)
        opened.append(store)
        return store

    yield make
    for store in opened:
        await store.close()


def _batch(batch_id: str, tenant: str = "t", **fields: object) -> BatchRecord:
    return BatchRecord(
        id=batch_id, tenant=tenant, tier="bulk", endpoint="/v1/completions",
        input_file_id="file-in", completion_window="24h", created_at=100, expires_at=86_500,
        total=3, **fields,  # type: ignore[arg-type]
    )  # fmt: skip


async def test_files_belong_to_their_tenant_and_page(make_store: Callable[[], BatchStore]) -> None:
    store = make_store()
    await store.open()
    assert store.files_dir.is_dir()
    for i in range(5):
        await store.add_file(FileRecord(f"file-{i}", "t", f"f{i}.jsonl", "batch", 10 + i, i, 1))
    await store.add_file(FileRecord("file-other", "u", "x.jsonl", "batch", 1, 9, 1))
    assert (await store.get_file("t", "file-2")).bytes == 12  # type: ignore[union-attr]
    assert await store.get_file("u", "file-2") is None
    page = await store.list_files("t", after=None, limit=2, purpose=None, newest_first=True)
    assert [f.id for f in page] == ["file-4", "file-3"]
    page = await store.list_files("t", after="file-3", limit=10, purpose=None, newest_first=True)
    assert [f.id for f in page] == ["file-2", "file-1", "file-0"]
    page = await store.list_files("t", after="file-1", limit=10, purpose=None, newest_first=False)
    assert [f.id for f in page] == ["file-2", "file-3", "file-4"]
    assert await store.list_files("t", after=None, limit=9, purpose="batch_output",
                                  newest_first=True) == []  # fmt: skip
    assert not await store.delete_file("u", "file-1")
    assert await store.delete_file("t", "file-1")
    assert not await store.delete_file("t", "file-1")
    assert await store.get_file("t", "file-1") is None


async def test_batches_and_their_journal_outlive_the_store(
    make_store: Callable[[], BatchStore],
) -> None:
    store = make_store()
    await store.open()
    await store.add_batch(_batch("batch_a", metadata={"k": "v"}))
    await store.add_batch(_batch("batch_b"))
    await store.add_batch(_batch("batch_c", tenant="u"))
    assert [b.id for b in await store.list_batches("t", after=None, limit=5)] == [
        "batch_b", "batch_a"
    ]
    assert [b.id for b in await store.list_batches("t", after="batch_b", limit=5)] == ["batch_a"]
    assert await store.get_batch("u", "batch_a") is None

    # Line 1's try r1 is in flight; line 2 was tried twice (r2 refused, r2b
    # answered); line 3's try is settled for good; line 4 failed unsent.
    for line_no, request_id in ((1, "r1"), (2, "r2"), (2, "r2b"), (3, "r3")):
        await store.line_sent("batch_a", line_no, request_id, "t")
    await store.line_unsent("batch_a", "r3")
    await store.record("batch_a", LineResult(2, "two", True, '{"x": 2}', 30, "r2b"))
    # A second record of the same line counts nothing.
    await store.record("batch_a", LineResult(2, "two", True, '{"x": 2}', 30, "r2b"))
    await store.record("batch_a", LineResult(4, "four", False, '{"x": 4}'))
    a = await store.get_batch("t", "batch_a")
    assert a is not None and (a.completed, a.failed) == (1, 1)
    a.status = "in_progress"
    a.times["in_progress_at"] = 101
    a.completed = 99  # the counts move only with results: a save leaves them
    await store.save_batch(a)
    await store.close()

    again = make_store()
    await again.open()
    a = await again.get_batch("t", "batch_a")
    assert a is not None
    assert (a.status, a.times, a.metadata, a.completed, a.failed) == (
        "in_progress", {"in_progress_at": 101}, {"k": "v"}, 1, 1
    )
    assert await again.journal("batch_a") == [
        JournalEntry(1, "r1", "t", None), JournalEntry(2, "r2", "t", None),
        JournalEntry(2, "r2b", "t", 30),
    ]
    assert [r async for r in again.recorded("batch_a")] == [2, 4]
    assert [r async for r in again.results("batch_a")] == [
        LineResult(2, "two", True, '{"x": 2}', 30, "r2b"),
        LineResult(4, "four", False, '{"x": 4}', 0, ""),
    ]
    assert [b.id for b in await again.active_batches()] == ["batch_a", "batch_b", "batch_c"]
    assert await again.status_counts() == {"in_progress": 1, "validating": 2}


async def test_a_long_journal_is_walked_in_order(make_store: Callable[[], BatchStore]) -> None:
    store = make_store()
    await store.open()
    await store.add_batch(_batch("batch_long"))
    numbers = list(range(2500, 0, -1))  # recorded out of order, across several pages
    for n in numbers:
        await store.record("batch_long", LineResult(n, f"c{n}", n % 3 != 0, "{}"))
    assert [n async for n in store.recorded("batch_long")] == sorted(numbers)
    assert [r.custom_id async for r in store.results("batch_long")] == [
        f"c{n}" for n in sorted(numbers)
    ]
    record = await store.get_batch("t", "batch_long")
    assert record is not None and record.completed + record.failed == 2500


async def test_a_redis_that_does_not_answer_is_the_store_unavailable(tmp_path: Path) -> None:
    """A lease asked of a Redis nobody listens on fails as the port says
    (the runner then keeps its jobs and tries again), not with redis-py's error."""
    store = RedisBatchStore(f"redis://127.0.0.1:{free_port()}/0", tmp_path, timeout_s=1.0)
    await store.open()
    try:
        with pytest.raises(BatchStoreUnavailable, match="redis unreachable"):
            await store.acquire("batch-1")
        with pytest.raises(BatchStoreUnavailable, match="redis unreachable"):
            await store.take(set())
        with pytest.raises(BatchStoreUnavailable, match="redis unreachable"):
            await store.list_batches("t", after=None, limit=5)
        with pytest.raises(BatchStoreUnavailable, match="redis unreachable"):
            [n async for n in store.recorded("batch-1")]
        # What a client is told names no host; the detail is for the logs.
        with pytest.raises(BatchStoreUnavailable) as caught:
            await store.get_file("t", "file-1")
        assert caught.value.status == 503 and caught.value.retry_after_header == "1"
        assert "127.0.0.1" not in caught.value.message and "127.0.0.1" in str(caught.value)
    finally:
        await store.close()
