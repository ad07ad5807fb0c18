"""The requests of a bench run, drawn before anything is sent.

Arrival times and lengths come from the same seeded draws as `qosgate
simulate` (qosgate.sim.workload), so a bench scenario and a simulate scenario
with the same classes, rates and seed describe the same traffic.

A request is a plain tuple (cheap to send to the worker processes):
`(rid, t, cls, prompt_tokens, max_tokens)`: its id (unique in the run), its
send time in seconds after the start (open loop; 0 in a sweep pool), the
index of its class, and its lengths.
"""

from __future__ import annotations

import random

from qosgate.bench.scenario import BenchScenario
from qosgate.sim.workload import class_draws, class_rates, length_sampler

Spec = tuple[int, float, int, int, int]

# A duration-bound sweep level cycles through a pool of drawn requests; this
# many per user keeps repeats rare without drawing an unbounded list.
_POOL_PER_USER = 256
_POOL_MIN = 4096


def plan_open(scenario: BenchScenario, seed: int | None = None) -> list[Spec]:
    """The open-loop requests over [0, duration_s), sorted by send time."""
    seed = scenario.seed if seed is None else seed
    rates = class_rates(scenario, scenario.arrivals.rate_rps)  # type: ignore[arg-type]
    drawn: list[tuple[float, int, int, int, int]] = []
    for index, (cls_, rate) in enumerate(zip(scenario.classes, rates)):
        draws = class_draws(scenario, index, cls_, rate, seed)  # type: ignore[arg-type]
        times, prompt, output = draws
        for n, t in enumerate(times):
            drawn.append((t, index, n, prompt(), output()))
    drawn.sort()
    return [(rid, t, index, p, o) for rid, (t, index, _, p, o) in enumerate(drawn)]


def sweep_pool(scenario: BenchScenario, concurrency: int, seed: int | None = None) -> list[Spec]:
    """The requests one sweep level draws from, classes mixed by share (or
    rate_rps). With `sweep.requests` the pool is exactly the level's requests;
    with `sweep.duration_s` users cycle through it."""
    assert scenario.sweep is not None
    seed = scenario.seed if seed is None else seed
    size = scenario.sweep.requests
    if size is None:
        size = max(_POOL_MIN, concurrency * _POOL_PER_USER)
    weights = [
        (c.rate_rps if c.rate_rps is not None else c.effective_share) for c in scenario.classes
    ]
    samplers = []
    for index, cls_ in enumerate(scenario.classes):
        lengths = scenario.class_lengths(cls_)
        rng = random.Random(f"{seed}/{index}/sweep-lengths/{concurrency}")
        samplers.append((length_sampler(rng, lengths.prompt), length_sampler(rng, lengths.output)))
    chooser = random.Random(f"{seed}/sweep/{concurrency}")
    chosen = chooser.choices(range(len(samplers)), weights=weights, k=size)
    pool: list[Spec] = []
    for rid, index in enumerate(chosen):
        prompt, output = samplers[index]
        pool.append((rid, 0.0, index, prompt(), output()))
    return pool
