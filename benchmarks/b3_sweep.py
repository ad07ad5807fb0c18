"""B3 sweep: tier SLOs across loads, arrival burstiness and length mixes, with
pass rules that can fail.

    .venv/bin/python benchmarks/b3_sweep.py [--loads 1,2,4] [--arrivals poisson]
        [--mix b3] [--policies qos,strict,fcfs] [--seed S] [--seeds 5] [--jobs $(nproc)]
        [--prefill-budget TOKENS] [--override JSON] [--engine JSON] [--json PATH]

Every cell (mix x arrivals x load) runs each policy on the same arrivals through
the simulator's own API (qosgate.sim.commands.Simulation), once per seed: S,
S + 1, ... S + N - 1 (`--seed`, by default the scenario's; `--seeds`, 5 by
default). The B3 scenario file gives the policy, the engine and the b3 mix; the
`long` mix keeps its policy and tenants but gives docs-qa and the batch tenants
8k-token prompts beside short chat. Each cell is DURATION_S simulated seconds of
arrivals (the acceptance run of B3 is 600 s): the 144 runs of the whole sweep on
one seed take about 4 minutes on one core, five seeds five times that;
`--jobs J` runs J units (a mix and arrival process on one seed, every load) at
a time in worker processes, with the same figures. `--engine` runs B3's tiers
on another simulated engine (a profile, fewer sequence slots): the load unit,
interactive's demand and its run alone are that engine's.

The rules judge each cell over its seeds. The simulator is chaotic: any
reordering of the lower tiers' work moves the tiers above by a request or
two, in either direction from seed to seed. So "qos attainment >= strict" is
judged on the paired differences d = qos - strict over the seeds: it fails
when mean(d) + t x sd(d) / sqrt(N) < 0 (t: Student's one-sided 95% quantile,
N - 1 degrees of freedom), a shortfall beyond the seeds' noise. Interactive's
floor (where its demand, the mean over the seeds, fits), goodput against qos
at 1x and tokens/s against fcfs judge the means over the seeds; served waits
the longest of any seed; requests lost their sum. With `--seeds 1` every rule
judges the one run as it is, qos against strict with no tolerance.

Exit status: 0 when every rule passes, 1 when a rule fails (each printed as
FAIL with its cell and figures), 2 when a rule cannot be evaluated (a policy
or seed that was not run, a ratio whose denominator is zero or missing, such as
no 1.0x baseline in the selection): an error, never a pass.
"""

from __future__ import annotations

import argparse
import functools
import json
import math
import os
import sys
import time
from concurrent.futures import ProcessPoolExecutor, as_completed
from dataclasses import dataclass
from pathlib import Path
from statistics import fmean, stdev
from typing import Any, Callable, Iterable

from pydantic import ValidationError

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
SEEDS = 5
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


# {cell: {seed: {"policies": {name: report}, "interactive_demand": ..., ...}}}: what
# `run_sweep` ran and the rules judge.
Table = dict[Cell, dict[int, dict]]


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


def run_unit(base: Scenario, mix: str, arrivals: str, loads: tuple[float, ...],
             policies: tuple[str, ...], seed: int) -> list[tuple[Cell, dict, float]]:
    """One mix and arrival process on one seed, at every load: every policy on
    the same arrivals, and the figures the rules read beside the policies'
    reports, with the CPU seconds each load took. The engine's capacities are
    measured once for all the loads. The simulator draws from the seed alone,
    so a unit gives the same figures in any process."""
    scenario = cell_scenario(base, mix, arrivals)
    sim = Simulation(scenario, seed=seed, quiet=True)
    own_capacity = interactive_capacity_rps(scenario, seed)
    share = interactive_share(scenario)
    out = []
    for load in loads:
        started = time.process_time()
        result, _ = sim.run(load, policies)
        out.append((Cell(mix, arrivals, load), {
            "capacity_rps": sim.capacity_rps,
            "rate_rps": result["rate_rps"],
            "interactive_demand": result["rate_rps"] * share / own_capacity,
            "interactive_alone": interactive_alone(sim, load, seed),
            "bounds": stated_bounds(scenario),
            "policies": result["policies"],
        }, time.process_time() - started))
    return out


