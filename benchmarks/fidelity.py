"""Fidelity: `qosgate simulate` against the real engine it was calibrated on.

    make test-vllm   # once: builds .venv-vllm with vLLM's build
    .venv-vllm/bin/python benchmarks/fidelity.py [--model DIR] [--duration 60]
                                                 [--json benchmarks/results/fidelity.json]

One `vllm serve` (vLLM's OpenAI server: the tests' tiny model unless --model
names another; the engine arguments below, and the device's defaults
otherwise, so a CUDA build runs it unchanged) is the engine, and one
`qosgate serve` with the `openai` backend in front of it, as many requests
at once as the engine has sequences, serves every phase, each with its own
tenants so that the gateway's one trace splits by phase:

1. calibrate: `qosgate calibrate` against the engine fits a profile file
   (its context, KV size and decode steps from the server itself);
2. capacity: a closed loop of 2 x max_num_seqs users with the B3-shaped mix
   gives the engine's capacity in requests/s as qosgate serves it;
3. for each load (0.8x and 1.5x that capacity): B3-shaped open-loop Poisson
   arrivals (interactive 10%, standard 60%, batch 30%; B3's tiers and waits;
   lengths scaled to the model's 2048-token context) run live through the
   gateway, whose trace writer records them (`observability.trace`);
4. each load's recorded trace is replayed by `qosgate simulate` with the
   calibrated profile under the same policy.

Per tier it reports predicted (simulated) against measured (live) TTFT p50,
p99, queue wait p99 and throughput (completed requests/s), as error
percentages, with the targets: TTFT p50 within 10%, p99 within 20%,
throughput within 5%. Measured TTFT is the client's (qosgate bench); the
gateway's own (arrival to first token, from its request log, the clock the
simulator models) and queue wait are beside it, which separates what the
cost model misses from what HTTP and the client add.
Exit status 1 when a target fails.
"""

from __future__ import annotations

import argparse
import hashlib
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
sys.path.insert(0, str(HERE))

from b8_vllm import bench, cpu_model, model_folder, start_gateway, start_server, stop  # noqa: E402

from qosgate.observability.stats import percentile  # noqa: E402

MAX_NUM_SEQS = 4
CONTEXT = 2048
ENGINE = ["--max-model-len", str(CONTEXT), "--max-num-seqs", str(MAX_NUM_SEQS),
          "--dtype", "bfloat16", "--enforce-eager", "--scheduling-policy", "priority"]
LOADS = (0.8, 1.5)
WARMUP_S = 10.0
TARGETS = {"ttft_p50": 0.10, "ttft_p99": 0.20, "throughput": 0.05}
# B3's tiers and shares (benchmarks/b3_overload.yaml), one tenant each.
SHARES = {"interactive": 0.1, "standard": 0.6, "batch": 0.3}
TIERS = {
    "interactive": {"priority": 0, "ttft_slo_ms": 500, "max_queue_wait_ms": 250,
                    "on_timeout": "reject", "max_tokens": 512},
    "standard": {"priority": 1, "ttft_slo_ms": 2000, "max_queue_wait_ms": 1500,
                 "on_timeout": "reject", "max_tokens": 512},
    "batch": {"priority": 2, "e2e_slo_ms": 60000, "max_queue_wait_ms": 20000,
              "max_queue_len": 5000, "on_timeout": "delay", "max_tokens": 512},
}  # fmt: skip
# B3's log-normal lengths scaled by 1/4 to fit a 2048-token context. The
# load generator asks for prompts in its own words (about 4 characters a
# token); the tiny model's tokenizer makes about 2.7 tokens of each, so the
# prompt asked is about a third of what the engine gets (the gateway counts
# the engine's tokens, and that is what the trace records and replays).
PROMPT = {"median": 95, "sigma": 1.0, "min": 2, "max": 500}
OUTPUT = {"median": 38, "sigma": 0.9, "min": 1, "max": 256}
SCHEDULER = {"policy": "qos", "fairness": "vtc", "aging": {"interval_ms": 2000, "max_boost": 2},
             "reserve": {"slots": 1}}  # fmt: skip


