"""A request's output as server-sent events, paced by its reader: a client
that stalls or reads below its tier's delivery floor is cut, so it cannot
hold a backend slot.
"""

from __future__ import annotations

import asyncio
import fcntl
import logging
import socket
import struct
import sys
import traceback
from typing import Any

import orjson
from aiohttp import web

from qosgate.backends.base import Chunk
from qosgate.runtime.errors import GatewayError
from qosgate.runtime.gate import RequestStream

from .errors import INTERNAL_ERROR, error_payload
from .render import (
    DONE_EVENT, Call, Tally, chunk_event, sse_event, text_event_parts, usage_body, usage_event,
)
from .state import REQUEST_ID, REQUEST_ID_HEADER, AppState, echoed_request_id

log = logging.getLogger("qosgate.http")


async def stream_response(
    request: web.Request, stream: RequestStream, call: Call, state: AppState, pace: Pace
) -> web.StreamResponse:
    chunks = stream.__aiter__()
    try:
        # Wait for the first chunk before sending headers: an error while the
        # request is queued (expired, backend down) can still be a proper status.
        first: Chunk | None = await anext(chunks, None)
    except BaseException:
        await stream.aclose()
        raise

    response = web.StreamResponse(
        headers={
            "Content-Type": "text/event-stream",
            "Cache-Control": "no-cache",
            # Proxies such as nginx would otherwise buffer the stream.
            "X-Accel-Buffering": "no",
            REQUEST_ID_HEADER: echoed_request_id(request),
        }
    )
    tally = Tally()
    head, tail = text_event_parts(call)
    stall_s = state.policy.server.client_stall_timeout_s
    # Events are held until the stream may have to wait for its next chunk, then
    # go out in one write (one system call) rather than one each: an upstream's
    # events mostly arrive several to a read.
    pending: list[bytes] = []
    if call.endpoint == "chat":
        pending.append(chunk_event(call, "", None, role=True))
    last: Chunk | None = None  # a finishing chunk with fields beyond text
    try:
        await response.prepare(request)
        chunk = first
        while chunk is not None:
            tally.add(chunk)
            if chunk.raw:
                # Fields beyond text (tool calls, logprobs) need the whole
                # event rendered. A finishing chunk's fields and text go out
                # in the finish event, as an upstream sends them.
                if chunk.finish_reason is None:
                    pending.append(chunk_event(call, chunk.text or None, None, raw=chunk.raw))
                else:
                    last = chunk
            elif chunk.text:
                pending.append(head + orjson.dumps(chunk.text) + tail)
            # After the finishing chunk the stream ends without a wait, and
            # its events go out with the last ones.
            if pending and chunk.finish_reason is None and not stream.ready():
                data = b"".join(pending)
                pending.clear()
                await _write(request, response, data, stall_s, pace=pace)
            chunk = await anext(chunks, None)
        usage = usage_body(call, tally.tokens, tally.usage)
        finish = tally.finish_reason or "stop"
        last_text = (last.text or None) if last is not None else None
        last_raw = last.raw if last is not None else None
        if call.include_usage:
            # OpenAI's shape when asked: the usage alone in a last, choice-less chunk.
            pending.append(chunk_event(call, last_text, finish, raw=last_raw))
            pending.append(usage_event(call, usage))
        else:
            # Usage goes in the final chunk even when not asked for (so every
            # stream can be metered by its reader); clients ignore a field
            # they do not expect.
            pending.append(chunk_event(call, last_text, finish, usage=usage, raw=last_raw))
        pending.append(DONE_EVENT)
        data = b"".join(pending)
        pending.clear()
        await _write(request, response, data, stall_s, last=True, pace=pace)
    except _ClientStalled:
        # Cancelled, not failed: the client is as good as gone, and what ran
        # for it is charged; its backend slot goes to the queue.
        await stream.aclose()
        _drop_stalled(request, stall_s)
    except _ClientTooSlow as slow:
        # As a stall (cancelled, charged what ran, the slot to the queue), but
        # the client still reads: the reason goes as the stream's last event,
        # behind what the buffers hold, and the connection closes after it.
        await stream.aclose()
        log.warning(
            "request %s: the client took %.0f B in %gs of waiting on it (floor %g B/s); ended",
            request[REQUEST_ID], slow.taken, slow.waited_s, pace.floor,
        )  # fmt: skip
        response.force_close()
        message = (
            f"The client read the stream slower than {pace.floor:g} bytes a second "
            f"(tier delivery floor) for {slow.waited_s:g}s; the stream was ended."
        )
        payload = error_payload(message, "server_error", "client_too_slow", None)
        await _send_error_event(request, response, payload, pending, stall_s)
    except ConnectionError:
        # The client went away mid-stream (aiohttp's write errors are
        # ConnectionResetError): end the request as cancelled.
        await stream.aclose()
    except GatewayError as exc:
        await stream.aclose()
        # Headers are gone; the status can only travel inside the stream.
        await _send_error_event(request, response, exc.body(), pending, stall_s)
    except asyncio.CancelledError:
        await stream.aclose()
        raise
    except Exception as exc:  # noqa: BLE001 - the stream must still end with an error event
        await stream.aclose()
        log.error(
            "unhandled %s while streaming request %s\n%s",
            type(exc).__name__,
            request[REQUEST_ID],
            "".join(traceback.format_tb(exc.__traceback__)),
        )
        await _send_error_event(request, response, INTERNAL_ERROR, pending, stall_s)
    return response


class _ClientStalled(Exception):
    """The client took none of a write for `server.client_stall_timeout_s`."""


class _ClientTooSlow(Exception):
    """The client took less than its tier's delivery floor while the gateway
    waited on it for a whole window."""

    def __init__(self, taken: float, waited_s: float) -> None:
        super().__init__(taken, waited_s)
        self.taken = taken
        self.waited_s = waited_s


