"""`qosgate bench URL SCENARIO`: drive an OpenAI-compatible endpoint with a bench scenario.

URL may be a comma-separated list (several replicas of one gateway): request
number n goes to the (n mod count)-th URL, as a round-robin load balancer in
front of them would send it.

Exit status: 0 when every request has a result (refusals and errors are
results: they are what is being measured), 1 when requests were lost or a
load-generator process failed, 2 for an invalid scenario or arguments.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

from qosgate.bench.scenario import BenchScenario

DEFAULT_WORKERS = 4


class BenchUsageError(ValueError):
    """An argument or environment problem; the message names the field."""


def api_base(url: str, field: str = "URL") -> str:
    """The API base requests go under: the URL as given (e.g. http://host:8080/v1),
    with /v1 added when it has no path. `field` is what an error names."""
    parts = urlsplit(url)
    if parts.scheme not in ("http", "https") or not parts.netloc:
        raise BenchUsageError(f"{field}: expected http(s)://host:port[/v1], got {url!r}")
    if parts.query or parts.fragment:
        raise BenchUsageError(f"{field}: no query or fragment allowed, got {url!r}")
    path = parts.path.rstrip("/") or "/v1"
    return f"{parts.scheme}://{parts.netloc}{path}"


def api_bases(arg: str) -> list[str]:
    """The API bases of a comma-separated URL argument, in order. A URL may be
    repeated: that weights its replica, as a weighted balancer would."""
    entries = [entry.strip() for entry in arg.split(",")]
    if len(entries) == 1:
        # One URL keeps the messages it always had (no entry number).
        return [api_base(entries[0])]
    bases = []
    for number, entry in enumerate(entries, start=1):
        field = f"URL: entry {number}"
        if not entry:
            # A stray comma would otherwise silently shift every request's replica.
            raise BenchUsageError(f"{field}: empty (URL is a comma-separated list of "
                                  f"http(s)://host:port[/v1]), got {arg!r}")
        bases.append(api_base(entry, field))
    return bases


def resolve_keys(scenario: BenchScenario, environ: dict[str, str] | os._Environ = os.environ) -> list[str | None]:
    """Each class's key: api_key, else the value of api_key_env, else None (no header)."""
    keys: list[str | None] = []
    for index, cls_ in enumerate(scenario.classes):
        if cls_.api_key_env is not None:
            value = environ.get(cls_.api_key_env)
            if not value:
                raise BenchUsageError(
                    f"classes.{index}.api_key_env: environment variable "
                    f"{cls_.api_key_env} is not set"
                )
            keys.append(value)
        else:
            keys.append(cls_.api_key)
    return keys


def job_config(scenario: BenchScenario, urls: str | list[str], keys: list[str | None],
               seed: int) -> dict[str, Any]:
    """What a worker needs to build the requests (plain data: it is pickled).
    `urls`: one API base or several, request n going to urls[n % len(urls)]."""
    return {
        "urls": [urls] if isinstance(urls, str) else list(urls),
        "endpoint": scenario.endpoint,
        "model": scenario.model,
        "stream": scenario.stream,
        "timeout_s": scenario.timeout_s,
        "honor_retry_after": scenario.honor_retry_after,
        "extra_body": dict(scenario.extra_body),
        "keys": keys,
        "priority": [c.priority for c in scenario.classes],
        "sessions": scenario.sessions,
        "seed": seed,
    }


class ProgressLine:
    """The live line of a run on stderr: requests answered so far, how many
    completed, the time since the run began. On a terminal it is rewritten in
    place; elsewhere (a log) a line is written every `log_every_s`."""

    def __init__(self, stream: Any, planned: int | None, *, log_every_s: float = 10.0,
                 clock: Any = time.monotonic) -> None:  # fmt: skip
        self._stream = stream
        self._tty = bool(getattr(stream, "isatty", lambda: False)())
        self._planned = planned
        self._clock = clock
        self._began = clock()
        self._every = log_every_s
        self._last_logged = self._began
        self._shown = False

    def __call__(self, finished: int, completed: int) -> None:
        now = self._clock()
        of = f"/{self._planned}" if self._planned else ""
        text = (f"  {finished}{of} answered, {completed} completed, "
                f"{finished - completed} not, {now - self._began:.0f} s")  # fmt: skip
        if self._tty:
            self._stream.write("\r" + text + "\x1b[K")
            self._shown = True
        elif now - self._last_logged >= self._every:
            self._stream.write(text + "\n")
            self._last_logged = now
        self._stream.flush()

    def end(self) -> None:
        """The run is over: the line in place is left as it stands."""
        if self._shown:
            self._stream.write("\n")
            self._stream.flush()
            self._shown = False


def run_open(pool: Any, scenario: BenchScenario, cfg: dict[str, Any], seed: int,
             client_workers: int, live: ProgressLine | None = None,
             ) -> tuple[dict[str, Any], list, list[int]]:  # fmt: skip
    """The report, the records, and the max_tokens asked of each (by request id)."""
    from qosgate.bench.plan import plan_open
    from qosgate.bench.pool import split_open
    from qosgate.bench.report import build_bench_report, records_from

    specs = plan_open(scenario, seed)
    job = pool.run("open", cfg, split_open(specs, client_workers), live)
    if live is not None:
        live.end()
    records = records_from(job.records)
    assert scenario.duration_s is not None
    report = build_bench_report(
        records, scenario, window=(scenario.warmup_s, scenario.duration_s), planned=len(specs),
        failures=job.failures, client_cpu_s=job.client_cpu_s,
    )
    return report, records, [spec[4] for spec in specs]


def run_sweep(pool: Any, scenario: BenchScenario, cfg: dict[str, Any], seed: int,
              client_workers: int, progress: Any = None,
              asked: list[tuple[Any, int]] | None = None,
              live: Callable[[int | None], ProgressLine] | None = None) -> dict[str, Any]:
    """The pooled report with its `sweep` rows; `asked`, when given, gets each
    record (on the pooled clock) with the max_tokens it asked for; `live`
    makes each level's progress line."""
    from qosgate.bench.plan import sweep_pool
    from qosgate.bench.pool import split_users
    from qosgate.bench.report import build_bench_report, level_window, records_from, sweep_row

    assert scenario.sweep is not None
    rows = []
    pooled = []
    failures: list[str] = []
    planned: int | None = 0
    cpu = 0.0
    offset = 0.0
    for concurrency in scenario.sweep.concurrency:
        spec_pool = sweep_pool(scenario, concurrency, seed)
        base = {
            "concurrency": concurrency,
            "pool": spec_pool,
            "requests": scenario.sweep.requests,
            "duration_s": scenario.sweep.duration_s,
        }
        payloads = [{**base, "users": users} for users in split_users(concurrency, client_workers)]
        line = live(scenario.sweep.requests) if live is not None else None
        job = pool.run("closed", cfg, payloads, line)
        if line is not None:
            line.end()
        records = records_from(job.records)
        level_planned = scenario.sweep.requests
        report = build_bench_report(
            records, scenario, window=level_window(records), planned=level_planned,
            failures=job.failures, client_cpu_s=job.client_cpu_s,
        )
        row = sweep_row(concurrency, report)
        rows.append(row)
        if progress is not None:
            progress(row)
        failures.extend(job.failures)
        cpu += job.client_cpu_s
        planned = None if planned is None or level_planned is None else planned + level_planned
        last = max((r.end for r in records), default=0.0)
        shifted = [r.shifted(offset) for r in records]
        pooled.extend(shifted)
        if asked is not None:
            # A level's users cycle through its pool: request n is pool[n % size].
            asked.extend((r, spec_pool[r.rid % len(spec_pool)][4]) for r in shifted)
        offset += last
    combined = build_bench_report(
        pooled, scenario, window=level_window(pooled), planned=planned, failures=failures,
        client_cpu_s=cpu,
    )
    # Request ids restart at every level, so the pooled report cannot tell a
    # duplicate from a request of another level; the levels' own counts can.
    combined["totals"]["lost"] = sum(row["lost"] for row in rows)
    combined["totals"]["duplicates"] = sum(row["totals"]["duplicates"] for row in rows)
    combined["sweep"] = rows
    return combined


def bench_command(args: argparse.Namespace) -> int:
    from qosgate.bench.pool import PoolError, WorkerPool
    from qosgate.bench.report import format_bench, plot_open, plot_sweep, write_trace
    from qosgate.bench.scenario import load_bench_scenario
    from qosgate.config.loader import ConfigError

    try:
        scenario = load_bench_scenario(args.scenario)
    except ConfigError as exc:
        print(f"qosgate bench: {args.scenario} is not a valid bench scenario:\n{exc}",
              file=sys.stderr)
        return 2
    try:
        urls = api_bases(args.url)
        keys = resolve_keys(scenario)
        if args.workers is not None and args.workers < 1:
            raise BenchUsageError(f"--workers: must be at least 1, got {args.workers}")
        if not args.label or any(c.isspace() for c in args.label):
            raise BenchUsageError(f"--label: must be a non-empty word, got {args.label!r}")
    except BenchUsageError as exc:
        print(f"qosgate bench: {exc}", file=sys.stderr)
        return 2
    seed = scenario.seed if args.seed is None else args.seed
    workers = args.workers or max(1, min(DEFAULT_WORKERS, os.cpu_count() or 1))
    cfg = job_config(scenario, urls, keys, seed)
    # "url" stays one string for readers of single-endpoint results; joined, it
    # is also an argument that repeats the run.
    url = ",".join(urls)
    result: dict[str, Any] = {
        "scenario": scenario.name,
        "mode": scenario.mode,
        "url": url,
        "urls": urls,
        "model": scenario.model,
        "endpoint": scenario.endpoint,
        "stream": scenario.stream,
        "seed": seed,
        "workers": workers,
    }
    if scenario.mode == "open":
        result["rate_rps"] = scenario.arrivals.rate_rps
        result["duration_s"] = scenario.duration_s

    def progress(row: dict[str, Any]) -> None:
        if not args.quiet:
            print(f"  {row['concurrency']} users: {row['completed']}/{row['requests']} completed, "
                  f"{row['throughput_rps']:.1f} req/s", file=sys.stderr, flush=True)

    records = None
    asked: list[tuple[Any, int]] = []
    try:
        with WorkerPool(workers) as pool:
            if scenario.mode == "open":
                if not args.quiet:
                    print(f"qosgate bench: {scenario.name}: open loop for {scenario.duration_s:g} s "
                          f"against {url} ({workers} client processes)", file=sys.stderr, flush=True)
                live = None if args.quiet else ProgressLine(sys.stderr, None)
                report, records, asks = run_open(pool, scenario, cfg, seed, workers, live)
                asked = [(r, asks[r.rid]) for r in records]
            else:
                if not args.quiet:
                    print(f"qosgate bench: {scenario.name}: sweep against {url} "
                          f"({workers} client processes)", file=sys.stderr, flush=True)
                report = run_sweep(
                    pool, scenario, cfg, seed, workers, progress, asked,
                    None if args.quiet else lambda planned: ProgressLine(sys.stderr, planned),
                )  # fmt: skip
    except PoolError as exc:
        print(f"qosgate bench: {exc}", file=sys.stderr)
        return 1
    result["policies"] = {args.label: report}

    print(format_bench(result))
    if args.json_path:
        Path(args.json_path).write_text(json.dumps(result, indent=2))
        print(f"wrote {args.json_path}")
    if args.record_path:
        try:
            write_trace(args.record_path, asked, scenario)
        except OSError as exc:
            print(f"qosgate bench: --record: cannot write {args.record_path}: {exc}",
                  file=sys.stderr)
            return 1
        print(f"wrote {args.record_path}")
    if args.plot_path:
        if scenario.mode == "sweep":
            plot_sweep(result, args.plot_path)
        else:
            assert records is not None
            plot_open(result, {args.label: records}, scenario, args.plot_path)
        print(f"wrote {args.plot_path}")
    totals = report["totals"]
    if totals["lost"] or totals["worker_failures"]:
        print(f"qosgate bench: {totals['lost']} requests lost, "
              f"{totals['worker_failures']} worker failures", file=sys.stderr)
        return 1
    if totals["sent"] and not totals["answered"]:
        # Every request failed (the endpoint down, every key wrong): the run
        # measured nothing, and a script running it must see so. Refusals
        # (429, 503 overloaded) are answers, and a run of them measures one.
        causes = ", ".join(f"{k} x{v}" for k, v in (totals.get("error_types") or {}).items())
        print(f"qosgate bench: every request failed ({totals['sent']} sent"
              + (f"; {causes}" if causes else "") + ")", file=sys.stderr)
        return 1
    return 0