def run_sweep(
    base: Scenario, mixes: Iterable[str], arrivals: Iterable[str], loads: Iterable[float],
    policies: tuple[str, ...], seeds: tuple[int, ...], jobs: int = 1,
) -> Table:
    """{cell: {seed: {"interactive_demand": x capacity, "rate_rps", "policies":
    {name: report}, ...}}}: every unit (run_unit), `jobs` at a time in
    worker processes (1: in this one)."""
    loads = tuple(loads)
    units = [(mix, arr, seed) for mix in mixes for arr in arrivals for seed in seeds]
    table: Table = {Cell(mix, arr, load): {} for mix, arr, _ in units for load in loads}

    def record(seed: int, results: list[tuple[Cell, dict, float]]) -> None:
        for cell, entry, cpu_s in results:
            table[cell][seed] = entry
            print(f"  {cell} seed {seed}: {cpu_s:.1f} CPU s", file=sys.stderr, flush=True)

    if jobs == 1:
        for mix, arr, seed in units:
            record(seed, run_unit(base, mix, arr, loads, policies, seed))
    else:
        with ProcessPoolExecutor(max_workers=jobs) as pool:
            pending = {pool.submit(run_unit, base, mix, arr, loads, policies, seed): seed
                       for mix, arr, seed in units}
            for done in as_completed(pending):
                record(pending[done], done.result())
    # Units end in any order across workers: the table's does not depend on it.
    return {cell: dict(sorted(runs.items())) for cell, runs in table.items()}


# -- figures and rules --------------------------------------------------------------------


def merged(doc: dict[str, Any], override: dict[str, Any]) -> dict[str, Any]:
    """`doc` with `override` merged in, key by key into nested objects: an
    experiment on one setting of the policy (`--override`)."""
    out = dict(doc)
    for key, value in override.items():
        out[key] = merged(out.get(key) or {}, value) if isinstance(value, dict) else value
    return out


def _with_section(base: Scenario, section: str, override: dict[str, Any]) -> Scenario:
    if not override:
        return base
    data = base.model_dump()
    data[section] = merged(data[section], override)
    return Scenario.model_validate(data)


def with_override(base: Scenario, override: dict[str, Any]) -> Scenario:
    """`base` with `override` merged into its policy, validated again."""
    return _with_section(base, "policy", override)


def with_engine(base: Scenario, engine: dict[str, Any]) -> Scenario:
    """`base` on another simulated engine: `engine` merged into its engine
    section (profile, max_num_seqs, ...), validated again. The load unit,
    interactive's demand and its run alone follow the engine."""
    return _with_section(base, "engine", engine)


def common_seeds(table: Table) -> tuple[int, ...]:
    """The seeds every cell ran; SweepError when a cell lacks one that another
    ran: the cells' means, and the goodput rule's ratio of two of them, would
    be over different arrivals."""
    ran = sorted({seed for runs in table.values() for seed in runs})
    if not ran:
        raise SweepError("no cell ran a seed")
    for cell in sorted(table, key=Cell.sort_key):
        missing = [seed for seed in ran if seed not in table[cell]]
        if missing:
            raise SweepError(f"{cell}: seed(s) {missing} were not run, which other cells ran "
                             f"(the sweep's: {ran})")
    return tuple(ran)


def _runs(table: Table, cell: Cell) -> dict[int, dict]:
    if cell not in table:
        raise SweepError(f"{cell} was not run, and a rule needs it "
                         "(select it with --loads/--arrivals/--mix)")
    return table[cell]


