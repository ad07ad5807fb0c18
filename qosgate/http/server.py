"""`qosgate serve`: the gateway (built by qosgate/wiring.py) behind the HTTP app, in one process."""

from __future__ import annotations

import asyncio
import gc
import logging
import os
import signal
from collections.abc import Callable, Mapping

from aiohttp import web

from qosgate.backends.base import BackendError
from qosgate.batch.runner import BatchService
from qosgate.config.models import PolicyConfig
from qosgate.quotas import QuotaGuard
from qosgate.runtime.gate import Gateway
from qosgate.wiring import LivePolicy, bound_port, build_gateway, on_signals, serve_engine

from .app import build_app
from .state import STATE
from .protocol import HEAD_LIMITS, GatewayRunner

log = logging.getLogger(__name__)

_LINGER_S = 1.0
_FLUSH_S = 5.0
"""After the grace, how long handlers get to write the error that ends their
stream before their connections are closed under them."""


def api_url(host: str, port: int) -> str:
    if ":" in host:  # IPv6 literal
        host = f"[{host}]"
    return f"http://{host}:{port}/v1"


async def serve(
    policy: PolicyConfig,
    host: str | None = None,
    port: int | None = None,
    *,
    environ: Mapping[str, str] = os.environ,
    on_ready: Callable[[str], None] | None = None,
    stop: asyncio.Event | None = None,
    quotas: QuotaGuard | None = None,
    policy_path: str | None = None,
    gateway: Gateway | None = None,
    freeze_startup: bool = False,
) -> None:
    """Serve until SIGINT/SIGTERM (or `stop` is set). `on_ready` gets the API
    URL once the socket listens (port 0 resolved), and replaces the default
    one-line announcement. `quotas` replaces the guard the policy would build
    (a benchmark's instrumented store); `gateway`, not yet started, the one
    the policy would build (a test's, over a scripted backend).
    `freeze_startup` (the process is this server's alone, as under `qosgate
    serve`): what exists once the socket listens is kept out of the garbage
    collector's passes."""

    host = host if host is not None else policy.server.host
    port = port if port is not None else policy.server.port
    stop = stop if stop is not None else asyncio.Event()

    if policy.fleet is not None and policy.fleet.role == "engine":
        await serve_engine(policy, host, port, on_ready=on_ready, stop=stop)
        return
    if gateway is None:
        gateway = build_gateway(policy, quotas=quotas)
    backend = gateway.backend
    await gateway.start()
    # A backend that loads in the background (the vLLM engine) and fails to
    # start stops the server: an unready gateway that can never become ready
    # would only turn every request into a 503.
    failed: list[BaseException] = []

    async def watch() -> None:
        try:
            await backend.wait_ready()
        except Exception as exc:  # noqa: BLE001 - reported by the caller
            failed.append(exc)
            stop.set()

    watcher = asyncio.get_running_loop().create_task(watch())
    runner: web.AppRunner | None = None
    batches: BatchService | None = None
    loop = asyncio.get_running_loop()
    handled: list[signal.Signals] = []
    policy_watch: asyncio.Task[None] | None = None
    try:
        live = LivePolicy(gateway, policy, environ=environ, policy_path=policy_path)
        app = build_app(gateway, live=live)
        batches = app[STATE].batches
        # Without handler cancellation aiohttp lets a handler run on after its
        # client disconnects, so a queued request would keep its place.
        # Its connections answer requests aiohttp cannot parse (oversized or
        # malformed heads, broken body framing) in OpenAI's error shape.
        runner = GatewayRunner(
            app,
            handler_cancellation=True,
            shutdown_timeout=_FLUSH_S,
            access_log=None,
            # From the connection's start as well as between requests, so it
            # also bounds a client that trickles its headers (slowloris).
            keepalive_timeout=policy.server.idle_timeout_s,
            # After an answer given before the body was read (413, 408), how
            # long the rest may still come in: bounded, so a client trickling
            # a body cannot hold the connection after its 408.
            lingering_time=_LINGER_S,
            **HEAD_LIMITS,
        )
        await runner.setup()
        site = web.TCPSite(runner, host, port)
        await site.start()
        url = api_url(host, bound_port(runner, port))
        if freeze_startup:
            _freeze_startup_objects()
        handled = on_signals(loop, {
            signal.SIGINT: stop.set, signal.SIGTERM: stop.set, signal.SIGHUP: live.reload_or_log,
        })  # fmt: skip
        if policy.server.policy_watch_s is not None and policy_path is not None:
            policy_watch = loop.create_task(live.watch(policy.server.policy_watch_s))
        if on_ready is not None:
            on_ready(url)
        else:
            print(f"qosgate: serving the OpenAI API at {url}", flush=True)
        await stop.wait()
    finally:
        for sig in handled:
            loop.remove_signal_handler(sig)
        watcher.cancel()
        if policy_watch is not None:
            policy_watch.cancel()
        await _stop(runner, gateway, policy.server.shutdown_grace_s, batches)
    if failed:
        error = failed[0]
        raise error if isinstance(error, BackendError) else BackendError(str(error))


def _freeze_startup_objects() -> None:
    # The modules, the policy, the app and the backend live as long as the
    # process, yet every full collection would walk all of them (some 60,000
    # objects, about 30 ms, every few thousand streamed requests: B1 measured
    # collections at 18 µs a request, 10 once frozen). Frozen, the collector
    # walks only what requests made. Collected first, so no garbage is frozen.
    gc.collect()
    gc.freeze()


async def _stop(
    runner: web.AppRunner | None,
    gateway: Gateway,
    grace_s: float,
    batches: BatchService | None = None,
) -> None:
    """The graceful stop: nothing taken is dropped without an answer.

    Stop listening (a load balancer's next connection goes elsewhere), answer
    what is queued with 503 and Retry-After, let running requests finish for
    up to `grace_s`, then end the rest (their streams get an error event) and
    close the connections.
    """
    if runner is not None:
        for site in list(runner.sites):
            await site.stop()
    snapshot = gateway.snapshot()
    queued = snapshot["queued"]
    log.info(
        "stopping: %d queued requests answered 503, %d running get up to %gs",
        queued,
        snapshot["running"],
        grace_s,
    )
    if batches is not None:
        # No batch line is sent from here; those running may finish within
        # the grace, the rest run again after a restart.
        batches.stop_feeding()
    left = await gateway.drain(grace_s)
    if left:
        log.warning("%d requests still running after the %gs grace are ended", left, grace_s)
    if batches is not None:
        await batches.stop()
    await gateway.close()
    if runner is not None:
        await runner.cleanup()