_SIOCOUTQ = 0x5411
"""Linux's ioctl for the bytes a TCP socket holds that its peer has not yet
acknowledged (TIOCOUTQ's number)."""


class Pace:
    """A stream's delivery floor. The gateway pulls the backend's
    next chunk only once the client's socket took the last write, so a reader
    slower than the backend holds the backend's slot for as long as it reads:
    a 4,000-token answer at 256 B/s takes an hour. The stall timeout catches
    only a reader that takes nothing at all.

    The floor is judged only over the time the gateway waits on the client:
    then the buffers to it are full and the client alone holds the slot. A
    slow model keeps no write waiting, so a client of a slow model is never
    judged, however long the answer takes; a rate rather than a maximum
    duration for the same reason, since a duration long enough for a slow
    model's longest answer bounds nothing. While the gateway waits, what the
    client took is what left the transport's buffer and the kernel's send
    queue (the queue holds what the client's kernel has not acknowledged,
    SIOCOUTQ; where that cannot be read, what left the transport, which comes
    in bursts as the kernel frees room: a window must then outlast a burst).
    Once the waits add up to `window_s`, the bytes taken must reach
    `floor * window_s`, or the stream ends; the count then starts over.

    So a reader holds a slot for at most about the answer's bytes over the
    floor, on top of the backend's own time, and never more than `window_s`
    of waiting at below the floor."""

    __slots__ = ("floor", "window_s", "waited_s", "taken")

    def __init__(self, floor: float, window_s: float) -> None:
        self.floor = floor
        self.window_s = window_s
        self.waited_s = 0.0
        self.taken = 0.0

    @staticmethod
    def backlog(transport: asyncio.Transport) -> int:
        """Bytes written that the client's kernel has not acknowledged."""
        held = transport.get_write_buffer_size()
        if sys.platform == "linux":
            sock = transport.get_extra_info("socket")
            if sock is not None:
                try:
                    raw = fcntl.ioctl(sock.fileno(), _SIOCOUTQ, b"\0" * 4)
                    held += struct.unpack("i", raw)[0]
                except OSError:
                    pass
        return held

    async def wait(self, write: Any, transport: asyncio.Transport, size: int,
                   stall_s: float) -> None:  # fmt: skip
        """Await `write` (which adds `size` bytes), bounded by the stall
        timeout and judged against the floor."""
        loop = asyncio.get_running_loop()
        task = asyncio.ensure_future(write)
        start = loop.time()
        backlog = self.backlog(transport) + size
        try:
            while True:
                now = loop.time()
                until = min(start + stall_s, now + max(0.0, self.window_s - self.waited_s))
                await asyncio.wait((task,), timeout=max(0.0, until - now))
                left = self.backlog(transport)
                self.waited_s += loop.time() - now
                self.taken += max(0, backlog - left)
                backlog = left
                if task.done():
                    task.result()
                    return
                if loop.time() - start >= stall_s:
                    raise _ClientStalled
                if self.waited_s >= self.window_s:
                    if self.taken < self.floor * self.waited_s:
                        raise _ClientTooSlow(self.taken, self.waited_s)
                    self.waited_s = self.taken = 0.0
        finally:
            if not task.done():
                # Settled before anything else is written to the response.
                task.cancel()
                await asyncio.wait((task,))


_WRITE_SLACK = 4096
"""Bytes aiohttp may add to a write: chunk framing, and the headers it sends
along with the first one."""


async def _write(
    request: web.Request,
    response: web.StreamResponse,
    data: bytes,
    stall_s: float,
    *,
    last: bool = False,
    pace: Pace | None = None,
) -> None:
    """Send `data` (and end the body, if `last`). aiohttp's write waits while
    the socket's buffers are full, which is what keeps a slow reader from
    making the gateway pull the backend ahead and buffer its output; bounding
    that wait keeps a reader that stopped from holding its backend slot, and
    `pace`'s floor one that reads too slowly."""
    transport = request.transport
    write = response.write_eof(data) if last else response.write(data)
    if (
        transport is not None
        and not request.protocol.writing_paused
        and transport.get_write_buffer_size() + len(data) + _WRITE_SLACK
        <= transport.get_write_buffer_limits()[1]
    ):
        # This write cannot wait: the transport stays below its high-water
        # mark, so aiohttp has nothing to drain. Most writes are like this,
        # and skip the timer (a few microseconds each, per token).
        await write
        return
    if pace is not None and pace.floor > 0 and transport is not None:
        await pace.wait(write, transport, len(data), stall_s)
        return
    try:
        async with asyncio.timeout(stall_s):
            await write
    except TimeoutError:
        raise _ClientStalled from None


def _drop_stalled(request: web.Request, stall_s: float) -> None:
    """Hang up on a stalled client at once, with a reset: a graceful close
    would leave the kernel holding what is still buffered for a reader that
    takes nothing, for as long as TCP keeps probing it."""
    log.warning(
        "request %s: the client read nothing for %gs; dropped", request[REQUEST_ID], stall_s
    )
    transport = request.transport
    if transport is None:
        return
    sock = transport.get_extra_info("socket")
    if sock is not None:
        try:
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
        except OSError:
            pass  # the socket refused the option: a plain abort then
    transport.abort()


async def _send_error_event(
    request: web.Request,
    response: web.StreamResponse,
    payload: dict[str, Any],
    pending: list[bytes],
    stall_s: float,
) -> None:
    """The error as the stream's last event, after the events not yet sent."""
    try:
        data = b"".join([*pending, sse_event(payload)])
        await _write(request, response, data, stall_s, last=True)
    except _ClientStalled:
        _drop_stalled(request, stall_s)
    except ConnectionError:
        pass
