"""A fleet on loopback: a real redis-server, gateway replicas and engine nodes,
each a `qosgate serve` process of its own (so one can be killed with SIGKILL).

Used by tests/test_fleet_e2e.py and benchmarks/fleet.py. A process counts as
up when it prints its URL line, read from its stdout as it comes (no
sleeping); its stderr goes to a log file shown when something fails.
"""

from __future__ import annotations

import contextlib
import json
import os
import queue
import signal
import subprocess
import sys
import threading
import urllib.request
from collections.abc import AsyncIterator, Awaitable, Callable
from pathlib import Path
from typing import Any, Literal

import aiohttp
import redis.asyncio as aioredis
import yaml
from prometheus_client.parser import text_string_to_metric_families

from tests.redis_server import RedisServer

ROOT = Path(__file__).resolve().parent.parent
START_LIMIT_S = 30.0

KEYS = {
    "interactive": "fleet-interactive-key",
    "standard": "fleet-standard-key",
    "batch": "fleet-batch-key",
}


def policy(
    *,
    speed: float,
    seqs: int,
    redis_url: str | None,
    lease_s: float = 2.0,
    output_median: int | None = None,
    affinity: str = "session",
) -> dict[str, Any]:
    """The fleet benchmark's policy: three tiers as in B3/B8, one tenant per
    tier; with `redis_url` None, the single-node mode."""
    backend: dict[str, Any] = {"kind": "sim", "speed": speed, "max_num_seqs": seqs}
    if output_median is not None:
        backend["output_median_tokens"] = output_median
    doc: dict[str, Any] = {
        "version": 1,
        "server": {"port": 0, "admin_token_env": None, "auth_failures_per_minute": 0,
                   "shutdown_grace_s": 5},
        "backend": backend,
        "scheduler": {"policy": "qos", "aging": {"interval_ms": 2000, "max_boost": 2}},
        "tiers": {
            "interactive": {"priority": 0, "ttft_slo_ms": 500, "max_queue_wait_ms": 1000},
            "standard": {"priority": 1, "ttft_slo_ms": 2000, "max_queue_wait_ms": 3000},
            "batch": {"priority": 2, "e2e_slo_ms": 60000, "max_queue_wait_ms": 20000,
                      "on_timeout": "delay"},
        },
        "tenants": [
            {"id": f"fleet-{tier}", "tier": tier, "api_keys": [f"env:QG_FLEET_{tier.upper()}"]}
            for tier in KEYS
        ],
        "observability": {"log_requests": False},
    }  # fmt: skip
    if redis_url is not None:
        doc = with_fleet(doc, redis_url, lease_s=lease_s, affinity=affinity)
    return doc


def with_fleet(doc: dict[str, Any], redis_url: str, *, lease_s: float = 2.0,
               affinity: str = "session") -> dict[str, Any]:  # fmt: skip
    """`doc` as a fleet's policy: its queue on the Redis at `redis_url` (each
    process's --role says whether it is a gateway or an engine node)."""
    return {**doc, "fleet": {"role": "gateway", "url": redis_url, "lease_s": lease_s,
                             "key_prefix": "fleet-test:", "affinity": affinity}}  # fmt: skip


STANDARD = {"Authorization": f"Bearer {KEYS['standard']}"}
"""The headers of tenant fleet-standard's requests."""


def chat(max_tokens: int, stream: bool) -> dict[str, Any]:
    return {"model": "sim-llama3-8b", "messages": [{"role": "user", "content": "hello"}],
            "max_tokens": max_tokens, "stream": stream}  # fmt: skip


def cap_concurrency(doc: dict[str, Any], redis_url: str, *, slots: int, lease_s: float,
                    key_prefix: str) -> None:  # fmt: skip
    """Put `doc`'s quotas on the Redis at `redis_url`, with concurrency leases
    of `lease_s`, and let tenant fleet-standard run `slots` requests at once."""
    doc["quota_store"] = {"kind": "redis", "url": redis_url, "lease_s": lease_s,
                          "key_prefix": key_prefix}  # fmt: skip
    for tenant in doc["tenants"]:
        if tenant["id"] == "fleet-standard":
            tenant["quotas"] = {"max_concurrency": slots}