def key(name: str) -> str:
    return f"fidelity-{name}-key"


def phases() -> list[str]:
    return ["capacity", *(f"load{load}" for load in LOADS)]


def tenant(phase: str, tier: str) -> str:
    return f"{phase}-{tier}"


def policy(upstream: str, trace: Path) -> dict[str, Any]:
    tenants = []
    for phase in phases():
        for tier in SHARES:
            name = tenant(phase, tier)
            digest = hashlib.sha256(key(name).encode()).hexdigest()
            tenants.append({"id": name, "tier": tier, "api_keys": [f"sha256:{digest}"]})
    return {
        "version": 1,
        "server": {"host": "127.0.0.1", "port": 0, "admin_token_env": None},
        # The engine's sequences at once, as the simulated engine's slots:
        # the rest wait in the gateway's queues.
        "backend": {"kind": "openai", "upstreams": [
            {"url": upstream, "max_concurrency": MAX_NUM_SEQS, "learn_room": False}]},
        "scheduler": SCHEDULER,
        "tiers": TIERS,
        "tenants": tenants,
        "observability": {"log_format": "json", "log_requests": True,
                          "trace": {"path": str(trace), "flush_interval_s": 0.2}},
    }  # fmt: skip


def bench_scenario(phase: str, *, rate: float | None, duration: float, seed: int) -> dict:
    classes = [{"name": tier, "tier": tier, "tenant": tenant(phase, tier),
                "api_key": key(tenant(phase, tier)), "share": share}
               for tier, share in SHARES.items()]  # fmt: skip
    scenario: dict[str, Any] = {
        "kind": "bench", "name": f"fidelity-{phase}", "model": "tiny",
        "endpoint": "completions", "stream": True, "seed": seed, "timeout_s": 300,
        "extra_body": {"ignore_eos": True}, "lengths": {"prompt": PROMPT, "output": OUTPUT},
        "classes": classes,
        "tiers": {t: {k: v for k, v in TIERS[t].items() if k in ("ttft_slo_ms", "e2e_slo_ms")}
                  for t in SHARES},
    }  # fmt: skip
    if rate is None:
        scenario["mode"] = "sweep"
        scenario["sweep"] = {"concurrency": [2 * MAX_NUM_SEQS], "duration_s": duration}
    else:
        scenario.update(mode="open", duration_s=duration, warmup_s=WARMUP_S,
                        arrivals={"process": "poisson", "rate_rps": round(rate, 3)})
    return scenario


def run_bench(url: str, scenario: dict, tmp: Path, label: str) -> dict[str, Any]:
    path = tmp / f"{scenario['name']}.yaml"
    path.write_text(yaml.safe_dump(scenario, sort_keys=False))
    return bench(url, path, tmp / f"{scenario['name']}.json", label)


def split_trace(trace: Path, tmp: Path) -> dict[str, Path]:
    """Each load's lines of the gateway's one trace, its first arrival at 0."""
    lines = [json.loads(line) for line in trace.read_text().splitlines() if line.strip()]
    out = {}
    for phase in phases()[1:]:
        mine = [r for r in lines if r["tenant"].startswith(phase + "-")]
        if not mine:
            raise RuntimeError(f"the gateway's trace has no line of {phase}")
        start = min(r["t"] for r in mine)
        path = tmp / f"trace-{phase}.jsonl"
        with path.open("w") as handle:
            for r in sorted(mine, key=lambda r: r["t"]):
                handle.write(json.dumps({**r, "t": round(r["t"] - start, 6)}) + "\n")
        out[phase] = path
    return out


def request_log(log: Path) -> list[dict[str, Any]]:
    """The gateway's request log lines (JSON), with each one's `arrival` (its
    end, the line's timestamp, less its end-to-end time)."""
    events = []
    for line in log.read_text(errors="replace").splitlines():
        try:
            event = json.loads(line)
        except ValueError:
            continue
        if isinstance(event, dict) and event.get("event") == "request":
            event["arrival"] = event["timestamp"] - (event.get("e2e_ms") or 0.0) / 1000.0
            events.append(event)
    return events