def figure(table: Table, cell: Cell, seed: int, policy: str, *path: str) -> float:
    """One number of one policy's report in one cell on one seed; SweepError
    when it is not there."""
    if seed not in _runs(table, cell):
        raise SweepError(f"{cell}: seed {seed} was not run, and a rule needs it")
    runs = table[cell][seed]["policies"]
    if policy not in runs:
        raise SweepError(f"{cell} seed {seed}: a rule needs policy {policy!r}, which was not "
                         f"run (run: {', '.join(runs) or 'none'})")
    node: Any = runs[policy]
    for key in path:
        node = node.get(key) if isinstance(node, dict) else None
    if isinstance(node, bool) or not isinstance(node, (int, float)):
        raise SweepError(f"{cell} seed {seed}: {policy} {'.'.join(path)} is missing ({node!r})")
    return float(node)


def figures(table: Table, cell: Cell, policy: str, *path: str) -> list[float]:
    """`figure` on each of the cell's seeds, in their order."""
    return [figure(table, cell, seed, policy, *path) for seed in _runs(table, cell)]


def ratio(num: float, den: float, what: str) -> float:
    if den == 0:
        raise SweepError(f"{what}: the denominator is 0, so the ratio is undefined")
    return num / den


def _attainments(table: Table, cell: Cell, policy: str, tier: str) -> list[float]:
    return figures(table, cell, policy, "tiers", tier, "ttft_slo_attainment")


# One-sided 95% quantiles of Student's t for 1, 2, ... 30 degrees of freedom;
# the normal's beyond.
T95 = (6.314, 2.920, 2.353, 2.132, 2.015, 1.943, 1.895, 1.860, 1.833, 1.812,
       1.796, 1.782, 1.771, 1.761, 1.753, 1.746, 1.740, 1.734, 1.729, 1.725,
       1.721, 1.717, 1.714, 1.711, 1.708, 1.706, 1.703, 1.701, 1.699, 1.697)
T95_BEYOND = 1.645


def t95(df: int) -> float:
    return T95[df - 1] if df <= len(T95) else T95_BEYOND


@dataclass(frozen=True)
class Paired:
    """qos's attainment less strict's on the same arrivals, over the seeds:
    the mean difference and its standard error (None on one seed)."""
    mean: float
    se: float | None
    n: int

    @classmethod
    def of(cls, qos: list[float], strict: list[float]) -> Paired:
        diffs = [q - s for q, s in zip(qos, strict, strict=True)]
        n = len(diffs)
        return cls(fmean(diffs), stdev(diffs) / math.sqrt(n) if n >= 2 else None, n)

    @property
    def upper(self) -> float:
        """The mean difference plus its one-sided 95% margin: below 0, qos is
        below strict by more than the seeds' noise."""
        assert self.se is not None
        return self.mean + t95(self.n - 1) * self.se


@dataclass(frozen=True)
class Check:
    cell: Cell
    rule: str
    value: float
    threshold: float
    op: str = ">="
    detail: str = ""

    @property
    def passed(self) -> bool:
        if self.op == "<=":
            return self.value <= self.threshold
        return self.value >= self.threshold if self.op == ">=" else self.value == self.threshold


def versus_strict(table: Table, cell: Cell, tier: str) -> Check:
    """qos's attainment against strict's. On one seed the figures themselves,
    with no tolerance. On several, their paired differences: any reordering
    of the lower tiers' work moves the tiers above by a request or two, in
    either direction from seed to seed, so the rule fails only on a mean
    difference below 0 by more than its noise."""
    qos = _attainments(table, cell, "qos", tier)
    strict = _attainments(table, cell, "strict", tier)
    rule = f"{tier} attainment qos >= strict"
    if len(qos) == 1:
        return Check(cell, rule, qos[0], strict[0])
    paired = Paired.of(qos, strict)
    return Check(cell, f"{rule}, paired over {paired.n} seeds: mean difference + t x se",
                 paired.upper, 0.0,
                 detail=f"mean difference {paired.mean:+.3f} ± {paired.se:.3f} se, "
                 f"t {t95(paired.n - 1):.3f}")


