"""B6: the batch window (`tiers.<t>.batch.max_wait_ms`) against throughput and p95 TTFT.

    .venv/bin/python benchmarks/b6_batch_window.py [--json benchmarks/results/b6_batch_window.json]
                                                   [--plot benchmarks/results/b6_batch_window.png]

One tier, `max_wait_ms` 0, 1, 5, 10 and 50, each at offered loads from 0.5x
to 1.2x capacity (Poisson arrivals), on three backends:

- calibrated: `qosgate simulate`'s engine with the profile fitted to vLLM's
  CPU build serving the tests' tiny model (benchmarks/fidelity.py wrote it:
  benchmarks/results/tiny-cpu-profile.yaml);
- gpu: the simulated H100 with Llama-3-8B (the built-in h100-llama3-8b);
- fixed-cost: `qosgate serve` live, its `openai` backend in front of a small
  aiohttp server here that sleeps a fixed time per call and then answers (at
  most `CALLS` calls at once: the backend's max_concurrency), whatever the
  call asks.

Per backend and window: throughput (prompt and output tokens/s of the
completed requests, delivered inside the measurement window) and p95 TTFT at each
load, and the knee: the highest throughput reached with p95 TTFT within
KNEE_FACTOR x the window-0 run's at the lowest load. A table goes to stdout
and the JSON, the curves to the PNG.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
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
sys.path.insert(0, str(HERE))

from fidelity import request_log  # noqa: E402

from qosgate.observability.stats import percentile  # noqa: E402

WINDOWS_MS = (0, 1, 5, 10, 50)
LOADS = (0.5, 0.8, 1.0, 1.2)
KNEE_FACTOR = 2.0
SIM_DURATION_S, SIM_WARMUP_S = 60.0, 10.0
LIVE_DURATION_S, LIVE_WARMUP_S = 12.0, 2.0
FIXED_COST_MS = 100.0
CALLS = 4
"""The fixed-cost upstream's calls at once: its capacity is CALLS / the cost."""
CALIBRATED = HERE / "results" / "tiny-cpu-profile.yaml"
TIER = {"priority": 1, "max_queue_wait_ms": 60000, "on_timeout": "delay", "max_tokens": 2048}
KEY = "b6-key"


def policy(window_ms: float, backend: dict[str, Any]) -> dict[str, Any]:
    import hashlib

    digest = hashlib.sha256(KEY.encode()).hexdigest()
    return {
        "version": 1,
        "server": {"host": "127.0.0.1", "port": 0, "admin_token_env": None},
        "backend": backend,
        "scheduler": {"policy": "qos", "admission": False},
        "tiers": {"standard": {**TIER, "batch": {"max_wait_ms": window_ms}}},
        "tenants": [{"id": "b6", "tier": "standard", "api_keys": [f"sha256:{digest}"]}],
        "observability": {"log_requests": True, "log_format": "json"},
    }  # fmt: skip


# -- the simulated engines ----------------------------------------------------


def simulated(profile: str, lengths: dict[str, Any], tmp: Path) -> dict[str, Any]:
    from qosgate.sim.commands import Simulation
    from qosgate.sim.scenario import load_scenario

    rows: dict[str, Any] = {}
    capacity = None
    for window in WINDOWS_MS:
        scenario = {
            "kind": "traffic", "name": f"b6-{Path(profile).stem}-{window}", "seed": 6,
            "duration_s": SIM_DURATION_S, "warmup_s": SIM_WARMUP_S, "drain_s": 120,
            "policies": ["qos"], "engine": {"profile": profile},
            "arrivals": {"process": "poisson", "load": 1.0}, "lengths": lengths,
            "classes": [{"tenant": "b6", "share": 1}],
            "policy": policy(window, {"kind": "sim"}),
        }  # fmt: skip
        path = tmp / f"{scenario['name']}.yaml"
        path.write_text(yaml.safe_dump(scenario, sort_keys=False))
        simulation = Simulation(load_scenario(path), seed=6, quiet=True)
        capacity = simulation.capacity_rps
        points = []
        for load in LOADS:
            result, series = simulation.run(load, ("qos",))
            report = result["policies"]["qos"]
            ttfts = [ttft for arrival, _, ttft in series["qos"]["ttft"]
                     if SIM_WARMUP_S <= arrival < SIM_DURATION_S]  # fmt: skip
            points.append({
                "load": load,
                "throughput_tokens_per_s": report["totals"]["throughput_tokens_per_s"],
                "ttft_p95_s": percentile(ttfts, 95),
                "batch_size_mean": report["engine"]["batch_size_mean"],
            })  # fmt: skip
        rows[str(window)] = points
    return {"capacity_rps": capacity, "windows": rows}