def gateway_view(log: Path, phase: str, duration: float) -> dict[str, dict[str, Any]]:
    """Per tier, from the gateway's request log: TTFT (arrival to first token)
    and queue wait, of the requests that arrived in the measurement window
    (the trace's window: its first arrival is 0)."""
    rows = [(e["arrival"], e) for e in request_log(log) if e["tenant"].startswith(phase + "-")]
    if not rows:
        raise RuntimeError(f"the gateway's log has no request of {phase}")
    start = min(a for a, _ in rows)
    tiers: dict[str, dict[str, Any]] = {}
    for tier in SHARES:
        mine = [e for a, e in rows if e["tier"] == tier and WARMUP_S <= a - start < duration]
        ttfts = [e["ttft_ms"] / 1000 for e in mine
                 if e["outcome"] == "completed" and e.get("ttft_ms") is not None]  # fmt: skip
        waits = [(e["queue_wait_ms"] if e.get("queue_wait_ms") is not None else e["e2e_ms"]) / 1000
                 for e in mine if not e["outcome"].startswith("rejected")]  # fmt: skip
        tiers[tier] = {"ttft_p50_s": percentile(ttfts, 50), "ttft_p99_s": percentile(ttfts, 99),
                       "queue_wait_p99_s": percentile(waits, 99)}  # fmt: skip
    return tiers


def terms(log: Path, phase: str, trace: Path, engine: dict[str, float | None],
          profile: Path) -> dict[str, Any]:  # fmt: skip
    """A completed request's mean time to first token, term by term, as the
    engine, vLLM's server and the gateway measured it, beside what the
    profile says of the terms it models (the simulator has no other)."""
    from qosgate.profiles import load_profile_file

    events = [e for e in request_log(log)
              if e["outcome"] == "completed" and e["tenant"].startswith(phase + "-")]
    records = [json.loads(line) for line in trace.read_text().splitlines() if line.strip()]
    done = [r for r in records if r.get("outcome") == "completed"]
    prompt = sum(r["prompt_tokens"] for r in done) / len(done)
    output = sum(r["output_tokens"] for r in done) / len(done)
    gateway_ttft = sum(e["ttft_ms"] for e in events) / len(events)
    gateway_wait = sum(e["queue_wait_ms"] for e in events) / len(events)
    cost = load_profile_file(profile)
    seqs = MAX_NUM_SEQS
    server_ttft = engine["server_ttft"] or 0.0
    return {
        "mean_prompt_tokens": prompt, "mean_output_tokens": output,
        "engine_decode_step_ms": engine["decode_step"],
        "profile_decode_step_ms": cost.step_ms([], seqs, int(seqs * (prompt + output / 2))),
        "engine_prefill_ms": engine["prefill"],
        "profile_prefill_ms": cost.step_ms([round(prompt)], 0, 0),
        "engine_queue_ms": engine["engine_queue"],
        "engine_steps": engine["steps"], "engine_tokens_per_step": engine["step_tokens"],
        "server_ttft_ms": server_ttft,
        "server_outside_engine_ms": server_ttft - (engine["engine_queue"] or 0.0)
        - (engine["prefill"] or 0.0),
        "gateway_ttft_ms": gateway_ttft, "gateway_queue_wait_ms": gateway_wait,
        "gateway_outside_server_ms": gateway_ttft - gateway_wait - server_ttft,
        "profile_request_overhead_ms": cost.request_overhead_ms,
        "profile_chunk_ms": cost.c_chunk,
    }  # fmt: skip


