"""The requests a simulation replays: generated from a scenario's classes or read from a trace.

Everything is drawn from `random.Random` streams seeded by strings, so the
same seed gives the same arrivals on every machine and Python run, and each
class has its own streams: adding a class or changing one class's lengths
leaves the other classes' arrival times untouched.
"""

from __future__ import annotations

import json
import math
import random
from collections.abc import Callable
from dataclasses import dataclass, replace
from pathlib import Path

from qosgate.config.models import PolicyConfig, TierConfig
from qosgate.core.request import Outcome
from qosgate.sim.scenario import LengthDist, Scenario, TrafficClass


@dataclass(frozen=True, slots=True)
class Arrival:
    """One request of the workload, before the gateway sees it."""

    id: str
    t: float
    """Arrival time, seconds since the start of the run."""
    tenant: str
    tier: str
    prompt_tokens: int
    output_tokens: int
    """Tokens it really produces (never more than max_tokens)."""
    max_tokens: int
    """What the client asks for, already clamped to the tier's cap."""
    priority_offset: int = 0


class TraceError(ValueError):
    """A trace file line that cannot be replayed; the message names the file and line."""


def _tier_names(policy: PolicyConfig) -> dict[str, str]:
    return {tenant.id: tenant.tier for tenant in policy.tenants}


def class_rates(scenario: Scenario, rate_rps: float | None) -> list[float]:
    """Requests/s of each class while it is on: share / sum(shares) x rate_rps, or its own rate."""
    shared = [cls_.effective_share for cls_ in scenario.classes if cls_.rate_rps is None]
    if shared and rate_rps is None:
        raise ValueError("classes given by share need a total rate_rps")
    total_share = sum(shared)
    return [
        cls_.rate_rps if cls_.rate_rps is not None else cls_.effective_share / total_share * rate_rps
        for cls_ in scenario.classes
    ]


def _gap_sampler(rng: random.Random, scenario: Scenario, rate: float):
    if scenario.arrivals.process == "gamma":
        # Gamma with shape k has CV 1/sqrt(k); the scale keeps the mean gap at 1/rate.
        shape = 1.0 / scenario.arrivals.burstiness**2
        scale = 1.0 / (rate * shape)
        return lambda: rng.gammavariate(shape, scale)
    return lambda: rng.expovariate(rate)


def arrival_times(
    rng: random.Random, scenario: Scenario, cls_: TrafficClass, rate: float
) -> list[float]:
    duration = scenario.duration_s
    gap = _gap_sampler(rng, scenario, rate)
    times: list[float] = []
    if cls_.on_s is None or cls_.off_s is None:
        t = gap()
        while t < duration:
            times.append(t)
            t += gap()
        return times
    # On/off: run the process on a clock that only ticks while the class is on,
    # then map that clock to wall time, so on periods keep the process's rate and
    # burstiness and off periods are empty.
    on, period = cls_.on_s, cls_.on_s + cls_.off_s
    into_cycle = (-cls_.phase_s) % period
    if into_cycle < on:
        base, on_clock = -into_cycle, into_cycle
    else:
        base, on_clock = period - into_cycle, 0.0
    while True:
        on_clock += gap()
        cycle, offset = divmod(on_clock, on)
        t = base + cycle * period + offset
        if t >= duration:
            return times
        times.append(t)


def length_sampler(rng: random.Random, dist: LengthDist):
    low = dist.min
    high = dist.max if dist.max is not None else math.inf
    if dist.sigma == 0:
        fixed = int(min(max(round(dist.median), low), high))
        return lambda: fixed
    mu, sigma = math.log(dist.median), dist.sigma
    lognorm = rng.lognormvariate

    def draw() -> int:
        return int(min(max(round(lognorm(mu, sigma)), low), high))

    return draw


def class_draws(
    scenario: Scenario, index: int, cls_: TrafficClass, rate: float, seed: int
) -> tuple[list[float], Callable[[], int], Callable[[], int]]:
    """The class's arrival times and its prompt and output length samplers,
    from the seeded streams that `qosgate bench` draws from too."""
    times = arrival_times(random.Random(f"{seed}/{index}/times"), scenario, cls_, rate)
    lengths = scenario.class_lengths(cls_)
    rng = random.Random(f"{seed}/{index}/lengths")
    return times, length_sampler(rng, lengths.prompt), length_sampler(rng, lengths.output)


