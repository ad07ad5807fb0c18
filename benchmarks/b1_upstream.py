"""B1's upstream: a minimal OpenAI-compatible server with a fixed short answer.

    .venv/bin/python benchmarks/b1_upstream.py --delays 0,50 [--host 127.0.0.1]

Listens on one free port per delay (milliseconds waited before answering) and
prints `{"ports": {"0": PORT, "50": PORT}}` on one line once all listen. It
serves GET /v1/models and POST /v1/chat/completions and /v1/completions,
streaming (SSE, one event per token, usage when asked, [DONE]) or not, always
OUTPUT_TOKENS tokens. Its answers are prepared once so that it costs as
little CPU as possible: what B1 measures is what sits in front of it.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import signal
import sys

from aiohttp import web

MODEL = "b1-model"
OUTPUT_TOKENS = 8
PROMPT_TOKENS_GUESS = 36
_PIECES = [f"w{i} " for i in range(OUTPUT_TOKENS)]
_USAGE = {
    "prompt_tokens": PROMPT_TOKENS_GUESS,
    "completion_tokens": OUTPUT_TOKENS,
    "total_tokens": PROMPT_TOKENS_GUESS + OUTPUT_TOKENS,
}


def _event(payload: dict) -> bytes:
    return b"data: " + json.dumps(payload, separators=(",", ":")).encode() + b"\n\n"


def _stream_events(chat: bool) -> tuple[list[bytes], bytes, bytes]:
    """(token events + the finish event, the usage event, [DONE])."""
    kind = "chat.completion.chunk" if chat else "text_completion"
    base = {"id": "b1", "object": kind, "created": 0, "model": MODEL}
    events = []
    if chat:
        events.append(_event({**base, "choices": [
            {"index": 0, "delta": {"role": "assistant", "content": ""}, "finish_reason": None}]}))
    for piece in _PIECES:
        choice = ({"index": 0, "delta": {"content": piece}, "finish_reason": None} if chat
                  else {"index": 0, "text": piece, "finish_reason": None})
        events.append(_event({**base, "choices": [choice]}))
    final = ({"index": 0, "delta": {}, "finish_reason": "length"} if chat
             else {"index": 0, "text": "", "finish_reason": "length"})
    events.append(_event({**base, "choices": [final]}))
    usage = _event({**base, "choices": [], "usage": _USAGE})
    return events, usage, b"data: [DONE]\n\n"


def _full_body(chat: bool) -> bytes:
    text = "".join(_PIECES)
    if chat:
        choice = {"index": 0, "message": {"role": "assistant", "content": text},
                  "finish_reason": "length"}
        kind = "chat.completion"
    else:
        choice = {"index": 0, "text": text, "finish_reason": "length"}
        kind = "text_completion"
    return json.dumps({"id": "b1", "object": kind, "created": 0, "model": MODEL,
                       "choices": [choice], "usage": _USAGE}).encode()


_STREAM = {True: _stream_events(True), False: _stream_events(False)}
_BODY = {True: _full_body(True), False: _full_body(False)}
_MODELS = json.dumps({"object": "list", "data": [
    {"id": MODEL, "object": "model", "created": 0, "owned_by": "b1"}]}).encode()


def build_app(delay_s: float) -> web.Application:
    async def models(request: web.Request) -> web.Response:
        return web.Response(body=_MODELS, content_type="application/json")

    async def generate(request: web.Request) -> web.StreamResponse:
        chat = request.path.endswith("/chat/completions")
        body = await request.json()  # read and parse it, as any real server must
        if delay_s:
            await asyncio.sleep(delay_s)
        if not body.get("stream"):
            return web.Response(body=_BODY[chat], content_type="application/json")
        events, usage, done = _STREAM[chat]
        response = web.StreamResponse(headers={"Content-Type": "text/event-stream",
                                               "Cache-Control": "no-cache"})
        await response.prepare(request)
        for event in events:
            await response.write(event)
        options = body.get("stream_options")
        if isinstance(options, dict) and options.get("include_usage"):
            await response.write(usage)
        await response.write(done)
        await response.write_eof()
        return response

    async def traces(request: web.Request) -> web.Response:
        # An OTLP/HTTP collector that keeps nothing: where a traced gateway
        # under test (b1_ab.py --trace) exports its spans.
        await request.read()
        return web.Response(body=b"", content_type="application/x-protobuf")

    app = web.Application()
    app.router.add_post("/v1/traces", traces)
    app.router.add_get("/v1/models", models)
    app.router.add_post("/v1/chat/completions", generate)
    app.router.add_post("/v1/completions", generate)
    return app


async def main(delays_ms: list[float], host: str) -> None:
    runners = []
    ports: dict[str, int] = {}
    for delay in delays_ms:
        runner = web.AppRunner(build_app(delay / 1000.0), access_log=None)
        await runner.setup()
        await web.TCPSite(runner, host, 0).start()
        ports[f"{delay:g}"] = runner.addresses[0][1]
        runners.append(runner)
    print(json.dumps({"ports": ports}), flush=True)
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGINT, signal.SIGTERM):
        loop.add_signal_handler(sig, stop.set)
    await stop.wait()
    for runner in runners:
        await runner.cleanup()


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--delays", default="0,50", help="comma-separated delays in ms, one port each")
    parser.add_argument("--host", default="127.0.0.1")
    args = parser.parse_args()
    asyncio.run(main([float(d) for d in args.delays.split(",")], args.host))
    sys.exit(0)
