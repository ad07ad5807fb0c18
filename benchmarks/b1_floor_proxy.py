"""B1's floor: a bare proxy doing qosgate's network work and nothing else.

    .venv/bin/python benchmarks/b1_floor_proxy.py http://127.0.0.1:UPSTREAM_PORT/v1 [--port 0]

This is deliberately NOT qosgate. It has no identity, validation, admission,
queue, scheduling, quotas or metering: it is the least a Python proxy built
on the same stack (uvloop, aiohttp, orjson, one keep-alive ClientSession with
an unlimited TCPConnector) must do to stand where qosgate stands. B1
(benchmarks/b1_overhead.py) measures it beside qosgate, so its figures split
qosgate's added latency and CPU into the part the Python HTTP stack costs on
this machine (this proxy) and the part that is qosgate's own logic (qosgate
over this proxy).

It serves POST /v1/chat/completions and /v1/completions, and asks the upstream
as qosgate's openai backend does. A streaming client request is streamed from
the upstream (`stream_options.include_usage: true`) and its SSE bytes are
relayed as they arrive. Any other request is asked for whole, and the
upstream's JSON answer is relayed as it is.

Prints `b1-floor: proxying at http://HOST:PORT/v1` (the form qosgate uses) as
its first stdout line once it listens; SIGTERM or SIGINT stops it.
"""

from __future__ import annotations

import argparse
import asyncio
import signal
import sys

import orjson
from aiohttp import ClientSession, ClientTimeout, TCPConnector, web

_SSE_HEADERS = {"Content-Type": "text/event-stream", "Cache-Control": "no-cache"}


def _error(status: int, message: str) -> web.Response:
    body = {"error": {"message": message, "type": "floor_proxy_error"}}
    return web.Response(status=status, body=orjson.dumps(body), content_type="application/json")


def build_app(upstream: str) -> web.Application:
    upstream = upstream.rstrip("/")
    session_key = web.AppKey("session", ClientSession)

    async def start_session(app: web.Application) -> None:
        app[session_key] = ClientSession(connector=TCPConnector(limit=0),
                                         timeout=ClientTimeout(total=60))

    async def close_session(app: web.Application) -> None:
        await app[session_key].close()

    async def proxy(request: web.Request) -> web.StreamResponse:
        chat = request.path.endswith("/chat/completions")
        try:
            body = orjson.loads(await request.read())
        except orjson.JSONDecodeError:
            return _error(400, "body is not JSON")
        if not isinstance(body, dict):
            return _error(400, "body is not a JSON object")
        streaming = body.get("stream") is True
        if streaming:
            options = body.get("stream_options")
            body["stream_options"] = {**(options if isinstance(options, dict) else {}),
                                      "include_usage": True}
        else:
            body["stream"] = False
            body.pop("stream_options", None)
        url = upstream + ("/chat/completions" if chat else "/completions")
        async with request.app[session_key].post(
            url, data=orjson.dumps(body),
            headers={"Content-Type": "application/json", "Accept": "text/event-stream"},
        ) as upstream_response:
            if upstream_response.status != 200:
                return web.Response(status=upstream_response.status,
                                    body=await upstream_response.read(),
                                    content_type="application/json")
            if not streaming:
                return web.Response(body=await upstream_response.read(),
                                    content_type="application/json")
            response = web.StreamResponse(headers=_SSE_HEADERS)
            await response.prepare(request)
            async for block in upstream_response.content.iter_any():
                await response.write(block)
            await response.write_eof()
            return response

    app = web.Application(client_max_size=8 * 1024 * 1024)
    app.on_startup.append(start_session)
    app.on_cleanup.append(close_session)
    app.router.add_post("/v1/chat/completions", proxy)
    app.router.add_post("/v1/completions", proxy)
    return app


async def main(upstream: str, host: str, port: int) -> None:
    # handler_cancellation as qosgate serves: a client that leaves ends its call.
    runner = web.AppRunner(build_app(upstream), handler_cancellation=True, access_log=None)
    await runner.setup()
    await web.TCPSite(runner, host, port).start()
    bound = runner.addresses[0][1]
    shown = f"[{host}]" if ":" in host else host
    print(f"b1-floor: proxying at http://{shown}:{bound}/v1", flush=True)
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGINT, signal.SIGTERM):
        loop.add_signal_handler(sig, stop.set)
    await stop.wait()
    await runner.cleanup()


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("upstream", help="the upstream's OpenAI API base URL (http://HOST:PORT/v1)")
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--port", type=int, default=0, help="port to listen on (0: a free one)")
    args = parser.parse_args()
    try:
        import uvloop
    except ImportError:  # pragma: no cover - qosgate's environment has it
        asyncio.run(main(args.upstream, args.host, args.port))
    else:
        uvloop.run(main(args.upstream, args.host, args.port))
    sys.exit(0)
