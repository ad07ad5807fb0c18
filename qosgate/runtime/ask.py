"""What a client asked, as the runtime takes it, and the job it becomes.

The HTTP layer parses and validates a body into an `Ask`; `Gateway.admit`
shapes it here (max_tokens clamped to the tier and to the model's context,
the prompt counted) before it reserves the quota and submits the job.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any, Literal

from qosgate.config.models import TierConfig
from qosgate.runtime.errors import ContextLengthExceeded


@dataclass(frozen=True, slots=True)
class Ask:
    """One validated request of an identified client."""

    request_id: str
    tenant: str
    tier: str
    endpoint: Literal["chat", "completions"]
    body: Mapping[str, Any]
    """The client's body as validated; the job's body is derived from it."""
    asked_max_tokens: int | None = None
    """The output the client asked for (None: the tier's default)."""
    asked_field: str = "max_tokens"
    """The field it asked it in (`max_completion_tokens` on chat)."""
    min_tokens: int | None = None
    priority_offset: int = 0
    session: str | None = None
    trace: Mapping[str, str] | None = None
    """The trace context as W3C headers, when the request is traced."""


@dataclass(frozen=True, slots=True)
class Shaped:
    """An ask as the backend will run it."""

    body: dict[str, Any]
    prompt_tokens: int
    max_tokens: int


def short_number(value: int) -> str:
    # An integer of thousands of digits is quoted by its size, not in full.
    text = str(value)
    return text if len(text) <= 24 else f"an integer of {len(text)} digits"


def shape(
    ask: Ask,
    tier: TierConfig,
    count_prompt_tokens: Callable[[str, dict[str, Any]], int],
    max_model_len: int | None,
) -> Shaped:
    """The job's body, prompt tokens and max_tokens. Raises ContextLengthExceeded."""
    asked = ask.asked_max_tokens
    default = tier.default_max_tokens or tier.max_tokens
    # Larger asks are clamped rather than refused (the tier cap is the
    # gateway's business); only one past the model's context is refused.
    max_tokens = min(asked if asked is not None else default, tier.max_tokens)
    body = dict(ask.body)
    body["max_tokens"] = max_tokens
    if "max_completion_tokens" in body:
        body["max_completion_tokens"] = max_tokens
    # The gateway turns the client's priority into the job's engine priority;
    # the backend must not see the raw value and apply it twice.
    body.pop("priority", None)

    prompt_tokens = max(1, int(count_prompt_tokens(ask.endpoint, body)))
    fitted = fit_context(ask, prompt_tokens, max_tokens, max_model_len)
    if fitted != max_tokens:
        max_tokens = body["max_tokens"] = fitted
        if "max_completion_tokens" in body:
            body["max_completion_tokens"] = fitted
    least = ask.min_tokens
    if least is not None and least > max_tokens and (asked is None or least <= asked):
        # The clamp put max_tokens under a min_tokens the client asked within
        # its own: a backend that checks the two (vLLM) would refuse the
        # request for the gateway's doing. One past the client's own
        # max_tokens is left for the backend to judge.
        body["min_tokens"] = max_tokens
    return Shaped(body, prompt_tokens, max_tokens)


def fit_context(ask: Ask, prompt_tokens: int, max_tokens: int, max_model_len: int | None) -> int:
    """The max_tokens to run with: `max_tokens` (the tier's clamp of the ask),
    lowered to the room the prompt leaves in the context. A prompt that leaves
    no room, or an ask past the context itself, is a 400 as from
    OpenAI-compatible servers; an ask within the context is clamped like any
    other (it depends on the prompt's length, which a client cannot know)."""
    if max_model_len is None:
        return max_tokens
    asked = ask.asked_max_tokens
    room = max_model_len - prompt_tokens
    if room < 1 or (asked is not None and asked > max_model_len):
        wanted = prompt_tokens + (asked if asked is not None else 1)
        where = "messages" if ask.endpoint == "chat" else "prompt"
        raise ContextLengthExceeded(
            f"This model's maximum context length is {max_model_len} tokens. However, you "
            f"requested {short_number(wanted)} tokens ({prompt_tokens} in the {where}, "
            f"{short_number(wanted - prompt_tokens)} in the completion). Please reduce the "
            f"length of the {where} or completion.",
            param=where if room < 1 else ask.asked_field,
        )
    return min(max_tokens, room)