def with_overhead(profile: Path, overhead_ms: float, out: Path) -> Path:
    """The calibrated profile with `request_overhead_ms` set to what a live
    run measured: not a prediction (the run had to happen first), a test of
    whether that term is what the prediction lacks."""
    from qosgate.profiles import load_profile_file

    cost = load_profile_file(profile)
    doc = cost.model_copy(update={"name": f"{cost.name}-measured-overhead",
                                  "request_overhead_ms": max(0.0, overhead_ms)}).model_dump()
    out.write_text(yaml.safe_dump(doc, sort_keys=False))
    return out


def simulate(profile: Path, policy_path: Path, trace: Path, tmp: Path, phase: str,
             duration: float) -> dict[str, Any]:  # fmt: skip
    scenario = {
        "kind": "traffic", "name": f"fidelity-{phase}", "duration_s": duration,
        "warmup_s": WARMUP_S, "drain_s": 300, "policies": ["qos"],
        "engine": {"profile": str(profile)}, "trace": str(trace), "policy": str(policy_path),
    }  # fmt: skip
    path = tmp / f"sim-{phase}.yaml"
    path.write_text(yaml.safe_dump(scenario, sort_keys=False))
    out = tmp / f"sim-{phase}.json"
    subprocess.run([sys.executable, "-m", "qosgate.cli", "simulate", str(path), "--json", str(out),
                    "--quiet"], cwd=ROOT, check=True, stdout=subprocess.DEVNULL)  # fmt: skip
    return json.loads(out.read_text())["policies"]["qos"]


def error(predicted: float | None, measured: float | None, *, target: bool = True) -> float | None:
    """(predicted - measured) / measured; None when either is missing. A
    measured 0 has no error percentage: for a target that is an error
    (nothing to compare with), for a figure beside them None (the table
    gives both values)."""
    if predicted is None or measured is None:
        return None
    if measured == 0:
        if target:
            raise ZeroDivisionError("a measured figure is 0: no baseline to compare with")
        return None
    return (predicted - measured) / measured


