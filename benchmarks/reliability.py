"""Load held and soak: qosgate's own process watched from outside.

    python benchmarks/reliability.py load [--requests 10000]
    python benchmarks/reliability.py soak [--minutes 10] [--load 0.8]

`load`: one `qosgate serve` on a slow simulated GPU, then `--requests`
requests sent at once (one closed-loop user each, one request per user, by
`qosgate bench`). Every request must be answered; the gateway's resident
memory and open file descriptors are sampled throughout, and the memory per
queued request is (RSS at the deepest queue - RSS idle) / that depth. It
counts everything one queued request holds in the gateway: its connection,
its handler, its request record.

`soak`: the same gateway. Its capacity is measured first (a closed loop at
high concurrency), then open-loop Poisson arrivals at `--load` of it for
`--minutes`; RSS and file descriptors are sampled every few seconds, and the
growth between the end of the first minute and the end of the run is what is
reported (with the least-squares slope over the rest).

Both write benchmarks/results/reliability_<mode>.json and print a table.
Loopback only; nothing leaves the machine.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import threading
import time
import urllib.request
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
RESULTS = ROOT / "benchmarks" / "results"
KEY = "reliability-bench-key"
ADMIN = "reliability-admin"

POLICY = """
version: 1
server:
  admin_token_env: QG_RELIABILITY_ADMIN
  shutdown_grace_s: 5
backend:
  kind: sim
  speed: {speed}
  max_num_seqs: {seqs}
  model: sim-llama3-8b
tiers:
  standard:
    priority: 0
    max_queue_wait_ms: 900000
    max_queue_len: 50000
tenants:
  - id: load
    tier: standard
    api_keys: ["env:QG_RELIABILITY_KEY"]
    quotas: {{tokens_per_minute: 1000000000}}
observability:
  log_requests: false
"""

SCENARIO = """
kind: bench
name: reliability-{name}
mode: {mode}
model: sim-llama3-8b
endpoint: chat
stream: {stream}
seed: 11
timeout_s: 900
lengths:
  prompt: {{median: 64, sigma: 0.3, max: 256}}
  output: {{median: 16, sigma: 0.3, max: 48}}
classes:
  - {{name: load, tier: standard, api_key_env: QG_RELIABILITY_KEY}}
