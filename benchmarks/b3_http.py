"""B3 sweep through the real HTTP gateway: the 1x, 2x and 4x Poisson cells of
benchmarks/b3_sweep.py, sent by `qosgate bench` to a `qosgate serve` process
on the live simulated GPU, judged by the sweep's own rules.

    .venv/bin/python benchmarks/b3_http.py [--loads 1,2,4] [--policies qos,strict,fcfs]
        [--speed 0.1] [--duration 60] [--json PATH]

Each cell and policy starts its own gateway (tests/fleet_support.py's Proc)
with B3's policy, engine and tenants (benchmarks/b3_overload.yaml) and the
scheduler policy set to the one under test, the engine slowed down by --speed
so that it, not this machine's cores, is the bottleneck. The load unit is the
engine's capacity on the B3 mix as the simulator measures it for the profile,
times --speed. `qosgate bench` then sends open-loop Poisson arrivals of B3's
class mix at load x that rate, each tenant with its own key, and the tiers'
SLOs judge the answers.

The rules are b3_sweep's `evaluate`, on the bench reports. One rule is out of
reach of a client: the tiers' longest served queue wait against their stated
bound (the client sees TTFT, not the gateway's queue), so it is not evaluated
here and the output says so.

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
import time
from pathlib import Path
from typing import Any

import yaml

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent
sys.path[:0] = [str(ROOT), str(HERE)]

import b3_sweep as sweep  # noqa: E402
from tests.fleet_support import Proc, environ  # noqa: E402

from qosgate.sim.commands import Simulation  # noqa: E402
from qosgate.sim.scenario import Scenario, load_scenario  # noqa: E402

LOADS = (1.0, 2.0, 4.0)
ARRIVALS = "poisson"
MIX = "b3"
UNSEEN_RULE = "tiers' max served queue wait within their stated bound (gateway-side figure)"


def tenant_key(tenant: str) -> str:
    return f"b3-http-{tenant}"


def dilated(node: Any, speed: float) -> Any:
    """`node` with every duration in milliseconds (a key ending in _ms) divided
    by `speed`: on an engine `speed` times as fast as the modelled GPU, the
    SLOs, queue budgets and ageing of the policy keep their meaning."""
    if isinstance(node, dict):
        return {key: value / speed if key.endswith("_ms") and isinstance(value, (int, float))
                else dilated(value, speed) for key, value in node.items()}  # fmt: skip
    return node


def serve_policy(base: Scenario, policy: str, speed: float) -> dict[str, Any]:
    """B3's policy file as `qosgate serve` reads it: its tiers, tenants (each
    with its key) and scheduler, with `policy` as scheduler.policy, on B3's
    engine slowed to `speed` and its durations stretched to match."""
    doc = base.policy.model_dump(mode="json", exclude_unset=True)
    doc["tiers"] = dilated(doc["tiers"], speed)
    doc["scheduler"] = {**dilated(doc.get("scheduler", {}), speed), "policy": policy}
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
                   seed: int) -> dict[str, Any]:  # fmt: skip
    """B3's class mix and lengths as a `qosgate bench` open-loop scenario, its
    tiers' SLOs stretched as the gateway's are (`dilated`)."""
    tiers = {tenant.id: tenant.tier for tenant in base.policy.tenants}
    slos = {name: {"ttft_slo_ms": tier.ttft_slo_ms, "e2e_slo_ms": tier.e2e_slo_ms}
            for name, tier in base.policy.tiers.items()}  # fmt: skip
    return {
        "kind": "bench", "name": "b3-http", "mode": "open", "model": base.engine.model,
        "endpoint": "chat", "stream": True, "seed": seed, "timeout_s": args.timeout,
        "duration_s": args.duration, "warmup_s": args.warmup,
        "arrivals": {"process": "poisson", "rate_rps": round(rate_rps, 4)},
        "lengths": base.lengths.model_dump(mode="json"),
        "classes": [{"name": c.tenant, "tier": tiers[c.tenant], "api_key": tenant_key(c.tenant),
                     "share": c.effective_share} for c in base.classes],
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


def run_cell(base: Scenario, policy: str, rate_rps: float, args: argparse.Namespace,
             tmp: Path, seed: int) -> dict[str, Any]:  # fmt: skip
    name = f"{policy}-{rate_rps:.3f}"
    config = tmp / f"{name}-policy.yaml"
    config.write_text(yaml.safe_dump(serve_policy(base, policy, args.speed)))
    gateway = Proc(config, name, tmp, None)
    try:
        return run_bench(gateway.url, bench_scenario(base, rate_rps, args, seed), tmp, name)
    except sweep.SweepError:
        print(gateway.tail(), file=sys.stderr)
        raise
    finally:
        gateway.stop()


def run_table(base: Scenario, loads: tuple[float, ...], policies: tuple[str, ...],
              args: argparse.Namespace) -> tuple[dict, float]:  # fmt: skip
    """{Cell: entry} in b3_sweep's shape, and the capacity (requests/s) the loads multiply."""
    scenario = sweep.cell_scenario(base, MIX, ARRIVALS)
    capacity = Simulation(scenario, seed=base.seed, quiet=True).capacity_rps * args.speed
    # Interactive demand is a ratio of rates on one engine: the speed factor cancels.
    own = sweep.interactive_capacity_rps(scenario, base.seed) * args.speed
    share = sweep.interactive_share(scenario)
    table: dict = {}
    with tempfile.TemporaryDirectory(prefix="qosgate-b3-http-") as tmp_name:
        tmp = Path(tmp_name)
        for load in loads:
            rate = load * capacity
            cell = sweep.Cell(MIX, ARRIVALS, load)
            runs = {}
            for policy in policies:
                began = time.monotonic()
                runs[policy] = run_cell(base, policy, rate, args, tmp, base.seed)
                print(f"  {cell} {policy}: {rate:.2f} req/s offered, "
                      f"{time.monotonic() - began:.0f} s, load average "
                      f"{os.getloadavg()[0]:.2f}", file=sys.stderr, flush=True)  # fmt: skip
            # The client cannot see queue waits: no stated bound is judged here (UNSEEN_RULE).
            table[cell] = {"capacity_rps": capacity, "rate_rps": rate,
                           "interactive_demand": rate * share / own, "bounds": {},
                           "policies": runs}  # fmt: skip
    return table, capacity


