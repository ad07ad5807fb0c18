"""The load generator's worker processes, seen from the parent.

One asyncio client saturates its own core and then skews its own timings, so
the requests of a run are spread over worker processes (spawned, so it works
the same wherever it is imported from). Each job is sent to the workers,
armed, then started at one instant a little ahead on the monotonic clock,
which every process on the machine shares.

A worker that dies or fails a job returns no records for its share; those
requests then count as lost, never as silently absent.
"""

from __future__ import annotations

import contextlib
import multiprocessing
import time
from dataclasses import dataclass, field
from multiprocessing.connection import Connection, wait
from collections.abc import Callable
from typing import Any, Self

from qosgate.bench.client import worker_main

# Time between the last worker arming and the start instant: enough for the
# `go` messages to arrive everywhere.
_START_MARGIN_S = 0.02
_READY_TIMEOUT_S = 60.0


class PoolError(RuntimeError):
    """The worker processes could not be started."""


@dataclass
class JobResult:
    records: list[tuple]
    """Every record the workers returned, in no particular order (times
    relative to the job's start instant)."""
    client_cpu_s: float = 0.0
    """CPU the workers spent on this job, summed."""
    failures: list[str] = field(default_factory=list)
    """Tracebacks or exit reasons of workers that returned no records."""


class WorkerPool:
    """`workers` load-generator processes; use as a context manager."""

    def __init__(self, workers: int) -> None:
        if workers < 1:
            raise ValueError("workers must be at least 1")
        self.size = workers
        self._ctx = multiprocessing.get_context("spawn")
        self._procs: list[Any] = []
        self._conns: list[Connection] = []
        self.pids: list[int] = []

    def __enter__(self) -> Self:
        self.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def start(self) -> None:
        for _ in range(self.size):
            parent, child = self._ctx.Pipe()
            proc = self._ctx.Process(target=worker_main, args=(child,), daemon=True)
            proc.start()
            child.close()
            self._procs.append(proc)
            self._conns.append(parent)
        deadline = time.monotonic() + _READY_TIMEOUT_S
        for proc, conn in zip(self._procs, self._conns):
            remaining = max(0.0, deadline - time.monotonic())
            ready = wait([conn, proc.sentinel], timeout=remaining)
            if conn not in ready:
                self.close()
                raise PoolError(f"load generator process {proc.pid} did not start")
            message = conn.recv()
            self.pids.append(message[1])

    def close(self) -> None:
        for conn in self._conns:
            with contextlib.suppress(OSError, ValueError):
                conn.send(("stop",))
        for proc in self._procs:
            proc.join(timeout=5)
            if proc.is_alive():
                proc.terminate()
                proc.join(timeout=5)
        for conn in self._conns:
            conn.close()
        self._procs.clear()
        self._conns.clear()

    def run(
        self, kind: str, cfg: dict[str, Any], payloads: list[Any],
        on_progress: Callable[[int, int], None] | None = None,
    ) -> JobResult:  # fmt: skip
        """Run one job: payloads[i] goes to worker i (fewer payloads than
        workers leave the rest idle). Blocks until every worker answered.
        `on_progress(finished, completed)` gets the job's counts, summed over
        the workers, as they report them while it runs."""
        if len(payloads) > self.size:
            raise ValueError(f"{len(payloads)} payloads for {self.size} workers")
        active = list(range(len(payloads)))
        failures: list[str] = []
        for i in active:
            self._conns[i].send((kind, cfg, payloads[i]))
        armed: list[int] = []
        for i in active:
            reply = self._reply(i)
            if reply is None or reply[0] != "armed":
                failures.append(self._why(i, reply))
            else:
                armed.append(i)
        start = time.monotonic() + _START_MARGIN_S
        for i in armed:
            self._conns[i].send(("go", start))
        records: list[tuple] = []
        cpu = 0.0
        pending = set(armed)
        counts: dict[int, tuple[int, int]] = {}
        while pending:
            conns = {self._conns[i]: i for i in pending}
            sentinels = {self._procs[i].sentinel: i for i in pending}
            for ready in wait([*conns, *sentinels]):
                i = conns.get(ready)  # type: ignore[call-overload]
                if i is None:
                    i = sentinels[ready]  # type: ignore[index]
                    if i in pending and not self._conns[i].poll():
                        pending.discard(i)
                        failures.append(self._why(i, None))
                    continue
                if i not in pending:
                    continue
                reply = self._reply(i)
                if reply is not None and reply[0] == "progress":
                    counts[i] = (reply[1], reply[2])
                    if on_progress is not None:
                        on_progress(*(sum(c) for c in zip(*counts.values())))
                    continue
                pending.discard(i)
                if reply is not None and reply[0] == "done":
                    records.extend(reply[1])
                    cpu += float(reply[2].get("cpu_s", 0.0))
                else:
                    failures.append(self._why(i, reply))
        return JobResult(records, cpu, failures)

    def _reply(self, i: int) -> tuple | None:
        conn, proc = self._conns[i], self._procs[i]
        ready = wait([conn, proc.sentinel])
        if conn in ready or conn.poll():
            try:
                return conn.recv()
            except (EOFError, OSError):
                return None
        return None

    def _why(self, i: int, reply: tuple | None) -> str:
        proc = self._procs[i]
        if reply is not None and reply[0] == "failed":
            return f"worker {proc.pid}: {reply[1]}"
        if not proc.is_alive():
            return f"worker {proc.pid} exited with code {proc.exitcode}"
        return f"worker {proc.pid}: unexpected reply {reply!r:.200}"


def split_open(specs: list[tuple], workers: int) -> list[list[tuple]]:
    """Round-robin by send time, so each worker carries an even share of every
    stretch of the run."""
    count = max(1, min(workers, len(specs)))
    return [specs[i::count] for i in range(count)]


def split_users(concurrency: int, workers: int) -> list[list[int]]:
    """User ids 0..concurrency-1 spread evenly over at most `workers` processes."""
    count = max(1, min(workers, concurrency))
    return [list(range(i, concurrency, count)) for i in range(count)]