def evaluate(table: Table, errors: list[str] | None = None) -> list[Check]:
    """Every rule in every cell of the table, over the seeds every cell ran.
    A rule that cannot be evaluated (a policy or the 1x baseline not run, a
    figure missing, a zero denominator) raises SweepError; with `errors`, its
    message goes there instead and the other rules are still judged (the
    caller then exits 2 all the same: an unevaluated rule is never a pass)."""
    checks: list[Check] = []

    def rule(make: Callable[[], Check | None]) -> None:
        try:
            check = make()
        except SweepError as exc:
            if errors is None:
                raise
            errors.append(str(exc))
            return
        if check is not None:
            checks.append(check)

    n = len(common_seeds(table)) if table else 1
    mean_of, longest_of, sum_of = ("", "", "") if n == 1 else (
        f", mean of {n} seeds", f", longest of {n} seeds", f", sum of {n} seeds")
    for cell in sorted(table, key=Cell.sort_key):
        entries = list(table[cell].values())

        # Each rule is judged at once, in this iteration: the closures read
        # the loop's own cell.
        def floor() -> Check | None:
            demand = fmean(entry["interactive_demand"] for entry in entries)
            if demand > INTERACTIVE_DEMAND_LIMIT:
                return None
            qos_int = fmean(_attainments(table, cell, "qos", "interactive"))
            alone = _mean([entry.get("interactive_alone") for entry in entries])
            return Check(cell, f"interactive attainment (qos){mean_of}, interactive "
                         f"demand {demand:.2f}x capacity, alone on the engine {_f(alone)}",
                         qos_int, INTERACTIVE_FLOOR[cell.arrivals])

        def goodput() -> Check | None:
            if cell.load < BASELINE_LOAD:
                return None
            base = Cell(cell.mix, cell.arrivals, BASELINE_LOAD)
            if base not in table:
                raise SweepError(
                    f"{cell}: qos goodput is compared with qos at {BASELINE_LOAD:g}x, "
                    f"which is not in the selection (add {BASELINE_LOAD:g} to --loads)")
            num = fmean(figures(table, cell, "qos", "totals", "goodput_rps"))
            den = fmean(figures(table, base, "qos", "totals", "goodput_rps"))
            return Check(cell, f"qos goodput / qos goodput at {BASELINE_LOAD:g}x{mean_of}",
                         ratio(num, den, f"{cell}: qos goodput at {BASELINE_LOAD:g}x"),
                         GOODPUT_FLOOR)

        def throughput() -> Check:
            thr_q = fmean(figures(table, cell, "qos", "totals", "throughput_tokens_per_s"))
            thr_f = fmean(figures(table, cell, "fcfs", "totals", "throughput_tokens_per_s"))
            return Check(cell, f"qos throughput / fcfs throughput{mean_of}",
                         ratio(thr_q, thr_f, f"{cell}: fcfs throughput"), THROUGHPUT_FLOOR)

        def lost(policy: str) -> Check:
            return Check(cell, f"requests lost ({policy}){sum_of}",
                         sum(figures(table, cell, policy, "totals", "lost")), 0.0, "==")

        rule(floor)
        for tier in ("interactive", "standard"):
            rule(functools.partial(versus_strict, table, cell, tier))
        rule(goodput)
        rule(throughput)
        if any("bounds" not in entry for entry in entries):
            raise SweepError(f"{cell}: the tiers' stated bounds are missing")
        for tier, bound in entries[0]["bounds"].items():
            # A seed on which the tier served nothing had nothing wait.
            waited = _longest([_maybe(table, cell, seed, "qos", "tiers", tier,
                                      "served_wait_max_s") for seed in table[cell]])
            if bound is None or waited is None:
                continue
            checks.append(Check(cell, f"{tier} max served wait (qos) within its stated "
                                f"bound{longest_of}", waited, bound, "<="))
        for policy in POLICIES:
            rule(functools.partial(lost, policy))
    return checks


