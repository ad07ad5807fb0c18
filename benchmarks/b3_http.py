"""B3 sweep through the real HTTP gateway: the 1x, 2x and 4x Poisson cells of
benchmarks/b3_sweep.py, sent by `qosgate bench` to `qosgate serve` on the live
simulated GPU, judged by the sweep's own rules.

    .venv/bin/python benchmarks/b3_http.py [--loads 1,2,4] [--policies qos,strict,fcfs]
        [--mix b3|long] [--speed 1] [--duration 60] [--warmup 20] [--timeout 90] [--fleet]
        [--seeds 1] [--seed 3] [--override JSON] [--engine JSON] [--twin-only] [--json PATH]

Each cell and policy starts its own gateway (or, with --fleet, a redis-server,
--gateways replicas and --engines engine nodes, each a `qosgate serve`
process: tests/fleet_support.py's Fleet) with B3's policy, engine and tenants
(benchmarks/b3_overload.yaml) and the scheduler policy set to the one under
test. The load unit is the engine's capacity on the B3 mix as the simulator
measures it for the profile (times the engines of a fleet, times --speed).
`qosgate bench` sends open-loop Poisson arrivals of B3's class mix at load x
that rate, each tenant with its own key, and the tiers' SLOs judge the answers.

Durations on the command line are the modelled GPU's seconds; with --speed
below 1 the engine runs that much slower, and every duration of the run and
of the policy (SLOs, queue budgets, ageing, the drain estimate's time
constant) is stretched by 1 / speed. A run must be long enough for the queues
to reach their steady state (the engine's 256 slots absorb the first seconds
of any overload), and the client must wait long enough for a request that
was served in time to finish streaming: by default 60 s of arrivals, the
first 20 s left out, and 90 s per request (batch's 60 s objective and then
some). At speed 1 the whole table takes about 15 minutes.

Beside each HTTP figure the output has the simulator's on the very same
requests (`twin_scenario`), and the counts behind both: per tier what the
client saw (completed, refused by status, expired, cut by its timeout,
errors, TTFT), what the gateways counted (/metrics: outcomes, queue waits)
and the CPU the client and each server process used.

The rules are b3_sweep's `evaluate`, on the bench reports. With --seeds N each
cell runs on N arrival seeds (from --seed, by default B3's), every policy on the same
requests, and the rules are the sweep's over seeds: qos against strict by the
paired difference and its noise, the rest on the seeds' means. On one seed
qos against strict is the exact comparison of one run, which any reordering
of the lower tiers' work moves by a request or two either way. One rule is out of
reach of a client: the tiers' longest served queue wait against their stated
bound (the client sees TTFT, not the gateway's queue), so it is not evaluated
here and the output says so.

--twin-only runs the simulator twin alone (no gateway, seconds instead of
minutes) and judges its table: what a run would show, or how the figures on
this short a run move with the seed, --duration and --warmup.

--override is an experiment on B3's policy: its tiers, tenants and scheduler
are in the modelled GPU's time, stretched for the gateway like the rest, and
the simulator twin runs with them too; other sections reach the gateway only.

Exit status as b3_sweep: 0 when every rule passes, 1 when one fails, 2 when a
rule cannot be evaluated (a policy not run, no 1x baseline, a gateway or
bench that failed).
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

import yaml

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent
sys.path[:0] = [str(ROOT), str(HERE)]

import b3_sweep as sweep  # noqa: E402
from tests.fleet_support import Fleet, environ, metric_samples, tier_quantiles  # noqa: E402

from qosgate.sim.commands import Simulation  # noqa: E402
from qosgate.sim.scenario import Scenario, load_scenario  # noqa: E402

LOADS = (1.0, 2.0, 4.0)
ARRIVALS = "poisson"
MIX = "b3"
# At speed 1 the gateway and the client each use about a fifth of a core on
# this mix, so the engine stays the bottleneck, and the table fits in a
# quarter of an hour; at 0.1, 60 modelled seconds would take 10 minutes a run.
SPEED = 1.0
DURATION_S = 60.0
WARMUP_S = 20.0
TIMEOUT_S = 90.0
# The fleet's default lease: B3's engine nodes hold up to 256 runs each, and a
# loaded machine can hold a renewal back longer than fleet.py's 2 s allow.
FLEET_LEASE_S = 5.0
UNSEEN_RULE = "tiers' max served queue wait within their stated bound (gateway-side figure)"
# The parts of --override that the simulator twin models too; the rest
# (backend, server, fleet, ...) reaches the gateway only.
MODELLED_SECTIONS = ("tiers", "tenants", "scheduler", "default_tier")


def tenant_key(tenant: str) -> str:
    return f"b3-http-{tenant}"


RATES = ("initial_drain_rate",)
"""Rates of the policy whose names do not end in _per_s."""


def dilated(node: Any, speed: float) -> Any:
    """`node` on an engine `speed` times as fast as the modelled GPU: every
    duration (a key ending in _ms or _s) divided by `speed`, every rate (a key
    ending in _per_s, or in RATES) times `speed`, so that the SLOs, queue
    budgets, ageing and the drain estimate's time constant keep their meaning."""
    if not isinstance(node, dict):
        return node
    out = {}
    for key, value in node.items():
        if isinstance(value, bool) or not isinstance(value, (int, float)):
            out[key] = dilated(value, speed)
        elif key.endswith("_per_s") or key in RATES:
            out[key] = value * speed
        elif key.endswith(("_ms", "_s")):
            out[key] = value / speed
        else:
            out[key] = value
    return out


