"""A light tenant beside a flood at a latency tier's door: what `fairness: vtc`
gives each tenant of one tier against `fifo`.

    .venv/bin/python benchmarks/door_flood.py [--seeds 3] [--load 2.2] [--light 1]
        [--flood 10] [--json PATH]

B3's engine, lengths and standard tier (2 s TTFT objective, 1.5 s queue
budget), with two of its tenants only: `search` (light) and `support-bot`
(the flood) sending in the ratio --light : --flood, together at --load x the
engine's capacity (by default 0.2x and 2x). Both policies are qos and see the
same arrivals on each seed; they differ only in `scheduler.fairness`. Under
`fifo` the door refuses the light tenant's newcomers at the flood's rate;
under `vtc` a newcomer of a tenant behind in its fair share takes the place
of the newest queued request of one ahead, one for one and no larger than it
(docs/SCHEDULING.md, "vtc: virtual token counters").

Printed per seed: each tenant's TTFT attainment (requests in time over those
sent, after the warm-up) and the tier's requests in time, under each
fairness. Rules, on the means of the seeds: under vtc the light tenant's
attainment is at least fifo's and at least the flood's, and the tier serves
at least 0.98x as many requests in time as under fifo (the door moves places
between tenants; it must not cost the tier). Exit 0 when they hold, 1 when
one fails.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from statistics import fmean

sys.path.insert(0, str(Path(__file__).resolve().parent))

import b3_sweep as sweep  # noqa: E402

from qosgate.config.models import PolicyConfig  # noqa: E402
from qosgate.sim.commands import Simulation  # noqa: E402
from qosgate.sim.runner import run_policy  # noqa: E402
from qosgate.sim.scenario import Scenario, load_scenario  # noqa: E402
from qosgate.sim.workload import generate_arrivals  # noqa: E402

LIGHT, FLOOD = "search", "support-bot"
TIER = "standard"
FAIRNESS = ("vtc", "fifo")
TIER_FLOOR = 0.98


def scenario(light: float, flood: float) -> Scenario:
    """B3's scenario with the light tenant and the flood alone."""
    data = load_scenario(sweep.SCENARIO).model_dump()
    shares = {LIGHT: light, FLOOD: flood}
    data["classes"] = [{**c, "share": shares[c["tenant"]]} for c in data["classes"]
                       if c["tenant"] in shares]  # fmt: skip
    return Scenario.model_validate(data)


def run_seed(sc: Scenario, load: float, seed: int) -> dict:
    """{fairness: {tenant: attainment, "in_time": the tier's requests in time}}."""
    sim = Simulation(sc, seed=seed, quiet=True)
    arrivals = generate_arrivals(sc, sc.policy, sim.rate_for(load), seed)
    slo = sc.policy.tiers[TIER].ttft_slo_ms / 1000.0
    out = {}
    for fairness in FAIRNESS:
        doc = sc.policy.model_dump()
        doc["scheduler"] = {**doc["scheduler"], "policy": "qos", "fairness": fairness}
        run = run_policy(PolicyConfig.model_validate(doc), sc.engine, arrivals,
                         drain_until=sc.duration_s + sc.drain_s,
                         drain_rate_hint=sim.capacity_tokens_per_s)  # fmt: skip
        figures: dict[str, float] = {"in_time": 0}
        for tenant in (LIGHT, FLOOD):
            sent = [r for r in run.requests
                    if r.tenant == tenant and sc.warmup_s <= r.arrival < sc.duration_s]
            in_time = sum(1 for r in sent
                          if r.first_token_at is not None and r.first_token_at - r.arrival <= slo)
            if not sent:
                raise SystemExit(f"seed {seed}: {tenant} sent nothing after the warm-up")
            figures[tenant] = in_time / len(sent)
            figures["in_time"] += in_time
        out[fairness] = figures
    return out


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--seeds", type=sweep._positive, default=3)
    ap.add_argument("--load", type=float, default=2.2)
    ap.add_argument("--light", type=float, default=1.0)
    ap.add_argument("--flood", type=float, default=10.0)
    ap.add_argument("--json", dest="json_path")
    args = ap.parse_args(argv)
    sc = scenario(args.light, args.flood)
    seeds = range(sc.seed, sc.seed + args.seeds)
    runs = {}
    print(f"{'seed':>4} | {'light vtc':>9} {'fifo':>6} | {'flood vtc':>9} {'fifo':>6} | "
          f"in time vtc   fifo")  # fmt: skip
    for seed in seeds:
        runs[seed] = run = run_seed(sc, args.load, seed)
        vtc, fifo = run["vtc"], run["fifo"]
        print(f"{seed:>4} | {vtc[LIGHT]:>9.3f} {fifo[LIGHT]:>6.3f} | {vtc[FLOOD]:>9.3f} "
              f"{fifo[FLOOD]:>6.3f} | {vtc['in_time']:>11} {fifo['in_time']:>6}")

    def mean(fairness: str, key: str) -> float:
        return fmean(run[fairness][key] for run in runs.values())

    checks = [
        ("light tenant's attainment, vtc >= fifo", mean("vtc", LIGHT), mean("fifo", LIGHT)),
        ("light tenant's attainment >= the flood's, vtc", mean("vtc", LIGHT), mean("vtc", FLOOD)),
        (f"tier's requests in time, vtc >= {TIER_FLOOR}x fifo", mean("vtc", "in_time"),
         TIER_FLOOR * mean("fifo", "in_time")),
    ]
    failed = 0
    for rule, value, threshold in checks:
        passed = value >= threshold
        failed += not passed
        print(f"{'PASS' if passed else 'FAIL'}  {rule}: {value:.3f} >= {threshold:.3f} "
              f"(mean of {len(runs)} seeds)")
    if args.json_path:
        Path(args.json_path).write_text(json.dumps({
            "load": args.load, "shares": {LIGHT: args.light, FLOOD: args.flood},
            "runs": {str(seed): run for seed, run in runs.items()},
            "checks": [{"rule": r, "value": v, "threshold": t, "passed": v >= t}
                       for r, v, t in checks]}, indent=1))  # fmt: skip
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