# -- text -----------------------------------------------------------------------------------


def _f(value: float | None, spec: str = ".3f") -> str:
    return "-" if value is None else format(value, spec)


def _maybe(table: Table, cell: Cell, seed: int, policy: str, *path: str) -> float | None:
    try:
        return figure(table, cell, seed, policy, *path)
    except SweepError:
        return None


def _mean(values: list[float | None]) -> float | None:
    """The mean over the seeds; None when a seed lacks the figure (a mean over
    fewer seeds would not be the cell's)."""
    return None if not values or None in values else fmean(values)


def _longest(values: list[float | None]) -> float | None:
    present = [value for value in values if value is not None]
    return max(present) if present else None


def _sum(values: list[float | None]) -> float | None:
    return None if not values or None in values else sum(values)


def _div(num: float | None, den: float | None) -> float | None:
    return None if num is None or not den else num / den


def _cell_figures(table: Table, cell: Cell, seeds: tuple[int, ...]) -> dict:
    """The figures printed for a cell over some of its seeds: the means, the
    longest served waits and the requests lost in all."""
    def over(how, policy: str, *path: str) -> float | None:
        return how([_maybe(table, cell, seed, policy, *path) for seed in seeds])

    entries = [table[cell][seed] for seed in seeds]
    att = {(p, t): over(_mean, p, "tiers", t, "ttft_slo_attainment")
           for p in POLICIES for t in ("interactive", "standard")}
    base = Cell(cell.mix, cell.arrivals, BASELINE_LOAD)
    goodput = over(_mean, "qos", "totals", "goodput_rps")
    base_goodput = _mean([_maybe(table, base, seed, "qos", "totals", "goodput_rps")
                          for seed in seeds])
    return {
        "rate_rps": _mean([entry["rate_rps"] for entry in entries]),
        "interactive_demand": _mean([entry["interactive_demand"] for entry in entries]),
        "interactive_alone": _mean([entry.get("interactive_alone") for entry in entries]),
        "attainment": {p: {t: att[p, t] for t in ("interactive", "standard")}
                       for p in POLICIES},
        "qos_over_strict": {t: _div(att["qos", t], att["strict", t])
                            for t in ("interactive", "standard")},
        "qos_goodput_rps": goodput,
        "qos_goodput_over_baseline": _div(goodput, base_goodput),
        "qos_throughput_over_fcfs": _div(
            over(_mean, "qos", "totals", "throughput_tokens_per_s"),
            over(_mean, "fcfs", "totals", "throughput_tokens_per_s")),
        "served_wait_max_s": {p: {t: over(_longest, p, "tiers", t, "served_wait_max_s")
                                  for t in TIERS} for p in POLICIES},
        "lost": {p: over(_sum, p, "totals", "lost") for p in POLICIES},
    }


def _paired_figures(table: Table, cell: Cell, tier: str) -> dict | None:
    try:
        paired = Paired.of(_attainments(table, cell, "qos", tier),
                           _attainments(table, cell, "strict", tier))
    except SweepError:
        return None
    return {"mean": paired.mean, "se": paired.se, "n": paired.n}


def summarise(table: Table) -> list[dict]:
    """The figures printed per cell (and written by --json): over its seeds,
    then per seed, and qos's attainment less strict's paired by seed."""
    rows = []
    for cell in sorted(table, key=Cell.sort_key):
        seeds = tuple(table[cell])
        rows.append({
            "mix": cell.mix, "arrivals": cell.arrivals, "load": cell.load,
            **_cell_figures(table, cell, seeds),
            "seeds": list(seeds),
            "qos_minus_strict": {t: _paired_figures(table, cell, t)
                                 for t in ("interactive", "standard")},
            "per_seed": [{"seed": seed, **_cell_figures(table, cell, (seed,))}
                         for seed in seeds],
        })
    return rows


