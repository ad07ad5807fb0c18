"""The simulated GPU as a live backend: `SimEngine` run in real time.

One background task steps the engine and, after each step, sleeps for the
step's modelled duration divided by `speed` -- that sleep stands for the GPU
working, it is not a poll -- then hands every sequence's new tokens to its
stream. With no work it waits on an event that `generate` sets, so an idle
backend costs nothing.

Requests go into the engine with the output length they will really produce
(the engine needs it up front): `max_tokens`, or a log-normal draw seeded by
the request id when `output_median_tokens` is set.
"""

from __future__ import annotations

import asyncio
import contextlib
import math
import random
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from typing import Any

from prometheus_client import CollectorRegistry
from prometheus_client.core import CounterMetricFamily
from prometheus_client.registry import Collector

from qosgate.backends.base import Backend, BackendError, BackendUnavailable, Chunk, GenerationJob
from qosgate.backends.sim import SimEngine, StepResult
from qosgate.backends.tokens import estimate_prompt_tokens
from qosgate.backends import support
from qosgate.config.models import SimBackendConfig
from qosgate.core.scheduler import BackendCapacity

OUTPUT_SIGMA = 0.9
"""Spread (sigma of the log) of output lengths around `output_median_tokens`."""

_WORDS = (
    "the", "quick", "brown", "fox", "jumps", "over", "a", "lazy", "dog", "while",
    "simulated", "tokens", "stream", "from", "an", "imaginary", "GPU", "in", "real", "time",
)  # fmt: skip

SIM_MAX_MODEL_LEN = 131_072
"""The context every profile's model has (Llama 3.1's): longer asks get a 400,
as from a real server of that model."""


def filler_text(start: int, count: int) -> str:
    """Output tokens `start` .. `start + count - 1` of any simulated stream, one
    word per token; streams are deterministic so tests can check order."""
    n = len(_WORDS)
    return "".join((" " if i else "") + _WORDS[i % n] for i in range(start, start + count))


def step_end(now: float, last_end: float | None, duration: float) -> float:
    """When a step of `duration` (real seconds) begun by the engine loop at
    `now` ends. A busy GPU runs its steps back to back, so a step starts when
    the last one ended (`last_end`; None after an idle spell), not when the
    loop got round to it: the time spent delivering tokens and waking up late
    must not slow the modelled GPU down (it did, by some 8% at speed 1). The
    lag carried over is at most one step, so a stalled host does not buy a
    burst of instant steps afterwards."""
    if last_end is None:
        return now + duration
    return min(now, max(last_end, now - duration)) + duration


_END = object()
"""Queued to a stream that ends without a last chunk (aborted)."""


@dataclass(eq=False)
class _Live:
    """One request inside the engine, as its stream sees it."""

    id: str
    prompt_tokens: int
    output_tokens: int
    finish_reason: str
    queue: asyncio.Queue = field(default_factory=asyncio.Queue)
    sent: int = 0
    """Output tokens delivered. After an engine preemption the sequence is
    recomputed from scratch; tokens the client already has are not sent again."""


ENGINE_PREFIX = "qosgate_sim_"
"""The simulated engine's own series on /metrics (as `vllm:` is vLLM's)."""


class _EngineSeries(Collector):
    """The engine's time, read at scrape time: a GPU's utilisation, modelled."""

    def __init__(self, backend: SimBackend) -> None:
        self._backend = backend

    def collect(self) -> Any:
        engine = self._backend.engine
        for name, text, value in (
            ("step_seconds", "Modelled GPU seconds the simulated engine spent in steps",
             engine.step_seconds),
            ("saturated_step_seconds",
             "Of those, seconds in steps that did all the engine can do in one: every "
             "slot running, the whole token budget used, or the KV cache full",
             engine.saturated_seconds),
            ("preemptions", "Sequences the simulated engine preempted for lack of KV",
             self._backend.engine_preemptions),
        ):  # fmt: skip
            family = CounterMetricFamily(f"{ENGINE_PREFIX}{name}", text)
            family.add_metric([], value)
            yield family


