"""A 20,000-line batch job beside latency traffic, on the live simulated GPU.

    .venv/bin/python benchmarks/batch_beside.py [--speed 1] [--duration 300] [--load 0.7]
        [--lines 20000] [--in-flight N] [--waiting N] [--warmup 10] [--override JSON]
        [--json PATH]

Two runs of one `qosgate serve` process each (tests/fleet_support.py's Proc),
with B3's policy, tenants and engine (benchmarks/b3_overload.yaml, as
benchmarks/b3_http.py serves it) and the Batch API on:

1. alone: `qosgate bench` sends open-loop Poisson arrivals of B3's interactive
   and standard classes (their shares and lengths) at --load times the
   engine's capacity on that mix, for --duration seconds of modelled time;
2. beside: the same arrivals (same seed) after a --lines batch job of tenant
   nightly-eval has been created and is running at the batch tier.

Capacity is the simulator's measure of the profile (`measure_capacity`, the
engine kept full) on the latency mix, and on the job's own lengths. The job's
lines are drawn from B3's length distributions, so the two agree; the idle
capacity the job may use is (1 - load) times the capacity on the job's
lengths, the engine's free fraction in the job's own requests/s.

Durations are modelled time: the engine runs --speed times as fast as the
modelled GPU, and every *_ms of the policy and the bench's SLOs are divided by
it (b3_http's `dilated`), so a run takes --duration / --speed seconds.

Every second the gateway's /metrics is read: the simulated engine's own
qosgate_sim_saturated_step_seconds_total (modelled seconds in steps that did
all the engine can do in one: every slot running, the whole token budget
used, or the KV cache full), qosgate_batch_lines_total, and
qosgate_backend_inflight against qosgate_backend_capacity less the
scheduler's reserved slots (the slots a batch line may take). The engine is
busy for the share of the window's modelled time it spent in saturated
steps: a GPU's utilisation, as the cost model has it. The share of samples
with every line slot running is printed beside it, not judged: a slot a
sequence frees at a step's end is refilled one step later (the engine plans
its next step before the gateway hears of the finish, as vLLM's engine core
does), so it counts a handover as idle. The job's rate is its completed lines
between the end of the bench's warm-up and the end of its arrivals, over that
window.

Rules (exit 0 when all pass, 1 when one fails, 2 when one cannot be evaluated:
a run that failed, a missing or zero baseline):
- interactive and standard TTFT SLO attainment beside the job >= 0.99x alone;
- their TTFT p99 alone / beside >= 0.99 (beside no more than 1/0.99 of alone);
- the engine saturated >= 95% of the time while the job runs;
- the job's lines/s >= 0.9x the idle capacity.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import random
import sys
import tempfile
import threading
import time
import urllib.request
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import yaml
from prometheus_client.parser import text_string_to_metric_families

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent
sys.path[:0] = [str(ROOT), str(HERE)]

import b3_sweep as sweep  # noqa: E402
from b3_http import bench_scenario, run_bench, serve_policy, tenant_key  # noqa: E402
from tests.fleet_support import Proc  # noqa: E402

from qosgate.sim.runner import measure_capacity  # noqa: E402
from qosgate.sim.scenario import Scenario, load_scenario  # noqa: E402
from qosgate.sim.workload import capacity_workload, length_sampler  # noqa: E402

LATENCY_TIERS = ("interactive", "standard")
JOB_TENANT = "nightly-eval"
CAPACITY_SAMPLE = 2000

ATTAINMENT_FLOOR = 0.99
P99_FLOOR = 0.99
BUSY_FLOOR = 0.95
JOB_RATE_FLOOR = 0.9


class BenchError(Exception):
    """A rule that cannot be evaluated on the figures at hand."""


@dataclass(frozen=True)
class Check:
    rule: str
    value: float
    threshold: float

    @property
    def passed(self) -> bool:
        return self.value >= self.threshold


def ratio(numerator: float | None, denominator: float | None, what: str) -> float:
    """numerator / denominator; a missing figure or a zero (or negative)
    denominator cannot be judged and raises."""
    if numerator is None or denominator is None:
        raise BenchError(f"{what}: a figure is missing ({numerator} / {denominator})")
    if not denominator > 0:
        raise BenchError(f"{what}: the baseline is {denominator}, not a positive number")
    return numerator / denominator


def add_run_arguments(parser: argparse.ArgumentParser) -> None:
    """The arguments of the latency traffic and the policy, shared with
    benchmarks/batch_tradeoff.py."""
    parser.add_argument("--duration", type=float, default=300.0,
                        help="modelled seconds of latency arrivals per run (default 300)")
    parser.add_argument("--warmup", type=float, default=10.0,
                        help="modelled seconds left out of the figures (default 10)")
    parser.add_argument("--load", type=float, default=0.7,
                        help="latency traffic as a fraction of capacity (default 0.7)")
    parser.add_argument("--override", type=json.loads, default={},
                        help="JSON object merged into B3's policy for every run, e.g. "
                        "'{\"scheduler\": {\"prefill_budget_tokens\": 2048}}' (an "
                        "experiment: not the defaults' figures)")


def run_problems(args: argparse.Namespace) -> list[str]:
    """What is wrong with `add_run_arguments`' arguments."""
    problems = []
    if not (math.isfinite(args.duration) and args.duration > 0):
        problems.append("--duration must be a positive number")
    if not (math.isfinite(args.warmup) and 0 <= args.warmup < args.duration):
        problems.append("--warmup must be at least 0 and less than --duration")
    if not (0 < args.load < 1):
        problems.append("--load must be between 0 and 1 (exclusive): the job needs idle capacity")
    if not isinstance(args.override, dict):
        problems.append("--override must be a JSON object")
    return problems


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--speed", type=float, default=1.0,
                        help="sim speed factor of the engine (default 1)")
    add_run_arguments(parser)
    parser.add_argument("--lines", type=int, default=20_000, help="lines of the batch job")
    parser.add_argument("--in-flight", type=int,
                        help="batch.in_flight_per_job (default: the policy's default)")
    parser.add_argument("--waiting", type=int,
                        help="batch.waiting_per_job (default: the policy's default)")
    parser.add_argument("--timeout", type=float, default=300.0,
                        help="modelled seconds the client waits for one request (default 300: "
                        "a 1,024-token answer beside the job takes over 60)")
    parser.add_argument("--json", dest="json_path", help="write the figures and checks")
    args = parser.parse_args(argv)
    problems = run_problems(args)
    if not (math.isfinite(args.speed) and args.speed > 0):
        problems.append("--speed must be a positive number")
    if args.lines < 1:
        problems.append("--lines must be at least 1")
    if args.in_flight is not None and not 1 <= args.in_flight <= 4096:
        problems.append("--in-flight must be between 1 and 4096")
    if args.waiting is not None and not 1 <= args.waiting <= 4096:
        problems.append("--waiting must be between 1 and 4096")
    if not (math.isfinite(args.timeout) and args.timeout > 0):
        problems.append("--timeout must be a positive number")
    if problems:
        parser.error("; ".join(problems))
    return args


