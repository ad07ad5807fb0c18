"""What a batch job's rate costs the latency tiers' TTFT, in the simulator.

    .venv/bin/python benchmarks/batch_tradeoff.py [--seeds 5] [--load 0.7]
        [--duration 300] [--warmup 10] [--fractions 0,0.1,...] [--override JSON]
        [--json PATH]

benchmarks/batch_beside.py measures one point over HTTP: a job that takes all
the idle capacity beside interactive and standard traffic at 0.7x. This
measures the curve behind it, on the same engine, policy and lengths (B3's),
in simulated time, so it does not depend on the machine:

- the latency tiers' classes at --load times the engine's capacity on their
  mix, Poisson, for --duration seconds;
- beside them a job of tenant nightly-eval at the batch tier, arriving at a
  fraction of the idle capacity ((1 - load) x the engine's capacity on the
  job's lengths, as batch_beside counts it); at a fraction above 1 the job
  is a backlog, as a Batch API job with lines waiting is. Its tier keeps
  its lines for a day (a job's completion window), so none expires;
- every fraction on --seeds seeds; each class draws from its own streams, so
  the latency arrivals are the same with and without the job.

For every fraction it prints the job's completed lines/s over the idle
capacity, the share of the measured window's time the engine spent in
saturated steps (docs/SIMULATE.md), and interactive's and standard's TTFT attainment and p99 as
ratios to the run without the job (alone / beside for p99), means over the
seeds, with the seeds' spread of the alone run's p99 (the noise a p99 of
one run carries).

Rules: batch_beside's, on the means. A fraction passes when the job's rate is
>= 0.9x the idle capacity and both tiers' p99 ratios and attainment ratios
are >= 0.99. Exit 0 when some fraction passes (the engine allows a job that
fills the idle capacity unnoticed), 1 when none does, 2 when a figure cannot
be judged (no request of a tier, a zero baseline).
"""

from __future__ import annotations

import argparse
import bisect
import json
import math
import statistics
import sys
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent
sys.path[:0] = [str(ROOT), str(HERE)]

import b3_sweep as sweep  # noqa: E402
from batch_beside import (  # noqa: E402
    ATTAINMENT_FLOOR, JOB_RATE_FLOOR, JOB_TENANT, LATENCY_TIERS, P99_FLOOR, add_run_arguments,
    capacity_rps, job_scenario, only, run_problems, tenants_of,
)  # fmt: skip

from qosgate.sim.report import build_policy_report  # noqa: E402
from qosgate.sim.runner import run_policy, with_policy  # noqa: E402
from qosgate.sim.scenario import Scenario, load_scenario  # noqa: E402
from qosgate.sim.workload import generate_arrivals  # noqa: E402

FRACTIONS = (0.0, 0.1, 0.25, 0.5, 0.75, 0.9, 1.0, 1.5)
JOB_KEEPS_MS = 86_400_000
"""A job's line waits up to a day at its tier: it never expires in a run."""
JOB_QUEUE = 100_000
"""Room in the job's tier for a backlog of a run's length."""


class TradeoffError(Exception):
    """A figure that cannot be judged."""


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--seeds", type=int, default=5, help="seeds per fraction (default 5)")
    add_run_arguments(parser)
    parser.add_argument("--fractions", default=",".join(str(f) for f in FRACTIONS),
                        help="job rates as fractions of the idle capacity, comma separated; "
                             "0 is the run without the job and is always run")
    parser.add_argument("--json", dest="json_path", help="write the figures here")
    args = parser.parse_args(argv)
    problems = run_problems(args)
    if not 1 <= args.seeds <= 100:
        problems.append("--seeds must be between 1 and 100")
    try:
        fractions = sorted({float(f) for f in args.fractions.split(",") if f.strip()} | {0.0})
    except ValueError:
        fractions = []
        problems.append(f"--fractions must be numbers separated by commas: {args.fractions!r}")
    if any(not (math.isfinite(f) and 0 <= f <= 10) for f in fractions):
        problems.append("every fraction must be between 0 and 10")
    if problems:
        parser.error("; ".join(problems))
    args.fractions = tuple(fractions)
    return args


