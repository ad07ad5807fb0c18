"""B8 upstream, one server and several gateway settings: what each setting
does to the same arrivals in front of the same `vllm serve`.

    make test-vllm   # once: builds .venv-vllm with vLLM's CPU build
    .venv-vllm/bin/python benchmarks/b8_upstream_variants.py --rate RPS [--seqs 128]
        [--variant JSON ...] [--json PATH]

`benchmarks/b8_upstream.py` starts a server per run and measures it alone
first; this starts one (`max_num_seqs` --seqs) and sends B8's overload at
--rate (requests/s; B8 upstream's "sent" figure for that server) through a
fresh gateway per variant, one after the other, so the variants differ only
in the gateway's settings and in the host's noise. A variant is a JSON object:
its "upstream" key holds settings of the gateway's one upstream besides its
url (e.g. {"step_tokens": 2048}), the rest is merged into B8's policy key by
key (e.g. {"scheduler": {"prefill_budget_tokens": null}}); {} is B8's policy
with every upstream setting at its default. Per variant and tier it prints
what the client saw (TTFT attainment, expired, TTFT p50 and p99), the
gateway's queue waits and dispatch-to-first-token times (from its request
log), and what the server's own metrics say of its queue (vLLM's
`request_queue_time_seconds` and `time_to_first_token_seconds`).

It reports; it judges nothing (B8 upstream's target is judged by
b8_upstream.py): exit status 0 unless a run fails.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import urllib.request
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parent))
sys.path.insert(0, str(HERE))

from b8_upstream import OVERLOAD_S, scenario, start_qosgate, start_server  # noqa: E402
from b8_vllm import bench, cpu_model, model_folder, stop  # noqa: E402
from prometheus_client.parser import text_string_to_metric_families  # noqa: E402

TIERS = ("interactive", "standard", "batch")
SERVER_HISTOGRAMS = ("vllm:request_queue_time_seconds", "vllm:time_to_first_token_seconds")


def scrape(url: str) -> dict[str, float]:
    """The server's metrics summed over engines: name (with its `le`) -> value."""
    with urllib.request.urlopen(url, timeout=5) as response:
        text = response.read().decode()
    out: dict[str, float] = {}
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            key = sample.name + (f"{{le={sample.labels['le']}}}" if "le" in sample.labels else "")
            out[key] = out.get(key, 0.0) + sample.value
    return out


def server_view(before: dict[str, float], after: dict[str, float]) -> dict[str, Any]:
    """Of each server histogram, over the run: count, mean, share within 0.25 s and 0.5 s."""
    view: dict[str, Any] = {}
    for name in SERVER_HISTOGRAMS:
        count = after.get(f"{name}_count", 0.0) - before.get(f"{name}_count", 0.0)
        total = after.get(f"{name}_sum", 0.0) - before.get(f"{name}_sum", 0.0)

        def within(bound: str) -> float | None:
            key = f"{name}_bucket{{le={bound}}}"
            if key not in after or not count:
                return None
            return (after[key] - before.get(key, 0.0)) / count

        # vLLM's queue-time buckets have 0.3 where its TTFT buckets have 0.25.
        near = "0.25" if f"{name}_bucket{{le=0.25}}" in after else "0.3"
        view[name] = {"count": int(count), "mean_s": total / count if count else None,
                      f"within_{near}_s": within(near), "within_0.5_s": within("0.5")}
    return view


def quantile(values: list[float], q: float) -> float | None:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))] if ordered else None


