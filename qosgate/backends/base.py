"""The backend port: where admitted work runs.

A backend takes one request at a time from the dispatcher (only as many as
its reported capacity allows), streams its output back as chunks, aborts on
request, and tells the runtime when capacity frees so the dispatcher can wake
without polling.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass, field
from collections.abc import AsyncIterator, Callable, Mapping
from types import MappingProxyType
from typing import Any, Literal

import orjson

from qosgate.backends.support import PASSTHROUGH, RequestSupport
from qosgate.core.scheduler import BackendCapacity


def dump_body(body: dict[str, Any]) -> bytes:
    """A request body as JSON, to send on. The gateway does not type every
    place in it (an unknown field a passthrough backend forwards, a tool's
    JSON schema, a message's extra keys), and a client may write an integer
    past 64 bits there, which orjson cannot encode: Python's json can."""
    try:
        return orjson.dumps(body)
    except TypeError:
        return json.dumps(body, ensure_ascii=False, separators=(",", ":")).encode()


LONG_NUMBER = re.compile(rb"[0-9]{19}")
"""19 digits in a row: perhaps an integer past 64 bits (or a whole float
past 2**63, which rounds), which orjson does not read exactly."""


def load_body(raw: bytes) -> Any:
    """What `dump_body` wrote, as it was: orjson reads an integer past 64
    bits as a float. Raises ValueError if it is not JSON."""
    if LONG_NUMBER.search(raw):
        return json.loads(raw)
    return orjson.loads(raw)


@dataclass(frozen=True, slots=True)
class GenerationJob:
    """What the backend is asked to run for one admitted request."""

    request_id: str
    endpoint: Literal["chat", "completions"]
    body: dict[str, Any]
    """The client's OpenAI request body after validation (model, messages or
    prompt, sampling fields, unknown fields passed through), ready to send:
    `max_tokens` (and `max_completion_tokens` if given) already clamped to the
    tier's cap, and the gateway's own fields (`priority`) removed."""
    prompt_tokens: int
    max_tokens: int
    priority: int
    """Engine priority (lower runs first): the tier's level, possibly lowered by
    the client, then the prompt's size class (core.ordering.engine_priority)."""
    tenant: str = ""
    tier: str = ""
    session: str | None = None
    """Session key for affinity (X-Session-Id), if the client sent one."""
    work: int = 0
    """Tokens the scheduler expects the request to take (prompt + its
    estimate of the output): what a backend that queues work elsewhere (the
    fleet) counts toward the wait it predicts."""
    trace: Mapping[str, str] | None = None
    """The request's trace context as W3C headers (`traceparent`,
    `tracestate`) when it is traced: a backend that calls out sends them on."""

    @property
    def streamed(self) -> bool:
        """Whether the client reads the output as it comes (its `stream`). When
        it does not, a backend may deliver the output in one piece."""
        return self.body.get("stream") is True


@dataclass(slots=True)
class Chunk:
    """A piece of output. The last chunk of a stream has `finish_reason` set."""

    text: str = ""
    tokens: int = 0
    """Output tokens in this chunk."""
    finish_reason: str | None = None
    """"stop" | "length" | None while streaming."""
    usage: dict[str, int] | None = None
    """Backend-reported usage on the last chunk, when it has one."""
    raw: dict[str, Any] = field(default_factory=dict)
    """Extra fields an upstream returned (passed through to the client)."""


class BackendError(Exception):
    """The backend failed this request (maps to 502, outcome backend_error)."""

    def __init__(self, message: str, *, retryable: bool = False) -> None:
        super().__init__(message)
        self.retryable = retryable
        """True when nothing reached the client, so running the request again
        elsewhere could not duplicate output. Informational: the gateway does
        not retry yet (a failed request ends backend_error)."""


class BackendUnavailable(BackendError):
    """The backend cannot take work now (maps to 503 with Retry-After)."""

    def __init__(self, message: str, retry_after_s: float = 1.0) -> None:
        super().__init__(message, retryable=True)
        self.retry_after_s = retry_after_s


class BackendRejected(BackendError):
    """The backend says the request itself is invalid (maps to 400
    invalid_request_error, outcome bad_request): running it again, here or
    elsewhere, would fail the same way, so it is the client's to fix.

    `message` is shown to the client as is: it must not name internal
    addresses (an upstream's URL); log those where the error is raised."""

    def __init__(
        self, message: str, *, param: str | None = None, context_length: bool = False
    ) -> None:
        super().__init__(message)
        self.message = message
        self.param = param
        """The request field the backend blamed, when it named one."""
        self.context_length = context_length
        """Whether it says the request exceeds the model's context (OpenAI's
        `context_length_exceeded`, which clients act on: they shorten it)."""


class BackendStream:
    """Base of a stream that `Backend.generate` returns with abilities only
    some streams have; each is declared here with the answer of a stream
    that lacks it, which is what a plain async iterator of chunks gets."""

    __slots__ = ()

    def ready(self) -> bool:
        """True when the next chunk is at hand, so that `__anext__` will not
        wait (see `RequestStream.ready`); False when the stream cannot tell."""
        return False

    def started(self) -> bool:
        """For a backend that queues what it takes (the fleet's): False while
        the job waits there, so that a request cancelled then is refunded as
        one cancelled in the gateway's own queue. Others start it at once."""
        return True


PLAIN_STREAM = BackendStream()
"""The abilities of a stream that declares none."""


class Backend:
    """Port implemented by the sim, openai and vllm backends and the fleet's
    replica. The abilities only some backends have are declared here with
    the answer of a backend that lacks them, so callers ask every backend
    alike."""

    models: tuple[str, ...]
    """Model names it serves (for /v1/models and request validation)."""

    support: RequestSupport = PASSTHROUGH
    """What it honours of a request; PASSTHROUGH: it judges requests itself."""

    max_model_len: int | None = None
    """Its model's context in tokens, where known: asks past it are 400s at the door."""

    model_roots: Mapping[str, str] = MappingProxyType({})
    """A served model's `root` in /v1/models (the path or hub name its engine
    loaded, which clients such as vLLM's benchmark read to find the
    tokenizer), by name, where it differs from the name."""

    restarts: int = 0
    """Times it restarted its engine (one that can, vllm, counts them)."""

    engine_metrics: tuple[Any, str] | None = None
    """Its engine's own Prometheus metrics, served on the gateway's /metrics:
    (a prometheus_client registry, the prefix of the families to take from
    it); None: the engine has none in this process."""

    async def start(self) -> None:
        """Bring the backend up (engine start, first health check)."""

    async def wait_ready(self) -> None:
        """Return once a backend that loads in the background is ready; raise
        if it cannot start, which stops the server. Others are ready once started."""

    async def close(self) -> None:
        """Abort what runs and release resources."""

    def ready(self) -> bool:
        """True when it can take work (readyz)."""
        raise NotImplementedError

    def gone(self) -> BackendUnavailable | None:
        """The error when it cannot take work and will not recover by itself
        (a dead engine), as opposed to not ready *yet*; None otherwise. The
        gateway then refuses new requests and ends queued ones at once,
        instead of letting them wait out their budgets."""
        return None

    def capacity(self) -> BackendCapacity:
        """Free sequence slots and KV tokens right now."""
        raise NotImplementedError

    @property
    def step_tokens(self) -> int | None:
        """Tokens its engine takes per step (vLLM's max_num_batched_tokens),
        where known: the unit of an automatic prefill budget. None: unknown
        (an upstream server). An engine that loads in the background may
        learn it once it is up; it then calls its capacity listener, and the
        gateway resolves the budget again."""
        return None

    releases_prefill: bool = True
    """Whether what the gateway releases goes straight into an engine, whose
    prefill queue the scheduler's prefill budget and delay tiers' pace keep
    short. False where something downstream releases it and applies them (a
    fleet replica's backend: the engine nodes' claims do)."""

    arrival_order_queue: bool = False
    """Whether its engine may take the requests waiting in its own queue in
    the order they came, whatever priority they carry (an upstream server; a
    vllm or simulated engine with `scheduling_policy: fcfs`). A top-level
    prompt then waits behind every prompt sent before it, so an automatic
    prefill budget is one of its steps instead of four
    (config.scheduling.prefill_budget)."""

    def hold_room(self, slots: int) -> None:
        """The gateway keeps `slots` of the free slots `capacity` reports for
        top-level work alone (the scheduler's reserve), so that other work
        leaves them free. A backend that learns its room from how much of it
        is used counts them as used; others need not know."""

    _listener: Callable[[], None] | None = None

    def set_capacity_listener(self, listener: Callable[[], None]) -> None:
        """`listener` is called (from the event loop) whenever capacity may have
        grown: a request finished or aborted, the backend became ready."""
        self._listener = listener

    def _notify(self) -> None:
        """Capacity may have grown: tell the listener."""
        if self._listener is not None:
            self._listener()

    def set_start_listener(self, listener: Callable[[str, object, float], None]) -> None:
        """For a backend that queues what it takes (the fleet's):
        `listener(tier, model, waited_s)` is called when a request starts
        there (`model`: the one its client asked for, as written).
        Others start what they take at once, and never call it."""

    def count_prompt_tokens(self, endpoint: str, body: dict[str, Any]) -> int:
        """Prompt tokens of a request, with the backend's tokenizer where it has one."""
        raise NotImplementedError

    def generate(self, job: GenerationJob) -> AsyncIterator[Chunk]:
        """Start `job` now and stream its output. Closing the iterator
        (`aclose`) before its end aborts the work. Raises BackendError /
        BackendUnavailable. A stream with more to say (`ready`, `started`)
        derives from BackendStream."""
        raise NotImplementedError

    def abort(self, request_id: str) -> None:
        """Stop a running request (preemption, client gone). Idempotent."""
        raise NotImplementedError

    async def fleet_levels(self) -> dict[str, Any] | None:
        """The fleet's shared queue (`queued` per tier, `running`), for a
        replica's backend; None for one node, or when it cannot be read."""
        return None
