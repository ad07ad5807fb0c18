"""The scheduling core: admission, tier queues, ageing, fairness, batch windows,
expiry and preemption, with no I/O and no clock of its own.

Like vLLM's engine core it is driven from outside: the runtime (live) or the
simulator (virtual clock) calls `submit`, `schedule`, `on_first_token`,
`finish`, `cancel` with the current time, and carries out the returned plan
(hand requests to the backend, abort preempted ones, answer expired ones).
Every request that enters ends in exactly one `Outcome`, set here.
"""

from __future__ import annotations

import heapq
from dataclasses import dataclass
from typing import Iterable, Sequence

from qosgate.core.admission import (
    ADMITTED,
    DEFAULT_DRAIN_RATE,
    MAX_RETRY_AFTER_S,
    AdmissionDecision,
    DrainRateEstimator,
    predicted_wait,
    saturated,
)
from qosgate.core.arrivals_hold import ArrivalsHold, top_budget
from qosgate.core.fairness import CountedFifoOrder, FairnessOrder, FifoOrder, VtcOrder, service
from qosgate.core.ordering import (
    engine_priority as ordering_engine_priority,
    has_reserve,
    may_preempt,
    pick_tier,
    prefill_holds,
    preemption_victim,
    reserve_holds,
    settles_shares,
    share_credit,
    share_owed,
    tier_level,
)
from qosgate.core.policy import SchedulingPolicy, TierParams, has_latency_objective
from qosgate.core.request import Outcome, Request, RequestState
from qosgate.core.tier_queue import TierQueue

_QUEUED = RequestState.QUEUED
_RUNNING = RequestState.RUNNING

# Output length assumed for a request before any has completed.
_DEFAULT_OUTPUT_ESTIMATE = 256.0
# Queued requests a refused newcomer tries to take the place of: the newest of
# the tenants furthest ahead, where one that leaves makes enough room.
PUSHOUT_CANDIDATES = 8
FCFS_QUEUE = "*"


@dataclass(frozen=True, slots=True)
class BackendCapacity:
    """What the backend can take right now, as it reports it."""

    free_slots: int
    """Sequences it can start now without queueing them itself."""
    free_kv_tokens: int
    """KV-cache tokens not yet spoken for."""
    kv_capacity_tokens: int | None = None
    """Total KV-cache tokens (None: unknown); a prompt larger can never run."""
    slots: int | None = None
    """Sequence slots in all, the ones in use included (None: unknown)."""


class SchedulePlan:
    """What the caller must do after one `schedule` call.

    Built on every scheduling decision, so it is a plain slotted class whose
    rarely-used lists start as a shared empty tuple.
    """

    __slots__ = ("dispatch", "expired", "pushed_out", "preempt", "failed", "batches", "wakeup_at")

    def __init__(self) -> None:
        self.dispatch: list[Request] = []
        """Hand these to the backend now (already marked running)."""
        self.expired: Sequence[Request] = ()
        """Answer these with 504: their queue deadline passed (already finished)."""
        self.pushed_out: Sequence[Request] = ()
        """Answer these as refused for overload: queued, they made room for a
        newcomer of a tenant behind theirs (already finished)."""
        self.preempt: Sequence[Request] = ()
        """Abort these in the backend: they are back in their queue, at its head."""
        self.failed: Sequence[Request] = ()
        """Answer these with 400: they can never fit the backend (already finished)."""
        self.batches: list[tuple[str, int, float]] = []
        """(tier, requests released, how long the batch's oldest request waited)."""
        self.wakeup_at: float | None = None
        """Call `schedule` again by this time even if nothing else happens."""


