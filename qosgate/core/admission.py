"""SLA-aware admission: predict a request's queue wait before queueing it."""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Iterable, Protocol

from qosgate.core.ordering import TierView
from qosgate.core.request import Outcome


@dataclass(frozen=True, slots=True)
class AdmissionDecision:
    """The answer at the door: admitted, or refused with a reason and when to retry."""

    admitted: bool
    outcome: Outcome | None = None
    """Why it was refused (None when admitted)."""
    retry_after_s: float | None = None
    """Seconds after which a retry may be admitted."""
    predicted_wait_s: float = 0.0
    """Predicted queue wait at the time of the decision."""
    reason: str = ""

    @property
    def retry_after_header(self) -> str | None:
        return retry_after_header(self.retry_after_s)


def retry_after_header(seconds: float | None) -> str | None:
    """Retry-After value: whole seconds, at least 1 (a 0 would invite a hot retry loop)."""
    if seconds is None:
        return None
    return str(max(1, math.ceil(seconds)))


ADMITTED = AdmissionDecision(admitted=True)

# What an unmeasured backend is assumed to drain, only until it is measured.
DEFAULT_DRAIN_RATE = 10_000.0

# A prediction can be unbounded (nothing left over for the tier); clients
# still get a finite hint and try again.
MAX_RETRY_AFTER_S = 300.0


def saturated(free_slots: int, held: bool) -> bool:
    """Whether a backend is full for the work that waits: no free slot, or
    the next queued work held back (for the reserved slots, or for room in
    its KV cache). Only then does time teach the drain estimate what the
    backend can do, and a newcomer without a reserve waits for a slot of its
    own."""
    return free_slots <= 0 or held


class TierLoad(TierView, Protocol):
    """Port: what admission reads of one tier's queue."""

    @property
    def work(self) -> float:
        """Tokens (prompt + expected output) of its queued requests."""

    def inflow_rate(self, now: float) -> float:
        """Tokens/s of work arriving in it (ArrivalRate)."""


def predicted_wait(
    priority: int,
    work: int,
    tiers: Iterable[TierLoad],
    now: float,
    *,
    own_slot: bool,
    room_work: float,
    drain: float,
) -> float:
    """How long a newcomer of `work` tokens at `priority` is expected to
    wait: the work served before it (everything queued at its priority or
    above, its own work for a slot of its own when `own_slot`, less what the
    free room takes at once: `room_work`) over the drain left to it: less
    the inflow of the more important tiers, which keeps going ahead of it.
    Less important tiers take nothing from a tier that is admitted here (one
    with a latency objective): ageing never lifts them to its level
    (policy.with_age_floors), and a guaranteed share never passes its work
    (ordering.pick_tier)."""
    ahead = float(work) if own_slot else 0.0
    inflow = 0.0
    for other in tiers:
        if other.priority <= priority:
            ahead += other.work
            if other.priority < priority:
                inflow += other.inflow_rate(now)
    if room_work > 0:
        ahead = max(0.0, ahead - room_work)
    if ahead <= 0.0:
        return 0.0
    drain = drain - inflow
    return ahead / drain if drain > 0 else math.inf


class DrainRateEstimator:
    """Tokens per second the backend completes, as an exponentially weighted
    average over the time the backend was saturated.

    Time only counts while work is waiting: when the queue is empty the
    completions measure the offered load, not what the backend can do, and an
    estimate that decays through idle periods would refuse the next burst.
    Both the token sum and the time sum decay with time constant `tau`, so the
    ratio is a continuous-time EWMA of the rate.
    """

    __slots__ = ("tau", "prior", "_tokens", "_time", "_last", "_saturated")

    def __init__(self, tau_s: float, prior_tokens_per_s: float) -> None:
        self.tau = tau_s
        self.prior = prior_tokens_per_s
        self._tokens = 0.0
        self._time = 0.0
        self._last: float | None = None
        self._saturated = False

    def advance(self, now: float, saturated: bool) -> None:
        """Account the time since the last call; `saturated` says what the next
        interval will be (work waiting or the backend full)."""
        last = self._last
        if now == last:
            self._saturated = saturated
            return
        if last is not None and self._saturated and now > last:
            dt = now - last
            decay = math.exp(-dt / self.tau)
            self._tokens *= decay
            self._time = self._time * decay + dt
        self._last = now
        self._saturated = saturated

    def observe(self, tokens: int, now: float) -> None:
        """`tokens` of work the backend finished at `now`."""
        self.advance(now, self._saturated)
        if self._saturated:
            self._tokens += tokens

    def prefilled(self, prompt_tokens: int, now: float) -> None:
        """A prompt is through prefill (its first token came). Its tokens are
        counted now, not when the request completes: the rate then follows
        the engine's work as it is done instead of lagging a request's whole
        decode behind it. Counted at completion, a burst's first seconds
        showed few completions against much saturated time, and the estimate
        fell far below what the backend does (5,000 tokens/s against 22,000
        while work was held for the prefill budget)."""
        self.observe(prompt_tokens, now)

    def completed(self, prompt_tokens: int, output_tokens: int, now: float, *,
                  prefilled: bool) -> None:
        """A request completed with `output_tokens`; its prompt counts here
        only if no first token was seen (`prefilled` False)."""
        self.observe(output_tokens if prefilled else prompt_tokens + output_tokens, now)

    @property
    def counting(self) -> bool:
        """Whether the time from the last call counts (the backend was said
        saturated)."""
        return self._saturated

    @property
    def rate(self) -> float:
        # Until a few seconds of saturated time are seen the prior dominates,
        # blended in proportion so the estimate does not jump on one sample.
        span = self._time
        if span <= 0.0 or self._tokens <= 0.0:
            # Nothing has completed yet: no evidence against the prior.
            return self.prior
        measured = self._tokens / span
        trust = min(1.0, span / self.tau)
        return trust * measured + (1.0 - trust) * self.prior


class ArrivalRate:
    """Tokens/s of work arriving, as an exponentially weighted average.

    Work admitted to a more important tier keeps going ahead of a request that
    is already queued, so a wait predicted from the queue alone is too short
    by exactly this inflow.
    """

    __slots__ = ("tau", "_sum", "_last")

    def __init__(self, tau_s: float) -> None:
        self.tau = tau_s
        self._sum = 0.0
        self._last: float | None = None

    @classmethod
    def restored(cls, tau_s: float, total: float, last: float) -> ArrivalRate:
        """The average as stored elsewhere: its sum as of `last`."""
        rate = cls(tau_s)
        rate._sum, rate._last = total, last
        return rate

    def add(self, tokens: float, now: float) -> None:
        last = self._last
        if last is None:
            self._last = now
        elif now > last:
            self._sum *= math.exp((last - now) / self.tau)
            self._last = now
        # An arrival stamped a little earlier (another replica's clock) is
        # counted as of the latest one: time never runs back.
        self._sum += tokens

    def rate(self, now: float) -> float:
        last = self._last
        if last is None:
            return 0.0
        decayed = self._sum * math.exp((last - now) / self.tau) if now > last else self._sum
        # Normalised by a full time constant even early on: a burst at start
        # is already counted as queued work ahead, and dividing it by the short
        # time it took would count it again as an enormous rate.
        return decayed / self.tau
