"""Bench records -> the benchmarks' result JSON (docs/BENCH.md), a table and plots.

The per-tier, per-tenant and total figures come from the same code as
`qosgate simulate` (`qosgate.sim.report.build_policy_report`): each record
becomes a finished request record with the outcome the client saw, so the two
commands' results read the same. The client adds what only it measures
(errors by type, end-to-end, TPOT and inter-token latency, requests/s, its
own send lag) and blanks what it cannot see (time spent in the gateway's
queue).
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, replace
from itertools import accumulate
from pathlib import Path
from typing import Any

from qosgate.bench.client import COMPLETED, RECORD_FIELDS
from qosgate.bench.scenario import BenchScenario
from qosgate.config.models import PolicyConfig
from qosgate.core.request import Outcome, Request, RequestState
from qosgate.observability.stats import percentile
from qosgate.observability.trace import trace_line
from qosgate.sim.report import build_policy_report, fmt_cell, format_table, pyplot, save_figure

_OUTCOMES = {
    COMPLETED: Outcome.COMPLETED,
    "rejected_quota": Outcome.REJECTED_QUOTA,
    "rejected_queue_full": Outcome.REJECTED_QUEUE_FULL,
    "rejected_overload": Outcome.REJECTED_OVERLOAD,
    "expired": Outcome.EXPIRED,
    "error": Outcome.BACKEND_ERROR,
}
_REJECTED = ("rejected_quota", "rejected_queue_full", "rejected_overload")
_INVISIBLE = ("queue_wait_p99_s", "queue_wait_max_s", "queue_depth_max", "queue_depth_mean")


@dataclass(frozen=True, slots=True)
class Record:
    """One request as the client saw it (times in seconds after the run's start)."""

    rid: int
    cls: int
    sent: float
    first: float | None
    """First content chunk (streaming) or the whole response (not streaming)."""
    end: float
    status: int
    """HTTP status; 0 when none came (connection error, timeout)."""
    outcome: str
    error_type: str | None
    error_code: str | None
    prompt_tokens: int
    """The prompt's length as asked (what a replay sends again)."""
    output_tokens: int
    itl: tuple[float, ...] | None
    lag: float
    """How late the client sent it against its planned time (open loop)."""
    prompt_counted: int | None = None
    """The prompt's length as the server counted it (its `usage`), where it said."""

    @property
    def prompt_served(self) -> int:
        """The prompt tokens the server worked on: its own count where it gave
        one, what was asked otherwise."""
        return self.prompt_tokens if self.prompt_counted is None else self.prompt_counted

    @property
    def ttft(self) -> float | None:
        return None if self.first is None else self.first - self.sent

    @property
    def e2e(self) -> float:
        return self.end - self.sent

    @property
    def tpot(self) -> float | None:
        """Time per output token after the first (streamed, completed, > 1 token)."""
        if self.outcome != COMPLETED or self.itl is None or self.first is None:
            return None
        if self.output_tokens < 2:
            return None
        return (self.end - self.first) / (self.output_tokens - 1)

    def shifted(self, offset: float) -> Record:
        first = None if self.first is None else self.first + offset
        return replace(self, sent=self.sent + offset, first=first, end=self.end + offset)


def records_from(raw: Iterable[tuple]) -> list[Record]:
    assert len(RECORD_FIELDS) == 14
    return [Record(*row) for row in raw]


def bench_policy(scenario: BenchScenario) -> PolicyConfig:
    """A policy holding the scenario's tiers (SLOs) and tenants, for the report."""
    tiers = {
        name: {"priority": index, "ttft_slo_ms": tier.ttft_slo_ms, "e2e_slo_ms": tier.e2e_slo_ms}
        for index, (name, tier) in enumerate(scenario.tiers.items())
    }
    tenants: dict[str, str] = {}
    for cls_ in scenario.classes:
        tenants.setdefault(cls_.tenant_id, cls_.tier)
    return PolicyConfig.model_validate(
        {"tiers": tiers, "tenants": [{"id": t, "tier": tier} for t, tier in tenants.items()]}
    )


def _as_request(record: Record, scenario: BenchScenario) -> Request:
    cls_ = scenario.classes[record.cls]
    request = Request(
        str(record.rid), cls_.tenant_id, cls_.tier, max(1, record.prompt_served),
        max(1, record.output_tokens), record.sent,
    )  # fmt: skip
    request.state = RequestState.FINISHED
    request.outcome = _OUTCOMES.get(record.outcome, Outcome.BACKEND_ERROR)
    request.first_token_at = record.first
    request.finished_at = record.end
    request.output_tokens = record.output_tokens
    return request


def write_trace(path: str | Path, asked: Iterable[tuple[Record, int]], scenario: BenchScenario) -> None:
    """The requests as the client sent them, in the trace format `qosgate
    simulate` replays (the gateway's own trace's): when each was sent, its
    class's tenant and tier, the lengths asked and produced, and the outcome
    seen. `asked` pairs each record with its max_tokens."""
    rows = sorted(asked, key=lambda pair: (pair[0].sent, pair[0].rid))
    with Path(path).open("w", encoding="utf-8") as handle:
        for record, max_tokens in rows:
            cls_ = scenario.classes[record.cls]
            handle.write(trace_line(
                t=record.sent, tenant=cls_.tenant_id, tier=cls_.tier,
                prompt_tokens=max(1, record.prompt_tokens), max_tokens=max_tokens,
                output_tokens=record.output_tokens,
                outcome=_OUTCOMES.get(record.outcome, Outcome.BACKEND_ERROR).value,
            ))  # fmt: skip


def _latency_stats(records: Sequence[Record]) -> dict[str, Any]:
    done = [r for r in records if r.outcome == COMPLETED]
    series = {
        "ttft": [r.ttft for r in done if r.ttft is not None],
        "e2e": [r.e2e for r in done],
        "tpot": [t for t in (r.tpot for r in done) if t is not None],
        "itl": [gap for r in done if r.itl for gap in r.itl],
    }
    return {f"{name}_p{q}_s": percentile(values, q) for name, values in series.items()
            for q in (50, 99)}  # fmt: skip


def _errors(records: Iterable[Record]) -> tuple[int, dict[str, int]]:
    kinds = Counter(r.error_type or "?" for r in records if r.outcome == "error")
    return sum(kinds.values()), dict(sorted(kinds.items()))


def build_bench_report(
    records: Sequence[Record],
    scenario: BenchScenario,
    *,
    window: tuple[float, float],
    planned: int | None,
    failures: Sequence[str] = (),
    client_cpu_s: float = 0.0,
) -> dict[str, Any]:
    """The `{"tiers", "tenants", "totals"}` object of one run (one label, or
    one sweep level).

    window is [start, end) in seconds of the run: statistics cover requests
    sent in it and rates are per second of it, as in `qosgate simulate`.
    planned is how many requests were meant to be sent (None when a
    duration-bound sweep decides that as it goes); `lost` is planned minus
    those with a record, plus records without an outcome.
    """
    policy = bench_policy(scenario)
    requests = [_as_request(r, scenario) for r in records]
    report = build_policy_report(
        requests, policy, window=window, metrics=scenario.metrics, samples=[]
    )
    start, end = window
    length = end - start
    in_window = [r for r in records if start <= r.sent < end]
    by_tier: dict[str, list[Record]] = {name: [] for name in report["tiers"]}
    by_tenant: dict[str, list[Record]] = {name: [] for name in report["tenants"]}
    for record in in_window:
        cls_ = scenario.classes[record.cls]
        by_tier.setdefault(cls_.tier, []).append(record)
        by_tenant.setdefault(cls_.tenant_id, []).append(record)
    for name, stats in report["tiers"].items():
        recs = by_tier.get(name, [])
        for key in _INVISIBLE:
            # The client cannot see the gateway's queue.
            stats[key] = None
        stats["errors"], stats["error_types"] = _errors(recs)
        stats.update(_latency_stats(recs))
        stats["throughput_rps"] = sum(1 for r in recs if r.outcome == COMPLETED and r.end < end) / length
    for name, stats in report["tenants"].items():
        stats["errors"], _ = _errors(by_tenant.get(name, []))

    recorded = {r.rid for r in records}
    duplicates = len(records) - len(recorded)
    missing = 0 if planned is None else max(0, planned - len(recorded))
    unknown = sum(1 for r in records if r.outcome not in _OUTCOMES)
    totals = report["totals"]
    done_in_window = [r for r in records if r.outcome == COMPLETED and start <= r.end < end]
    totals["errors"], totals["error_types"] = _errors(in_window)
    totals["rejected_by_status"] = dict(sorted(Counter(
        str(r.status) for r in in_window if r.outcome in _REJECTED or r.outcome == "expired"
    ).items()))  # fmt: skip
    totals["throughput_rps"] = len(done_in_window) / length
    totals.update(_latency_stats(in_window))
    lags = [r.lag for r in records]
    totals["client_send_lag_p99_s"] = percentile(lags, 99)
    totals["client_send_lag_max_s"] = max(lags) if lags else None
    totals["client_cpu_s"] = client_cpu_s
    totals["wall_s"] = max((r.end for r in records), default=0.0)
    totals["planned"] = planned
    totals["sent"] = len(records)
    # Over the whole run, not the window: whether anything was answered at all.
    totals["answered"] = sum(1 for r in records if r.outcome != "error")
    totals["duplicates"] = duplicates
    totals["worker_failures"] = len(failures)
    totals["lost"] = missing + unknown + totals.get("lost", 0)
    if failures:
        totals["failures"] = [f[-2000:] for f in failures]
    return report


def level_window(records: Sequence[Record]) -> tuple[float, float]:
    """A closed-loop level's window: from its start to its last answer."""
    last = max((r.end for r in records), default=0.0)
    return 0.0, max(last * (1 + 1e-9) + 1e-9, 1e-6)


_ROW_KEYS = (
    "requests", "completed", "rejected", "expired", "errors", "lost", "throughput_rps",
    "output_tokens_per_s", "throughput_tokens_per_s", "goodput_rps", "ttft_p50_s", "ttft_p99_s",
    "e2e_p50_s", "e2e_p99_s", "tpot_p50_s", "tpot_p99_s", "itl_p50_s", "itl_p99_s", "wall_s",
    "client_cpu_s",
)  # fmt: skip


def sweep_row(concurrency: int, report: dict[str, Any]) -> dict[str, Any]:
    """One sweep level: its totals flattened, with its full report alongside."""
    totals = report["totals"]
    return {
        "concurrency": concurrency, **{key: totals.get(key) for key in _ROW_KEYS},
        "tiers": report["tiers"], "tenants": report["tenants"], "totals": totals,
    }  # fmt: skip


# -- text --------------------------------------------------------------------------------


def _ms(value: Any) -> str:
    return "-" if value is None else f"{value * 1000:.1f}"


def format_bench(result: dict[str, Any]) -> str:
    """The run as text: the simulate-style tier table (open loop) or one row
    per concurrency level (sweep), then the client's own figures."""
    lines: list[str] = []
    if result.get("mode") == "sweep":
        lines.append(f"scenario {result.get('scenario', '?')}  sweep  {result.get('url', '')}")
        for label, run in result.get("policies", {}).items():
            lines.append("")
            lines.append(f"{label}  (latencies in ms)")
            lines.append(
                "  users  requests  completed  rejected  errors  lost     req/s  out tok/s"
                "  ttft_p50  ttft_p99   e2e_p50   e2e_p99  tpot_p50   itl_p99"
            )
            for row in run.get("sweep", []):
                lines.append(
                    f"  {row['concurrency']:>5} {row['requests']:>9} {row['completed']:>10}"
                    f" {row['rejected']:>9} {row['errors']:>7} {row['lost']:>5}"
                    f" {fmt_cell(row['throughput_rps'], '.1f'):>9}"
                    f" {fmt_cell(row['output_tokens_per_s'], '.1f'):>10}"
                    f" {_ms(row['ttft_p50_s']):>9} {_ms(row['ttft_p99_s']):>9}"
                    f" {_ms(row['e2e_p50_s']):>9} {_ms(row['e2e_p99_s']):>9}"
                    f" {_ms(row['tpot_p50_s']):>9} {_ms(row['itl_p99_s']):>9}"
                )
            lines.append(_totals_line(run.get("totals", {})))
        return "\n".join(lines)
    lines.append(format_table(result))
    for label, run in result.get("policies", {}).items():
        totals = run.get("totals", {})
        lines.append("")
        lines.append(
            f"{label}: e2e p50 {_ms(totals.get('e2e_p50_s'))} ms, p99 {_ms(totals.get('e2e_p99_s'))} ms;"
            f" TPOT p50 {_ms(totals.get('tpot_p50_s'))} ms; ITL p99 {_ms(totals.get('itl_p99_s'))} ms;"
            f" {fmt_cell(totals.get('throughput_rps'), '.2f')} req/s,"
            f" {fmt_cell(totals.get('output_tokens_per_s'), '.1f')} output tok/s"
        )
        lines.append(_totals_line(totals))
    return "\n".join(lines)


def _totals_line(totals: dict[str, Any]) -> str:
    errors = totals.get("error_types") or {}
    kinds = ", ".join(f"{k} {v}" for k, v in errors.items())
    line = (
        f"  sent {totals.get('sent')}, completed {totals.get('completed')},"
        f" rejected {totals.get('rejected')}, expired {totals.get('expired')},"
        f" errors {totals.get('errors')}{f' ({kinds})' if kinds else ''},"
        f" lost {totals.get('lost')}; client send lag p99 {_ms(totals.get('client_send_lag_p99_s'))} ms"
    )
    if totals.get("worker_failures"):
        line += f"; {totals['worker_failures']} load-generator worker(s) failed"
    return line


# -- plots -------------------------------------------------------------------------------


def plot_sweep(result: dict[str, Any], path: str | Path) -> None:
    """Throughput against latency, one curve per label, each point a concurrency
    level: requests/s against end-to-end latency, and output tokens/s against TTFT."""
    plt = pyplot()
    fig, (left, right) = plt.subplots(1, 2, figsize=(11, 4.5))
    palette = plt.get_cmap("tab10")
    for index, (label, run) in enumerate(result.get("policies", {}).items()):
        rows = run.get("sweep", [])
        colour = palette(index % 10)
        for ax, x_key, y_key in ((left, "throughput_rps", "e2e"), (right, "output_tokens_per_s", "ttft")):
            xs = [row[x_key] or 0.0 for row in rows]
            for q, style in (("p50", "-o"), ("p99", "--s")):
                ys = [(row[f"{y_key}_{q}_s"] or float("nan")) * 1000 for row in rows]
                ax.plot(xs, ys, style, color=colour, label=f"{label} {q}", markersize=4)
                if q == "p50":
                    for x, y, row in zip(xs, ys, rows):
                        ax.annotate(str(row["concurrency"]), (x, y), textcoords="offset points",
                                    xytext=(3, 3), fontsize=7, color=colour)
    left.set_xlabel("throughput (requests/s)")
    left.set_ylabel("end-to-end latency (ms)")
    right.set_xlabel("throughput (output tokens/s)")
    right.set_ylabel("TTFT (ms)")
    for ax in (left, right):
        ax.set_yscale("log")
        ax.grid(True, which="both", alpha=0.3)
        ax.legend(fontsize="small")
    fig.suptitle(f"{result.get('scenario', '?')}: throughput against latency "
                 "(points labelled with concurrency)")
    fig.tight_layout()
    save_figure(fig, path)


def plot_open(result: dict[str, Any], records: dict[str, list[Record]],
              scenario: BenchScenario, path: str | Path) -> None:
    """Open loop: requests in flight per tier over time (top) and TTFT per tier
    over time (bottom), one column per label."""
    plt = pyplot()
    labels = list(records)
    tiers = list(scenario.tiers)
    palette = plt.get_cmap("tab10")
    colour = {name: palette(i % 10) for i, name in enumerate(tiers)}
    fig, axes = plt.subplots(2, len(labels), figsize=(5 * len(labels), 6.5), sharex=True,
                             sharey="row", squeeze=False)
    for col, label in enumerate(labels):
        top, bottom = axes[0][col], axes[1][col]
        for tier in tiers:
            recs = [r for r in records[label] if scenario.classes[r.cls].tier == tier]
            events = sorted([(r.sent, 1) for r in recs] + [(r.end, -1) for r in recs])
            xs = [t for t, _ in events]
            ys = list(accumulate(step for _, step in events))
            if xs:
                top.step(xs, ys, where="post", color=colour[tier], label=tier, linewidth=1.0)
            points = [(r.sent, r.ttft) for r in recs if r.ttft is not None and r.ttft > 0]
            if points:
                bottom.scatter([p[0] for p in points], [p[1] for p in points], s=4,
                               color=colour[tier], label=tier, alpha=0.6, linewidths=0)
        top.set_title(label)
        bottom.set_yscale("log")
        bottom.set_xlabel("time since start (s)")
        if col == 0:
            top.set_ylabel("requests in flight")
            bottom.set_ylabel("TTFT (s)")
        top.legend(fontsize="small")
    fig.suptitle(f"{result.get('scenario', '?')}: {result.get('url', '')}")
    fig.tight_layout()
    save_figure(fig, path)
