"""B3 sweep: tier SLOs across loads, arrival burstiness and length mixes, with
pass rules that can fail.

    .venv/bin/python benchmarks/b3_sweep.py [--loads 1,2,4] [--arrivals poisson]
        [--mix b3] [--policies qos,strict,fcfs] [--prefill-budget TOKENS] [--json PATH]

Every cell (mix x arrivals x load) runs each policy on the same arrivals through
the simulator's own API (qosgate.sim.commands.Simulation). The B3 scenario file
gives the policy, the engine and the b3 mix; the `long` mix keeps its policy and
tenants but gives docs-qa and the batch tenants 8k-token prompts beside short
chat. Each cell is DURATION_S simulated seconds of arrivals (the acceptance run
of B3 is 600 s): short enough for the 144 runs of the whole sweep to finish in
about 10 minutes on one core.

Exit status: 0 when every rule passes, 1 when a rule fails (each printed as
FAIL with its cell and figures), 2 when a rule cannot be evaluated (a policy
that was not run, a ratio whose denominator is zero or missing, such as no
1.0x baseline in the selection): an error, never a pass.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Iterable

from qosgate.sim.commands import Simulation
from qosgate.sim.report import build_policy_report
from qosgate.sim.runner import measure_capacity, run_policy, with_policy
from qosgate.sim.scenario import (
    ArrivalsConfig,
    LengthDist,
    LengthsOverride,
    Scenario,
    load_scenario,
)
from qosgate.sim.workload import capacity_workload, generate_arrivals

HERE = Path(__file__).resolve().parent
SCENARIO = HERE / "b3_overload.yaml"

LOADS = (0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0, 10.0)
ARRIVALS = {"poisson": ("poisson", 1.0), "gamma2": ("gamma", 2.0), "gamma4": ("gamma", 4.0)}
MIXES = ("b3", "long")
POLICIES = ("qos", "strict", "fcfs")
TIERS = ("interactive", "standard", "batch")

DURATION_S = 600.0
WARMUP_S = 60.0
DRAIN_S = 120.0

# The pass rules.
BASELINE_LOAD = 1.0
INTERACTIVE_DEMAND_LIMIT = 0.8
INTERACTIVE_FLOOR = {"poisson": 0.99, "gamma2": 0.99, "gamma4": 0.95}
GOODPUT_FLOOR = 0.9
THROUGHPUT_FLOOR = 0.98

_SHORT_CHAT = LengthsOverride(
    prompt=LengthDist(median=300, sigma=0.8, min=4, max=2048),
    output=LengthDist(median=150, sigma=0.9, min=1, max=1024),
)
_LONG_PROMPT = LengthsOverride(
    prompt=LengthDist(median=8000, sigma=0.05, min=7000, max=8192),
    output=LengthDist(median=200, sigma=0.9, min=1, max=1024),
)
LONG_PROMPT_TENANTS = frozenset({"docs-qa", "nightly-eval", "bulk-summarise"})


def _rank(known: tuple[str, ...], name: str) -> int:
    return known.index(name) if name in known else len(known)


class SweepError(Exception):
    """A rule that cannot be evaluated on the figures at hand."""


@dataclass(frozen=True)
class Cell:
    mix: str
    arrivals: str
    load: float

    def sort_key(self) -> tuple:
        """The order of the command line's defaults: mix, then arrivals, then load."""
        return (_rank(MIXES, self.mix), _rank(tuple(ARRIVALS), self.arrivals), self.load)

    def __str__(self) -> str:
        return f"mix={self.mix} arrivals={self.arrivals} load={self.load:g}x"