def compare(measured: dict, gateway: dict, predicted: dict, window: float) -> dict[str, Any]:
    tiers = {}
    for tier in SHARES:
        m, g, p = measured["tiers"][tier], gateway[tier], predicted["tiers"][tier]
        row = {
            "requests": m["requests"],
            "measured": {"ttft_p50_s": m["ttft_p50_s"], "ttft_p99_s": m["ttft_p99_s"],
                         "gateway_ttft_p50_s": g["ttft_p50_s"],
                         "gateway_ttft_p99_s": g["ttft_p99_s"],
                         "queue_wait_p99_s": g["queue_wait_p99_s"],
                         "throughput_rps": m["completed"] / window,
                         "completed": m["completed"], "rejected": m["rejected"],
                         "expired": m.get("expired", 0)},
            "predicted": {"ttft_p50_s": p["ttft_p50_s"], "ttft_p99_s": p["ttft_p99_s"],
                          "queue_wait_p99_s": p["queue_wait_p99_s"],
                          "throughput_rps": p["completed"] / window,
                          "completed": p["completed"], "rejected": p["rejected"],
                          "expired": p["expired"]},
        }  # fmt: skip
        row["error"] = {
            "ttft_p50": error(p["ttft_p50_s"], m["ttft_p50_s"]),
            "ttft_p99": error(p["ttft_p99_s"], m["ttft_p99_s"]),
            "gateway_ttft_p50": error(p["ttft_p50_s"], g["ttft_p50_s"], target=False),
            "gateway_ttft_p99": error(p["ttft_p99_s"], g["ttft_p99_s"], target=False),
            "queue_wait_p99": error(p["queue_wait_p99_s"], g["queue_wait_p99_s"], target=False),
            "throughput": error(row["predicted"]["throughput_rps"],
                                row["measured"]["throughput_rps"]),
        }  # fmt: skip
        row["passed"] = {name: row["error"][name] is not None and abs(row["error"][name]) <= bound
                         for name, bound in TARGETS.items()}  # fmt: skip
        tiers[tier] = row
    return tiers


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", help="model folder (default: write the tiny test model)")
    parser.add_argument("--duration", type=float, default=60.0,
                        help="seconds of arrivals per load, the first 10 s warm-up")
    parser.add_argument("--json", default=str(HERE / "results" / "fidelity.json"))
    parser.add_argument("--keep", help="keep the run's files (policy, profile, traces, log) here")
    parser.add_argument("--profile-out", default=str(HERE / "results" / "tiny-cpu-profile.yaml"),
                        help="copy the calibrated profile here (B6 simulates it)")
    args = parser.parse_args()
    os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")  # GiB; the CPU build's KV cache
    started = time.monotonic()
    load_avg = os.getloadavg()
    with tempfile.TemporaryDirectory(prefix="qosgate-fidelity-") as tmp_name:
        tmp = Path(args.keep or tmp_name)
        tmp.mkdir(parents=True, exist_ok=True)
        model = model_folder(args.model, tmp)
        trace = tmp / "trace.jsonl"
        engine, engine_url = start_engine(model, tmp)
        policy_path = tmp / "policy.yaml"
        policy_path.write_text(yaml.safe_dump(policy(engine_url, trace), sort_keys=False))
        profile = tmp / "profile.yaml"
        live: dict[str, Any] = {}
        try:
            print("fidelity: calibrating the engine", file=sys.stderr, flush=True)
            calibrate = [sys.executable, "-m", "qosgate.cli", "calibrate", engine_url,
                         "--model", "tiny", "--out", str(profile),
                         "--plot", str(tmp / "calibrate.png"),
                         "--max-num-seqs", str(MAX_NUM_SEQS), "--quiet"]  # fmt: skip
            fit = subprocess.run(calibrate, cwd=ROOT, check=True, capture_output=True, text=True)
            print(fit.stdout, file=sys.stderr, flush=True)
            capacity = run_gateway(policy_path, tmp, args.duration, live, engine_url)
        finally:
            stop(engine)
        traces = split_trace(trace, tmp)
        window = args.duration - WARMUP_S
        results = {}
        for load in LOADS:
            phase = f"load{load}"
            predicted = simulate(profile, policy_path, traces[phase], tmp, phase, args.duration)
            gateway = gateway_view(tmp / "qosgate.log", phase, args.duration)
            measured_terms = terms(tmp / "qosgate.log", phase, traces[phase],
                                   live[phase]["engine_means"], profile)
            outside = (measured_terms["server_outside_engine_ms"]
                       + measured_terms["gateway_outside_server_ms"])
            diagnosis = with_overhead(profile, outside, tmp / f"profile-{phase}-overhead.yaml")
            rerun = simulate(diagnosis, policy_path, traces[phase], tmp, f"{phase}-overhead",
                             args.duration)  # fmt: skip
            results[phase] = {
                "load": load, "rate_rps": load * capacity,
                "terms": measured_terms,
                "tiers": compare(live[phase], gateway, predicted, window),
                "measured_overhead_ms": outside,
                "tiers_with_measured_overhead": compare(live[phase], gateway, rerun, window),
                "totals": {
                    "measured_tokens_per_s": live[phase]["totals"]["throughput_tokens_per_s"],
                    "predicted_tokens_per_s": predicted["totals"]["throughput_tokens_per_s"],
                    "predicted_utilisation": predicted["engine"]["utilisation"],
                },
            }  # fmt: skip
        profile_text = profile.read_text()
        Path(args.profile_out).write_text(profile_text)
    report(results, capacity, profile_text, load_avg)
    passed = all(all(row["passed"].values()) for r in results.values() for row in r["tiers"].values())
    out = {
        "benchmark": "fidelity",
        "command": " ".join(shlex.quote(a) for a in
                            [".venv-vllm/bin/python", "benchmarks/fidelity.py", *sys.argv[1:]]),
        "machine": {"cpus": os.cpu_count(), "cpu": cpu_model(), "python": platform.python_version(),
                    "load_average_at_start": load_avg, "load_average_at_end": os.getloadavg()},
        "engine_args": ENGINE, "capacity_rps": capacity, "wall_s": time.monotonic() - started,
        "profile": profile_text, "targets": TARGETS, "passed": passed, "loads": results,
    }  # fmt: skip
    Path(args.json).parent.mkdir(parents=True, exist_ok=True)
    Path(args.json).write_text(json.dumps(out, indent=2))
    print(f"\nwrote {args.json}")
    return 0 if passed else 1


