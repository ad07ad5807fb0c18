"""Prometheus metrics, named as DESIGN.md section 7 names them.

`GatewayMetrics` owns its metrics in a registry it is given (a fresh one by
default), so two gateways in one process, or a test, never share counters.
Events are recorded where they happen (a request refused at the door, a
batch released, a first token, a request's end); what is a level rather than
an event (queue depth, oldest wait, backend in flight) is read from the
gateway when Prometheus scrapes, so the hot path pays nothing for it.

The events are kept as plain numbers and handed to prometheus_client as
metric families when it collects (its custom-collector interface), rather
than as its Counter and Histogram objects: those take a lock on every update
so that threads can share them, and a request updates about fifteen series.
Every update happens on the gateway's event loop, as does every scrape, so
the numbers need no lock. The exposition is the same either way: totals,
cumulative buckets, sums, counts and `_created` samples.

With `tenant_labels` off, the per-tenant series (`tokens_total`,
`quota_remaining_tokens`) carry `tenant="all"`: a fleet with many thousand
tenants keeps a bounded number of series.
"""

from __future__ import annotations

import bisect
import collections
import os
import time
from collections.abc import Callable, Iterable, Iterator
from typing import Any

from prometheus_client import CollectorRegistry
from prometheus_client.core import (
    CounterMetricFamily,
    GaugeMetricFamily,
    HistogramMetricFamily,
    Metric,
)
from prometheus_client.registry import Collector
from prometheus_client.samples import Sample
from prometheus_client.utils import floatToGoString

from qosgate.config.models import PolicyConfig
from qosgate.core.request import Outcome, Request

PREFIX = "qosgate_"

# Seconds; from a fast first token to a long batch job.
LATENCY_BUCKETS = (0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.0, 5.0, 10.0, 30.0, 60.0, 120.0, 300.0)
TPOT_BUCKETS = (0.005, 0.01, 0.02, 0.03, 0.05, 0.075, 0.1, 0.2, 0.5, 1.0)
BATCH_SIZE_BUCKETS = (1, 2, 4, 8, 16, 32, 64, 128, 256)
BATCH_WAIT_BUCKETS = (0.0, 0.001, 0.005, 0.01, 0.02, 0.05, 0.1, 0.2, 0.5, 1.0, 2.0)

RECENT = 512
"""First-token times kept per tier for /admin/stats percentiles."""

# prometheus_client's own switch for the `_created` samples, honoured here too.
_WITH_CREATED = os.environ.get("PROMETHEUS_DISABLE_CREATED_SERIES", "False").lower() not in (
    "true", "1", "t",
)  # fmt: skip


class _Counter:
    """A counter's series: label values -> [total, created]."""

    __slots__ = ("name", "doc", "labels", "series")

    def __init__(self, name: str, doc: str, labels: tuple[str, ...]) -> None:
        self.name = name
        self.doc = doc
        self.labels = labels
        self.series: dict[tuple[str, ...], list[float]] = {}

    def inc(self, key: tuple[str, ...], amount: float = 1.0) -> None:
        series = self.series.get(key)
        if series is None:
            series = self.series[key] = [0.0, time.time()]
        series[0] += amount

    def totals(self) -> Iterator[tuple[tuple[str, ...], float]]:
        for key, (total, _) in self.series.items():
            yield key, total

    def family(self) -> Metric:
        family = CounterMetricFamily(self.name, self.doc, labels=self.labels)
        for key, (total, created) in self.series.items():
            family.add_metric(key, total, created=created if _WITH_CREATED else None)
        return family