def cell_scenario(base: Scenario, mix: str, arrivals: str) -> Scenario:
    """The B3 scenario with one mix and arrival process, shortened for the sweep."""
    process, cv = ARRIVALS[arrivals]
    classes = base.classes
    if mix == "long":
        classes = tuple(
            cls_.model_copy(update={
                "lengths": _LONG_PROMPT if cls_.tenant in LONG_PROMPT_TENANTS else _SHORT_CHAT})
            for cls_ in base.classes
        )
    data = base.model_dump()
    data.update(
        duration_s=DURATION_S, warmup_s=WARMUP_S, drain_s=DRAIN_S, targets=(),
        reference_load=None, policies=POLICIES, classes=[c.model_dump() for c in classes],
        arrivals=ArrivalsConfig(process=process, burstiness=cv, load=1.0).model_dump(),
    )
    return Scenario.model_validate(data)


def interactive_capacity_rps(scenario: Scenario, seed: int) -> float:
    """Requests/s the engine sustains on interactive's own lengths, the unit of its demand."""
    tiers = {tenant.id: tenant.tier for tenant in scenario.policy.tenants}
    only = scenario.model_copy(update={
        "classes": tuple(c for c in scenario.classes if tiers[c.tenant] == "interactive")})
    sample = capacity_workload(only, only.policy, 2000, seed)
    return measure_capacity(only.engine, sample)[0]


def interactive_alone(sim: Simulation, load: float, seed: int) -> float | None:
    """Interactive's TTFT attainment under qos with the engine to itself: the
    cell's own interactive arrivals (the same times and lengths; each class
    draws from its own streams) and nothing else. No order of the other tiers'
    work can do better than this, so a floor it misses is out of any
    gateway's reach in that cell; the figure is printed beside the rule, which
    stays as it is."""
    scenario = sim.scenario
    arrivals = [a for a in generate_arrivals(scenario, scenario.policy, sim.rate_for(load), seed)
                if a.tier == "interactive"]
    policy = with_policy(scenario.policy, "qos")
    run = run_policy(policy, scenario.engine, arrivals,
                     drain_until=scenario.duration_s + scenario.drain_s,
                     drain_rate_hint=sim.capacity_tokens_per_s)
    report = build_policy_report(run.requests, policy,
                                 window=(scenario.warmup_s, scenario.duration_s),
                                 metrics=scenario.metrics, samples=run.samples)
    return report["tiers"]["interactive"]["ttft_slo_attainment"]


def stated_bounds(scenario: Scenario) -> dict[str, float | None]:
    """Tier -> the longest queue wait the policy lets a served request have
    (docs/SCHEDULING.md, "The bounds"): the expiry of reject and delay tiers."""
    return {name: None if tier.expiry_ms is None else tier.expiry_ms / 1000.0
            for name, tier in scenario.policy.tiers.items()}


def interactive_share(scenario: Scenario) -> float:
    tiers = {tenant.id: tenant.tier for tenant in scenario.policy.tenants}
    total = sum(c.effective_share for c in scenario.classes)
    return sum(c.effective_share for c in scenario.classes
               if tiers[c.tenant] == "interactive") / total


def run_sweep(
    base: Scenario, mixes: Iterable[str], arrivals: Iterable[str], loads: Iterable[float],
    policies: tuple[str, ...], seed: int,
) -> dict[Cell, dict]:
    """{cell: {"interactive_demand": x capacity, "rate_rps", "policies": {name: report}}}."""
    table: dict[Cell, dict] = {}
    for mix in mixes:
        for arr in arrivals:
            scenario = cell_scenario(base, mix, arr)
            sim = Simulation(scenario, seed=seed, quiet=True)
            own_capacity = interactive_capacity_rps(scenario, seed)
            share = interactive_share(scenario)
            for load in loads:
                started = time.process_time()
                result, _ = sim.run(load, policies)
                cell = Cell(mix, arr, load)
                table[cell] = {
                    "capacity_rps": sim.capacity_rps,
                    "rate_rps": result["rate_rps"],
                    "interactive_demand": result["rate_rps"] * share / own_capacity,
                    "interactive_alone": interactive_alone(sim, load, seed),
                    "bounds": stated_bounds(scenario),
                    "policies": result["policies"],
                }
                print(f"  {cell}: {time.process_time() - started:.1f} CPU s",
                      file=sys.stderr, flush=True)
    return table


