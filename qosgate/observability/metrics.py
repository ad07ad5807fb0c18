"""Prometheus metrics, all named `qosgate_*` (the list is in the README, Operations).

`GatewayMetrics` owns its metrics in a registry it is given (a fresh one by
default), so two gateways in one process, or a test, never share counters.
Events are recorded where they happen (a request refused at the door, a
batch released, a first token, a request's end); what is a level rather than
an event (queue depth, oldest wait, backend in flight) is read from the
gateway when Prometheus scrapes, so the hot path pays nothing for it.

With `tenant_labels` off, the per-tenant series (`requests_total`,
`tokens_total`, `quota_remaining_tokens`) carry `tenant="all"`: a fleet with many thousand
tenants keeps a bounded number of series.

The per-request series (requests, the latency histograms, SLO attained and
missed, tokens) carry `model` too, as `model_label` bounds it: the client
writes the name, so only the names the backend serves become label values.
The levels (queue depth, oldest wait, backend in flight) do not: the queues
are per tier and hold every model's requests, and the backend is one.
"""

from __future__ import annotations

import collections
import importlib.metadata
import platform
from collections.abc import Callable, Collection, Iterable, Iterator
from typing import Any

from prometheus_client import (
    CollectorRegistry, Counter, Gauge, Histogram, Info, PlatformCollector, ProcessCollector,
)  # fmt: skip
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily
from prometheus_client.registry import Collector

from qosgate.config.models import PolicyConfig
from qosgate.core.request import Outcome, Request

from .stats import percentile

PREFIX = "qosgate_"

# Seconds; from a fast first token to a long batch job.
LATENCY_BUCKETS = (0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.0, 5.0, 10.0, 30.0, 60.0, 120.0, 300.0)
TPOT_BUCKETS = (0.005, 0.01, 0.02, 0.03, 0.05, 0.075, 0.1, 0.2, 0.5, 1.0)
BATCH_SIZE_BUCKETS = (1, 2, 4, 8, 16, 32, 64, 128, 256)
BATCH_WAIT_BUCKETS = (0.0, 0.001, 0.005, 0.01, 0.02, 0.05, 0.1, 0.2, 0.5, 1.0, 2.0)

RECENT = 512
"""First-token times kept per tier for /admin/stats percentiles."""

MODEL_NONE = "none"
"""`model` of a request refused before its body was read."""
MODEL_OTHER = "other"
"""`model` of a request for a name the backend does not list as served."""


class _Levels(Collector):
    """Queue and backend levels, read at scrape time."""

    def __init__(self, snapshot: Callable[[], dict[str, Any]]) -> None:
        self._snapshot = snapshot

    def collect(self) -> Iterator[GaugeMetricFamily]:
        snap = self._snapshot()
        tiers = snap.get("tiers", {}).items()
        for name, key, text in _TIER_LEVELS:
            family = GaugeMetricFamily(f"{PREFIX}{name}", text, labels=["tier"])
            for tier, levels in tiers:
                family.add_metric([tier], levels[key])
            yield family
        backend = snap.get("backend", {})
        running = snap.get("running", 0)
        quota_store = snap.get("quota_store", {})
        unlabelled = [
            (GaugeMetricFamily, "backend_inflight", "Requests the backend is running", running),
            (GaugeMetricFamily, "backend_capacity",
             "Requests the backend could run at once (running + free slots)",
             running + backend.get("free_slots", 0)),
            (CounterMetricFamily, "backend_restarts",
             "Engines the backend started again after one died or wedged",
             backend.get("restarts", 0)),
            *((CounterMetricFamily, name, text, quota_store.get(counter, 0))
              for name, counter, text in _QUOTA_STORE_COUNTERS),
        ]  # fmt: skip
        if "up" in quota_store:
            unlabelled += [
                (GaugeMetricFamily, "quota_store_up",
                 "1 while the quota store answers (as of its last call), else 0",
                 float(quota_store["up"])),
                (GaugeMetricFamily, "quota_store_failing_open",
                 "1 while the quota store is down and this gateway admits on its own "
                 "limiter (fail_open), else 0", float(quota_store["failing_open"])),
                (GaugeMetricFamily, "quota_store_last_error_timestamp_seconds",
                 "Unix time of the last failed call to the quota store (0: none yet)",
                 float(quota_store.get("last_error_unix") or 0)),
            ]  # fmt: skip
        for kind, name, text, value in unlabelled:
            family = kind(f"{PREFIX}{name}", text)
            family.add_metric([], value)
            yield family