def below_strict(table: Table) -> dict[str, tuple[int, int]]:
    """Tier -> (how many (cell, seed) pairs had qos's attainment below
    strict's, of how many had both)."""
    counts = {}
    for tier in ("interactive", "standard"):
        pairs = [(_maybe(table, cell, seed, "qos", "tiers", tier, "ttft_slo_attainment"),
                  _maybe(table, cell, seed, "strict", "tiers", tier, "ttft_slo_attainment"))
                 for cell in table for seed in table[cell]]
        both = [(q, s) for q, s in pairs if q is not None and s is not None]
        counts[tier] = (sum(q < s for q, s in both), len(both))
    return counts


def format_below_strict(counts: dict[str, tuple[int, int]]) -> str:
    return "qos below strict on a single seed, of the (cell, seed) pairs: " + ", ".join(
        f"{tier} {below} of {both}" for tier, (below, both) in counts.items())


def _versus_strict_text(row: dict, tier: str, paired: bool) -> str:
    if not paired:
        return f"{_f(row['qos_over_strict'][tier], '.2f'):>5}"
    diff = row["qos_minus_strict"][tier]
    text = "-" if diff is None else f"{diff['mean']:+.3f}±{_f(diff['se'])}"
    return f"{text:>12}"


def format_rows(rows: list[dict]) -> str:
    """The cells' figures; with several seeds, their means and, beside qos's
    and strict's attainments, the mean difference ± its standard error in
    place of their ratio."""
    paired = any(len(r["seeds"]) >= 2 for r in rows)
    versus = f"{'q-s ± se':>12}" if paired else f"{'q/s':>5}"
    head = (f"{'mix':<5} {'arrivals':<8} {'load':>5} {'i.dem':>5} | "
            f"{'interactive q/s/f':>17} {versus} {'alone':>5} | {'standard q/s/f':>17} {versus} | "
            f"{'gp/1x':>5} {'thr/f':>5} | {'qos max served wait i/s/b (s)':>27} | lost q/s/f")
    lines = [head, "-" * len(head)]
    for r in rows:
        a, waits = r["attainment"], r["served_wait_max_s"]["qos"]
        lost = r["lost"]
        lines.append(
            f"{r['mix']:<5} {r['arrivals']:<8} {r['load']:>5g} {r['interactive_demand']:>5.2f} | "
            + " ".join(f"{_f(a[p]['interactive'], '.3f'):>5}" for p in POLICIES)
            + f" {_versus_strict_text(r, 'interactive', paired)}"
            f" {_f(r['interactive_alone'], '.3f'):>5} | "
            + " ".join(f"{_f(a[p]['standard'], '.3f'):>5}" for p in POLICIES)
            + f" {_versus_strict_text(r, 'standard', paired)} | "
            f"{_f(r['qos_goodput_over_baseline'], '.2f'):>5} "
            f"{_f(r['qos_throughput_over_fcfs'], '.2f'):>5} | "
            + " ".join(f"{_f(waits[t], '.1f'):>8}" for t in TIERS) + " | "
            + "/".join(_f(lost[p], '.0f') for p in POLICIES)
        )
    return "\n".join(lines)


def format_check(check: Check) -> str:
    verdict = "PASS" if check.passed else "FAIL"
    return (f"{verdict}  {check.cell}: {check.rule}: "
            f"{check.value:.3f} {check.op} {check.threshold:.3f}"
            + (f" ({check.detail})" if check.detail else ""))


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


def _positive(text: str) -> int:
    value = int(text)
    if value < 1:
        raise argparse.ArgumentTypeError(f"{value} is not 1 or more")
    return value


_UNSET = object()


