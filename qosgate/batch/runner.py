"""The batch service: the API's operations on files and batches, and the
jobs that run batches' lines through the gateway.

Each line is a request of the batch's tenant at the batch's tier, taken
through `Gateway.admit` like an HTTP request, so quotas, fairness,
admission and settlement all apply as they do there. A job keeps
`batch.waiting_per_job` lines waiting to answer (queued, or in their
prefill): it sends the next whenever one starts answering, so it fills what
capacity other work leaves as soon as it frees, without flooding the queue;
and it holds at most `batch.in_flight_per_job` lines at once (admitted, or
waiting to be tried again), reading its input file as it goes. A line refused for load or
quota waits (Retry-After, else a doubling backoff) and is tried again; a
line whose own content is refused is an error line.

Charging each line once across crashes: before a try of a line is
admitted, the job journals it (`line_sent`: its request id). It is admitted
with its settlement held, and the quota store (a shared one) keeps a record
of its reservation until it is settled, and settles it only once however
often it is asked. When the try ends, its result is recorded first and its
settlement made after; a try given up (load, a stop) is refunded in full and
the line tried again. When the job resumes after a crash, and when it ends,
each journalled try is settled again from what was recorded (its result's
tokens, or nothing for a try without one) and taken out of the journal: a
reservation the crash left unsettled is settled then, one settled already
is left as it is, and a line with a recorded result never runs again.

Where gateway replicas share the store (`JobLeases`), each job is driven by
the one replica that holds its lease: the replica that created it, or one
that took it over after its lease ran out. A timer renews the leases held
here every third of `lease_s`, takes over the jobs nobody holds, and brings
in the cancels asked on other replicas. A driver that finds its lease lost
stops at once as a stopping gateway does (its lines cut off are refunded and
run again under the new driver), and its store refuses every later write of
it, so a result is recorded by one driver only. Resuming is the same as
after a crash.
"""

from __future__ import annotations

import asyncio
import contextlib
import heapq
import logging
import time
from collections.abc import AsyncIterator, Callable
from pathlib import Path
from typing import Any, Literal

from qosgate.config.models import PolicyConfig, completion_window_s
from qosgate.core.request import Outcome
from qosgate.http.render import Call, answer_body
from qosgate.http.validation import MAX_PRIORITY_OFFSET, validate_body
from qosgate.observability.metrics import GatewayMetrics
from qosgate.quotas import QuotaStoreError
from qosgate.runtime.ask import Ask
from qosgate.runtime.errors import (
    BackendFailed,
    BackendUnavailableError,
    BadRequest,
    BatchNotCancellable,
    BatchObjectNotFound,
    BatchStoreUnavailable,
    Expired,
    FileInUse,
    GatewayClosing,
    GatewayError,
    InvalidBatchFile,
    Overloaded,
    PayloadTooLarge,
    QueueFull,
    QuotaExceeded,
    QuotaStoreUnavailable,
)
from qosgate.runtime.gate import Gateway, RequestStream

from .files import (
    check_endpoint, check_input, input_lines, new_id, output_line, parse_item, unrun_line,
)  # fmt: skip
from .store import (
    ENDPOINTS, STATUSES, BatchRecord, BatchStore, FileRecord, JobLeases, LeaseLost, LineResult,
)  # fmt: skip

log = logging.getLogger(__name__)

_Ending = Literal["expired", "cancelled", "closing"]