_TIER_LEVELS = (
    ("queue_depth", "queued", "Requests queued"),
    ("queue_tokens", "queued_tokens", "Prompt + max tokens of the queued requests"),
    ("oldest_wait_seconds", "oldest_wait_s", "Wait of the oldest queued request"),
)


_QUOTA_STORE_COUNTERS = (
    ("quota_store_errors", "store_errors", "Calls to the quota store that failed"),
    ("quota_unshared_tokens", "unshared_tokens",
     "Tokens this gateway admitted on its own limiter while the shared quota store "
     "was unreachable (fail_open): each gateway counts them alone until they are "
     "carried into the store"),
    ("quota_carries", "carried",
     "Times this gateway carried a tenant's admissions into the quota store (after "
     "an outage, or a restart that lost its data)"),
    ("quota_leases_lost", "leases_lost",
     "Running requests whose concurrency lease ran out before it was renewed"),
)  # fmt: skip


class _Taken(Collector):
    """The families of another registry whose names start with `prefix`
    (an in-process engine's own metrics), as they stand when scraped."""

    def __init__(self, registry: Any, prefix: str) -> None:
        self._registry = registry
        self._prefix = prefix

    def collect(self) -> Iterator[Any]:
        for family in self._registry.collect():
            if family.name.startswith(self._prefix):
                yield family


def process_metrics(registry: CollectorRegistry) -> None:
    """The process's own (CPU, memory, open files; Python's version) and
    `qosgate_build_info` with qosgate's version, in `registry`."""
    ProcessCollector(registry=registry)
    PlatformCollector(registry=registry)
    try:
        version = importlib.metadata.version("qosgate")
    except importlib.metadata.PackageNotFoundError:
        version = "unknown"
    Info(f"{PREFIX}build", "The qosgate build", registry=registry).info(
        {"version": version, "python": platform.python_version()}
    )


class EngineNodeMetrics:
    """An engine node's /metrics (fleet mode): its runs and room as
    `status()` reports them when scraped, the process, and its engine's own."""

    def __init__(
        self, status: Callable[[], dict[str, Any]], engine: tuple[Any, str] | None
    ) -> None:
        self.registry = CollectorRegistry()
        process_metrics(self.registry)
        self.registry.register(_EngineNodeLevels(status))
        if engine is not None:
            self.registry.register(_Taken(*engine))


class _EngineNodeLevels(Collector):
    def __init__(self, status: Callable[[], dict[str, Any]]) -> None:
        self._status = status

    def collect(self) -> Iterator[Any]:
        status = self._status()
        node = [status["node"]]
        kinds: tuple[tuple[Any, str, str], ...] = (
            (GaugeMetricFamily, "running", "Fleet items this engine node is running"),
            (GaugeMetricFamily, "free_slots", "Sequences its backend could still take"),
            (GaugeMetricFamily, "drain_rate_tokens_per_s",
             "Tokens per second its backend was measured to finish"),
            (CounterMetricFamily, "completed", "Fleet items it ran to their end"),
            (CounterMetricFamily, "preempted",
             "Runs it gave back to the queue for more urgent work"),
            (CounterMetricFamily, "orphaned",
             "Runs it stopped because the replica that queued them was gone"),
        )  # fmt: skip
        for kind, key, text in kinds:
            family = kind(f"{PREFIX}engine_{key}", text, labels=["node"])
            family.add_metric(node, status[key])
            yield family
        affinity = CounterMetricFamily(
            f"{PREFIX}engine_claims", "Items it claimed, by affinity: home (its own session or "
            "tenant), away (another node's) or new", labels=["node", "affinity"],
        )  # fmt: skip
        for kind, count in status["affinity"].items():
            affinity.add_metric([*node, kind], count)
        yield affinity


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


