"""A gateway replica's side of the fleet: the `Backend` port over the shared queue.

The replica's own scheduler still does everything at the door (identity,
quotas, admission, the request's one outcome); it sees this backend as one
with unbounded room, so it hands every admitted request over at once, and the
ordering that matters happens in the shared queue, across every replica.

`generate` puts the job in its tier's queue (refused with 429 when the tier's
`max_queue_len` is reached fleet-wide, and with 503 `overloaded` when the
store predicts it would wait past its tier's budget and it takes no one's
place there) and yields what the
engine node that takes it publishes back on this replica's reply channel. A
queued request whose place a newcomer takes (any replica's) ends with 503
`overloaded`, told on this replica's reply channel. A tier whose
`on_timeout` is `reject` gets a timer at its queue budget: if the item is
still queued then, it is taken out and the request ends `expired`. A client
that goes away takes its item out of the queue, or tells the node running it
to stop.

When a node dies, its lease runs out and another node runs the item again
from the start. Events carry the lease's fencing token, so the dead run's
stragglers are dropped. A client reading the answer whole never sees the
first run (it is buffered until the end); a streaming client that already
has output gets the new run's output after what it already has, skipping as
many tokens as it was sent, which continues its text exactly when decoding is
deterministic (the simulated GPU; temperature 0 or a fixed seed).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import secrets
import socket
import time
from collections.abc import AsyncGenerator, AsyncIterator, Awaitable, Callable
from dataclasses import dataclass, field
from typing import Any

from redis.exceptions import RedisError

from qosgate.backends.base import (
    Backend,
    BackendError,
    BackendRejected,
    BackendStream,
    BackendUnavailable,
    Chunk,
    GenerationJob,
)
from qosgate.backends.support import PASSTHROUGH, RequestSupport
from qosgate.config.models import FleetConfig, PolicyConfig
from qosgate.config.scheduling import scheduling_policy
from qosgate.config.secrets import redis_password, redis_url
from qosgate.core.scheduler import BackendCapacity
from qosgate.runtime.errors import Expired, GatewayError, Overloaded, WorkQueueError

from . import wire
from .model import FleetTiers, ServiceMeter, WorkItem
from .redis_store import RedisWorkQueue, Subscription

log = logging.getLogger(__name__)

# The replica's scheduler must never hold work back for lack of room: the
# fleet's room is the engine nodes', and they take work when they have it.
_UNBOUNDED = BackendCapacity(1 << 40, 1 << 60, None)


def default_node_id() -> str:
    return f"{socket.gethostname()}-{os.getpid()}"[:64]


def fleet_store(policy: PolicyConfig, fleet: FleetConfig) -> RedisWorkQueue:
    return RedisWorkQueue(
        redis_url(fleet.url, fleet.url_env),
        FleetTiers.from_config(policy),
        password=redis_password(fleet.password_env),
        key_prefix=fleet.key_prefix,
        socket_timeout_s=fleet.timeout_ms / 1000.0,
        affinity_ttl_s=fleet.affinity_ttl_s,
    )


def affinity_key(fleet: FleetConfig, job: GenerationJob) -> str:
    """The key that binds `job` to a node, per `fleet.affinity`; '' for none."""
    if fleet.affinity == "session" and job.session:
        return "session:" + job.session
    if fleet.affinity == "tenant":
        return "tenant:" + job.tenant
    return ""


@dataclass(slots=True)
class _Waiting:
    """One request handed to the fleet, as its events arrive."""

    events: asyncio.Queue[wire.Event] = field(default_factory=asyncio.Queue)
    ended: bool = False
    expiry: asyncio.TimerHandle | None = None
    started: bool = False
    """An engine node has started it (its `started` event, or any output, came)."""
    tier: str = ""
    model: object = None
    """The model its client asked for, as written."""
    queued_at: float | None = None
    """Wall-clock time it went into the shared queue."""


class _FleetStream(BackendStream):
    """A request's output from the fleet, and whether a node has started it."""

    __slots__ = ("_gen", "_waiting")

    def __init__(self, gen: AsyncGenerator[Chunk, None], waiting: _Waiting) -> None:
        self._gen = gen
        self._waiting = waiting

    def __aiter__(self) -> _FleetStream:
        return self

    def __anext__(self) -> Awaitable[Chunk]:
        return self._gen.__anext__()

    async def aclose(self) -> None:
        await self._gen.aclose()

    def started(self) -> bool:
        return self._waiting.started


