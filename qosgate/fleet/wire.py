"""What gateways and engine nodes say to each other through Redis.

A work item's payload is the `GenerationJob` and the channel its gateway
listens on. Everything an engine node sends back is an event
`[request id, lease token, kind, data]`, published to that channel in
batches (a JSON list of events per message): one message per gateway per
event-loop turn, however many requests produced output in it.

The lease token fences a re-run: when a node dies and another takes the item
over, its events carry a higher token, and the gateway drops whatever the
dead node's run still had in flight.
"""

from __future__ import annotations

from typing import Any, Literal

import orjson

from qosgate.backends.base import (
    BackendError,
    BackendRejected,
    Chunk,
    GenerationJob,
    dump_body,
    load_body,
)

CHUNK = "c"
ERROR = "e"
STARTED = "s"
"""An engine node has handed the item to its backend: from here a request
cancelled by its client is charged for what ran (its prompt at least)."""

ErrorKind = Literal["backend_error", "unavailable", "expired", "rejected", "overloaded"]

LOCAL_TOKEN = 1 << 62
"""The token of the events no run sends: those a replica makes for itself
(expired, aborted, channel lost), and the one that ends an item whose place
at its tier's door went to a newcomer (`pushed_out_event`). Above every
lease's, so nothing a run still sends can follow them."""

Event = tuple[str, int, str, Any]


def encode_job(job: GenerationJob, reply_to: str) -> bytes:
    return dump_body(
        {
            "id": job.request_id,
            "endpoint": job.endpoint,
            "body": job.body,
            "prompt_tokens": job.prompt_tokens,
            "max_tokens": job.max_tokens,
            "priority": job.priority,
            "tenant": job.tenant,
            "tier": job.tier,
            "session": job.session,
            "reply_to": reply_to,
            "trace": job.trace,
        }
    )


def decode_job(payload: bytes) -> tuple[GenerationJob, str]:
    """The job and its gateway's reply channel; ValueError if malformed."""
    try:
        data = load_body(payload)
        job = GenerationJob(
            request_id=data["id"],
            endpoint=data["endpoint"],
            body=data["body"],
            prompt_tokens=int(data["prompt_tokens"]),
            max_tokens=int(data["max_tokens"]),
            priority=int(data["priority"]),
            tenant=data["tenant"],
            tier=data["tier"],
            session=data["session"],
            # Absent from items queued by a replica of an earlier version.
            trace=_trace_headers(data.get("trace")),
        )
        reply_to = data["reply_to"]
    except (orjson.JSONDecodeError, KeyError, TypeError, ValueError) as exc:
        raise ValueError(f"malformed work item payload: {exc}") from exc
    if not isinstance(reply_to, str) or job.endpoint not in ("chat", "completions"):
        raise ValueError("malformed work item payload: reply_to or endpoint")
    return job, reply_to


_MAX_TRACE_HEADER = 512


def _trace_headers(value: Any) -> dict[str, str] | None:
    """The W3C trace headers of an item, if it carries well-formed ones
    (anything else only loses the item its trace, never the item)."""
    if not isinstance(value, dict):
        return None
    headers = {
        k: v for k, v in value.items()
        if k in ("traceparent", "tracestate") and isinstance(v, str) and len(v) <= _MAX_TRACE_HEADER
    }  # fmt: skip
    return headers or None


def chunk_event(request_id: str, token: int, chunk: Chunk) -> Event:
    data = [chunk.text, chunk.tokens, chunk.finish_reason, chunk.usage, chunk.raw or None]
    return (request_id, token, CHUNK, data)


def started_event(request_id: str, token: int) -> Event:
    return (request_id, token, STARTED, None)


def error_event(request_id: str, token: int, kind: ErrorKind, message: str) -> Event:
    return (request_id, token, ERROR, [kind, message])


def pushed_out_event(request_id: str, message: str, retry_after_s: float) -> Event:
    """A queued item's place went to a newcomer of a tenant further behind in
    its fair share: its request ends refused for overload (503), with
    `retry_after_s`, the third field. Sent by the replica that enqueued the
    newcomer, in the enqueue's own step. A replica from before this kind
    fails such a request with a 502."""
    return (request_id, LOCAL_TOKEN, ERROR, ["overloaded", message, retry_after_s])


def failure_event(request_id: str, token: int, exc: BackendError) -> Event:
    """A backend's failure of the request, as the kind of failure it is, so
    that the replica ends the request as one node would have."""
    if isinstance(exc, BackendRejected):
        # The param comes third and whether it is the context fourth:
        # replicas from before them read fewer fields, so replicas are
        # upgraded first (docs/FLEET.md).
        return (request_id, token, ERROR,
                ["rejected", exc.message, exc.param, exc.context_length])
    return error_event(request_id, token, "backend_error", str(exc))


def encode_events(events: list[Event]) -> bytes:
    return orjson.dumps(events)


KINDS = (CHUNK, ERROR, STARTED)


def decode_events(message: bytes) -> list[Event]:
    """The events of one message; ValueError if it is not a list of events.
    An event of a kind this version does not know (sent by a newer engine node
    during an upgrade) is left out, not taken for a broken message: that would
    drop the other events with it."""
    try:
        events = orjson.loads(message)
    except orjson.JSONDecodeError as exc:
        raise ValueError(f"malformed fleet message: {exc}") from exc
    if not isinstance(events, list):
        raise ValueError("malformed fleet message: not a list")
    out: list[Event] = []
    for event in events:
        if (
            not isinstance(event, list)
            or len(event) != 4
            or not isinstance(event[0], str)
            or not isinstance(event[1], int)
            or not isinstance(event[2], str)
        ):
            raise ValueError("malformed fleet message: bad event")
        if event[2] in KINDS:
            out.append((event[0], event[1], event[2], event[3]))
    return out


def chunk_of(data: Any) -> Chunk:
    text, tokens, finish_reason, usage, raw = data
    return Chunk(text=text, tokens=tokens, finish_reason=finish_reason, usage=usage, raw=raw or {})
