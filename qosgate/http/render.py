"""OpenAI's answer bodies and stream events, rendered from a request's chunks
(whole by completions.py, as events by streaming.py).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import orjson

from qosgate.backends.base import Chunk
from qosgate.runtime.gate import RequestStream

from .validation import Endpoint


@dataclass
class Call:
    """What the response needs to know about one admitted request."""

    endpoint: Endpoint
    response_id: str
    created: int
    model: str
    prompt_tokens: int
    include_usage: bool


def usage_body(
    call: Call, completion_tokens: int, reported: dict[str, int] | None
) -> dict[str, int]:
    # The backend's own count wins where it has one (a real tokenizer).
    prompt = call.prompt_tokens
    completion = completion_tokens
    if reported:
        prompt = int(reported.get("prompt_tokens", prompt))
        completion = int(reported.get("completion_tokens", completion))
    return {
        "prompt_tokens": prompt,
        "completion_tokens": completion,
        "total_tokens": prompt + completion,
    }


class Tally:
    def __init__(self) -> None:
        self.tokens = 0
        self.finish_reason: str | None = None
        self.usage: dict[str, int] | None = None

    def add(self, chunk: Chunk) -> None:
        self.tokens += chunk.tokens
        if chunk.finish_reason is not None:
            self.finish_reason = chunk.finish_reason
        if chunk.usage:
            self.usage = chunk.usage


async def answer_body(stream: RequestStream, call: Call) -> dict[str, Any]:
    """The whole answer of a request read whole: its stream read to the end
    (closed on any other way out, so the request ends with its reader)."""
    parts: list[str] = []
    message_fields: dict[str, Any] = {}
    choice_fields: dict[str, Any] = {"logprobs": None}
    tally = Tally()
    try:
        async for chunk in stream:
            parts.append(chunk.text)
            tally.add(chunk)
            if chunk.raw:
                # A backend that answers whole passes a chat message's other
                # fields (tool calls, ...) under "message". Deltas (raw["delta"])
                # come only to streamed requests: the openai backend asks a
                # whole answer of its upstream for a client that reads whole.
                extra = chunk.raw.get("message")
                if isinstance(extra, dict):
                    message_fields.update(extra)
                relay_choice_fields(choice_fields, chunk.raw)
    except BaseException:
        # Cancelled (client gone) or failed: the stream must end its request
        # now, so a queued request leaves the queue and a running one aborts.
        await stream.aclose()
        raise
    text = "".join(parts)
    finish = tally.finish_reason or "stop"
    if call.endpoint == "chat":
        choice: dict[str, Any] = {
            "index": 0,
            "message": {"role": "assistant", "content": text, **message_fields},
            **choice_fields,
            "finish_reason": finish,
        }
    else:
        choice = {"index": 0, "text": text, **choice_fields, "finish_reason": finish}
    usage = usage_body(call, tally.tokens, tally.usage)
    return response_body(call, [choice], usage, chunk=False)


_NOT_CHOICE_FIELDS = frozenset({"index", "delta", "message", "text", "finish_reason"})
"""Keys of a chunk's `raw` that are not the choice's own fields: the gateway
renders these itself, or (delta, message) puts them further in."""


def _join_logprobs(have: Any, more: Any) -> Any:
    """Two consecutive chunks' logprobs as one. Every list in them runs along
    the tokens (chat's `content` and `refusal`; completions' `tokens`,
    `token_logprobs`, `top_logprobs`, `text_offset`, which upstreams count
    from the start of the whole text), so the lists go end to end. The
    joined lists are the response's own, extended in place: a whole answer
    given token by token (the vllm backend's) joins in linear time."""
    if not isinstance(more, dict):
        return have if more is None else more
    joined = have if isinstance(have, dict) else {}
    for key, value in more.items():
        before = joined.get(key)
        if isinstance(before, list) and isinstance(value, list):
            before.extend(value)
        elif isinstance(value, list):
            joined[key] = list(value)  # a copy: the chunk's list is not ours to grow
        elif value is not None:
            joined[key] = value
    return joined


def relay_choice_fields(choice: dict[str, Any], raw: dict[str, Any]) -> None:
    """What a backend relays beyond text (logprobs, vLLM's stop_reason, ...)
    onto `choice`; logprobs already there are joined, not replaced."""
    for key, value in raw.items():
        if key in _NOT_CHOICE_FIELDS:
            continue
        if key == "logprobs":
            value = _join_logprobs(choice.get("logprobs"), value)
        choice[key] = value


def sse_event(payload: dict[str, Any]) -> bytes:
    return b"data: " + orjson.dumps(payload) + b"\n\n"


DONE_EVENT = b"data: [DONE]\n\n"
# Stands in for the text while the rest of a text event is rendered. Any string
# would do: the text is the event's last string, so the last match is the text
# whatever the id or the model name hold.
_TEXT_MARKER = "\x00"
_TEXT_MARKER_JSON = orjson.dumps(_TEXT_MARKER)


def text_event_parts(call: Call) -> tuple[bytes, bytes]:
    """A text event's bytes before and after its JSON-quoted text. Text events
    differ in nothing else, so the rest is rendered once per response."""
    head, _, tail = chunk_event(call, _TEXT_MARKER, None).rpartition(_TEXT_MARKER_JSON)
    return head, tail


def chunk_event(
    call: Call,
    delta_text: str | None,
    finish: str | None,
    *,
    role: bool = False,
    usage: dict[str, int] | None = None,
    raw: dict[str, Any] | None = None,
) -> bytes:
    if call.endpoint == "chat":
        delta: dict[str, Any] = {}
        if role:
            delta["role"] = "assistant"
        if delta_text is not None:
            delta["content"] = delta_text
        extra = raw.get("delta") if raw else None
        if isinstance(extra, dict):
            delta.update(extra)
        choice: dict[str, Any] = {"index": 0, "delta": delta, "logprobs": None,
                                  "finish_reason": finish}  # fmt: skip
    else:
        choice = {"index": 0, "text": delta_text or "", "logprobs": None, "finish_reason": finish}
    if raw:
        relay_choice_fields(choice, raw)
    return sse_event(response_body(call, [choice], usage, chunk=True))


def usage_event(call: Call, usage: dict[str, int]) -> bytes:
    return sse_event(response_body(call, [], usage, chunk=True))


def response_body(
    call: Call, choices: list[dict[str, Any]], usage: dict[str, int] | None, *, chunk: bool
) -> dict[str, Any]:
    """The fields every answer body and stream event share around its choices."""
    if call.endpoint == "chat":
        kind = "chat.completion.chunk" if chunk else "chat.completion"
    else:
        kind = "text_completion"
    body: dict[str, Any] = {
        "id": call.response_id, "object": kind, "created": call.created, "model": call.model,
        "choices": choices,
    }  # fmt: skip
    if usage is not None:
        body["usage"] = usage
    return body
