"""`qosgate serve`: the backend, the gateway and the HTTP app in one process."""

from __future__ import annotations

import asyncio
import logging
import os
import signal
from collections.abc import Callable, Mapping

from aiohttp import web

from qosgate.backends.base import BackendError
from qosgate.config.models import PolicyConfig
from qosgate.quotas import QuotaGuard
from qosgate.runtime.errors import GatewayError

from .app import build_app, reload_policy

log = logging.getLogger(__name__)

SHUTDOWN_GRACE_S = 10.0
"""How long in-flight requests may run on after a stop signal before they are
cancelled (each still ends with an outcome: cancelled)."""


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
) -> None:
    """Serve until SIGINT/SIGTERM (or `stop` is set). `on_ready` gets the API
    URL once the socket listens (port 0 resolved), and replaces the default
    one-line announcement. `quotas` replaces the guard the policy would build
    (a benchmark's instrumented store)."""
    from qosgate.backends import build_backend
    from qosgate.runtime.gate import Gateway

    host = host if host is not None else policy.server.host
    port = port if port is not None else policy.server.port
    stop = stop if stop is not None else asyncio.Event()

    backend = build_backend(policy.backend)
    gateway = Gateway(policy, backend, quotas=quotas)
    await gateway.start()
    # A backend that loads in the background (the vLLM engine) and fails to
    # start stops the server: an unready gateway that can never become ready
    # would only turn every request into a 503.
    failed: list[BaseException] = []
    wait_ready = getattr(backend, "wait_ready", None)
    watcher: asyncio.Task[None] | None = None
    if wait_ready is not None:

        async def watch() -> None:
            try:
                await wait_ready()
            except Exception as exc:  # noqa: BLE001 - reported by the caller
                failed.append(exc)
                stop.set()

        watcher = asyncio.get_running_loop().create_task(watch())
    runner: web.AppRunner | None = None
    loop = asyncio.get_running_loop()
    handled: list[signal.Signals] = []
    try:
        app = build_app(gateway, policy, environ=environ, policy_path=policy_path)
        # Without handler cancellation aiohttp lets a handler run on after its
        # client disconnects, so a queued request would keep its place.
        runner = web.AppRunner(
            app, handler_cancellation=True, shutdown_timeout=SHUTDOWN_GRACE_S, access_log=None
        )
        await runner.setup()
        site = web.TCPSite(runner, host, port)
        await site.start()
        bound_port = port
        for address in runner.addresses:
            if isinstance(address, tuple) and len(address) >= 2:
                bound_port = address[1]
                break
        url = api_url(host, bound_port)
        def reload_on_signal() -> None:
            try:
                reload_policy(app)
            except GatewayError as exc:
                log.error("%s", exc.message)

        for sig, action in (
            (signal.SIGINT, stop.set),
            (signal.SIGTERM, stop.set),
            (signal.SIGHUP, reload_on_signal),
        ):
            try:
                loop.add_signal_handler(sig, action)
                handled.append(sig)
            except (NotImplementedError, RuntimeError):
                # Not the main thread (tests) or no signals on this platform.
                pass
        if on_ready is not None:
            on_ready(url)
        else:
            print(f"qosgate: serving the OpenAI API at {url}", flush=True)
        await stop.wait()
    finally:
        for sig in handled:
            loop.remove_signal_handler(sig)
        # Stop listening and let in-flight requests finish (up to the grace),
        # then end whatever the gateway still holds.
        if watcher is not None:
            watcher.cancel()
        if runner is not None:
            await runner.cleanup()
        await gateway.close()
    if failed:
        error = failed[0]
        raise error if isinstance(error, BackendError) else BackendError(str(error))