class _Histogram:
    """A histogram's series: label values -> [count per bucket..., +Inf count,
    sum, created]. An unlabelled one exists (all zeros) from the start, as
    prometheus_client's does."""

    __slots__ = ("name", "doc", "labels", "bounds", "series")

    def __init__(
        self, name: str, doc: str, labels: tuple[str, ...], bounds: tuple[float, ...]
    ) -> None:
        self.name = name
        self.doc = doc
        self.labels = labels
        self.bounds = bounds
        self.series: dict[tuple[str, ...], list[float]] = {}
        if not labels:
            self._new(())

    def _new(self, key: tuple[str, ...]) -> list[float]:
        series = self.series[key] = [0] * (len(self.bounds) + 1) + [0.0, time.time()]
        return series

    def observe(self, key: tuple[str, ...], value: float) -> None:
        series = self.series.get(key)
        if series is None:
            series = self._new(key)
        # A bucket counts the values at most its bound ("le"): the first bound
        # not below the value, or +Inf past the last.
        series[bisect.bisect_left(self.bounds, value)] += 1
        series[-2] += value

    def family(self) -> Metric:
        family = HistogramMetricFamily(self.name, self.doc, labels=self.labels)
        names = [floatToGoString(b) for b in self.bounds] + ["+Inf"]
        for key, series in self.series.items():
            cumulative = 0
            buckets = []
            for name, count in zip(names, series):
                cumulative += count
                buckets.append((name, cumulative))
            family.add_metric(key, buckets, series[-2])
            if _WITH_CREATED:
                family.samples.append(
                    Sample(self.name + "_created", dict(zip(self.labels, key)), series[-1])
                )
        return family


class _Levels(Collector):
    """Queue and backend levels, read at scrape time."""

    def __init__(self, snapshot: Callable[[], dict[str, Any]]) -> None:
        self._snapshot = snapshot

    def collect(self) -> Iterator[GaugeMetricFamily]:
        snap = self._snapshot()
        depth = GaugeMetricFamily(f"{PREFIX}queue_depth", "Requests queued", labels=["tier"])
        tokens = GaugeMetricFamily(
            f"{PREFIX}queue_tokens", "Prompt + max tokens of the queued requests", labels=["tier"]
        )
        oldest = GaugeMetricFamily(
            f"{PREFIX}oldest_wait_seconds", "Wait of the oldest queued request", labels=["tier"]
        )
        for tier, t in snap.get("tiers", {}).items():
            depth.add_metric([tier], t["queued"])
            tokens.add_metric([tier], t["queued_tokens"])
            oldest.add_metric([tier], t["oldest_wait_s"])
        backend = snap.get("backend", {})
        inflight = GaugeMetricFamily(
            f"{PREFIX}backend_inflight", "Requests the backend is running"
        )
        inflight.add_metric([], snap.get("running", 0))
        capacity = GaugeMetricFamily(
            f"{PREFIX}backend_capacity", "Requests the backend could run at once (running + free slots)"
        )
        capacity.add_metric([], snap.get("running", 0) + backend.get("free_slots", 0))
        yield from (depth, tokens, oldest, inflight, capacity)


class _Events(Collector):
    """The event metrics, handed to prometheus_client when it collects."""

    def __init__(self, metrics: GatewayMetrics) -> None:
        self._metrics = metrics

    def collect(self) -> Iterator[Metric]:
        m = self._metrics
        for kept in m.families:
            yield kept.family()
        quota = GaugeMetricFamily(
            m.quota_remaining_name,
            "Tokens the tenant's tightest token limit still allows (as of its last request)",
            labels=["tenant"],
        )
        for tenant, remaining in m.quota_remaining.items():
            quota.add_metric([tenant], remaining)
        yield quota


class _FleetLevels(Collector):
    """The fleet's shared queue as last read (fleet mode), at scrape time.

    The families are declared on every gateway, so that one dashboard serves
    one node and a fleet; they carry samples only in fleet mode, and none
    while the shared queue cannot be read (a gauge that kept its last value
    would look healthy)."""

    def __init__(self, metrics: GatewayMetrics) -> None:
        self._metrics = metrics

    def collect(self) -> Iterator[GaugeMetricFamily]:
        levels = self._metrics.fleet_levels
        depth = GaugeMetricFamily(
            f"{PREFIX}fleet_queue_depth",
            "Requests queued in the fleet's shared queue (fleet mode), read when scraped",
            labels=["tier"],
        )
        running = GaugeMetricFamily(
            f"{PREFIX}fleet_running",
            "Fleet requests held by engine nodes (fleet mode), read when scraped",
        )
        if levels is not None:
            for tier, queued in levels["queued"].items():
                depth.add_metric([tier], queued)
            running.add_metric([], levels["running"])
        yield from (depth, running)