def gateway_view(log: Path) -> dict[str, Any]:
    """Per tier, from the gateway's request log: queue waits and the time
    from dispatch to the first token, in ms."""
    rows = []
    for line in log.read_text(errors="replace").splitlines():
        if line.startswith("{") and '"event":"request"' in line.replace(" ", ""):
            try:
                rows.append(json.loads(line))
            except ValueError:
                continue
    view: dict[str, Any] = {}
    for tier in TIERS:
        mine = [r for r in rows if r.get("tier") == tier and r.get("event") == "request"]
        waits = [r["queue_wait_ms"] for r in mine if r.get("queue_wait_ms") is not None]
        engine = [r["ttft_ms"] - r["queue_wait_ms"] for r in mine
                  if r.get("ttft_ms") is not None and r.get("queue_wait_ms") is not None]
        view[tier] = {"logged": len(mine), "queue_wait_p50_ms": quantile(waits, 0.5),
                      "queue_wait_p90_ms": quantile(waits, 0.9),
                      "to_first_token_p50_ms": quantile(engine, 0.5),
                      "to_first_token_p99_ms": quantile(engine, 0.99)}
    return view


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rate", type=float, required=True, help="requests/s sent")
    parser.add_argument("--seqs", type=int, default=128, help="the server's max_num_seqs")
    parser.add_argument("--variant", type=json.loads, action="append", metavar="JSON",
                        help="a gateway setting to run (repeat; default: {} alone)")
    parser.add_argument("--model", help="model folder (default: write the tiny test model)")
    parser.add_argument("--json", help="write every figure here")
    args = parser.parse_args()
    variants = args.variant or [{}]
    if args.rate <= 0 or args.seqs < 1:
        parser.error("--rate must be above 0 and --seqs at least 1")
    if not all(isinstance(v, dict) for v in variants):
        parser.error("a --variant must be a JSON object")
    os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
    results = []
    with tempfile.TemporaryDirectory(prefix="qosgate-b8v-") as tmp_name:
        tmp = Path(tmp_name)
        model = model_folder(args.model, tmp)
        proc, url, server_cmd = start_server(model, args.seqs, tmp)
        metrics = url.removesuffix("/v1") + "/metrics"
        try:
            overload = scenario(tmp, "overload", arrivals__rate_rps=args.rate,
                                duration_s=OVERLOAD_S,
                                lengths__output={"median": 64, "sigma": 0.0, "max": 256})
            for i, variant in enumerate(variants):
                policy = {k: v for k, v in variant.items() if k != "upstream"}
                before = scrape(metrics)
                gate, gate_url, gate_log = start_qosgate(url, tmp, args.seqs, 0, policy,
                                                         variant.get("upstream", {}))
                try:
                    report = bench(gate_url, overload, tmp / f"variant-{i}.json", "qosgate")
                finally:
                    stop(gate)
                results.append({
                    "variant": variant, "tiers": report["tiers"], "totals": report["totals"],
                    "gateway": gateway_view(gate_log),
                    "server": server_view(before, scrape(metrics)),
                    "gateway_log": [line for line in gate_log.read_text(errors="replace")
                                    .splitlines() if "upstream" in line][:20],
                })
        finally:
            stop(proc)
    print(f"\nB8 upstream variants: vllm serve, max_num_seqs {args.seqs}, {args.rate} req/s "
          f"({os.cpu_count()} CPUs, {cpu_model()})\n")
    for result in results:
        totals = result["totals"]
        print(f"  variant {json.dumps(result['variant'])}: {totals.get('throughput_rps', 0):.1f} "
              f"req/s completed in the window")
        for tier in TIERS:
            t, g = result["tiers"].get(tier, {}), result["gateway"][tier]
            print(f"    {tier:<11} attainment {t.get('ttft_slo_attainment')!s:<6.5} expired "
                  f"{t.get('expired')!s:>4}  TTFT p50 {t.get('ttft_p50_s') or 0:.3f} s p99 "
                  f"{t.get('ttft_p99_s') or 0:.3f} s | gateway queue wait p50/p90 "
                  f"{g['queue_wait_p50_ms']}/{g['queue_wait_p90_ms']} ms, dispatch to first "
                  f"token p50/p99 {g['to_first_token_p50_ms']}/{g['to_first_token_p99_ms']} ms")
        for name, v in result["server"].items():
            shares = ", ".join(f"{key.replace('_', ' ')} {share:.3f}" for key, share in v.items()
                               if key.startswith("within") and share is not None)
            print(f"    server {name}: mean {v['mean_s'] or 0:.3f} s, {shares}")
    if args.json:
        out = {"benchmark": "B8 upstream variants", "server": server_cmd,
               "machine": {"cpus": os.cpu_count(), "cpu": cpu_model()},
               "rate_rps": args.rate, "seqs": args.seqs, "results": results}
        Path(args.json).parent.mkdir(parents=True, exist_ok=True)
        Path(args.json).write_text(json.dumps(out, indent=2, default=str))
        print(f"\nwrote {args.json}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
