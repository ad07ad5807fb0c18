"""The request trace: one JSONL line per request when it ends, in the format
`qosgate simulate` replays (docs/SIMULATE.md, "The JSONL trace format").

Only sizes, names and the outcome are written, never prompt or output text.
Lines are buffered and written together on a `call_at` timer and at close, so
a request costs a dict and a list append; a disk that fails (full, path not
writable) is logged once per failing spell and counted, and never fails a
request.
"""

from __future__ import annotations

import asyncio
import json
import logging
import os
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from qosgate.config.models import TraceConfig

log = logging.getLogger(__name__)

TRACE_TIME_DIGITS = 6
"""Arrival times are written to the microsecond."""


def trace_line(
    *, t: float, tenant: str, tier: str, prompt_tokens: int, max_tokens: int,
    output_tokens: int, outcome: str,
) -> str:  # fmt: skip
    """One record of the trace format, as a line (with its newline)."""
    record = {
        "t": round(max(0.0, t), TRACE_TIME_DIGITS),
        "tenant": tenant,
        "tier": tier,
        "prompt_tokens": prompt_tokens,
        "max_tokens": max_tokens,
        "output_tokens": output_tokens,
        "outcome": outcome,
    }
    return json.dumps(record, separators=(", ", ": ")) + "\n"


class TraceWriter:
    """Appends trace records to `config.path`, rotating it by size.

    Each file's times count from when that file was started (the writer's
    start, or its rotation), so any one file replays as it is. A request that
    arrived before its file was started (in flight across a rotation) is
    written at t = 0. A file left by an earlier run is rotated away at start
    rather than appended to, for the same reason.
    """

    def __init__(
        self, config: TraceConfig, *, on_dropped: Callable[[int], None] | None = None
    ) -> None:
        self.config = config
        self._path = Path(config.path)
        self._on_dropped = on_dropped
        # The clock the arrivals are read on; the gateway's loop's, from start().
        self._clock: Callable[[], float] = time.monotonic
        self._epoch = 0.0
        self._lines: list[tuple[float, dict[str, Any]]] = []
        self._size: int | None = None
        self._timer: asyncio.TimerHandle | None = None
        self._failing = False
        self._started = False
        self.written = 0
        """Lines written so far."""
        self.dropped = 0
        """Lines lost: the disk failed, or the buffer was full."""

    def start(self, clock: Callable[[], float] | None = None) -> None:
        """Begin the first file, its times counted on `clock` (the arrivals'
        clock) from now. An old file at the path is rotated away."""
        if clock is not None:
            self._clock = clock
        self._started = True
        try:
            if self._path.stat().st_size > 0:
                self._rotate()
        except FileNotFoundError:
            pass
        except OSError as exc:
            self._failed(exc, 0)
        self._epoch = self._clock()
        self._size = 0

    def record(
        self, *, arrival: float, tenant: str, tier: str, prompt_tokens: int, max_tokens: int,
        output_tokens: int, outcome: str,
    ) -> None:  # fmt: skip
        """Buffer one request's line; the timer writes it."""
        if len(self._lines) >= self.config.max_buffered:
            self._drop(1)
            return
        # Rendered at the flush: the time counts from the file the line lands in.
        self._lines.append((arrival, {
            "tenant": tenant, "tier": tier, "prompt_tokens": prompt_tokens,
            "max_tokens": max_tokens, "output_tokens": output_tokens, "outcome": outcome,
        }))  # fmt: skip
        if self._timer is None:
            try:
                loop = asyncio.get_running_loop()
            except RuntimeError:
                # No loop to wait on (a synchronous caller): write it now.
                self.flush()
                return
            self._timer = loop.call_at(loop.time() + self.config.flush_interval_s, self._on_timer)

    def _on_timer(self) -> None:
        self._timer = None
        self.flush()

    def flush(self) -> None:
        """Write the buffered lines, rotating where a file reaches rotate_bytes."""
        if self._timer is not None:
            self._timer.cancel()
            self._timer = None
        if not self._lines:
            return
        if not self._started:
            self.start()
        lines, self._lines = self._lines, []
        written = 0
        try:
            handle = None
            try:
                for arrival, fields in lines:
                    assert self._size is not None
                    if self._size >= self.config.rotate_bytes:
                        if handle is not None:
                            handle.close()
                            handle = None
                        self._rotate()
                        self._epoch = self._clock()
                        self._size = 0
                    if handle is None:
                        handle = self._path.open("a", encoding="utf-8")
                    text = trace_line(t=arrival - self._epoch, **fields)
                    handle.write(text)
                    self._size += len(text.encode("utf-8"))
                    written += 1
            finally:
                if handle is not None:
                    handle.close()
        except OSError as exc:
            # What was written before the failure may be only partly on disk;
            # counted as written, the rest as lost.
            self.written += written
            self._failed(exc, len(lines) - written)
            return
        self.written += written
        if self._failing:
            self._failing = False
            log.warning("trace %s: writing again", self._path)

    def _rotate(self) -> None:
        """PATH -> PATH.1 -> ... -> PATH.<keep>; the oldest is deleted."""
        keep = self.config.keep
        path = str(self._path)
        if keep == 0:
            os.unlink(path)
            return
        oldest = f"{path}.{keep}"
        if os.path.exists(oldest):
            os.unlink(oldest)
        for n in range(keep - 1, 0, -1):
            src = f"{path}.{n}"
            if os.path.exists(src):
                os.replace(src, f"{path}.{n + 1}")
        os.replace(path, f"{path}.1")

    def _failed(self, exc: OSError, lost: int) -> None:
        if not self._failing:
            self._failing = True
            log.error("trace %s: cannot write (%s); lines are dropped until it can", self._path, exc)
        # The file's size is unknown now; measure it again on the next flush.
        try:
            self._size = self._path.stat().st_size
        except OSError:
            self._size = 0
        self._drop(lost)

    def _drop(self, count: int) -> None:
        if count <= 0:
            return
        self.dropped += count
        if self._on_dropped is not None:
            self._on_dropped(count)
