"""What the gateway's levers buy the top tier's first token, and what they cost
in throughput, in the B3 sweep's cells where interactive misses its floor.

    .venv/bin/python benchmarks/floor_tradeoff.py [--cells b3:gamma2:1,b3:gamma2:2]
        [--reserves 6,64,128] [--budgets 0,4096,1024] [--seeds 3] [--jobs 2] [--json PATH]

Two levers act on what interactive finds in the engine: slots kept free for
the top level (`scheduler.reserve.slots`: fewer lower-tier sequences decode
beside it, so each engine step is shorter) and the prefill budget
(`scheduler.prefill_budget_tokens`: less lower-tier prompt queued ahead of
its prefill). For every cell and every pair of settings this runs qos and
fcfs on the sweep's arrivals (the seeds from the scenario's on) and prints
interactive's TTFT attainment against the sweep's floor, and qos's tokens/s
against fcfs's against the sweep's 0.98. A pair that meets both is marked;
a cell where none does shows that in that cell the two rules cannot both
hold with these levers. A cell, seed or policy missing from the run is an
error (exit 2), as in the sweep.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from statistics import fmean

sys.path.insert(0, str(Path(__file__).resolve().parent))

import b3_sweep as sweep  # noqa: E402

DEFAULT_CELLS = "b3:gamma2:1,b3:gamma2:2,b3:gamma2:4,long:gamma2:2"


def parse_cells(text: str) -> list[sweep.Cell]:
    cells = []
    for part in text.split(","):
        mix, arrivals, load = part.split(":")
        if mix not in sweep.MIXES or arrivals not in sweep.ARRIVALS:
            raise SystemExit(f"unknown cell {part!r} (mix in {sweep.MIXES}, "
                             f"arrivals in {tuple(sweep.ARRIVALS)})")
        cells.append(sweep.Cell(mix, arrivals, float(load)))
    return cells


def measure(cell: sweep.Cell, reserve: int, budget: int, seeds: tuple[int, ...],
            jobs: int) -> dict:
    override = {"reserve": {"slots": reserve}, "prefill_budget_tokens": budget or None}
    base = sweep.with_override(sweep.load_scenario(sweep.SCENARIO), {"scheduler": override})
    table = sweep.run_sweep(base, [cell.mix], [cell.arrivals], [cell.load], ("qos", "fcfs"),
                            seeds, jobs=jobs)
    qos_int = fmean(sweep.figures(table, cell, "qos", "tiers", "interactive",
                                  "ttft_slo_attainment"))
    thr = sweep.ratio(
        fmean(sweep.figures(table, cell, "qos", "totals", "throughput_tokens_per_s")),
        fmean(sweep.figures(table, cell, "fcfs", "totals", "throughput_tokens_per_s")),
        f"{cell}: fcfs throughput")
    alone = fmean(entry["interactive_alone"] for entry in table[cell].values())
    floor = sweep.INTERACTIVE_FLOOR[cell.arrivals]
    return {"mix": cell.mix, "arrivals": cell.arrivals, "load": cell.load,
            "reserve_slots": reserve, "prefill_budget_tokens": budget or None,
            "interactive": qos_int, "floor": floor, "alone": alone,
            "throughput_over_fcfs": thr,
            "both": qos_int >= floor and thr >= sweep.THROUGHPUT_FLOOR}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--cells", default=DEFAULT_CELLS)
    ap.add_argument("--reserves", default="6,64,128")
    ap.add_argument("--budgets", default="0,4096,1024", help="0: no prefill budget")
    ap.add_argument("--seed", type=int, default=None)
    ap.add_argument("--seeds", type=int, default=3)
    ap.add_argument("--jobs", type=int, default=1)
    ap.add_argument("--json", dest="json_path")
    args = ap.parse_args(argv)
    first = args.seed if args.seed is not None else sweep.load_scenario(sweep.SCENARIO).seed
    seeds = tuple(range(first, first + args.seeds))
    rows = []
    try:
        for cell in parse_cells(args.cells):
            for reserve in (int(r) for r in args.reserves.split(",")):
                for budget in (int(b) for b in args.budgets.split(",")):
                    row = measure(cell, reserve, budget, seeds, args.jobs)
                    rows.append(row)
                    print(f"{cell}  reserve {reserve:>3}  prefill budget "
                          f"{budget or '-':>5}  interactive {row['interactive']:.3f} "
                          f"(floor {row['floor']:.2f}, alone {row['alone']:.3f})  qos/fcfs "
                          f"tokens/s {row['throughput_over_fcfs']:.3f}"
                          f"{'  BOTH' if row['both'] else ''}", flush=True)
    except sweep.SweepError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    print()
    for cell in parse_cells(args.cells):
        mine = [r for r in rows if (r["mix"], r["arrivals"], r["load"])
                == (cell.mix, cell.arrivals, cell.load)]
        met = [r for r in mine if r["both"]]
        print(f"{cell}: {len(met)} of {len(mine)} settings meet the floor and the "
              f"throughput rule together")
    if args.json_path:
        Path(args.json_path).write_text(json.dumps({"seeds": list(seeds), "rows": rows},
                                                   indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