class SimBackend(Backend):
    """The `Backend` port over a real-time `SimEngine`."""

    def __init__(self, cfg: SimBackendConfig) -> None:
        self.cfg = cfg
        self.models: tuple[str, ...] = (cfg.model,)
        self.support = support.SIM
        self.max_model_len = SIM_MAX_MODEL_LEN
        self.engine = SimEngine.from_config(cfg)
        self._speed = cfg.speed
        self._live: dict[str, _Live] = {}
        self._work = asyncio.Event()
        self._task: asyncio.Task | None = None
        self._ready = False
        self.engine_preemptions = 0
        """Sequences the engine preempted for lack of KV (recomputed)."""
        registry = CollectorRegistry(auto_describe=True)
        registry.register(_EngineSeries(self))
        self.engine_metrics = (registry, ENGINE_PREFIX)

    @property
    def step_tokens(self) -> int:
        return self.engine.max_num_batched_tokens

    @property
    def arrival_order_queue(self) -> bool:  # type: ignore[override]
        return self.engine.scheduling_policy == "fcfs"

    # -- lifecycle -----------------------------------------------------------

    async def start(self) -> None:
        if self._task is not None:
            return
        self._task = asyncio.get_running_loop().create_task(self._run(), name="sim-backend")
        self._task.add_done_callback(self._on_task_done)
        self._ready = True
        self._notify()

    async def close(self) -> None:
        self._ready = False
        task, self._task = self._task, None
        if task is not None:
            task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await task
        self._fail_all(BackendUnavailable("the simulated backend was closed"))

    def ready(self) -> bool:
        return self._ready

    def capacity(self) -> BackendCapacity:
        return self.engine.capacity()

    def count_prompt_tokens(self, endpoint: str, body: dict[str, Any]) -> int:
        return estimate_prompt_tokens(endpoint, body)

    def output_length(self, request_id: str, max_tokens: int) -> int:
        """Tokens this request will produce (deterministic per request id)."""
        median = self.cfg.output_median_tokens
        if median is None:
            return max_tokens
        # A str seed goes through SHA-512, so the draw is the same in every process.
        draw = random.Random(request_id).lognormvariate(math.log(median), OUTPUT_SIGMA)
        return max(1, min(max_tokens, round(draw)))

    # -- requests ------------------------------------------------------------

    def generate(self, job: GenerationJob) -> AsyncIterator[Chunk]:
        # Not an async generator itself: the job enters the engine (and its
        # capacity) now, not when the caller first iterates.
        if not self._ready:
            raise BackendUnavailable("the simulated backend is not running")
        if job.request_id in self._live:
            raise BackendError(f"request {job.request_id!r} is already running")
        kv = self.engine.kv_capacity_tokens
        prompt = max(1, job.prompt_tokens)
        if prompt + 1 > kv:
            raise BackendError(f"prompt of {prompt} tokens exceeds the KV cache ({kv} tokens)")
        output = self.output_length(job.request_id, max(1, job.max_tokens))
        finish = "length" if output >= job.max_tokens else "stop"
        if prompt + output > kv:
            # The engine could never finish it; like a context-length limit, it
            # stops where the cache is full.
            output = kv - prompt
            finish = "length"
        overhead = self.engine.request_overhead_s / self._speed
        ready_at = asyncio.get_running_loop().time() + overhead if overhead else None
        self.engine.add(job.request_id, prompt, output, job.priority, ready_at=ready_at)
        live = _Live(job.request_id, prompt, output, finish)
        self._live[job.request_id] = live
        self._work.set()
        return self._stream(live)

    async def _stream(self, live: _Live) -> AsyncIterator[Chunk]:
        try:
            while True:
                item = await live.queue.get()
                if item is _END:
                    return
                if isinstance(item, BaseException):
                    raise item
                yield item
                if item.finish_reason is not None:
                    return
        finally:
            # Closed before its end (client gone, consumer cancelled): the
            # engine must not keep generating for nobody.
            if self._live.get(live.id) is live:
                self.abort(live.id)

    def abort(self, request_id: str) -> None:
        live = self._live.pop(request_id, None)
        if live is None:
            return
        self.engine.abort(request_id)
        live.queue.put_nowait(_END)
        self._notify()

    # -- the engine loop -----------------------------------------------------

    async def _run(self) -> None:
        engine = self.engine
        loop = asyncio.get_running_loop()
        ended: float | None = None
        while True:
            engine.take_ready(loop.time())
            if not engine.has_work():
                ended = None
                self._work.clear()
                ready = engine.next_ready_at()
                # Until a new request, or until the next dispatched one reaches the engine.
                with contextlib.suppress(TimeoutError):
                    async with asyncio.timeout_at(ready):
                        await self._work.wait()
                continue
            step = engine.step()
            self.engine_preemptions += len(step.preempted)
            # The modelled GPU time of the step; its tokens exist at its end.
            now = loop.time()
            ended = step_end(now, ended, step.duration / self._speed)
            await asyncio.sleep(max(0.0, ended - now))
            self._deliver(step)

    def _deliver(self, step: StepResult) -> None:
        engine = self.engine
        finished = set(step.finished)
        for live in list(self._live.values()):
            done = live.id in finished
            produced = live.output_tokens if done else engine.generated(live.id)
            new = produced - live.sent
            if new <= 0 and not done:
                continue
            chunk = Chunk(text=filler_text(live.sent, max(new, 0)), tokens=max(new, 0))
            live.sent = max(produced, live.sent)
            if done:
                chunk.finish_reason = live.finish_reason
                chunk.usage = {
                    "prompt_tokens": live.prompt_tokens,
                    "completion_tokens": live.output_tokens,
                    "total_tokens": live.prompt_tokens + live.output_tokens,
                }
                del self._live[live.id]
            live.queue.put_nowait(chunk)
        if finished:
            self._notify()

    def _on_task_done(self, task: asyncio.Task) -> None:
        if task.cancelled():
            return
        exc = task.exception()
        if exc is not None:
            # A crashed engine loop would leave every stream waiting forever.
            self._ready = False
            self._fail_all(BackendError(f"the simulated engine failed: {exc!r}"))

    def _fail_all(self, error: BackendError) -> None:
        for live in self._live.values():
            self.engine.abort(live.id)
            live.queue.put_nowait(error)
        self._live.clear()
