"""`qosgate calibrate URL --model M --out PROFILE.yaml`: fit a simulator
profile to an OpenAI-compatible engine (docs/CALIBRATE.md).

A short designed sweep: lone requests of several prompt lengths (prefill),
then batches of concurrent streams over prompt lengths x batch sizes x
output lengths (decode). Prompts are token ids, so their lengths are exact
on any server that takes them (vLLM, and qosgate in front of anything).
The server's Prometheus /metrics, where it has vLLM's, give the KV-cache
size and show the batch really ran together.
"""

from __future__ import annotations

import argparse
import asyncio
import bisect
import datetime
import itertools
import random
import re
import statistics
import sys
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

import aiohttp
import yaml
from prometheus_client.parser import text_string_to_metric_families

from qosgate.bench.client import COMPLETED, Job
from qosgate.bench.commands import BenchUsageError, api_base
from qosgate.calibrate.fit import DecodeSample, PrefillSample, Regression, fit_decode, fit_prefill
from qosgate.profiles import CostProfile

TIMEOUT_S = 600.0
TOKEN_IDS = (16, 500)
"""Prompt token ids are drawn from here: past the special tokens that open
common vocabularies and within any of more than 500 ids (the tests' tiny
model has 512; a server refuses an id outside its vocabulary), different for
every request so that no prefix cache helps."""


@dataclass(frozen=True)
class Sweep:
    prefill_tokens: tuple[int, ...]
    prefill_repeats: int
    batch_sizes: tuple[int, ...]
    prompt_tokens: tuple[int, ...]
    output_tokens: tuple[int, ...]


FULL = Sweep(
    prefill_tokens=(32, 128, 256, 512, 768, 1024, 1536, 2048), prefill_repeats=3,
    batch_sizes=(1, 8, 32, 96), prompt_tokens=(256, 2048), output_tokens=(64, 192),
)  # fmt: skip
QUICK = Sweep(
    prefill_tokens=(64, 512, 1024, 1536, 2048), prefill_repeats=2,
    batch_sizes=(1, 8, 24), prompt_tokens=(128, 1024), output_tokens=(40,),
)  # fmt: skip