# -- the workload ------------------------------------------------------------


def tenants_of(base: Scenario, tiers: tuple[str, ...]) -> set[str]:
    return {t.id for t in base.policy.tenants if t.tier in tiers}


def only(base: Scenario, tenants: set[str]) -> Scenario:
    """B3's scenario with only the classes of `tenants`."""
    return base.model_copy(update={"classes": tuple(
        c for c in base.classes if c.tenant in tenants)})  # fmt: skip


def capacity_rps(scenario: Scenario) -> float:
    """Requests/s (modelled) the engine sustains kept full with the scenario's mix."""
    sample = capacity_workload(scenario, scenario.policy, CAPACITY_SAMPLE, scenario.seed)
    return measure_capacity(scenario.engine, sample)[0]


def job_scenario(base: Scenario) -> Scenario:
    """The job's lengths as a scenario: one class, the job's tenant, B3's lengths."""
    (cls_,) = [c for c in base.classes if c.tenant == JOB_TENANT]
    return base.model_copy(update={"classes": (cls_.model_copy(update={"share": 1}),)})


def job_lines(base: Scenario, count: int) -> bytes:
    """The job's input file: `count` chat requests with prompt and output
    lengths drawn from B3's distributions (max_tokens is the output length,
    as the bench's requests have it), the prompt about 4 characters a token."""
    rng = random.Random(f"{base.seed}/batch-beside")
    prompt = length_sampler(rng, base.lengths.prompt)
    output = length_sampler(rng, base.lengths.output)
    words = "the quick brown fox jumps over a lazy dog "
    out = []
    for n in range(count):
        head = f"[{n}] "
        want = max(4 * prompt() - len(head), 0)
        text = head + (words * (want // len(words) + 1))[:want]
        out.append(json.dumps({
            "custom_id": f"line-{n}", "method": "POST", "url": "/v1/chat/completions",
            "body": {"model": base.engine.model, "max_tokens": output(),
                     "messages": [{"role": "user", "content": text}]},
        }, separators=(",", ":")))  # fmt: skip
    return ("\n".join(out) + "\n").encode()


def gateway_policy(base: Scenario, args: argparse.Namespace, data_dir: Path) -> dict[str, Any]:
    doc = serve_policy(base, "qos", args.speed)
    doc["batch"] = {"data_dir": str(data_dir), "max_file_bytes": 1 << 30,
                    "max_lines": max(args.lines, 1)}  # fmt: skip
    if args.in_flight is not None:
        doc["batch"]["in_flight_per_job"] = args.in_flight
    if args.waiting is not None:
        doc["batch"]["waiting_per_job"] = args.waiting
    return doc


def latency_bench(base: Scenario, rate_rps: float, args: argparse.Namespace) -> dict[str, Any]:
    """b3_http's bench scenario of the latency classes (it turns the modelled
    durations into wall seconds)."""
    return bench_scenario(only(base, tenants_of(base, LATENCY_TIERS)), rate_rps, args, base.seed)


# -- sampling the gateway ----------------------------------------------------


def scrape(url: str) -> dict[str, float]:
    """The levels the rules need, from one read of the gateway's /metrics."""
    base = url.removesuffix("/v1")
    with urllib.request.urlopen(base + "/metrics", timeout=5) as response:
        text = response.read().decode()
    found = {"inflight": 0.0, "capacity": 0.0, "job_completed": 0.0, "saturated_s": math.nan}
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            if sample.name == "qosgate_sim_saturated_step_seconds_total":
                found["saturated_s"] = sample.value
            elif sample.name == "qosgate_backend_inflight":
                found["inflight"] = sample.value
            elif sample.name == "qosgate_backend_capacity":
                found["capacity"] = sample.value
            elif (sample.name == "qosgate_batch_lines_total"
                  and sample.labels.get("result") == "completed"):  # fmt: skip
                found["job_completed"] += sample.value
    return found


class Sampler:
    """Reads /metrics every second on a thread until stopped."""

    def __init__(self, url: str) -> None:
        self.url = url
        self.samples: list[tuple[float, dict[str, float]]] = []
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()

    def _run(self) -> None:
        while True:
            began = time.monotonic()
            try:
                self.samples.append((began, scrape(self.url) | {"t": began}))
            except OSError:
                pass  # a missed sample: the window's count says how many were read
            if self._stop.wait(max(0.0, 1.0 - (time.monotonic() - began))):
                return

    def stop(self) -> None:
        self._stop.set()
        self._thread.join()

    def window(self, start: float, end: float) -> list[dict[str, float]]:
        return [s for t, s in self.samples if start <= t <= end]


def busy_fraction(samples: list[dict[str, float]], speed: float) -> float | None:
    """Share of the window's time the engine spent in saturated steps (the
    sim engine's own counter, in modelled seconds: wall seconds x speed)."""
    if len(samples) < 2:
        return None
    first, last = samples[0], samples[-1]
    span = (last["t"] - first["t"]) * speed
    busy = last["saturated_s"] - first["saturated_s"]
    if not (span > 0 and math.isfinite(busy)):
        return None
    return busy / span


def slots_full_fraction(samples: list[dict[str, float]], reserved_slots: int) -> float | None:
    """Share of the samples with every slot a batch line may take running."""
    if not samples:
        return None
    busy = sum(1 for s in samples if s["capacity"] > 0
               and s["inflight"] >= s["capacity"] - reserved_slots)  # fmt: skip
    return busy / len(samples)


def slots_short(samples: list[dict[str, float]], reserved_slots: int) -> dict[int, int]:
    """Of the samples that were not busy, how many slots short each was: a
    line's slot taken back a moment late shows as 1, a job that cannot keep
    the engine fed as many."""
    short: dict[int, int] = {}
    for s in samples:
        gap = int(s["capacity"] - reserved_slots - s["inflight"])
        if s["capacity"] > 0 and gap > 0:
            short[gap] = short.get(gap, 0) + 1
    return dict(sorted(short.items()))


def job_rate(samples: list[dict[str, float]], start: float, end: float) -> float | None:
    """Completed lines/s (wall) between the first and last sample of the window."""
    if len(samples) < 2 or end <= start:
        return None
    return (samples[-1]["job_completed"] - samples[0]["job_completed"]) / (end - start)


# -- the runs ----------------------------------------------------------------


def start_job(url: str, lines: bytes) -> str:
    import openai

    client = openai.OpenAI(base_url=url, api_key=tenant_key(JOB_TENANT), max_retries=0,
                           timeout=600)  # fmt: skip
    uploaded = client.files.create(file=("job.jsonl", lines), purpose="batch")
    batch = client.batches.create(input_file_id=uploaded.id, endpoint="/v1/chat/completions",
                                  completion_window="7d")  # fmt: skip
    return batch.id


def job_status(url: str, batch_id: str) -> dict[str, Any]:
    import openai

    client = openai.OpenAI(base_url=url, api_key=tenant_key(JOB_TENANT), max_retries=0)
    return client.batches.retrieve(batch_id).model_dump(mode="json")


def run_one(base: Scenario, args: argparse.Namespace, tmp: Path, name: str, rate_rps: float,
            lines: bytes | None) -> dict[str, Any]:  # fmt: skip
    """One gateway, the latency bench on it (beside a job when `lines`), and
    what the sampler saw over the bench's measured window."""
    config = tmp / f"{name}-policy.yaml"
    config.write_text(yaml.safe_dump(gateway_policy(base, args, tmp / f"{name}-data")))
    gateway = Proc(config, name, tmp, None)
    sampler = Sampler(gateway.url)
    batch_id = None
    try:
        if lines is not None:
            batch_id = start_job(gateway.url, lines)
        began = time.monotonic()
        report = run_bench(gateway.url, latency_bench(base, rate_rps, args), tmp, name)
        # The bench's arrivals end --duration after it starts; the figures
        # leave out its warm-up, and so does the window.
        start = began + args.warmup / args.speed
        end = began + args.duration / args.speed
        window = sampler.window(start, end)
        job = job_status(gateway.url, batch_id) if batch_id is not None else None
    except (sweep.SweepError, OSError) as exc:
        print(gateway.tail(), file=sys.stderr)
        raise BenchError(f"{name}: {exc}") from exc
    finally:
        sampler.stop()
        gateway.stop()
    reserved = base.policy.scheduler.reserve.slots
    rate = job_rate(window, start, end)
    return {
        "report": report,
        "samples": len(window),
        "busy_fraction": busy_fraction(window, args.speed),
        "slots_full_fraction": slots_full_fraction(window, reserved),
        "slots_short": slots_short(window, reserved),
        "inflight_mean": (sum(s["inflight"] for s in window) / len(window)) if window else None,
        "job_lines_per_s": None if rate is None else rate / args.speed,
        "job_completed_in_window": (window[-1]["job_completed"] - window[0]["job_completed"])
        if len(window) >= 2 else None,  # fmt: skip
        "job": None if job is None else {"status": job["status"],
                                         "request_counts": job["request_counts"]},
    }


def evaluate(alone: dict[str, Any], beside: dict[str, Any], idle_rps: float) -> list[Check]:
    """The rules on the two runs' figures; BenchError when one cannot be judged."""
    checks = []
    for tier in LATENCY_TIERS:
        base = alone["report"].get("tiers", {}).get(tier, {})
        with_job = beside["report"].get("tiers", {}).get(tier, {})
        checks.append(Check(f"{tier} TTFT attainment beside the job / alone",
                            ratio(with_job.get("ttft_slo_attainment"),
                                  base.get("ttft_slo_attainment"), f"{tier} attainment"),
                            ATTAINMENT_FLOOR))  # fmt: skip
        checks.append(Check(f"{tier} TTFT p99 alone / beside the job",
                            ratio(base.get("ttft_p99_s"), with_job.get("ttft_p99_s"),
                                  f"{tier} TTFT p99"),
                            P99_FLOOR))  # fmt: skip
    job = beside.get("job") or {}
    if job.get("status") != "in_progress":
        # A job that ended inside the window leaves idle capacity unused: its rate understates.
        raise BenchError(f"the job was {job.get('status')!r} when the latency traffic ended, "
                         "not in_progress: give it more --lines")  # fmt: skip
    busy = beside.get("busy_fraction")
    if busy is None:
        raise BenchError("backend busy: fewer than two /metrics samples with the engine's "
                         "qosgate_sim_saturated_step_seconds_total while the job ran")
    checks.append(Check("engine saturated share of the time while the job runs", busy,
                        BUSY_FLOOR))  # fmt: skip
    checks.append(Check("job lines/s / idle capacity",
                        ratio(beside.get("job_lines_per_s"), idle_rps, "job rate"),
                        JOB_RATE_FLOOR))  # fmt: skip
    return checks


def _figure(value: float | None) -> str:
    return "-" if value is None else f"{value:.3f}"


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    base = sweep.with_override(load_scenario(sweep.SCENARIO), args.override)
    latency = only(base, tenants_of(base, LATENCY_TIERS))
    capacity = capacity_rps(latency)
    job_capacity = capacity_rps(job_scenario(base))
    load_rps = args.load * capacity
    idle_rps = (1 - args.load) * job_capacity
    print(f"engine capacity (modelled): {capacity:.2f} req/s on the latency mix, "
          f"{job_capacity:.2f} on the job's lengths; latency load {load_rps:.2f} req/s; "
          f"idle capacity for the job {idle_rps:.2f} req/s", flush=True)  # fmt: skip
    lines = job_lines(base, args.lines)
    runs = {}
    try:
        with tempfile.TemporaryDirectory(prefix="qosgate-batch-beside-") as tmp_name:
            tmp = Path(tmp_name)
            for name, job in (("alone", None), ("beside", lines)):
                began = time.monotonic()
                runs[name] = run_one(base, args, tmp, name, load_rps * args.speed, job)
                print(f"  {name}: {time.monotonic() - began:.0f} s, load average "
                      f"{os.getloadavg()[0]:.2f}", file=sys.stderr, flush=True)  # fmt: skip
        checks = evaluate(runs["alone"], runs["beside"], idle_rps)
    except (BenchError, RuntimeError) as exc:
        print(f"ERROR  {exc}")
        return 2
    for name, run in runs.items():
        tiers = run["report"]["tiers"]
        row = "; ".join(f"{t} attainment {tiers[t]['ttft_slo_attainment']:.3f} "
                        f"p99 {tiers[t]['ttft_p99_s'] * 1000:.0f} ms"
                        for t in LATENCY_TIERS)  # fmt: skip
        print(f"{name}: {row}; engine saturated {_figure(run['busy_fraction'])} of the time; "
              f"every line slot running in {_figure(run['slots_full_fraction'])} of "
              f"{run['samples']} samples (mean inflight {_figure(run['inflight_mean'])}; "
              f"samples by slots short "
              f"{run['slots_short']}); job "
              f"{_figure(run['job_lines_per_s'])} lines/s {run['job'] or ''}")  # fmt: skip
    failed = [c for c in checks if not c.passed]
    for check in checks:
        print(f"{'PASS' if check.passed else 'FAIL'}  {check.rule}: {check.value:.3f} "
              f"(>= {check.threshold})")  # fmt: skip
    print(f"{len(checks) - len(failed)} of {len(checks)} checks pass; load average "
          f"{os.getloadavg()[0]:.2f}")  # fmt: skip
    if args.json_path:
        payload = {"args": vars(args), "capacity_rps": capacity, "job_capacity_rps": job_capacity,
                   "latency_load_rps": load_rps, "idle_capacity_rps": idle_rps,
                   "runs": {name: {k: v for k, v in run.items() if k != "report"}
                            | {"tiers": {t: run["report"]["tiers"][t] for t in LATENCY_TIERS}}
                            for name, run in runs.items()},
                   "checks": [{"rule": c.rule, "value": c.value, "threshold": c.threshold,
                               "passed": c.passed} for c in checks]}  # fmt: skip
        Path(args.json_path).write_text(json.dumps(payload, indent=1))
        print(f"wrote {args.json_path}")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
