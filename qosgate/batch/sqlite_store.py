"""The single-node `BatchStore`: one SQLite database (WAL, synchronous
FULL: a commit that returned survives a crash of the process and of the
machine) and the file contents beside it, under `batch.data_dir`."""

from __future__ import annotations

from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import aiosqlite

from .store import ACTIVE, BatchRecord, FileRecord, JournalEntry, LineResult

_SCHEMA = """
CREATE TABLE IF NOT EXISTS files (
  seq INTEGER PRIMARY KEY AUTOINCREMENT,
  id TEXT UNIQUE NOT NULL, tenant TEXT NOT NULL, filename TEXT NOT NULL,
  purpose TEXT NOT NULL, bytes INTEGER NOT NULL, created_at INTEGER NOT NULL,
  lines INTEGER NOT NULL, deleted INTEGER NOT NULL DEFAULT 0
);
CREATE TABLE IF NOT EXISTS batches (
  seq INTEGER PRIMARY KEY AUTOINCREMENT,
  id TEXT UNIQUE NOT NULL, tenant TEXT NOT NULL, status TEXT NOT NULL, doc TEXT NOT NULL,
  completed INTEGER NOT NULL DEFAULT 0, failed INTEGER NOT NULL DEFAULT 0
);
CREATE INDEX IF NOT EXISTS batches_by_tenant ON batches (tenant, seq);
CREATE TABLE IF NOT EXISTS sent (
  batch_id TEXT NOT NULL, request_id TEXT NOT NULL, line_no INTEGER NOT NULL,
  tenant TEXT NOT NULL, PRIMARY KEY (batch_id, request_id)
);
CREATE TABLE IF NOT EXISTS results (
  batch_id TEXT NOT NULL, line_no INTEGER NOT NULL, custom_id TEXT NOT NULL,
  ok INTEGER NOT NULL, text TEXT NOT NULL, tokens INTEGER NOT NULL,
  request_id TEXT NOT NULL, PRIMARY KEY (batch_id, line_no)
);
"""

_BATCH_COLUMNS = "SELECT id, tenant, status, doc, completed, failed FROM batches"
_PAGE = 1000
"""Rows read at a time when a journal is walked."""