def _ask(rule: str | int, output: int, cap: int) -> int:
    if rule == "cap":
        return cap
    if rule == "output":
        return min(output, cap)
    return min(int(rule), cap)


def _class_tier(policy: PolicyConfig, tenant: str) -> tuple[str, TierConfig]:
    tiers = _tier_names(policy)
    if tenant not in tiers:
        raise ValueError(f"tenant {tenant!r} is not in the policy")
    return tiers[tenant], policy.tiers[tiers[tenant]]


def _draw(
    scenario: Scenario, cls_: TrafficClass, tier_name: str, tier: TierConfig,
    prompt: Callable[[], int], output: Callable[[], int], rid: str, t: float,
) -> Arrival:  # fmt: skip
    """One request of the class: its lengths drawn, its ask as the scenario says."""
    p, o = prompt(), output()
    ask = _ask(scenario.max_tokens, o, tier.max_tokens)
    return Arrival(rid, t, cls_.tenant, tier_name, p, min(o, ask), ask, cls_.priority_offset)


def generate_arrivals(
    scenario: Scenario, policy: PolicyConfig, rate_rps: float | None, seed: int
) -> list[Arrival]:
    """The scenario's arrivals over [0, duration_s), sorted by time.

    rate_rps is the total rate of the classes given by share (the runner turns a
    `load` into it); classes with their own rate_rps ignore it. For a trace
    scenario the trace is replayed instead and rate_rps and seed are unused.
    """
    if scenario.trace is not None:
        return [a for a in load_trace(scenario.trace, policy) if a.t < scenario.duration_s]
    rates = class_rates(scenario, rate_rps)
    drawn: list[tuple[float, int, int, Arrival]] = []
    for index, (cls_, rate) in enumerate(zip(scenario.classes, rates)):
        tier_name, tier = _class_tier(policy, cls_.tenant)
        times, prompt, output = class_draws(scenario, index, cls_, rate, seed)
        for n, t in enumerate(times):
            arrival = _draw(scenario, cls_, tier_name, tier, prompt, output, "", t)
            drawn.append((t, index, n, arrival))
    drawn.sort(key=lambda item: item[:3])
    # Ids follow arrival order so they read naturally in logs and traces.
    return [replace(a, id=f"r{i}") for i, (_, _, _, a) in enumerate(drawn)]


def capacity_workload(scenario: Scenario, policy: PolicyConfig, n: int, seed: int) -> list[Arrival]:
    """n requests, all at t=0, with the scenario's mix of tenants and lengths.

    Classes are mixed in proportion to their long-run request rates (rate while
    on x fraction of time on). When the total rate is not known yet (a `load`
    without capacity_rps), share classes are counted at 1 request/s in total,
    which only matters when they are mixed with classes of absolute rate. A
    trace scenario resamples the trace's requests.
    """
    rng = random.Random(f"{seed}/capacity")
    if scenario.trace is not None:
        pool = load_trace(scenario.trace, policy)
        if not pool:
            raise ValueError(f"trace {scenario.trace!r} has no requests")
        picks = [rng.choice(pool) for _ in range(n)]
        return [replace(a, id=f"cap{i}", t=0.0) for i, a in enumerate(picks)]
    total = scenario.arrivals.total_rate() or 1.0
    rates = class_rates(scenario, total)
    weights = [rate * cls_.on_fraction for cls_, rate in zip(scenario.classes, rates)]
    samplers = []
    for index, cls_ in enumerate(scenario.classes):
        tier_name, tier = _class_tier(policy, cls_.tenant)
        lengths = scenario.class_lengths(cls_)
        class_rng = random.Random(f"{seed}/{index}/capacity-lengths")
        samplers.append(
            (cls_, tier_name, tier, length_sampler(class_rng, lengths.prompt),
             length_sampler(class_rng, lengths.output))
        )
    chosen = rng.choices(range(len(samplers)), weights=weights, k=n)
    return [
        _draw(scenario, *samplers[index], f"cap{i}", 0.0) for i, index in enumerate(chosen)
    ]


_TRACE_KEYS = {"t", "tenant", "tier", "prompt_tokens", "output_tokens", "max_tokens", "outcome", "id"}
_OUTCOMES = {outcome.value for outcome in Outcome}


def _int_field(record: dict, key: str, minimum: int) -> int:
    value = record[key]
    if isinstance(value, bool) or not isinstance(value, int) or value < minimum:
        raise ValueError(f"{key}: must be an integer >= {minimum}, got {value!r}")
    return value


