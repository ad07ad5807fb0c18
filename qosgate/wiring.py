"""A qosgate process assembled from its policy.

The backend (the fleet's replica backend in fleet mode), the gateway with
its quota guard and metrics, a fleet's engine node, and the reload that
swaps a new policy in, are built here and only here: `qosgate serve`
(cli.py) and the HTTP server call these, and the HTTP layer only exposes
what they built. A fleet's engine node runs here too (`serve_engine`): it
serves no API, only its status.
"""

from __future__ import annotations

import asyncio
import hashlib
import logging
import os
import signal
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import TYPE_CHECKING, Any

from aiohttp import web

from qosgate.backends import build_backend
from qosgate.backends.base import Backend
from qosgate.config.models import PolicyConfig
from qosgate.config.secrets import SecretError
from qosgate.http.identity import KeyRing, KeyRingError
from qosgate.quotas import QuotaGuard
from qosgate.runtime.errors import PolicyRejected
from qosgate.runtime.gate import Gateway, PolicyReloadRefused

if TYPE_CHECKING:
    from qosgate.batch.runner import BatchService

log = logging.getLogger(__name__)


def with_fleet_role(policy: PolicyConfig, role: str | None, node_id: str | None) -> PolicyConfig:
    """The policy with its `fleet:` role and node id replaced (the command
    line's --role and --node-id). Raises ValueError naming what is wrong."""
    if role is None and node_id is None:
        return policy
    if policy.fleet is None:
        raise ValueError("--role and --node-id need a `fleet:` section in the policy")
    try:
        fleet = policy.fleet.model_validate({
            **policy.fleet.model_dump(),
            **({"role": role} if role else {}),
            **({"node_id": node_id} if node_id else {}),
        })  # fmt: skip
    except ValueError as exc:
        raise ValueError(f"--node-id: {exc}") from None
    return policy.model_copy(update={"fleet": fleet})


def gateway_backend(policy: PolicyConfig) -> Backend:
    """The backend a gateway (or a fleet's replica) serves through."""
    backend = build_backend(policy.backend)
    if policy.fleet is None:
        return backend
    from qosgate.fleet.gateway import FleetBackend

    # The configured backend is what the engine nodes run; here it names the
    # models, counts prompt tokens and says what a request may ask of it.
    replica = FleetBackend(
        policy, policy.fleet, models=backend.models,
        count_prompt_tokens=backend.count_prompt_tokens,
        support=backend.support,
        max_model_len=backend.max_model_len,
    )  # fmt: skip
    replica.model_roots = backend.model_roots
    return replica


def build_gateway(policy: PolicyConfig, *, quotas: QuotaGuard | None = None) -> Gateway:
    """The gateway a policy describes, not yet started: its backend, its
    quota guard (`quotas` replaces the one the policy would build: a
    benchmark's instrumented store) and its metrics."""
    return Gateway(policy, gateway_backend(policy), quotas=quotas)


def build_batches(gateway: Gateway, live: LivePolicy) -> BatchService | None:
    """The Batch API's service over the policy's `batch.data_dir` (None when
    it is unset), its metrics in the gateway's registry: jobs in SQLite
    there, or (`batch.store: redis`) in the fleet's Redis, driven under
    leases, with the files in `data_dir`."""
    policy = live.policy
    data_dir = policy.batch.data_dir
    if data_dir is None:
        return None
    from qosgate.batch.runner import BatchService

    if policy.batch_store() == "sqlite":
        from qosgate.batch.sqlite_store import SqliteBatchStore

        return BatchService(
            gateway, lambda: live.policy, SqliteBatchStore(data_dir),
            metrics=gateway.observer.metrics,
        )  # fmt: skip
    from qosgate.batch.redis_store import RedisBatchStore
    from qosgate.config.secrets import redis_password, redis_url
    from qosgate.fleet.gateway import default_node_id

    fleet = policy.fleet
    assert fleet is not None  # the policy's validation says so
    store = RedisBatchStore(
        redis_url(fleet.url, fleet.url_env), Path(data_dir) / "files",
        key_prefix=fleet.key_prefix, owner=fleet.node_id or default_node_id(),
        lease_s=policy.batch.lease_s, password=redis_password(fleet.password_env),
        timeout_s=fleet.timeout_ms / 1000.0,
    )  # fmt: skip
    return BatchService(
        gateway, lambda: live.policy, store, leases=store, metrics=gateway.observer.metrics
    )


