"""B7: quotas hold, on one gateway and across four sharing one Redis.

    .venv/bin/python benchmarks/b7_quota.py [--duration 180] [--json benchmarks/results/b7_quota.json]

Two runs (B7 of benchmarks/RESULTS.md), each `--duration` seconds:

- one: one gateway (memory store), 64 concurrent streams of one tenant;
- four: four gateway processes sharing one real redis-server (started here on
  a free port), 16 streams against each: 64 in all, one tenant, one budget.

The tenant has tokens_per_minute 60,000 (benchmarks/b7_policy.yaml), several
times less than the 64 streams would use, so the quota binds all the time.
Each gateway is benchmarks/b7_gateway.py (`qosgate serve` with its store's
calls written to a ledger); the load is `qosgate bench` with
benchmarks/b7_load.yaml, one process per gateway, users honouring
Retry-After.

From the ledgers of all gateways of a run, independently of the store:
- held: at each admission, the tokens held by the reservations admitted in
  the minute up to it, as they stood at that instant (reservations minus the
  refunds already made). This is what the quota promises to bound.
- charged: the most tokens charged (what the requests really used) to
  reservations admitted within any 60 s.
- over: how far either ever went above the quota; the target is 0.
- the store's check-and-reserve time (p50, p99) as the gateway saw it.
"""

from __future__ import annotations

import argparse
import bisect
import json
import os
import platform
import shlex
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import yaml

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent
sys.path.insert(0, str(ROOT))

from qosgate.observability.stats import percentile  # noqa: E402
from tests.redis_server import RedisServer  # noqa: E402

QUOTA = 60_000
WINDOW_S = 60.0


def start_gateway(policy: Path, ledger: Path, log: Path) -> tuple[subprocess.Popen, str]:
    proc = subprocess.Popen(
        [sys.executable, str(HERE / "b7_gateway.py"), str(policy), str(ledger)],
        stdout=subprocess.PIPE, stderr=log.open("wb"), cwd=ROOT, text=True,
    )  # fmt: skip
    assert proc.stdout is not None
    line = proc.stdout.readline().strip()
    if not line.startswith("qosgate: serving"):
        proc.kill()
        raise RuntimeError(f"gateway did not start: {line!r}\n{log.read_text()[-2000:]}")
    return proc, line.rsplit(" ", 1)[-1]


def run_load(urls: list[str], concurrency: int, duration: float, tmp: Path) -> list[dict]:
    scenario = yaml.safe_load((HERE / "b7_load.yaml").read_text())
    scenario["sweep"] = {"concurrency": [concurrency], "duration_s": duration}
    path = tmp / f"load-{concurrency}.yaml"
    path.write_text(yaml.safe_dump(scenario, sort_keys=False))
    procs = []
    for i, url in enumerate(urls):
        out = tmp / f"bench-{len(urls)}-{i}.json"
        procs.append((subprocess.Popen(
            [sys.executable, "-m", "qosgate.cli", "bench", url, str(path), "--workers", "1",
             "--quiet", "--json", str(out)],
            cwd=ROOT, stdout=subprocess.DEVNULL, stderr=(tmp / f"bench-{i}.stderr").open("wb"),
        ), out))  # fmt: skip
    results = []
    for proc, out in procs:
        if proc.wait() != 0:
            raise RuntimeError(f"qosgate bench failed: see {out.with_suffix('.stderr')}")
        results.append(json.loads(out.read_text()))
    return results


def read_ledgers(paths: list[Path]) -> tuple[list[dict], list[dict]]:
    reserves, settles = [], []
    for path in paths:
        for line in path.read_bytes().splitlines():
            event = json.loads(line)
            (reserves if event["ev"] == "reserve" else settles).append(event)
    return reserves, settles


def check(reserves: list[dict], settles: list[dict]) -> dict[str, Any]:
    admitted = sorted((e for e in reserves if e["admitted"]), key=lambda e: e["at"])
    by_rid = {e["rid"]: e for e in admitted}
    settled = {e["rid"]: e for e in settles}
    # Held at each admission: reservations in (t - 60, t], less refunds made by t.
    times = [e["at"] for e in admitted]
    refunds = sorted(
        (s["settled_at"], s["at"], s["tokens"] - s["charged"])
        for s in settles if s["rid"] in by_rid
    )  # fmt: skip
    held_max = 0
    prefix = [0]
    for e in admitted:
        prefix.append(prefix[-1] + e["tokens"])
    for i, t in enumerate(times):
        lo = bisect.bisect_right(times, t - WINDOW_S)
        held = prefix[i + 1] - prefix[lo]
        held -= sum(
            amount for when, at, amount in refunds if when <= t and t - WINDOW_S < at <= t
        )
        held_max = max(held_max, held)
    # Charged: what the requests really used, by admission time.
    charged = [(e["at"], settled[e["rid"]]["charged"]) for e in admitted if e["rid"] in settled]
    charged.sort()
    ctimes = [at for at, _ in charged]
    cprefix = [0]
    for _, c in charged:
        cprefix.append(cprefix[-1] + c)
    charged_max = 0
    for i, t in enumerate(ctimes):
        lo = bisect.bisect_right(ctimes, t - WINDOW_S)
        charged_max = max(charged_max, cprefix[i + 1] - cprefix[lo])
    store_ms = [e["store_s"] * 1000 for e in reserves]
    span = (times[-1] - times[0]) if len(times) > 1 else 0.0
    return {
        "reservations": len(reserves),
        "admitted": len(admitted),
        "refused": len(reserves) - len(admitted),
        "unsettled": len([r for r in by_rid if r not in settled]),
        "held_max_tokens": held_max,
        "charged_max_tokens_per_minute": charged_max,
        "over_tokens": max(0, held_max - QUOTA, charged_max - QUOTA),
        "charged_tokens": sum(c for _, c in charged),
        "admitted_span_s": span,
        "store_reserve_ms_p50": percentile(store_ms, 50),
        "store_reserve_ms_p99": percentile(store_ms, 99),
    }


