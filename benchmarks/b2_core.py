"""B2: the scheduling core's cost per request lifecycle (enqueue, dispatch,
settle) across 4 tiers and 1,000 tenants, at 1k, 10k and 100k queued, on the
whole qos path: two `reject` tiers whose newcomers go through admission's
predicted wait and onto the expiry heap, two `delay` tiers queued past their
budget, so that they age (among themselves) and their guaranteed shares fall
due, and VTC fairness inside every tier.

The queue is filled to the target depth first (with delay-tier work, which
admission never refuses); then each measured lifecycle submits one request
to any tier, runs one scheduling decision with one free slot (which releases
one request, chosen by share credit, level, ageing and VTC) and settles the
released request, so the depth stays constant while it is measured. The
target is growth: the cost at 100k queued over the cost at 1k.

    .venv/bin/python benchmarks/b2_core.py [--json PATH]
"""

from __future__ import annotations

import argparse
import gc
import json
import random
import statistics
import sys
import time

from qosgate.config.models import PolicyConfig
from qosgate.config.scheduling import scheduling_policy
from qosgate.core.request import Outcome, Request
from qosgate.core.scheduler import BackendCapacity, Scheduler

TIERS = {"t0": 0, "t1": 1, "t2": 2, "t3": 3}
DELAY_TIERS = ("t2", "t3")
TENANTS = 1000
DEPTHS = (1_000, 10_000, 100_000)
MEASURED = 20_000
REPEATS = 5
ONE_SLOT = BackendCapacity(free_slots=1, free_kv_tokens=1 << 40, kv_capacity_tokens=1 << 40)


def policy() -> PolicyConfig:
    latency = {"on_timeout": "reject", "max_queue_len": 1_000_000}
    delayed = {"on_timeout": "delay", "max_queue_wait_ms": 100, "max_queue_len": 1_000_000,
               "min_share": 0.1}
    return PolicyConfig.model_validate({
        "tiers": {
            "t0": {"priority": 0, "max_queue_wait_ms": 2_000, **latency},
            "t1": {"priority": 1, "max_queue_wait_ms": 5_000, **latency},
            "t2": {"priority": 2, **delayed},
            "t3": {"priority": 4, **delayed},
        },
        "tenants": [{"id": f"tenant{i}", "tier": f"t{i % 4}", "weight": 1 + i % 3}
                    for i in range(TENANTS)],
        "scheduler": {"policy": "qos", "fairness": "vtc",
                      "aging": {"interval_ms": 100, "max_boost": 2}},
    })


def make_requests(
    n: int, start: int, rng: random.Random, t: float, *, delay_only: bool = False
) -> list[Request]:
    out = []
    for k in range(start, start + n):
        tenant = rng.randrange(TENANTS)
        if delay_only and f"t{tenant % 4}" not in DELAY_TIERS:
            tenant = tenant - tenant % 4 + 2 + tenant % 2
        out.append(Request(f"r{k}", f"tenant{tenant}", f"t{tenant % 4}",
                           rng.randint(50, 2000), rng.randint(16, 512), t))
    return out


def measure(depth: int, seed: int) -> float:
    rng = random.Random(seed)
    # A drain rate at which the latency tiers' newcomers, with little of
    # their own queued, are admitted: the prediction is computed, not skipped.
    sched = Scheduler(scheduling_policy(policy()), drain_rate_hint=100_000.0)
    for req in make_requests(depth, 0, rng, 0.0, delay_only=True):
        sched.submit(req, 0.0)
    fresh = make_requests(MEASURED, depth, rng, 1.0)
    gc.collect()
    gc.disable()
    try:
        now = 1.0
        refused = 0
        start = time.perf_counter()
        for req in fresh:
            now += 1e-4
            req.arrival = now
            refused += not sched.submit(req, now).admitted
            for done in sched.schedule(now, ONE_SLOT).dispatch:
                sched.finish(done.id, now, Outcome.COMPLETED, done.max_tokens // 2)
        elapsed = time.perf_counter() - start
    finally:
        gc.enable()
    # Every lifecycle took the whole path: admitted, released, settled.
    if refused or sched.queued_count != depth:
        raise SystemExit(f"b2: {refused} refused, {sched.queued_count} queued of {depth}: "
                         "the lifecycle did not take the path it measures")
    return elapsed / MEASURED


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--json", dest="json_path")
    args = parser.parse_args()
    results = {}
    for depth in DEPTHS:
        samples = [measure(depth, seed) for seed in range(REPEATS)]
        results[depth] = statistics.median(samples)
        print(f"queued {depth:>7,}: {results[depth] * 1e6:6.2f} us per lifecycle "
              f"(median of {REPEATS}; min {min(samples) * 1e6:.2f})", flush=True)
    if results[DEPTHS[0]] <= 0:
        raise SystemExit("b2: the 1k baseline took no time: growth is undefined")
    growth = results[DEPTHS[-1]] / results[DEPTHS[0]]
    worst = max(results.values())
    print(f"growth 1k -> 100k: {growth:.2f}x (target <= 2x); worst {worst * 1e6:.2f} us "
          "(this machine's, for reference)")
    if args.json_path:
        with open(args.json_path, "w") as fh:
            json.dump({"scenario": "b2_core",
                       "us_per_lifecycle": {str(d): v * 1e6 for d, v in results.items()},
                       "growth_1k_to_100k": growth, "python": sys.version.split()[0]}, fh, indent=2)
    return 0 if growth <= 2.0 else 1


if __name__ == "__main__":
    sys.exit(main())