class FleetBackend(Backend):
    """The `Backend` port of a gateway replica: work goes to the shared queue."""

    releases_prefill = False

    def __init__(
        self,
        policy: PolicyConfig,
        fleet: FleetConfig,
        *,
        models: tuple[str, ...],
        count_prompt_tokens: Callable[[str, dict[str, Any]], int],
        support: RequestSupport = PASSTHROUGH,
        max_model_len: int | None = None,
    ) -> None:
        self.models = models
        self.support = support
        """What the engine nodes' backend honours of a request."""
        self.max_model_len = max_model_len
        """Their model's context, where it is known before they run."""
        self._count = count_prompt_tokens
        self._policy = policy
        self._fleet = fleet
        self.node = fleet.node_id or default_node_id()
        self.store = fleet_store(policy, fleet)
        self._meter = ServiceMeter(scheduling_policy(policy)) if self.store.tiers.fair else None
        # One channel per start, not per name: engine nodes stop the runs of a
        # replica that no one subscribes for any more, and a replica restarted
        # under the same name must not look like the one that crashed.
        self.reply_channel = f"{self.store.base}reply:{self.node}:{secrets.token_hex(4)}"
        self.cancel_channel = f"{self.store.base}cancel"
        self._waiting: dict[str, _Waiting] = {}
        self._replies = Subscription(self.store, self.reply_channel, what="reply channel")
        self._reader: asyncio.Task[None] | None = None
        self._ready = False
        self._start_listener: Callable[[str, object, float], None] | None = None
        # Cancellations in flight, so that close() can wait for them.
        self._chores: set[asyncio.Task[Any]] = set()

    # -- lifecycle -----------------------------------------------------------

    async def start(self) -> None:
        # Subscribed before any request is queued, so no reply can come first.
        await self._replies.open()
        # When the channel is lost (Redis restarts, the network breaks), the
        # requests in flight end with an error (their replies may be gone)
        # and the replica is not ready until it has subscribed again.
        self._reader = asyncio.get_running_loop().create_task(
            self._replies.run(
                self._on_reply, on_lost=self._on_lost, on_back=lambda: self._set_ready(True)
            ),
            name="fleet-replies",
        )  # fmt: skip
        self._set_ready(True)

    def _set_ready(self, ready: bool) -> None:
        self._ready = ready
        self._notify()

    async def close(self) -> None:
        self._ready = False
        for request_id in list(self._waiting):
            self.abort(request_id)
        if self._chores:
            await asyncio.gather(*self._chores, return_exceptions=True)
        if self._reader is not None:
            self._reader.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._reader
        await self._replies.close()
        await self.store.close()

    def ready(self) -> bool:
        return self._ready

    def capacity(self) -> BackendCapacity:
        return _UNBOUNDED

    def set_start_listener(self, listener: Callable[[str, object, float], None]) -> None:
        """`listener(tier, model, waited_s)` is called when an engine node
        starts a request of this replica, with how long it waited in the
        shared queue."""
        self._start_listener = listener

    def count_prompt_tokens(self, endpoint: str, body: dict[str, Any]) -> int:
        return self._count(endpoint, body)

    async def fleet_levels(self) -> dict[str, Any] | None:
        """The shared queue as it stands: `queued` per tier, and `running` (the
        items engine nodes hold). None while Redis cannot be read."""
        try:
            queued = await self.store.depth()
            running = await self.store.leased()
        except WorkQueueError:
            return None
        return {"queued": queued, "running": running}

    # -- replies -------------------------------------------------------------

    def _on_reply(self, message: dict[str, Any]) -> None:
        """Relay a message's events to the requests waiting for them."""
        try:
            events = wire.decode_events(message["data"])
        except ValueError:
            log.error("dropped a malformed message on %s", self.reply_channel)
            return
        for event in events:
            waiting = self._waiting.get(event[0])
            if waiting is None:
                continue
            # Noted as it arrives, not as the request's reader gets to it: a
            # client may go away in between. An event no run sent (its place
            # in the queue was taken) says nothing started.
            if not waiting.started and event[1] != wire.LOCAL_TOKEN:
                waiting.started = True
                self._started(waiting)
            if event[2] != wire.STARTED:
                waiting.events.put_nowait(event)

    def _on_lost(self, exc: Exception) -> None:
        self._set_ready(False)
        for request_id, waiting in self._waiting.items():
            waiting.events.put_nowait(
                wire.error_event(request_id, wire.LOCAL_TOKEN, "unavailable", str(exc))
            )

    def _started(self, waiting: _Waiting) -> None:
        listener = self._start_listener
        if listener is not None and waiting.queued_at is not None:
            listener(waiting.tier, waiting.model, time.time() - waiting.queued_at)

    # -- requests ------------------------------------------------------------

    def generate(self, job: GenerationJob) -> AsyncIterator[Chunk]:
        if not self._ready:
            raise BackendUnavailable("the fleet's queue is not reachable")
        if job.request_id in self._waiting:
            raise BackendError(f"request {job.request_id!r} is already running")
        waiting = _Waiting(tier=job.tier, model=job.body.get("model"))
        self._waiting[job.request_id] = waiting
        return _FleetStream(self._stream(job, waiting), waiting)

    async def _stream(self, job: GenerationJob, waiting: _Waiting) -> AsyncIterator[Chunk]:
        request_id = job.request_id
        tier = self._policy.tiers[job.tier]
        try:
            item = WorkItem(
                id=request_id,
                tier=job.tier,
                tenant=job.tenant,
                arrival=time.time(),
                payload=wire.encode_job(job, self.reply_channel),
                affinity=affinity_key(self._fleet, job),
                # On max_tokens, where one node charges its running output
                # estimate: the replica has none. Completion settles either.
                charge=self._meter(job.tenant, job.prompt_tokens, job.max_tokens)
                if self._meter is not None
                else 0.0,
                work=job.work or job.prompt_tokens + job.max_tokens,
                prompt=job.prompt_tokens,
            )
            # Before the enqueue returns, a node may already have started it.
            waiting.queued_at = item.arrival
            try:
                await self.store.enqueue(
                    item, max_queued=tier.max_queue_len, notice=self._pushed_out
                )
            except GatewayError:
                # Full, overloaded or unreachable: typed in the one error
                # table (runtime/errors.py), answered as they stand.
                waiting.ended = True
                raise
            if tier.expiry_ms is not None:
                waiting.expiry = asyncio.get_running_loop().call_later(
                    tier.expiry_ms / 1000.0, self._expire, request_id, tier.expiry_ms
                )
            async for chunk in self._relay(job, waiting):
                yield chunk
        finally:
            if waiting.expiry is not None:
                waiting.expiry.cancel()
            if not waiting.ended:
                # Closed before its end: the client went away.
                self._cancel_soon(request_id)
            self._waiting.pop(request_id, None)

    async def _relay(self, job: GenerationJob, waiting: _Waiting) -> AsyncIterator[Chunk]:
        token = 0
        streamed = job.streamed
        sent = 0  # tokens the consumer has been given
        skip = 0  # tokens of the current run that repeat what it was given
        held: list[Chunk] = []  # a whole-answer client's output so far
        while True:
            _, event_token, kind, data = await waiting.events.get()
            if event_token < token:
                continue  # a dead run's straggler
            if event_token > token:
                # A new run (the first, or a re-run after a node was lost).
                if token:
                    log.warning("request %s: re-run after its engine node was lost", job.request_id)
                token = event_token
                held.clear()
                skip = sent
            if kind == wire.ERROR:
                waiting.ended = True
                error_kind, message, *more = data
                if error_kind == "expired":
                    raise Expired(message)
                if error_kind == "unavailable":
                    raise BackendUnavailable(message)
                if error_kind == "overloaded":
                    raise Overloaded(message, retry_after_s=more[0] if more else None)
                if error_kind == "rejected":
                    raise BackendRejected(message, param=more[0] if more else None,
                                          context_length=len(more) > 1 and more[1] is True)
                raise BackendError(message)
            chunk = wire.chunk_of(data)
            if chunk.finish_reason is not None:
                waiting.ended = True
            if not streamed:
                held.append(chunk)
                if chunk.finish_reason is not None:
                    for piece in held:
                        yield piece
                    return
                continue
            if skip:
                if chunk.tokens <= skip and chunk.finish_reason is None:
                    skip -= chunk.tokens
                    continue
                chunk.tokens -= min(skip, chunk.tokens)
                skip = 0
            sent += chunk.tokens
            yield chunk
            if chunk.finish_reason is not None:
                return

    def _pushed_out(self, item: WorkItem) -> tuple[str, bytes] | None:
        """What tells the replica of a queued item (this one or another) that
        the item enqueued now took its place: its tier's budget as
        Retry-After, as one node answers it."""
        try:
            _, reply_to = wire.decode_job(item.payload)
        except ValueError:
            log.error("request %s: its place was taken, but its payload names no reply channel",
                      item.id)  # fmt: skip
            return None
        tier = self.store.tiers.tier(item.tier)
        event = wire.pushed_out_event(
            item.id,
            f"tier {item.tier!r} is full: its place in the fleet's queue went to a tenant "
            f"further behind in its fair share",
            tier.budget_s if tier.budget_s is not None else 1.0,
        )  # fmt: skip
        return reply_to, wire.encode_events([event])

    def _expire(self, request_id: str, budget_ms: float) -> None:
        waiting = self._waiting.get(request_id)
        if waiting is None or waiting.ended:
            return
        waiting.expiry = None

        async def expire() -> None:
            try:
                was = await self.store.cancel(request_id, time.time(), only_queued=True)
            except WorkQueueError as exc:
                log.warning("request %s: could not expire it: %s", request_id, exc)
                return
            if was == "queued":
                waiting.events.put_nowait(wire.error_event(
                    request_id, wire.LOCAL_TOKEN, "expired",
                    f"queued in the fleet longer than its tier allows ({budget_ms:.0f} ms)",
                ))  # fmt: skip

        self._chore(expire())

    def _cancel_soon(self, request_id: str) -> None:
        async def cancel() -> None:
            try:
                was = await self.store.cancel(request_id, time.time())
                if was == "leased":
                    await self.store.redis.publish(self.cancel_channel, request_id)
            except (WorkQueueError, RedisError, OSError) as exc:
                # The node will run it to its end for nobody; its output is
                # dropped here, and the request has already ended.
                log.warning("request %s: could not cancel it in the fleet: %s", request_id, exc)

        self._chore(cancel())

    def _chore(self, coro: Any) -> None:
        task = asyncio.get_running_loop().create_task(coro)
        self._chores.add(task)
        task.add_done_callback(self._chores.discard)

    def abort(self, request_id: str) -> None:
        waiting = self._waiting.get(request_id)
        if waiting is None or waiting.ended:
            return
        waiting.ended = True
        self._cancel_soon(request_id)
        # Whoever reads the stream stops at once.
        waiting.events.put_nowait(
            wire.error_event(request_id, wire.LOCAL_TOKEN, "unavailable", "the request was aborted")
        )
