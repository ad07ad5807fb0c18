"""The gateway: the async shell around the synchronous scheduling core.

`Gateway.admit` takes a request from identity to a `RequestStream`: it
shapes the ask (max_tokens clamped, prompt counted), reserves the tenant's
quota and runs admission (`submit`), counting every refusal by its outcome.
The consumer (an HTTP handler) iterates the stream, which waits to be
dispatched and then pulls the backend's output in the consumer's own task;
the stream and the gateway talk through `StreamHost` and the stream's
"the gateway's side" methods, nothing else. The
dispatcher is not a task of its own: it is a callback run when something may
have changed (a submit, a request ending, the backend reporting capacity, or
the one timer the last plan asked for), so an idle gateway does nothing.

Every request the gateway admits ends in exactly one `Outcome`, always set by
the scheduler (the request record is finished there), and the error a
consumer sees is the one class that maps to it.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import AsyncIterator, Callable, Iterable, Mapping, Sequence
from typing import Any, Literal, Protocol

import structlog

from qosgate.backends.base import (
    Backend,
    BackendError,
    BackendRejected,
    BackendStream,
    BackendUnavailable,
    Chunk,
    GenerationJob,
    PLAIN_STREAM,
)
from qosgate.config.models import PolicyConfig
from qosgate.config.scheduling import scheduling_policy
from qosgate.core.request import Outcome, Request, RequestState
from qosgate.core.scheduler import BackendCapacity, SchedulePlan, Scheduler
from qosgate.observability import Observer
from qosgate.quotas import LimitState, QuotaGuard, QuotaStoreDown, Reservation
from qosgate.runtime.ask import Ask, shape
from qosgate.runtime.errors import (
    BackendFailed,
    BackendUnavailableError,
    BadRequest,
    ContextLengthExceeded,
    Expired,
    GatewayClosing,
    GatewayError,
    Overloaded,
    QueueFull,
    QuotaExceeded,
    QuotaLeaseLost,
    QuotaStoreUnavailable,
)

log = logging.getLogger(__name__)
_prompt_log = structlog.get_logger("qosgate.prompts")
_OnQuota = Callable[[Sequence[LimitState]], None]
_Held = Reservation | None


class PolicyReloadRefused(ValueError):
    """A reloaded policy changes what only a restart can change."""


class Gateway:
    """One scheduler in front of one backend."""

    def __init__(
        self,
        policy: PolicyConfig,
        backend: Backend,
        *,
        drain_rate_hint: float | None = None,
        quotas: QuotaGuard | None = None,
        observer: Observer | None = None,
    ) -> None:
        # Without a guard of its own it builds one from the policy (memory or
        # Redis, as `quota_store` says); likewise its metrics, in a registry
        # of their own.
        self._policy = policy
        self._backend = backend
        self.quotas = quotas if quotas is not None else QuotaGuard.from_policy(policy)
        """Reserves a request's quota in `admit` and settles it when it ends."""
        self.quotas.on_lease_lost = self._lease_lost
        self.observer = observer if observer is not None else Observer(policy)
        """Metrics and the request log, fed at each event of a request."""
        self.observer.metrics.watch(self.snapshot)
        self.observer.metrics.watch_models(lambda: self._backend.models)
        if backend.engine_metrics is not None:
            self.observer.metrics.include(backend.engine_metrics)
        # A backend that queues what it takes (the fleet's) reports when the
        # waiting there ends.
        backend.set_start_listener(self.observer.metrics.fleet_started)
        self._step_tokens = backend.step_tokens
        rules = scheduling_policy(policy, step_tokens=self._step_tokens,
                                  prefill_limits=backend.releases_prefill,
                                  in_order=backend.arrival_order_queue)
        self._scheduler = Scheduler(rules, drain_rate_hint=drain_rate_hint)
        backend.hold_room(rules.held_slots)
        self._loop: asyncio.AbstractEventLoop | None = None
        # Requests admitted and not yet finished.
        self._streams: dict[str, RequestStream] = {}
        # Dispatched, but the consumer has not handed them to the backend yet, so
        # the backend's capacity does not show them: without holding their room
        # here, a dispatcher run in between would give it away twice.
        self._reserved: dict[str, int] = {}
        self._reserved_kv = 0
        self._wake_handle: asyncio.Handle | None = None
        self._timer: asyncio.TimerHandle | None = None
        self._timer_at = 0.0
        self._closed = False
        # Set by drain(): new requests are refused, running ones go on.
        self._draining = False
        # Resolved when the last stream ends while draining.
        self._idle: asyncio.Future[None] | None = None

    # -- lifecycle -----------------------------------------------------------

    async def start(self) -> None:
        self._loop = asyncio.get_running_loop()
        self.observer.start(self._loop.time)
        self._backend.set_capacity_listener(self._wake)
        await self._backend.start()
        # Anything submitted before the backend was up can go now.
        self._wake()

    async def drain(self, grace_s: float) -> int:
        """The first half of a graceful stop. From now on new requests are
        refused and queued ones end at once, both with GatewayClosing (503 and
        Retry-After: another replica can take them); running requests may
        finish for up to `grace_s`. Returns how many were still running then
        (`close()` ends them)."""
        self._draining = True
        for stream in list(self._streams.values()):
            if stream.request.state is not RequestState.RUNNING:
                # One error each: each consumer raises its own, with its own traceback.
                stream.end(GatewayClosing())
        if not self._streams:
            return 0
        self._idle = self._get_loop().create_future()
        with contextlib.suppress(TimeoutError):
            async with asyncio.timeout(grace_s):
                await asyncio.shield(self._idle)
        return len(self._streams)

    @property
    def draining(self) -> bool:
        """True once drain() has begun: the gateway takes no more requests."""
        return self._draining or self._closed

    async def close(self) -> None:
        """End every request (GatewayClosing, outcome cancelled) and close the backend."""
        if self._closed:
            return
        self._closed = True
        # Nothing arms them again: a closed gateway dispatches nothing.
        for handle in (self._wake_handle, self._timer):
            if handle is not None:
                handle.cancel()
        for stream in list(self._streams.values()):
            stream.end(GatewayClosing())
        # Every request has ended, so the trace has its last lines.
        self.observer.close()
        await self._backend.close()
        await self.quotas.close()

    # -- reload --------------------------------------------------------------

    RESTART_ONLY = ("scheduler", "backend", "server", "quota_store", "observability", "batch")
    """Sections a reload cannot change (a restart can)."""

    def reload(self, policy: PolicyConfig) -> None:
        """Swap in a reloaded policy's tiers, tenants and quotas, all at once
        (no await between). Queued and running requests are unaffected.
        Raises PolicyReloadRefused, naming the section, if the new policy
        changes one that needs a restart; the old policy then stays."""
        for section in self.RESTART_ONLY:
            if getattr(policy, section) != getattr(self._policy, section):
                raise PolicyReloadRefused(
                    f"{section}: changed, and changing it needs a restart "
                    "(a reload swaps tiers, tenants and quotas)"
                )
        self._policy = policy
        self._reconfigure()
        self.quotas.set_limits(policy)
        self.observer.metrics.set_tiers(policy)
        self._wake()

    def _reconfigure(self) -> None:
        backend = self._backend
        self._step_tokens = backend.step_tokens
        self._scheduler.reconfigure(scheduling_policy(
            self._policy, step_tokens=self._step_tokens, prefill_limits=backend.releases_prefill,
            in_order=backend.arrival_order_queue))

    # -- views ---------------------------------------------------------------

    @property
    def policy(self) -> PolicyConfig:
        return self._policy

    @property
    def scheduler(self) -> Scheduler:
        return self._scheduler

    @property
    def backend(self) -> Backend:
        return self._backend

    def ready(self) -> bool:
        """Whether to send it traffic: the backend is up and no stop has begun
        (a draining gateway leaves the load balancer's rotation first)."""
        return not self.draining and self._backend.ready()

    def snapshot(self) -> dict:
        loop = self._get_loop()
        snap = self._scheduler.snapshot(loop.time())
        cap = self._backend.capacity()
        snap["backend"] = {
            "ready": self._backend.ready(),
            "free_slots": cap.free_slots,
            "free_kv_tokens": cap.free_kv_tokens,
            "kv_capacity_tokens": cap.kv_capacity_tokens,
            "dispatched_not_started": len(self._reserved),
            "restarts": self._backend.restarts,
        }
        snap["quota_store"] = {
            **vars(self.quotas.counters),
            "up": not self.quotas.store_down,
            "failing_open": self.quotas.failing_open,
        }
        return snap

    # -- requests ------------------------------------------------------------

    async def admit(
        self, ask: Ask, *, on_quota: _OnQuota | None = None, hold_settlement: bool = False
    ) -> RequestStream:
        """Take a validated request from its client's identity to a stream:
        its max_tokens clamped to the tier and the model's context, its
        prompt counted, its quota reserved (`on_quota` gets the tenant's
        limits as they stand once checked, admitted or not), then `submit`.
        Every refusal on the way is counted here, by its outcome, and raised
        as its typed error (ContextLengthExceeded, QuotaExceeded,
        QuotaStoreUnavailable, and `submit`'s); the quota reserved is
        refunded when admission refuses the request.

        `hold_settlement`: when the request ends, its settlement is worked
        out as always but kept on the stream, to be made by the consumer
        with `settle_held` once it has recorded the result; and a shared
        quota store keeps a record of the reservation until it is settled,
        so that a consumer that restarts can settle it, exactly once
        (`QuotaGuard.settle_recorded`): a batch line."""
        arrival = self._get_loop().time()
        try:
            shaped = shape(
                ask, self._policy.tiers[ask.tier],
                self._backend.count_prompt_tokens, self._backend.max_model_len,
            )  # fmt: skip
        except GatewayError as exc:
            self.refused(ask.tier, exc.outcome, tenant=ask.tenant, model=ask.body.get("model"))
            raise
        if self._policy.observability.log_prompts:
            body = shaped.body
            prompt = body.get("messages") if ask.endpoint == "chat" else body.get("prompt")
            _prompt_log.info("prompt", endpoint=ask.endpoint, prompt=prompt)
        try:
            tokens = shaped.prompt_tokens + shaped.max_tokens
            reservation = await self._reserve(ask, tokens, on_quota, record=hold_settlement)
        except GatewayError as exc:
            # Counted, its lengths known: the trace keeps it as an arrival.
            refused = Request(
                ask.request_id, ask.tenant, ask.tier, shaped.prompt_tokens, shaped.max_tokens,
                arrival, priority_offset=ask.priority_offset,
            )  # fmt: skip
            self.refused(ask.tier, exc.outcome, refused, model=ask.body.get("model"))
            raise
        return self.submit(
            request_id=ask.request_id, tenant=ask.tenant, tier=ask.tier, endpoint=ask.endpoint,
            body=shaped.body, prompt_tokens=shaped.prompt_tokens, max_tokens=shaped.max_tokens,
            priority_offset=ask.priority_offset, session=ask.session, reservation=reservation,
            trace=ask.trace,
            hold_settlement=hold_settlement,
        )  # fmt: skip

    async def _reserve(
        self, ask: Ask, tokens: int, on_quota: _OnQuota | None, *, record: bool = False
    ) -> _Held:
        # A tenant without limits has nothing to reserve: no coroutine to run.
        if self.quotas.limits(ask.tenant) is None:
            return None
        try:
            decision = await self.quotas.reserve(ask.tenant, tokens, ask.request_id, record=record)
        except QuotaStoreDown as exc:
            raise QuotaStoreUnavailable(str(exc), retry_after_s=exc.retry_after_s) from None
        if decision is None:
            return None
        if on_quota is not None:
            on_quota(decision.states)
        tokens_left = tightest_tokens(decision.states)
        if tokens_left is not None:
            self.observer.metrics.quota(ask.tenant, tokens_left.remaining)
        if not decision.admitted:
            raise QuotaExceeded(decision.reason, retry_after_s=decision.retry_after_s)
        return decision.reservation

    def submit(
        self,
        *,
        request_id: str,
        tenant: str,
        tier: str,
        endpoint: Literal["chat", "completions"],
        body: dict[str, Any],
        prompt_tokens: int,
        max_tokens: int,
        priority_offset: int = 0,
        session: str | None = None,
        reservation: Reservation | None = None,
        trace: Mapping[str, str] | None = None,
        hold_settlement: bool = False,
    ) -> RequestStream:
        """Admit a request now or refuse it (QueueFull / Overloaded, the request
        then finished with that outcome). Unknown tier or a reused request id
        are caller bugs and raise ValueError. The gateway takes over
        `reservation` (the request's quota): it is refunded if the request is
        refused, and settled when it ends."""
        loop = self._get_loop()
        now = loop.time()
        req = Request(
            request_id, tenant, tier, prompt_tokens, max_tokens, now,
            priority_offset=priority_offset,
        )  # fmt: skip
        model = body.get("model")
        if self.draining:
            raise self._refuse(req, model, reservation, GatewayClosing())
        down = self._backend_down()
        if down is not None:
            # Gone for good (not starting): queueing would only make the
            # client wait out its budget for the same answer.
            raise self._refuse(req, model, reservation, down)
        try:
            decision = self._scheduler.submit(req, now)
        except BaseException:
            self._settle(reservation, 0, served=False)
            raise
        if not decision.admitted:
            error = QueueFull if decision.outcome is Outcome.REJECTED_QUEUE_FULL else Overloaded
            raise self._refuse(
                req, model, reservation,
                error(decision.reason, retry_after_s=decision.retry_after_s),
            )  # fmt: skip
        job = GenerationJob(
            request_id=request_id,
            endpoint=endpoint,
            body=body,
            prompt_tokens=prompt_tokens,
            max_tokens=max_tokens,
            priority=self._scheduler.engine_priority(req),
            tenant=tenant,
            tier=tier,
            session=session,
            work=req.work,
            trace=trace,
        )
        stream = RequestStream(self, req, job, loop, reservation)
        stream.holds_settlement = hold_settlement and reservation is not None
        self._streams[request_id] = stream
        # Dispatch now rather than on the next loop turn: requests arriving in
        # the same turn would otherwise count each other, still undispatched,
        # as backlog and be refused while the backend has room for all of them.
        self._dispatch(now)
        return stream

    def _refuse(
        self, req: Request, model: object, reservation: _Held, error: GatewayError
    ) -> GatewayError:
        """Admission refused the request: its quota back, its outcome counted."""
        self._settle(reservation, 0, served=False)
        self.refused(req.tier, error.outcome, req, model=model)
        return error

    def refused(
        self,
        tier: str,
        outcome: Outcome,
        request: Request | None = None,
        *,
        tenant: str = "none",
        model: object = None,
    ) -> None:
        """Count a request refused before it reached a queue: where every
        refusal is counted, `admit`'s and `submit`'s and those of the HTTP
        layer before it has a request to admit (no key, a bad body).
        `request`, once its prompt is counted, goes into the trace; `tenant`,
        without it, once known; `model`, the name its client wrote, once read."""
        self.observer.refused(tier, outcome, request, tenant, model)

    # -- the stream's host (StreamHost) --------------------------------------

    def hand_over(self, job: GenerationJob) -> AsyncIterator[Chunk]:
        # The backend counts the job from here (at the latest before the first
        # await of its stream), so the room held for it at dispatch is given
        # back in this same step.
        self._unreserve(job.request_id)
        return self._backend.generate(job)

    def first_token(self, stream: RequestStream, now: float) -> None:
        request = stream.request
        if self._scheduler.on_first_token(request.id, now):
            self._wake()  # work held back for the prefill budget may go now
        self.observer.first_token(request, now, stream.model)

    def finish(self, stream: RequestStream, outcome: Outcome, now: float) -> None:
        self._scheduler.finish(stream.request.id, now, outcome, stream.output_tokens)
        self._forget(stream)

    def cancel(self, stream: RequestStream, outcome: Outcome, now: float) -> None:
        req = stream.request
        _, running = self._scheduler.cancel(req.id, now, stream.output_tokens, outcome)
        self._forget(stream)
        if running:
            self._backend.abort(req.id)

    def ended(self, stream: RequestStream) -> None:
        self._forget(stream)

    # -- the dispatcher ------------------------------------------------------

    def _get_loop(self) -> asyncio.AbstractEventLoop:
        if self._loop is None:
            self._loop = asyncio.get_running_loop()
        return self._loop

    def _wake(self) -> None:
        """Run the dispatcher soon; any number of wakes before it runs cost one run."""
        if self._wake_handle is None and not self._closed:
            self._wake_handle = self._get_loop().call_soon(self._on_wake)

    def _on_wake(self) -> None:
        self._wake_handle = None
        if self._backend.step_tokens != self._step_tokens:
            # An engine that loads in the background (vllm) knows its tokens
            # per step once it is up, and its capacity listener wakes us then:
            # an automatic prefill budget is counted in them.
            self._reconfigure()
        self._dispatch(self._get_loop().time())

    def _on_timer(self) -> None:
        when = self._timer_at
        self._timer = None
        # The loop may run a timer a clock tick early; the plan asked for this
        # instant, so schedule as of it rather than re-arm for the same one.
        self._dispatch(max(self._get_loop().time(), when))

    def _arm(self, when: float) -> None:
        if self._timer is not None:
            if self._timer_at <= when:
                return
            self._timer.cancel()
        self._timer_at = when
        self._timer = self._get_loop().call_at(when, self._on_timer)

    def _capacity(self, ready: bool) -> BackendCapacity:
        if not ready:
            # Requests wait in their queues (where they can still expire) for
            # the backend to come up; its listener wakes the dispatcher then.
            return BackendCapacity(0, 0, None)
        cap = self._backend.capacity()
        if not self._reserved:
            return cap
        return BackendCapacity(
            max(0, cap.free_slots - len(self._reserved)),
            max(0, cap.free_kv_tokens - self._reserved_kv),
            cap.kv_capacity_tokens,
            cap.slots,
        )

    def _backend_down(self) -> BackendUnavailableError | None:
        # Only a backend that can end for good (an engine that died) says so.
        error = self._backend.gone()
        if error is None:
            return None
        return BackendUnavailableError(str(error), retry_after_s=error.retry_after_s)

    def _dispatch(self, now: float) -> None:
        if self._closed:
            return
        down = self._backend_down()
        if down is not None:
            # What is queued will never run here: end it now (503, another
            # replica can take it). Running requests fail through their
            # backend streams.
            for stream in list(self._streams.values()):
                if stream.request.state is not RequestState.RUNNING:
                    stream.end(down)
            return
        while True:
            ready = self._backend.ready()
            cap = self._capacity(ready)
            plan = self._scheduler.schedule(now, cap, backend_ready=ready)
            self._carry_out(plan, cap, now)
            # A preemption frees room this same instant can use; a backend that
            # is down frees none, and asking again would only preempt more.
            if not plan.preempt or not self._backend.ready():
                break
        if plan.wakeup_at is not None:
            self._arm(plan.wakeup_at)

    def _carry_out(self, plan: SchedulePlan, cap: BackendCapacity, now: float) -> None:
        streams = self._streams
        kv_total = cap.kv_capacity_tokens
        observer = self.observer
        if plan.batches:
            observer.released(plan.batches)
        for req in plan.dispatch:
            stream = streams[req.id]
            observer.dispatched(req, now, stream.model)
            # What the scheduler counted against free KV for it.
            need = req.work if kv_total is None else min(req.work, kv_total)
            self._reserved[req.id] = need
            self._reserved_kv += need
            stream.dispatched()
        for req in plan.expired:
            stream = streams[req.id]
            if req.outcome is Outcome.EXPIRED:
                assert req.deadline is not None  # only requests with one expire
                allowed_ms = (req.deadline - req.arrival) * 1000.0
                stream.ended_in_queue(Expired(
                    f"queued longer than tier {req.tier!r} allows ({allowed_ms:.0f} ms)"
                ))  # fmt: skip
            else:
                # The core ended it backend_error: the wait was the backend's
                # doing (down or starting), not load, so say so (503, retry).
                stream.ended_in_queue(BackendUnavailableError(
                    "the backend is not ready", retry_after_s=1.0
                ))  # fmt: skip
        for req in plan.pushed_out:
            streams[req.id].ended_in_queue(Overloaded(
                f"tier {req.tier!r} is full: after {now - req.arrival:.2f}s queued, its place "
                f"went to a tenant further behind in its fair share",
                retry_after_s=req.deadline - req.arrival if req.deadline is not None else 1.0,
            ))  # fmt: skip
        for req in plan.failed:
            stream = streams[req.id]
            param = "messages" if stream.job.endpoint == "chat" else "prompt"
            stream.ended_in_queue(BadRequest(
                f"the prompt ({req.prompt_tokens} tokens) can never fit the backend's "
                f"KV cache ({kv_total} tokens)",
                param=param,
            ))  # fmt: skip
        for req in plan.preempt:
            self._unreserve(req.id)
            streams[req.id].preempted()
            self._backend.abort(req.id)

    def _unreserve(self, request_id: str) -> None:
        need = self._reserved.pop(request_id, None)
        if need is not None:
            self._reserved_kv -= need

    def _forget(self, stream: RequestStream) -> None:
        """The request finished: its room (if it held any) is free again, and
        its quota is settled (here, where every way of ending meets, once)."""
        request_id = stream.request.id
        self._unreserve(request_id)
        if self._streams.pop(request_id, None) is not None:
            usage = stream.usage()
            if stream.reservation is not None:
                charged = sum(usage) if usage is not None else 0
                if stream.holds_settlement:
                    stream.owed = (charged, usage is not None)
                else:
                    self._settle(stream.reservation, charged, served=usage is not None)
            self.observer.finished(stream.request, usage, stream.model)
        if self._idle is not None and not self._streams and not self._idle.done():
            self._idle.set_result(None)
        self._wake()

    def settle_held(self, stream: RequestStream, *, refund: bool = False) -> None:
        """Make the settlement an ended stream admitted with `hold_settlement`
        kept: as worked out when it ended, or (`refund`) none of it charged
        and the request given back, for a consumer that will send it again.
        Exactly once; a stream without a reservation has nothing to settle."""
        if not stream.holds_settlement:
            return
        owed = stream.owed
        if owed is None:
            raise RuntimeError(f"request {stream.request.id} has not ended: nothing is owed yet")
        stream.holds_settlement = False
        charged, served = (0, False) if refund else owed
        self._settle(stream.reservation, charged, served=served)

    def _lease_lost(self, reservation: Reservation) -> None:
        """The quota store lost a running request's concurrency lease (fail_closed)."""
        stream = self._streams.get(reservation.request_id)
        if stream is not None and stream.reservation is reservation:
            stream.end(
                QuotaLeaseLost(
                    "the quota store could not renew this request's concurrency lease",
                    retry_after_s=1.0,
                )
            )

    def _settle(self, reservation: Reservation | None, charged: int, *, served: bool) -> None:
        if reservation is not None:
            self.quotas.settle_soon(reservation, charged, served)