class LivePolicy:
    """The policy a gateway serves and the API keys it grants, swapped
    together, and in the gateway at once, by `reload`."""

    def __init__(
        self,
        gateway: Gateway,
        policy: PolicyConfig | None = None,
        *,
        environ: Mapping[str, str] = os.environ,
        policy_path: str | None = None,
    ) -> None:
        self.gateway = gateway
        self.policy = policy if policy is not None else gateway.policy
        self.environ = environ
        """Where `env:` keys are read from (again on reload)."""
        self.policy_path = policy_path
        """The policy file, re-read on reload (None: reload is refused)."""
        self.keyring = KeyRing.from_policy(self.policy, environ)

    def reload(self) -> dict[str, Any]:
        """Re-read the policy file, validate it, and swap tiers, tenants, keys
        and quotas at once, or raise PolicyRejected with the reason (the file,
        line and field of each problem) and change nothing."""
        from qosgate.config.loader import ConfigError, load_policy

        if self.policy_path is None:
            raise PolicyRejected(
                "this gateway was not started from a policy file; nothing to reload"
            )
        try:
            policy = load_policy(self.policy_path)
            keyring = KeyRing.from_policy(policy, self.environ)
            self.gateway.reload(policy)
        except (ConfigError, KeyRingError, SecretError, PolicyReloadRefused) as exc:
            raise PolicyRejected(f"reload refused, the running policy stays: {exc}") from None
        # Nothing awaited since the gateway took it: no request sees half of each.
        self.policy = policy
        self.keyring = keyring
        log.warning("policy reloaded from %s", self.policy_path)
        return {
            "status": "reloaded",
            "path": self.policy_path,
            "tiers": sorted(policy.tiers),
            "tenants": len(policy.tenants),
        }

    def reload_or_log(self) -> None:
        """`reload` for a trigger that has no one to answer (SIGHUP, a changed
        file): a refusal is logged, and the running policy stays."""
        try:
            self.reload()
        except PolicyRejected as exc:
            log.error("%s", exc.message)

    async def watch(self, interval_s: float) -> None:
        """Reload each time the policy file's content changes, read every
        `interval_s` (runs until cancelled). The content, not the mtime: a
        ConfigMap update swaps a symlink to a new directory, and file times
        there say nothing about the order of versions."""
        assert self.policy_path is not None
        seen = _digest(self.policy_path)
        while True:
            await asyncio.sleep(interval_s)
            current = _digest(self.policy_path)
            # None: the file is gone for now (mid-swap, or being replaced).
            if current is not None and current != seen:
                seen = current
                self.reload_or_log()


def _digest(path: str) -> bytes | None:
    try:
        with open(path, "rb") as file:
            return hashlib.sha256(file.read()).digest()
    except OSError:
        return None


def bound_port(runner: web.AppRunner, port: int) -> int:
    """The port the site listens on (port 0 resolved)."""
    for address in runner.addresses:
        if isinstance(address, tuple) and len(address) >= 2:
            return address[1]
    return port


def on_signals(
    loop: asyncio.AbstractEventLoop, actions: Mapping[signal.Signals, Callable[[], None]]
) -> list[signal.Signals]:
    """Install what it can of `actions`; returns the signals to remove later."""
    handled = []
    for sig, action in actions.items():
        try:
            loop.add_signal_handler(sig, action)
            handled.append(sig)
        except (NotImplementedError, RuntimeError):
            # Not the main thread (tests) or no signals on this platform.
            pass
    return handled


async def serve_engine(
    policy: PolicyConfig,
    host: str,
    port: int,
    *,
    on_ready: Callable[[str], None] | None = None,
    stop: asyncio.Event,
) -> None:
    """An engine node of the fleet (`fleet.role: engine`): the backend, fed
    from the shared queue, and only /healthz, /readyz, /fleet and /metrics
    over HTTP (clients talk to the gateway replicas)."""
    from prometheus_client import CONTENT_TYPE_LATEST, generate_latest

    from qosgate.fleet.engine import EngineNode
    from qosgate.observability.metrics import EngineNodeMetrics

    assert policy.fleet is not None
    backend = build_backend(policy.backend)
    node = EngineNode(policy, policy.fleet, backend)
    metrics = EngineNodeMetrics(node.status, backend.engine_metrics)

    async def healthz(_: web.Request) -> web.Response:
        return web.json_response({"status": "ok"})

    async def readyz(_: web.Request) -> web.Response:
        ready = node.ready()
        return web.json_response(
            {"status": "ready" if ready else "not_ready"}, status=200 if ready else 503
        )

    async def status(_: web.Request) -> web.Response:
        return web.json_response(node.status())

    async def get_metrics(_: web.Request) -> web.Response:
        response = web.Response(body=generate_latest(metrics.registry))
        response.content_type = CONTENT_TYPE_LATEST.split(";")[0]
        return response

    app = web.Application()
    app.router.add_get("/healthz", healthz)
    app.router.add_get("/readyz", readyz)
    app.router.add_get("/fleet", status)
    app.router.add_get("/metrics", get_metrics)
    runner = web.AppRunner(app, access_log=None)
    loop = asyncio.get_running_loop()
    handled: list[signal.Signals] = []
    await node.start()
    try:
        await runner.setup()
        site = web.TCPSite(runner, host, port)
        await site.start()
        handled = on_signals(loop, {signal.SIGINT: stop.set, signal.SIGTERM: stop.set})
        url = f"http://{host}:{bound_port(runner, port)}"
        if on_ready is not None:
            on_ready(url)
        else:
            print(f"qosgate: engine node {node.node} pulling fleet work; status at {url}/fleet",
                  flush=True)
        await stop.wait()
    finally:
        for sig in handled:
            loop.remove_signal_handler(sig)
        await node.stop(policy.server.shutdown_grace_s)
        await runner.cleanup()