# -- the fixed-cost upstream, live ----------------------------------------------


async def fixed_cost_upstream(port_box: list[int], stop: asyncio.Event) -> None:
    """An OpenAI-compatible server whose every call costs FIXED_COST_MS, then
    answers at once (streamed or not) with max_tokens one-word tokens."""
    from aiohttp import web

    async def models(request: web.Request) -> web.Response:
        return web.json_response({"object": "list", "data": [
            {"id": "fixed", "object": "model", "created": 0, "owned_by": "b6"}]})

    async def completions(request: web.Request) -> web.StreamResponse:
        body = await request.json()
        await asyncio.sleep(FIXED_COST_MS / 1000.0)
        tokens = int(body.get("max_tokens") or 16)
        prompt = body.get("prompt")
        prompt_tokens = len(prompt) if isinstance(prompt, list) else len(str(prompt).split())
        usage = {"prompt_tokens": prompt_tokens, "completion_tokens": tokens,
                 "total_tokens": prompt_tokens + tokens}  # fmt: skip
        if not body.get("stream"):
            return web.json_response({
                "id": "cmpl-b6", "object": "text_completion", "created": 0, "model": "fixed",
                "choices": [{"index": 0, "text": " x" * tokens, "finish_reason": "length"}],
                "usage": usage,
            })  # fmt: skip
        response = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
        await response.prepare(request)
        chunks = []
        for n in range(tokens):
            chunks.append({"id": "cmpl-b6", "object": "text_completion", "created": 0,
                           "model": "fixed", "choices": [{"index": 0, "text": " x",
                           "finish_reason": "length" if n == tokens - 1 else None}]})  # fmt: skip
        chunks.append({"id": "cmpl-b6", "object": "text_completion", "created": 0,
                       "model": "fixed", "choices": [], "usage": usage})  # fmt: skip
        await response.write(b"".join(b"data: " + json.dumps(c).encode() + b"\n\n" for c in chunks)
                             + b"data: [DONE]\n\n")
        return response

    app = web.Application()
    app.router.add_get("/v1/models", models)
    app.router.add_post("/v1/completions", completions)
    runner = web.AppRunner(app, access_log=None)
    await runner.setup()
    site = web.TCPSite(runner, "127.0.0.1", 0)
    await site.start()
    port_box.append(site._server.sockets[0].getsockname()[1])  # type: ignore[union-attr]
    await stop.wait()
    await runner.cleanup()


def live_fixed_cost(lengths: dict[str, Any], tmp: Path) -> dict[str, Any]:
    import threading

    from b8_vllm import start_gateway, stop

    loop = asyncio.new_event_loop()
    port_box: list[int] = []
    stopped = asyncio.Event()
    ready = threading.Event()

    def serve() -> None:
        asyncio.set_event_loop(loop)

        async def main() -> None:
            task = asyncio.create_task(fixed_cost_upstream(port_box, stopped))
            while not port_box:
                await asyncio.sleep(0.01)
            ready.set()
            await task

        loop.run_until_complete(main())

    thread = threading.Thread(target=serve, daemon=True)
    thread.start()
    ready.wait(30)
    upstream = f"http://127.0.0.1:{port_box[0]}/v1"
    capacity = CALLS / (FIXED_COST_MS / 1000.0)
    rows: dict[str, Any] = {}
    try:
        for window in WINDOWS_MS:
            backend = {"kind": "openai", "upstreams": [
                {"url": upstream, "max_concurrency": CALLS, "learn_room": False}]}  # fmt: skip
            path = tmp / f"b6-fixed-{window}.yaml"
            path.write_text(yaml.safe_dump(policy(window, backend), sort_keys=False))
            log = tmp / f"qosgate-{window}.log"
            proc, base = start_gateway(path, log)
            try:
                rows[str(window)] = [
                    bench_point(f"{base}/v1", log, lengths, load, capacity, tmp) for load in LOADS
                ]
            finally:
                stop(proc)
            print(f"B6 fixed-cost: max_wait_ms {window} done", file=sys.stderr, flush=True)
    finally:
        loop.call_soon_threadsafe(stopped.set)
        thread.join(30)
    return {"capacity_rps": capacity, "windows": rows}


