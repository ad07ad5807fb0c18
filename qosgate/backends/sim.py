"""The simulated GPU: a continuous-batching engine on a step cost model.

`SimEngine` is sans-I/O and synchronous. It never reads a clock: `step()`
plans and executes one engine step and says how long the modelled GPU took,
so the discrete-event simulator can run it on a virtual clock and a real-time
backend can run it by sleeping that long. Its scheduler follows vLLM v1: one
token budget per step, running sequences first (decodes, then the next chunk
of any prefill in progress), then admission from the engine's own waiting
queue, and recompute preemption when the KV cache runs out.

A step costs O(prefilling + finishing sequences + log n), not O(running):
decoding sequences are kept in aggregate (a count, their total context, and a
heap of the steps at which they finish), and a decoding sequence's output
count is derived from the step at which it started decoding.
"""

from __future__ import annotations

import heapq
from collections import deque
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Literal

from qosgate.core.scheduler import BackendCapacity
from qosgate.profiles import CostProfile, get_profile

if TYPE_CHECKING:
    from qosgate.config.models import SimBackendConfig


# --------------------------------------------------------------------------
# Engine


@dataclass(frozen=True, slots=True, kw_only=True)
class EngineCapacity(BackendCapacity):
    """What the backend port reports, and the engine's own counts. Free slots:
    max_num_seqs - running - waiting. Free KV: capacity - allocated - what is
    promised but not yet allocated: the prompts of engine-waiting sequences
    (and those on their way), and the rest of each prefill in progress with
    its first output token. Both never below 0."""

    running: int
    waiting: int
    """In the engine's waiting queue or on their way to it."""


@dataclass
class StepResult:
    """What one step did. Preemptions happen before the step's work, so a
    sequence is never both preempted and in `first_token`/`finished` of one step."""

    duration: float
    """Seconds of modelled GPU time."""
    prefill_tokens: int
    decode_tokens: int
    batch_size: int
    """Sequences that took part (decoding + prefilling)."""
    first_token: list[str] = field(default_factory=list)
    """Sequences whose prefill completed: they emit output token 1 now."""
    finished: list[str] = field(default_factory=list)
    """Sequences that produced their last token and left the engine."""
    preempted: list[str] = field(default_factory=list)
    """Sequences preempted for lack of KV (recompute): back in the engine's
    waiting queue with nothing generated; they start over."""
    saturated: bool = False
    """The step did all an engine of this shape can do in one step: every
    slot running, or the whole token budget used, or the KV cache full."""


_WAITING = 0
_PREFILLING = 1
_DECODING = 2
_GONE = 3
_PENDING = 4
"""Dispatched, not yet in the engine: the profile's request overhead."""


class _Seq:
    __slots__ = (
        "admitted",
        "arrival",
        "base",
        "entry",
        "id",
        "output",
        "prefilled",
        "priority",
        "prompt",
        "state",
    )

    def __init__(self, seq_id: str, prompt: int, output: int, priority: int, arrival: int) -> None:
        self.id = seq_id
        self.prompt = prompt
        self.output = output
        self.priority = priority
        self.arrival = arrival
        self.state = _WAITING
        self.prefilled = 0
        self.admitted = 0
        # While decoding, generated = engine step - base and it finishes at step base + output.
        self.base = 0
        # Its live entry in the finish heap; stale entries (aborted, preempted) are skipped.
        self.entry: tuple[int, int, _Seq] | None = None