# -- figures and rules --------------------------------------------------------------------


def merged(doc: dict[str, Any], override: dict[str, Any]) -> dict[str, Any]:
    """`doc` with `override` merged in, key by key into nested objects: an
    experiment on one setting of the policy (`--override`)."""
    out = dict(doc)
    for key, value in override.items():
        out[key] = merged(out.get(key) or {}, value) if isinstance(value, dict) else value
    return out


def figure(table: dict[Cell, dict], cell: Cell, policy: str, *path: str) -> float:
    """One number of one policy's report in one cell; SweepError when it is not there."""
    if cell not in table:
        raise SweepError(f"{cell} was not run, and a rule needs it "
                         "(select it with --loads/--arrivals/--mix)")
    runs = table[cell]["policies"]
    if policy not in runs:
        raise SweepError(f"{cell}: a rule needs policy {policy!r}, which was not run "
                         f"(run: {', '.join(runs) or 'none'})")
    node: Any = runs[policy]
    for key in path:
        node = node.get(key) if isinstance(node, dict) else None
    if isinstance(node, bool) or not isinstance(node, (int, float)):
        raise SweepError(f"{cell}: {policy} {'.'.join(path)} is missing ({node!r})")
    return float(node)


def ratio(num: float, den: float, what: str) -> float:
    if den == 0:
        raise SweepError(f"{what}: the denominator is 0, so the ratio is undefined")
    return num / den


def _attainment(table, cell, policy, tier) -> float:
    return figure(table, cell, policy, "tiers", tier, "ttft_slo_attainment")


@dataclass(frozen=True)
class Check:
    cell: Cell
    rule: str
    value: float
    threshold: float
    op: str = ">="

    @property
    def passed(self) -> bool:
        if self.op == "<=":
            return self.value <= self.threshold
        return self.value >= self.threshold if self.op == ">=" else self.value == self.threshold


def evaluate(table: dict[Cell, dict]) -> list[Check]:
    """Every rule in every cell of the table; SweepError when one cannot be evaluated."""
    checks: list[Check] = []
    for cell in sorted(table, key=Cell.sort_key):
        entry = table[cell]
        qos_int = _attainment(table, cell, "qos", "interactive")
        if entry["interactive_demand"] <= INTERACTIVE_DEMAND_LIMIT:
            alone = entry.get("interactive_alone")
            checks.append(Check(cell, "interactive attainment (qos), interactive demand "
                                f"{entry['interactive_demand']:.2f}x capacity, alone on the "
                                f"engine {_f(alone)}",
                                qos_int, INTERACTIVE_FLOOR[cell.arrivals]))
        for tier in ("interactive", "standard"):
            checks.append(Check(cell, f"{tier} attainment qos >= strict",
                                _attainment(table, cell, "qos", tier),
                                _attainment(table, cell, "strict", tier)))
        goodput = figure(table, cell, "qos", "totals", "goodput_rps")
        if cell.load >= BASELINE_LOAD:
            base = Cell(cell.mix, cell.arrivals, BASELINE_LOAD)
            if base not in table:
                raise SweepError(
                    f"{cell}: qos goodput is compared with qos at {BASELINE_LOAD:g}x, "
                    f"which is not in the selection (add {BASELINE_LOAD:g} to --loads)")
            den = figure(table, base, "qos", "totals", "goodput_rps")
            checks.append(Check(cell, f"qos goodput / qos goodput at {BASELINE_LOAD:g}x",
                                ratio(goodput, den, f"{cell}: qos goodput at {BASELINE_LOAD:g}x"),
                                GOODPUT_FLOOR))
        thr_q = figure(table, cell, "qos", "totals", "throughput_tokens_per_s")
        thr_f = figure(table, cell, "fcfs", "totals", "throughput_tokens_per_s")
        checks.append(Check(cell, "qos throughput / fcfs throughput",
                            ratio(thr_q, thr_f, f"{cell}: fcfs throughput"), THROUGHPUT_FLOOR))
        if "bounds" not in entry:
            raise SweepError(f"{cell}: the tiers' stated bounds are missing")
        for tier, bound in entry["bounds"].items():
            if bound is None:
                continue
            try:
                waited = figure(table, cell, "qos", "tiers", tier, "served_wait_max_s")
            except SweepError:
                continue  # the tier served nothing in this cell: nothing waited
            checks.append(Check(cell, f"{tier} max served wait (qos) within its stated bound",
                                waited, bound, "<="))
        for policy in POLICIES:
            checks.append(Check(cell, f"requests lost ({policy})",
                                figure(table, cell, policy, "totals", "lost"), 0.0, "=="))
    return checks