def _budget(text: str) -> int | str | None:
    if text in ("auto", "null"):
        return None if text == "null" else text
    try:
        return int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a number, auto or null") from None


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--loads", help="comma-separated multiples of capacity "
                        f"(default: {','.join(f'{x:g}' for x in LOADS)})")
    parser.add_argument("--arrivals", help=f"comma-separated subset of {', '.join(ARRIVALS)}")
    parser.add_argument("--mix", help=f"comma-separated subset of {', '.join(MIXES)}")
    parser.add_argument("--policies", help=f"comma-separated subset of {', '.join(POLICIES)}")
    parser.add_argument("--seed", type=int, help="the first arrival seed (default: the "
                        "scenario's)")
    parser.add_argument("--seeds", type=_positive, default=SEEDS, metavar="N",
                        help=f"run every cell on N seeds, --seed, --seed + 1, ... (default "
                        f"{SEEDS}); the rules judge the means, qos against strict by its "
                        "paired differences; 1: one run per cell, qos against strict with no "
                        "tolerance")
    parser.add_argument("--jobs", type=_positive, default=1, metavar="J",
                        help="run J units (a mix and arrivals on one seed) at a time in worker "
                        "processes, with "
                        f"the same figures as one at a time (default 1; this machine has "
                        f"{os.cpu_count()} CPUs)")
    parser.add_argument("--prefill-budget", type=_budget, default=_UNSET, metavar="TOKENS",
                        help="run with scheduler.prefill_budget_tokens set: a number of "
                        "tokens, auto or null (default: the policy's, auto: 4,096 on "
                        "this profile)")
    parser.add_argument("--override", type=json.loads, default={},
                        help="JSON object merged into the scenario's policy, e.g. "
                        "'{\"tiers\": {\"batch\": {\"min_share\": 0}}}' (an experiment, "
                        "not B3: the report is not comparable with RESULTS.md's)")
    parser.add_argument("--engine", type=json.loads, default={},
                        help="JSON object merged into the scenario's simulated engine, e.g. "
                        "'{\"max_num_seqs\": 64}' or '{\"profile\": \"a100-llama3-8b\"}' "
                        "(B3's tiers on another engine: the report is not comparable with "
                        "RESULTS.md's B3 sweep)")
    parser.add_argument("--json", dest="json_path",
                        help="write the per-cell figures (the means over the seeds, each "
                        "seed's, and qos - strict paired by seed) and the checks")
    args = parser.parse_args(argv)
    try:
        loads = _pick(args.loads, LOADS, float)
        arrivals = _pick(args.arrivals, ARRIVALS)
        mixes = _pick(args.mix, MIXES)
        policies = _pick(args.policies, POLICIES)
    except SweepError as exc:
        print(f"b3_sweep: {exc}", file=sys.stderr)
        return 2
    override = args.override
    if args.prefill_budget is not _UNSET:
        override = merged({"scheduler": {"prefill_budget_tokens": args.prefill_budget}}, override)
    try:
        base = with_engine(with_override(load_scenario(SCENARIO), override), args.engine)
    except ValidationError as exc:
        print(f"b3_sweep: --override or --engine: {exc}", file=sys.stderr)
        return 2
    seed = base.seed if args.seed is None else args.seed
    seeds = tuple(range(seed, seed + args.seeds))
    table = run_sweep(base, mixes, arrivals, loads, policies, seeds, args.jobs)
    rows = summarise(table)
    print(format_rows(rows))
    below = below_strict(table)
    if len(seeds) >= 2:
        print(format_below_strict(below))
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
        payload = {"duration_s": DURATION_S, "warmup_s": WARMUP_S, "seed": seed,
                   "engine": base.engine.model_dump(mode="json"), "override": override,
                   "seeds": list(seeds), "cells": rows,
                   "qos_below_strict_on_a_single_seed": {
                       tier: {"pairs": n, "of": of} for tier, (n, of) in below.items()},
                   "checks": [{"cell": str(c.cell), "rule": c.rule, "value": c.value,
                               "threshold": c.threshold, "passed": c.passed,
                               "detail": c.detail} for c in checks]}
        Path(args.json_path).write_text(json.dumps(payload, indent=1))
        print(f"wrote {args.json_path}")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