async def hold_streams(
    http: aiohttp.ClientSession, url: str, count: int, max_tokens: int
) -> list[aiohttp.ClientResponse]:
    """`count` streams of tenant fleet-standard on the gateway at `url`, each
    running: its headers come with its first chunk."""
    streams = []
    for _ in range(count):
        response = await http.post(url + "/chat/completions", json=chat(max_tokens, True),
                                   headers=STANDARD)  # fmt: skip
        assert response.status == 200, await response.text()
        streams.append(response)
    return streams


@contextlib.asynccontextmanager
async def slot_events(
    redis_url: str, event: Literal["expired", "zrem"]
) -> AsyncIterator[Callable[[], Awaitable[None]]]:
    """A wait for the next keyspace event `event` on tenant fleet-standard's
    concurrency key (its leases all live in that one key): the key running
    out (expired), or leases taken out of it (zrem: a settlement or a
    release). Subscribed before the block runs, so none is missed."""
    store = aioredis.Redis.from_url(redis_url)
    await store.config_set("notify-keyspace-events", {"expired": "Ex", "zrem": "Ez"}[event])
    events = store.pubsub()
    await events.subscribe(f"__keyevent@0__:{event}")

    async def next_event() -> None:
        async for message in events.listen():
            if message["type"] == "message" and message["data"].endswith(
                b"{fleet-standard}:conc"
            ):
                return

    try:
        yield next_event
    finally:
        await events.aclose()
        await store.aclose()


def bucket_quantile(cumulative: dict[float, float], q: float) -> float | None:
    """The q-quantile of a histogram given as upper bound -> cumulative count,
    interpolated linearly within its bucket (Prometheus' histogram_quantile);
    the highest finite bound if it falls in the +Inf bucket."""
    bounds = sorted(cumulative)
    total = cumulative[bounds[-1]] if bounds else 0.0
    if total <= 0:
        return None
    rank = q * total
    lower, below = 0.0, 0.0
    for bound in bounds:
        count = cumulative[bound]
        if count >= rank:
            if bound == float("inf"):
                return lower
            return lower + (bound - lower) * (rank - below) / max(count - below, 1e-12)
        lower, below = bound, count
    return lower


def metric_samples(urls: list[str], name: str) -> list[tuple[dict[str, str], float]]:
    """The samples of `name` (a sample name, such as a histogram's `_bucket`)
    on every gateway at `urls` (their API URLs), read with prometheus_client's
    own parser."""
    found = []
    for url in urls:
        with urllib.request.urlopen(url.removesuffix("/v1") + "/metrics", timeout=10) as response:
            text = response.read().decode()
        found += [
            (sample.labels, sample.value)
            for family in text_string_to_metric_families(text)
            for sample in family.samples
            if sample.name == name
        ]  # fmt: skip
    return found


def tier_quantiles(
    buckets: list[tuple[dict[str, str], float]],
) -> dict[str, dict[str, float | None]]:
    """Per tier, the count and the p50 / p99 of a histogram's `_bucket`
    samples, the buckets summed over the gateways (each observes only its own
    requests), read as Prometheus' histogram_quantile reads them."""
    by_tier: dict[str, dict[float, float]] = {}
    for labels, value in buckets:
        per_tier = by_tier.setdefault(labels["tier"], {})
        le = float(labels["le"])
        per_tier[le] = per_tier.get(le, 0.0) + value
    return {
        tier: {"count": cumulative[max(cumulative)],
               "p50_s": bucket_quantile(cumulative, 0.50),
               "p99_s": bucket_quantile(cumulative, 0.99)}
        for tier, cumulative in sorted(by_tier.items())
    }  # fmt: skip


def environ() -> dict[str, str]:
    env = dict(os.environ)
    env.update({f"QG_FLEET_{tier.upper()}": key for tier, key in KEYS.items()})
    env["PYTHONPATH"] = str(ROOT)
    return env


