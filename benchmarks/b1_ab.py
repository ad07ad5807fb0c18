"""B1 A/B: is a change to qosgate's request path cheaper? Two builds, one run.

    .venv/bin/python benchmarks/b1_ab.py --base HEAD~1 [--stream] [--concurrency 16]
        [--requests 3000] [--rounds 4] [--trace] [--json PATH]

B1 (benchmarks/b1_overhead.py) gives the figures; this answers a narrower
question while working on them. This machine's speed drifts (the same build's
CPU per request can move by a fifth between runs minutes apart), which hides
a change worth a few percent when two B1 runs are compared. So this runs, in
one process tree and against one instant upstream:

- A: `qosgate serve` from the git revision `--base` (exported to a temporary
  directory with `git archive`; its own code, this checkout's environment),
- B: `qosgate serve` from this working tree, as it is (uncommitted changes
  included),
- F: the floor proxy (benchmarks/b1_floor_proxy.py), as a yardstick,
- with `--trace`, C: this working tree again with OpenTelemetry tracing on
  (`observability.otel`, every request sampled, exported to a sink on the
  upstream), for what tracing costs,

and sends each the same closed-loop load in blocks ordered A B F F B A per
round (A B C F F C B A with `--trace`), so drift falls on all alike. Per block it reads the server's
CPU (schedstat, as B1 does) and the end-to-end p50; it prints each target's
median over its blocks, B over A, and each over F, and B over A of the
cheapest blocks as well: what other work on the host does can only add to a
block's CPU, so the cheapest block is the least disturbed one. The figures of
several rounds are what to compare; a single block is noise.
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any

import yaml

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent
sys.path.insert(0, str(ROOT))

from b1_overhead import Child, _announced_url, cpu_seconds, run_block, start_floor

from qosgate.bench.commands import job_config, resolve_keys
from qosgate.bench.plan import sweep_pool
from qosgate.bench.pool import WorkerPool
from qosgate.bench.scenario import load_bench_scenario
from qosgate.observability.stats import percentile

ORDER = ("A", "B", "F", "F", "B", "A")
TRACED_ORDER = ("A", "B", "C", "F", "F", "C", "B", "A")
WARMUP = 300


def export(revision: str, into: Path) -> None:
    """The tree of `revision` (qosgate/ is what matters) under `into`."""
    archive = subprocess.run(
        ["git", "-C", str(ROOT), "archive", "--format=tar", revision, "qosgate"],
        check=True, capture_output=True,
    )  # fmt: skip
    subprocess.run(["tar", "-x", "-C", str(into)], input=archive.stdout, check=True)


def start_build(
    source: Path, upstream_url: str, tmp: Path, name: str, *, traced: bool = False
) -> tuple[Child, str]:
    """`qosgate serve` with the qosgate package found under `source`; with
    `traced`, its spans exported to the upstream's sink."""
    policy = yaml.safe_load((HERE / "b1_policy.yaml").read_text())
    policy["backend"]["upstreams"][0]["url"] = upstream_url
    if traced:
        policy["observability"] = {"otel": {"endpoint": upstream_url + "/traces"}}
    path = tmp / f"{name}.yaml"
    path.write_text(yaml.safe_dump(policy, sort_keys=False))
    entry = (
        f"import sys; sys.path.insert(0, {str(source)!r}); import qosgate.cli; "
        f"assert qosgate.cli.__file__.startswith({str(source)!r}), qosgate.cli.__file__; "
        "sys.exit(qosgate.cli.main(sys.argv[1:]))"
    )
    # Run from `source` too: `-c` puts the working directory first on the
    # path, and this checkout's package must not stand in for the other's.
    child = Child(
        name,
        [sys.executable, "-c", entry, "serve", "--config", str(path),
         "--host", "127.0.0.1", "--port", "0"],
        tmp,
        cwd=source,
    )  # fmt: skip
    return child, _announced_url(child)