class GatewayMetrics:
    def __init__(
        self,
        policy: PolicyConfig,
        registry: CollectorRegistry | None = None,
        *,
        tenant_labels: bool = True,
    ) -> None:
        self.registry = registry if registry is not None else CollectorRegistry()
        self.tenant_labels = tenant_labels
        self._tiers = policy.tiers
        self.requests = _Counter(
            f"{PREFIX}requests", "Requests by tier and outcome", ("tier", "outcome")
        )
        self.queue_wait = _Histogram(
            f"{PREFIX}queue_wait_seconds", "Time queued before dispatch", ("tier",),
            LATENCY_BUCKETS,
        )  # fmt: skip
        self.ttft = _Histogram(
            f"{PREFIX}ttft_seconds", "Time to first token", ("tier",), LATENCY_BUCKETS
        )
        self.tpot = _Histogram(
            f"{PREFIX}tpot_seconds", "Time per output token after the first", ("tier",),
            TPOT_BUCKETS,
        )  # fmt: skip
        self.e2e = _Histogram(
            f"{PREFIX}e2e_seconds", "Arrival to last token", ("tier",), LATENCY_BUCKETS
        )
        self.slo_attained = _Counter(
            f"{PREFIX}slo_attained", "Completed within the tier's SLO", ("tier",)
        )
        self.slo_missed = _Counter(
            f"{PREFIX}slo_missed", "Completed outside the tier's SLO", ("tier",)
        )
        self.batch_size = _Histogram(
            f"{PREFIX}batch_size", "Requests released together by a batch window", (),
            BATCH_SIZE_BUCKETS,
        )  # fmt: skip
        self.batch_wait = _Histogram(
            f"{PREFIX}batch_wait_seconds", "How long a batch's oldest request waited", (),
            BATCH_WAIT_BUCKETS,
        )  # fmt: skip
        self.tokens = _Counter(
            f"{PREFIX}tokens", "Tokens served, by tenant and kind (prompt, completion)",
            ("tenant", "kind"),
        )  # fmt: skip
        self.families: tuple[_Counter | _Histogram, ...] = (
            self.requests, self.queue_wait, self.ttft, self.tpot, self.e2e,
            self.slo_attained, self.slo_missed, self.batch_size, self.batch_wait, self.tokens,
        )  # fmt: skip
        """In the order /metrics lists them."""
        self.quota_remaining_name = f"{PREFIX}quota_remaining_tokens"
        self.quota_remaining: dict[str, float] = {}
        """Tenant (or "all") -> tokens its tightest token limit still allows."""
        self.registry.register(_Events(self))
        self.fleet_levels: dict[str, Any] | None = None
        """The fleet's shared queue as last read (`queued` per tier, `running`),
        set before each scrape in fleet mode; None otherwise."""
        self.registry.register(_FleetLevels(self))
        self.recent_ttft: dict[str, collections.deque[float]] = collections.defaultdict(
            lambda: collections.deque(maxlen=RECENT)
        )
        self.batches_recent: collections.deque[int] = collections.deque(maxlen=RECENT)

    def set_tiers(self, policy: PolicyConfig) -> None:
        """The SLOs of a reloaded policy."""
        self._tiers = policy.tiers

    def watch(self, snapshot: Callable[[], dict[str, Any]]) -> None:
        """Read the queue and backend levels from `snapshot` at scrape time."""
        self.registry.register(_Levels(snapshot))

    def _tenant(self, tenant: str) -> str:
        return tenant if self.tenant_labels else "all"

    # -- events -------------------------------------------------------------------

    def refused(self, tier: str, outcome: Outcome) -> None:
        """A request that never entered a queue (unknown key, bad body, quota...)."""
        self.requests.inc((tier, outcome.value))

    def dispatched(self, req: Request, now: float) -> None:
        wait = now - req.arrival
        self.queue_wait.observe((req.tier,), wait if wait > 0.0 else 0.0)

    def released(self, batches: Iterable[tuple[str, int, float]]) -> None:
        for _tier, size, wait in batches:
            self.batch_size.observe((), size)
            self.batch_wait.observe((), wait if wait > 0.0 else 0.0)
            self.batches_recent.append(size)

    def first_token(self, req: Request, now: float) -> None:
        ttft = now - req.arrival
        if ttft < 0.0:
            ttft = 0.0
        self.ttft.observe((req.tier,), ttft)
        self.recent_ttft[req.tier].append(ttft)

    def finished(self, req: Request, charged: tuple[int, int] | None) -> None:
        """A request that was admitted has ended. `charged`: (prompt, completion)
        tokens it used, when it ran."""
        assert req.outcome is not None and req.finished_at is not None
        tier = (req.tier,)
        self.requests.inc((req.tier, req.outcome.value))
        if charged is not None:
            prompt, completion = charged
            tenant = self._tenant(req.tenant)
            self.tokens.inc((tenant, "prompt"), prompt)
            self.tokens.inc((tenant, "completion"), completion)
        if req.outcome is not Outcome.COMPLETED:
            return
        e2e = req.finished_at - req.arrival
        self.e2e.observe(tier, e2e)
        if req.first_token_at is not None and req.output_tokens > 1:
            self.tpot.observe(
                tier, (req.finished_at - req.first_token_at) / (req.output_tokens - 1)
            )
        cfg = self._tiers.get(req.tier)
        if cfg is None:
            return
        if cfg.ttft_slo_ms is not None:
            ttft = (req.first_token_at or req.finished_at) - req.arrival
            met = ttft * 1000 <= cfg.ttft_slo_ms
        elif cfg.e2e_slo_ms is not None:
            met = e2e * 1000 <= cfg.e2e_slo_ms
        else:
            return
        (self.slo_attained if met else self.slo_missed).inc(tier)

    def quota(self, tenant: str, remaining: int) -> None:
        self.quota_remaining[self._tenant(tenant)] = remaining