def serve_policy(base: Scenario, policy: str, speed: float) -> dict[str, Any]:
    """B3's policy file as `qosgate serve` reads it: its tiers, tenants (each
    with its key) and scheduler, with `policy` as scheduler.policy, on B3's
    engine slowed to `speed` and its durations stretched to match."""
    doc = base.policy.model_dump(mode="json", exclude_unset=True)
    # With their defaults: a default duration (drain_rate_tau_s) is stretched too.
    # Nulls stay: `prefill_budget_tokens: null` says "no budget", not "the default".
    full = base.policy.model_dump(mode="json")
    doc["tiers"] = dilated(full["tiers"], speed)
    doc["scheduler"] = {**dilated(full["scheduler"], speed), "policy": policy}
    doc["tenants"] = [
        {**tenant, "api_keys": [
            "sha256:" + hashlib.sha256(tenant_key(tenant["id"]).encode()).hexdigest()]}
        for tenant in doc["tenants"]
    ]
    doc["backend"] = base.engine.model_copy(update={"speed": speed}).model_dump(
        mode="json", exclude_none=True)
    doc["server"] = {"port": 0, "admin_token_env": None, "auth_failures_per_minute": 0,
                     "shutdown_grace_s": 5}
    doc["observability"] = {"log_requests": False}
    return doc


def bench_scenario(base: Scenario, rate_rps: float, args: argparse.Namespace,
                   seed: int, mix: str = MIX) -> dict[str, Any]:  # fmt: skip
    """B3's class mix (`mix`: one of b3_sweep's) and lengths as a `qosgate
    bench` open-loop scenario, its tiers' SLOs stretched as the gateway's are
    (`dilated`)."""
    cell = sweep.cell_scenario(base, mix, ARRIVALS)
    tiers = {tenant.id: tenant.tier for tenant in base.policy.tenants}
    slos = {name: {"ttft_slo_ms": tier.ttft_slo_ms, "e2e_slo_ms": tier.e2e_slo_ms}
            for name, tier in base.policy.tiers.items()}  # fmt: skip
    return {
        "kind": "bench", "name": "b3-http", "mode": "open", "model": base.engine.model,
        "endpoint": "chat", "stream": True, "seed": seed, "timeout_s": args.timeout / args.speed,
        "duration_s": args.duration / args.speed, "warmup_s": args.warmup / args.speed,
        "arrivals": {"process": "poisson", "rate_rps": round(rate_rps, 4)},
        "lengths": base.lengths.model_dump(mode="json"),
        "classes": [{"name": c.tenant, "tier": tiers[c.tenant], "api_key": tenant_key(c.tenant),
                     "share": c.effective_share,
                     **({"lengths": c.lengths.model_dump(mode="json", exclude_none=True)}
                        if c.lengths is not None else {})}
                    for c in cell.classes],
        "tiers": {name: {key: value for key, value in dilated(slo, args.speed).items()
                         if value is not None} for name, slo in slos.items()},
    }  # fmt: skip


