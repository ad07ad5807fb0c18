"""What a batch store keeps, and the `BatchStore` port.

A store keeps the files' and the batches' records, and each job's journal:
the tries of its lines sent to the gateway (until they are settled for good),
and each line's result once recorded. The file
contents live on disk under `files_dir`; the records say where.

A store that gateway replicas share (Redis) is also `JobLeases`: which
replica drives each job. A driver's writes to its job land only while it
holds the job's lease; a write after the lease was lost raises `LeaseLost`.
"""

from __future__ import annotations

import dataclasses
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal, Protocol, get_args

import orjson

BatchStatus = Literal[
    "validating", "failed", "in_progress", "finalizing", "completed", "expired", "cancelling",
    "cancelled",
]  # fmt: skip
ACTIVE: tuple[BatchStatus, ...] = ("validating", "in_progress", "finalizing", "cancelling")
"""Statuses of a job not yet ended: a restart resumes it."""
STATUSES: tuple[BatchStatus, ...] = get_args(BatchStatus)
ENDPOINTS: dict[str, Literal["chat", "completions"]] = {
    "/v1/chat/completions": "chat",
    "/v1/completions": "completions",
}


@dataclass(frozen=True, slots=True)
class FileRecord:
    id: str
    tenant: str
    filename: str
    purpose: str
    bytes: int
    created_at: int
    lines: int = 0
    """Requests it holds (a batch input file), or lines written (output)."""

    def api(self) -> dict[str, Any]:
        """OpenAI's file object."""
        return {
            "id": self.id, "object": "file", "bytes": self.bytes, "created_at": self.created_at,
            "filename": self.filename, "purpose": self.purpose, "status": "processed",
            "status_details": None, "expires_at": None,
        }  # fmt: skip


@dataclass(slots=True)
class BatchRecord:
    id: str
    tenant: str
    tier: str
    endpoint: str
    input_file_id: str
    completion_window: str
    created_at: int
    expires_at: int
    status: BatchStatus = "validating"
    total: int = 0
    completed: int = 0
    failed: int = 0
    output_file_id: str | None = None
    error_file_id: str | None = None
    metadata: dict[str, str] | None = None
    errors: list[dict[str, Any]] | None = None
    times: dict[str, int] = field(default_factory=dict)
    """When each status was reached (in_progress_at, ... cancelled_at)."""
    outcome: str | None = None
    """While finalizing: the status it ends with (completed, expired, cancelled)."""

    def api(self) -> dict[str, Any]:
        """OpenAI's batch object."""
        at = self.times
        return {
            "id": self.id, "object": "batch", "endpoint": self.endpoint,
            "errors": {"object": "list", "data": self.errors} if self.errors else None,
            "input_file_id": self.input_file_id, "completion_window": self.completion_window,
            "status": self.status, "output_file_id": self.output_file_id,
            "error_file_id": self.error_file_id, "created_at": self.created_at,
            "in_progress_at": at.get("in_progress_at"), "expires_at": self.expires_at,
            "finalizing_at": at.get("finalizing_at"), "completed_at": at.get("completed_at"),
            "failed_at": at.get("failed_at"), "expired_at": at.get("expired_at"),
            "cancelling_at": at.get("cancelling_at"), "cancelled_at": at.get("cancelled_at"),
            "request_counts": {
                "total": self.total, "completed": self.completed, "failed": self.failed,
            },
            "metadata": self.metadata,
        }  # fmt: skip

    def copy(self) -> BatchRecord:
        return dataclasses.replace(self, times=dict(self.times))

    def doc(self) -> str:
        """What a store keeps of it as one JSON document (its keys and counts
        aside: the counts are fields of their own, moved only with the
        results they count)."""
        return orjson.dumps({name: getattr(self, name) for name in _DOC_FIELDS}).decode()

    @classmethod
    def stored(cls, batch_id: str, tenant: str, status: BatchStatus, doc: str | bytes,
               completed: int, failed: int) -> BatchRecord:  # fmt: skip
        """The record a store kept: its keys, its `doc` and its counts."""
        return cls(id=batch_id, tenant=tenant, status=status, completed=completed,
                   failed=failed, **orjson.loads(doc))  # fmt: skip


_DOC_FIELDS = tuple(
    f.name for f in dataclasses.fields(BatchRecord)
    if f.name not in ("id", "tenant", "status", "completed", "failed")
)