def run(args: argparse.Namespace) -> dict[str, Any]:
    scenario = load_bench_scenario(HERE / "b1_load.yaml")
    keys = resolve_keys(scenario)
    per_block = max(1, args.requests // (2 * args.rounds))
    with tempfile.TemporaryDirectory(prefix="qosgate-b1ab-") as tmp_name:
        tmp = Path(tmp_name)
        base = tmp / "base"
        base.mkdir()
        export(args.base, base)
        children: list[Child] = []
        try:
            upstream = Child(
                "upstream", [sys.executable, str(HERE / "b1_upstream.py"), "--delays", "0"], tmp
            )
            children.append(upstream)
            upstream_url = f"http://127.0.0.1:{json.loads(upstream.first_line)['ports']['0']}/v1"
            servers: dict[str, tuple[Child, str]] = {
                "A": start_build(base, upstream_url, tmp, "A"),
                "B": start_build(ROOT, upstream_url, tmp, "B"),
                "F": start_floor(upstream_url, tmp, "F"),
            }
            if args.trace:
                servers["C"] = start_build(ROOT, upstream_url, tmp, "C", traced=True)
            order = TRACED_ORDER if args.trace else ORDER
            children.extend(child for child, _ in servers.values())
            cfgs = {}
            for name, (_, url) in servers.items():
                cfg = job_config(scenario, url, keys, scenario.seed)
                cfg["stream"] = args.stream
                cfgs[name] = cfg
            specs = sweep_pool(scenario, 1)[:1]
            blocks: dict[str, list[tuple[float, float]]] = {name: [] for name in servers}
            failures: list[str] = []
            with WorkerPool(1) as pool:
                for name in servers:
                    failures += run_block(pool, cfgs[name], specs, args.concurrency, WARMUP)[2]
                for name in order * args.rounds:
                    child, _ = servers[name]
                    before = cpu_seconds(child.pid)
                    records, _, failed = run_block(
                        pool, cfgs[name], specs, args.concurrency, per_block
                    )
                    cpu = cpu_seconds(child.pid) - before
                    failures += failed
                    done = [r.e2e for r in records if r.outcome == "completed"]
                    if len(done) != per_block:
                        raise SystemExit(f"{name}: {per_block - len(done)} requests failed")
                    blocks[name].append((cpu * 1000 / per_block, percentile(done, 50) * 1000))
        finally:
            for child in reversed(children):
                child.stop()
    if failures:
        raise SystemExit(f"load generator failures: {failures[:3]}")
    medians = {
        name: {
            "cpu_ms_per_request": statistics.median(c for c, _ in rows),
            "cpu_ms_per_request_min": min(c for c, _ in rows),
            "e2e_p50_ms": statistics.median(p for _, p in rows),
            "cpu_ms_per_request_blocks": [round(c, 4) for c, _ in rows],
        }
        for name, rows in blocks.items()
    }
    a, b, f = (medians[n]["cpu_ms_per_request"] for n in "ABF")
    a_min, b_min = (medians[n]["cpu_ms_per_request_min"] for n in "AB")
    traced = {}
    if args.trace:
        c, c_min = medians["C"]["cpu_ms_per_request"], medians["C"]["cpu_ms_per_request_min"]
        traced = {"c_over_b_cpu": c / b, "c_over_b_cpu_min": c_min / b_min}
    return {
        **traced,
        "base": args.base,
        "stream": args.stream,
        "concurrency": args.concurrency,
        "requests_per_block": per_block,
        "rounds": args.rounds,
        "targets": medians,
        "b_over_a_cpu": b / a,
        "b_over_a_cpu_min": b_min / a_min,
        "a_over_floor_cpu": a / f,
        "b_over_floor_cpu": b / f,
    }


def main() -> int:
    parser = argparse.ArgumentParser(description="B1 A/B: a git revision against this tree")
    parser.add_argument("--base", required=True, help="git revision to compare against (A)")
    parser.add_argument("--stream", action="store_true", help="stream the answers (SSE)")
    parser.add_argument("--concurrency", type=int, default=16)
    parser.add_argument("--requests", type=int, default=3000,
                        help="requests per target, over all its blocks")
    parser.add_argument("--rounds", type=int, default=4, help="rounds of A B F F B A")
    parser.add_argument("--trace", action="store_true",
                        help="also run this tree with OpenTelemetry tracing on (C)")
    parser.add_argument("--json", dest="json_path", help="also write the result here")
    args = parser.parse_args()
    result = run(args)
    mode = "stream" if args.stream else "json"
    print(f"B1 A/B, {mode}, concurrency {args.concurrency}, {result['requests_per_block']} "
          f"requests a block, {args.rounds} rounds (medians over blocks)")
    labels = {"A": f"A {args.base}", "B": "B working tree", "F": "F floor proxy"}
    if args.trace:
        labels["C"] = "C working tree, traced"
    for name, label in labels.items():
        t = result["targets"][name]
        blocks = " ".join(f"{c:.3f}" for c in sorted(t["cpu_ms_per_request_blocks"]))
        print(f"  {label:<24} CPU {t['cpu_ms_per_request']:.3f} ms/req, e2e p50 "
              f"{t['e2e_p50_ms']:.3f} ms  (blocks: {blocks})")
    print(f"  B / A CPU {result['b_over_a_cpu']:.3f} (of the cheapest blocks: "
          f"{result['b_over_a_cpu_min']:.3f});  A / F {result['a_over_floor_cpu']:.2f}x, "
          f"B / F {result['b_over_floor_cpu']:.2f}x")
    if args.trace:
        print(f"  C / B CPU {result['c_over_b_cpu']:.3f} (of the cheapest blocks: "
              f"{result['c_over_b_cpu_min']:.3f})")
    if args.json_path:
        Path(args.json_path).parent.mkdir(parents=True, exist_ok=True)
        Path(args.json_path).write_text(json.dumps(result, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