class Proc:
    """One `qosgate serve` process."""

    def __init__(self, config: Path, name: str, logs: Path, role: str | None) -> None:
        self.name = name
        self.log = logs / f"{name}.log"
        cmd = [sys.executable, "-m", "qosgate.cli", "serve", "--config", str(config)]
        if role is not None:
            cmd += ["--role", role, "--node-id", name]
        self._stderr = self.log.open("wb")
        self.proc = subprocess.Popen(
            cmd, cwd=ROOT, env=environ(), stdout=subprocess.PIPE, stderr=self._stderr
        )
        lines: queue.Queue[str] = queue.Queue()
        threading.Thread(target=self._pump, args=(lines,), daemon=True).start()
        try:
            line = lines.get(timeout=START_LIMIT_S)
        except queue.Empty:
            self.kill()
            raise RuntimeError(f"{name} did not start:\n{self.tail()}") from None
        if not line:
            raise RuntimeError(f"{name} exited at start:\n{self.tail()}")
        self.url = line.split(" at ", 1)[1].split()[0].removesuffix("/fleet").removesuffix(";")
        """The API URL (gateway, …/v1) or the status base URL (engine)."""

    def _pump(self, lines: queue.Queue[str]) -> None:
        assert self.proc.stdout is not None
        for raw in self.proc.stdout:
            lines.put(raw.decode(errors="replace").strip())
        lines.put("")

    def tail(self) -> str:
        return self.log.read_text(errors="replace")[-4000:]

    def get(self, path: str) -> Any:
        base = self.url.removesuffix("/v1")
        with urllib.request.urlopen(base + path, timeout=10) as response:
            return json.loads(response.read())

    def kill(self) -> None:
        """SIGKILL: no release, no goodbye, as a node lost to the OOM killer."""
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGKILL)
        self.proc.wait(timeout=30)

    def stop(self) -> int:
        if self.proc.poll() is None:
            self.proc.terminate()
        code = self.proc.wait(timeout=60)
        self._stderr.close()
        return code


class Fleet:
    """Redis, `gateways` replicas and `engines` nodes; or, with `single`, one
    `qosgate serve` with the simulated GPU in process (no Redis)."""

    def __init__(self, tmp: Path, *, gateways: int = 3, engines: int = 2, single: bool = False,
                 speed: float | None = None, seqs: int | None = None, lease_s: float = 2.0,
                 output_median: int | None = None, affinity: str = "session",
                 doc: dict[str, Any] | None = None) -> None:  # fmt: skip
        """`doc`: the policy every process serves (its fleet section added
        here); default: `policy` with `speed`, `seqs` and `output_median`."""
        self.redis: RedisServer | None = None
        self.gateways: list[Proc] = []
        self.engines: list[Proc] = []
        tmp.mkdir(parents=True, exist_ok=True)
        if doc is None:
            if speed is None or seqs is None:
                raise TypeError("Fleet needs a policy `doc`, or `speed` and `seqs` for the default")
            doc = policy(speed=speed, seqs=seqs, redis_url=None, output_median=output_median)
        try:
            if single:
                config = tmp / "single.yaml"
                config.write_text(yaml.safe_dump(doc))
                self.gateways.append(Proc(config, "single", tmp, None))
                return
            self.redis = RedisServer()
            self.redis.start()
            config = tmp / "fleet.yaml"
            config.write_text(yaml.safe_dump(
                with_fleet(doc, self.redis.url, lease_s=lease_s, affinity=affinity)))
            for index in range(engines):
                self.engines.append(Proc(config, f"engine-{index + 1}", tmp, "engine"))
            for index in range(gateways):
                self.gateways.append(Proc(config, f"gateway-{index + 1}", tmp, "gateway"))
        except BaseException:
            self.close()
            raise

    @property
    def urls(self) -> str:
        """The gateways' API URLs, as `qosgate bench` takes them."""
        return ",".join(g.url for g in self.gateways)

    def _samples(self, name: str) -> list[tuple[dict[str, str], float]]:
        return metric_samples([g.url for g in self.gateways], name)

    def outcomes(self) -> dict[str, int]:
        """Every gateway's `qosgate_requests_total`, summed by outcome."""
        counts: dict[str, int] = {}
        for labels, value in self._samples("qosgate_requests_total"):
            counts[labels["outcome"]] = counts.get(labels["outcome"], 0) + int(value)
        return counts

    def fleet_waits(self) -> dict[str, dict[str, float | None]]:
        """Per tier, the count and the p50 / p99 (seconds) of
        qosgate_fleet_queue_wait_seconds over the gateways (`tier_quantiles`)."""
        return tier_quantiles(self._samples("qosgate_fleet_queue_wait_seconds_bucket"))

    def total(self, name: str) -> float:
        """Sample `name` summed over every gateway and label set."""
        return sum(value for _, value in self._samples(name))

    def logs(self) -> str:
        return "\n".join(f"--- {p.name}\n{p.tail()}" for p in [*self.engines, *self.gateways])

    def close(self) -> dict[str, int]:
        codes = {}
        for proc in [*self.gateways, *self.engines]:
            codes[proc.name] = proc.stop()
        if self.redis is not None:
            self.redis.close()
        return codes
