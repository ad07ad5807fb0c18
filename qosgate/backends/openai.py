"""The `openai` backend: one or more OpenAI-compatible servers over HTTP.

Every request is streamed from the upstream (whatever the client asked) so
that output reaches the client as it is produced, a disconnect can abort the
upstream work, and the token count is known per chunk. Requests are routed to
the healthy upstream with the fewest in flight, or, with affinity, to the one
rendezvous hashing picks for the tenant or session, so that an upstream's
prefix cache keeps serving the same conversation.

Capacity is what the gateway itself has in flight against each upstream's
limit. An upstream that reports its engine's state in Prometheus metrics
(vLLM's running and waiting requests and KV usage) has its limit learned from
them (`_Room`), so that a backlog waits in the gateway, where tiers order it,
rather than in the upstream's first-come queue; `max_concurrency` bounds it.
One that reports none is limited by `max_concurrency` alone. KV is reported
to the scheduler as unbounded: the limits are the gate.

Each request carries its engine priority as `priority` where the upstream
takes it (vLLM with `--scheduling-policy priority`), learned per upstream.
"""

from __future__ import annotations

import asyncio
import collections
import contextlib
import email.utils
import hashlib
import json
import logging
import math
import os
import time
import weakref
from collections.abc import AsyncIterator, Callable
from typing import Any, NamedTuple

import aiohttp
import orjson
from prometheus_client.parser import text_string_to_metric_families

from qosgate.backends.base import (
    Backend,
    BackendError,
    BackendRejected,
    BackendStream,
    BackendUnavailable,
    Chunk,
    GenerationJob,
    dump_body,
)
from qosgate.backends.tokens import TokenizerCounter, TokenizerUnavailable, estimate_prompt_tokens
from qosgate.backends.support import PASSTHROUGH
from qosgate.config.models import OpenAIBackendConfig, UpstreamConfig
from qosgate.core.scheduler import BackendCapacity

log = logging.getLogger("qosgate.backends.openai")

# The upstreams' KV caches cannot be seen over the OpenAI API; a number this
# large never limits the dispatcher, which then goes by free slots alone.
UNKNOWN_KV_TOKENS = 1 << 40

# A health probe must not take a whole request timeout to notice a hung server.
_HEALTH_TIMEOUT_S = 5.0
# Upstream error bodies are quoted in errors and logs; bound what is read.
_ERROR_BODY_BYTES = 64 * 1024
_MAX_MESSAGE_CHARS = 2000
"""Of an upstream's error message passed on to the client."""
# One SSE line holds one chunk, and long tool-call arguments or logprobs make
# long lines; a line longer than this is taken for a broken stream rather than
# buffered without end.
_MAX_LINE_BYTES = 2 << 20
_MAX_BODY_BYTES = 64 << 20
"""The largest whole (non-streamed) answer read from an upstream."""
# What `read_timeout_s` raises (aiohttp before 3.10 has only the broader class).
_READ_TIMEOUT: type[Exception] = getattr(aiohttp, "SocketTimeoutError", aiohttp.ServerTimeoutError)


_UNREPORTED_LIMIT = 64
"""`max_concurrency` where it is unset and the upstream reports no metrics."""
_LEARNED_BOUND = 1024
"""`max_concurrency` where it is unset over room learned from metrics."""
_SLOW_START = 4
"""Requests first sent to an upstream that reports its engine's state, before
its reports have shown room for more (`_Room`)."""

_RUNNING = "vllm:num_requests_running"
_WAITING = "vllm:num_requests_waiting"
_KV_USAGE = ("vllm:kv_cache_usage_perc", "vllm:gpu_cache_usage_perc")
"""KV usage, 0 to 1 (the second: vLLM's name before 0.10)."""
_STARTED = "process_start_time_seconds"
_STEP_TOKENS = "vllm:iteration_tokens_total_bucket"
"""vLLM's histogram of the tokens each engine step took (its buckets powers
of two up to 16384 by default, which its step budgets are too)."""
_ROOM_METRICS = frozenset((_RUNNING, _WAITING, *_KV_USAGE, _STARTED, _STEP_TOKENS))


class _EngineReport(NamedTuple):
    running: int
    waiting: int
    kv: float | None
    started: float | None
    """When its server's process started (None: the page does not say)."""
    step: int | None = None
    """The tokens its engine's steps have taken at most, to the bucket
    (`_largest_step`; None: unknown)."""


def _largest_step(buckets: dict[float, float]) -> int | None:
    """From a tokens-per-step histogram's cumulative buckets (bound: count,
    summed over engines), the smallest finite bound that holds every step
    counted: the largest step rounded up to its bucket, which for vLLM's
    power-of-two buckets and step budgets is the budget itself once a step
    has filled it. None when no step is counted, or one is past the last
    finite bound."""
    total = buckets.get(math.inf, 0.0)
    if total <= 0.0:
        return None
    for bound in sorted(b for b in buckets if math.isfinite(b)):
        if buckets[bound] >= total:
            return max(1, int(bound))
    return None


def _engine_report(text: str) -> _EngineReport | None:
    """Running and waiting requests summed over the engines a vLLM metrics
    page reports, KV usage (the fullest), when the server started and the
    largest step its engines took; None if it reports no running and waiting
    requests (not vLLM)."""
    # Only the lines of the few samples read are parsed: a vLLM page holds
    # hundreds of histogram buckets, read several times a second.
    wanted = "\n".join(
        line for line in text.splitlines()
        if line.split("{", 1)[0].split(" ", 1)[0] in _ROOM_METRICS
    )  # fmt: skip
    values: dict[str, list[float]] = {}
    steps: dict[float, float] = {}
    try:
        for family in text_string_to_metric_families(wanted + "\n"):
            for sample in family.samples:
                if sample.name == _STEP_TOKENS:
                    bound = float(sample.labels.get("le", "nan"))
                    if not math.isnan(bound) and math.isfinite(sample.value):
                        steps[bound] = steps.get(bound, 0.0) + sample.value
                    continue
                values.setdefault(sample.name, []).append(sample.value)
    except ValueError:
        return None
    if _RUNNING not in values or _WAITING not in values:
        return None
    kv = next((max(values[name]) for name in _KV_USAGE if name in values), None)
    running, waiting = sum(values[_RUNNING]), sum(values[_WAITING])
    if not all(math.isfinite(v) for v in (running, waiting)):
        return None
    started = values.get(_STARTED, [math.nan])[0]
    return _EngineReport(int(running), int(waiting), kv,
                         started if math.isfinite(started) else None, _largest_step(steps))