class BatchService:
    """The Batch API over one gateway and one store: the routes' operations,
    and a `Job` for each batch not yet ended (those a previous run left are
    resumed by `start`). With `leases`, only the jobs whose lease this
    service holds run here."""

    def __init__(
        self,
        gateway: Gateway,
        policy: Callable[[], PolicyConfig],
        store: BatchStore,
        *,
        leases: JobLeases | None = None,
        metrics: GatewayMetrics | None = None,
        clock: Callable[[], float] = time.time,
    ) -> None:
        self.gateway = gateway
        self._policy = policy
        self.store = store
        self.leases = leases
        self.clock = clock
        """The wall clock (records, the completion windows); a test's to set."""
        self._metrics = metrics
        self._jobs: dict[str, Job] = {}
        self._tasks: set[asyncio.Task[None]] = set()
        self._status_counts: dict[str, int] = {}
        self._stopping = False
        self._started = False
        self._tick_timer: asyncio.TimerHandle | None = None
        self._ticking: asyncio.Task[None] | None = None
        self.driven = 0
        """Jobs this service has started driving (created, resumed or taken over)."""
        if metrics is not None:
            metrics.watch_batches(self.levels)

    @property
    def policy(self) -> PolicyConfig:
        return self._policy()

    def now(self) -> int:
        return int(self.clock())

    # -- lifecycle -------------------------------------------------------------

    async def start(self) -> None:
        """Open the store and resume every job a previous run left unfinished
        (with leases: every one no replica holds, and from then on, each
        such job that a replica leaves)."""
        if self._started:
            return
        self._started = True
        await self.store.open()
        if self.leases is None:
            self._status_counts = await self.store.status_counts()
            for record in await self.store.active_batches():
                self._launch(record)
            return
        try:
            self._status_counts = await self.store.status_counts()
            await self._take_over()
        except BatchStoreUnavailable as exc:
            # A shared store down at start is an outage, not a broken
            # gateway: the API answers 503 and the lease rounds try again.
            log.warning("batch jobs: the store does not answer at start: %s", exc)
        self._arm_tick()

    def stop_feeding(self) -> None:
        """The first half of a stop: no line is sent from now on."""
        self._stopping = True
        for job in self._jobs.values():
            job.end("closing")

    async def stop(self) -> None:
        """End every job where it stands (lines cut off run again after a
        restart) and close the store. Idempotent."""
        self.stop_feeding()
        for job in list(self._jobs.values()):
            job.cut()
        if self._tasks:
            await asyncio.gather(*self._tasks, return_exceptions=True)
        # The jobs have let their leases go: other replicas take them at once.
        if self._tick_timer is not None:
            self._tick_timer.cancel()
        if self._ticking is not None:
            await asyncio.gather(self._ticking, return_exceptions=True)
        if self._started:
            self._started = False
            await self.store.close()

    def _launch(self, record: BatchRecord) -> None:
        self.driven += 1
        job = Job(self, record)
        self._jobs[record.id] = job
        task = job.task = asyncio.get_running_loop().create_task(job.run())
        self._tasks.add(task)

        def done(task: asyncio.Task[None]) -> None:
            self._tasks.discard(task)
            self._jobs.pop(record.id, None)

        task.add_done_callback(done)

    # -- leases (replicas sharing the store) ----------------------------------

    def _arm_tick(self) -> None:
        assert self.leases is not None
        loop = asyncio.get_running_loop()
        self._tick_timer = loop.call_at(loop.time() + self.leases.lease_s / 3, self._on_tick)

    def _on_tick(self) -> None:
        if self._ticking is None or self._ticking.done():
            self._ticking = asyncio.get_running_loop().create_task(self._tick())
        self._arm_tick()

    async def _tick(self) -> None:
        try:
            await self._round()
        except (BatchStoreUnavailable, LeaseLost) as exc:
            log.warning("batch jobs: the lease timer's round stopped short: %s", exc)
        except Exception:
            # The next round tries again; a round must not fail unseen.
            log.exception("batch jobs: the lease timer's round failed")

    async def _round(self) -> None:
        """Renew the leases held here (a job whose lease is lost, or could
        not be renewed for `lease_s`, stops), act on cancels asked
        elsewhere, take over the jobs no replica holds, and read the jobs'
        counts by status (the fleet's, for the metrics)."""
        leases = self.leases
        assert leases is not None
        jobs = dict(self._jobs)
        asked = asyncio.get_running_loop().time()
        try:
            renewals = await leases.renew(list(jobs))
        except BatchStoreUnavailable as exc:
            log.warning("could not renew the leases of %d batch jobs: %s", len(jobs), exc)
            for job in jobs.values():
                if asked - job.renewed_at >= leases.lease_s:
                    job.lose()
        else:
            for batch_id, job in jobs.items():
                cancel_at = renewals.get(batch_id, 0)
                if cancel_at is None:
                    job.lose()
                    continue
                job.renewed_at = asked
                if cancel_at:
                    await job.cancel(cancel_at)
        if not self._stopping:
            await self._take_over()
            self._status_counts = await self.store.status_counts()

    async def _take_over(self) -> None:
        assert self.leases is not None
        for record in await self.leases.take(set(self._jobs)):
            if self._stopping:
                await self.leases.release(record.id)
                continue
            log.warning("batch %s: taken over (%s, %d of %d lines recorded)", record.id,
                        record.status, record.completed + record.failed, record.total)  # fmt: skip
            self._launch(record)

    async def wait(self, batch_id: str) -> None:
        """Until the job of `batch_id` (if it runs here) has ended."""
        job = self._jobs.get(batch_id)
        if job is not None and job.task is not None:
            await asyncio.shield(job.task)

    def levels(self) -> tuple[dict[str, int], dict[str, int]]:
        """Jobs by status, and per tenant the lines of running jobs without a
        result (the metrics read these)."""
        queued: dict[str, int] = {}
        for job in self._jobs.values():
            record = job.record
            queued[record.tenant] = queued.get(record.tenant, 0) + max(
                0, record.total - record.completed - record.failed
            )
        counts = self._status_counts
        return {status: counts.get(status, 0) for status in STATUSES}, queued

    def moved(self, before: str | None, after: str) -> None:
        if before is not None:
            self._status_counts[before] = self._status_counts.get(before, 0) - 1
        self._status_counts[after] = self._status_counts.get(after, 0) + 1

    def recorded(self, tenant: str, ok: bool) -> None:
        if self._metrics is not None:
            self._metrics.batch_line(tenant, ok)

    # -- files -----------------------------------------------------------------

    async def receive(self, chunks: AsyncIterator[bytes]) -> tuple[Path, int]:
        """Write an upload to disk as it comes (at most `batch.max_file_bytes`):
        its path, to hand to `add_file`, and its size."""
        limit = self.policy.batch.max_file_bytes
        part = self.store.files_dir / (new_id("upload-") + ".part")
        size = 0
        try:
            with part.open("wb") as out:
                async for chunk in chunks:
                    size += len(chunk)
                    if size > limit:
                        raise PayloadTooLarge(
                            f"The file is larger than {limit} bytes (batch.max_file_bytes)."
                        )
                    out.write(chunk)
        except BaseException:
            part.unlink(missing_ok=True)
            raise
        return part, size

    async def add_file(
        self, tenant: str, filename: str, purpose: str, part: Path, size: int
    ) -> FileRecord:
        """Check a received file (a batch input's lines, in a thread: it can be
        long) and keep it."""
        try:
            if purpose != "batch":
                raise BadRequest(
                    f"purpose {purpose[:40]!r} is not supported here; use \"batch\"",
                    param="purpose",
                )
            policy = self.policy
            lines = await asyncio.to_thread(
                check_input, part, policy.batch.max_lines, policy.server.max_body_bytes
            )
            record = FileRecord(
                new_id("file-"), tenant, filename[:255], purpose, size, self.now(), lines
            )
            part.replace(self.store.files_dir / record.id)
        finally:
            part.unlink(missing_ok=True)
        # Kept if this fails: a write whose answer was lost may have landed,
        # and a recorded file must have its content.
        await self.store.add_file(record)
        return record

    async def file(self, tenant: str, file_id: str) -> FileRecord:
        record = await self.store.get_file(tenant, file_id)
        if record is None:
            raise BatchObjectNotFound(f"No such File object: {file_id[:100]}", param="file_id")
        return record

    def file_path(self, record: FileRecord) -> Path:
        return self.store.files_dir / record.id

    async def delete_file(self, tenant: str, file_id: str) -> None:
        await self.file(tenant, file_id)
        # A job reads its input as it goes, and again after a restart, on
        # whichever replica drives it.
        for record in await self.store.active_batches():
            if record.input_file_id == file_id:
                raise FileInUse(
                    f"File {file_id} is the input of batch {record.id}, which has not "
                    "ended; cancel it first."
                )
        await self.store.delete_file(tenant, file_id)
        (self.store.files_dir / file_id).unlink(missing_ok=True)

    # -- batches ---------------------------------------------------------------

    async def create(
        self,
        tenant: str,
        own_tier: str,
        input_file_id: str,
        endpoint: str,
        completion_window: str,
        metadata: dict[str, str] | None,
    ) -> BatchRecord:
        if self._stopping:
            raise GatewayClosing()
        if endpoint not in ENDPOINTS:
            raise BadRequest(
                f"endpoint must be one of {', '.join(ENDPOINTS)}", param="endpoint"
            )
        try:
            window_s = completion_window_s(completion_window)
        except ValueError as exc:
            raise BadRequest(str(exc), param="completion_window") from None
        source = await self.file(tenant, input_file_id)
        if source.purpose != "batch":
            raise InvalidBatchFile(
                f"file {input_file_id} was not uploaded with purpose \"batch\"",
                param="input_file_id",
            )
        await asyncio.to_thread(check_endpoint, self.file_path(source), endpoint)
        policy = self.policy
        now = self.now()
        record = BatchRecord(
            id=new_id("batch_"), tenant=tenant, tier=policy.batch_tier(tenant, own_tier),
            endpoint=endpoint, input_file_id=input_file_id,
            completion_window=completion_window, created_at=now,
            expires_at=now + int(window_s), total=source.lines, metadata=metadata,
        )  # fmt: skip
        if self.leases is not None:
            # Held before it is recorded, so no other replica's timer takes
            # it (a new id's lease is free).
            await self.leases.acquire(record.id)
        try:
            await self.store.add_batch(record)
        except BaseException:
            if self.leases is not None:
                with contextlib.suppress(BatchStoreUnavailable):
                    await self.leases.release(record.id)
            raise
        self.moved(None, record.status)
        self._launch(record.copy())
        return record

    async def batch(self, tenant: str, batch_id: str) -> BatchRecord:
        job = self._jobs.get(batch_id)
        # Shared, the store is what every replica answers from alike.
        if self.leases is None and job is not None and job.record.tenant == tenant:
            return job.record.copy()
        record = await self.store.get_batch(tenant, batch_id)
        if record is None:
            raise BatchObjectNotFound(f"No such Batch object: {batch_id[:100]}", param="batch_id")
        return record

    async def list(self, tenant: str, after: str | None, limit: int) -> list[BatchRecord]:
        records = await self.store.list_batches(tenant, after=after, limit=limit)
        if self.leases is not None:
            return records
        return [await self.batch(tenant, r.id) if r.id in self._jobs else r for r in records]

    async def cancel(self, tenant: str, batch_id: str) -> BatchRecord:
        record = await self.batch(tenant, batch_id)
        if record.status == "cancelling":
            return record
        job = self._jobs.get(batch_id)
        if record.status in ("validating", "in_progress"):
            if job is not None and await job.cancel(self.now()):
                return await self.batch(tenant, batch_id)
            # Driven elsewhere, or by nobody until a replica takes it over.
            if self.leases is not None and await self.leases.request_cancel(batch_id, self.now()):
                return await self.batch(tenant, batch_id)
        raise BatchNotCancellable(
            f"Batch {batch_id} is {record.status} and can no longer be cancelled."
        )