def bench_point(url: str, log: Path, lengths: dict[str, Any], load: float, capacity: float,
                tmp: Path) -> dict[str, Any]:  # fmt: skip
    """One load through the gateway: throughput as the client saw it, p95
    TTFT from the gateway's request log (arrival to first token, as the
    simulator measures it; the client's report has p50 and p99 only)."""
    scenario = {
        "kind": "bench", "name": "b6-fixed", "mode": "open", "model": "fixed",
        "endpoint": "completions", "stream": True, "seed": 6, "timeout_s": 120,
        "duration_s": LIVE_DURATION_S, "warmup_s": LIVE_WARMUP_S,
        "arrivals": {"process": "poisson", "rate_rps": round(load * capacity, 3)},
        "lengths": lengths,
        "classes": [{"name": "standard", "tier": "standard", "api_key": KEY}],
        "tiers": {"standard": {}},
    }  # fmt: skip
    path = tmp / "b6-fixed-bench.yaml"
    path.write_text(yaml.safe_dump(scenario, sort_keys=False))
    out = tmp / "b6-fixed-bench.json"
    seen = len(request_log(log))
    subprocess.run([sys.executable, "-m", "qosgate.cli", "bench", url, str(path), "--workers", "1",
                    "--quiet", "--json", str(out)], cwd=ROOT, check=True,
                   stdout=subprocess.DEVNULL)  # fmt: skip
    run = json.loads(out.read_text())["policies"]["run"]
    rows = [(e["arrival"], e["ttft_ms"] / 1000.0) for e in request_log(log)[seen:]
            if e.get("ttft_ms") is not None]  # fmt: skip
    start = min(arrival for arrival, _ in rows) if rows else 0.0
    ttfts = [ttft for arrival, ttft in rows
             if LIVE_WARMUP_S <= arrival - start < LIVE_DURATION_S]  # fmt: skip
    return {
        "load": load,
        "throughput_tokens_per_s": run["totals"]["throughput_tokens_per_s"],
        "ttft_p95_s": percentile(ttfts, 95),
        "errors": run["totals"]["errors"],
    }


# -- the knee, the table, the plot ---------------------------------------------


def knee(result: dict[str, Any]) -> dict[str, Any]:
    """Per window: the highest throughput whose p95 TTFT stays within
    KNEE_FACTOR x the window-0 run's at the lowest load."""
    base = result["windows"][str(WINDOWS_MS[0])][0]["ttft_p95_s"]
    if not base:
        raise RuntimeError("no p95 TTFT at the lowest load with no window: no baseline")
    bound = KNEE_FACTOR * base
    knees = {}
    for window, points in result["windows"].items():
        within = [p["throughput_tokens_per_s"] for p in points
                  if p["ttft_p95_s"] is not None and p["ttft_p95_s"] <= bound]  # fmt: skip
        knees[window] = max(within) if within else 0.0
    return {"ttft_bound_s": bound, "throughput_tokens_per_s": knees}