class Scheduler:
    """One gateway's queues and the decisions over them."""

    def __init__(self, policy: SchedulingPolicy, *, drain_rate_hint: float | None = None) -> None:
        self.policy = policy
        self.kind = policy.kind
        self._admission = policy.admission
        self._preemption = policy.preemption
        self._ageing = policy.ageing
        self._reserve_slots = policy.held_slots
        self._reserve_kv = policy.held_kv_tokens
        self._w_in = policy.w_in
        self._w_out = policy.w_out
        # Prompt tokens of running requests with no first token yet: the
        # prefills queued in or going through the backend.
        self._prefilling = 0
        self._held_for_prefill = False
        self._paced = False
        prior = policy.initial_drain_rate or drain_rate_hint or DEFAULT_DRAIN_RATE
        self.drain = DrainRateEstimator(policy.drain_rate_tau_s, prior)
        self._output_estimate = _DEFAULT_OUTPUT_ESTIMATE

        self._queues: dict[str, TierQueue] = {}
        self._queue_list: list[TierQueue] = []
        self.reconfigure(policy)

        self._queued: dict[str, Request] = {}
        self._running: dict[str, Request] = {}
        self._deadlines: list[tuple[float, int, Request]] = []
        self._pushed_out: list[Request] = []
        self._seq = 0
        self._saturated = False
        # Room the backend had left after the last scheduling round: work
        # queued since (a batch window holding it, arrivals in the same
        # instant) starts as soon as it is released, so it is not backlog.
        self._room_slots = 0
        self._room_kv = 0
        share = policy.arrivals_share
        self._arrivals_hold = (
            ArrivalsHold(share, policy.held_slots) if share > 0.0 else None)
        # Free slots the last round kept for the top level's expected
        # arrivals and left free (admission counts them as reserve).
        self._kept_for_arrivals = 0

    # -- configuration -------------------------------------------------------

    def reconfigure(self, policy: SchedulingPolicy) -> None:
        """Take a reloaded policy's tiers and tenants, and its prefill budget
        and pace (resolved again once the engine's step is known). The rest of
        the `scheduler` section must be unchanged (the caller checks). Queued
        and running requests keep their place and their deadlines; a tier's
        new settings apply to what is decided from now on; a tier that is
        gone keeps its queue until it drains (no tenant can send it more)."""
        self.policy = policy
        # The one scheduler setting a reconfigure takes: an engine that loads
        # in the background tells its tokens per step, which an automatic
        # prefill budget is counted in, only once it is up.
        self._prefill_budget = policy.prefill_budget_tokens if policy.tiered else None
        self._delay_prefill = policy.delay_prefill_tokens if policy.tiered else None
        weights = dict(policy.weights)
        tau = policy.drain_rate_tau_s
        if self.kind == "fcfs":
            # One FIFO for everything: no tiers, no budgets, no windows.
            single = self._queue_list[0] if self._queue_list else TierQueue(
                TierParams(FCFS_QUEUE, 0, None, True), FifoOrder(), tau
            )
            self._queues.update(dict.fromkeys(policy.tiers, single))
            self._queue_list, self._top_level, self._shares = [single], 0, False
            return
        for name, tier in policy.tiers.items():
            queue = self._queues.get(name)
            if queue is None:
                self._queues[name] = TierQueue(tier, self._order(tier, weights), tau)
                continue
            queue.configure(tier)
            order = self._order(tier, weights)
            if type(order) is not type(queue.order):
                # The tier took or dropped a latency objective: it now goes
                # in admission order with a fair door, or by its counters.
                # Counters start again; what is queued keeps its order.
                queue.reorder(order)
            elif isinstance(queue.order, (VtcOrder, CountedFifoOrder)):
                queue.order.set_weights(weights)
        self._queue_list = sorted(
            {id(q): q for q in self._queues.values()}.values(), key=lambda q: (q.priority, q.name)
        )
        self._top_level = min(self._queues[name].priority for name in policy.tiers)
        self._top_budget = top_budget(policy.tiers.values())
        self._shares = any(q.min_share > 0.0 for q in self._queue_list)

    def _order(self, tier: TierParams, weights: dict[str, float]) -> FairnessOrder:
        """The release order of a tier: by counters, or (a tier admitted by its
        predicted wait, under vtc) admission order with a fair door."""
        if not self.policy.fair:
            return FifoOrder()
        if self._admission and has_latency_objective(tier):
            return CountedFifoOrder(weights, self._charge)
        return VtcOrder(weights)

    def _charge(self, req: Request) -> float:
        return service(self._w_in, self._w_out, req.prompt_tokens, req.work - req.prompt_tokens)

    def queue(self, tier: str) -> TierQueue:
        try:
            return self._queues[tier]
        except KeyError:
            raise ValueError(f"unknown tier {tier!r}") from None

    @property
    def queues(self) -> list[TierQueue]:
        return list(self._queue_list)

    def engine_priority(self, req: Request) -> int:
        """The priority handed to the backend (lower runs first): the tier's
        level as lowered by the client, then the prompt's size class
        (ordering.engine_priority). `fcfs` is one first-come queue, in the
        engine too."""
        level = self._queues[req.tier].priority + req.priority_offset
        return ordering_engine_priority(level, req.prompt_tokens) if self.policy.tiered else level

    # -- admission -----------------------------------------------------------

    def _draining(self) -> bool:
        # Time teaches the drain rate something only while the backend works
        # on our requests and more are waiting: with nothing running (an idle
        # or down backend) no completion can be expected, and counting that
        # time would drive the estimate to zero. Work held back for the prefill
        # budget counts too: the queue then drains at the pace of prefill,
        # which the first tokens measure (DrainRateEstimator.prefilled).
        return bool(self._running) and (self._saturated or bool(self._queued))

    def _advance(self, now: float) -> None:
        self.drain.advance(now, self._draining())

    def _reject(self, req: Request, now: float, decision: AdmissionDecision) -> AdmissionDecision:
        req.end(decision.outcome, now)
        return decision

    def submit(self, req: Request, now: float) -> AdmissionDecision:
        """Admit `req` into its tier's queue, or refuse it (it is then finished)."""
        if req.state is not RequestState.NEW:
            raise ValueError(f"request {req.id!r} was already submitted")
        if req.id in self._queued or req.id in self._running:
            raise ValueError(f"duplicate request id {req.id!r}")
        queue = self.queue(req.tier)
        self._advance(now)
        if self._arrivals_hold is not None and queue.priority == self._top_level:
            self._arrivals_hold.arrived(now)
        estimate = self._output_estimate
        output = req.max_tokens if req.max_tokens < estimate else int(estimate)
        req.work = req.prompt_tokens + output

        if len(queue) >= queue.max_len:
            return self._reject(req, now, AdmissionDecision(
                admitted=False, outcome=Outcome.REJECTED_QUEUE_FULL,
                retry_after_s=min(queue.work / self.drain.rate, MAX_RETRY_AFTER_S)
                if self.drain.rate > 0 else MAX_RETRY_AFTER_S,
                reason=f"tier {req.tier!r} queue is full ({queue.max_len} requests)",
            ))

        predicted = 0.0
        budget = queue.budget_s
        if self._admission and has_latency_objective(queue):
            # On a saturated backend the newcomer also waits for a slot of its
            # own, unless capacity is held in reserve for its level.
            reserved = has_reserve(queue.priority, self._top_level,
                                   self._reserve_slots + self._kept_for_arrivals)
            # Below the top level, while the prefill budget holds work back, the
            # free room does not take a newcomer at once.
            held = self._held_for_prefill and queue.priority > self._top_level
            room = 0 if held else self._room_slots
            predicted = self._predicted_wait(queue, req, now, reserved, room, held)
            if predicted > budget and isinstance(queue.order, CountedFifoOrder):
                predicted = self._push_out(queue, req, now, predicted, budget, reserved, room, held)
            if predicted > budget:
                return self._reject(req, now, AdmissionDecision(
                    admitted=False, outcome=Outcome.REJECTED_OVERLOAD,
                    retry_after_s=min(predicted - budget, MAX_RETRY_AFTER_S),
                    predicted_wait_s=predicted,
                    reason=(f"predicted queue wait {predicted:.2f}s exceeds tier "
                            f"{req.tier!r} budget {budget:.2f}s"),
                ))

        self._seq += 1
        req.seq = self._seq
        limit = queue.deadline_s
        if limit is not None:
            req.deadline = req.arrival + limit
            heapq.heappush(self._deadlines, (req.deadline, req.seq, req))
        queue.push(req)
        queue.inflow.add(req.work, now)
        self._queued[req.id] = req
        if predicted:
            return AdmissionDecision(admitted=True, predicted_wait_s=predicted)
        return ADMITTED

    def _predicted_wait(
        self, queue: TierQueue, req: Request, now: float, reserved: bool, room: int,
        held: bool,
    ) -> float:
        return predicted_wait(
            queue.priority, req.work, self._queue_list, now,
            own_slot=(self._saturated or held) and not reserved,
            room_work=min(self._room_kv, room * req.work) if room > 0 else 0,
            drain=self.drain.rate,
        )  # fmt: skip

    def _push_out(self, queue: TierQueue, req: Request, now: float, predicted: float,
                  budget: float, reserved: bool, room: int, held: bool) -> float:
        """Give `req` the place of one queued request of a tenant ahead of its
        own (CountedFifoOrder.pushout) whose leaving brings its predicted wait
        within `budget`, refusing that one; the predicted wait after. One for
        one and no larger (fairness.fits_place), so the tier admits as many
        requests as it would have, with no more work queued."""
        work = queue.work
        candidates = queue.order.pushout(req.tenant, self._charge(req), req.work)
        for tried, victim in enumerate(candidates):
            if tried == PUSHOUT_CANDIDATES:
                break
            queue.work = work - victim.work
            try:
                after = self._predicted_wait(queue, req, now, reserved, room, held)
            finally:
                queue.work = work
            if after <= budget:
                victim.end(Outcome.REJECTED_OVERLOAD, now)
                queue.remove(victim)
                del self._queued[victim.id]
                self._pushed_out.append(victim)
                return after
        return predicted

    # -- the dispatch decision -----------------------------------------------

    def level(self, queue: TierQueue, now: float) -> int | None:
        """The effective priority level a non-empty queue competes at now."""
        oldest = queue.oldest()
        if oldest is None:
            return None
        return tier_level(queue, oldest.arrival, now, self._ageing)

    def _window_opens(self, queue: TierQueue, oldest: Request, now: float) -> float:
        """When the queue's batch window releases (now or earlier: ready)."""
        if queue.max_wait_s <= 0.0:
            return now
        if len(queue) >= queue.max_batch_size or queue.prompt_tokens >= queue.max_batch_tokens:
            return now
        return oldest.arrival + queue.max_wait_s

    def schedule(
        self, now: float, capacity: BackendCapacity, *, backend_ready: bool = True
    ) -> SchedulePlan:
        """Release what the backend has room for, best first; expire what is overdue.

        With `backend_ready` False (the backend is down or starting) nothing is
        preempted, since the room it would make cannot be used, and a request
        that runs out of queue budget ends `backend_error`, not `expired`: the
        wait was the backend's doing, not load."""
        self._advance(now)
        plan = SchedulePlan()
        if self._deadlines and self._deadlines[0][0] <= now:
            plan.expired = self._expire(
                now, Outcome.EXPIRED if backend_ready else Outcome.BACKEND_ERROR
            )
        if self._pushed_out:
            plan.pushed_out, self._pushed_out = self._pushed_out, []

        free_slots = capacity.free_slots
        free_kv = capacity.free_kv_tokens
        kv_total = capacity.kv_capacity_tokens
        top_level = self._top_level
        # An open batch keeps releasing after its window fires, up to its size,
        # even though the requests behind the oldest have waited less.
        open_batches: dict[str, list] = {}
        wakeup: float | None = None
        blocked: TierQueue | None = None
        budget = self._prefill_budget
        # Counted at the first release below the top level a round weighs:
        # a round with none has no use for it.
        for_arrivals: int | None = None
        reserve_slots = self._reserve_slots
        held: list[TierQueue] = []  # tiers held back this round for the prefill budget
        paced: list[TierQueue] = []  # delay tiers held back for theirs

        while free_slots > 0:
            ready: list[tuple[TierQueue, float, bool]] = []
            for queue in self._queue_list:
                oldest = queue.oldest()
                if oldest is None or queue in held or queue in paced:
                    continue
                if queue.max_wait_s > 0.0:
                    batch = open_batches.get(queue.name)
                    if batch is None or batch[0] <= 0 or batch[1] <= 0:
                        opens = self._window_opens(queue, oldest, now)
                        if opens > now:
                            if wakeup is None or opens < wakeup:
                                wakeup = opens
                            continue
                ready.append((queue, oldest.arrival, share_owed(queue.credit, oldest.work)))
            chosen = pick_tier(ready, now, self._ageing)
            if chosen is None:
                break
            best, level = chosen
            below_top = level > top_level
            if below_top and for_arrivals is None:
                for_arrivals = self._arrivals_held(now, capacity)
                reserve_slots += for_arrivals
            if reserve_holds(level, top_level, free_slots, reserve_slots):
                # What is left is held for top-level work.
                blocked = best
                break
            req = best.peek()
            assert req is not None
            wait = prefill_holds(best, level, top_level, req.prompt_tokens, self._prefilling,
                                 budget, self._delay_prefill, held=bool(held), paced=bool(paced))
            if wait == "budget":
                # The backend's prefill queue is as long as a top-level
                # request may wait behind; this waits for a first token.
                held.append(best)
                continue
            if wait == "pace":
                # Work that can wait goes in at the pace of prefill: a lull's
                # worth of long prompts would sit in the engine ahead of
                # whatever comes next. Unlike the prefill budget it holds no
                # tier with a latency objective, so no newcomer's predicted
                # wait changes for it.
                paced.append(best)
                continue
            if kv_total is not None and req.prompt_tokens >= kv_total:
                best.pop()
                if not plan.failed:
                    plan.failed = []
                self._fail(best, req, now, plan.failed)
                continue
            # Room for the prompt and the output it is expected to produce, so
            # the backend does not have to preempt what it was just given.
            need = req.work if kv_total is None or req.work <= kv_total else kv_total
            if need + (self._reserve_kv if below_top else 0) > free_kv:
                # Keep order: a large request is not overtaken just because
                # smaller ones behind it would fit.
                blocked = best
                break
            batch = open_batches.get(best.name)
            if batch is None or batch[0] <= 0 or batch[1] <= 0:
                if batch is not None:
                    plan.batches.append((best.name, batch[2], batch[3]))
                batch = [best.max_batch_size, best.max_batch_tokens, 0, now - best.oldest_arrival]
                open_batches[best.name] = batch
            best.pop()
            self._dispatch(best, req, now)
            if self._shares and settles_shares(best):
                for queue in self._queue_list:
                    if len(queue):
                        queue.credit = share_credit(
                            queue.credit, queue.min_share, req.work, taken=queue is best
                        )
            plan.dispatch.append(req)
            batch[0] -= 1
            batch[1] -= req.prompt_tokens
            batch[2] += 1
            free_slots -= 1
            free_kv -= need

        for name, batch in open_batches.items():
            plan.batches.append((name, batch[2], batch[3]))

        if self._preemption and backend_ready and (blocked is not None or free_slots <= 0):
            self._preempt(now, blocked, plan)

        # Work held for the prefill budget waits for a first token, not for a
        # slot: the backend still has room for top-level work.
        self._held_for_prefill = bool(held)
        self._paced = bool(paced)
        self._kept_for_arrivals = min(free_slots, for_arrivals or 0)
        self._saturated = saturated(free_slots, blocked is not None)
        self._room_slots = 0 if self._saturated else free_slots
        self._room_kv = 0 if self._saturated else free_kv
        # What the coming interval is: saturated only if work is still waiting
        # or the backend is full after this round, not before it.
        self.drain.advance(now, self._draining())
        if self._deadlines:
            deadline = self._next_deadline()
            if deadline is not None and (wakeup is None or deadline < wakeup):
                wakeup = deadline
        plan.wakeup_at = wakeup
        return plan

    def _arrivals_held(self, now: float, capacity: BackendCapacity) -> int:
        """Free slots to keep for the top level's expected arrivals this round
        (core.arrivals_hold), on top of the reserve."""
        hold = self._arrivals_hold
        if hold is None or self._top_budget is None or not self._running:
            return 0
        starts = [now if r.dispatched_at is None else r.dispatched_at
                  for r in self._running.values()]  # in dispatch order
        return hold.slots(now, starts, self._top_budget, free_slots=capacity.free_slots,
                          backend_slots=capacity.slots)

    def _dispatch(self, queue: TierQueue, req: Request, now: float) -> None:
        del self._queued[req.id]
        req.state = _RUNNING
        req.dispatched_at = now
        self._prefilling += req.prompt_tokens
        charge = service(self._w_in, self._w_out, req.prompt_tokens, req.work - req.prompt_tokens)
        req.charged_service = charge
        queue.order.on_dispatch(req, charge)
        self._running[req.id] = req
        queue.running[req.id] = req

    def _fail(self, queue: TierQueue, req: Request, now: float, into: list[Request]) -> None:
        queue.order.on_dispatch(req, 0.0)
        del self._queued[req.id]
        req.end(Outcome.BAD_REQUEST, now)
        into.append(req)

    def _expire(self, now: float, outcome: Outcome) -> list[Request]:
        into: list[Request] = []
        heap = self._deadlines
        while heap and heap[0][0] <= now:
            _, _, req = heapq.heappop(heap)
            if req.state is _QUEUED and req.deadline is not None and req.deadline <= now:
                req.end(outcome, now)
                self._queues[req.tier].remove(req)
                del self._queued[req.id]
                into.append(req)
        return into

    def _next_deadline(self) -> float | None:
        heap = self._deadlines
        while heap:
            deadline, _, req = heap[0]
            if req.state is _QUEUED and req.deadline == deadline:
                return deadline
            heapq.heappop(heap)
        return None

    def _preempt(self, now: float, blocked: TierQueue | None, plan: SchedulePlan) -> None:
        """Make room for the most important waiting tier by sending back the
        newest running request of a less important preemptible tier."""
        waiting = blocked
        if waiting is None:
            for queue in self._queue_list:
                if len(queue) and self._window_opens(queue, queue.oldest(), now) <= now:
                    waiting = queue
                    break
        if waiting is None:
            return
        victim = preemption_victim(
            waiting.priority,
            [(q.priority, q.preemptible, q.running.values()) for q in self._queue_list],
            lambda run: may_preempt(run.preemptions, run.first_token_at is not None),
        )
        if victim is not None:
            self._requeue(victim, now)
            plan.preempt = [victim]

    def _requeue(self, req: Request, now: float) -> None:
        queue = self._queues[req.tier]
        del self._running[req.id]
        del queue.running[req.id]
        queue.order.on_settle(req, -req.charged_service)
        req.charged_service = 0.0
        if req.first_token_at is None:
            self._prefilling -= req.prompt_tokens
        req.preemptions += 1
        req.output_tokens = 0
        req.first_token_at = None
        # Already admitted and started once: it keeps its place and never expires.
        req.deadline = None
        queue.push(req, front=True)
        self._queued[req.id] = req

    # -- progress reported by the backend ------------------------------------

    def on_first_token(self, req_id: str, now: float) -> bool:
        """A running request's first output token; True when work was held
        back for the prefill budget (or a delay tier's), so the caller should
        schedule again."""
        req = self._running.get(req_id)
        if req is not None and req.first_token_at is None:
            req.first_token_at = now
            self._prefilling -= req.prompt_tokens
            self.drain.prefilled(req.prompt_tokens, now)
        return self._held_for_prefill or self._paced

    def finish(self, req_id: str, now: float, outcome: Outcome, output_tokens: int) -> Request:
        """A running request ended (completed, failed, cancelled mid-stream)."""
        req = self._running.pop(req_id, None)
        if req is None:
            raise KeyError(f"request {req_id!r} is not running")
        queue = self._queues[req.tier]
        del queue.running[req_id]
        if req.first_token_at is None:
            self._prefilling -= req.prompt_tokens
        req.end(outcome, now)
        req.output_tokens = output_tokens
        actual = service(self._w_in, self._w_out, req.prompt_tokens, output_tokens)
        queue.order.on_settle(req, actual - req.charged_service)
        req.charged_service = actual
        if (outcome is Outcome.COMPLETED and self._arrivals_hold is not None
                and req.dispatched_at is not None):
            self._arrivals_hold.ended(now, req.dispatched_at)
        if outcome is Outcome.COMPLETED:
            self.drain.completed(req.prompt_tokens, output_tokens, now,
                                 prefilled=req.first_token_at is not None)
            self._output_estimate += 0.05 * (output_tokens - self._output_estimate)
        return req

    def cancel(
        self,
        req_id: str,
        now: float,
        output_tokens: int = 0,
        outcome: Outcome = Outcome.CANCELLED,
    ) -> tuple[Request | None, bool]:
        """End a request wherever it is: the client went away (cancelled), or
        the backend is gone for good (`outcome` backend_error). Returns the
        request and whether it was running (then the caller must abort it in
        the backend)."""
        req = self._queued.pop(req_id, None)
        if req is not None:
            req.end(outcome, now)
            self._queues[req.tier].remove(req)
            return req, False
        if req_id in self._running:
            return self.finish(req_id, now, outcome, output_tokens), True
        return None, False

    # -- views ---------------------------------------------------------------

    def get(self, req_id: str) -> Request | None:
        return self._queued.get(req_id) or self._running.get(req_id)

    @property
    def queued_count(self) -> int:
        return len(self._queued)

    @property
    def running_count(self) -> int:
        return len(self._running)

    @property
    def prefilling_tokens(self) -> int:
        """Prompt tokens of running requests with no first token yet."""
        return self._prefilling

    def queued(self) -> Iterable[Request]:
        return self._queued.values()

    def running(self) -> Iterable[Request]:
        return self._running.values()

    def depth_by_tier(self) -> dict[str, int]:
        """Queued requests per tier (the request's own tier, also under fcfs)."""
        if self.kind == "fcfs":
            depth = dict.fromkeys(self.policy.tiers, 0)
            for req in self._queued.values():
                depth[req.tier] += 1
            return depth
        return {name: len(q) for name, q in self._queues.items()}

    def snapshot(self, now: float) -> dict:
        tiers = {}
        for queue in self._queue_list:
            oldest = queue.oldest()
            tiers[queue.name] = {
                "queued": len(queue),
                "queued_tokens": queue.work,
                "running": len(queue.running),
                "oldest_wait_s": (now - oldest.arrival) if oldest else 0.0,
                "level": self.level(queue, now),
            }
        return {
            "policy": self.kind,
            "queued": len(self._queued),
            "running": len(self._running),
            "drain_rate_tokens_per_s": self.drain.rate,
            "tiers": tiers,
        }