def judge(table: dict) -> tuple[int, list]:
    """b3_sweep's rules on the table: (exit status, checks), printing each failure."""
    try:
        checks = sweep.evaluate(table)
    except sweep.SweepError as exc:
        print(f"ERROR  {exc}")
        return 2, []
    failed = [c for c in checks if not c.passed]
    for check in failed:
        print(sweep.format_check(check))
    print(f"not evaluated over HTTP: {UNSEEN_RULE}")
    print(f"{len(checks) - len(failed)} of {len(checks)} checks pass, {len(failed)} FAIL")
    return (1 if failed else 0), checks


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--loads", help="comma-separated multiples of capacity (default 1,2,4)")
    parser.add_argument("--policies", help=f"comma-separated subset of "
                        f"{', '.join(sweep.POLICIES)}")  # fmt: skip
    parser.add_argument("--speed", type=float, default=0.1,
                        help="sim speed factor of the engine (default 0.1)")
    parser.add_argument("--duration", type=float, default=45.0, help="seconds of arrivals per run")
    parser.add_argument("--warmup", type=float, default=5.0, help="seconds left out of the metrics")
    parser.add_argument("--timeout", type=float, default=45.0,
                        help="seconds the client waits for one request (default 45): a batch "
                        "request still queued then counts as an error, and the run ends")
    parser.add_argument("--json", dest="json_path", help="write the per-cell figures and checks")
    args = parser.parse_args(argv)
    try:
        loads = sweep._pick(args.loads, LOADS, float)
        policies = sweep._pick(args.policies, sweep.POLICIES)
    except sweep.SweepError as exc:
        print(f"b3_http: {exc}", file=sys.stderr)
        return 2
    base = load_scenario(sweep.SCENARIO)
    try:
        table, capacity = run_table(base, loads, policies, args)
    except (sweep.SweepError, RuntimeError) as exc:
        print(f"ERROR  {exc}")
        return 2
    print(f"engine capacity on the B3 mix at speed {args.speed:g}: {capacity:.2f} req/s; "
          f"load average {os.getloadavg()[0]:.2f}")
    rows = sweep.summarise(table)
    print(sweep.format_rows(rows))
    print()
    status, checks = judge(table)
    if args.json_path:
        payload = {"speed": args.speed, "duration_s": args.duration, "warmup_s": args.warmup,
                   "capacity_rps": capacity, "cells": rows,
                   "checks": [{"cell": str(c.cell), "rule": c.rule, "value": c.value,
                               "threshold": c.threshold, "passed": c.passed} for c in checks]}
        Path(args.json_path).write_text(json.dumps(payload, indent=1))
        print(f"wrote {args.json_path}")
    return status


if __name__ == "__main__":
    sys.exit(main())