class Job:
    """One batch being run: its lines fed to the gateway as capacity takes them."""

    def __init__(self, service: BatchService, record: BatchRecord) -> None:
        self.service = service
        self.record = record
        self.endpoint = ENDPOINTS[record.endpoint]
        self.ending: _Ending | None = None
        self.task: asyncio.Task[None] | None = None
        self._wake = asyncio.Event()
        self._tasks: dict[int, asyncio.Task[None]] = {}
        self._streams: dict[int, RequestStream] = {}
        # Lines started and not yet answering (queued, prefilling, or being admitted).
        self._waiting: set[int] = set()
        # The tasks reading an answer now, by line; and whether `cut` was called.
        self._reading: dict[int, asyncio.Task[None]] = {}
        self._cut = False
        # Lines waiting to be tried again: (due, line number, item, tries so far).
        self._retry: list[tuple[float, int, dict[str, Any], int]] = []
        self._retry_timer: asyncio.TimerHandle | None = None
        self._deadline: asyncio.TimerHandle | None = None
        self._loop = asyncio.get_running_loop()
        self.renewed_at = self._loop.time()
        """When its lease was last renewed (asked; leases only)."""
        self.lost = False
        """Its lease was lost: it stopped, and another replica drives it."""

    @property
    def _store(self) -> BatchStore:
        return self.service.store

    def end(self, why: _Ending) -> None:
        """Stop feeding lines; the job then ends as `why` says."""
        if self.ending is None or (self.ending != "closing" and why == "closing"):
            self.ending = why
        self._wake.set()

    def lose(self) -> None:
        """Its lease is gone: stop as a stopping gateway does, at once."""
        if not self.lost:
            self.lost = True
            log.warning("batch %s: its lease was lost; another replica drives it now",
                        self.record.id)  # fmt: skip
        self.halt()

    def halt(self) -> None:
        """Stop as a stopping gateway does, at once: the lines without a
        result run again under whoever drives the job next."""
        self.end("closing")
        self.cut()

    async def cancel(self, at: int) -> bool:
        """Cancel it here (asked at `at`); whether it was still cancellable
        by this driver."""
        if self.lost or self.record.status not in ("validating", "in_progress"):
            return False
        self.record.times.setdefault("cancelling_at", at)
        try:
            await self.set_status("cancelling")
        except LeaseLost:
            self.lose()
            return False
        self.end("cancelled")
        return True

    def cut(self) -> None:
        """End the lines admitted now, as a client that leaves ends its
        request: the tasks reading their answers are cancelled (which closes
        their streams), and those about to read close theirs instead."""
        self._cut = True
        for task in list(self._reading.values()):
            task.cancel()

    async def set_status(self, status: str) -> None:
        record = self.record
        before = record.status
        if before == status:
            return
        record.status = status  # type: ignore[assignment]
        if status != "validating":
            record.times.setdefault(f"{status}_at", self.service.now())
        await self._store.save_batch(record)
        self.service.moved(before, status)

    # -- the job -----------------------------------------------------------------

    async def run(self) -> None:
        try:
            await self._run()
        except (LeaseLost, BatchStoreUnavailable) as exc:
            if isinstance(exc, LeaseLost):
                self.lose()
            else:
                # An outage, not the job's failure: it stops where it stands,
                # its lease goes (or runs out), and a lease round resumes it,
                # here or on another replica, once the store answers.
                log.warning("batch %s: the store did not answer (%s); it stops here and "
                            "is taken over once it does", self.record.id, exc)  # fmt: skip
                self.halt()
            if self._tasks:
                await asyncio.gather(*self._tasks.values(), return_exceptions=True)
        except Exception:
            log.exception("batch %s failed", self.record.id)
            with contextlib.suppress(Exception):
                self.record.errors = [{"code": "internal_error", "line": None, "param": None,
                                       "message": "The batch failed; see the gateway's log."}]
                await self.set_status("failed")
        finally:
            for timer in (self._retry_timer, self._deadline):
                if timer is not None:
                    timer.cancel()
            leases = self.service.leases
            if leases is not None:
                try:
                    await leases.release(self.record.id)
                except BatchStoreUnavailable as exc:
                    log.warning("batch %s: could not let its lease go (%s); it runs out",
                                self.record.id, exc)  # fmt: skip

    async def _run(self) -> None:
        record = self.record
        await self._settle_journal()
        if record.status == "validating":
            await self.set_status("in_progress")
        if record.status == "in_progress":
            left_s = record.expires_at - self.service.clock()
            self._deadline = self._loop.call_at(self._loop.time() + left_s, self.end, "expired")
            await self._feed()
            if self.ending == "closing":
                return
            if self.ending == "cancelled":
                await self.set_status("cancelling")
        if record.status == "cancelling":
            await self._record_unrun("cancelled")
            final = "cancelled"
        elif self.ending == "expired":
            await self._record_unrun("expired")
            final = "expired"
        else:
            final = record.outcome or "completed"
        # Every try has ended: each journalled one is settled as recorded.
        await self._settle_journal()
        await self._finalize(final)

    async def _settle_journal(self) -> None:
        """Settle every journalled try from what was recorded (its result's
        tokens, or nothing), then take it out of the journal: what a crash
        left unsettled is settled now; what was settled stays as it is."""
        guard = self.service.gateway.quotas
        for entry in await self._store.journal(self.record.id):
            charged = entry.charged or 0
            try:
                await guard.settle_recorded(entry.tenant, entry.request_id, charged, charged > 0)
            except QuotaStoreError as exc:
                # Kept: the next pass (a restart, the job's end) settles it.
                log.warning("batch %s line %d: could not settle its try %s (%s)",
                            self.record.id, entry.line_no, entry.request_id, exc)  # fmt: skip
                continue
            await self._store.line_unsent(self.record.id, entry.request_id)

    async def _pending(self) -> AsyncIterator[tuple[int, bytes]]:
        """The input's lines without a result, read as they are needed."""
        path = self.service.store.files_dir / self.record.input_file_id
        done = self._store.recorded(self.record.id)
        next_done = await anext(done, None)
        for number, raw in input_lines(path):
            while next_done is not None and next_done < number:
                next_done = await anext(done, None)
            if next_done == number:
                continue
            yield number, raw

    async def _feed(self) -> None:
        cfg = self.service.policy.batch
        cap, waiting_cap = cfg.in_flight_per_job, cfg.waiting_per_job
        lines = self._pending()
        exhausted = False

        def room() -> bool:
            return len(self._tasks) < cap and len(self._waiting) < waiting_cap

        while self.ending is None:
            now = self._loop.time()
            while room():
                if self._retry and self._retry[0][0] <= now:
                    _, number, item, tries = heapq.heappop(self._retry)
                    self._start(number, item, tries)
                elif (not exhausted and len(self._tasks) + len(self._retry) < cap
                      and len(self._waiting) + len(self._retry) < waiting_cap):
                    nxt = await anext(lines, None)
                    if nxt is None:
                        exhausted = True
                    else:
                        number, raw = nxt
                        self._start(number, parse_item(number, raw), 0)
                else:
                    break
            if exhausted and not self._tasks and not self._retry:
                return
            self._wake.clear()
            if self._retry and room():
                self._arm(self._retry[0][0])
            if self.ending is None:
                await self._wake.wait()
        if self.ending != "closing":
            self.cut()
        if self._tasks:
            await asyncio.gather(*self._tasks.values(), return_exceptions=True)

    def _arm(self, when: float) -> None:
        if self._retry_timer is not None:
            self._retry_timer.cancel()
        self._retry_timer = self._loop.call_at(when, self._wake.set)

    def _start(self, number: int, item: dict[str, Any], tries: int) -> None:
        task = self._loop.create_task(self._line(number, item, tries))
        self._tasks[number] = task
        self._waiting.add(number)

        def done(_: asyncio.Task[None]) -> None:
            self._tasks.pop(number, None)
            self._streams.pop(number, None)
            self._waiting.discard(number)
            self._wake.set()

        task.add_done_callback(done)

    # -- one line ----------------------------------------------------------------

    async def _line(self, number: int, item: dict[str, Any], tries: int) -> None:
        try:
            await self._try(number, item, tries)
        except LeaseLost:
            self.lose()
        except BatchStoreUnavailable as exc:
            # Its result (or its try) could not be written: not the line's
            # fault. It runs again after a wait; the try is refunded.
            log.warning("batch %s line %d: the store did not answer (%s); it runs again",
                        self.record.id, number, exc)  # fmt: skip
            self._again(number, item, tries, exc)
        except Exception:
            # A bug: the line gets an error line rather than go missing from
            # both files (what it reserved stays charged).
            log.exception("batch %s line %d", self.record.id, number)
            custom_id = item["custom_id"]
            error = GatewayError("The server had an error processing this request.")
            with contextlib.suppress(Exception):
                await self._record(number, custom_id, False, _error_line(custom_id, "", error))

    async def _try(self, number: int, item: dict[str, Any], tries: int) -> None:
        record = self.record
        gateway = self.service.gateway
        backend = gateway.backend
        custom_id = item["custom_id"]
        request_id = new_id("")
        body = item["body"]
        try:
            parsed = validate_body(self.endpoint, body, backend.models, backend.support)
            if parsed.stream:
                raise BadRequest("stream is not supported in a batch", param="stream")
        except GatewayError as exc:
            model = body.get("model") if isinstance(body, dict) else None
            gateway.refused(record.tier, exc.outcome, tenant=record.tenant, model=model)
            await self._record(number, custom_id, False, _error_line(custom_id, request_id, exc))
            return
        if gateway.quotas.limits(record.tenant) is not None:
            await self._store.line_sent(record.id, number, request_id, record.tenant)
        ask = Ask(
            request_id=request_id, tenant=record.tenant, tier=record.tier,
            endpoint=self.endpoint, body=body, asked_max_tokens=parsed.asked_max_tokens,
            asked_field=parsed.asked_field, min_tokens=parsed.min_tokens,
            priority_offset=min(parsed.priority or 0, MAX_PRIORITY_OFFSET),
        )  # fmt: skip
        try:
            stream = await gateway.admit(ask, hold_settlement=True)
        except GatewayError as exc:
            if self._again(number, item, tries, exc):
                return
            await self._record(number, custom_id, False, _error_line(custom_id, request_id, exc))
            return
        self._streams[number] = stream
        stream.on_first_output(lambda: self._answering(number))
        call = Call(
            endpoint=self.endpoint, response_id=("chatcmpl-" if self.endpoint == "chat"
                                                 else "cmpl-") + request_id,
            created=self.service.now(), model=parsed.model,
            prompt_tokens=stream.request.prompt_tokens, include_usage=False,
        )  # fmt: skip
        answer, error = await self._read(number, stream, call)
        outcome = stream.request.outcome
        if outcome is Outcome.COMPLETED and answer is not None:
            text = output_line(custom_id, request_id, 200, answer)
            await self._record(number, custom_id, True, text, stream)
        elif error is None and self.ending in ("expired", "cancelled"):
            await self._record(number, custom_id, False, unrun_line(custom_id, self.ending),
                               stream)  # fmt: skip
        elif error is None or self._again(number, item, tries, error, dry=True):
            # Cut off by a stop, or refused for load: not this line's fault.
            # Refunded; the journal keeps the try until the job settles it
            # again (a no-op once this has reached the store).
            gateway.settle_held(stream, refund=True)
            if error is not None:
                self._again(number, item, tries, error)
        else:
            await self._record(number, custom_id, False,
                               _error_line(custom_id, request_id, error), stream)  # fmt: skip

    def _answering(self, number: int) -> None:
        """The line's first output came: it runs, and the next may wait in its place."""
        self._waiting.discard(number)
        self._wake.set()

    async def _read(
        self, number: int, stream: RequestStream, call: Call
    ) -> tuple[dict[str, Any] | None, GatewayError | None]:
        """The line's answer, or the error it ended with; (None, None) when
        the job cut it off."""
        if self._cut:
            await stream.aclose()
            return None, None
        task = asyncio.current_task()
        assert task is not None
        self._reading[number] = task
        try:
            return await answer_body(stream, call), None
        except GatewayError as exc:
            return None, exc
        except asyncio.CancelledError:
            if not self._cut or task.uncancel():
                raise
            # The job's own cut (the stream is closed already).
            return None, None
        finally:
            self._reading.pop(number, None)

    def _again(
        self, number: int, item: dict[str, Any], tries: int, exc: GatewayError, *, dry: bool = False
    ) -> bool:
        """Whether the line is tried again after `exc` (and, unless `dry`,
        put in the queue of retries): a refusal for load or quota that a wait
        can help, or a backend failure while tries are left."""
        cfg = self.service.policy.batch
        if isinstance(exc, BackendFailed):
            again = tries + 1 < cfg.backend_attempts
        elif isinstance(exc, QuotaExceeded):
            again = exc.retry_after_s is not None
        else:
            again = isinstance(
                exc, QueueFull | Overloaded | Expired | BackendUnavailableError
                | QuotaStoreUnavailable | BatchStoreUnavailable,
            )
        if not again or dry or self.ending is not None:
            return again
        wait = min(cfg.retry_max_s, cfg.retry_initial_s * 2 ** min(tries, 30))
        if exc.retry_after_s is not None:
            wait = min(cfg.retry_max_s, max(wait, exc.retry_after_s))
        heapq.heappush(self._retry, (self._loop.time() + wait, number, item, tries + 1))
        return True

    async def _record(
        self, number: int, custom_id: str, ok: bool, text: str,
        stream: RequestStream | None = None,
    ) -> None:  # fmt: skip
        """The line's result, committed; then the settlement it holds."""
        owed = stream.owed if stream is not None else None
        tokens = owed[0] if owed is not None else 0
        request_id = stream.request.id if stream is not None else ""
        try:
            await self._store.record(
                self.record.id, LineResult(number, custom_id, ok, text, tokens, request_id)
            )
        except (LeaseLost, BatchStoreUnavailable):
            # Not recorded: the line runs again (under the job's driver now,
            # for a lost lease), and this try is refunded.
            if stream is not None:
                self.service.gateway.settle_held(stream, refund=True)
            raise
        if ok:
            self.record.completed += 1
        else:
            self.record.failed += 1
        self.service.recorded(self.record.tenant, ok)
        if stream is not None:
            self.service.gateway.settle_held(stream)

    async def _record_unrun(self, why: Literal["expired", "cancelled"]) -> None:
        """Every line still without a result, as an error line saying `why`."""
        async for number, raw in self._pending():
            custom_id = parse_item(number, raw)["custom_id"]
            await self._record(number, custom_id, False, unrun_line(custom_id, why))

    async def _finalize(self, final: str) -> None:
        """Write the output and error files from the recorded results (again,
        whole, after a crash in between) and end the job."""
        record = self.record
        record.outcome = final
        await self.set_status("finalizing")
        store = self._store
        names = {True: record.id + "_output.jsonl", False: record.id + "_error.jsonl"}
        ids = {True: "file-" + record.id.removeprefix("batch_") + "o",
               False: "file-" + record.id.removeprefix("batch_") + "e"}  # fmt: skip
        # Parts of their own: a driver that lost the job may still be writing.
        parts = {ok: store.files_dir / f"{ids[ok]}.{new_id('')}.part" for ok in (True, False)}
        counts = {True: 0, False: 0}
        with parts[True].open("w") as out, parts[False].open("w") as err:
            async for result in store.results(record.id):
                (out if result.ok else err).write(result.text + "\n")
                counts[result.ok] += 1
        for ok in (True, False):
            if counts[ok]:
                path = store.files_dir / ids[ok]
                parts[ok].replace(path)
                if await store.get_file(record.tenant, ids[ok]) is None:
                    await store.add_file(FileRecord(
                        ids[ok], record.tenant, names[ok], "batch_output",
                        path.stat().st_size, self.service.now(), counts[ok],
                    ))  # fmt: skip
                if ok:
                    record.output_file_id = ids[ok]
                else:
                    record.error_file_id = ids[ok]
            else:
                parts[ok].unlink(missing_ok=True)
        await self.set_status(final)


def _error_line(custom_id: str, request_id: str, exc: GatewayError) -> str:
    return output_line(custom_id, request_id, exc.status, exc.body())