def fitted_sweep(sweep: Sweep, *, budget_tokens: int, max_model_len: int | None,
                 max_batch: int | None) -> Sweep:  # fmt: skip
    """The sweep within the engine's limits: every prefill one step of at
    most `budget_tokens` and, with its one output token, within the context;
    no batch above `max_batch` (a larger one would queue in the engine, and
    its steps would not be of its size). A limit that cuts some points off
    adds a point at the limit itself, so the sweep still spans the range."""
    longest = budget_tokens if max_model_len is None else min(budget_tokens, max_model_len - 1)
    prefill = _capped(sweep.prefill_tokens, longest)
    batches = _capped(sweep.batch_sizes, max_batch)
    if len(batches) < 3 and batches[-1] // 2 > batches[0]:
        # Three batch sizes at least: the decode fit separates the step's
        # fixed cost from its per-sequence one.
        batches = tuple(sorted({*batches, batches[-1] // 2}))
    return Sweep(prefill, sweep.prefill_repeats, batches, sweep.prompt_tokens, sweep.output_tokens)


def _capped(values: tuple[int, ...], cap: int | None) -> tuple[int, ...]:
    if cap is None or max(values) <= cap:
        return values
    return (*(v for v in values if v < cap), cap)


def decode_points(sweep: Sweep, *, budget_tokens: int,
                  max_model_len: int | None) -> list[tuple[int, int, int]]:  # fmt: skip
    """(batch, prompt, output) of each batch of the sweep, a prompt shortened
    where it and its longest output would not fit the context (one prompt for
    all its outputs: `engine_decode_samples` takes their differences)."""
    points: list[tuple[int, int, int]] = []
    for prompt, batch in itertools.product(sweep.prompt_tokens, sweep.batch_sizes):
        outputs = [decode_output_tokens(batch, prompt, o, budget_tokens)
                   for o in sweep.output_tokens]  # fmt: skip
        if max_model_len is not None and prompt + max(outputs) > max_model_len:
            prompt = max_model_len - max(outputs)
            if prompt < 1:
                raise CalibrationFailed(
                    f"a context of {max_model_len} tokens leaves no room for a prompt before "
                    f"{max(outputs)} output tokens"
                )
        for output in outputs:
            if (batch, prompt, output) not in points:
                points.append((batch, prompt, output))
    return points


class _TokenIdJob(Job):
    """The load generator's request, with a prompt of token ids."""

    # Each run's prompts differ from every earlier run's too: a server keeps
    # its prefix cache between runs.
    run_salt = random.SystemRandom().getrandbits(64)

    def prompt(self, rid: int, tokens: int) -> list[int]:  # type: ignore[override]
        rng = random.Random(f"calibrate/{self.run_salt}/{rid}")
        return [rng.randrange(*TOKEN_IDS) for _ in range(tokens)]


class CalibrationFailed(RuntimeError):
    """A request of the sweep failed, or the measurements cannot be fitted."""


@dataclass
class Measured:
    prefill: list[PrefillSample]
    decode: list[DecodeSample]
    """Decode steps as the client saw them (`_decode_samples`)."""
    engine_decode: list[DecodeSample] = field(default_factory=list)
    """Decode steps as the engine timed them (`engine_decode_samples`)."""
    engine_prefill: list[PrefillSample] = field(default_factory=list)
    """Lone prefills as the engine timed them (vLLM's request prefill time)."""
    outside_ms: list[float] = field(default_factory=list)
    """Per lone request with both clocks: the client's time to its first
    token less the engine's prefill."""
    running_max: int | None = None
    """Most requests the server's metrics showed running at once."""

    @property
    def decode_fitted(self) -> list[DecodeSample]:
        """The engine's own timings where there are enough for the fit."""
        if len({s.seqs for s in self.engine_decode}) >= 2:
            return self.engine_decode
        return self.decode

    @property
    def prefill_fitted(self) -> list[PrefillSample]:
        if len({s.prompt_tokens for s in self.engine_prefill}) >= 3:
            return self.engine_prefill
        return self.prefill

    def overhead_ms(self, prefill: Regression, t0_ms: float) -> float:
        """What a request spends outside the engine: measured on both clocks
        where there were, else the prefill intercept's excess over t0."""
        if self.prefill_fitted is self.engine_prefill and self.outside_ms:
            return statistics.median(self.outside_ms)
        return prefill.value("intercept_ms") - t0_ms


def _job(base: str, model: str, api_key: str | None, ignore_eos: bool,
         session: aiohttp.ClientSession) -> _TokenIdJob:  # fmt: skip
    cfg = {
        "urls": [base], "endpoint": "completions", "model": model, "stream": True,
        "timeout_s": TIMEOUT_S, "extra_body": {"ignore_eos": True} if ignore_eos else {},
        "keys": [api_key], "priority": [None],
    }  # fmt: skip
    return _TokenIdJob(cfg, session, "")


async def _metrics(session: aiohttp.ClientSession, url: str | None) -> dict[str, Any]:
    """What the server's Prometheus text says: vLLM's running count and KV size."""
    if url is None:
        return {}
    try:
        async with session.get(url, timeout=aiohttp.ClientTimeout(total=5)) as response:
            if response.status != 200:
                return {}
            text = await response.text()
    except (aiohttp.ClientError, TimeoutError):
        return {}
    found: dict[str, Any] = {}
    try:
        families = list(text_string_to_metric_families(text))
    except ValueError:
        return {}
    for family in families:
        for sample in family.samples:
            if sample.name == "vllm:num_requests_running":
                found["running"] = found.get("running", 0) + int(sample.value)
            elif sample.name.rpartition("_")[0] in _HISTOGRAMS:
                series, _, part = sample.name.rpartition("_")
                if part in ("sum", "count"):
                    key = f"{_HISTOGRAMS[series]}_{part}"
                    found[key] = found.get(key, 0.0) + sample.value
            elif sample.name == "vllm:cache_config_info":
                blocks = sample.labels.get("num_gpu_blocks")
                size = sample.labels.get("block_size")
                if blocks and size and blocks.isdigit() and size.isdigit():
                    found["kv_capacity_tokens"] = int(blocks) * int(size)
    return found


_HISTOGRAMS = {
    "vllm:inter_token_latency_seconds": "itl",
    "vllm:request_prefill_time_seconds": "prefill",
}
"""vLLM's histograms timed in the engine's process: their sums and counts."""


async def _run(job: _TokenIdJob, specs: list[tuple]) -> list[tuple]:
    loop = asyncio.get_running_loop()
    start = loop.time()
    records = await asyncio.gather(*(job.one(spec, start, 0.0) for spec in specs))
    for record in records:
        if record[6] != COMPLETED:
            status, error = record[5], record[7] or record[8]
            raise CalibrationFailed(
                f"a request of {record[9]} prompt tokens failed (HTTP {status}, {error})"
            )
    return records


async def served_context(base: str, model: str, api_key: str | None) -> int | None:
    """The model's context in tokens, where the server's /v1/models gives it
    (vLLM's `max_model_len`)."""
    headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
    async with aiohttp.ClientSession() as session:
        try:
            async with session.get(f"{base}/models", headers=headers,
                                   timeout=aiohttp.ClientTimeout(total=30)) as response:  # fmt: skip
                if response.status != 200:
                    return None
                body = await response.json(content_type=None)
        except (aiohttp.ClientError, TimeoutError, ValueError):
            return None
    cards = body.get("data") if isinstance(body, dict) else None
    for card in cards if isinstance(cards, list) else []:
        if isinstance(card, dict) and card.get("id") == model:
            value = card.get("max_model_len")
            return value if isinstance(value, int) and value > 1 else None
    return None


async def measure(
    base: str, model: str, api_key: str | None, sweep: Sweep, *, budget_tokens: int,
    max_model_len: int | None = None, ignore_eos: bool = True, metrics_url: str | None = None,
    progress: Callable[[str], None] = lambda line: None,
) -> Measured:  # fmt: skip
    """Run the sweep against the server; the samples the fit takes. The
    sweep is taken as it is: `fitted_sweep` fits it to the engine."""
    connector = aiohttp.TCPConnector(limit=0)
    async with aiohttp.ClientSession(connector=connector) as session:
        job = _job(base, model, api_key, ignore_eos, session)
        rid = 0
        # A first request warms the server up (and fails fast on a wrong URL or key).
        await _run(job, [(rid, 0.0, 0, 16, 2)])
        measured = Measured([], [])
        # Lone prefills are timed on the engine's clock too where the server
        # has vLLM's histograms (each costs two reads of /metrics, so only then).
        engine_clock = "prefill_count" in await _metrics(session, metrics_url)
        lengths = sweep.prefill_tokens
        for n, tokens in enumerate(lengths, start=1):
            ttfts = []
            for _ in range(sweep.prefill_repeats):
                rid += 1
                before = await _metrics(session, metrics_url) if engine_clock else {}
                (record,) = await _run(job, [(rid, 0.0, 0, tokens, 1)])
                ttfts.append((record[3] - record[2]) * 1000.0)
                measured.prefill.append(PrefillSample(tokens, ttfts[-1]))
                after = await _metrics(session, metrics_url) if engine_clock else {}
                if after.get("prefill_count", 0) - before.get("prefill_count", 0) == 1:
                    engine_ms = (after["prefill_sum"] - before["prefill_sum"]) * 1000.0
                    measured.engine_prefill.append(PrefillSample(tokens, engine_ms))
                    measured.outside_ms.append(ttfts[-1] - engine_ms)
            progress(f"prefill {n}/{len(lengths)}: {tokens} tokens: "
                     f"first token {statistics.median(ttfts):.1f} ms")
        points = decode_points(sweep, budget_tokens=budget_tokens, max_model_len=max_model_len)
        itl: dict[tuple[int, int, int], tuple[float, float]] = {}
        for n, (batch, prompt, output) in enumerate(points, start=1):
            specs = [(rid + 1 + i, 0.0, 0, prompt, output) for i in range(batch)]
            rid += batch
            before = await _metrics(session, metrics_url)
            watcher = asyncio.create_task(_watch_running(session, metrics_url, measured))
            try:
                records = await _run(job, specs)
            finally:
                watcher.cancel()
            after = await _metrics(session, metrics_url)
            if "itl_sum" in before and "itl_sum" in after:
                itl[batch, prompt, output] = (after["itl_sum"] - before["itl_sum"],
                                              after["itl_count"] - before["itl_count"])
            samples = _decode_samples(records, batch, prompt)
            measured.decode.extend(samples)
            step = statistics.median(s.step_ms for s in samples) if samples else float("nan")
            engine = itl.get((batch, prompt, output))
            progress(f"decode {n}/{len(points)}: {batch} streams x {prompt}-token prompts x "
                     f"{output} tokens: step {step:.1f} ms"
                     + (f" (the engine's mean gap {1000 * engine[0] / engine[1]:.1f} ms)"
                        if engine and engine[1] else ""))
        measured.engine_decode = engine_decode_samples(itl)
        return measured


def engine_decode_samples(
    itl: dict[tuple[int, int, int], tuple[float, float]],
) -> list[DecodeSample]:
    """Decode steps from the engine's own clock: vLLM's inter-token latency
    histogram (`vllm:inter_token_latency_seconds`, timed in the engine's
    process, so a stall of the server or the client between it and the
    engine does not show). Its sum and count over one batch take in the
    steps of the batch's prefills too; two batches alike but for their
    output lengths differ by decode steps alone, so the difference of the
    two is one sample: the mean step over the longer one's extra tokens, at
    the context of their middle. A batch whose count is not its streams'
    gaps (another client's requests ran beside it) is left out."""
    samples = []
    for (batch, prompt, output), (total, count) in itl.items():
        if count != batch * (output - 1):
            continue
        shorter = [(o, itl[batch, prompt, o]) for b, p, o in itl
                   if (b, p) == (batch, prompt) and o < output
                   and itl[b, p, o][1] == batch * (o - 1)]  # fmt: skip
        if not shorter:
            continue
        o, (total_o, count_o) = max(shorter)
        step_ms = (total - total_o) / (count - count_o) * 1000.0
        context = batch * (prompt + (o + output) / 2)
        samples.append(DecodeSample(batch, float(context), step_ms))
    return samples


_WATCH_INTERVAL_S = 0.05


async def _watch_running(session: aiohttp.ClientSession, url: str | None,
                         measured: Measured) -> None:  # fmt: skip
    """Raise `measured.running_max` to the most requests the server's metrics
    (vLLM's) show running while a batch is under way, read over and over
    until the batch ends (the task is cancelled)."""
    while url is not None:
        running = (await _metrics(session, url)).get("running")
        if running is None:
            return
        measured.running_max = max(measured.running_max or 0, running)
        await asyncio.sleep(_WATCH_INTERVAL_S)


DECODE_BINS = 1
"""Samples per batch: the time all its streams decode together, in this many
runs. One: a server on a busy machine stalls now and then and sends the
tokens of the stall in one burst after it, and a stall across two runs'
border would give one run its time and the next its tokens."""


def _decode_samples(records: list[tuple], batch: int, prompt: int) -> list[DecodeSample]:
    """From the last stream's first token (every prefill done) to the first
    stream's last token (none finished yet), the whole batch decodes and a
    gap between two tokens is one step. That time is cut into runs: per run
    and stream, the time from its first token in the run to its last over the
    gaps between them, and the median of that over the streams, at the
    context the batch had in the run's middle. A mean over a run, not a
    median gap: tokens can arrive in bursts (several in one read, then a
    pause) and a client's timing jitters by milliseconds; neither moves a
    run's ends by much."""
    times = []
    for record in records:
        first, itl = record[3], record[11]
        if first is None or not itl:
            return []
        times.append(list(itertools.accumulate(itl, initial=first)))
    start = max(t[0] for t in times)
    end = min(t[-1] for t in times)
    if len(times) < batch or end <= start:
        return []
    edges = [start + (end - start) * n / DECODE_BINS for n in range(DECODE_BINS + 1)]
    samples = []
    for low, high in itertools.pairwise(edges):
        steps = []
        for t in times:
            run = t[bisect.bisect_right(t, low):bisect.bisect_right(t, high)]
            if len(run) >= 2:
                steps.append((run[-1] - run[0]) / (len(run) - 1))
        if steps:
            middle = (low + high) / 2
            context = sum(prompt + bisect.bisect_right(t, middle) for t in times)
            samples.append(DecodeSample(batch, float(context), statistics.median(steps) * 1000.0))
    return samples


def decode_output_tokens(batch: int, prompt: int, output: int, budget_tokens: int) -> int:
    """Long enough that the batch decodes together for at least `output` / 2
    steps: its prefills take about batch x prompt / budget steps, during which
    the first streams already decode."""
    spread = -(-batch * prompt // budget_tokens)
    return max(output, 2 * spread + output // 2)


def fitted_profile(
    measured: Measured, *, name: str, description: str, kv_capacity_tokens: int,
    max_num_seqs: int, max_num_batched_tokens: int,
) -> tuple[CostProfile, Regression, Regression]:  # fmt: skip
    decode = fit_decode(measured.decode_fitted)
    prefill = fit_prefill(measured.prefill_fitted)
    t0 = decode.value("t0_ms")
    # On the engine's clock a lone prefill is one step: what its intercept has
    # beyond the step's t0 is the sequence's own set-up. On the client's clock
    # that cannot be told apart from the time outside the engine.
    on_engine_clock = measured.prefill_fitted is measured.engine_prefill
    chunk_ms = prefill.value("intercept_ms") - t0 if on_engine_clock else 0.0
    profile = CostProfile(
        name=name, description=description, t0_ms=t0,
        c_p=prefill.value("c_p"), c_q=prefill.value("c_q"), c_chunk=max(0.0, chunk_ms),
        c_d=decode.value("c_d"), c_kv=decode.value("c_kv"),
        request_overhead_ms=max(0.0, measured.overhead_ms(prefill, t0)),
        kv_capacity_tokens=kv_capacity_tokens,
        max_num_seqs=max_num_seqs, max_num_batched_tokens=max_num_batched_tokens,
    )  # fmt: skip
    return profile, decode, prefill


def residual_report(decode: Regression, prefill: Regression, overhead_ms: float) -> list[str]:
    """Each term with its standard error, and each regression's residuals."""
    lines = []
    for what, fit in (("decode steps", decode), ("prefill", prefill)):
        lines.append(f"{what} ({fit.samples} samples): rms residual {fit.rms_ms:.3f} ms")
        lines += [f"  {t.name:<12} {t.value:.6g} +/- {t.stderr:.2g}" for t in fit.terms]
    lines.append(f"  request overhead outside the engine (request_overhead_ms): "
                 f"{overhead_ms:.3f} ms")
    return lines


def write_profile(path: str | Path, profile: CostProfile, notes: list[str]) -> None:
    header = "".join(f"# {line}\n" for line in notes)
    body = yaml.safe_dump(profile.model_dump(), sort_keys=False)
    Path(path).write_text(header + body, encoding="utf-8")


def plot_fit(path: str | Path, measured: Measured, profile: CostProfile, overhead_ms: float) -> None:
    from qosgate.sim.report import pyplot, save_figure

    plt = pyplot()
    fig, (left, right) = plt.subplots(1, 2, figsize=(11, 4.5))
    decode = measured.decode_fitted
    measured_steps = [s.step_ms for s in decode]
    fitted_steps = [profile.step_ms([], s.seqs, int(s.context_tokens)) for s in decode]
    left.scatter(fitted_steps, measured_steps, s=8, c=[s.seqs for s in decode],
                 cmap="viridis")
    top = max(measured_steps + fitted_steps)
    left.plot([0, top], [0, top], color="grey", linewidth=1)
    left.set_xlabel("fitted step (ms)")
    left.set_ylabel("measured step (ms)")
    left.set_title("decode: time between tokens (colour: batch size)")
    prefill = measured.prefill_fitted
    tokens = [s.prompt_tokens for s in prefill]
    right.scatter(tokens, [s.ttft_ms for s in prefill], s=10, label="measured")
    grid = sorted(set(tokens))
    right.plot(grid, [profile.step_ms([p], 0, 0) + overhead_ms for p in grid], color="C1",
               label="fitted + overhead" if overhead_ms else "fitted")
    right.set_xlabel("prompt tokens")
    right.set_ylabel("time to first token (ms)")
    right.set_title("prefill: a lone request"
                    + ("" if prefill is measured.prefill else " (the engine's clock)"))
    right.legend()
    fig.tight_layout()
    save_figure(fig, path)


def _metrics_url(base: str) -> str:
    parts = urlsplit(base)
    return f"{parts.scheme}://{parts.netloc}/metrics"


def _profile_name(model: str) -> str:
    return "calibrated-" + (re.sub(r"[^A-Za-z0-9_.-]+", "-", model).strip("-") or "model")


def calibrate_command(args: argparse.Namespace) -> int:
    try:
        base = api_base(args.url)
        for flag in ("max_num_seqs", "max_num_batched_tokens", "kv_capacity_tokens",
                     "max_model_len", "max_batch"):
            value = getattr(args, flag)
            if value is not None and value < 1:
                raise BenchUsageError(f"--{flag.replace('_', '-')}: must be at least 1, got {value}")
    except BenchUsageError as exc:
        print(f"qosgate calibrate: {exc}", file=sys.stderr)
        return 2
    sweep = QUICK if args.quick else FULL
    budget = args.max_num_batched_tokens or 2048
    metrics_url = None if args.no_metrics else (args.metrics_url or _metrics_url(base))

    def progress(line: str) -> None:
        if not args.quiet:
            print(f"qosgate calibrate: {line}", file=sys.stderr, flush=True)

    async def run() -> tuple[Sweep, Measured, dict[str, Any]]:
        context = args.max_model_len or await served_context(base, args.model, args.api_key)
        fitted = fitted_sweep(sweep, budget_tokens=budget, max_model_len=context,
                              max_batch=args.max_batch or args.max_num_seqs)  # fmt: skip
        progress(f"{'quick' if args.quick else 'full'} sweep against {base} (model {args.model}"
                 f"{'' if context is None else f', context {context} tokens'}; batches "
                 f"{', '.join(map(str, fitted.batch_sizes))})")
        measured = await measure(
            base, args.model, args.api_key, fitted, budget_tokens=budget, max_model_len=context,
            ignore_eos=not args.no_ignore_eos, metrics_url=metrics_url, progress=progress,
        )  # fmt: skip
        async with aiohttp.ClientSession() as session:
            return fitted, measured, await _metrics(session, metrics_url)

    try:
        sweep, measured, server = asyncio.run(run())
        kv = args.kv_capacity_tokens or server.get("kv_capacity_tokens")
        if kv is None:
            raise CalibrationFailed(
                "the server's metrics do not give its KV-cache size (vllm:cache_config_info); "
                "pass --kv-capacity-tokens"
            )
        when = datetime.datetime.now(datetime.UTC).strftime("%Y-%m-%d")
        profile, decode, prefill = fitted_profile(
            measured, name=args.name or _profile_name(args.model),
            description=f"{args.model} at {base}, fitted by qosgate calibrate on {when}",
            kv_capacity_tokens=kv, max_num_seqs=args.max_num_seqs or 256,
            max_num_batched_tokens=budget,
        )  # fmt: skip
    except (CalibrationFailed, ValueError, aiohttp.ClientError, OSError) as exc:
        print(f"qosgate calibrate: {exc}", file=sys.stderr)
        return 1
    overhead = profile.request_overhead_ms
    report = residual_report(decode, prefill, overhead)
    report.append(f"  a prefill chunk's own set-up (c_chunk): {profile.c_chunk:.3f} ms")
    report.insert(0, "decode steps timed by the engine (vLLM's inter-token latency)"
                  if measured.decode_fitted is measured.engine_decode
                  else "decode steps timed by the client")
    report.insert(1, "prefills timed by the engine (vLLM's request prefill time)"
                  if measured.prefill_fitted is measured.engine_prefill
                  else "prefills timed by the client (first token)")
    if measured.running_max is not None:
        report.append(f"the server's metrics showed up to {measured.running_max} requests running "
                      f"at once (largest batch: {max(sweep.batch_sizes)})")
    print("\n".join(report))
    notes = ["A simulated GPU's cost profile (docs/SIMULATE.md, \"Profile files\"),",
             f"fitted by `qosgate calibrate` ({'quick' if args.quick else 'full'} sweep).",
             *report]  # fmt: skip
    try:
        write_profile(args.out, profile, notes)
        print(f"wrote {args.out}")
        if args.plot_path:
            on_engine_clock = measured.prefill_fitted is measured.engine_prefill
            plot_fit(args.plot_path, measured, profile, 0.0 if on_engine_clock else overhead)
            print(f"wrote {args.plot_path}")
    except OSError as exc:
        print(f"qosgate calibrate: {exc}", file=sys.stderr)
        return 1
    return 0