def tightest_tokens(states: Iterable[LimitState]) -> LimitState | None:
    """The token limit with the least left (what the quota gauge and the
    x-ratelimit-*-tokens headers show); None for a tenant without one."""
    tokens = [s for s in states if s.kind in ("tokens_per_minute", "tokens_per_day")]
    return min(tokens, key=lambda s: s.remaining) if tokens else None


class StreamHost(Protocol):
    """What a `RequestStream` asks of its gateway, and all it asks."""

    def hand_over(self, job: GenerationJob) -> AsyncIterator[Chunk]:
        """Start the dispatched job in the backend."""

    def first_token(self, stream: RequestStream, now: float) -> None:
        """The request's first output reached its consumer."""

    def finish(self, stream: RequestStream, outcome: Outcome, now: float) -> None:
        """The request ended running, with `outcome` (completed, failed)."""

    def cancel(self, stream: RequestStream, outcome: Outcome, now: float) -> None:
        """End the request wherever it is (queue or backend), with `outcome`."""

    def ended(self, stream: RequestStream) -> None:
        """The scheduler finished the request in its queue."""


class RequestStream:
    """One admitted request, as an async iterator of its output chunks.

    Iterate it at most once. A consumer that stops early must call `aclose()`
    (e.g. `async with contextlib.aclosing(stream)`): that is how the gateway
    learns the client went away. Cancelling the consumer's task while it
    iterates has the same effect.
    """

    def __init__(
        self,
        host: StreamHost,
        request: Request,
        job: GenerationJob,
        loop: asyncio.AbstractEventLoop,
        reservation: Reservation | None = None,
    ) -> None:
        self.request = request
        self.job = job
        self.reservation = reservation
        """The request's quota, settled by the gateway when it ends."""
        self.holds_settlement = False
        """Its settlement waits for the consumer (`Gateway.settle_held`)."""
        self.owed: tuple[int, bool] | None = None
        """(charged, served), once a held settlement is worked out."""
        self._host = host
        self._loop = loop
        # Whether the backend ever ran it, and the prompt size it reported:
        # what the tenant is charged for if it ends cancelled.
        self._ran = False
        self._reported_prompt: int | None = None
        # Resolved when the request is dispatched, or ends while queued.
        self._go: asyncio.Future[None] = loop.create_future()
        # Bumped on every preemption, so a consumer can tell that the backend
        # run it is reading is no longer the request's current one.
        self._epoch = 0
        self.output_tokens = 0
        """Output tokens delivered so far (the backend's count once it ends)."""
        self._error: GatewayError | None = None
        self._agen: AsyncIterator[Chunk] | None = None
        # The backend stream being read (PLAIN_STREAM between two), and the
        # last one read: their abilities.
        self._reading: BackendStream = PLAIN_STREAM
        self._last_read: BackendStream = PLAIN_STREAM
        self._on_first_output: list[Callable[[], None]] = []

    @property
    def model(self) -> object:
        """The model its client asked for, as written."""
        return self.job.body.get("model")

    def on_first_output(self, callback: Callable[[], None]) -> None:
        """Call `callback` once its first output has reached the consumer (at
        once if it has): from then it holds a place in the backend, whichever
        backend it is, one that queues (the fleet's) included."""
        if self.request.first_token_at is not None:
            callback()
        else:
            self._on_first_output.append(callback)

    def __aiter__(self) -> AsyncIterator[Chunk]:
        if self._agen is None:
            self._agen = self._iterate()
        return self._agen

    def ready(self) -> bool:
        """True when the next chunk is at hand, so that iterating on will not
        wait: a consumer can hold back what it sends until then and send it all
        at once. False when the backend's stream cannot tell."""
        # Nothing between two chunks of one backend stream waits: once a chunk
        # has gone out the request is no longer preempted.
        return self._reading.ready()

    async def aclose(self) -> None:
        """The client went away: a queued request leaves its queue now, a running
        one is aborted in the backend; outcome cancelled. Idempotent."""
        self.end(None)
        agen = self._agen
        # A consumer inside __anext__ (another task) wakes from _end and closes
        # its backend stream itself; one parked at a yield needs closing here.
        if agen is not None and not agen.ag_running:  # type: ignore[attr-defined]
            await agen.aclose()  # type: ignore[attr-defined]

    # -- the gateway's side --------------------------------------------------

    def dispatched(self) -> None:
        # Done already only if the consumer's task was just cancelled while it
        # waited (that cancels the future too); its handler ends the request.
        if not self._go.done():
            self._go.set_result(None)

    def preempted(self) -> None:
        self._epoch += 1
        # It was dispatched, so its future is spent; a fresh one waits for the next dispatch.
        self._go = self._loop.create_future()

    def ended_in_queue(self, error: GatewayError) -> None:
        """The scheduler finished it while queued (expired, failed)."""
        self._error = error
        self._host.ended(self)
        if not self._go.done():
            self._go.set_result(None)

    def end(self, error: GatewayError | None) -> None:
        """Cancel the request wherever it is (no-op once it has an outcome). With
        `error` (gateway shutdown) the consumer raises it; without (client gone)
        the consumer's iteration just stops."""
        if self.request.finished:
            return
        outcome = error.outcome if error is not None else Outcome.CANCELLED
        self._error = error
        self._host.cancel(self, outcome, self._loop.time())
        if not self._go.done():
            self._go.set_result(None)

    def _fail(self, error: GatewayError) -> GatewayError:
        """A running request failed in the backend: finish it with the error's outcome."""
        if not self.request.finished:
            self._error = error
            self._host.finish(self, error.outcome, self._loop.time())
        return error

    def usage(self) -> tuple[int, int] | None:
        """(prompt, completion) tokens the request used, now that it has
        ended; None if it never ran. What ran is paid for (quotas) and counted
        (metrics), including a request cancelled mid-way; a request refused,
        expired, failed by the backend, or cancelled before it ran is not."""
        req = self.request
        # Handed to a backend that queues it (the fleet's), and still waiting
        # there, it did not run: as if cancelled in the gateway's own queue.
        ran = self._ran and self._last_read.started()
        if req.outcome is Outcome.COMPLETED or (req.outcome is Outcome.CANCELLED and ran):
            prompt = self._reported_prompt
            return (prompt if prompt is not None else req.prompt_tokens), self.output_tokens
        return None

    # -- the consumer's side -------------------------------------------------

    async def _iterate(self) -> AsyncIterator[Chunk]:
        req = self.request
        host = self._host
        try:
            while True:
                go = self._go
                await go
                if req.finished:
                    break
                if go is not self._go:
                    # Preempted after dispatch but before this task ran.
                    continue
                epoch = self._epoch
                self._ran = True
                try:
                    gen = host.hand_over(self.job)
                except Exception as exc:
                    raise self._fail(_map_backend_error(req, exc)) from exc
                self._reading = self._last_read = (
                    gen if isinstance(gen, BackendStream) else PLAIN_STREAM
                )
                closed = False
                try:
                    while True:
                        try:
                            chunk = await anext(gen, None)
                        except Exception as exc:
                            if self._epoch != epoch or req.finished:
                                break
                            raise self._fail(_map_backend_error(req, exc)) from exc
                        if self._epoch != epoch or req.finished:
                            # Preempted or cancelled: whatever the old run still
                            # delivered never reaches the client.
                            break
                        if chunk is None:
                            raise self._fail(BackendFailed("the backend ended the stream early"))
                        now = self._loop.time()
                        if req.first_token_at is None:
                            # From here the core will not preempt it: the
                            # client has output that cannot be taken back.
                            host.first_token(self, now)
                            callbacks, self._on_first_output = self._on_first_output, []
                            for callback in callbacks:
                                callback()
                        self.output_tokens += chunk.tokens
                        if chunk.finish_reason is not None:
                            usage = chunk.usage or {}
                            self._reported_prompt = usage.get("prompt_tokens")
                            output = usage.get("completion_tokens", self.output_tokens)
                            self.output_tokens = output
                            host.finish(self, Outcome.COMPLETED, now)
                            # Closed before the last chunk goes out: a consumer
                            # that stops reading at it leaves nothing open.
                            await _close_quietly(gen)
                            closed = True
                            yield chunk
                            return
                        yield chunk
                finally:
                    self._reading = PLAIN_STREAM
                    if not closed:
                        await _close_quietly(gen)
                if req.finished:
                    break
                # Preempted: back to waiting for dispatch.
                self.output_tokens = 0
            if self._error is not None:
                raise self._error
        except GatewayError:
            raise
        except BaseException:
            # Task cancelled or the iterator closed mid-way (GeneratorExit): the
            # client is gone, and the request must still end, exactly once.
            self.end(None)
            raise


