"""Turning one simulated run into the benchmarks' result JSON, a table and a plot.

`build_policy_report` gives the `{"tiers", "tenants", "totals"}` object of one
scheduler policy in the machine-readable result; `format_table` prints a
whole result; `plot_run` draws queue depth and TTFT over time per policy.
"""

from __future__ import annotations

import importlib
import math
from bisect import bisect_right
from collections import Counter, defaultdict
from pathlib import Path
from typing import Any

from qosgate.config.models import PolicyConfig, TierConfig
from qosgate.core.request import Outcome, Request
from qosgate.observability.stats import percentile
from qosgate.sim.scenario import MetricsConfig

REJECTED = frozenset(
    {Outcome.REJECTED_QUOTA, Outcome.REJECTED_OVERLOAD, Outcome.REJECTED_QUEUE_FULL}
)
# Simulated times are sums of floats; a request landing exactly on its SLO
# must not fail it by rounding.
_EPS = 1e-9


def met_slo(request: Request, tier: TierConfig | None) -> bool:
    """Whether a request met its tier's objective (Request.met_objective); a
    tier with none is met by completing."""
    if tier is None:
        return request.outcome is Outcome.COMPLETED
    met = request.met_objective(*tier.objectives_s)
    return request.outcome is Outcome.COMPLETED if met is None else met


def _queue_wait(request: Request) -> float | None:
    if request.dispatched_at is not None:
        return request.dispatched_at - request.arrival
    # Never dispatched: it waited until it expired or was cancelled. Refusals at
    # the door never queued, so they add no wait.
    if request.outcome in REJECTED or request.finished_at is None:
        return None
    return request.finished_at - request.arrival


def _tier_stats(
    requests: list[Request], tier: TierConfig | None, window_len: float
) -> dict:
    counts = Counter(request.outcome for request in requests)
    rejected_quota = counts[Outcome.REJECTED_QUOTA]
    judged = len(requests) - rejected_quota
    met = sum(1 for request in requests if met_slo(request, tier))

    ttft_attainment: float | None = None
    if tier is not None and tier.ttft_slo_ms is not None and judged > 0:
        ttft_slo_s = tier.objectives_s[0]
        ttft_attainment = sum(1 for r in requests if r.met_objective(ttft_slo_s, None)) / judged

    ttfts = sorted(r.first_token_at - r.arrival for r in requests if r.first_token_at is not None)
    waits = sorted(w for w in map(_queue_wait, requests) if w is not None)
    served_waits = [r.dispatched_at - r.arrival for r in requests if r.dispatched_at is not None]
    e2es = sorted(
        r.finished_at - r.arrival
        for r in requests
        if r.outcome is Outcome.COMPLETED and r.finished_at is not None
    )
    return {
        "requests": len(requests),
        "completed": counts[Outcome.COMPLETED],
        "rejected": sum(counts[o] for o in REJECTED),
        "rejected_quota": rejected_quota,
        "rejected_overload": counts[Outcome.REJECTED_OVERLOAD],
        "rejected_queue_full": counts[Outcome.REJECTED_QUEUE_FULL],
        "expired": counts[Outcome.EXPIRED],
        "cancelled": counts[Outcome.CANCELLED],
        "backend_error": counts[Outcome.BACKEND_ERROR],
        "lost": counts[None],
        "ttft_slo_attainment": ttft_attainment,
        "slo_attainment": met / judged if judged > 0 else None,
        "ttft_p50_s": percentile(ttfts, 50),
        "ttft_p99_s": percentile(ttfts, 99),
        "queue_wait_p99_s": percentile(waits, 99),
        "queue_wait_max_s": waits[-1] if waits else None,
        "served_wait_max_s": max(served_waits, default=None),
        "e2e_p50_s": percentile(e2es, 50),
        "e2e_p99_s": percentile(e2es, 99),
        "goodput_rps": met / window_len,
    }