def cell_scenario(base: Scenario, args: argparse.Namespace, latency_rps: float,
                  job_rps: float) -> Scenario:  # fmt: skip
    """B3's latency classes at `latency_rps` in all, and the job's class at
    `job_rps` after them (0: no job), with the job's tier keeping its lines."""
    doc = base.model_dump(mode="json", exclude_none=True)
    latency = tenants_of(base, LATENCY_TIERS)
    classes = [c for c in doc["classes"] if c["tenant"] in latency]
    if job_rps > 0:
        (job,) = [c for c in doc["classes"] if c["tenant"] == JOB_TENANT]
        job.pop("share", None)
        classes.append(job | {"rate_rps": job_rps})
    (job_tier,) = {t.tier for t in base.policy.tenants if t.id == JOB_TENANT}
    tier = doc["policy"]["tiers"][job_tier]
    tier.pop("e2e_slo_ms", None)
    tier.pop("expire_after_ms", None)
    tier.update(max_queue_wait_ms=JOB_KEEPS_MS, max_queue_len=JOB_QUEUE)
    doc.update(classes=classes, duration_s=args.duration, warmup_s=args.warmup,
               arrivals={"process": "poisson", "rate_rps": latency_rps})
    for key in ("targets", "reference_load", "reference_policies"):
        doc.pop(key, None)
    return Scenario.model_validate(doc)


def run_cell(scenario: Scenario, latency_rps: float, seed: int) -> dict[str, Any]:
    """qos on the scenario's arrivals: the latency tiers' report and the job's
    completed lines/s inside the window."""
    policy = with_policy(scenario.policy, "qos")
    arrivals = generate_arrivals(scenario, policy, latency_rps, seed)
    run = run_policy(policy, scenario.engine, arrivals,
                     drain_until=scenario.duration_s + scenario.drain_s)  # fmt: skip
    start, end = scenario.warmup_s, scenario.duration_s
    report = build_policy_report(run.requests, policy, window=(start, end),
                                 metrics=scenario.metrics, samples=run.samples)  # fmt: skip
    done = sum(1 for r in run.requests if r.tenant == JOB_TENANT and r.finished_at is not None
               and r.output_tokens > 0 and start <= r.finished_at <= end)  # fmt: skip
    return {"tiers": {t: report["tiers"][t] for t in LATENCY_TIERS},
            "job_lines_per_s": done / (end - start),
            "saturated_share": saturated_share(run.saturated_s_samples, start, end)}


def saturated_share(samples: list[tuple[float, float]], start: float,
                    end: float) -> float | None:  # fmt: skip
    """The engine's saturated seconds between the last samples at or before
    `start` and `end`, over the time between them; None without two."""
    times = [t for t, _ in samples]
    first, last = bisect.bisect_right(times, start) - 1, bisect.bisect_right(times, end) - 1
    if first < 0 or last <= first:
        return None
    (t0, s0), (t1, s1) = samples[first], samples[last]
    return (s1 - s0) / (t1 - t0)


def _ratio(num: float | None, den: float | None, what: str) -> float:
    if num is None or den is None:
        raise TradeoffError(f"{what}: no figure (a tier without requests in the window)")
    if den == 0:
        raise TradeoffError(f"{what}: the baseline is 0")
    return num / den


def summarise(runs: dict[float, dict[int, dict]], idle_rps: float) -> list[dict[str, Any]]:
    """Per fraction: the means over the seeds of the ratios the rules read."""
    if idle_rps <= 0:
        raise TradeoffError("the idle capacity is 0: nothing for a job to take")
    alone = runs[0.0]
    rows = []
    for fraction, seeds in runs.items():
        row: dict[str, Any] = {"fraction": fraction}
        row["job_rate"] = statistics.fmean(
            seeds[s]["job_lines_per_s"] for s in seeds) / idle_rps
        shares = [seeds[s].get("saturated_share") for s in seeds]
        row["saturated_share"] = (None if None in shares
                                  else statistics.fmean(shares))  # type: ignore[arg-type]
        for tier in LATENCY_TIERS:
            p99 = [_ratio(alone[s]["tiers"][tier]["ttft_p99_s"], seeds[s]["tiers"][tier]["ttft_p99_s"],
                          f"{tier} TTFT p99 at {fraction}, seed {s}") for s in seeds]
            att = [_ratio(seeds[s]["tiers"][tier]["ttft_slo_attainment"],
                          alone[s]["tiers"][tier]["ttft_slo_attainment"],
                          f"{tier} attainment at {fraction}, seed {s}") for s in seeds]
            row[f"{tier}_p99_ratio"] = statistics.fmean(p99)
            row[f"{tier}_p99_ratio_range"] = (min(p99), max(p99))
            row[f"{tier}_attainment_ratio"] = statistics.fmean(att)
            row[f"{tier}_p99_ms"] = 1000 * statistics.fmean(
                seeds[s]["tiers"][tier]["ttft_p99_s"] for s in seeds)
        row["passed"] = row["job_rate"] >= JOB_RATE_FLOOR and all(
            row[f"{t}_p99_ratio"] >= P99_FLOOR and row[f"{t}_attainment_ratio"] >= ATTAINMENT_FLOOR
            for t in LATENCY_TIERS)
        rows.append(row)
    return rows


