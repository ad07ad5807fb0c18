"""A backend the test drives by hand: each request runs until the test emits its
tokens, finishes it or fails it, so a test can hold work running for as long
as it needs without sleeping. It records what the gateway asked of it."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass, field
from typing import Any

from qosgate.backends.base import Backend, BackendUnavailable, Chunk, GenerationJob
from qosgate.core.scheduler import BackendCapacity

_END = object()


@dataclass(eq=False)
class FakeRun:
    job: GenerationJob
    queue: asyncio.Queue = field(default_factory=asyncio.Queue)
    tokens: int = 0


class FakeBackend(Backend):
    models = ("fake-model",)

    def __init__(self, slots: int = 1, kv_tokens: int = 1 << 30, *, ready: bool = True) -> None:
        self.slots = slots
        self.kv_tokens = kv_tokens
        self._ready = ready
        self.running: dict[str, FakeRun] = {}
        self.started: asyncio.Queue[str] = asyncio.Queue()
        """Request ids in the order generate() was called: await .get() for the next."""
        self.jobs: list[GenerationJob] = []
        self.aborted: list[str] = []
        self.max_running = 0
        self.violations: list[str] = []
        self.unavailable = False
        """generate() raises BackendUnavailable while set."""
        self.closed = False
        self.gone_error: BackendUnavailable | None = None
        """What gone() reports: set it for a backend that will not come back."""
        self._listener: Callable[[], None] | None = None

    # -- the port ------------------------------------------------------------

    async def start(self) -> None:
        pass

    async def close(self) -> None:
        self.closed = True
        for request_id in list(self.running):
            self.abort(request_id)

    def ready(self) -> bool:
        return self._ready and self.gone_error is None

    def gone(self) -> BackendUnavailable | None:
        return self.gone_error

    def capacity(self) -> BackendCapacity:
        used = sum(run.job.prompt_tokens + run.job.max_tokens for run in self.running.values())
        return BackendCapacity(
            max(0, self.slots - len(self.running)), max(0, self.kv_tokens - used), self.kv_tokens
        )

    def set_capacity_listener(self, listener: Callable[[], None]) -> None:
        self._listener = listener

    def count_prompt_tokens(self, endpoint: str, body: dict[str, Any]) -> int:
        return 1

    def generate(self, job: GenerationJob) -> AsyncIterator[Chunk]:
        if self.unavailable:
            raise BackendUnavailable("fake backend is down", retry_after_s=7.0)
        if len(self.running) >= self.slots:
            self.violations.append(f"{job.request_id} started with {len(self.running)} running")
        run = FakeRun(job)
        self.running[job.request_id] = run
        self.max_running = max(self.max_running, len(self.running))
        self.jobs.append(job)
        self.started.put_nowait(job.request_id)
        return self._stream(run)

    async def _stream(self, run: FakeRun) -> AsyncIterator[Chunk]:
        ended = False
        try:
            while True:
                item = await run.queue.get()
                if item is _END:
                    return
                if isinstance(item, BaseException):
                    ended = True
                    raise item
                yield item
                if item.finish_reason is not None:
                    ended = True
                    return
        finally:
            request_id = run.job.request_id
            if self.running.get(request_id) is run:
                del self.running[request_id]
                if not ended:
                    # Closed before its end: the port says that is an abort.
                    self.aborted.append(request_id)
                self._notify()

    def abort(self, request_id: str) -> None:
        run = self.running.pop(request_id, None)
        if run is None:
            return
        self.aborted.append(request_id)
        run.queue.put_nowait(_END)
        self._notify()

    # -- the test's controls -------------------------------------------------

    def set_ready(self, ready: bool) -> None:
        self._ready = ready
        if ready:
            self._notify()

    def emit(self, request_id: str, tokens: int = 1) -> None:
        run = self.running[request_id]
        run.tokens += tokens
        run.queue.put_nowait(Chunk(text="x" * tokens, tokens=tokens))

    def finish(self, request_id: str, tokens: int = 1) -> None:
        run = self.running[request_id]
        run.tokens += tokens
        prompt = run.job.prompt_tokens
        run.queue.put_nowait(Chunk(
            text="y" * tokens, tokens=tokens, finish_reason="stop",
            usage={"prompt_tokens": prompt, "completion_tokens": run.tokens,
                   "total_tokens": prompt + run.tokens},
        ))  # fmt: skip

    def fail(self, request_id: str, error: BaseException) -> None:
        self.running[request_id].queue.put_nowait(error)

    def _notify(self) -> None:
        if self._listener is not None:
            self._listener()