def run_bench(url: str, scenario: dict[str, Any], tmp: Path, name: str) -> dict[str, Any]:
    path = tmp / f"{name}.yaml"
    path.write_text(yaml.safe_dump(scenario))
    out = tmp / f"{name}.json"
    run = subprocess.run(
        [sys.executable, "-m", "qosgate.cli", "bench", url, str(path), "--json", str(out),
         "--quiet"],
        env=environ(), cwd=ROOT, capture_output=True, text=True,
    )  # fmt: skip
    if run.returncode not in (0, 1) or not out.exists():
        raise sweep.SweepError(f"{name}: qosgate bench failed ({run.returncode}):\n"
                               f"{run.stderr[-3000:]}")
    (report,) = json.loads(out.read_text())["policies"].values()
    return report


def gateway_figures(urls: list[str]) -> dict[str, Any]:
    """What the gateways themselves counted, from their /metrics: requests by
    tier and outcome, and per tier the queue waits (p50 / p99; in a fleet the
    wait in the shared queue too)."""
    outcomes: dict[str, dict[str, int]] = {}
    for labels, value in metric_samples(urls, "qosgate_requests_total"):
        per_tier = outcomes.setdefault(labels["tier"], {})
        per_tier[labels["outcome"]] = per_tier.get(labels["outcome"], 0) + int(value)
    return {
        "outcomes": outcomes,
        "queue_wait": tier_quantiles(metric_samples(urls, "qosgate_queue_wait_seconds_bucket")),
        "fleet_queue_wait": tier_quantiles(
            metric_samples(urls, "qosgate_fleet_queue_wait_seconds_bucket")),
    }  # fmt: skip


def cpu_seconds(pid: int) -> float | None:
    """CPU time (user + system) a live process has used so far; None where
    /proc does not say (not Linux)."""
    try:
        fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    except OSError:
        return None
    # utime and stime are fields 14 and 15 of stat(5), in clock ticks.
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


