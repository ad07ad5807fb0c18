"""B8: qosgate with the co-located vLLM engine, against the engine alone.

    make test-vllm   # once: builds .venv-vllm with vLLM's CPU build
    .venv-vllm/bin/python benchmarks/b8_vllm.py [--json benchmarks/results/b8_vllm.json]

One run, the same engine arguments both ways (B8 of benchmarks/RESULTS.md):

- direct: vLLM's own OpenAI server (`vllm.entrypoints.openai.api_server`),
  FCFS, the engine alone;
- qosgate: `qosgate serve` with benchmarks/b8_policy.yaml (the vllm backend,
  the same model and engine arguments, three tiers).

Each is started in turn (two engines would share 2 cores), and gets:

1. throughput: benchmarks/b8_throughput.yaml, closed loop at 32 users;
2. overload: benchmarks/b8_overload.yaml, open-loop Poisson arrivals at twice
   the direct run's measured capacity (requests/s at 32 users), the same
   arrivals (same seed) both ways.

Targets: qosgate's throughput at least 0.9x direct; under 2x overload,
interactive TTFT p99 at most 0.25x what the engine alone gives it.

The model is the tiny random-weight Llama of tests/vllm_engine (written to a
temporary folder unless --model names one): its output is noise, but the
engine's batching, scheduling and streaming are real.
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
import time
import urllib.request
from collections.abc import Callable
from pathlib import Path
from typing import Any

import yaml

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent
sys.path.insert(0, str(ROOT))

ENGINE = {"max_model_len": 512, "max_num_seqs": 32, "dtype": "bfloat16", "enforce_eager": True}
START_LIMIT_S = 300.0
TARGET_THROUGHPUT = 0.9
TARGET_TTFT_RATIO = 0.25


def wait_until_ready(url: str, proc: subprocess.Popen, log: Path) -> None:
    """A benchmark harness may poll: the server is another program."""
    deadline = time.monotonic() + START_LIMIT_S
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"{url} exited:\n{log.read_text(errors='replace')[-3000:]}")
        try:
            with urllib.request.urlopen(url, timeout=2) as r:
                if r.status == 200:
                    return
        except OSError:
            pass
        time.sleep(0.5)
    raise RuntimeError(f"{url} not ready after {START_LIMIT_S:.0f} s")


def model_folder(given: str | None, tmp: Path) -> str:
    """`given`, or the tiny test model written into `tmp`."""
    if given is not None:
        return given
    from tests.vllm_engine.make_tiny_model import write

    write(tmp / "tiny-model")
    return str(tmp / "tiny-model")


def free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def start_direct(model: str, tmp: Path) -> tuple[subprocess.Popen, str, str]:
    port = free_port()
    log = tmp / "direct.log"
    argv = [sys.executable, "-m", "vllm.entrypoints.openai.api_server", "--model", model,
            "--served-model-name", "tiny", "--host", "127.0.0.1", "--port", str(port),
            "--scheduling-policy", "fcfs", "--max-model-len", str(ENGINE["max_model_len"]),
            "--max-num-seqs", str(ENGINE["max_num_seqs"]), "--dtype", ENGINE["dtype"],
            "--enforce-eager", "--disable-uvicorn-access-log"]
    proc = subprocess.Popen(argv, stdout=log.open("wb"), stderr=subprocess.STDOUT, cwd=ROOT)
    base = f"http://127.0.0.1:{port}"
    wait_until_ready(base + "/health", proc, log)
    return proc, base + "/v1", " ".join(shlex.quote(a) for a in argv[1:])


def start_qosgate(model: str, tmp: Path) -> tuple[subprocess.Popen, str]:
    policy = yaml.safe_load((HERE / "b8_policy.yaml").read_text())
    policy["backend"]["model"] = model
    path = tmp / "b8_policy.yaml"
    path.write_text(yaml.safe_dump(policy, sort_keys=False))
    proc, base = start_gateway(path, tmp / "qosgate.log")
    return proc, base + "/v1"


def start_gateway(config: Path, log: Path) -> tuple[subprocess.Popen, str]:
    """`qosgate serve --config CONFIG` of this checkout, once ready."""
    return start_server(
        lambda port: [sys.executable, "-m", "qosgate.cli", "serve", "--config", str(config),
                      "--host", "127.0.0.1", "--port", str(port)],
        log, "/readyz", env=dict(os.environ, PYTHONPATH=str(ROOT)),
    )  # fmt: skip


def start_server(argv: Callable[[int], list[str]], log: Path, ready: str,
                 **popen: Any) -> tuple[subprocess.Popen, str]:  # fmt: skip
    """The command `argv(port)` on a free loopback port, its output to
    `log`, once `ready` answers 200 there; its base URL. A server that does
    not get ready is stopped."""
    port = free_port()
    proc = subprocess.Popen(argv(port), stdout=log.open("wb"), stderr=subprocess.STDOUT,
                            cwd=ROOT, **popen)  # fmt: skip
    base = f"http://127.0.0.1:{port}"
    try:
        wait_until_ready(base + ready, proc, log)
    except BaseException:
        stop(proc)
        raise
    return proc, base


def stop(proc: subprocess.Popen) -> None:
    proc.terminate()
    try:
        proc.wait(timeout=60)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait()


def bench(url: str, scenario: Path, out: Path, label: str) -> dict[str, Any]:
    subprocess.run(
        [sys.executable, "-m", "qosgate.cli", "bench", url, str(scenario), "--workers", "1",
         "--quiet", "--label", label, "--json", str(out)],
        cwd=ROOT, check=True,
    )  # fmt: skip
    return json.loads(out.read_text())["policies"][label]


def overload_scenario(tmp: Path, rate: float) -> Path:
    scenario = yaml.safe_load((HERE / "b8_overload.yaml").read_text())
    scenario["arrivals"]["rate_rps"] = round(rate, 3)
    path = tmp / "b8_overload.yaml"
    path.write_text(yaml.safe_dump(scenario, sort_keys=False))
    return path


def run_target(name: str, url: str, tmp: Path, rate: float | None) -> dict[str, Any]:
    throughput = bench(url, HERE / "b8_throughput.yaml", tmp / f"{name}-tp.json", name)
    row = throughput["sweep"][0]
    if rate is None:
        rate = 2.0 * row["throughput_rps"]
    overload = bench(url, overload_scenario(tmp, rate), tmp / f"{name}-ov.json", name)
    return {"throughput": row, "overload": overload, "rate_rps": rate}


def cpu_model() -> str:
    """The host's CPU and whether it has AVX-512, which vLLM's CPU kernels
    use where they find it: the engine's own costs differ by an order of
    magnitude between hosts, so a run's figures say which it was."""
    try:
        info = Path("/proc/cpuinfo").read_text()
    except OSError:
        return platform.processor() or "unknown CPU"
    name = next((line.split(":", 1)[1].strip() for line in info.splitlines()
                 if line.startswith("model name")), "unknown CPU")
    return f"{name}, {'with' if ' avx512f' in info else 'without'} AVX-512"