class _ServiceLedger:
    """Weighted service per tenant, per fairness window and over the whole
    measurement window (the fairness metric of B4, docs/SIMULATE.md).

    A request's prompt tokens count at its first token; its output tokens are
    spread evenly over [first_token_at, finished_at].
    """

    def __init__(self, start: float, end: float, width: float) -> None:
        self.start, self.end = start, end
        count = math.floor((end - start) / width + _EPS)
        # A run shorter than one fairness window is judged as a single window.
        self.width = width if count >= 1 else end - start
        self.count = max(count, 1)
        self.windows: dict[str, list[float]] = defaultdict(lambda: [0.0] * self.count)
        self.total: dict[str, float] = defaultdict(float)

    def _point(self, tenant: str, t: float, amount: float) -> None:
        if not self.start <= t < self.end:
            return
        self.total[tenant] += amount
        k = int((t - self.start) // self.width)
        if k < self.count:
            self.windows[tenant][k] += amount

    def _spread(self, tenant: str, t0: float, t1: float, amount: float) -> None:
        density = amount / (t1 - t0)
        lo, hi = max(t0, self.start), min(t1, self.end)
        if hi > lo:
            self.total[tenant] += density * (hi - lo)
        bins_end = self.start + self.count * self.width
        lo, hi = max(t0, self.start), min(t1, bins_end)
        if hi <= lo:
            return
        bins = self.windows[tenant]
        first = int((lo - self.start) // self.width)
        last = min(int((hi - self.start) // self.width), self.count - 1)
        for k in range(first, last + 1):
            w0 = self.start + k * self.width
            overlap = min(hi, w0 + self.width) - max(lo, w0)
            if overlap > 0:
                bins[k] += density * overlap

    def add(self, request: Request, w_in: float, w_out: float, weight: float,
            key: str | None = None) -> None:
        """Count `request` under `key`, its tenant by default."""
        t0 = request.first_token_at
        if t0 is None:
            return
        tenant = request.tenant if key is None else key
        self._point(tenant, t0, w_in * request.prompt_tokens / weight)
        out = w_out * request.output_tokens / weight
        if out <= 0:
            return
        t1 = request.finished_at
        if t1 is None or t1 <= t0:
            self._point(tenant, t0, out)
        else:
            self._spread(tenant, t0, t1, out)


def _backlogged_windows(
    requests: list[Request], start: float, width: float, count: int
) -> list[bool]:
    """For each fairness window, whether the tenant had a request arrived but not
    finished at every instant of it."""
    spans = sorted(
        (r.arrival, r.finished_at if r.finished_at is not None else math.inf) for r in requests
    )
    starts: list[float] = []
    ends: list[float] = []
    for s, e in spans:
        if starts and s <= ends[-1]:
            ends[-1] = max(ends[-1], e)
        else:
            starts.append(s)
            ends.append(e)
    flags = []
    for k in range(count):
        w0 = start + k * width
        i = bisect_right(starts, w0) - 1
        flags.append(i >= 0 and ends[i] >= w0 + width)
    return flags


def _service_differences(
    ledger: _ServiceLedger, by_tenant: dict[str, list[Request]], tier_of: dict[str, str]
) -> list[float]:
    # Fairness is a promise between tenants of one tier, so each tier's
    # tenants are compared among themselves and the tiers' differences added.
    backlog = {
        tenant: _backlogged_windows(reqs, ledger.start, ledger.width, ledger.count)
        for tenant, reqs in by_tenant.items()
    }
    groups: dict[str, list[str]] = defaultdict(list)
    for tenant in by_tenant:
        groups[tier_of[tenant]].append(tenant)
    diffs = [0.0] * ledger.count
    for tenants in groups.values():
        if len(tenants) < 2:
            continue
        for k in range(ledger.count):
            served = [ledger.windows[t][k] for t in tenants if backlog[t][k]]
            if len(served) >= 2:
                top = max(served)
                diffs[k] += sum(top - s for s in served)
    return diffs


def build_policy_report(
    requests: list[Request],
    policy: PolicyConfig,
    *,
    window: tuple[float, float],
    metrics: MetricsConfig,
    samples: list[tuple[float, dict[str, int]]],
) -> dict:
    """The `{"tiers", "tenants", "totals"}` object of one scheduler policy's run.

    window is the measurement window [start, end) in simulated seconds:
    per-request statistics cover requests that arrived in it, rates are per
    second of it, and service and throughput count what happened inside it.
    samples are (t, {tier: queued requests}) snapshots of queue depth.
    `lost` in totals counts every request without an outcome, in or out of the
    window.
    """
    start, end = window
    if not end > start:
        raise ValueError(f"empty measurement window {window!r}")
    length = end - start
    weights = {tenant.id: tenant.weight for tenant in policy.tenants}

    in_window = [r for r in requests if start <= r.arrival < end]
    by_tier: dict[str, list[Request]] = {name: [] for name in policy.tiers}
    by_tenant_window: dict[str, list[Request]] = {tenant.id: [] for tenant in policy.tenants}
    for request in in_window:
        by_tier.setdefault(request.tier, []).append(request)
        by_tenant_window.setdefault(request.tenant, []).append(request)

    tiers = {
        name: _tier_stats(reqs, policy.tiers.get(name), length) for name, reqs in by_tier.items()
    }
    depth: dict[str, list[int]] = defaultdict(list)
    for t, snapshot in samples:
        if start <= t < end:
            for name in tiers:
                depth[name].append(snapshot.get(name, 0))
    for name, stats in tiers.items():
        values = depth.get(name)
        stats["queue_depth_max"] = max(values) if values else None
        stats["queue_depth_mean"] = sum(values) / len(values) if values else None

    # Service and backlog look at every request, whenever it arrived: a request
    # from the warm-up still occupies the engine and the tenant's queue.
    ledger = _ServiceLedger(start, end, metrics.window_s)
    by_tenant_all: dict[str, list[Request]] = defaultdict(list)
    tier_of: dict[str, str] = {tenant.id: tenant.tier for tenant in policy.tenants}
    for request in requests:
        ledger.add(request, metrics.service_w_in, metrics.service_w_out,
                   weights.get(request.tenant, 1.0))
        by_tenant_all[request.tenant].append(request)
        tier_of.setdefault(request.tenant, request.tier)
    diffs = _service_differences(ledger, by_tenant_all, tier_of)

    tenants: dict[str, dict] = {}
    for tenant in sorted(by_tenant_window):
        reqs = by_tenant_window[tenant]
        ttfts = sorted(r.first_token_at - r.arrival for r in reqs if r.first_token_at is not None)
        tenants[tenant] = {
            "tier": tier_of.get(tenant),
            "weight": weights.get(tenant, 1.0),
            "requests": len(reqs),
            "completed": sum(1 for r in reqs if r.outcome is Outcome.COMPLETED),
            "rejected": sum(1 for r in reqs if r.outcome in REJECTED),
            "prompt_tokens": sum(r.prompt_tokens for r in reqs if r.first_token_at is not None),
            "output_tokens": sum(r.output_tokens for r in reqs),
            "service": ledger.total.get(tenant, 0.0),
            "ttft_p99_s": percentile(ttfts, 99),
        }

    # Throughput counts the tokens of completed requests as service does: when
    # they were delivered, not all at the completion. Counted at completion, a
    # window short beside a request's length (8k-token prompts in a minute)
    # measures the order of completions: a policy that finishes short requests
    # first looks slower until the long ones land, past the window's end.
    # A completion whose first token nobody saw (a client that read no content
    # before the end) counts whole at its end.
    delivered = _ServiceLedger(start, end, length)
    for request in requests:
        if request.outcome is not Outcome.COMPLETED:
            continue
        if request.first_token_at is None:
            if request.finished_at is not None and start <= request.finished_at < end:
                delivered.total["prompt"] += request.prompt_tokens
                delivered.total["output"] += request.output_tokens
            continue
        delivered.add(request, 1.0, 0.0, 1.0, key="prompt")
        delivered.add(request, 0.0, 1.0, 1.0, key="output")
    prompt_done = delivered.total["prompt"]
    output_done = delivered.total["output"]
    totals = {
        "requests": len(in_window),
        "completed": sum(s["completed"] for s in tiers.values()),
        "rejected": sum(s["rejected"] for s in tiers.values()),
        "expired": sum(s["expired"] for s in tiers.values()),
        "cancelled": sum(s["cancelled"] for s in tiers.values()),
        "throughput_tokens_per_s": (prompt_done + output_done) / length,
        "output_tokens_per_s": output_done / length,
        "goodput_rps": sum(s["goodput_rps"] for s in tiers.values()),
        "max_service_difference": max(diffs),
        "avg_service_difference": sum(diffs) / len(diffs),
        "service_windows": len(diffs),
        "lost": sum(1 for r in requests if r.outcome is None),
    }
    return {"tiers": tiers, "tenants": tenants, "totals": totals}


# -- text --------------------------------------------------------------------------------


def fmt_cell(value: object, spec: str = ".3f") -> str:
    """A table cell: `-` for None, a float as `spec` says, anything else as is."""
    if value is None:
        return "-"
    return f"{value:{spec}}" if isinstance(value, float) else str(value)


_COLUMNS = (
    ("tier", "<14", "name"),
    ("requests", ">9", "requests"),
    ("completed", ">10", "completed"),
    ("rejected", ">9", "rejected"),
    ("expired", ">8", "expired"),
    ("slo_att", ">8", "slo_attainment"),
    ("ttft_att", ">9", "ttft_slo_attainment"),
    ("ttft_p50", ">9", "ttft_p50_s"),
    ("ttft_p99", ">9", "ttft_p99_s"),
    ("wait_p99", ">9", "queue_wait_p99_s"),
    ("wait_max", ">9", "queue_wait_max_s"),
)


_HEADER = (
    ("load", "load {:g}x"),
    ("rate_rps", "rate {:.2f} req/s"),
    ("capacity_rps", "capacity {:.2f} req/s"),
)


def _header(result: dict) -> str:
    parts = [f"scenario {result.get('scenario', '?')}"]
    parts += [form.format(result[key]) for key, form in _HEADER if result.get(key) is not None]
    return "  ".join(parts)


def format_table(result: dict) -> str:
    """A fixed-width table of a result object: per policy, one row per tier and
    a totals line (plus target checks when the result carries `targets`)."""
    lines = [_header(result)]
    for policy, run in result.get("policies", {}).items():
        lines.append("")
        lines.append(f"policy {policy}  (times in seconds)")
        lines.append("  " + " ".join(f"{title:{align}}" for title, align, _ in _COLUMNS))
        for name, stats in run.get("tiers", {}).items():
            cells = []
            for _, align, key in _COLUMNS:
                value = name if key == "name" else stats.get(key)
                cells.append(f"{fmt_cell(value):{align}}")
            lines.append("  " + " ".join(cells))
        totals = run.get("totals", {})
        lines.append(
            "  totals: "
            f"throughput {fmt_cell(totals.get('throughput_tokens_per_s'), '.1f')} tok/s, "
            f"goodput {fmt_cell(totals.get('goodput_rps'), '.3f')} req/s, "
            f"max service diff {fmt_cell(totals.get('max_service_difference'), '.1f')} "
            f"(avg {fmt_cell(totals.get('avg_service_difference'), '.1f')}), "
            f"lost {fmt_cell(totals.get('lost'))}"
        )
    checks = result.get("targets")
    if checks:
        lines.append("")
        lines.append("targets")
        for check in checks:
            verdict = "PASS" if check.get("passed") else "FAIL"
            lines.append(
                f"  {verdict}  {check.get('name')}: {fmt_cell(check.get('value'), '.4g')} "
                f"{check.get('op')} {check.get('threshold'):g}"
            )
    return "\n".join(lines)


# -- plot --------------------------------------------------------------------------------


def plot_run(result_runs: dict, series: dict[str, dict], path: str | Path) -> None:
    """Write a PNG: one column per policy, queue depth per tier over time on top,
    TTFT per tier over time below (log scale), axes shared across policies.

    result_runs is the result object ({"scenario", "load", "policies", ...})
    whose scenario and load go in the title; a bare {policy: report} mapping
    also works. series[policy] holds "queue_depth": [(t, {tier: n})] and
    "ttft": [(t_arrival, tier, ttft_s)].
    """
    plt = pyplot()
    runs = result_runs.get("policies", result_runs)
    policies = [p for p in runs if p in series] + [p for p in series if p not in runs]
    if not policies:
        raise ValueError("nothing to plot: no policy has a series")

    # Every tier named anywhere, in the order first named.
    names: list[str] = []
    for policy in policies:
        names += runs.get(policy, {}).get("tiers", {})
        for _, snapshot in series[policy].get("queue_depth", ()):
            names += snapshot
        names += [name for _, name, _ in series[policy].get("ttft", ())]
    tiers = list(dict.fromkeys(names))
    palette = plt.get_cmap("tab10")
    colour = {name: palette(i % 10) for i, name in enumerate(tiers)}

    fig, axes = plt.subplots(
        2, len(policies), figsize=(4.5 * len(policies), 6.5), sharex=True, sharey="row",
        squeeze=False,
    )
    for col, policy in enumerate(policies):
        depth_ax, ttft_ax = axes[0][col], axes[1][col]
        data = series[policy]
        depth = data.get("queue_depth", ())
        times = [t for t, _ in depth]
        for name in tiers:
            if depth:
                depth_ax.step(times, [snap.get(name, 0) for _, snap in depth], where="post",
                              color=colour[name], label=name, linewidth=1.0)
        depth_ax.set_title(policy)
        by_tier: dict[str, tuple[list[float], list[float]]] = {n: ([], []) for n in tiers}
        for t, name, ttft in data.get("ttft", ()):
            if ttft is not None and ttft > 0:
                by_tier[name][0].append(t)
                by_tier[name][1].append(ttft)
        for name, (xs, ys) in by_tier.items():
            if xs:
                ttft_ax.scatter(xs, ys, s=3, color=colour[name], label=name, alpha=0.6,
                                linewidths=0, rasterized=True)
        ttft_ax.set_yscale("log")
        ttft_ax.set_xlabel("simulated time (s)")
        if col == 0:
            depth_ax.set_ylabel("queued requests")
            ttft_ax.set_ylabel("TTFT (s)")
    handles = [
        plt.Line2D([], [], color=colour[name], marker="o", linestyle="", label=name)
        for name in tiers
    ]
    fig.legend(handles=handles, loc="upper right", title="tier", fontsize="small")
    title = f"scenario {result_runs.get('scenario', '?')}" if "policies" in result_runs else "run"
    if result_runs.get("load") is not None:
        title += f", load {result_runs['load']:g}x"
    fig.suptitle(title)
    fig.tight_layout(rect=(0, 0, 0.9, 0.95))
    save_figure(fig, path)


PLOT_EXTRA = "plots need matplotlib: pip install 'qosgate[plot]'"


def plotting_missing() -> str | None:
    """Why plots cannot be drawn here (matplotlib, the `plot` extra, is not
    installed), or None. The commands ask before a run, not after it."""
    try:
        importlib.import_module("matplotlib")
    except ImportError:
        return PLOT_EXTRA
    return None


def pyplot() -> Any:
    """matplotlib's pyplot, drawing to files only (no display needed)."""
    try:
        import matplotlib
    except ImportError:
        raise ImportError(PLOT_EXTRA) from None

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def save_figure(fig: Any, path: str | Path) -> None:
    fig.savefig(Path(path), dpi=100)
    pyplot().close(fig)
