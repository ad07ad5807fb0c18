"""B1: what qosgate adds in front of an upstream that answers at once.

    .venv/bin/python benchmarks/b1_overhead.py [--json benchmarks/results/b1_overhead.json]

One run, on one machine, side by side (B1 of benchmarks/RESULTS.md):

- an OpenAI-compatible upstream (benchmarks/b1_upstream.py, its own process)
  on two ports: one answers at once, one after 50 ms; always 8 tokens;
- one `qosgate serve` process per port (benchmarks/b1_policy.yaml with that
  upstream: one tier, budgets that never refuse);
- one floor proxy per port (benchmarks/b1_floor_proxy.py): a bare aiohttp
  proxy on qosgate's stack (uvloop, aiohttp, orjson) doing the same network
  work with no identity, validation, scheduling or metering. It is not a
  target: it shows how much of what qosgate adds is the Python HTTP stack on
  this machine, and how much is qosgate's own logic (qosgate over floor);
- the load generator of `qosgate bench` in its own process (one worker, one
  asyncio client), sending benchmarks/b1_load.yaml's requests closed-loop at
  concurrency 1, 16 and 64, non-streaming and streaming.

For each case, blocks alternate between (d) client -> upstream, (f) client
-> floor proxy -> upstream and (q) client -> qosgate -> upstream in the order
d f q q f d (then again), each block the same request count, so slow drift of
the machine falls on all three alike. Reported per case: end-to-end p50/p99
each way and what qosgate (and the floor) add over direct, TTFT likewise when
streaming, requests/s, and the CPU per request of qosgate and of the floor:
each process's CPU time (its threads' /proc/PID/task/*/schedstat, in
nanoseconds; utime + stime from /proc/PID/stat where the kernel keeps no
schedstat) over its own blocks divided by their requests; then qosgate over
floor (added p50 and CPU per request).

The targets (added p50 under 1 ms at concurrency 1; gateway CPU under 0.5 ms
per request) are about qosgate against direct and are printed as PASS/FAIL,
each with an informational line giving the floor's figure beside it; the exit
status is 0 unless the run itself broke (a request lost or failed, a process
that would not start): the figures are measurements.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import shlex
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
sys.path.insert(0, str(ROOT))

from qosgate.bench.commands import job_config, resolve_keys
from qosgate.bench.plan import sweep_pool
from qosgate.bench.pool import WorkerPool
from qosgate.bench.report import Record, records_from
from qosgate.bench.scenario import load_bench_scenario
from qosgate.observability.stats import percentile

TARGET_ADDED_P50_MS = 1.0
TARGET_CPU_MS = 0.5
CONCURRENCY = (1, 16, 64)
DELAYS_MS = (0, 50)
# Requests per case and target, split over the blocks. Sized so a case's
# blocks take a few seconds on a 2-core machine and the whole run < 2.5 min;
# 50 ms at c=1 gets 160 so the CPU per request is not mostly tick rounding.
REQUESTS = {
    0: {1: 800, 16: 2400, 64: 3200},
    50: {1: 160, 16: 640, 64: 2560},
}
TARGETS = ("direct", "floor", "qosgate")
# Each round is d f q q f d: 6 blocks, 2 per target.
ROUND_ORDER = ("direct", "floor", "qosgate", "qosgate", "floor", "direct")
ROUNDS = 2
BLOCKS_PER_TARGET = 2 * ROUNDS
WARMUP = 64  # unmeasured requests per target before a (delay, stream) group

CLK_TCK = os.sysconf("SC_CLK_TCK")


def _schedstat_ns(pid: int) -> int | None:
    """On-CPU nanoseconds of all of a process's threads (/proc/PID/task/*/schedstat),
    or None where the kernel keeps no schedstat."""
    total = 0
    try:
        for task in os.listdir(f"/proc/{pid}/task"):
            try:
                with open(f"/proc/{pid}/task/{task}/schedstat", "rb") as fh:
                    total += int(fh.read().split()[0])
            except FileNotFoundError:
                continue  # a thread that ended since the listing
    except FileNotFoundError:
        return None
    return total


CPU_SOURCE = "schedstat" if _schedstat_ns(os.getpid()) is not None else "stat"
"""Where CPU time is read: schedstat counts nanoseconds; /proc/PID/stat counts
whole clock ticks (10 ms), coarse against a fraction of a millisecond per
request over a few thousand requests."""


def cpu_seconds(pid: int) -> float:
    """CPU time of a process so far: its threads' schedstat, or utime + stime
    from /proc/PID/stat where schedstat is missing."""
    if CPU_SOURCE == "schedstat":
        ns = _schedstat_ns(pid)
        if ns is not None:
            return ns / 1e9
    with open(f"/proc/{pid}/stat", "rb") as fh:
        stat = fh.read()
    fields = stat[stat.rindex(b")") + 2 :].split()
    return (int(fields[11]) + int(fields[12])) / CLK_TCK


class Child:
    """A process this script starts, whose first stdout line says it is ready."""

    def __init__(self, name: str, argv: list[str], log_dir: Path, cwd: Path = ROOT) -> None:
        self.name = name
        self.stderr_path = log_dir / f"{name}.stderr"
        self.proc = subprocess.Popen(
            argv, stdout=subprocess.PIPE, stderr=self.stderr_path.open("wb"), cwd=cwd, text=True
        )
        self.first_line = self.proc.stdout.readline().strip() if self.proc.stdout else ""
        if not self.first_line:
            self.stop()
            raise RuntimeError(
                f"{name} did not start:\n{self.stderr_path.read_text(errors='replace')[-3000:]}"
            )
        # Keep draining stdout so a chatty child never blocks on a full pipe.
        threading.Thread(target=self._drain, daemon=True).start()

    def _drain(self) -> None:
        assert self.proc.stdout is not None
        for _ in self.proc.stdout:
            pass

    @property
    def pid(self) -> int:
        return self.proc.pid

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(timeout=15)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()


def _announced_url(child: Child) -> str:
    # "qosgate: serving the OpenAI API at http://127.0.0.1:PORT/v1", and the
    # floor proxy's "b1-floor: proxying at http://127.0.0.1:PORT/v1"
    url = child.first_line.rsplit(" ", 1)[-1]
    if not url.startswith("http://"):
        child.stop()
        raise RuntimeError(f"{child.name}: unexpected first line {child.first_line!r}")
    return url


def start_gateway(upstream_url: str, tmp: Path, name: str) -> tuple[Child, str]:
    policy = yaml.safe_load((HERE / "b1_policy.yaml").read_text())
    policy["backend"]["upstreams"][0]["url"] = upstream_url
    path = tmp / f"{name}.yaml"
    path.write_text(yaml.safe_dump(policy, sort_keys=False))
    child = Child(
        name,
        [sys.executable, "-m", "qosgate.cli", "serve", "--config", str(path),
         "--host", "127.0.0.1", "--port", "0"],
        tmp,
    )
    return child, _announced_url(child)


def start_floor(upstream_url: str, tmp: Path, name: str) -> tuple[Child, str]:
    child = Child(
        name,
        [sys.executable, str(HERE / "b1_floor_proxy.py"), upstream_url,
         "--host", "127.0.0.1", "--port", "0"],
        tmp,
    )
    return child, _announced_url(child)


def run_block(pool: WorkerPool, cfg: dict[str, Any], spec_pool: list[tuple], concurrency: int,
              requests: int) -> tuple[list[Record], float, list[str]]:
    payload = {"concurrency": concurrency, "pool": spec_pool, "requests": requests,
               "duration_s": None, "users": list(range(concurrency))}
    job = pool.run("closed", cfg, [payload])
    records = records_from(job.records)
    wall = max((r.end for r in records), default=0.0)
    return records, wall, job.failures


def summarise(records: list[Record], wall: float, planned: int) -> dict[str, Any]:
    done = [r for r in records if r.outcome == "completed"]
    e2e = [r.e2e for r in done]
    ttft = [r.ttft for r in done if r.ttft is not None]

    def ms(values: list[float], q: float) -> float | None:
        value = percentile(values, q)
        return None if value is None else value * 1000

    return {
        "requests": len(records),
        "completed": len(done),
        "errors": len(records) - len(done),
        "error_types": sorted({r.error_type or r.outcome for r in records if r.outcome != "completed"}),
        "lost": planned - len(records),
        "e2e_p50_ms": ms(e2e, 50),
        "e2e_p99_ms": ms(e2e, 99),
        "ttft_p50_ms": ms(ttft, 50),
        "ttft_p99_ms": ms(ttft, 99),
        "requests_per_s": len(done) / wall if wall > 0 else None,
        "wall_s": wall,
    }


def _diff(a: float | None, b: float | None) -> float | None:
    return None if a is None or b is None else a - b


def run(args: argparse.Namespace) -> dict[str, Any]:
    delays = [int(d) for d in args.delays.split(",")]
    levels = [int(c) for c in args.concurrency.split(",")]
    unknown = [d for d in delays if d not in REQUESTS]
    if unknown:
        raise SystemExit(f"--delays: no request counts for {unknown} (known: {sorted(REQUESTS)})")
    scenario = load_bench_scenario(HERE / "b1_load.yaml")
    keys = resolve_keys(scenario)
    scale = args.scale
    rows: list[dict[str, Any]] = []
    broken: list[str] = []
    started = time.monotonic()
    with tempfile.TemporaryDirectory(prefix="qosgate-b1-") as tmp_name:
        tmp = Path(tmp_name)
        children: list[Child] = []
        try:
            upstream = Child(
                "upstream",
                [sys.executable, str(HERE / "b1_upstream.py"),
                 "--delays", ",".join(str(d) for d in delays)],
                tmp,
            )
            children.append(upstream)
            ports = json.loads(upstream.first_line)["ports"]
            gateways: dict[int, tuple[Child, str]] = {}
            floors: dict[int, tuple[Child, str]] = {}
            for delay in delays:
                upstream_url = f"http://127.0.0.1:{ports[str(delay)]}/v1"
                child, url = start_gateway(upstream_url, tmp, f"qosgate-{delay}ms")
                children.append(child)
                gateways[delay] = (child, url)
                child, url = start_floor(upstream_url, tmp, f"floor-{delay}ms")
                children.append(child)
                floors[delay] = (child, url)
            with WorkerPool(1) as pool:
                print(f"B1: upstream pid {upstream.pid}, qosgate pids "
                      f"{', '.join(str(g[0].pid) for g in gateways.values())}, floor pids "
                      f"{', '.join(str(f[0].pid) for f in floors.values())}, "
                      f"load generator pid {pool.pids[0]}", file=sys.stderr, flush=True)
                for delay in delays:
                    gateway, gateway_url = gateways[delay]
                    floor, floor_url = floors[delay]
                    # The process whose CPU a target's blocks are charged to.
                    proxy_pid = {"direct": None, "floor": floor.pid, "qosgate": gateway.pid}
                    direct_url = f"http://127.0.0.1:{ports[str(delay)]}/v1"
                    urls = {"direct": direct_url, "floor": floor_url, "qosgate": gateway_url}
                    for stream in (False, True):
                        cfgs = {}
                        for target, url in urls.items():
                            cfg = job_config(scenario, url, keys, scenario.seed)
                            cfg["stream"] = stream
                            cfgs[target] = cfg
                        # Every request is alike (fixed lengths); a worker numbers
                        # them itself, so one drawn request serves as the pool.
                        specs = sweep_pool(scenario, 1)[:1]
                        for target in TARGETS:
                            _, _, failures = run_block(pool, cfgs[target], specs, 16, WARMUP)
                            broken.extend(failures)
                        for concurrency in levels:
                            base = REQUESTS[delay].get(concurrency, 40 * concurrency)
                            total = max(BLOCKS_PER_TARGET, int(base * scale))
                            per_block = max(1, total // BLOCKS_PER_TARGET)
                            collected: dict[str, dict[str, Any]] = {
                                t: {"records": [], "wall": 0.0, "cpu": 0.0, "up_cpu": 0.0,
                                    "planned": 0}
                                for t in TARGETS
                            }
                            for target in ROUND_ORDER * ROUNDS:
                                pid = proxy_pid[target]
                                proxy_before = cpu_seconds(pid) if pid else 0.0
                                up_before = cpu_seconds(upstream.pid)
                                records, wall, failures = run_block(
                                    pool, cfgs[target], specs, concurrency, per_block
                                )
                                proxy_cpu = cpu_seconds(pid) - proxy_before if pid else 0.0
                                up_cpu = cpu_seconds(upstream.pid) - up_before
                                broken.extend(failures)
                                slot = collected[target]
                                slot["records"].extend(records)
                                slot["wall"] += wall
                                slot["cpu"] += proxy_cpu
                                slot["up_cpu"] += up_cpu
                                slot["planned"] += per_block
                            row = case_row(delay, stream, concurrency, collected)
                            rows.append(row)
                            print(progress(row), file=sys.stderr, flush=True)
        finally:
            for child in reversed(children):
                child.stop()
    return {
        "benchmark": "B1",
        "command": " ".join(shlex.quote(a) for a in [".venv/bin/python", "benchmarks/b1_overhead.py",
                                                       *sys.argv[1:]]),
        "machine": {
            "cpus": os.cpu_count(),
            "python": platform.python_version(),
            "platform": platform.platform(),
            "processor": platform.processor() or platform.machine(),
        },
        "upstream_output_tokens": 8,
        "rounds": ROUNDS,
        "cpu_source": CPU_SOURCE,
        "block_order": list(ROUND_ORDER),
        "run_s": time.monotonic() - started,
        "rows": rows,
        "targets": targets(rows),
        "failures": broken,
    }


def case_row(delay: int, stream: bool, concurrency: int, collected: dict[str, dict]) -> dict:
    out: dict[str, Any] = {"upstream_delay_ms": delay, "stream": stream,
                           "concurrency": concurrency}
    for target, slot in collected.items():
        summary = summarise(slot["records"], slot["wall"], slot["planned"])
        done = summary["completed"] or 0
        summary["upstream_cpu_ms_per_request"] = slot["up_cpu"] * 1000 / done if done else None
        if target != "direct":
            summary["cpu_ms_per_request"] = slot["cpu"] * 1000 / done if done else None
            summary["cpu_s"] = slot["cpu"]
            # /proc/PID/stat counts whole clock ticks: each block's reading can
            # be off by one tick. schedstat's nanoseconds are exact enough.
            summary["cpu_resolution_ms_per_request"] = (
                BLOCKS_PER_TARGET * 1000 / CLK_TCK / done
                if done and CPU_SOURCE == "stat" else None
            )
        out[target] = summary
    d, f, g = out["direct"], out["floor"], out["qosgate"]

    def ratio(a: float | None, b: float | None) -> float | None:
        return a / b if a and b else None

    # qosgate against direct (the targets' figures; keys as before the floor).
    out["added_e2e_p50_ms"] = _diff(g["e2e_p50_ms"], d["e2e_p50_ms"])
    out["added_e2e_p99_ms"] = _diff(g["e2e_p99_ms"], d["e2e_p99_ms"])
    out["added_ttft_p50_ms"] = _diff(g["ttft_p50_ms"], d["ttft_p50_ms"]) if stream else None
    out["added_ttft_p99_ms"] = _diff(g["ttft_p99_ms"], d["ttft_p99_ms"]) if stream else None
    out["rps_ratio"] = ratio(g["requests_per_s"], d["requests_per_s"])
    # The floor proxy against direct: what the Python HTTP stack alone adds.
    out["floor_added_e2e_p50_ms"] = _diff(f["e2e_p50_ms"], d["e2e_p50_ms"])
    out["floor_added_e2e_p99_ms"] = _diff(f["e2e_p99_ms"], d["e2e_p99_ms"])
    out["floor_added_ttft_p50_ms"] = _diff(f["ttft_p50_ms"], d["ttft_p50_ms"]) if stream else None
    out["floor_added_ttft_p99_ms"] = _diff(f["ttft_p99_ms"], d["ttft_p99_ms"]) if stream else None
    out["floor_rps_ratio"] = ratio(f["requests_per_s"], d["requests_per_s"])
    # qosgate against the floor: what qosgate's own logic adds.
    over = "qosgate_over_floor_"
    out[over + "e2e_p50_ms"] = _diff(g["e2e_p50_ms"], f["e2e_p50_ms"])
    out[over + "e2e_p99_ms"] = _diff(g["e2e_p99_ms"], f["e2e_p99_ms"])
    out[over + "ttft_p50_ms"] = _diff(g["ttft_p50_ms"], f["ttft_p50_ms"]) if stream else None
    out[over + "cpu_ms_per_request"] = _diff(g["cpu_ms_per_request"], f["cpu_ms_per_request"])
    out["qosgate_over_floor_rps_ratio"] = ratio(g["requests_per_s"], f["requests_per_s"])
    return out


def progress(row: dict) -> str:
    mode = "stream" if row["stream"] else "json"
    return (
        f"  {row['upstream_delay_ms']:>2} ms upstream, {mode:>6}, c={row['concurrency']:<2}:"
        f" added p50 {fmt(row['added_e2e_p50_ms'], '.3f')} ms"
        f" (floor {fmt(row['floor_added_e2e_p50_ms'], '.3f')}),"
        f" qosgate CPU {fmt(row['qosgate']['cpu_ms_per_request'], '.3f')} ms/req"
        f" (floor {fmt(row['floor']['cpu_ms_per_request'], '.3f')})"
    )


def targets(rows: list[dict]) -> list[dict]:
    checks = []
    for row in rows:
        case = (f"{row['upstream_delay_ms']} ms upstream, "
                f"{'stream' if row['stream'] else 'json'}, c={row['concurrency']}")
        # floor_value: the floor proxy's figure for the same check, and
        # qosgate_over_floor: qosgate's minus it; information only, never `passed`.
        if row["concurrency"] == 1:
            value = row["added_e2e_p50_ms"]
            checks.append({"name": f"added p50 < {TARGET_ADDED_P50_MS:g} ms ({case})",
                           "value": value, "threshold": TARGET_ADDED_P50_MS,
                           "passed": value is not None and value < TARGET_ADDED_P50_MS,
                           "floor_value": row.get("floor_added_e2e_p50_ms"),
                           "qosgate_over_floor": row.get("qosgate_over_floor_e2e_p50_ms")})
        value = row["qosgate"].get("cpu_ms_per_request")
        checks.append({"name": f"qosgate CPU < {TARGET_CPU_MS:g} ms/request ({case})",
                       "value": value, "threshold": TARGET_CPU_MS,
                       "passed": value is not None and value < TARGET_CPU_MS,
                       "floor_value": (row.get("floor") or {}).get("cpu_ms_per_request"),
                       "qosgate_over_floor": row.get("qosgate_over_floor_cpu_ms_per_request")})
    return checks


def fmt(value: Any, spec: str = ".2f") -> str:
    return "-" if value is None else f"{value:{spec}}"


def table(result: dict[str, Any]) -> str:
    lines = [
        (
            f"B1 gateway overhead ({result['machine']['cpus']} CPUs, Python "
            f"{result['machine']['python']}; upstream answers 8 tokens; e2e in ms;"
            " floor = bare aiohttp proxy, benchmarks/b1_floor_proxy.py)"
        ),
        "",
        (
            "upstream  mode    conc  requests  direct p50  direct p99  floor p50  floor p99"
            "  qosgate p50  qosgate p99  added p50  added p99  added TTFT p50"
            "  floor added p50  q-over-floor p50  direct req/s  floor req/s  qosgate req/s"
            "  floor CPU ms/req  qosgate CPU ms/req  q-over-floor CPU"
            "  upstream CPU ms/req (direct/floor/qosgate)  errors  lost"
        ),
    ]
    for row in result["rows"]:
        d, f, g = row["direct"], row["floor"], row["qosgate"]
        lines.append(
            f"{row['upstream_delay_ms']:>5} ms  {'stream' if row['stream'] else 'json':<6}"
            f" {row['concurrency']:>5} {g['requests']:>9}"
            f" {fmt(d['e2e_p50_ms'], '.3f'):>11} {fmt(d['e2e_p99_ms'], '.3f'):>11}"
            f" {fmt(f['e2e_p50_ms'], '.3f'):>10} {fmt(f['e2e_p99_ms'], '.3f'):>10}"
            f" {fmt(g['e2e_p50_ms'], '.3f'):>12} {fmt(g['e2e_p99_ms'], '.3f'):>12}"
            f" {fmt(row['added_e2e_p50_ms'], '.3f'):>10} {fmt(row['added_e2e_p99_ms'], '.3f'):>10}"
            f" {fmt(row['added_ttft_p50_ms'], '.3f'):>15}"
            f" {fmt(row['floor_added_e2e_p50_ms'], '.3f'):>16}"
            f" {fmt(row['qosgate_over_floor_e2e_p50_ms'], '.3f'):>17}"
            f" {fmt(d['requests_per_s'], '.0f'):>13} {fmt(f['requests_per_s'], '.0f'):>12}"
            f" {fmt(g['requests_per_s'], '.0f'):>14}"
            f" {fmt(f['cpu_ms_per_request'], '.3f'):>17}"
            f" {fmt(g['cpu_ms_per_request'], '.3f'):>19}"
            f" {fmt(row['qosgate_over_floor_cpu_ms_per_request'], '.3f'):>17}"
            f" {fmt(d['upstream_cpu_ms_per_request'], '.3f'):>19} /"
            f" {fmt(f['upstream_cpu_ms_per_request'], '.3f')} /"
            f" {fmt(g['upstream_cpu_ms_per_request'], '.3f'):<13}"
            f" {d['errors'] + f['errors'] + g['errors']:>7}"
            f" {d['lost'] + f['lost'] + g['lost']:>5}"
        )
    lines.append("")
    lines.append("targets (qosgate against direct; measurements, they do not set the exit status;")
    lines.append("each followed by the floor proxy's figure for the same check, for information)")
    for check in result["targets"]:
        verdict = "PASS" if check["passed"] else "FAIL"
        lines.append(f"  {verdict}  {check['name']}: {fmt(check['value'], '.3f')}")
        floor = check.get("floor_value")
        # Where the bare proxy alone misses the threshold, no gateway on this
        # stack meets it on this machine: say so beside the verdict.
        alone = (" (the floor alone misses it)"
                 if floor is not None and floor >= check["threshold"] else "")
        lines.append(f"        info  floor proxy: {fmt(floor, '.3f')},"
                     f" qosgate over floor: {fmt(check.get('qosgate_over_floor'), '.3f')}{alone}")
    lines.append("")
    lines.append(f"run took {result['run_s']:.0f} s")
    if result["failures"]:
        lines.append(f"load generator failures: {len(result['failures'])}")
    return "\n".join(lines)


def main() -> int:
    parser = argparse.ArgumentParser(description="B1: gateway overhead against a direct upstream")
    parser.add_argument("--json", dest="json_path", default=str(HERE / "results" / "b1_overhead.json"),
                        help="write the results JSON here")
    parser.add_argument("--scale", type=float, default=1.0,
                        help="multiply every block's request count (0.1 for a smoke run)")
    parser.add_argument("--delays", default=",".join(map(str, DELAYS_MS)),
                        help="upstream delays in ms to run (default: 0,50)")
    parser.add_argument("--concurrency", default=",".join(map(str, CONCURRENCY)),
                        help="concurrency levels to run (default: 1,16,64)")
    args = parser.parse_args()
    result = run(args)
    print(table(result))
    path = Path(args.json_path)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(result, indent=2))
    print(f"wrote {path}")
    lost = sum(row[t]["lost"] for row in result["rows"] for t in TARGETS)
    errors = sum(row[t]["errors"] for row in result["rows"] for t in TARGETS)
    if lost or result["failures"]:
        print(f"B1 broke: {lost} requests lost, {len(result['failures'])} load generator failures",
              file=sys.stderr)
        return 1
    if errors:
        print(f"B1: {errors} requests failed (see error_types in the JSON)", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