@dataclass(frozen=True, slots=True)
class LineResult:
    """One line's recorded result: its line of the output file (`ok`) or of
    the error file, and the tokens its settlement charged."""

    line_no: int
    custom_id: str
    ok: bool
    text: str
    """The output or error line, JSON, without its newline."""
    tokens: int = 0
    request_id: str = ""
    """The try whose result it is ("": none was admitted)."""


@dataclass(frozen=True, slots=True)
class JournalEntry:
    """A try of a line that was sent to the gateway: its quota reservation,
    if it got one, is settled from what was recorded of it."""

    line_no: int
    request_id: str
    tenant: str
    charged: int | None
    """The tokens its recorded result was charged; None: no result of this try."""


class LeaseLost(Exception):
    """A driver wrote to a job whose lease it no longer holds: another
    replica drives the job now, and this one must stop."""


class BatchStore(Protocol):
    """Where batch records and journals live. Every write is durable
    (committed) when its call returns: a line's result counts from then."""

    files_dir: Path
    """Where file contents are kept, one file per id."""

    async def open(self) -> None: ...

    async def close(self) -> None: ...

    async def add_file(self, record: FileRecord) -> None: ...

    async def get_file(self, tenant: str, file_id: str) -> FileRecord | None:
        """The tenant's file (None: missing, deleted, or another tenant's)."""

    async def list_files(
        self, tenant: str, *, after: str | None, limit: int, purpose: str | None, newest_first: bool
    ) -> list[FileRecord]:
        """Up to `limit` of the tenant's files past the one `after` names."""

    async def delete_file(self, tenant: str, file_id: str) -> bool: ...

    async def add_batch(self, record: BatchRecord) -> None: ...

    async def get_batch(self, tenant: str, batch_id: str) -> BatchRecord | None: ...

    async def list_batches(
        self, tenant: str, *, after: str | None, limit: int
    ) -> list[BatchRecord]:
        """Up to `limit` of the tenant's batches, newest first, past `after`."""

    async def save_batch(self, record: BatchRecord) -> None:
        """Its status, times, counts, file ids and errors as they are now."""

    async def active_batches(self) -> list[BatchRecord]:
        """Every job not yet ended, oldest first: what a restart resumes."""

    async def status_counts(self) -> dict[str, int]: ...

    async def line_sent(self, batch_id: str, line_no: int, request_id: str, tenant: str) -> None:
        """A try of the line is about to be sent (journalled before it is)."""

    async def line_unsent(self, batch_id: str, request_id: str) -> None:
        """The try is settled for good: out of the journal."""

    async def journal(self, batch_id: str) -> list[JournalEntry]:
        """The journalled tries, each with what its recorded result was
        charged (None: no result of it)."""

    async def record(self, batch_id: str, result: LineResult) -> None:
        """The line's result and the batch's counts moved, in one transaction
        (a second result of the line is ignored)."""

    def recorded(self, batch_id: str) -> AsyncIterator[int]:
        """The numbers of the lines with a result, ascending."""

    def results(self, batch_id: str) -> AsyncIterator[LineResult]:
        """The recorded results, by line, ascending."""


class JobLeases(Protocol):
    """Which of the gateway replicas that share a store drives each job not
    yet ended: the one holding its lease, renewed every third of `lease_s`.
    While a lease is held here, the store's writes for that job carry it
    and land only while it is still held (`LeaseLost` otherwise). Each
    method raises `BatchStoreUnavailable` when the store cannot be reached."""

    lease_s: float

    async def acquire(self, batch_id: str) -> bool:
        """Take the job's lease if no replica holds it."""

    async def take(self, exclude: set[str]) -> list[BatchRecord]:
        """Take the lease of every job not yet ended that no replica holds
        (the ids in `exclude` aside): those jobs, as recorded once held."""

    async def renew(self, batch_ids: list[str]) -> dict[str, int | None]:
        """Extend the leases held of `batch_ids`: per job, None when its
        lease is no longer this replica's (its driver must stop), else when
        a cancel of it was asked (0: none)."""

    async def release(self, batch_id: str) -> None:
        """Let the job's lease go (if still held) and stop carrying it."""

    async def request_cancel(self, batch_id: str, at: int) -> bool:
        """Ask the job's driver, wherever it runs, to cancel the job; whether
        the job was still cancellable. Until the driver acts, the job reads
        as `cancelling`."""