class SqliteBatchStore:
    def __init__(self, data_dir: str | Path) -> None:
        self.data_dir = Path(data_dir)
        self.files_dir = self.data_dir / "files"
        self._db: aiosqlite.Connection | None = None

    @property
    def db(self) -> aiosqlite.Connection:
        if self._db is None:
            raise RuntimeError("the batch store is not open")
        return self._db

    async def open(self) -> None:
        self.files_dir.mkdir(parents=True, exist_ok=True)
        db = await aiosqlite.connect(self.data_dir / "batches.sqlite3")
        await db.execute("PRAGMA journal_mode=WAL")
        await db.execute("PRAGMA synchronous=FULL")
        await db.executescript(_SCHEMA)
        await db.commit()
        self._db = db

    async def close(self) -> None:
        if self._db is not None:
            await self._db.close()
            self._db = None

    # -- files -----------------------------------------------------------------

    async def add_file(self, record: FileRecord) -> None:
        await self.db.execute(
            "INSERT INTO files (id, tenant, filename, purpose, bytes, created_at, lines) "
            "VALUES (?, ?, ?, ?, ?, ?, ?)",
            (record.id, record.tenant, record.filename, record.purpose, record.bytes,
             record.created_at, record.lines),
        )  # fmt: skip
        await self.db.commit()

    async def get_file(self, tenant: str, file_id: str) -> FileRecord | None:
        async with self.db.execute(
            "SELECT id, tenant, filename, purpose, bytes, created_at, lines FROM files "
            "WHERE id = ? AND tenant = ? AND deleted = 0", (file_id, tenant)
        ) as cursor:  # fmt: skip
            row = await cursor.fetchone()
        return FileRecord(*row) if row is not None else None

    async def list_files(
        self, tenant: str, *, after: str | None, limit: int, purpose: str | None, newest_first: bool
    ) -> list[FileRecord]:
        where = ["tenant = ?", "deleted = 0"]
        args: list[Any] = [tenant]
        if purpose is not None:
            where.append("purpose = ?")
            args.append(purpose)
        if after is not None:
            where.append(f"seq {'<' if newest_first else '>'} "
                         "(SELECT seq FROM files WHERE id = ? AND tenant = ?)")  # fmt: skip
            args += [after, tenant]
        order = "DESC" if newest_first else "ASC"
        async with self.db.execute(
            "SELECT id, tenant, filename, purpose, bytes, created_at, lines FROM files WHERE "
            f"{' AND '.join(where)} ORDER BY seq {order} LIMIT ?", (*args, limit)
        ) as cursor:  # fmt: skip
            return [FileRecord(*row) for row in await cursor.fetchall()]

    async def delete_file(self, tenant: str, file_id: str) -> bool:
        cursor = await self.db.execute(
            "UPDATE files SET deleted = 1 WHERE id = ? AND tenant = ? AND deleted = 0",
            (file_id, tenant),
        )
        await self.db.commit()
        return cursor.rowcount > 0

    # -- batches ---------------------------------------------------------------

    async def add_batch(self, record: BatchRecord) -> None:
        await self.db.execute(
            "INSERT INTO batches (id, tenant, status, doc) VALUES (?, ?, ?, ?)",
            (record.id, record.tenant, record.status, record.doc()),
        )
        await self.db.commit()

    async def get_batch(self, tenant: str, batch_id: str) -> BatchRecord | None:
        async with self.db.execute(
            f"{_BATCH_COLUMNS} WHERE id = ? AND tenant = ?",
            (batch_id, tenant),
        ) as cursor:
            row = await cursor.fetchone()
        return BatchRecord.stored(*row) if row is not None else None

    async def list_batches(
        self, tenant: str, *, after: str | None, limit: int
    ) -> list[BatchRecord]:
        where, args = "tenant = ?", [tenant]
        if after is not None:
            where += " AND seq < (SELECT seq FROM batches WHERE id = ? AND tenant = ?)"
            args += [after, tenant]
        async with self.db.execute(
            f"{_BATCH_COLUMNS} WHERE {where} ORDER BY seq DESC LIMIT ?",
            (*args, limit),
        ) as cursor:
            return [BatchRecord.stored(*row) for row in await cursor.fetchall()]

    async def save_batch(self, record: BatchRecord) -> None:
        await self.db.execute(
            "UPDATE batches SET status = ?, doc = ? WHERE id = ?",
            (record.status, record.doc(), record.id),
        )
        await self.db.commit()

    async def active_batches(self) -> list[BatchRecord]:
        marks = ", ".join("?" for _ in ACTIVE)
        async with self.db.execute(
            f"{_BATCH_COLUMNS} WHERE status IN ({marks}) ORDER BY seq",
            ACTIVE,
        ) as cursor:
            return [BatchRecord.stored(*row) for row in await cursor.fetchall()]

    async def status_counts(self) -> dict[str, int]:
        async with self.db.execute("SELECT status, COUNT(*) FROM batches GROUP BY status") as cur:
            return {status: count for status, count in await cur.fetchall()}

    # -- the journal -------------------------------------------------------------

    async def line_sent(self, batch_id: str, line_no: int, request_id: str, tenant: str) -> None:
        await self.db.execute(
            "INSERT INTO sent (batch_id, request_id, line_no, tenant) VALUES (?, ?, ?, ?)",
            (batch_id, request_id, line_no, tenant),
        )
        await self.db.commit()

    async def line_unsent(self, batch_id: str, request_id: str) -> None:
        await self.db.execute(
            "DELETE FROM sent WHERE batch_id = ? AND request_id = ?", (batch_id, request_id)
        )
        await self.db.commit()

    async def journal(self, batch_id: str) -> list[JournalEntry]:
        async with self.db.execute(
            "SELECT s.line_no, s.request_id, s.tenant, r.tokens FROM sent s LEFT JOIN results r "
            "ON r.batch_id = s.batch_id AND r.line_no = s.line_no AND r.request_id = s.request_id "
            "WHERE s.batch_id = ? ORDER BY s.line_no, s.request_id", (batch_id,)
        ) as cursor:  # fmt: skip
            return [JournalEntry(*row) for row in await cursor.fetchall()]

    async def record(self, batch_id: str, result: LineResult) -> None:
        db = self.db
        # Both statements or neither: aiosqlite opens the transaction at the
        # first write and the commit ends it.
        cursor = await db.execute(
            "INSERT OR IGNORE INTO results "
            "(batch_id, line_no, custom_id, ok, text, tokens, request_id) "
            "VALUES (?, ?, ?, ?, ?, ?, ?)",
            (batch_id, result.line_no, result.custom_id, int(result.ok), result.text,
             result.tokens, result.request_id),
        )  # fmt: skip
        if cursor.rowcount:
            column = "completed" if result.ok else "failed"
            await db.execute(
                f"UPDATE batches SET {column} = {column} + 1 WHERE id = ?", (batch_id,)
            )
        await db.commit()

    async def recorded(self, batch_id: str) -> AsyncIterator[int]:
        async for (line_no,) in self._results("line_no", batch_id):
            yield line_no

    async def results(self, batch_id: str) -> AsyncIterator[LineResult]:
        rows = self._results("line_no, custom_id, ok, text, tokens, request_id", batch_id)
        async for line_no, custom_id, ok, text, tokens, request_id in rows:
            yield LineResult(line_no, custom_id, bool(ok), text, tokens, request_id)

    async def _results(self, columns: str, batch_id: str) -> AsyncIterator[tuple[Any, ...]]:
        """`columns` (line_no first) of the job's results, by line, a page at a time."""
        last = -1
        while True:
            async with self.db.execute(
                f"SELECT {columns} FROM results WHERE batch_id = ? AND line_no > ? "
                "ORDER BY line_no LIMIT ?", (batch_id, last, _PAGE)
            ) as cursor:  # fmt: skip
                rows = await cursor.fetchall()
            for row in rows:
                yield row
            if len(rows) < _PAGE:
                return
            last = rows[-1][0]