class EngineSampler:
    """Each fleet engine node's own view of its load, sampled from its status
    endpoint while the bench runs: its drain estimate (what the shared
    queue's admission divides by), free slots and completions. Read beside
    the client's measured throughput, it says whether the fleet admits on
    what its nodes can do."""

    def __init__(self, engines: list[Any], interval_s: float) -> None:
        self._engines = engines
        self._interval_s = interval_s
        self._samples: dict[str, list[dict[str, Any]]] = {e.name: [] for e in engines}
        self._done = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()

    def _run(self) -> None:
        while not self._done.wait(self._interval_s):
            for engine in self._engines:
                try:
                    status = engine.get("/fleet")
                except OSError:
                    continue
                status["t"] = time.monotonic()
                self._samples[engine.name].append(status)

    def stop(self) -> dict[str, Any]:
        """Per node: the drain estimate's median and last value (tokens/s),
        how often it had no free slot, and its completions per second."""
        self._done.set()
        self._thread.join()
        out = {}
        for name, samples in self._samples.items():
            if len(samples) < 2:
                out[name] = {"samples": len(samples)}
                continue
            rates = sorted(s["drain_rate_tokens_per_s"] for s in samples)
            span = samples[-1]["t"] - samples[0]["t"]
            out[name] = {
                "samples": len(samples),
                "drain_estimate_median": rates[len(rates) // 2],
                "drain_estimate_last": samples[-1]["drain_rate_tokens_per_s"],
                "full_fraction": sum(s["free_slots"] <= 0 for s in samples) / len(samples),
                "free_slots_median": sorted(s["free_slots"] for s in samples)[len(samples) // 2],
                "completed_per_s": (samples[-1]["completed"] - samples[0]["completed"]) / span
                if span > 0 else None,
            }
        return out


def run_cell(base: Scenario, policy: str, rate_rps: float, args: argparse.Namespace,
             tmp: Path, seed: int) -> dict[str, Any]:  # fmt: skip
    """One policy's run of one cell: a fresh gateway (or fleet), the bench
    against it, and the gateways' own counts under the report's "gateway"."""
    name = f"{policy}-{rate_rps:.3f}"
    doc = sweep.merged(serve_policy(base, policy, args.speed), gateway_only(args.override))
    fleet = Fleet(tmp / name, single=not args.fleet, gateways=args.gateways,
                  engines=args.engines, lease_s=FLEET_LEASE_S, doc=doc)  # fmt: skip
    sampler = EngineSampler(fleet.engines, interval_s=1.0 / args.speed)
    try:
        scenario = bench_scenario(base, rate_rps, args, seed, args.mix)
        report = run_bench(fleet.urls, scenario, tmp, name)
        report["gateway"] = gateway_figures([g.url for g in fleet.gateways])
        report["gateway"]["engines"] = sampler.stop()
        report["gateway"]["cpu_s"] = {p.name: cpu_seconds(p.proc.pid)
                                      for p in [*fleet.gateways, *fleet.engines]}
        return report
    except sweep.SweepError:
        print(fleet.logs(), file=sys.stderr)
        raise
    finally:
        fleet.close()


def with_modelled_override(base: Scenario, override: dict[str, Any]) -> Scenario:
    """`base` with the sections of `override` that the simulator models
    (MODELLED_SECTIONS) merged into its policy, in the modelled GPU's time:
    the gateway gets them stretched by the speed like the rest of B3's
    policy (`serve_policy`), and the twin as they are, so both run the same
    experiment. Raises ValueError naming the bad field."""
    return sweep.with_override(
        base, {key: value for key, value in override.items() if key in MODELLED_SECTIONS})


def b3_scenario(override: dict[str, Any], seed: int | None = None,
                engine: dict[str, Any] | None = None) -> Scenario:
    """B3's scenario as a run sends it: with the modelled part of `override`
    (with_modelled_override), on `engine` merged into its engine section
    (sweep.with_engine: the served gateway's backend and the twin's engine
    alike, and the load unit follows it), its seeds counted from `seed`
    (None: B3's). Raises ValueError naming the bad field."""
    base = with_modelled_override(load_scenario(sweep.SCENARIO), override)
    if engine:
        base = sweep.with_engine(base, engine)
    return base if seed is None else base.model_copy(update={"seed": seed})


def gateway_only(override: dict[str, Any]) -> dict[str, Any]:
    """The sections of `override` the twin does not model, merged into the
    served policy as they are."""
    return {key: value for key, value in override.items() if key not in MODELLED_SECTIONS}


def twin_scenario(base: Scenario, args: argparse.Namespace) -> Scenario:
    """The sweep's cell on the bench's own requests: the same seeded draws at
    the modelled GPU's pace (the bench's times x speed), over the bench's
    duration and warm-up, with each request asking for exactly its output, as
    the bench asks. The offline simulator replays it, so each HTTP figure has
    the figure the same rules give in the simulator beside it."""
    cell = sweep.cell_scenario(base, args.mix, ARRIVALS)
    return cell.model_copy(update={
        "duration_s": args.duration, "warmup_s": args.warmup, "drain_s": args.timeout,
        "max_tokens": "output"})


def run_table(base: Scenario, loads: tuple[float, ...], policies: tuple[str, ...],
              args: argparse.Namespace) -> tuple[dict, dict, float]:  # fmt: skip
    """{Cell: {seed: entry}} in b3_sweep's shape through HTTP, the same for
    the simulator on the same requests (`twin_scenario`), and the capacity
    (requests/s) the loads multiply on the first seed: one engine's, times the
    engines of a fleet."""
    scenario = sweep.cell_scenario(base, args.mix, ARRIVALS)
    engines = args.engines if args.fleet else 1
    share = sweep.interactive_share(scenario)
    table: dict = {}
    twins: dict = {}
    capacities = []
    with tempfile.TemporaryDirectory(prefix="qosgate-b3-http-") as tmp_name:
        tmp = Path(tmp_name)
        for seed in range(base.seed, base.seed + args.seeds):
            # As the sweep measures it, on each seed's own draws.
            one = Simulation(scenario, seed=seed, quiet=True).capacity_rps
            capacity = one * args.speed * engines
            capacities.append(capacity)
            # Interactive demand is a ratio of rates on one engine: the speed factor cancels.
            own = sweep.interactive_capacity_rps(scenario, seed) * args.speed * engines
            twin = Simulation(twin_scenario(base, args), seed=seed, quiet=True)
            for load in loads:
                rate = load * capacity
                cell = sweep.Cell(args.mix, ARRIVALS, load)
                runs = {}
                for policy in () if args.twin_only else policies:
                    began = time.monotonic()
                    runs[policy] = run_cell(base, policy, rate, args, tmp, seed)
                    print(f"  {cell} seed {seed} {policy}: {rate:.2f} req/s offered, "
                          f"{time.monotonic() - began:.0f} s, load average "
                          f"{os.getloadavg()[0]:.2f}", file=sys.stderr, flush=True)  # fmt: skip
                # The client cannot see queue waits: no stated bound is judged here
                # (UNSEEN_RULE).
                table.setdefault(cell, {})[seed] = {
                    "capacity_rps": capacity, "rate_rps": rate,
                    "interactive_demand": rate * share / own, "bounds": {}, "policies": runs}
                # For a fleet: one engine at the same load (its share of the requests).
                twins.setdefault(cell, {})[seed] = {
                    "capacity_rps": capacity / engines, "rate_rps": rate / engines,
                    "interactive_demand": rate * share / own, "bounds": {},
                    "policies": twin.run(load, policies)[0]["policies"]}  # fmt: skip
    return table, twins, capacities[0]


def _s(value: float | None, speed: float = 1.0) -> str:
    return "-" if value is None else f"{value / speed:.1f}"


def _a(value: float | None) -> str:
    return "-" if value is None else f"{value:.3f}"


TIER_HEAD = (f"  {'tier':<11} {'':>4} {'sent':>5} {'done':>5} {'503':>4} {'429':>4} {'504':>4} "
             f"{'cut':>4} {'err':>4} {'TTFT p50':>8} {'p99':>6} {'wait p50':>8} {'p99':>6} "
             f"{'attain':>6}")  # fmt: skip


def tier_counts(table: dict, twins: dict, speed: float) -> str:
    """Per cell, policy and tier, three rows: what the client saw (`http`:
    sent, completed, refused 503 / 429, expired 504, errors (timeouts as
    `cut`), TTFT p50/p99, attainment), what the gateways counted over the
    whole run, warm-up included (`gw`: their outcomes, `cut` being those
    cancelled, and queue waits; in a fleet the wait in the shared queue) and
    what the simulator gives on the same requests (`sim`; `cut`: still
    running at its horizon), every time in the gateway's seconds."""
    lines = []
    runs = [(cell, seed, policy, report)
            for cell in sorted(table, key=sweep.Cell.sort_key)
            for seed, entry in table[cell].items()
            for policy, report in entry["policies"].items()]
    for cell, seed, policy, report in runs:
        totals = report["totals"]
        gateway = report.get("gateway", {})
        cpu = ", ".join(f"{name} {_s(used)}" for name, used in gateway.get("cpu_s", {}).items())
        lines.append(f"{cell} seed {seed} {policy}: {totals.get('sent')} sent over "
                     f"{_s(totals.get('wall_s'))} s; CPU s: client "
                     f"{_s(totals.get('client_cpu_s'))}, {cpu}")  # fmt: skip
        lines.append(TIER_HEAD)
        twin = twins[cell][seed]["policies"][policy]
        for tier, http in report["tiers"].items():
            kinds = dict(http.get("error_types") or {})
            cut = kinds.pop("timeout", 0)
            lines.append(
                f"  {tier:<11} {'http':>4} {http['requests']:>5} {http['completed']:>5} "
                f"{http['rejected_overload']:>4} {http['rejected_queue_full']:>4} "
                f"{http['expired']:>4} {cut:>4} {http['errors'] - cut:>4} "
                f"{_s(http['ttft_p50_s']):>8} {_s(http['ttft_p99_s']):>6} {'':>8} {'':>6} "
                f"{_a(http['ttft_slo_attainment']):>6}"
                + (f"  errors: {kinds}" if kinds else ""))  # fmt: skip
            counted = gateway.get("outcomes", {}).get(tier, {})
            wait = (gateway.get("fleet_queue_wait") or gateway.get("queue_wait", {})).get(tier, {})
            lines.append(
                f"  {'':<11} {'gw':>4} {sum(counted.values()):>5} "
                f"{counted.get('completed', 0):>5} {counted.get('rejected_overload', 0):>4} "
                f"{counted.get('rejected_queue_full', 0):>4} {counted.get('expired', 0):>4} "
                f"{counted.get('cancelled', 0):>4} {counted.get('backend_error', 0):>4} "
                f"{'':>8} {'':>6} {_s(wait.get('p50_s')):>8} {_s(wait.get('p99_s')):>6}")
            sim = twin["tiers"][tier]
            lines.append(
                f"  {'':<11} {'sim':>4} {sim['requests']:>5} {sim['completed']:>5} "
                f"{sim['rejected_overload']:>4} {sim['rejected_queue_full']:>4} "
                f"{sim['expired']:>4} {sim['cancelled']:>4} {sim['backend_error']:>4} "
                f"{_s(sim['ttft_p50_s'], speed):>8} {_s(sim['ttft_p99_s'], speed):>6} "
                f"{'-':>8} "
                f"{_s(sim['queue_wait_p99_s'], speed):>6} "
                f"{_a(sim['ttft_slo_attainment']):>6}")  # fmt: skip
    return "\n".join(lines)


def judge(table: dict, unseen: str = f"not evaluated over HTTP: {UNSEEN_RULE}") -> tuple[int, list]:
    """b3_sweep's rules on the table ({cell: {seed: entry}}): (exit status,
    checks), printing each failure, and each rule that cannot be evaluated on
    what was run (a subset of loads or policies) as an error: exit status 2
    then, with the other rules still judged."""
    errors: list[str] = []
    try:
        checks = sweep.evaluate(table, errors)
    except sweep.SweepError as exc:
        print(f"ERROR  {exc}")
        return 2, []
    failed = [c for c in checks if not c.passed]
    for check in failed:
        print(sweep.format_check(check))
    for error in errors:
        print(f"ERROR  {error}")
    print(unseen)
    print(f"{len(checks) - len(failed)} of {len(checks)} checks pass, {len(failed)} FAIL"
          + (f", {len(errors)} not evaluated" if errors else ""))
    return (2 if errors else 1 if failed else 0), checks


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--loads", help="comma-separated multiples of capacity (default 1,2,4)")
    parser.add_argument("--policies", help=f"comma-separated subset of "
                        f"{', '.join(sweep.POLICIES)}")  # fmt: skip
    parser.add_argument("--speed", type=float, default=SPEED,
                        help=f"sim speed factor of the engine (default {SPEED:g})")
    parser.add_argument("--duration", type=float, default=DURATION_S,
                        help=f"seconds of arrivals per run, in the modelled GPU's time "
                        f"(default {DURATION_S:g}; the run takes duration / speed)")
    parser.add_argument("--warmup", type=float, default=WARMUP_S,
                        help=f"modelled seconds left out of the metrics (default {WARMUP_S:g})")
    parser.add_argument("--timeout", type=float, default=TIMEOUT_S,
                        help=f"modelled seconds a client waits for one request (default "
                        f"{TIMEOUT_S:g}); a request still unanswered then is an error")
    parser.add_argument("--mix", choices=sweep.MIXES, default=MIX,
                        help=f"b3_sweep's class mix (default {MIX}; long: 8k-token prompts "
                        "beside short chat)")
    parser.add_argument("--fleet", action="store_true",
                        help="run each cell on a fleet: a redis-server, --gateways replicas "
                        "and --engines engine nodes, the load unit being all the engines")
    parser.add_argument("--gateways", type=int, default=3, help="fleet: gateway replicas")
    parser.add_argument("--engines", type=int, default=2, help="fleet: engine nodes")
    parser.add_argument("--override", type=json.loads, default={},
                        help="JSON object merged into every served policy, e.g. "
                        "'{\"tiers\": {\"batch\": {\"min_share\": 0}}}' (an experiment, "
                        "not B3: the report is not comparable with RESULTS.md's); "
                        "tiers, tenants and scheduler in the modelled GPU's time, and the "
                        "simulator twin runs with them too")
    parser.add_argument("--engine", type=json.loads, default={},
                        help="JSON object merged into B3's simulated engine for the gateway "
                        "and the twin, e.g. '{\"scheduling_policy\": \"fcfs\"}' or "
                        "'{\"max_num_seqs\": 64}' (not B3: the load unit is that engine's)")
    parser.add_argument("--seeds", type=sweep._positive, default=1,
                        help="arrival seeds per cell, from --seed on (default 1); on several, "
                        "qos against strict is judged by the paired difference over them")
    parser.add_argument("--seed", type=int,
                        help="the first arrival seed (default: B3's); with --seeds N, "
                        "this one and the next N - 1")
    parser.add_argument("--twin-only", action="store_true",
                        help="the simulator twin alone on the same requests, judged by the "
                        "same rules: no gateway is started")
    parser.add_argument("--json", dest="json_path", help="write the per-cell figures and checks")
    args = parser.parse_args(argv)
    try:
        loads = sweep._pick(args.loads, LOADS, float)
        policies = sweep._pick(args.policies, sweep.POLICIES)
    except sweep.SweepError as exc:
        print(f"b3_http: {exc}", file=sys.stderr)
        return 2
    try:
        base = with_modelled_override(load_scenario(sweep.SCENARIO), args.override)
    except ValueError as exc:
        print(f"b3_http: --override: {exc}", file=sys.stderr)
        return 2
    try:
        base = b3_scenario(args.override, args.seed, args.engine)
    except ValueError as exc:
        print(f"b3_http: --engine: {exc}", file=sys.stderr)
        return 2
    try:
        table, twins, capacity = run_table(base, loads, policies, args)
    except (sweep.SweepError, RuntimeError) as exc:
        print(f"ERROR  {exc}")
        return 2
    print(f"engine capacity on the {args.mix} mix at speed {args.speed:g}: "
          f"{capacity:.2f} req/s; "
          f"load average {os.getloadavg()[0]:.2f}")
    if args.twin_only:
        twin_rows = sweep.summarise(twins)
        print("the simulator on the requests the bench would send (no gateway run):")
        print(sweep.format_rows(twin_rows))
        print()
        status, checks = judge(twins, f"not evaluated, as over HTTP: {UNSEEN_RULE}")
        if args.json_path:
            write_json(args, base, capacity, {"simulator_cells": twin_rows}, twins, checks)
        return status
    print(tier_counts(table, twins, args.speed))
    print()
    rows = sweep.summarise(table)
    twin_rows = sweep.summarise(twins)
    print(sweep.format_rows(rows))
    print()
    print("the simulator on the same requests:")
    print(sweep.format_rows(twin_rows))
    print()
    status, checks = judge(table)
    if args.json_path:
        write_json(args, base, capacity, {"cells": rows, "simulator_cells": twin_rows},
                   table, checks)
    return status


def write_json(args: argparse.Namespace, base: Scenario, capacity: float, rows: dict,
               table: dict, checks: list) -> None:  # fmt: skip
    """The per-cell figures (`rows`), each run's reports in `table` and the
    checks, with the settings they were measured under."""
    payload = {"mix": args.mix, "speed": args.speed, "duration_s": args.duration,
               "warmup_s": args.warmup, "timeout_s": args.timeout,
               "fleet": args.fleet and {"gateways": args.gateways, "engines": args.engines},
               "twin_only": args.twin_only,
               "override": args.override, "capacity_rps": capacity,
               "load_average": os.getloadavg(), **rows,
               "seeds": list(range(base.seed, base.seed + args.seeds)),
               "runs": {f"{cell} seed {seed}": {
                   policy: {key: report.get(key) for key in ("tiers", "totals", "gateway")}
                   for policy, report in entry["policies"].items()}
                   for cell, runs in table.items() for seed, entry in runs.items()},
               "checks": [{"cell": str(c.cell), "rule": c.rule, "value": c.value,
                           "threshold": c.threshold, "passed": c.passed} for c in checks]}
    Path(args.json_path).write_text(json.dumps(payload, indent=1))
    print(f"wrote {args.json_path}")


if __name__ == "__main__":
    sys.exit(main())