def plot(results: dict[str, Any], path: Path) -> None:
    from qosgate.sim.report import pyplot, save_figure

    plt = pyplot()
    fig, axes = plt.subplots(1, len(results), figsize=(5 * len(results), 4.2))
    for ax, (name, result) in zip(axes, results.items()):
        for window, points in result["windows"].items():
            xs = [p["throughput_tokens_per_s"] for p in points]
            ys = [1000 * p["ttft_p95_s"] if p["ttft_p95_s"] is not None else float("nan")
                  for p in points]  # fmt: skip
            ax.plot(xs, ys, marker="o", label=f"max_wait_ms {window}")
        ax.axhline(1000 * result["knee"]["ttft_bound_s"], color="grey", linewidth=0.8,
                   linestyle="--")
        ax.set_yscale("log")
        ax.set_xlabel("throughput (prompt + output tokens/s)")
        ax.set_ylabel("p95 TTFT (ms)")
        ax.set_title(name)
        ax.legend(fontsize=8)
    fig.tight_layout()
    save_figure(fig, path)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--profile", default=str(CALIBRATED),
                        help="the calibrated engine's profile file")
    parser.add_argument("--json", default=str(HERE / "results" / "b6_batch_window.json"))
    parser.add_argument("--plot", default=str(HERE / "results" / "b6_batch_window.png"))
    args = parser.parse_args()
    started = time.monotonic()
    load_avg = os.getloadavg()
    with tempfile.TemporaryDirectory(prefix="qosgate-b6-") as tmp_name:
        tmp = Path(tmp_name)
        results = {
            # B3's length mix on the GPU; the fidelity mix (scaled to a
            # 2048-token context) on the calibrated CPU engine.
            "calibrated (tiny model, vLLM CPU)": simulated(str(Path(args.profile).resolve()), {
                "prompt": {"median": 250, "sigma": 1.0, "min": 4, "max": 1536},
                "output": {"median": 38, "sigma": 0.9, "min": 1, "max": 256}}, tmp),
            "simulated H100, Llama-3-8B": simulated("h100-llama3-8b", {
                "prompt": {"median": 1000, "sigma": 1.0, "min": 4, "max": 4096},
                "output": {"median": 150, "sigma": 0.9, "min": 1, "max": 1024}}, tmp),
            f"fixed cost per call ({FIXED_COST_MS:.0f} ms, {CALLS} at once)": live_fixed_cost({
                "prompt": {"median": 100}, "output": {"median": 16}}, tmp),
        }  # fmt: skip
    for result in results.values():
        result["knee"] = knee(result)
    print(f"\nB6 batch window ({os.cpu_count()} CPUs, load average {load_avg[0]:.2f} at start)\n")
    print("| backend | max_wait_ms | " + " | ".join(f"{load}x: tokens/s, p95 TTFT" for load in LOADS)
          + " | knee tokens/s |")
    print("|---|---|" + "---|" * len(LOADS) + "---|")
    for name, result in results.items():
        for window, points in result["windows"].items():
            cells = [f"{p['throughput_tokens_per_s']:,.0f}, {_ms(p['ttft_p95_s'])}" for p in points]
            print(f"| {name} | {window} | " + " | ".join(cells)
                  + f" | {result['knee']['throughput_tokens_per_s'][window]:,.0f} |")
    Path(args.plot).parent.mkdir(parents=True, exist_ok=True)
    plot(results, Path(args.plot))
    out = {
        "benchmark": "B6",
        "command": " ".join(shlex.quote(a) for a in
                            [".venv/bin/python", "benchmarks/b6_batch_window.py", *sys.argv[1:]]),
        "machine": {"cpus": os.cpu_count(), "load_average_at_start": load_avg,
                    "load_average_at_end": os.getloadavg()},
        "windows_ms": WINDOWS_MS, "loads": LOADS, "wall_s": time.monotonic() - started,
        "results": results,
    }  # fmt: skip
    Path(args.json).write_text(json.dumps(out, indent=2))
    print(f"\nwrote {args.json}\nwrote {args.plot}")
    return 0


def _ms(value: float | None) -> str:
    return "-" if value is None else f"{1000 * value:.0f} ms"


if __name__ == "__main__":
    sys.exit(main())