def alone_spread(runs: dict[float, dict[int, dict]]) -> dict[str, float | None]:
    """Per tier: the alone run's p99 over the seeds, as its coefficient of variation."""
    out: dict[str, float | None] = {}
    for tier in LATENCY_TIERS:
        p99 = [r["tiers"][tier]["ttft_p99_s"] for r in runs[0.0].values()]
        out[tier] = statistics.stdev(p99) / statistics.fmean(p99) if len(p99) > 1 else None
    return out


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    base = sweep.with_override(load_scenario(sweep.SCENARIO), args.override)
    latency_rps = args.load * capacity_rps(only(base, tenants_of(base, LATENCY_TIERS)))
    idle_rps = (1 - args.load) * capacity_rps(job_scenario(base))
    print(f"latency load {latency_rps:.2f} req/s ({args.load}x); idle capacity for the job "
          f"{idle_rps:.2f} lines/s; {args.seeds} seeds", flush=True)  # fmt: skip
    runs: dict[float, dict[int, dict]] = {}
    for fraction in args.fractions:
        scenario = cell_scenario(base, args, latency_rps, fraction * idle_rps)
        runs[fraction] = {seed: run_cell(scenario, latency_rps, seed)
                          for seed in range(1, args.seeds + 1)}  # fmt: skip
    try:
        rows = summarise(runs, idle_rps)
    except TradeoffError as exc:
        print(f"ERROR  {exc}")
        return 2
    spread = alone_spread(runs)
    print("| job rate asked (x idle) | job done (x idle) | interactive p99 ms (alone/beside; "
          "seeds' range) | standard p99 ms (alone/beside; seeds' range) "
          "| attainment ratios (interactive, standard) | engine saturated | rule |")
    print("|---:|---:|---:|---:|---:|---:|---|")

    def p99(row: dict[str, Any], tier: str) -> str:
        low, high = row[f"{tier}_p99_ratio_range"]
        return (f"{row[f'{tier}_p99_ms']:.0f} ({row[f'{tier}_p99_ratio']:.3f}; "
                f"{low:.3f}-{high:.3f})")

    for row in rows:
        print(f"| {row['fraction']:.2f} | {row['job_rate']:.3f} "
              f"| {p99(row, 'interactive')} | {p99(row, 'standard')} "
              f"| {row['interactive_attainment_ratio']:.3f}, "
              f"{row['standard_attainment_ratio']:.3f} "
              f"| {'-' if row['saturated_share'] is None else format(row['saturated_share'], '.3f')} "
              f"| {'PASS' if row['passed'] else 'fail'} |")
    print("alone p99 spread over the seeds (coefficient of variation): "
          + ", ".join(f"{t} {v:.3f}" if v is not None else f"{t} -" for t, v in spread.items()))
    passing = [row["fraction"] for row in rows if row["passed"]]
    if passing:
        print(f"PASS  a job at {passing} of the idle capacity takes >= {JOB_RATE_FLOOR}x of it "
              f"with the latency tiers' p99 >= {P99_FLOOR}x and attainment >= "
              f"{ATTAINMENT_FLOOR}x alone")
    else:
        print(f"FAIL  no job rate takes >= {JOB_RATE_FLOOR}x the idle capacity with the latency "
              f"tiers' TTFT p99 >= {P99_FLOOR}x and attainment >= {ATTAINMENT_FLOOR}x alone")
    if args.json_path:
        Path(args.json_path).write_text(json.dumps({
            "args": vars(args), "latency_rps": latency_rps, "idle_capacity_rps": idle_rps,
            "rows": rows, "alone_p99_spread": spread,
            "runs": {str(f): runs[f] for f in runs},
        }, indent=1))  # fmt: skip
        print(f"wrote {args.json_path}")
    return 0 if passing else 1


if __name__ == "__main__":
    sys.exit(main())