class _Room:
    """How many requests the gateway may have in flight at one upstream,
    learned from what its engine reports, so that the engine's own queue
    stays (nearly) empty. The engine's limit (vLLM's `max_num_seqs`, or what
    its KV cache holds) is not reported, only its effect: requests it leaves
    waiting. And the gateway's count is not the engine's: a request the engine
    has finished may still be streaming through its API server. So the limit
    is on the gateway's own count, moved by what each report shows:

    - Nothing waits, the gateway uses its room, and the engine holds at least
      three quarters of it (what was sent has reached it: an API server that
      lags shows less): it grows, by half until the engine has been seen
      full, then by a 32nd (at least one). Slots the gateway keeps free for
      top-level work (`held`, the scheduler's reserve) count as used: other
      work never takes them, so without that the room could never grow
      past them.
    - Requests wait beyond the most the engine has ever run at once (`peak`,
      which its limit is at least): it drops by that excess, so nothing more
      is sent until as many have finished, and the engine is seen full.
      Requests that wait while fewer run are the engine taking in a burst a
      step at a time (its prefill budget), not its limit: nothing changes.
    - KV usage at the high-water mark: it drops to what does not wait, so
      that the engine does not preempt.

    Between reports the gateway's own count is exact: a request that ends
    frees its slot at once. Another client's requests count in the engine's
    figures, so they shrink the room as the gateway's would."""

    __slots__ = ("bound", "high_water", "limit", "peak", "seen_full")

    def __init__(self, bound: int, high_water: float) -> None:
        self.bound = bound
        self.high_water = high_water
        self.limit = min(bound, _SLOW_START)
        self.peak = 0
        self.seen_full = False

    def report(
        self, running: int, waiting: int, kv: float | None, in_flight: int, held: int = 0
    ) -> None:
        """An engine report, read while the gateway had `in_flight` there and
        kept `held` slots free for top-level work."""
        self.peak = max(self.peak, running)
        if kv is not None and kv >= self.high_water:
            self.limit = min(self.limit, max(1, in_flight - waiting))
            self.seen_full = True
        elif waiting > 0:
            excess = running + waiting - self.peak
            if excess > 0:
                self.limit = max(1, in_flight - excess)
                self.seen_full = True
        elif in_flight >= self.limit - 1 - held and running >= max(0, self.limit - held) * 3 // 4:
            self.limit += max(1, self.limit // (32 if self.seen_full else 2))
        self.limit = min(self.limit, self.bound)


class _Upstream:
    __slots__ = ("cfg", "headers", "healthy", "in_flight", "index", "metrics_failing",
                 "metrics_url", "priority_ok", "reports", "room", "said_held", "started",
                 "step", "url", "weight")  # fmt: skip

    def __init__(self, cfg: UpstreamConfig, index: int) -> None:
        self.cfg = cfg
        self.index = index
        self.url = cfg.url.rstrip("/")
        self.weight = cfg.weight
        self.metrics_url = cfg.metrics_url or self.url.removesuffix("/v1") + "/metrics"
        self.room = _Room(cfg.max_concurrency or _LEARNED_BOUND, cfg.kv_high_water)
        self.reports: bool | None = None if cfg.learn_room else False
        """Whether it reports its engine's state (None: not asked yet)."""
        self.priority_ok: bool | None = {"on": True, "off": False}.get(cfg.priority)
        """Whether it takes `priority` (None: not known yet)."""
        self.headers: dict[str, str] = {}
        # Unknown until the first probe; start() probes before anything routes.
        self.healthy = False
        self.in_flight = 0
        self.said_held = False
        """Whether the log has said that the reserve holds all of its room."""
        self.metrics_failing = False
        """Whether its last metrics read failed (and the log has said so)."""
        self.started: float | None = None
        """When its server's process started, as its metrics last said."""
        self.step: int | None = None
        """The tokens its engine takes per step, as its metrics last said (None: unknown)."""

    def learn_again(self) -> None:
        """It may be another server now (restarted, other settings): whether
        it reports, its room and its step are learned from the start."""
        self.step = None
        if self.cfg.learn_room:
            self.reports = None
            self.room = _Room(self.room.bound, self.room.high_water)
            self.said_held = False

    @property
    def limit(self) -> int:
        # Not yet known to report (a server just back): the small start, not
        # a fallback that could flood a small engine's queue.
        if self.reports is False:
            return self.cfg.max_concurrency or _UNREPORTED_LIMIT
        return self.room.limit


async def _cancel(task: asyncio.Task[None] | None) -> None:
    if task is not None:
        task.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await task


def _rendezvous_score(key: str, upstream: _Upstream) -> float:
    # Weighted rendezvous hashing: each key ranks every upstream
    # independently, so losing or regaining one upstream moves only the keys
    # that ranked it first.
    digest = hashlib.blake2b(
        f"{key}\x00{upstream.index}\x00{upstream.url}".encode(), digest_size=8
    ).digest()
    unit = (int.from_bytes(digest, "big") + 0.5) / 2.0**64
    return -upstream.weight / math.log(unit)


def _retry_after_s(value: str | None) -> float:
    if not value:
        return 1.0
    try:
        seconds = float(value)
    except ValueError:
        try:
            when = email.utils.parsedate_to_datetime(value)
        except (TypeError, ValueError):
            return 1.0
        seconds = when.timestamp() - time.time()
    return max(0.0, seconds) if math.isfinite(seconds) else 1.0


def _error_fields(body: bytes) -> tuple[str, str | None]:
    """The message and the `param` of an upstream's error body: OpenAI's
    `{"error": {...}}`, vLLM's older unwrapped object, or plain text."""
    text = body.decode("utf-8", "replace").strip()
    try:
        payload = json.loads(text)
    except ValueError:
        return text[:500] or "(no body)", None
    if isinstance(payload, dict):
        error = payload.get("error", payload)
        if isinstance(error, dict) and isinstance(error.get("message"), str):
            param = error.get("param")
            return error["message"][:_MAX_MESSAGE_CHARS], param if isinstance(param, str) else None
        if isinstance(error, str):
            return error[:_MAX_MESSAGE_CHARS], None
        if isinstance(payload.get("message"), str):
            return payload["message"][:_MAX_MESSAGE_CHARS], None
    return text[:500], None


def _over_context(body: bytes, message: str) -> bool:
    """Whether an upstream's refusal says the request exceeds the model's
    context: OpenAI's code for it, or the message vLLM's server (and others
    after OpenAI's) gives it without that code."""
    if _CONTEXT_MESSAGE in message:
        return True
    try:
        error = json.loads(body).get("error")
    except (ValueError, AttributeError):
        return False
    return isinstance(error, dict) and error.get("code") == "context_length_exceeded"


_CONTEXT_MESSAGE = "maximum context length"


_REJECTED_STATUSES = frozenset({400, 413, 422})
"""What an upstream answers for a request it finds invalid (OpenAI and vLLM:
400; a validation layer such as FastAPI's: 422; a body over its limit: 413).
The client's to fix: no other upstream would take it either. The other 4xx
(401, 403, 404) say the gateway's upstream configuration is wrong."""


_DOWN_RETRY_AFTER_S = 1.0
"""Retry-After for a request whose upstream could not be reached: the failure
triggers a health probe at once, so the upstream is back in rotation, or out
of it, by then."""


def _upstream_error(
    status: int | None, body: bytes, *, retry_after: str | None = None, started: bool = False
) -> BackendError:
    """The one reading of an upstream's error: its HTTP status and body, or
    (`status` None, or the error's own `code`) an error object in a 200
    answer or a stream, after output (`started`) or not. The message reaches
    the client, so it names no upstream; the caller logs which one it was."""
    message, param = _error_fields(body)
    if status in _REJECTED_STATUSES:
        return BackendRejected(message, param=param, context_length=_over_context(body, message))
    if started:
        # Output went out already: whatever the upstream says, the stream
        # ends here, and running it again would repeat that output.
        return BackendError(f"the upstream failed mid-stream: {message}")
    if status in (429, 503):
        return BackendUnavailable(
            f"the upstream is busy ({status}): {message}", _retry_after_s(retry_after)
        )
    # A server error produced nothing, so a retry (on another upstream, or
    # this one later) cannot repeat output; a retry cannot fix the rest.
    what = "failed" if status is None else f"answered {status}"
    return BackendError(
        f"the upstream {what}: {message}", retryable=status is not None and status >= 500
    )


def _error_code(payload: dict[str, Any]) -> int | None:
    """The HTTP status an error object carries as its `code` (vLLM's), if any."""
    error = payload.get("error")
    code = error.get("code") if isinstance(error, dict) else None
    return code if isinstance(code, int) and not isinstance(code, bool) else None


def _int_fields(usage: dict[str, Any]) -> dict[str, int]:
    # Usage may carry nested details (prompt_tokens_details) or nulls; the port
    # promises a flat dict of counts.
    return {k: v for k, v in usage.items() if isinstance(v, int) and not isinstance(v, bool)}


class OpenAIBackend(Backend):
    """Backend port over OpenAI-compatible HTTP servers (see module docstring)."""

    def __init__(self, cfg: OpenAIBackendConfig) -> None:
        self._cfg = cfg
        self._upstreams = [_Upstream(u, i) for i, u in enumerate(cfg.upstreams)]
        self.models: tuple[str, ...] = tuple(cfg.models)
        self.model_roots: dict[str, str] = {}
        """Each model's `root` as the first upstream to list it gave it (vLLM:
        the path or hub name it loaded, which its clients load the tokenizer
        from); /v1/models lists it."""
        self.support = PASSTHROUGH
        self.max_model_len: int | None = None
        """The served model's context, where the upstreams say it (vLLM's
        `max_model_len` in /models) and agree on one: asks past it are 400s at
        the door. None: unknown, and the upstream judges."""
        self._contexts: dict[str, int] = {}
        self._learn_models = not cfg.models
        self._session: aiohttp.ClientSession | None = None
        self._loop: asyncio.AbstractEventLoop | None = None
        self._health_task: asyncio.Task[None] | None = None
        self._metrics_timer: asyncio.TimerHandle | None = None
        self._metrics_task: asyncio.Task[None] | None = None
        # Weak, so that a stream its caller dropped unread can be collected
        # and give its slot back (_Call.__del__).
        self._calls: weakref.WeakValueDictionary[str, _Call] = weakref.WeakValueDictionary()
        self._recheck = asyncio.Event()
        self._rr = 0
        self._held = 0
        self._closed = False
        # A streamed answer comes a piece at a time, so silence between pieces
        # means a hung upstream; a whole answer is silent until it is done.
        self._stream_timeout = aiohttp.ClientTimeout(
            total=cfg.timeout_s, sock_read=cfg.read_timeout_s
        )
        self._whole_timeout = aiohttp.ClientTimeout(total=cfg.timeout_s)
        self._health_timeout = aiohttp.ClientTimeout(total=min(cfg.timeout_s, _HEALTH_TIMEOUT_S))
        self._count: Callable[[str, dict[str, Any]], int] = estimate_prompt_tokens
        # Prompt tokens as counted here and as the upstreams counted them
        # (usage), decayed sums: the unit an upstream's step is converted to.
        self._counted_prompts = 0.0
        self._reported_prompts = 0.0
        self._step_tokens: int | None = None

    # -- lifecycle ---------------------------------------------------------

    async def start(self) -> None:
        if self._cfg.tokenizer is not None:
            try:
                self._count = TokenizerCounter(self._cfg.tokenizer)
            except TokenizerUnavailable as exc:
                raise BackendError(str(exc)) from exc
        for index, upstream in enumerate(self._upstreams):
            env = upstream.cfg.api_key_env
            if env is None:
                continue
            key = os.environ.get(env)
            if not key:
                # Every request would come back 401; say so once, at start.
                raise BackendError(
                    f"backend.upstreams.{index}.api_key_env: environment variable {env} is not set"
                )
            upstream.headers["Authorization"] = f"Bearer {key}"
        self._session = aiohttp.ClientSession(
            # Concurrency is capped per upstream here; aiohttp's own pool cap
            # (100 by default) would otherwise queue requests out of sight.
            # An idle connection is let go before the server's own idle
            # timeout can close it (uvicorn's, vLLM's server's, is 5 s; aiohttp
            # keeps one 15 s): a request written on one the server has just
            # closed fails, though nothing is wrong with the server.
            connector=aiohttp.TCPConnector(limit=0, keepalive_timeout=_IDLE_CONNECTION_S),
            # One session serves every tenant: a cookie an upstream set in
            # one tenant's answer must not ride along on another's request.
            cookie_jar=aiohttp.DummyCookieJar(),
        )
        self._loop = asyncio.get_running_loop()
        await self._check_all()
        if not any(u.healthy for u in self._upstreams):
            log.warning("no upstream answered its health check; will keep checking")
        # Whether each upstream reports its engine's state is known before
        # anything is sent: an unknown one would get a guess.
        await self._read_all_metrics()
        # Polling is not how work moves here (the listener is); this loop only
        # notices upstreams dying or coming back, which nothing else reports.
        self._health_task = self._loop.create_task(
            self._health_loop(), name="qosgate-openai-health"
        )

    async def close(self) -> None:
        if self._closed:
            return
        self._closed = True
        await _cancel(self._health_task)
        if self._metrics_timer is not None:
            self._metrics_timer.cancel()
        await _cancel(self._metrics_task)
        for request_id in list(self._calls):
            self.abort(request_id)
        if self._session is not None:
            await self._session.close()
            self._session = None

    def ready(self) -> bool:
        # Asked at least once per dispatch: a plain loop, not any() over a generator.
        if self._session is not None and not self._closed:
            for upstream in self._upstreams:
                if upstream.healthy:
                    return True
        return False

    # -- capacity ----------------------------------------------------------

    def hold_room(self, slots: int) -> None:
        # Per upstream, though the gateway holds them across all: an upstream
        # may then grow past its engine's slots, which the engine's waiting
        # requests show at the next report, and the room drops back.
        self._held = slots

    def capacity(self) -> BackendCapacity:
        free = slots = 0
        for upstream in self._upstreams:
            if upstream.healthy:
                free += max(0, upstream.limit - upstream.in_flight)
                slots += upstream.limit
        return BackendCapacity(
            free_slots=free, free_kv_tokens=UNKNOWN_KV_TOKENS, kv_capacity_tokens=None,
            slots=slots,
        )

    def _notify(self) -> None:
        try:
            super()._notify()
        except Exception:
            # A failing listener must not turn a finished request into a failed one.
            log.exception("capacity listener failed")

    # An upstream's queue may be taken first come, first served (vLLM's
    # default scheduling takes a `priority` and ignores it), so what it was
    # sent before a top-level prompt is prefilled before it.
    arrival_order_queue = True

    @property
    def step_tokens(self) -> int | None:
        """The healthy upstreams' engine steps summed (each its `step_tokens`,
        or else learned from its vLLM metrics as an upper bound,
        `_largest_step`), in this gateway's count of prompt tokens: converted
        by how the upstreams counted the prompts they were sent (usage)
        against how they were counted here, which for an estimate without the
        model's tokenizer can be several times apart. None while no upstream
        has one."""
        return self._step_tokens

    def _saw_usage(self, job: GenerationJob, usage: dict[str, int]) -> None:
        reported = usage.get("prompt_tokens")
        if not isinstance(reported, int) or reported <= 0 or job.prompt_tokens <= 0:
            return
        # Recent prompts weigh most: the mix of prompts can change.
        self._counted_prompts = _USAGE_DECAY * self._counted_prompts + job.prompt_tokens
        self._reported_prompts = _USAGE_DECAY * self._reported_prompts + reported

    def _learn_step(self) -> None:
        """Resolves `step_tokens` again after a round of metrics; a change of
        less than an eighth is kept out, so that a budget counted in it is
        not recomputed at every report. The listener hears of a change: the
        gateway resolves an automatic prefill budget again then."""
        steps = [u.cfg.step_tokens or u.step for u in self._upstreams
                 if u.healthy and (u.cfg.step_tokens or u.step)]  # fmt: skip
        step: int | None = None
        if steps:
            scale = (self._counted_prompts / self._reported_prompts
                     if self._reported_prompts > 0.0 else 1.0)  # fmt: skip
            step = max(1, round(sum(steps) * scale))
        current = self._step_tokens
        if step == current or (step is not None and current is not None
                               and abs(step - current) * 8 <= current):  # fmt: skip
            return
        self._step_tokens = step
        log.info("upstream engines' step: %s prompt tokens as counted here", step)
        self._notify()

    # -- tokens ------------------------------------------------------------

    def count_prompt_tokens(self, endpoint: str, body: dict[str, Any]) -> int:
        """With `backend.tokenizer`, counted with it; otherwise the shared
        estimate (qosgate.backends.tokens): the upstream's own tokenizer is not
        reachable over the OpenAI API."""
        return self._count(endpoint, body)

    # -- routing -----------------------------------------------------------

    def _affinity_key(self, job: GenerationJob) -> str | None:
        mode = self._cfg.affinity
        if mode == "tenant" and job.tenant:
            return "tenant:" + job.tenant
        if mode == "session" and job.session:
            return "session:" + job.session
        return None

    def _pick(self, job: GenerationJob) -> _Upstream | None:
        key = self._affinity_key(job)
        if key is not None:
            # Ranked over every healthy upstream, full or not, so a key's home
            # does not move just because it was busy for a moment.
            healthy = [u for u in self._upstreams if u.healthy]
            if healthy:
                home = max(healthy, key=lambda u: _rendezvous_score(key, u))
                if home.in_flight < home.limit:
                    return home
        candidates = [u for u in self._upstreams if u.healthy and u.in_flight < u.limit]
        if not candidates:
            # The dispatcher hands over only what capacity() allowed, but an
            # engine report may have shrunk a learned room since: the request
            # goes where it is least over, within the upstream's bound,
            # rather than fail.
            over = [u for u in self._upstreams if u.healthy and u.reports is not False
                    and u.in_flight < u.room.bound]  # fmt: skip
            return min(over, key=lambda u: u.in_flight - u.limit, default=None)
        count = len(self._upstreams)
        rr = self._rr
        best = min(candidates, key=lambda u: (u.in_flight, -u.weight, (u.index - rr) % count))
        self._rr = best.index + 1
        return best

    # -- generation --------------------------------------------------------

    def generate(self, job: GenerationJob) -> AsyncIterator[Chunk]:
        """The upstream slot is taken here, not at the first `__anext__`, so the
        capacity the dispatcher reads next already counts this request. Errors
        (no upstream free) surface from the first `__anext__`."""
        if self._closed or self._session is None:
            return _Call(self, job, None, BackendUnavailable("openai backend is not running"))
        upstream = self._pick(job)
        if upstream is None:
            return _Call(self, job, None, BackendUnavailable("no healthy upstream has a free slot"))
        upstream.in_flight += 1
        call = _Call(self, job, upstream, None)
        self._calls[job.request_id] = call
        return call

    def abort(self, request_id: str) -> None:
        call = self._calls.get(request_id)
        if call is not None:
            call.abort()

    def _release(self, call: _Call, *, notify: bool = True) -> None:
        upstream = call.upstream
        if upstream is None:
            return
        call.upstream = None
        upstream.in_flight -= 1
        if self._calls.get(call.job.request_id) is call:
            del self._calls[call.job.request_id]
        if notify:
            self._notify()

    def _mark_unhealthy(self, upstream: _Upstream, reason: str, *, recheck: bool = True) -> None:
        if upstream.healthy:
            upstream.healthy = False
            log.warning("upstream %s marked unhealthy: %s", upstream.url, reason)
            if recheck:
                # A request's connection error can be a one-off (a pooled
                # connection the upstream had just closed); probe now rather
                # than leave a live upstream out for a whole interval.
                self._recheck.set()

    def _request_body(self, job: GenerationJob, upstream: _Upstream) -> dict[str, Any]:
        # The body arrives clamped and without the gateway's own fields (see
        # GenerationJob.body). A client that reads the answer whole gets it
        # from the upstream whole: one JSON body instead of an event per token
        # is less work on both sides (about a third of the gateway's CPU per
        # request, B1). Streamed answers always carry usage.
        body = dict(job.body)
        body["max_tokens"] = job.max_tokens
        if job.priority and upstream.priority_ok is not False:
            body["priority"] = job.priority
        if not job.streamed:
            body["stream"] = False
            body.pop("stream_options", None)
            return body
        body["stream"] = True
        options = body.get("stream_options")
        body["stream_options"] = {
            **(options if isinstance(options, dict) else {}),
            "include_usage": True,
        }
        return body

    async def _run(self, call: _Call, upstream: _Upstream) -> AsyncIterator[Chunk]:
        job = call.job
        assert self._session is not None
        path = "/chat/completions" if job.endpoint == "chat" else "/completions"
        url = upstream.url + path
        headers = {
            "Accept": "text/event-stream",
            "Content-Type": "application/json",
            **upstream.headers,
            # The trace goes on into the upstream (vLLM reads traceparent).
            **(job.trace or {}),
        }
        response: aiohttp.ClientResponse | None = None
        finished = False
        try:
            body = self._request_body(job, upstream)
            response = call.response = await self._post(url, body, headers, job, upstream)
            if call.aborted:
                raise call.abort_error()
            if "priority" in body and upstream.priority_ok is None:
                if response.status in _REJECTED_STATUSES:
                    # Perhaps refused for `priority` (vLLM without priority
                    # scheduling): asked again without it, which then decides.
                    refusal = await _read_at_most(response, _ERROR_BODY_BYTES)
                    response.release()
                    del body["priority"]
                    response = call.response = await self._post(url, body, headers, job, upstream)
                    if call.aborted:
                        raise call.abort_error()
                    if response.status not in _REJECTED_STATUSES:
                        upstream.priority_ok = False
                        log.warning(
                            "upstream %s refused a request's priority (%s); sending it none",
                            upstream.url, _error_fields(refusal)[0],
                        )  # fmt: skip
                elif response.status == 200:
                    upstream.priority_ok = True
            if response.status != 200:
                raise _upstream_error(
                    response.status,
                    await _read_at_most(response, _ERROR_BODY_BYTES),
                    retry_after=response.headers.get("Retry-After"),
                )
            if not job.streamed:
                whole = _whole_answer(
                    job.endpoint, await _read_at_most(response, _MAX_BODY_BYTES + 1)
                )
                # Read to its end: the connection can go back to the pool.
                finished = True
                if whole.usage is not None:
                    self._saw_usage(job, whole.usage)
                yield whole
                return
            # Whatever has arrived is parsed in one go rather than awaited line
            # by line: each await costs more than the parsing it waits for.
            events = call._events = _EventStream(job.endpoint)
            content = response.content
            while not events.ended:
                while events.ready:
                    yield events.ready.popleft()
                block = await content.readany()
                if block:
                    events.feed(block)
                else:
                    events.end()
            # [DONE] can come a read before the end of the body. Read that end
            # before the last chunk goes out (the consumer may stop at it): a
            # response released with its body unread closes its connection,
            # and every request would pay for a new one.
            finished = events.error is None and await _read_to_eof(content)
            while events.ready:
                chunk = events.ready.popleft()
                if chunk.usage is not None:
                    self._saw_usage(job, chunk.usage)
                yield chunk
            if events.error is not None:
                raise events.error
        except Exception as exc:
            # Whatever an aborted request's closed connection produced (a
            # connection error, a short stream) is the abort, not a failure.
            if call.aborted:
                raise call.abort_error() from exc
            error = exc if isinstance(exc, BackendError) else self._transport_error(exc)
            if error is None:
                raise
            # The client is told what failed, never where: an upstream's
            # address is internal. The log says where, and the cause.
            cause = exc if error is not exc else exc.__cause__
            log.log(
                logging.INFO if isinstance(error, BackendRejected) else logging.WARNING,
                "request %s: upstream %s: %s%s", job.request_id, upstream.url, error,
                f" ({cause!r})" if cause is not None else "",
            )  # fmt: skip
            if error is exc:
                raise
            raise error from exc
        finally:
            if response is not None:
                if finished:
                    response.release()
                else:
                    # Dropping the connection is what tells the upstream to stop.
                    response.close()
            self._release(call)

    async def _post(
        self,
        url: str,
        body: dict[str, Any],
        headers: dict[str, str],
        job: GenerationJob,
        upstream: _Upstream,
        *,
        again: bool = False,
    ) -> aiohttp.ClientResponse:
        assert self._session is not None
        try:
            return await self._session.post(
                url,
                data=dump_body(body),
                headers=headers,
                timeout=self._stream_timeout if job.streamed else self._whole_timeout,
            )
        except aiohttp.ClientConnectionError as exc:
            # ServerTimeoutError is a connection error too, but a slow
            # upstream is not a dead one.
            if isinstance(exc, TimeoutError):
                raise
            if isinstance(exc, aiohttp.ClientConnectorError):
                self._mark_unhealthy(upstream, repr(exc))
            else:
                # A connection that broke once made (often a pooled one its
                # server closed as the request went out) is no sign that the
                # server is down: a probe, now, says whether it is. Taken out
                # on it alone, a server that is up would answer nothing until
                # the next probe, and its room be learned again from the start.
                healthy, _, reason, _ = await self._probe(upstream)
                if not healthy:
                    self._mark_unhealthy(upstream, f"{exc!r}, then {reason}")
                elif not again:
                    # No answer came on it, so no output was produced: the
                    # request goes once more, on another connection, rather
                    # than failing for the connection's fault.
                    log.info("upstream %s: a connection broke (%r); it is up, and the request "
                             "goes again", upstream.url, exc)
                    return await self._post(url, body, headers, job, upstream, again=True)
                else:
                    log.info("upstream %s: a connection broke again (%r); it is up",
                             upstream.url, exc)
            if isinstance(exc, aiohttp.ServerDisconnectedError):
                # It took the request and hung up: no answer came, so no
                # output was produced (retryable), but it failed the request.
                raise BackendError("the upstream dropped the connection", retryable=True) from exc
            # Down, not failing: it could not be connected to, or sent the
            # request. The client is told when to come back (503 with
            # Retry-After) rather than handed a 502 that OpenAI's clients
            # retry at once.
            raise BackendUnavailable(
                "the upstream could not be reached", _DOWN_RETRY_AFTER_S
            ) from exc

    def _transport_error(self, exc: Exception) -> BackendError | None:
        """What a failed read or a timeout means for the request (None: not
        the upstream's doing, a bug)."""
        # Before OSError, which TimeoutError is.
        if isinstance(exc, _READ_TIMEOUT):
            return BackendError(f"the upstream sent nothing for {self._cfg.read_timeout_s:g}s")
        if isinstance(exc, TimeoutError):
            return BackendError(f"the upstream timed out after {self._cfg.timeout_s:g}s")
        if isinstance(exc, (aiohttp.ClientError, OSError)):
            # The exception's text can hold the upstream's address.
            return BackendError(f"the connection to the upstream failed ({type(exc).__name__})")
        return None

    # -- health ------------------------------------------------------------

    async def _health_loop(self) -> None:
        loop = asyncio.get_running_loop()
        while True:
            timer = loop.call_later(self._cfg.health_interval_s, self._recheck.set)
            try:
                await self._recheck.wait()
            finally:
                timer.cancel()
            self._recheck.clear()
            try:
                await self._check_all()
            except Exception:
                log.exception("health check round failed")

    async def _check_all(self) -> None:
        results = await asyncio.gather(*(self._probe(u) for u in self._upstreams))
        recovered = False
        for upstream, (ok, models, reason, contexts) in zip(self._upstreams, results):
            if ok:
                if not upstream.healthy:
                    upstream.healthy = True
                    recovered = True
                    log.info("upstream %s is healthy", upstream.url)
                    upstream.learn_again()
                for name, root in models.items():
                    if root is not None:
                        self.model_roots.setdefault(name, root)
                for name, context in contexts.items():
                    # The smallest any upstream serves it with: a request may go to any.
                    self._contexts[name] = min(context, self._contexts.get(name, context))
                if self._learn_models:
                    self.models = tuple(dict.fromkeys((*self.models, *models)))
            else:
                self._mark_unhealthy(upstream, reason, recheck=False)
        distinct = set(self._contexts.values())
        # One number for the backend: where models differ, no one bound fits all.
        self.max_model_len = distinct.pop() if len(distinct) == 1 else None
        if recovered:
            self._notify()

    async def _probe(
        self, upstream: _Upstream
    ) -> tuple[bool, dict[str, str | None], str, dict[str, int]]:
        """(healthy, {model: its root if the upstream gives one}, why not,
        {model: its context where the upstream gives one})."""
        assert self._session is not None
        try:
            async with self._session.get(
                upstream.url + "/models", headers=upstream.headers, timeout=self._health_timeout
            ) as response:
                if response.status != 200:
                    return False, {}, f"GET /models answered {response.status}", {}
                payload = await response.json(content_type=None)
        except (aiohttp.ClientError, TimeoutError, OSError, ValueError) as exc:
            return False, {}, f"GET /models failed: {exc!r}", {}
        models: dict[str, str | None] = {}
        contexts: dict[str, int] = {}
        if isinstance(payload, dict) and isinstance(payload.get("data"), list):
            for entry in payload["data"]:
                if isinstance(entry, dict) and isinstance(entry.get("id"), str):
                    root = entry.get("root")
                    models[entry["id"]] = root if isinstance(root, str) and root else None
                    context = entry.get("max_model_len")
                    if isinstance(context, int) and not isinstance(context, bool) and context > 0:
                        contexts[entry["id"]] = context
        return True, models, "", contexts

    # -- room --------------------------------------------------------------

    def _metrics_tick(self) -> None:
        self._metrics_timer = None
        if not self._closed and self._loop is not None:
            self._metrics_task = self._loop.create_task(
                self._read_all_metrics(), name="qosgate-openai-metrics"
            )

    async def _read_all_metrics(self) -> None:
        """One read of every healthy upstream's metrics that may report, then
        the next one timed (a timer, not a sleeping task: one read at a time,
        and nothing to wake on close)."""
        try:
            await asyncio.gather(*(self._read_metrics(u) for u in self._upstreams
                                   if u.healthy and u.reports is not False))  # fmt: skip
            self._learn_step()
        except Exception:
            log.exception("metrics round failed")
        finally:
            if self._metrics_timer is not None:
                self._metrics_timer.cancel()
            if not self._closed and self._loop is not None:
                self._metrics_timer = self._loop.call_later(
                    self._cfg.metrics_interval_s, self._metrics_tick
                )

    async def _read_metrics(self, upstream: _Upstream) -> None:
        assert self._session is not None
        report: _EngineReport | None = None
        failed = False
        try:
            async with self._session.get(
                upstream.metrics_url, headers=upstream.headers, timeout=self._health_timeout
            ) as response:
                if response.status == 200:
                    page = await _read_at_most(response, _MAX_METRICS_BYTES)
                    report = _engine_report(page.decode("utf-8", "replace"))
                    why = "no vLLM running and waiting requests in them"
                else:
                    why = f"answered {response.status}"
                    failed = response.status >= 500 or response.status == 429
        except (aiohttp.ClientError, TimeoutError, OSError) as exc:
            why = f"failed: {exc!r}"
            failed = True
        if failed:
            # Says nothing of whether it reports (a server busy or still
            # starting): it keeps the room it had, at first the small start,
            # and is asked again next time. Taken for "reports nothing", one
            # miss would send it up to max_concurrency from then on. The
            # health probe judges whether it is down.
            if not upstream.metrics_failing:
                upstream.metrics_failing = True
                log.warning(
                    "upstream %s: its metrics (%s) %s; its room stays at %d until they answer "
                    "(learn_room: false sends it up to max_concurrency instead)",
                    upstream.url, upstream.metrics_url, why, upstream.limit,
                )  # fmt: skip
            return
        if upstream.metrics_failing:
            upstream.metrics_failing = False
            log.info("upstream %s: its metrics (%s) answer again", upstream.url,
                     upstream.metrics_url)  # fmt: skip
        if report is None:
            if upstream.reports is None:
                upstream.reports = False
                log.warning(
                    "upstream %s: its metrics (%s) %s; sending it at most max_concurrency "
                    "(%d) at once", upstream.url, upstream.metrics_url, why, upstream.limit,
                )  # fmt: skip
            return
        if report.started is not None:
            if upstream.started is not None and report.started != upstream.started:
                # Restarted between two health probes, perhaps with another
                # max_num_seqs: the most it ran before says nothing of now.
                log.info("upstream %s restarted (its metrics say so): its room is learned "
                         "again", upstream.url)
                upstream.learn_again()
            upstream.started = report.started
        if not upstream.reports:
            upstream.reports = True
            log.info("upstream %s: room learned from %s", upstream.url, upstream.metrics_url)
        upstream.step = report.step
        before = upstream.limit
        # Counted when the page came: what was sent while it was on its way
        # is not in it, and is not taken for another client's.
        upstream.room.report(
            report.running, report.waiting, report.kv, upstream.in_flight, self._held
        )
        room = upstream.room
        if self._held and room.seen_full and room.limit <= self._held and not upstream.said_held:
            upstream.said_held = True
            log.warning(
                "upstream %s runs about %d requests at once, and scheduler.reserve.slots "
                "(%d) holds them all for the top priority level: below it, requests run "
                "there only while its room overshoots", upstream.url, room.limit, self._held,
            )  # fmt: skip
        if upstream.limit > before and upstream.in_flight < upstream.limit:
            self._notify()


_USAGE_DECAY = 0.99
"""Weight each prompt's count keeps per prompt counted after it (`_saw_usage`)."""

_IDLE_CONNECTION_S = 4.0
"""How long an idle connection to an upstream is kept for the next request."""

_MAX_METRICS_BYTES = 8 << 20
"""The most of a metrics page read (vLLM's is tens of kilobytes)."""


class _Call(BackendStream):
    """One request's stream. Holds its upstream slot from `generate()` until it
    ends, fails, is closed or aborted, whichever comes first."""

    def __init__(
        self,
        backend: OpenAIBackend,
        job: GenerationJob,
        upstream: _Upstream | None,
        error: BackendError | None,
    ) -> None:
        self.backend = backend
        self.job = job
        self.upstream = upstream
        self.response: aiohttp.ClientResponse | None = None
        self.aborted = False
        self._error = error
        self._gen: AsyncIterator[Chunk] | None = None
        self._events: _EventStream | None = None
        self._done = False

    def abort_error(self) -> BackendError:
        # Retryable: an aborted request (preempted) may be run again from the start.
        return BackendError(f"request {self.job.request_id} aborted", retryable=True)

    def abort(self) -> None:
        if self.aborted or self._done:
            return
        self.aborted = True
        if self.response is not None:
            # Wakes a pending read with a connection error, and the upstream
            # sees its client gone.
            self.response.close()
        self.backend._release(self)

    def ready(self) -> bool:
        """True when the next chunk is parsed already: `__anext__` will not wait."""
        events = self._events
        return events is not None and bool(events.ready) and not self.aborted

    def __aiter__(self) -> _Call:
        return self

    async def __anext__(self) -> Chunk:
        events = self._events
        if (
            events is not None
            and events.ready
            and not events.ended
            and not (self.aborted or self._done)
        ):
            # Parsed already, and not the stream's end (which _run holds until
            # the body's end is read): no need to resume the generator.
            return events.ready.popleft()
        if self._done:
            raise StopAsyncIteration
        if self._error is not None:
            error, self._error = self._error, None
            self._done = True
            raise error
        if self.aborted:
            # Lines already buffered before the abort must not reach the client.
            self._done = True
            if self._gen is not None:
                await self._gen.aclose()  # type: ignore[attr-defined]
            raise self.abort_error()
        if self._gen is None:
            assert self.upstream is not None
            self._gen = self.backend._run(self, self.upstream)
        try:
            return await self._gen.__anext__()
        except BaseException:
            self._done = True
            self.backend._release(self)
            raise

    async def aclose(self) -> None:
        self._done = True
        if self._gen is not None:
            await self._gen.aclose()  # type: ignore[attr-defined]
        elif self.response is not None:
            self.response.close()
        self.backend._release(self)

    def __del__(self) -> None:
        # Dropped without being run or closed: give the slot back anyway. The
        # listener runs later from the loop, not from inside whatever code the
        # garbage collector interrupted.
        if self.upstream is not None:
            self.backend._release(self, notify=False)
            loop = self.backend._loop
            if loop is not None and not loop.is_closed():
                loop.call_soon_threadsafe(self.backend._notify)


def _whole_answer(endpoint: str, raw: bytes) -> Chunk:
    """A non-streamed completion as one chunk: its text, its usage, the
    choice's other fields (logprobs, ...) in raw, and for chat the message's
    other fields (tool calls, ...) under raw["message"]."""

    def malformed(why: str) -> BackendError:
        return BackendError(f"the upstream sent a malformed answer: {why}")

    if len(raw) > _MAX_BODY_BYTES:
        raise malformed(f"larger than {_MAX_BODY_BYTES} bytes")
    try:
        payload = orjson.loads(raw)
    except orjson.JSONDecodeError as exc:
        raise malformed(f"not JSON: {raw[:200]!r}") from exc
    if not isinstance(payload, dict):
        raise malformed("not an object")
    if payload.get("error") is not None:
        raise _upstream_error(_error_code(payload), raw)
    choices = payload.get("choices")
    if not isinstance(choices, list):
        raise malformed("no choices")
    choice = next((c for c in choices if isinstance(c, dict) and c.get("index", 0) == 0), None)
    if choice is None:
        raise malformed("no choice 0")
    raw_fields = {k: v for k, v in choice.items() if k not in _OWN_WHOLE_FIELDS and v is not None}
    if endpoint == "chat":
        message = choice.get("message")
        if not isinstance(message, dict):
            raise malformed("choice 0 has no message")
        text = message.get("content") or ""
        extra = {k: v for k, v in message.items() if k not in ("content", "role") and v is not None}
        if extra:
            raw_fields["message"] = extra
    else:
        text = choice.get("text") or ""
    if not isinstance(text, str):
        raise malformed("content is not a string")
    usage_raw = payload.get("usage")
    usage = _int_fields(usage_raw) if isinstance(usage_raw, dict) else None
    if usage is not None and "completion_tokens" in usage:
        tokens = usage["completion_tokens"]
    else:
        tokens = estimate_prompt_tokens("completions", {"prompt": text}) if text else 0
    finish = choice.get("finish_reason") or "stop"
    return Chunk(text=text, tokens=tokens, finish_reason=str(finish), usage=usage, raw=raw_fields)


_EOF_GRACE_S = 1.0
"""How long the end of a body may lag its [DONE] before the connection is
dropped rather than kept for reuse."""


async def _read_to_eof(content: aiohttp.StreamReader) -> bool:
    """Whether the body ended (at once, normally) within the grace."""
    if content.at_eof():
        return True
    try:
        async with asyncio.timeout(_EOF_GRACE_S):
            while await content.readany():
                pass
    except (TimeoutError, aiohttp.ClientError, OSError):
        # The output is complete either way; only the connection is not reused.
        return False
    return True


async def _read_at_most(response: aiohttp.ClientResponse, limit: int) -> bytes:
    try:
        return await response.content.readexactly(limit)
    except asyncio.IncompleteReadError as short:
        return short.partial


class _EventStream:
    """Server-sent events -> chunks, fed the body as it arrives. The chunk
    carrying `finish_reason` is held back until the usage chunk that follows
    it, so that the last chunk has both."""

    def __init__(self, endpoint: str) -> None:
        self.chat = endpoint == "chat"
        self.ready: collections.deque[Chunk] = collections.deque()
        """Chunks parsed and not yet taken, in stream order."""
        self.error: BackendError | None = None
        """Ends the stream once the ready chunks are taken."""
        self.ended = False
        """Nothing more is to be read: [DONE] came, or the body ended, or an error."""
        self._partial = b""  # the unfinished last line of what was fed so far
        self._data: list[bytes] = []  # the data lines of the event being read
        self._counted = 0  # tokens in the chunks parsed so far
        self._usage: dict[str, int] | None = None
        self._final: Chunk | None = None

    def feed(self, block: bytes) -> None:
        """Parse the events `block` completes. A malformed one stops the parsing;
        the chunks before it are still taken first, then the error."""
        try:
            self._parse(block)
        except BackendError as exc:
            self.error = exc
            self.ended = True

    def end(self) -> None:
        """The body ended."""
        # An unterminated last line and event still count, as if the blank
        # line that should have ended them had come.
        self.feed(b"\n\n")
        if not self.ended:
            self._finish(done=False)

    def _malformed(self, why: str) -> BackendError:
        return BackendError(f"the upstream sent a malformed stream: {why}")

    def _parse(self, block: bytes) -> None:
        if self._partial or self._data or b"\r" in block:
            self._parse_lines(block)
            return
        # At an event boundary, with no CR: split on the blank lines. Events
        # that are one `data: ` line (what OpenAI-compatible servers send) go
        # straight to _event; the general reader takes any other, with a
        # blank line after it, and the unfinished tail. Same result as
        # reading the block line by line, in a fraction of the calls.
        events = block.split(b"\n\n")
        tail = events.pop()
        for event in events:
            if event.startswith(b"data: ") and b"\n" not in event:
                self._event(event[6:])
            else:
                self._parse_lines(event + b"\n\n")
            if self.ended:
                return
        if tail:
            self._parse_lines(tail)

    def _parse_lines(self, block: bytes) -> None:
        lines = block.split(b"\n")
        if self._partial:
            lines[0] = self._partial + lines[0]
        self._partial = lines.pop()
        data = self._data
        for line in lines:
            line = line.rstrip(b"\r")
            if line.startswith(b"data:"):
                data.append(line[5:].removeprefix(b" "))
            elif not line and data:
                event = b"\n".join(data)
                data.clear()
                self._event(event)
                if self.ended:
                    return
            # Comments (":"), event:, id: and retry: lines carry nothing for us.
        if len(self._partial) > _MAX_LINE_BYTES:
            raise self._malformed(f"a line longer than {_MAX_LINE_BYTES} bytes")

    def _finish(self, *, done: bool) -> None:
        """[DONE] (`done`) or the end of the body: the held-back last chunk."""
        self.ended = True
        final = self._final
        if final is None:
            if not done:
                self.error = BackendError("the upstream ended the stream before finishing")
                return
            # [DONE] without a finish_reason: the upstream considers it complete.
            final = Chunk(finish_reason="stop")
        usage = self._usage
        if usage is not None:
            final.usage = usage
            if "completion_tokens" in usage:
                final.tokens = max(0, usage["completion_tokens"] - self._counted)
        self.ready.append(final)

    def _event(self, raw_data: bytes) -> None:
        # Once per token: the common shapes take the short ways, with the same
        # result as the general ones beside them.
        if raw_data == b"[DONE]":
            self._finish(done=True)
            return
        try:
            payload = orjson.loads(raw_data)
        except orjson.JSONDecodeError:
            # Decoded as a whole, with the same result as line by line: a
            # newline is never part of a multi-byte character.
            data = raw_data.decode("utf-8", "replace")
            if data.strip() == "[DONE]":
                self._finish(done=True)
                return
            try:
                payload = orjson.loads(data)
            except orjson.JSONDecodeError as exc:
                raise self._malformed(f"not JSON: {data[:200]!r}") from exc
        if not isinstance(payload, dict):
            raise self._malformed(f"not an object: {raw_data[:200].decode('utf-8', 'replace')!r}")
        if payload.get("error") is not None:
            raise _upstream_error(
                _error_code(payload), json.dumps(payload).encode(), started=self._counted > 0
            )
        chunk_usage = payload.get("usage")
        reported: int | None = None
        if isinstance(chunk_usage, dict):
            self._usage = _int_fields(chunk_usage)
            reported = self._usage.get("completion_tokens")
        choices = payload.get("choices")
        if not isinstance(choices, list):
            if choices is not None:
                raise self._malformed("choices is not an array")
            return
        choice = choices[0] if choices else None
        if not isinstance(choice, dict) or choice.get("index", 0) != 0:
            choice = next(
                (c for c in choices if isinstance(c, dict) and c.get("index", 0) == 0), None
            )
            if choice is None:
                return
        if choice.keys() <= _CHOICE_FIELDS and choice.get("logprobs") is None:
            raw: dict[str, Any] = {}
        else:
            raw = {k: v for k, v in choice.items() if k not in _OWN_CHOICE_FIELDS and v is not None}
        if self.chat:
            delta = choice.get("delta") or {}
            if not isinstance(delta, dict):
                raise self._malformed("delta is not an object")
            text = delta.get("content") or ""
            if delta.keys() <= _OWN_DELTA_FIELDS:
                produced = bool(text)
            else:
                extra = {
                    k: v for k, v in delta.items() if k not in _OWN_DELTA_FIELDS and v is not None
                }
                if extra:
                    raw["delta"] = extra
                produced = bool(text) or bool(extra)
        else:
            text = choice.get("text") or ""
            produced = bool(text)
        if not isinstance(text, str):
            raise self._malformed("content is not a string")
        if reported is not None:
            # Continuous usage stats: the upstream's running count is exact.
            tokens = max(0, reported - self._counted)
        else:
            tokens = 1 if produced else 0
        finish = choice.get("finish_reason")
        if finish is not None:
            self._final = Chunk(text=text, tokens=tokens, finish_reason=str(finish), raw=raw)
        elif text or tokens or raw:
            self._counted += tokens
            ready = self.ready
            last = ready[-1] if ready else None
            if last is not None and not raw and not last.raw:
                # Text that arrived in one read goes on as one piece: it reaches
                # the client at the same moment either way, in one write, and
                # each piece costs a trip through every layer above.
                last.text += text
                last.tokens += tokens
            else:
                ready.append(Chunk(text=text, tokens=tokens, raw=raw))


_OWN_CHOICE_FIELDS = frozenset({"index", "finish_reason", "text", "delta"})
"""A streamed choice's fields the chunk carries itself; the rest goes in `raw`."""
_CHOICE_FIELDS = _OWN_CHOICE_FIELDS | {"logprobs"}
"""A choice with no fields but these (and no logprobs) has nothing for `raw`."""
_OWN_DELTA_FIELDS = frozenset({"content", "role"})
_OWN_WHOLE_FIELDS = frozenset({"index", "finish_reason", "text", "message"})
"""A whole answer's choice fields the chunk carries itself (the message's
extras go under raw["message"]); the rest goes in `raw`."""