def run_case(name: str, gateways: int, store: str, duration: float, tmp: Path,
             redis: RedisServer | None) -> dict[str, Any]:
    policy = yaml.safe_load((HERE / "b7_policy.yaml").read_text())
    if store == "redis":
        assert redis is not None
        policy["quota_store"] = {"kind": "redis", "url": redis.url, "key_prefix": f"b7-{name}:"}
    path = tmp / f"policy-{name}.yaml"
    path.write_text(yaml.safe_dump(policy, sort_keys=False))
    ledgers = [tmp / f"ledger-{name}-{i}.jsonl" for i in range(gateways)]
    procs = []
    try:
        urls = []
        for i, ledger in enumerate(ledgers):
            proc, url = start_gateway(path, ledger, tmp / f"gateway-{name}-{i}.log")
            procs.append(proc)
            urls.append(url)
        print(f"B7 {name}: {gateways} gateway(s), {store} store, 64 streams, {duration:g} s",
              file=sys.stderr, flush=True)
        bench = run_load(urls, 64 // gateways, duration, tmp)
    finally:
        for proc in procs:
            proc.terminate()
        for proc in procs:
            proc.wait(timeout=30)
    result = check(*read_ledgers(ledgers))
    completed = sum(_total(b, "completed") for b in bench)
    result.update({"case": name, "gateways": gateways, "store": store, "streams": 64,
                   "completed_requests": completed,
                   "refused_429": sum(_total(b, "rejected") for b in bench),
                   "errors": sum(_total(b, "errors") for b in bench)})
    return result


def _total(bench: dict, key: str) -> int:
    total = 0
    for run in bench.get("policies", {}).values():
        for row in run.get("sweep", []):
            total += int(row.get(key, 0) or 0)
    return total


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--duration", type=float, default=180.0)
    parser.add_argument("--json", default=str(HERE / "results" / "b7_quota.json"))
    parser.add_argument("--only", choices=["one", "four"])
    args = parser.parse_args()
    started = time.monotonic()
    cases = []
    with tempfile.TemporaryDirectory(prefix="qosgate-b7-") as tmp_name, RedisServer() as redis:
        tmp = Path(tmp_name)
        if args.only in (None, "one"):
            cases.append(run_case("one", 1, "memory", args.duration, tmp, None))
        if args.only in (None, "four"):
            cases.append(run_case("four", 4, "redis", args.duration, tmp, redis))
    print(f"\nB7 quotas hold (tokens_per_minute {QUOTA:,}; {os.cpu_count()} CPUs)\n")
    cols = ("case", "gateways", "store", "admitted", "refused", "held_max_tokens",
            "charged_max_tokens_per_minute", "over_tokens", "store_reserve_ms_p50",
            "store_reserve_ms_p99", "unsettled", "errors")
    print("  ".join(cols))
    for c in cases:
        print("  ".join(_fmt(c[k]) for k in cols))
    ok = all(c["over_tokens"] == 0 and c["unsettled"] == 0 for c in cases)
    redis_case = next((c for c in cases if c["store"] == "redis"), None)
    print(f"\n  {'PASS' if ok else 'FAIL'}  0 tokens over quota in any minute, every reservation settled")
    if redis_case is not None:
        p50 = redis_case["store_reserve_ms_p50"]
        print(f"  {'PASS' if p50 is not None and p50 < 1.0 else 'FAIL'}  "
              f"Redis check-and-reserve p50 < 1 ms: {_fmt(p50)} ms")
    out = {
        "benchmark": "B7",
        "command": " ".join(shlex.quote(a) for a in
                            [".venv/bin/python", "benchmarks/b7_quota.py", *sys.argv[1:]]),
        "machine": {"cpus": os.cpu_count(), "python": platform.python_version()},
        "quota_tokens_per_minute": QUOTA,
        "duration_s": args.duration,
        "wall_s": time.monotonic() - started,
        "cases": cases,
    }
    Path(args.json).parent.mkdir(parents=True, exist_ok=True)
    Path(args.json).write_text(json.dumps(out, indent=2))
    print(f"\nwrote {args.json}")
    return 0 if ok else 1


def _fmt(value: Any) -> str:
    if isinstance(value, float):
        return f"{value:.3f}"
    return str(value)


if __name__ == "__main__":
    sys.exit(main())