def start_engine(model: str, tmp: Path) -> tuple[subprocess.Popen, str]:
    proc, base = start_server(
        lambda port: [sys.executable, "-m", "vllm.entrypoints.openai.api_server", "--model", model,
                      "--served-model-name", "tiny", "--host", "127.0.0.1", "--port", str(port),
                      *ENGINE, "--disable-uvicorn-access-log"],
        tmp / "vllm.log", "/health", start_new_session=True,
    )  # fmt: skip
    return proc, base + "/v1"


ENGINE_SERIES = {
    "decode_step": "vllm:inter_token_latency_seconds",
    "prefill": "vllm:request_prefill_time_seconds",
    "engine_queue": "vllm:request_queue_time_seconds",
    "server_ttft": "vllm:time_to_first_token_seconds",
    "step_tokens": "vllm:iteration_tokens_total",
}
"""vLLM's own histograms: each one's sum and count over a phase give the
mean the engine (or its server) saw, one term of a request's time each."""


def engine_counters(engine_url: str) -> dict[str, tuple[float, float]]:
    import urllib.request

    from prometheus_client.parser import text_string_to_metric_families

    base = engine_url.rsplit("/v1", 1)[0]
    with urllib.request.urlopen(base + "/metrics", timeout=30) as response:
        text = response.read().decode()
    sums: dict[str, list[float]] = {name: [0.0, 0.0] for name in ENGINE_SERIES}
    by_series = {series: name for name, series in ENGINE_SERIES.items()}
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            series, _, part = sample.name.rpartition("_")
            if series in by_series and part in ("sum", "count"):
                sums[by_series[series]][part == "count"] += sample.value
    return {name: (total, count) for name, (total, count) in sums.items()}


def engine_means(before: dict, after: dict) -> dict[str, float | None]:
    """Per term, the mean over the phase in ms (tokens for step_tokens)."""
    means: dict[str, float | None] = {}
    for name in ENGINE_SERIES:
        total = after[name][0] - before[name][0]
        count = after[name][1] - before[name][1]
        scale = 1.0 if name == "step_tokens" else 1000.0
        means[name] = total / count * scale if count else None
    means["steps"] = after["step_tokens"][1] - before["step_tokens"][1]
    return means


def run_gateway(policy_path: Path, tmp: Path, duration: float, live: dict[str, Any],
                engine_url: str) -> float:  # fmt: skip
    """The live phases through `qosgate serve`; the engine's capacity in requests/s."""
    proc, base = start_gateway(policy_path, tmp / "qosgate.log")
    url = base + "/v1"
    try:
        print("fidelity: capacity (closed loop)", file=sys.stderr, flush=True)
        cap = run_bench(url, bench_scenario("capacity", rate=None, duration=30.0, seed=1),
                        tmp, "capacity")  # fmt: skip
        capacity = cap["sweep"][0]["throughput_rps"]
        if not capacity:
            raise RuntimeError("the closed loop completed nothing: no capacity to scale by")
        for n, load in enumerate(LOADS):
            phase = f"load{load}"
            print(f"fidelity: {load}x capacity ({load * capacity:.2f} req/s) live",
                  file=sys.stderr, flush=True)
            before = engine_counters(engine_url)
            live[phase] = run_bench(url, bench_scenario(
                phase, rate=load * capacity, duration=duration, seed=10 + n), tmp, phase)  # fmt: skip
            live[phase]["engine_means"] = engine_means(before, engine_counters(engine_url))
    finally:
        stop(proc)  # flushes the trace
    return capacity


