"""Run every offline benchmark (no server needed) and keep their JSON.

    .venv/bin/python benchmarks/run_all.py [--only b3,b4]

Each scenario's result goes to benchmarks/results/<name>.json; the target
lines are printed so they can be copied into benchmarks/RESULTS.md together
with the command. Exit status 1 if any target failed.
"""

from __future__ import annotations

import argparse
import subprocess
import sys
from pathlib import Path

HERE = Path(__file__).resolve().parent
OUT = HERE / "results"

RUNS = {
    "b2": [sys.executable, str(HERE / "b2_core.py"), "--json", str(OUT / "b2_core.json")],
    "b3": ["simulate", "b3_overload.yaml", "--load", "1.0", "--load", "1.5", "--load", "2.0"],
    "b4": ["simulate", "b4_fairness.yaml"],
    "b4-onoff": ["simulate", "b4_fairness_onoff.yaml"],
    "b4-weighted": ["simulate", "b4_fairness_weighted.yaml"],
    "b5": ["simulate", "b5_starvation.yaml"],
    "b5-share": ["simulate", "b5_delay_share.yaml"],
    "b9": ["simulate", "b9_hour.yaml"],
    "b10": ["simulate", "b10_seed_tables.yaml"],
}


def command(name: str, spec: list[str]) -> list[str]:
    if spec[0] != "simulate":
        return spec
    scenario = HERE / spec[1]
    return [sys.executable, "-m", "qosgate.cli", "simulate", str(scenario), *spec[2:],
            "--quiet", "--json", str(OUT / f"{scenario.stem}.json")]


def main() -> int:
    parser = argparse.ArgumentParser(description="run the offline benchmarks")
    parser.add_argument("--only", help="comma-separated subset of: " + ", ".join(RUNS))
    args = parser.parse_args()
    names = args.only.split(",") if args.only else list(RUNS)
    OUT.mkdir(exist_ok=True)
    failed = []
    for name in names:
        cmd = command(name, RUNS[name])
        print(f"== {name}: {' '.join(cmd)}", flush=True)
        if subprocess.run(cmd).returncode != 0:
            failed.append(name)
    if failed:
        print(f"targets missed or errors in: {', '.join(failed)}")
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
