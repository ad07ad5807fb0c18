"""An engine node: the backend's pump, pulling the fleet's most urgent work.

The node claims work only when its backend has room (free sequence slots as
the backend reports them; a claimed item enters the backend in the claim's
own step), and
is woken, never polling, by:
- a message on the wake channel (every enqueue publishes one);
- its backend's capacity listener (a sequence finished);
- a timer at the first lease expiry in the store, while it has room, so a
  dead node's work is taken back even when nothing else happens;
- a timer at the instant a node it held affinity work back for stops
  counting as live, so such work is not left waiting for a dead node;
- a run's first token, when its last claim left work queued for one (the
  prefill budget, or delay tiers' pace: the prompt tokens in its backend's
  prefill queue are the node's own count, as one node's scheduler keeps).

Every third of `lease_s` the node records in the store that it is live,
how much room it has and how many tokens/s it completes while full (a
heartbeat; each claim records the same): other nodes leave it the work whose
session it last ran only while it is live and has room, and the gateways'
admission divides the queued work by the live nodes' summed rates. A
stopping node takes its record out first.

Each claimed item runs in a task of its own: its output goes back to the
gateway holding the client, batched per gateway per event-loop turn; the
last chunk (or the error that ends it) is published by the same Lua step
that completes the item, so the gateway hears of the end exactly when it
happened. A renewal timer extends every held lease each third of `lease_s`;
a lease found lost (cancelled by its gateway, or taken over after this node
stalled) stops its run. So does a gateway found gone: at each renewal, and
after each claim, the node asks Redis whether anyone still subscribes to the
reply channels of its items, and ends those nobody waits for. Their
requests' quota concurrency slots (quota_store: redis) are released with
them: a replica that died can neither settle nor renew them, and the
tenant's other requests should not wait out `quota_store.lease_s` for them.
On shutdown the node releases what it has not finished, so other nodes take
it at once, at its original arrival.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import logging
import time
from collections.abc import AsyncIterator, Coroutine
from typing import Any

from redis.exceptions import RedisError

from qosgate.backends.base import Backend, BackendError, BackendUnavailable, Chunk, GenerationJob
from qosgate.config.models import FleetConfig, PolicyConfig
from qosgate.config.scheduling import scheduling_policy
from qosgate.core.admission import DEFAULT_DRAIN_RATE, DrainRateEstimator, saturated
from qosgate.core.arrivals_hold import ArrivalsHold, top_budget
from qosgate.core.ordering import may_preempt, preemption_victim
from qosgate.observability.otel import Tracing
from qosgate.quotas import QuotaStore, QuotaStoreError, build_store
from qosgate.runtime.errors import WorkQueueError

from . import wire
from .gateway import default_node_id, fleet_store
from .model import Lease, Prefill, ServiceMeter
from .redis_store import Subscription

log = logging.getLogger(__name__)


class _Outbox:
    """Events for gateways, published once per loop turn per gateway, in order."""

    def __init__(self, redis: Any) -> None:
        self._redis = redis
        self._pending: dict[str, list[wire.Event]] = {}
        self._lock = asyncio.Lock()
        self._scheduled = False
        self._tasks: set[asyncio.Task[None]] = set()

    def put(self, channel: str, event: wire.Event) -> None:
        self._pending.setdefault(channel, []).append(event)
        if not self._scheduled:
            self._scheduled = True
            asyncio.get_running_loop().call_soon(self._spawn)

    def _spawn(self) -> None:
        self._scheduled = False
        task = asyncio.get_running_loop().create_task(self.flush())
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    async def flush(self) -> None:
        """Publish everything put so far; when it returns, all of it is out.
        Batches go out one at a time under the lock, so order holds."""
        async with self._lock:
            pending, self._pending = self._pending, {}
            if not pending:
                return
            try:
                async with self._redis.pipeline(transaction=False) as pipe:
                    for channel, events in pending.items():
                        pipe.publish(channel, wire.encode_events(events))
                    await pipe.execute()
            except (RedisError, OSError) as exc:
                # Lost output: the requests' own completion (or lease) decides
                # their end; a stream missing pieces is the price of an outage.
                log.error("could not publish output to gateways: %r", exc)


class EngineNode:
    """Runs claimed fleet work on `backend`."""

    def __init__(self, policy: PolicyConfig, fleet: FleetConfig, backend: Backend) -> None:
        self.backend = backend
        self.tracing = Tracing.from_config(policy.observability.otel)
        """OpenTelemetry tracing: each run of a traced item is a span of the
        trace its replica began (None: off)."""
        self.node = fleet.node_id or default_node_id()
        self.store = fleet_store(policy, fleet)
        # Its prefill limits come from _learn_step, against its backend's step.
        rules = scheduling_policy(policy)
        backend.hold_room(rules.held_slots)
        self._meter = ServiceMeter(rules) if rules.fair else None
        # Slots this node keeps for the top level's expected arrivals, over
        # its own runs, as one node's scheduler does over its backend's.
        share = rules.arrivals_share
        self._arrivals_hold = (
            ArrivalsHold(share, rules.held_slots) if share > 0.0 else None)
        self._top_level = min(t.priority for t in rules.tiers.values())
        self._top_budget = top_budget(rules.tiers.values())
        self._started: dict[str, float] = {}
        """When each run began (loop time), in the order they began."""
        # What this node completes while full, as one node measures its
        # backend: its share of the fleet's drain rate, which the gateways'
        # admission sums over the live nodes.
        self.drain = DrainRateEstimator(
            rules.drain_rate_tau_s, rules.initial_drain_rate or DEFAULT_DRAIN_RATE
        )
        self.lease_s = fleet.lease_s
        self._tiers = rules.tiers
        self._preemption = rules.preemption
        # Items whose output has begun to go out: never preempted, since what
        # a client has seen cannot be taken back.
        self._streaming: set[str] = set()
        self._preempting: asyncio.Task[None] | None = None
        self.preempted = 0
        """Items this node gave back for more urgent work (for stats and tests)."""
        self.cancel_channel = f"{self.store.base}cancel"
        self._wake_channel = self.store.wake_channel.encode()
        self._outbox = _Outbox(self.store.redis)
        self._runs: dict[str, asyncio.Task[None]] = {}
        self._at_reserve = False
        """The last claim stopped at the reserved slots (Claim.at_reserve)."""
        self._policy = policy
        self._step_tokens: int | None = None
        self._prefill_limits: tuple[int | None, int | None] = (None, None)
        self._learn_step()
        self._in_prefill: dict[str, int] = {}
        """Prompt tokens of each run that has no first token yet: this node's
        side of the backend's prefill queue, which its claims keep within the
        prefill budget as one node's scheduler does."""
        self._waits_for_prefill = False
        """The last claim left work queued for a first token here
        (Claim.held_for_prefill or Claim.paced)."""
        self._spans: dict[str, Any] = {}
        """The span of each traced run, ended with the run."""
        self._leases: dict[str, Lease] = {}
        # The reply channel of each item held, and the channels seen with a
        # subscriber since the last renewal: a run whose gateway is gone is
        # stopped rather than run for nobody.
        self._replies: dict[str, str] = {}
        self._live_replies: set[str] = set()
        self.orphaned = 0
        """Runs stopped because no gateway waited for them any more (for stats and tests)."""
        # A memory store died with the replica that held the slots: only a
        # shared one still counts them.
        self._quotas: QuotaStore | None = (
            build_store(policy.quota_store) if policy.quota_store.kind == "redis" else None
        )
        self._claiming: asyncio.Task[None] | None = None
        self._again = False
        self._wake_handle: asyncio.Handle | None = None
        self._expiry_timer: asyncio.TimerHandle | None = None
        self._renew_timer: asyncio.TimerHandle | None = None
        self._renewing: asyncio.Task[None] | None = None
        self._wakes = Subscription(
            self.store, self.store.wake_channel, self.cancel_channel, what="wake channel"
        )
        self._listener: asyncio.Task[None] | None = None
        self._stopping = False
        self._stopped = False
        self.completed = 0
        """Items this node completed (for stats and tests)."""
        self.affinity = {"home": 0, "away": 0, "new": 0}
        """Items with an affinity key this node took: bound to it (its prefix
        cache may hold their session), bound to another node (full or gone),
        or bound nowhere yet."""

    # -- lifecycle -----------------------------------------------------------

    async def start(self) -> None:
        self.backend.set_capacity_listener(self.wake)
        await self.backend.start()
        await self._wakes.open()
        loop = asyncio.get_running_loop()
        # While the channel is lost the node claims only on its timers (a
        # failed claim retries in a second); once back, it claims whatever
        # was queued meanwhile.
        self._listener = loop.create_task(
            self._wakes.run(self._on_message, on_back=self.wake), name="fleet-wake"
        )
        self._arm_renewal()
        # Whatever was queued before this node came up.
        self.wake()

    def ready(self) -> bool:
        return not self._stopping and self.backend.ready()

    async def stop(self, grace_s: float) -> None:
        """Take no more work; let running items finish for up to `grace_s`,
        then give the rest back to the queue for other nodes."""
        if self._stopped:
            return
        self._stopped = self._stopping = True
        for handle in (self._wake_handle, self._expiry_timer):
            if handle is not None:
                handle.cancel()
        for chore in (self._claiming, self._preempting):
            if chore is not None:
                with contextlib.suppress(Exception):
                    await chore
        # After the last claim, which records this node's room.
        with contextlib.suppress(WorkQueueError):
            await self.store.leave(self.node)
        runs = list(self._runs.values())
        if runs:
            await asyncio.wait(runs, timeout=grace_s)
        for task in list(self._runs.values()):
            task.cancel()
        for lease in list(self._leases.values()):
            with contextlib.suppress(WorkQueueError):
                await self.store.release(lease)
        if self._runs:
            await asyncio.gather(*self._runs.values(), return_exceptions=True)
        if self._renew_timer is not None:
            self._renew_timer.cancel()
        if self._renewing is not None:
            self._renewing.cancel()
        if self._listener is not None:
            self._listener.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._listener
        await self._outbox.flush()
        await self._wakes.close()
        await self.backend.close()
        await self.store.close()
        if self._quotas is not None:
            await self._quotas.close()
        if self.tracing is not None:
            self.tracing.close()

    def status(self) -> dict[str, Any]:
        return {
            "node": self.node,
            "running": len(self._runs),
            "completed": self.completed,
            "free_slots": self.backend.capacity().free_slots,
            "drain_rate_tokens_per_s": self.drain.rate,
            "prefill_tokens": sum(self._in_prefill.values()),
            "preempted": self.preempted,
            "orphaned": self.orphaned,
            "affinity": dict(self.affinity),
        }

    # -- claiming ------------------------------------------------------------

    def _on_message(self, message: dict[str, Any]) -> None:
        """A wake (something was queued: claim, and perhaps preempt for it) or
        a gateway's cancellation of an item this node may be running."""
        if message["channel"] == self._wake_channel:
            self.wake()
            data = message["data"]
            if self._preemption and data.startswith(b"q:"):
                self._consider_preempting(data[2:].decode(errors="replace"))
        else:
            task = self._runs.get(message["data"].decode(errors="replace"))
            if task is not None:
                task.cancel()

    def _room(self) -> int:
        if self._stopping or not self.backend.ready():
            return 0
        return self.backend.capacity().free_slots

    def _learn_step(self) -> None:
        """The prefill budget and delay tiers' pace for this node's backend,
        as one node's gateway resolves them (`auto` counts its engine's
        tokens per step, which a vllm engine knows once it is up; fcfs has
        neither)."""
        self._step_tokens = self.backend.step_tokens
        rules = scheduling_policy(self._policy, step_tokens=self._step_tokens,
                                  in_order=self.backend.arrival_order_queue)
        self._prefill_limits = ((rules.prefill_budget_tokens, rules.delay_prefill_tokens)
                                if rules.tiered else (None, None))  # fmt: skip

    def _prefill(self) -> Prefill:
        """This node's prefill queue and its limits, for a claim."""
        if self.backend.step_tokens != self._step_tokens:
            self._learn_step()
        return Prefill(sum(self._in_prefill.values()), *self._prefill_limits)

    def _note_load(self) -> None:
        """Tell the drain estimate whether the time from now on is measured:
        only while the node is full for the work that waits is what it
        completes what it can do. A node that keeps its reserved slots for
        top-level work is full to the rest, as one node's scheduler counts it;
        so is one holding work for a first token, whose queue then drains at
        the pace of prefill (DrainRateEstimator.prefilled)."""
        full = bool(self._runs) and (
            saturated(self._room(), self._at_reserve) or self._waits_for_prefill)
        self.drain.advance(asyncio.get_running_loop().time(), full)

    def wake(self) -> None:
        """Claim soon if there is room; any number of wakes before it costs one claim."""
        if self._wake_handle is None and not self._stopping:
            self._wake_handle = asyncio.get_running_loop().call_soon(self._on_wake)

    def _on_wake(self) -> None:
        self._wake_handle = None
        if self._room() <= 0:
            return
        if self._claiming is not None:
            self._again = True
            return
        self._claiming = asyncio.get_running_loop().create_task(self._claim())

    async def _claim(self) -> None:
        try:
            while True:
                self._again = False
                room = self._room()
                if room <= 0:
                    return
                now = time.time()
                try:
                    claim = await self.store.claim(
                        self.node, room, now, self.lease_s, drain_rate=self.drain.rate,
                        prefill=self._prefill(), held_for_arrivals=self._held_for_arrivals(),
                    )
                except WorkQueueError as exc:
                    log.error("claim failed: %s", exc)
                    self._arm_expiry(time.time() + 1.0)
                    return
                self._at_reserve = claim.at_reserve
                self._waits_for_prefill = claim.held_for_prefill or claim.paced
                for lease in claim.leases:
                    tier = self._tiers.get(lease.item.tier)
                    if (self._arrivals_hold is not None and tier is not None
                            and tier.priority == self._top_level):
                        self._arrivals_hold.arrived(asyncio.get_running_loop().time())
                    if lease.item.affinity:
                        self.affinity[claim.placement(lease.item.id)] += 1
                    self._start(lease)
                self._note_load()
                # After the start, so that checking costs the runs no time; a
                # gateway already seen waiting since the last renewal is not
                # asked about again.
                await self._stop_orphans([lease.item.id for lease in claim.leases], fresh=False)
                if len(claim.leases) < room:
                    # Nothing more for this node: the next work is a new
                    # enqueue (a wake), another node filling up (a wake), a
                    # lease running out somewhere, or a node that work was
                    # held back for going silent.
                    with contextlib.suppress(WorkQueueError):
                        times = (await self.store.next_expiry(), claim.held_back_until)
                        at = min((t for t in times if t is not None), default=None)
                        if at is not None:
                            self._arm_expiry(at)
                    if not self._again:
                        return
        finally:
            self._claiming = None

    def _held_for_arrivals(self) -> int:
        """Free slots to keep for the top level's expected arrivals
        (core.arrivals_hold), on top of the tiers' reserve."""
        hold = self._arrivals_hold
        if hold is None or self._top_budget is None or not self._started:
            return 0
        capacity = self.backend.capacity()
        return hold.slots(asyncio.get_running_loop().time(), self._started.values(),
                          self._top_budget, free_slots=capacity.free_slots,
                          backend_slots=capacity.slots)  # fmt: skip

    def _arm_expiry(self, at: float) -> None:
        if self._expiry_timer is not None:
            self._expiry_timer.cancel()
        # A hair after the expiry, so that the claim finds it expired.
        delay = max(0.0, at - time.time()) + 0.01
        self._expiry_timer = asyncio.get_running_loop().call_later(delay, self._on_expiry)

    def _on_expiry(self) -> None:
        self._expiry_timer = None
        self.wake()

    # -- preemption ----------------------------------------------------------

    def _consider_preempting(self, tier: str) -> None:
        """Work of `tier` was queued: if this node is full, send back the
        newest run of the least important preemptible tier below it that has
        not begun its output (the store decides whether it is still needed,
        so that one queued item costs at most the runs it needs)."""
        if self._preempting is not None or self._stopping or self._room() > 0:
            return
        waiting = self._tiers.get(tier)
        if waiting is None:
            return
        runs: dict[str, list[Lease]] = {}
        for lease in self._leases.values():  # in the order taken
            if lease.item.tier in self._tiers:
                runs.setdefault(lease.item.tier, []).append(lease)
        tiers = sorted((t.priority, t.name) for t in self._tiers.values() if t.name in runs)
        # As one node's, with the runs sent back (preempted or lost) as its
        # count of preemptions.
        victim = preemption_victim(
            waiting.priority,
            [(p, self._tiers[name].preemptible, runs[name]) for p, name in tiers],
            lambda lease: may_preempt(lease.item.attempt, lease.item.id in self._streaming),
        )
        if victim is None:
            return
        self._preempting = asyncio.get_running_loop().create_task(self._preempt(victim))

    async def _preempt(self, lease: Lease) -> None:
        try:
            given_back = await self.store.preempt(lease, time.time())
        except WorkQueueError as exc:
            log.warning("work item %s: could not preempt it: %s", lease.item.id, exc)
            given_back = False
        finally:
            self._preempting = None
        task = self._runs.get(lease.item.id)
        if given_back and task is not None:
            # Back in its queue at its arrival: stop running it here. Its
            # gateway heard nothing of it yet, or hears the re-run's output
            # after what it has (the lease's fencing token moved on).
            self.preempted += 1
            log.info("work item %s: preempted for more urgent work", lease.item.id)
            task.cancel()

    # -- running -------------------------------------------------------------

    def _start(self, lease: Lease) -> None:
        """Hand a claimed item to the backend now, in the claim's own step, so
        that the backend's free slots count it before the next claim."""
        item_id = lease.item.id
        self._leases[item_id] = lease
        try:
            job, reply_to = wire.decode_job(lease.item.payload)
        except ValueError as exc:
            log.error("work item %s: %s; dropped", item_id, exc)
            self._hold(item_id, self._complete(lease, None))
            return
        self._replies[item_id] = reply_to
        span = None
        if self.tracing is not None and job.trace:
            span = self.tracing.start("engine run", job.trace, server=False)
            span.set_attributes({
                "qosgate.node": self.node, "qosgate.tenant": job.tenant, "qosgate.tier": job.tier,
                "gen_ai.usage.input_tokens": job.prompt_tokens,
            })  # fmt: skip
            # The backend's own calls (an upstream) are children of this run.
            job = dataclasses.replace(job, trace=self.tracing.headers(span))
        self._spans[item_id] = span
        try:
            gen = self.backend.generate(job)
        except BackendUnavailable as exc:
            log.warning("work item %s: the backend cannot take it (%s); given back", item_id, exc)
            self._hold(item_id, self._give_back(lease))
            return
        except BackendError as exc:
            event = wire.failure_event(item_id, lease.token, exc)
            self._hold(item_id, self._end(lease, reply_to, event))
            return
        self._outbox.put(reply_to, wire.started_event(item_id, lease.token))
        self._in_prefill[item_id] = job.prompt_tokens
        self._started[item_id] = asyncio.get_running_loop().time()
        self._hold(item_id, self._run(lease, job, reply_to, gen))

    def _hold(self, item_id: str, work: Coroutine[Any, Any, None]) -> None:
        """Run `work` for a held item; the item is let go when it ends, even
        if its task is cancelled before it starts (a cancel, a preemption or
        a lost lease in the claim's own step): `work` is the task's own
        coroutine, so it is never left unawaited, and the letting go is the
        task's done callback, which runs however the task ends."""

        def let_go(_: asyncio.Task[None]) -> None:
            span = self._spans.pop(item_id, None)
            if span is not None:
                span.end()
            self._runs.pop(item_id, None)
            self._leases.pop(item_id, None)
            self._replies.pop(item_id, None)
            self._streaming.discard(item_id)
            self._in_prefill.pop(item_id, None)
            self._started.pop(item_id, None)
            self._note_load()
            self.wake()

        task = asyncio.get_running_loop().create_task(work)
        task.add_done_callback(let_go)
        self._runs[item_id] = task

    async def _run(
        self, lease: Lease, job: GenerationJob, reply_to: str, gen: AsyncIterator[Chunk]
    ) -> None:
        item_id = lease.item.id
        output = 0
        prefilled = False
        try:
            async for chunk in gen:
                event = wire.chunk_event(item_id, lease.token, chunk)
                output += chunk.tokens
                if not prefilled and chunk.tokens:
                    prefilled = True
                    self.drain.prefilled(job.prompt_tokens, asyncio.get_running_loop().time())
                    self._in_prefill.pop(item_id, None)
                    if self._waits_for_prefill:
                        # What the last claim left for a first token may go now.
                        self.wake()
                if chunk.finish_reason is not None:
                    if chunk.usage and "completion_tokens" in chunk.usage:
                        output = int(chunk.usage["completion_tokens"])
                    ended = asyncio.get_running_loop().time()
                    self.drain.completed(job.prompt_tokens, output, ended, prefilled=prefilled)
                    started = self._started.get(item_id)
                    if self._arrivals_hold is not None and started is not None:
                        self._arrivals_hold.ended(ended, started)
                    await self._end(lease, reply_to, event, self._used(job, output))
                    return
                self._streaming.add(item_id)
                self._outbox.put(reply_to, event)
        except BackendUnavailable as exc:
            log.warning("work item %s: the backend failed (%s); given back", item_id, exc)
            await self._give_back(lease)
            return
        except BackendError as exc:
            event = wire.failure_event(item_id, lease.token, exc)
            await self._end(lease, reply_to, event, self._used(job, output))
            return
        finally:
            # Cancelled (lease lost, gateway's cancel, stop): the backend must
            # stop generating for nobody.
            aclose = getattr(gen, "aclose", None)
            if aclose is not None:
                with contextlib.suppress(Exception):
                    await aclose()
        event = wire.error_event(item_id, lease.token, "backend_error",
                                 "the backend ended the stream early")  # fmt: skip
        await self._end(lease, reply_to, event, self._used(job, output))

    async def _stop_orphans(self, item_ids: list[str], *, fresh: bool) -> None:
        """Stop the runs of `item_ids` that nobody waits for: no connection
        subscribes to their reply channel any more, because the gateway replica
        that queued them crashed or stopped. Each is ended in the store first
        (so that its lease is not taken over and run again elsewhere), then its
        run is cancelled, which aborts it in the backend. With `fresh`, every
        channel is asked about anew; otherwise only those not seen live since."""
        channels = {self._replies[i] for i in item_ids if i in self._replies}
        if not fresh:
            channels -= self._live_replies
        if not channels:
            if fresh:
                self._live_replies = set()
            return
        try:
            counts = await self.store.subscribers(channels)
        except WorkQueueError as exc:
            log.warning("could not tell whether gateways still wait: %s", exc)
            return
        live = {channel for channel, count in counts.items() if count > 0}
        self._live_replies = live if fresh else self._live_replies | live
        gone = {channel for channel, count in counts.items() if count == 0}
        stopped: dict[str, list[str]] = {}
        for item_id in item_ids:
            if self._replies.get(item_id) not in gone:
                continue
            task = self._runs.get(item_id)
            lease = self._leases.get(item_id)
            if task is None or task.done() or lease is None:
                continue
            try:
                await self.store.cancel(item_id, time.time())
            except WorkQueueError as exc:
                # Still leased: the next renewal asks again.
                log.warning("work item %s: could not end it: %s", item_id, exc)
                continue
            log.warning("work item %s: the gateway that queued it is gone; stopped", item_id)
            self.orphaned += 1
            task.cancel()
            # The work item's id is the quota reservation's request id.
            stopped.setdefault(lease.item.tenant, []).append(item_id)
        await self._release_quotas(stopped)

    async def _release_quotas(self, stopped: dict[str, list[str]]) -> None:
        """Free the concurrency slots of the requests in `stopped` (tenant ->
        request ids), whose gateway is gone; their tokens stay charged."""
        if self._quotas is None or not stopped:
            return
        try:
            await self._quotas.release(stopped)
        except QuotaStoreError as exc:
            # No retry: the leases run out on their own within quota_store.lease_s.
            count = sum(len(ids) for ids in stopped.values())
            log.warning("could not release the quota slots of %d stopped runs: %s", count, exc)

    def _used(self, job: GenerationJob, output_tokens: int) -> float | None:
        """The service a run used, which settles its tenant's counter (fair tiers)."""
        if self._meter is None:
            return None
        return self._meter(job.tenant, job.prompt_tokens, output_tokens)

    async def _end(
        self, lease: Lease, reply_to: str, event: wire.Event, used: float | None = None
    ) -> None:
        # Everything before the end goes out before it. Shielded: the flush
        # carries other runs' output too, which cancelling this run (its
        # gateway went away) must not drop.
        await asyncio.shield(self._outbox.flush())
        await self._complete(lease, (reply_to, wire.encode_events([event])), used)

    async def _complete(
        self, lease: Lease, reply: tuple[str, bytes] | None, used: float | None = None
    ) -> None:
        # A renewal keeps the token, and the token is all completion checks.
        try:
            if await self.store.complete(lease, reply, used=used):
                self.completed += 1
            else:
                log.info("work item %s: lease lost before completion", lease.item.id)
        except WorkQueueError as exc:
            # Unknown whether it landed; if not, the lease runs out and the
            # item runs again elsewhere.
            log.error("work item %s: completion failed: %s", lease.item.id, exc)

    async def _give_back(self, lease: Lease) -> None:
        with contextlib.suppress(WorkQueueError):
            await self.store.release(lease)

    # -- renewal -------------------------------------------------------------

    def _arm_renewal(self) -> None:
        self._renew_timer = asyncio.get_running_loop().call_later(self.lease_s / 3, self._on_renew)

    def _on_renew(self) -> None:
        if self._renewing is None or self._renewing.done():
            self._renewing = asyncio.get_running_loop().create_task(self._renew())
        self._arm_renewal()

    async def _renew(self) -> None:
        now = time.time()
        if not self._stopped:
            try:
                await self.store.heartbeat(
                    self.node, self._room(), now, self.lease_s, drain_rate=self.drain.rate
                )
            except WorkQueueError as exc:
                log.warning("heartbeat failed: %s", exc)
        held = list(self._leases.items())
        try:
            # In one round trip, as of now: a busy node's hundreds of runs,
            # renewed one by one, can take longer than their leases have left.
            renewals = await self.store.renew_all(
                [lease for _, lease in held], time.time(), self.lease_s)
        except WorkQueueError as exc:
            log.warning("renewal failed: %s", exc)
            return
        for (item_id, _), renewed in zip(held, renewals, strict=True):
            if item_id not in self._leases:
                continue
            if renewed is None:
                # Cancelled by its gateway, or taken over: stop running it.
                task = self._runs.get(item_id)
                if task is not None:
                    task.cancel()
            else:
                self._leases[item_id] = renewed
        # After the renewals, which a slow answer here must not hold back.
        await self._stop_orphans(list(self._leases), fresh=True)