def _percentile(values: list[float], q: float) -> float | None:
    if not values:
        return None
    ordered = sorted(values)
    index = min(len(ordered) - 1, max(0, round(q / 100 * (len(ordered) - 1))))
    return ordered[index]


def stats_view(metrics: GatewayMetrics) -> dict[str, Any]:
    """What the dashboard draws, from the same counters /metrics exports:
    requests by tier and outcome, SLO attained and missed, recent first-token
    times, recent batch sizes."""
    requests: dict[str, dict[str, float]] = collections.defaultdict(dict)
    for (tier, outcome), total in metrics.requests.totals():
        requests[tier][outcome] = total
    slo: dict[str, dict[str, float]] = collections.defaultdict(dict)
    for key, counter in (("attained", metrics.slo_attained), ("missed", metrics.slo_missed)):
        for (tier,), total in counter.totals():
            slo[tier][key] = total
    ttft = {
        tier: {"p50_s": _percentile(list(v), 50), "p99_s": _percentile(list(v), 99), "n": len(v)}
        for tier, v in metrics.recent_ttft.items()
    }
    sizes = list(metrics.batches_recent)
    return {
        "requests": requests,
        "slo": slo,
        "ttft": ttft,
        "batches": {
            "recent": len(sizes),
            "mean_size": (sum(sizes) / len(sizes)) if sizes else None,
            "max_size": max(sizes) if sizes else None,
        },
    }