_FAILED_RETRY_AFTER_S = 1.0
"""Retry-After of a request the backend failed before any output: by then the
upstream that failed it may be out of rotation, or back."""


def _map_backend_error(req: Request, exc: Exception) -> GatewayError:
    """The one place a backend's exception becomes the client's error. None of
    these requests is charged: they did not complete (RequestStream.usage)."""
    if isinstance(exc, GatewayError):
        # A backend that queues (the fleet's) ends requests the ways a queue
        # does: expired, queue full.
        return exc
    if isinstance(exc, BackendRejected):
        # The backend's word that the request itself is invalid: the client's
        # to fix, as any 400 of the gateway's own, with the gateway's code
        # when it is the context the request exceeds.
        error = ContextLengthExceeded if exc.context_length else BadRequest
        return error(exc.message, param=exc.param)
    if isinstance(exc, BackendUnavailable):
        return BackendUnavailableError(
            str(exc) or "the backend is unavailable", retry_after_s=exc.retry_after_s
        )
    if not isinstance(exc, BackendError):
        # Not a failure the backend reported but a bug in it; the request still
        # ends as a backend error, and the traceback must not be lost.
        log.error("request %s: unexpected error in the backend", req.id, exc_info=exc)
        return BackendFailed(str(exc) or "the backend failed")
    return BackendFailed(
        str(exc) or "the backend failed",
        retry_after_s=_FAILED_RETRY_AFTER_S if exc.retryable else None,
    )


async def _close_quietly(gen: AsyncIterator[Chunk]) -> None:
    try:
        await gen.aclose()  # type: ignore[attr-defined]
    except Exception:
        # The request's outcome is already decided; a backend that cannot
        # close cleanly must not turn it into a different one.
        log.exception("error closing a backend stream")