# -- text -----------------------------------------------------------------------------------


def _f(value: float | None, spec: str = ".3f") -> str:
    return "-" if value is None else format(value, spec)


def _maybe(table, cell, policy, *path) -> float | None:
    try:
        return figure(table, cell, policy, *path)
    except SweepError:
        return None


def _div(num: float | None, den: float | None) -> float | None:
    return None if num is None or not den else num / den


def summarise(table: dict[Cell, dict]) -> list[dict]:
    """The figures printed per cell (and written by --json)."""
    rows = []
    for cell in sorted(table, key=Cell.sort_key):
        att = {(p, t): _maybe(table, cell, p, "tiers", t, "ttft_slo_attainment")
               for p in POLICIES for t in ("interactive", "standard")}
        base = Cell(cell.mix, cell.arrivals, BASELINE_LOAD)
        goodput = _maybe(table, cell, "qos", "totals", "goodput_rps")
        rows.append({
            "mix": cell.mix, "arrivals": cell.arrivals, "load": cell.load,
            "rate_rps": table[cell]["rate_rps"],
            "interactive_demand": table[cell]["interactive_demand"],
            "interactive_alone": table[cell].get("interactive_alone"),
            "attainment": {p: {t: att[p, t] for t in ("interactive", "standard")}
                           for p in POLICIES},
            "qos_over_strict": {t: _div(att["qos", t], att["strict", t])
                                for t in ("interactive", "standard")},
            "qos_goodput_rps": goodput,
            "qos_goodput_over_baseline": _div(
                goodput, _maybe(table, base, "qos", "totals", "goodput_rps")),
            "qos_throughput_over_fcfs": _div(
                _maybe(table, cell, "qos", "totals", "throughput_tokens_per_s"),
                _maybe(table, cell, "fcfs", "totals", "throughput_tokens_per_s")),
            "served_wait_max_s": {p: {t: _maybe(table, cell, p, "tiers", t, "served_wait_max_s")
                                      for t in TIERS} for p in POLICIES},
            "lost": {p: _maybe(table, cell, p, "totals", "lost") for p in POLICIES},
        })
    return rows


def format_rows(rows: list[dict]) -> str:
    head = (f"{'mix':<5} {'arrivals':<8} {'load':>5} {'i.dem':>5} | "
            f"{'interactive q/s/f':>17} {'q/s':>5} {'alone':>5} | {'standard q/s/f':>17} {'q/s':>5} | "
            f"{'gp/1x':>5} {'thr/f':>5} | {'qos max served wait i/s/b (s)':>27} | lost q/s/f")
    lines = [head, "-" * len(head)]
    for r in rows:
        a, qs, waits = r["attainment"], r["qos_over_strict"], r["served_wait_max_s"]["qos"]
        lost = r["lost"]
        lines.append(
            f"{r['mix']:<5} {r['arrivals']:<8} {r['load']:>5g} {r['interactive_demand']:>5.2f} | "
            + " ".join(f"{_f(a[p]['interactive'], '.3f'):>5}" for p in POLICIES)
            + f" {_f(qs['interactive'], '.2f'):>5} {_f(r['interactive_alone'], '.3f'):>5} | "
            + " ".join(f"{_f(a[p]['standard'], '.3f'):>5}" for p in POLICIES)
            + f" {_f(qs['standard'], '.2f'):>5} | "
            f"{_f(r['qos_goodput_over_baseline'], '.2f'):>5} "
            f"{_f(r['qos_throughput_over_fcfs'], '.2f'):>5} | "
            + " ".join(f"{_f(waits[t], '.1f'):>8}" for t in TIERS) + " | "
            + "/".join(_f(lost[p], '.0f') for p in POLICIES)
        )
    return "\n".join(lines)