class SimEngine:
    def __init__(
        self,
        profile: CostProfile,
        *,
        max_num_seqs: int | None = None,
        max_num_batched_tokens: int | None = None,
        enable_chunked_prefill: bool | None = None,
        kv_capacity_tokens: int | None = None,
        scheduling_policy: Literal["fcfs", "priority"] = "fcfs",
    ) -> None:
        self.profile = profile
        self.max_num_seqs = max_num_seqs or profile.max_num_seqs
        self.max_num_batched_tokens = max_num_batched_tokens or profile.max_num_batched_tokens
        self.kv_capacity_tokens = kv_capacity_tokens or profile.kv_capacity_tokens
        self.enable_chunked_prefill = (
            profile.enable_chunked_prefill if enable_chunked_prefill is None
            else enable_chunked_prefill
        )  # fmt: skip
        if scheduling_policy not in ("fcfs", "priority"):
            raise ValueError(
                f"scheduling_policy must be 'fcfs' or 'priority', not {scheduling_policy!r}"
            )
        self.scheduling_policy = scheduling_policy
        # vLLM refuses this too; it also lets every decode take its token without a check.
        if self.max_num_batched_tokens < self.max_num_seqs:
            raise ValueError(
                f"max_num_batched_tokens ({self.max_num_batched_tokens}) must be >= "
                f"max_num_seqs ({self.max_num_seqs})"
            )

        self._seqs: dict[str, _Seq] = {}
        self._step = 0
        self._counter = 0
        self._priority = scheduling_policy == "priority"
        # Engine-waiting queue: arrival order (fcfs) or a (priority, arrival) heap.
        # Aborted sequences stay in it as stale entries and are skipped.
        self._fifo: deque[_Seq] = deque()
        self._heap: list[tuple[int, int, _Seq]] = []
        self._n_waiting = 0
        self._waiting_prompt = 0
        # Running sequences in admission order (dicts keep insertion order).
        self._running: dict[str, _Seq] = {}
        self._prefilling: dict[str, _Seq] = {}
        # KV still to allocate for running prefills: the rest of each prompt + token 1.
        self._prefill_left = 0
        self._n_decoding = 0
        self._decode_ctx = 0  # sum of prompt + generated over decoding seqs
        self._finish_heap: list[tuple[int, int, _Seq]] = []
        self._kv_used = 0
        # Dispatched sequences by the time they reach the engine (stale entries skipped).
        self._pending: list[tuple[float, int, _Seq]] = []
        self._n_pending = 0
        self._pending_prompt = 0
        self.step_seconds = 0.0
        """Modelled GPU seconds spent in steps."""
        self.saturated_seconds = 0.0
        """Of those, seconds in saturated steps (`StepResult.saturated`)."""

    @classmethod
    def from_config(cls, cfg: SimBackendConfig) -> SimEngine:
        return cls(
            get_profile(cfg.profile),
            max_num_seqs=cfg.max_num_seqs,
            max_num_batched_tokens=cfg.max_num_batched_tokens,
            enable_chunked_prefill=cfg.enable_chunked_prefill,
            kv_capacity_tokens=cfg.kv_capacity_tokens,
            scheduling_policy=cfg.scheduling_policy,
        )

    # -- requests ----------------------------------------------------------

    @property
    def request_overhead_s(self) -> float:
        """How long after its dispatch a sequence reaches the engine (modelled seconds)."""
        return self.profile.request_overhead_ms / 1000.0

    def add(
        self, seq_id: str, prompt_tokens: int, output_tokens: int, priority: int = 0,
        *, ready_at: float | None = None,
    ) -> None:  # fmt: skip
        """Queue a sequence; `output_tokens` is how many it will really generate.

        With `ready_at` (the caller's clock) it holds a slot but reaches the
        engine's waiting queue only when `take_ready` passes that time."""
        if seq_id in self._seqs:
            raise ValueError(f"sequence {seq_id!r} is already in the engine")
        if prompt_tokens < 1 or output_tokens < 1:
            raise ValueError("prompt_tokens and output_tokens must be >= 1")
        # Alone in the engine a sequence needs prompt + output tokens of KV; more could
        # never finish and would be preempted forever.
        if prompt_tokens + output_tokens > self.kv_capacity_tokens:
            raise ValueError(
                f"sequence {seq_id!r} needs {prompt_tokens + output_tokens} KV tokens, "
                f"more than the cache holds ({self.kv_capacity_tokens})"
            )
        self._counter += 1
        seq = _Seq(seq_id, prompt_tokens, output_tokens, priority, self._counter)
        self._seqs[seq_id] = seq
        if ready_at is None:
            self._enqueue(seq, front=False)
            return
        seq.state = _PENDING
        self._n_pending += 1
        self._pending_prompt += prompt_tokens
        heapq.heappush(self._pending, (ready_at, self._counter, seq))

    def next_ready_at(self) -> float | None:
        """When the next dispatched sequence reaches the engine; None if none is on its way."""
        heap = self._pending
        while heap and heap[0][2].state != _PENDING:
            heapq.heappop(heap)
        return heap[0][0] if heap else None

    def take_ready(self, now: float) -> None:
        """Move the sequences whose overhead has passed by `now` into the engine."""
        heap = self._pending
        while heap and (heap[0][2].state != _PENDING or heap[0][0] <= now):
            seq = heapq.heappop(heap)[2]
            if seq.state == _PENDING:
                self._n_pending -= 1
                self._pending_prompt -= seq.prompt
                self._enqueue(seq, front=False)

    def abort(self, seq_id: str) -> bool:
        seq = self._seqs.pop(seq_id, None)
        if seq is None:
            return False
        if seq.state == _WAITING:
            self._n_waiting -= 1
            self._waiting_prompt -= seq.prompt
        elif seq.state == _PENDING:
            self._n_pending -= 1
            self._pending_prompt -= seq.prompt
        else:
            self._release(seq)
        seq.state = _GONE
        return True

    def generated(self, seq_id: str) -> int:
        """Output tokens produced so far (0 if unknown, finished or aborted)."""
        seq = self._seqs.get(seq_id)
        if seq is None or seq.state != _DECODING:
            return 0
        return self._step - seq.base

    def capacity(self) -> EngineCapacity:
        running = len(self._running)
        waiting = self._n_waiting + self._n_pending
        reserved = self._kv_used + self._waiting_prompt + self._pending_prompt + self._prefill_left
        return EngineCapacity(
            free_slots=max(0, self.max_num_seqs - running - waiting),
            free_kv_tokens=max(0, self.kv_capacity_tokens - reserved),
            kv_capacity_tokens=self.kv_capacity_tokens,
            slots=self.max_num_seqs,
            running=running,
            waiting=waiting,
        )

    def has_work(self) -> bool:
        """Whether a step has anything to do (sequences still on their way do not count)."""
        return len(self._seqs) > self._n_pending

    # -- the step ----------------------------------------------------------

    def step(self) -> StepResult:
        if not self.has_work():
            raise RuntimeError("SimEngine.step() called with no work (check has_work())")
        step = self._step + 1
        budget_total = self.max_num_batched_tokens
        preempted: list[str] = []

        # Running sequences: every decode takes one token (the budget always has room,
        # see __init__), then prefills in progress take their next chunk. If the KV
        # cache cannot hold what they need, preempt and plan again.
        while True:
            decodes = self._n_decoding
            budget = budget_total - decodes
            chunks: list[tuple[_Seq, int]] = []
            need = decodes
            for seq in self._prefilling.values():
                if budget <= 0:
                    break
                chunk = min(seq.prompt - seq.prefilled, budget)
                budget -= chunk
                chunks.append((seq, chunk))
                need += chunk + (seq.prefilled + chunk == seq.prompt)
            if self._kv_used + need <= self.kv_capacity_tokens:
                break
            preempted.append(self._preempt_one())

        # Admission, skipped in a step that had to preempt (as vLLM does): the cache
        # is full and the preempted would only be taken straight back. A prefill
        # reserves its whole prompt and first output token up front, so admissions
        # never overcommit the cache among themselves; decode growth is what runs it out.
        bound = bool(preempted)  # by the KV cache or the token budget, with work waiting
        if not preempted:
            kv_free = self.kv_capacity_tokens - self._kv_used - decodes - self._prefill_left
            room = self.max_num_seqs - len(self._running)
            while room > 0 and budget > 0:
                seq = self._peek_waiting()
                if seq is None:
                    break
                if seq.prompt + 1 > kv_free:
                    bound = True
                    break
                if self.enable_chunked_prefill:
                    chunk = min(seq.prompt, budget)
                elif seq.prompt <= budget or budget == budget_total:
                    # A prompt longer than the whole budget goes alone rather than never.
                    chunk = seq.prompt
                else:
                    bound = True
                    break
                self._pop_waiting(seq)
                seq.state = _PREFILLING
                self._counter += 1
                seq.admitted = self._counter
                self._running[seq.id] = seq
                self._prefilling[seq.id] = seq
                self._prefill_left += seq.prompt + 1
                kv_free -= seq.prompt + 1
                room -= 1
                budget -= chunk
                chunks.append((seq, chunk))

        # Execute. Cost first: K is the decoders' context before this step's token.
        lengths = [c for _, c in chunks]
        prefill = sum(lengths)
        duration_ms = self.profile.step_ms(lengths, decodes, self._decode_ctx)
        # Counted before the step's finishes leave: a slot a sequence frees at
        # this step's end is the next step's to fill.
        saturated = (bound or len(self._running) >= self.max_num_seqs
                     or decodes + prefill >= budget_total)  # fmt: skip
        self.step_seconds += duration_ms / 1000.0
        if saturated:
            self.saturated_seconds += duration_ms / 1000.0
        self._step = step
        self._kv_used += decodes
        self._decode_ctx += decodes

        first_token: list[str] = []
        finished: list[str] = []
        for seq, chunk in chunks:
            seq.prefilled += chunk
            self._kv_used += chunk
            self._prefill_left -= chunk
            if seq.prefilled < seq.prompt:
                continue
            del self._prefilling[seq.id]
            self._kv_used += 1
            self._prefill_left -= 1
            first_token.append(seq.id)
            if seq.output == 1:
                self._kv_used -= seq.prompt + 1
                self._finish(seq)
                finished.append(seq.id)
                continue
            seq.state = _DECODING
            seq.base = step - 1
            entry = (seq.base + seq.output, seq.admitted, seq)
            seq.entry = entry
            heapq.heappush(self._finish_heap, entry)
            self._n_decoding += 1
            self._decode_ctx += seq.prompt + 1

        heap = self._finish_heap
        while heap and heap[0][0] <= step:
            entry = heapq.heappop(heap)
            seq = entry[2]
            if seq.entry is not entry:
                continue
            held = seq.prompt + seq.output
            self._kv_used -= held
            self._decode_ctx -= held
            self._n_decoding -= 1
            self._finish(seq)
            finished.append(seq.id)

        return StepResult(
            duration=duration_ms / 1000.0,
            prefill_tokens=prefill,
            decode_tokens=decodes,
            batch_size=decodes + len(chunks),
            first_token=first_token,
            finished=finished,
            preempted=preempted,
            saturated=saturated,
        )

    # -- internals ---------------------------------------------------------

    def _finish(self, seq: _Seq) -> None:
        seq.state = _GONE
        seq.entry = None
        del self._running[seq.id]
        del self._seqs[seq.id]

    def _release(self, seq: _Seq) -> None:
        """Take a running sequence out of the batch and give back its KV."""
        del self._running[seq.id]
        if seq.state == _PREFILLING:
            del self._prefilling[seq.id]
            self._kv_used -= seq.prefilled
            self._prefill_left -= seq.prompt + 1 - seq.prefilled
        else:
            held = seq.prompt + self._step - seq.base
            self._kv_used -= held
            self._decode_ctx -= held
            self._n_decoding -= 1
            seq.entry = None

    def _preempt_one(self) -> str:
        if self._priority:
            victim = max(self._running.values(), key=lambda s: (s.priority, s.admitted))
        else:
            victim = next(reversed(self._running.values()))
        self._release(victim)
        victim.prefilled = 0
        self._enqueue(victim, front=True)
        return victim.id

    def _enqueue(self, seq: _Seq, *, front: bool) -> None:
        seq.state = _WAITING
        self._n_waiting += 1
        self._waiting_prompt += seq.prompt
        if self._priority:
            # A preempted sequence keeps its arrival, which puts it ahead of its peers.
            heapq.heappush(self._heap, (seq.priority, seq.arrival, seq))
        elif front:
            self._fifo.appendleft(seq)
        else:
            self._fifo.append(seq)

    def _peek_waiting(self) -> _Seq | None:
        if self._priority:
            heap = self._heap
            while heap and heap[0][2].state != _WAITING:
                heapq.heappop(heap)
            return heap[0][2] if heap else None
        fifo = self._fifo
        while fifo and fifo[0].state != _WAITING:
            fifo.popleft()
        return fifo[0] if fifo else None

    def _pop_waiting(self, seq: _Seq) -> None:
        if self._priority:
            heapq.heappop(self._heap)
        else:
            self._fifo.popleft()
        self._n_waiting -= 1
        self._waiting_prompt -= seq.prompt
