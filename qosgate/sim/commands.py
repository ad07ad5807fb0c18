"""`qosgate simulate`: run a scenario under each policy on the same arrivals."""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path
from typing import Any

import yaml

from qosgate.config.loader import ConfigError, load_model
from qosgate.sim.report import build_policy_report, format_table, plot_run
from qosgate.sim.runner import measure_capacity, run_policy, stderr_progress, with_policy
from qosgate.sim.scenario import Scenario, evaluate_targets, load_scenario
from qosgate.sim.workload import TraceError, capacity_workload, generate_arrivals

_POLICIES = ("fcfs", "strict", "qos")
_CAPACITY_SAMPLE = 2000


def _scenario_kind(path: str) -> str | None:
    try:
        with open(path, encoding="utf-8") as fh:
            data = yaml.safe_load(fh)
    except (OSError, yaml.YAMLError):
        return None  # the real loader reports it with its line
    return data.get("kind") if isinstance(data, dict) else None


def simulate_command(args: argparse.Namespace) -> int:
    if _scenario_kind(args.scenario) == "seed_tables":
        return _seed_tables(args)
    try:
        scenario = load_scenario(args.scenario)
    except ConfigError as exc:
        print(f"qosgate simulate: {args.scenario} is not a valid scenario:\n{exc}", file=sys.stderr)
        return 2
    policies = tuple(scenario.policies)
    if args.policies:
        policies = tuple(p.strip() for p in args.policies.split(",") if p.strip())
        unknown = [p for p in policies if p not in _POLICIES]
        if unknown or not policies:
            print(f"qosgate simulate: --policies: unknown {unknown} (known: {', '.join(_POLICIES)})",
                  file=sys.stderr)
            return 2
    loads = args.load or [scenario.arrivals.load]
    seed = scenario.seed if args.seed is None else args.seed
    results = []
    all_passed = True
    try:
        simulation = Simulation(scenario, seed=seed, quiet=args.quiet)
        for load in loads:
            result, series = simulation.run(load, policies)
            print(format_table(result))
            all_passed &= all(t["passed"] for t in result.get("targets", []))
            results.append((result, series))
    except TraceError as exc:
        print(f"qosgate simulate: {exc}", file=sys.stderr)
        return 2

    if args.json_path:
        payload = results[0][0] if len(results) == 1 else {
            "scenario": scenario.name, "runs": [r for r, _ in results]}
        Path(args.json_path).write_text(json.dumps(payload, indent=2))
        print(f"wrote {args.json_path}")
    if args.plot_path:
        for result, series in results:
            path = Path(args.plot_path)
            if len(results) > 1:
                path = path.with_name(f"{path.stem}-load{result['load']}{path.suffix}")
            plot_run(result, series, path)
            print(f"wrote {path}")
    return 0 if all_passed else 1


class Simulation:
    """One scenario's runs, sharing the capacity measurement and reusing runs a
    reference comparison asks for again."""

    def __init__(self, scenario: Scenario, *, seed: int, quiet: bool = False) -> None:
        self.scenario = scenario
        self.seed = seed
        self.quiet = quiet
        self._runs: dict[tuple[float | None, str], tuple[dict, dict]] = {}
        sample = capacity_workload(scenario, scenario.policy, _CAPACITY_SAMPLE, seed)
        self.capacity_rps, self.capacity_tokens_per_s = measure_capacity(scenario.engine, sample)
        self._log(f"{scenario.name}: engine capacity {self.capacity_rps:.2f} req/s, "
                  f"{self.capacity_tokens_per_s:,.0f} tokens/s with this length mix")

    def _log(self, message: str) -> None:
        if not self.quiet:
            print(message, file=sys.stderr, flush=True)

    def rate_for(self, load: float | None) -> float | None:
        arrivals = self.scenario.arrivals
        if load is None:
            return arrivals.rate_rps
        return load * (arrivals.capacity_rps or self.capacity_rps)

    def run(self, load: float | None, policies: tuple[str, ...]) -> tuple[dict, dict]:
        scenario = self.scenario
        rate = self.rate_for(load)
        result: dict[str, Any] = {
            "scenario": scenario.name,
            "load": load,
            "rate_rps": rate,
            "capacity_rps": self.capacity_rps,
            "capacity_tokens_per_s": self.capacity_tokens_per_s,
            "seed": self.seed,
            "policies": {},
        }
        series: dict[str, dict] = {}
        for name in policies:
            report, one_series = self._run_one(load, name)
            result["policies"][name] = report
            series[name] = one_series
        if scenario.reference_load is not None:
            reference: dict[str, Any] = {"load": scenario.reference_load, "policies": {}}
            for name in scenario.reference_policies:
                report, _ = self._run_one(scenario.reference_load, name)
                reference["policies"][name] = report
            result["reference"] = reference
        result["targets"] = evaluate_targets(scenario.targets, result)
        return result, series

    def _run_one(self, load: float | None, name: str) -> tuple[dict, dict]:
        key = (load, name)
        if key in self._runs:
            return self._runs[key]
        scenario = self.scenario
        policy = with_policy(scenario.policy, name)
        arrivals = generate_arrivals(scenario, scenario.policy, self.rate_for(load), self.seed)
        label = f"{name} @ load {load}" if load is not None else name
        started = time.process_time()
        run = run_policy(
            policy, scenario.engine, arrivals,
            drain_until=scenario.duration_s + scenario.drain_s,
            drain_rate_hint=self.capacity_tokens_per_s,
            progress=None if self.quiet else stderr_progress(label),
        )
        cpu = time.process_time() - started
        report = build_policy_report(
            run.requests, policy, window=(scenario.warmup_s, scenario.duration_s),
            metrics=scenario.metrics, samples=run.samples,
        )
        sizes = run.batch_sizes
        report["engine"] = {
            "steps": run.steps,
            "busy_s": run.engine_busy_s,
            "utilisation": run.engine_busy_s / run.end_time if run.end_time else 0.0,
            "saturated_s": run.engine_saturated_s,
            "engine_preemptions": run.engine_preemptions,
            "gateway_preemptions": run.gateway_preemptions,
            "batches": len(sizes),
            "batch_size_mean": sum(sizes) / len(sizes) if sizes else 0.0,
            "simulated_s": run.end_time,
            "cpu_s": cpu,
        }
        self._log(f"  {label}: {len(arrivals)} requests, {run.end_time:,.0f} simulated s "
                  f"in {cpu:.1f} CPU s")
        one_series = {
            "queue_depth": run.samples,
            "ttft": [(r.arrival, r.tier, r.ttft) for r in run.requests if r.ttft is not None],
        }
        self._runs[key] = (report, one_series)
        return report, one_series


def _seed_tables(args: argparse.Namespace) -> int:
    from qosgate.sim.seed_tables import SeedTablesSpec, format_seed_tables, run_seed_tables

    try:
        spec = load_model(SeedTablesSpec, Path(args.scenario))
    except ConfigError as exc:
        print(f"qosgate simulate: {args.scenario} is not a valid scenario:\n{exc}", file=sys.stderr)
        return 2
    result = run_seed_tables(spec)
    print(format_seed_tables(result))
    if args.json_path:
        Path(args.json_path).write_text(json.dumps(result, indent=2))
        print(f"wrote {args.json_path}")
    passed = all(p["all_within_10pct"] for p in result["profiles"].values())
    return 0 if passed else 1