tiers:
  standard: {{}}
{extra}
"""


def rss_bytes(pid: int) -> int:
    with open(f"/proc/{pid}/status") as fh:
        for line in fh:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) * 1024
    raise RuntimeError("no VmRSS")


def open_fds(pid: int) -> int:
    return len(os.listdir(f"/proc/{pid}/fd"))


class Gateway:
    def __init__(self, tmp: Path, speed: float, seqs: int) -> None:
        policy = tmp / "policy.yaml"
        policy.write_text(POLICY.format(speed=speed, seqs=seqs))
        self.env = {**os.environ, "QG_RELIABILITY_KEY": KEY, "QG_RELIABILITY_ADMIN": ADMIN}
        self.stderr = tmp / "gateway.stderr"
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "qosgate.cli", "serve", "--config", str(policy), "--port", "0"],
            stdout=subprocess.PIPE, stderr=self.stderr.open("wb"), env=self.env, text=True,
            cwd=ROOT,
        )  # fmt: skip
        assert self.proc.stdout is not None
        line = self.proc.stdout.readline().strip()
        if "serving the OpenAI API at" not in line:
            self.proc.kill()
            raise RuntimeError(f"gateway did not start: {line}\n{self.stderr.read_text()[-2000:]}")
        self.url = line.rsplit(" ", 1)[1]
        self.base = self.url.removesuffix("/v1")
        threading.Thread(target=lambda: [None for _ in self.proc.stdout], daemon=True).start()

    @property
    def pid(self) -> int:
        return self.proc.pid

    def stats(self) -> dict[str, Any]:
        req = urllib.request.Request(
            self.base + "/admin/stats", headers={"Authorization": f"Bearer {ADMIN}"}
        )
        with urllib.request.urlopen(req, timeout=30) as r:
            return json.loads(r.read())

    def outcomes(self) -> dict[str, float]:
        with urllib.request.urlopen(self.base + "/metrics", timeout=30) as r:
            text = r.read().decode()
        counts: dict[str, float] = {}
        for line in text.splitlines():
            if line.startswith("qosgate_requests_total{"):
                labels, value = line.rsplit(" ", 1)
                outcome = labels.split('outcome="', 1)[1].split('"', 1)[0]
                counts[outcome] = counts.get(outcome, 0) + float(value)
        return counts

    def stop(self) -> int:
        self.proc.terminate()
        return self.proc.wait(timeout=60)


class Sampler:
    """RSS, file descriptors and queue depth of the gateway, every `every_s`."""

    def __init__(self, gateway: Gateway, every_s: float, queue: bool) -> None:
        self.gateway = gateway
        self.every_s = every_s
        self.queue = queue
        self.samples: list[dict[str, float]] = []
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)
        self.t0 = time.monotonic()

    def __enter__(self) -> Sampler:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join()

    def _run(self) -> None:
        while not self._stop.wait(self.every_s):
            sample = {
                "t": time.monotonic() - self.t0,
                "rss": rss_bytes(self.gateway.pid),
                "fds": open_fds(self.gateway.pid),
            }
            if self.queue:
                stats = self.gateway.stats()
                sample["queued"] = stats["scheduler"]["queued"]
                sample["running"] = stats["scheduler"]["running"]
            self.samples.append(sample)


def bench(gateway: Gateway, tmp: Path, name: str, mode: str, extra: str, stream: bool,
          workers: int) -> dict[str, Any]:  # fmt: skip
    scenario = tmp / f"{name}.yaml"
    scenario.write_text(SCENARIO.format(
        name=name, mode=mode, extra=extra, stream=str(stream).lower()
    ))  # fmt: skip
    out = tmp / f"{name}.json"
    run = subprocess.run(
        [sys.executable, "-m", "qosgate.cli", "bench", gateway.url, str(scenario), "--json",
         str(out), "--workers", str(workers), "--quiet"],
        env=gateway.env, cwd=ROOT, capture_output=True, text=True,
    )  # fmt: skip
    if run.returncode not in (0, 1) or not out.exists():
        raise RuntimeError(f"qosgate bench failed ({run.returncode}):\n{run.stderr[-3000:]}")
    (report,) = json.loads(out.read_text())["policies"].values()
    return report


def settle_idle(gateway: Gateway) -> dict[str, Any]:
    """Until nothing is queued or running (a benchmark's sampling, not the product's)."""
    deadline = time.monotonic() + 120
    while time.monotonic() < deadline:
        stats = gateway.stats()
        if stats["scheduler"]["queued"] == 0 and stats["scheduler"]["running"] == 0:
            return stats
        time.sleep(0.2)
    raise RuntimeError("the gateway did not go idle")


def mb(n: float) -> float:
    return round(n / 2**20, 1)


class Run:
    """One measured bench run against a gateway, then its stop: what the
    client saw, what the gateway counted, and the samples taken meanwhile."""

    def __init__(self, gateway: Gateway, sampler: Sampler, result: dict[str, Any],
                 before: dict[str, float], wall_s: float) -> None:  # fmt: skip
        settle_idle(gateway)
        after = gateway.outcomes()
        self.end_rss, self.end_fds = rss_bytes(gateway.pid), open_fds(gateway.pid)
        self.exit_code = gateway.stop()
        self.samples = sampler.samples
        self.totals = result["totals"]
        counted = {k: after.get(k, 0) - before.get(k, 0) for k in after}
        self.common = {
            "sent": self.totals["sent"],
            "completed": self.totals["completed"],
            "rejected": self.totals["rejected"],
            "errors": self.totals["errors"],
            "lost": self.totals["lost"],
            "gateway_outcomes": {k: int(v) for k, v in counted.items() if v},
            "gateway_outcome_total": int(sum(counted.values())),
            "wall_s": round(wall_s, 1),
        }


def measured(gateway: Gateway, tmp: Path, name: str, mode: str, extra: str, stream: bool,
             workers: int, every_s: float, queue: bool) -> Run:  # fmt: skip
    settle_idle(gateway)
    before = gateway.outcomes()
    began = time.monotonic()
    with Sampler(gateway, every_s, queue=queue) as sampler:
        result = bench(gateway, tmp, name, mode, extra, stream, workers)
    return Run(gateway, sampler, result, before, time.monotonic() - began)


def load(args: argparse.Namespace) -> dict[str, Any]:
    with tempfile.TemporaryDirectory() as tmp_name:
        tmp = Path(tmp_name)
        gateway = Gateway(tmp, speed=args.speed, seqs=64)
        try:
            bench(gateway, tmp, "warmup", "sweep", "sweep: {concurrency: [8], requests: 64}",
                  False, 1)  # fmt: skip
            settle_idle(gateway)
            idle_rss, idle_fds = rss_bytes(gateway.pid), open_fds(gateway.pid)
            run = measured(
                gateway, tmp, "burst", "sweep",
                f"sweep: {{concurrency: [{args.requests}], requests: {args.requests}}}",
                args.stream, args.workers, 0.25, True,
            )  # fmt: skip
        finally:
            if gateway.proc.poll() is None:
                gateway.proc.kill()
    deepest = max(run.samples, key=lambda s: s["queued"] + s["running"])
    held = deepest["queued"] + deepest["running"]
    return {
        "mode": "load",
        "requests": args.requests,
        "stream": args.stream,
        "sim_speed": args.speed,
        **run.common,
        "deepest_queued": deepest["queued"],
        "deepest_running": deepest["running"],
        "rss_idle_mb": mb(idle_rss),
        "rss_deepest_mb": mb(deepest["rss"]),
        "rss_peak_mb": mb(max(s["rss"] for s in run.samples)),
        "rss_after_mb": mb(run.end_rss),
        "bytes_per_held_request": round((deepest["rss"] - idle_rss) / max(1, held)),
        "fds_idle": idle_fds,
        "fds_peak": max(s["fds"] for s in run.samples),
        "fds_after": run.end_fds,
        "gateway_exit_code": run.exit_code,
    }


def soak(args: argparse.Namespace) -> dict[str, Any]:
    with tempfile.TemporaryDirectory() as tmp_name:
        tmp = Path(tmp_name)
        gateway = Gateway(tmp, speed=args.speed, seqs=64)
        try:
            capacity = bench(gateway, tmp, "capacity", "sweep",
                             "sweep: {concurrency: [256], duration_s: 30}", args.stream, 2)
            capacity_rps = capacity["totals"]["throughput_rps"]
            rate = round(args.load * capacity_rps, 1)
            run = measured(
                gateway, tmp, "soak", "open",
                f"duration_s: {args.minutes * 60}\narrivals: {{process: poisson, rate_rps: {rate}}}",
                args.stream, 2, 5.0, False,
            )  # fmt: skip
        finally:
            if gateway.proc.poll() is None:
                gateway.proc.kill()
    samples = run.samples
    warm = [s for s in samples if s["t"] >= 60] or samples
    first, last = warm[0], warm[-1]
    ts = [s["t"] for s in warm]
    slope = statistics.linear_regression(ts, [s["rss"] for s in warm]).slope if len(warm) > 2 else 0
    return {
        "mode": "soak",
        "minutes": args.minutes,
        "stream": args.stream,
        "sim_speed": args.speed,
        "capacity_rps": round(capacity_rps, 1),
        "offered_rps": rate,
        **run.common,
        "e2e_p99_s": run.totals.get("e2e_p99_s"),
        "samples": len(samples),
        "rss_at_1min_mb": mb(first["rss"]),
        "rss_at_end_mb": mb(last["rss"]),
        "rss_min_mb": mb(min(s["rss"] for s in warm)),
        "rss_max_mb": mb(max(s["rss"] for s in warm)),
        "rss_slope_mb_per_min": round(slope * 60 / 2**20, 3),
        "rss_after_mb": mb(run.end_rss),
        "fds_at_1min": first["fds"],
        "fds_at_end": last["fds"],
        "fds_max": max(s["fds"] for s in warm),
        "fds_after": run.end_fds,
        "gateway_exit_code": run.exit_code,
        "series": [{"t": round(s["t"]), "rss_mb": mb(s["rss"]), "fds": s["fds"]} for s in samples],
    }


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    sub = parser.add_subparsers(dest="mode", required=True)
    p_load = sub.add_parser("load", help="N requests at once against a slow simulated GPU")
    p_load.add_argument("--requests", type=int, default=10_000)
    p_load.add_argument("--speed", type=float, default=0.25,
                        help="sim speed (below 1: slower than the modelled H100)")
    p_load.add_argument("--workers", type=int, default=2)
    p_load.add_argument("--stream", action="store_true")
    p_soak = sub.add_parser("soak", help="minutes at a fraction of capacity")
    p_soak.add_argument("--minutes", type=float, default=10)
    p_soak.add_argument("--load", type=float, default=0.8)
    p_soak.add_argument("--speed", type=float, default=0.25)
    p_soak.add_argument("--stream", action="store_true", default=True)
    args = parser.parse_args()
    result = load(args) if args.mode == "load" else soak(args)
    RESULTS.mkdir(parents=True, exist_ok=True)
    path = RESULTS / f"reliability_{args.mode}.json"
    path.write_text(json.dumps(result, indent=2) + "\n")
    for key, value in result.items():
        if key != "series":
            print(f"{key:>26}: {value}")
    print(f"written to {path.relative_to(ROOT)}")
    answered = result["sent"] == result["gateway_outcome_total"] and not result["lost"]
    return 0 if answered and result["gateway_exit_code"] == 0 else 1


if __name__ == "__main__":
    sys.exit(main())