def summary(result: dict[str, Any]) -> dict[str, Any]:
    row = result["throughput"]
    tiers = result["overload"]["tiers"]
    inter = tiers.get("interactive", {})
    return {
        "throughput_rps": row["throughput_rps"],
        "output_tokens_per_s": row["output_tokens_per_s"],
        "errors_at_32": row["errors"],
        "overload_rate_rps": result["rate_rps"],
        "interactive_ttft_p99_s": inter.get("ttft_p99_s"),
        "interactive_ttft_p50_s": inter.get("ttft_p50_s"),
        "interactive_completed": inter.get("completed"),
        "interactive_requests": inter.get("requests"),
        "interactive_attainment": inter.get("ttft_slo_attainment"),
        "overload_totals": {k: result["overload"]["totals"].get(k) for k in
                            ("requests", "completed", "rejected", "errors", "lost",
                             "throughput_rps", "output_tokens_per_s")},
        "tiers": {name: {k: t.get(k) for k in ("requests", "completed", "rejected", "expired",
                                                 "errors", "ttft_p50_s", "ttft_p99_s", "e2e_p99_s")}
                  for name, t in tiers.items()},
    }


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", help="model folder (default: write the tiny test model)")
    parser.add_argument("--json", default=str(HERE / "results" / "b8_vllm.json"))
    args = parser.parse_args()
    os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
    started = time.monotonic()
    with tempfile.TemporaryDirectory(prefix="qosgate-b8-") as tmp_name:
        tmp = Path(tmp_name)
        model = model_folder(args.model, tmp)
        print("B8: the engine alone (vLLM's OpenAI server, FCFS)", file=sys.stderr, flush=True)
        proc, url, direct_cmd = start_direct(model, tmp)
        try:
            direct = run_target("direct", url, tmp, None)
        finally:
            stop(proc)
        print("B8: qosgate with the co-located engine", file=sys.stderr, flush=True)
        proc, url = start_qosgate(model, tmp)
        try:
            gated = run_target("qosgate", url, tmp, direct["rate_rps"])
        finally:
            stop(proc)
    d, q = summary(direct), summary(gated)
    tp_ratio = q["throughput_rps"] / d["throughput_rps"] if d["throughput_rps"] else None
    ttft_ratio = (
        q["interactive_ttft_p99_s"] / d["interactive_ttft_p99_s"]
        if q["interactive_ttft_p99_s"] and d["interactive_ttft_p99_s"] else None
    )
    print(f"\nB8 real engine (vLLM CPU build, tiny model; {os.cpu_count()} CPUs)\n")
    print(f"  throughput at 32 users: direct {d['throughput_rps']:.2f} req/s "
          f"({d['output_tokens_per_s']:.0f} tok/s), qosgate {q['throughput_rps']:.2f} req/s "
          f"({q['output_tokens_per_s']:.0f} tok/s): {tp_ratio:.3f}x")
    print(f"  2x overload ({d['overload_rate_rps']:.2f} req/s): interactive TTFT p99 "
          f"direct {1000 * (d['interactive_ttft_p99_s'] or 0):.0f} ms, "
          f"qosgate {1000 * (q['interactive_ttft_p99_s'] or 0):.0f} ms: "
          f"{ttft_ratio if ttft_ratio is None else round(ttft_ratio, 3)}x")
    print_tiers(("direct", d), ("qosgate", q))
    ok_tp = tp_ratio is not None and tp_ratio >= TARGET_THROUGHPUT
    ok_ttft = ttft_ratio is not None and ttft_ratio <= TARGET_TTFT_RATIO
    print(f"\n  {'PASS' if ok_tp else 'FAIL'}  throughput >= {TARGET_THROUGHPUT}x direct")
    print(f"  {'PASS' if ok_ttft else 'FAIL'}  interactive TTFT p99 <= {TARGET_TTFT_RATIO}x "
          "the engine alone under 2x overload")
    out = {
        "benchmark": "B8",
        "command": " ".join(shlex.quote(a) for a in
                            [".venv-vllm/bin/python", "benchmarks/b8_vllm.py", *sys.argv[1:]]),
        "direct_server": direct_cmd,
        "machine": {"cpus": os.cpu_count(), "python": platform.python_version()},
        "engine_args": ENGINE,
        "wall_s": time.monotonic() - started,
        "direct": d,
        "qosgate": q,
        "throughput_ratio": tp_ratio,
        "interactive_ttft_p99_ratio": ttft_ratio,
        "targets": {"throughput": ok_tp, "interactive_ttft": ok_ttft},
        "raw": {"direct": direct, "qosgate": gated},
    }
    Path(args.json).parent.mkdir(parents=True, exist_ok=True)
    Path(args.json).write_text(json.dumps(out, indent=2, default=str))
    print(f"\nwrote {args.json}")
    return 0


def print_tiers(*summaries: tuple[str, dict[str, Any]]) -> None:
    """Each tier's line of each (name, `summary`)."""
    for name, s in summaries:
        for tier, t in s["tiers"].items():
            print(f"    {name:8} {tier:12} requests {t['requests']:>5} completed "
                  f"{t['completed']:>5} rejected {t['rejected']:>5} expired "
                  f"{t.get('expired') or 0:>4} errors {t['errors']:>3}"
                  f" ttft p50 {_ms(t['ttft_p50_s'])} p99 {_ms(t['ttft_p99_s'])}")


def _ms(value: float | None) -> str:
    return "      -" if value is None else f"{1000 * value:7.0f}"


if __name__ == "__main__":
    sys.exit(main())