def format_check(check: Check) -> str:
    verdict = "PASS" if check.passed else "FAIL"
    return (f"{verdict}  {check.cell}: {check.rule}: "
            f"{check.value:.3f} {check.op} {check.threshold:.3f}")


# -- command line ---------------------------------------------------------------------------


def _pick(text: str | None, known: Iterable, parse=str) -> tuple:
    known = tuple(known)
    if text is None:
        return known
    picked = tuple(parse(part.strip()) for part in text.split(",") if part.strip())
    unknown = [p for p in picked if p not in known]
    if unknown or not picked:
        raise SweepError(f"unknown {unknown} (known: {', '.join(map(str, known))})")
    return picked


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--loads", help="comma-separated multiples of capacity "
                        f"(default: {','.join(f'{x:g}' for x in LOADS)})")
    parser.add_argument("--arrivals", help=f"comma-separated subset of {', '.join(ARRIVALS)}")
    parser.add_argument("--mix", help=f"comma-separated subset of {', '.join(MIXES)}")
    parser.add_argument("--policies", help=f"comma-separated subset of {', '.join(POLICIES)}")
    parser.add_argument("--seed", type=int, help="arrival seed (default: the scenario's)")
    parser.add_argument("--prefill-budget", type=int, metavar="TOKENS",
                        help="run with scheduler.prefill_budget_tokens set (default: unset)")
    parser.add_argument("--override", type=json.loads, default={},
                        help="JSON object merged into the scenario's policy, e.g. "
                        "'{\"tiers\": {\"batch\": {\"min_share\": 0}}}' (an experiment, "
                        "not B3: the report is not comparable with RESULTS.md's)")
    parser.add_argument("--json", dest="json_path",
                        help="write the per-cell figures and checks")
    args = parser.parse_args(argv)
    try:
        loads = _pick(args.loads, LOADS, float)
        arrivals = _pick(args.arrivals, ARRIVALS)
        mixes = _pick(args.mix, MIXES)
        policies = _pick(args.policies, POLICIES)
    except SweepError as exc:
        print(f"b3_sweep: {exc}", file=sys.stderr)
        return 2
    base = load_scenario(SCENARIO)
    if args.prefill_budget is not None or args.override:
        data = base.model_dump()
        if args.prefill_budget is not None:
            data["policy"]["scheduler"]["prefill_budget_tokens"] = args.prefill_budget
        data["policy"] = merged(data["policy"], args.override)
        base = Scenario.model_validate(data)
    seed = base.seed if args.seed is None else args.seed
    table = run_sweep(base, mixes, arrivals, loads, policies, seed)
    rows = summarise(table)
    print(format_rows(rows))
    try:
        checks = evaluate(table)
    except SweepError as exc:
        print(f"ERROR  {exc}")
        return 2
    failed = [c for c in checks if not c.passed]
    print()
    for check in failed:
        print(format_check(check))
    print(f"{len(checks) - len(failed)} of {len(checks)} checks pass, {len(failed)} FAIL")
    if args.json_path:
        payload = {"duration_s": DURATION_S, "warmup_s": WARMUP_S, "seed": seed, "cells": rows,
                   "checks": [{"cell": str(c.cell), "rule": c.rule, "value": c.value,
                               "threshold": c.threshold, "passed": c.passed} for c in checks]}
        Path(args.json_path).write_text(json.dumps(payload, indent=1))
        print(f"wrote {args.json_path}")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