class _BatchLevels(Collector):
    """Batch jobs by status and lines waiting per tenant, read at scrape time."""

    def __init__(
        self,
        levels: Callable[[], tuple[dict[str, int], dict[str, int]]],
        tenant: Callable[[str], str],
    ) -> None:
        self._levels = levels
        self._tenant = tenant

    def collect(self) -> Iterator[GaugeMetricFamily]:
        jobs, per_tenant = self._levels()
        queued: collections.Counter[str] = collections.Counter()
        for tenant, count in per_tenant.items():
            queued[self._tenant(tenant)] += count
        by_status = GaugeMetricFamily(
            f"{PREFIX}batch_jobs", "Batch jobs by status", labels=["status"]
        )
        for status, count in sorted(jobs.items()):
            by_status.add_metric([status], count)
        waiting = GaugeMetricFamily(
            f"{PREFIX}batch_lines_queued",
            "Lines of running batch jobs without a result yet", labels=["tenant"],
        )  # fmt: skip
        for tenant, count in sorted(queued.items()):
            waiting.add_metric([tenant], count)
        yield by_status
        yield waiting


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
        self._served: Callable[[], Collection[str]] = tuple
        r = self.registry

        def histogram(
            name: str, text: str, buckets: Any, labels: Any = ("tier", "model")
        ) -> Histogram:
            return Histogram(f"{PREFIX}{name}", text, labels, buckets=buckets, registry=r)

        self.requests = Counter(
            f"{PREFIX}requests",
            "Requests by tier, tenant (`all` with tenant labels off; `none` refused before "
            "it was known), outcome and model (`none` refused before it was read; `other` "
            "a name the backend does not serve)",
            ["tier", "tenant", "outcome", "model"], registry=r,
        )  # fmt: skip
        self.queue_wait = histogram(
            "queue_wait_seconds", "Time queued before dispatch", LATENCY_BUCKETS
        )
        self.fleet_queue_wait = histogram(
            "fleet_queue_wait_seconds",
            "Fleet mode: time a replica's request waited in the shared queue before "
            "an engine node started it",
            LATENCY_BUCKETS,
        )
        self.ttft = histogram("ttft_seconds", "Time to first token", LATENCY_BUCKETS)
        self.tpot = histogram("tpot_seconds", "Time per output token after the first", TPOT_BUCKETS)
        self.e2e = histogram("e2e_seconds", "Arrival to last token", LATENCY_BUCKETS)
        self.slo_attained = Counter(
            f"{PREFIX}slo_attained", "Completed within the tier's SLO", ["tier", "model"],
            registry=r,
        )  # fmt: skip
        self.slo_missed = Counter(
            f"{PREFIX}slo_missed", "Completed outside the tier's SLO", ["tier", "model"],
            registry=r,
        )  # fmt: skip
        self.batch_size = histogram(
            "batch_size", "Requests released together by a batch window", BATCH_SIZE_BUCKETS, ()
        )
        self.batch_wait = histogram(
            "batch_wait_seconds", "How long a batch's oldest request waited", BATCH_WAIT_BUCKETS, ()
        )
        self.tokens = Counter(
            f"{PREFIX}tokens", "Tokens served, by tenant, kind (prompt, completion) and model",
            ["tenant", "kind", "model"], registry=r,
        )  # fmt: skip
        self.quota_remaining = Gauge(
            f"{PREFIX}quota_remaining_tokens",
            "Tokens the tenant's tightest token limit still allows (as of its last request)",
            ["tenant"], registry=r,
        )  # fmt: skip
        self.trace_dropped = Counter(
            f"{PREFIX}trace_dropped_lines",
            "Request trace lines lost (the file could not be written, or the buffer was full)",
            registry=r,
        )
        self.recent_ttft: dict[str, collections.deque[float]] = collections.defaultdict(
            lambda: collections.deque(maxlen=RECENT)
        )
        # Labelled children, looked up once: `labels()` costs more than the
        # increment it leads to, and a request touches a dozen series.
        self._children: dict[tuple[Any, ...], Any] = {}
        self.batches_recent: collections.deque[int] = collections.deque(maxlen=RECENT)
        self.fleet_levels: dict[str, Any] | None = None
        """The fleet's shared queue as last read (`queued` per tier, `running`),
        set before each scrape in fleet mode; None otherwise."""
        self.registry.register(_FleetLevels(self))
        process_metrics(self.registry)

    def set_tiers(self, policy: PolicyConfig) -> None:
        """The SLOs of a reloaded policy."""
        self._tiers = policy.tiers

    def watch_batches(
        self, levels: Callable[[], tuple[dict[str, int], dict[str, int]]]
    ) -> None:
        """Count batch lines as they are recorded, and read the jobs by
        status and the lines queued per tenant (`levels`) at scrape time."""
        self.batch_lines = Counter(
            f"{PREFIX}batch_lines", "Batch lines recorded, by tenant and result",
            ["tenant", "result"], registry=self.registry,
        )  # fmt: skip
        self.registry.register(_BatchLevels(levels, self._tenant))

    def batch_line(self, tenant: str, ok: bool) -> None:
        self._child(self.batch_lines, self._tenant(tenant), "completed" if ok else "failed").inc()

    def watch_models(self, served: Callable[[], Collection[str]]) -> None:
        """Read the names the backend serves from `served` (a backend may
        learn them after it starts): the values `model_label` lets through."""
        self._served = served

    def model_label(self, name: object) -> str:
        """The `model` label of a request for `name`, the model its client
        wrote (None: not read yet). Only a name the backend serves is its own
        label; any other is `other`, so that no client can add series by
        making names up (a backend that lists no names labels all `other`)."""
        if name is None:
            return MODEL_NONE
        return name if isinstance(name, str) and name in self._served() else MODEL_OTHER

    def watch(self, snapshot: Callable[[], dict[str, Any]]) -> None:
        """Read the queue and backend levels from `snapshot` at scrape time."""
        self.registry.register(_Levels(snapshot))

    def include(self, engine: tuple[Any, str]) -> None:
        """Serve an in-process engine's own metrics too (`Backend.engine_metrics`)."""
        self.registry.register(_Taken(*engine))

    def _tenant(self, tenant: str) -> str:
        return tenant if self.tenant_labels else "all"

    def _child(self, metric: Any, *labels: str) -> Any:
        key = (id(metric), *labels)
        child = self._children.get(key)
        if child is None:
            child = self._children[key] = metric.labels(*labels)
        return child

    # -- events -------------------------------------------------------------------

    # `model`, where a method takes it, is the name the request's client wrote
    # (None: not read yet); `model_label` makes it a label.

    def refused(
        self, tier: str, outcome: Outcome, tenant: str = "none", model: object = None
    ) -> None:
        """A request that never entered a queue (unknown key, bad body, quota...)."""
        labels = (tier, self._tenant(tenant), outcome.value, self.model_label(model))
        self._child(self.requests, *labels).inc()

    def dispatched(self, req: Request, now: float, model: object) -> None:
        self._child(self.queue_wait, req.tier, self.model_label(model)).observe(
            max(0.0, now - req.arrival)
        )

    def fleet_started(self, tier: str, model: object, waited_s: float) -> None:
        """An engine node started a request this replica queued in the fleet."""
        self._child(self.fleet_queue_wait, tier, self.model_label(model)).observe(
            max(0.0, waited_s)
        )

    def released(self, batches: Iterable[tuple[str, int, float]]) -> None:
        for _tier, size, wait in batches:
            self.batch_size.observe(size)
            self.batch_wait.observe(max(0.0, wait))
            self.batches_recent.append(size)

    def first_token(self, req: Request, now: float, model: object) -> None:
        ttft = max(0.0, now - req.arrival)
        self._child(self.ttft, req.tier, self.model_label(model)).observe(ttft)
        self.recent_ttft[req.tier].append(ttft)

    def finished(self, req: Request, charged: tuple[int, int] | None, model: object) -> None:
        """A request that was admitted has ended. `charged`: (prompt, completion)
        tokens it used, when it ran."""
        assert req.outcome is not None and req.finished_at is not None
        tier = req.tier
        tenant = self._tenant(req.tenant)
        label = self.model_label(model)
        self._child(self.requests, tier, tenant, req.outcome.value, label).inc()
        if charged is not None:
            prompt, completion = charged
            self._child(self.tokens, tenant, "prompt", label).inc(prompt)
            self._child(self.tokens, tenant, "completion", label).inc(completion)
        if req.outcome is not Outcome.COMPLETED:
            return
        e2e = req.finished_at - req.arrival
        self._child(self.e2e, tier, label).observe(e2e)
        if req.first_token_at is not None and req.output_tokens > 1:
            self._child(self.tpot, tier, label).observe(
                (req.finished_at - req.first_token_at) / (req.output_tokens - 1)
            )
        cfg = self._tiers.get(tier)
        if cfg is None:
            return
        met = req.met_objective(*cfg.objectives_s)
        if met is None:
            return
        self._child(self.slo_attained if met else self.slo_missed, tier, label).inc()

    def quota(self, tenant: str, remaining: int) -> None:
        self._child(self.quota_remaining, self._tenant(tenant)).set(remaining)


def stats_view(metrics: GatewayMetrics) -> dict[str, Any]:
    """What the dashboard draws, from the same counters /metrics exports:
    requests by tier and outcome, SLO attained and missed, recent first-token
    times, recent batch sizes."""
    requests: dict[str, collections.Counter[str]] = collections.defaultdict(collections.Counter)
    for sample in metrics.requests.collect()[0].samples:
        if sample.name.endswith("_total"):
            requests[sample.labels["tier"]][sample.labels["outcome"]] += sample.value
    slo: dict[str, collections.Counter[str]] = collections.defaultdict(collections.Counter)
    for key, counter in (("attained", metrics.slo_attained), ("missed", metrics.slo_missed)):
        for sample in counter.collect()[0].samples:
            if sample.name.endswith("_total"):
                slo[sample.labels["tier"]][key] += sample.value
    ttft = {
        tier: {"p50_s": percentile(v, 50), "p99_s": percentile(v, 99), "n": len(v)}
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