def _record_tier(record: dict, tier_names: dict[str, str], policy: PolicyConfig) -> str:
    """The tier a record's request is served in, as the gateway would pick it:
    a policy tenant's own tier; for another tenant the record's tier (what a
    trusted front gateway named), else the policy's default_tier."""
    tenant = record["tenant"]
    if not isinstance(tenant, str):
        raise ValueError(f"tenant: must be a string, got {tenant!r}")
    tier = record.get("tier")
    if tier is not None and (not isinstance(tier, str) or tier not in policy.tiers):
        raise ValueError(f"tier: unknown tier {tier!r} (policy tiers: {', '.join(sorted(policy.tiers))})")
    if tenant in tier_names:
        return tier_names[tenant]
    if tier is not None:
        return tier
    if policy.default_tier is not None:
        return policy.default_tier
    raise ValueError(
        f"tenant: unknown tenant {tenant!r} with no tier, and the policy has no default_tier "
        f"(policy tenants: {', '.join(sorted(tier_names)) or 'none'})"
    )


def load_trace(path: str | Path, policy: PolicyConfig) -> list[Arrival]:
    """Read a JSONL trace: one object per line with t (seconds since start),
    tenant, prompt_tokens, output_tokens, and optionally tier, max_tokens,
    outcome and id (the gateway's trace writes all but id).

    Blank lines are skipped. A missing max_tokens is what the gateway gives a
    request without one (the tier's default_max_tokens, else its cap); asks
    above the cap are clamped and output_tokens is cut to max_tokens. A record
    whose outcome is not `completed` never showed its full length, so it
    replays as producing its max_tokens.
    Raises TraceError naming the line of the first bad record.
    """
    path = Path(path)
    tier_names = _tier_names(policy)
    arrivals: list[Arrival] = []
    seen: dict[str, int] = {}
    with path.open() as handle:
        for lineno, line in enumerate(handle, start=1):
            if not line.strip():
                continue
            try:
                record = json.loads(line)
                if not isinstance(record, dict):
                    raise ValueError("each line must be a JSON object")
                unknown = set(record) - _TRACE_KEYS
                if unknown:
                    raise ValueError(
                        f"unknown keys {sorted(unknown)} (known: {sorted(_TRACE_KEYS)})"
                    )
                missing = {"t", "tenant", "prompt_tokens", "output_tokens"} - set(record)
                if missing:
                    raise ValueError(f"missing keys {sorted(missing)}")
                t = record["t"]
                numeric = isinstance(t, (int, float)) and not isinstance(t, bool)
                if not numeric or not (t >= 0 and math.isfinite(t)):
                    raise ValueError(f"t: must be a finite number >= 0, got {t!r}")
                tenant = record["tenant"]
                tier_name = _record_tier(record, tier_names, policy)
                tier = policy.tiers[tier_name]
                outcome = record.get("outcome")
                if outcome is not None and outcome not in _OUTCOMES:
                    raise ValueError(
                        f"outcome: unknown outcome {outcome!r} (known: {', '.join(sorted(_OUTCOMES))})"
                    )
                prompt = _int_field(record, "prompt_tokens", 1)
                # A request that ended early may have produced nothing.
                output = _int_field(record, "output_tokens", 1 if outcome is None else 0)
                if "max_tokens" in record and record["max_tokens"] is not None:
                    ask = min(_int_field(record, "max_tokens", 1), tier.max_tokens)
                else:
                    ask = tier.default_max_tokens or tier.max_tokens
                if outcome is not None and outcome != Outcome.COMPLETED:
                    output = ask
                # An engine produces at least one token.
                output = max(1, output)
                rid = record.get("id")
                if rid is None:
                    rid = f"line{lineno}"
                elif not isinstance(rid, str) or not rid:
                    raise ValueError(f"id: must be a non-empty string, got {rid!r}")
                if rid in seen:
                    raise ValueError(f"id: duplicate {rid!r} (first on line {seen[rid]})")
                seen[rid] = lineno
            except ValueError as exc:  # json.JSONDecodeError is a ValueError too
                raise TraceError(f"{path}:{lineno}: {exc}") from None
            arrivals.append(
                Arrival(rid, float(t), tenant, tier_name, prompt, min(output, ask), ask)
            )
    arrivals.sort(key=lambda a: a.t)
    return arrivals