def report(results: dict, capacity: float, profile: str, load_avg: tuple) -> None:
    print(f"\nFidelity: qosgate simulate against vLLM ({os.cpu_count()} CPUs, {cpu_model()}, load average "
          f"{load_avg[0]:.2f} at start); capacity {capacity:.2f} req/s\n")
    table(results, "tiers")
    print("\nThe same with the profile's request_overhead_ms set to what each live run "
          "measured outside the engine (" + ", ".join(
              f"{r['load']}x: {r['measured_overhead_ms']:.0f} ms" for r in results.values())
          + "): a diagnosis, not a prediction\n")
    table(results, "tiers_with_measured_overhead")
    for r in results.values():
        t, m = r["totals"], r["terms"]
        print(f"\n{r['load']}x: tokens/s measured {t['measured_tokens_per_s']:.0f}, predicted "
              f"{t['predicted_tokens_per_s']:.0f}; predicted engine utilisation "
              f"{t['predicted_utilisation']:.2f}")
        print(f"  mean of a completed request ({m['mean_prompt_tokens']:.0f} prompt, "
              f"{m['mean_output_tokens']:.0f} output tokens), measured | the profile's:")
        print(f"    decode step (engine clock)        {_f(m['engine_decode_step_ms'])} ms | "
              f"{_f(m['profile_decode_step_ms'])} ms at {MAX_NUM_SEQS} sequences")
        print(f"    prefill (engine clock)            {_f(m['engine_prefill_ms'])} ms | "
              f"{_f(m['profile_prefill_ms'])} ms (c_chunk {_f(m['profile_chunk_ms'])} ms)")
        print(f"    engine queue                      {_f(m['engine_queue_ms'])} ms | modelled")
        print(f"    vLLM's server outside the engine  {_f(m['server_outside_engine_ms'])} ms | "
              f"{_f(m['profile_request_overhead_ms'])} ms with the next (request_overhead_ms)")
        print(f"    gateway queue wait                {_f(m['gateway_queue_wait_ms'])} ms | modelled")
        print(f"    gateway and HTTP to the engine    {_f(m['gateway_outside_server_ms'])} ms | "
              "in request_overhead_ms")
        print(f"    engine: {m['engine_steps']:.0f} steps, {_f(m['engine_tokens_per_step'])} "
              "tokens a step")


def table(results: dict, key: str) -> None:
    print("| load | tier | requests | TTFT p50 meas / pred (err) | TTFT p99 meas / pred (err) | "
          "gateway TTFT p50 / p99 err | queue wait p99 meas / pred (err) | "
          "throughput meas / pred req/s (err) |")
    print("|---|---|---|---|---|---|---|---|")
    for r in results.values():
        for tier, row in r[key].items():
            m, p, e = row["measured"], row["predicted"], row["error"]
            print(f"| {r['load']}x | {tier} | {row['requests']} "
                  f"| {_ms(m['ttft_p50_s'])} / {_ms(p['ttft_p50_s'])} ({_pct(e['ttft_p50'])}) "
                  f"| {_ms(m['ttft_p99_s'])} / {_ms(p['ttft_p99_s'])} ({_pct(e['ttft_p99'])}) "
                  f"| {_pct(e['gateway_ttft_p50'])} / {_pct(e['gateway_ttft_p99'])} "
                  f"| {_ms(m['queue_wait_p99_s'])} / {_ms(p['queue_wait_p99_s'])} "
                  f"({_pct(e['queue_wait_p99'])}) "
                  f"| {m['throughput_rps']:.2f} / {p['throughput_rps']:.2f} "
                  f"({_pct(e['throughput'])}) |")


def _f(value: float | None) -> str:
    return "-" if value is None else f"{value:.1f}"


def _ms(value: float | None) -> str:
    return "-" if value is None else f"{1000 * value:.0f} ms"


def _pct(value: float | None) -> str:
    return "-" if value is None else f"{100 * value:+.0f}%"


if __name__ == "__main__":
    sys.exit(main())
