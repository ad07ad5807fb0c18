"""The `x-ratelimit-*` headers, in the form OpenAI's clients already read."""

from __future__ import annotations

from collections.abc import Iterable

from qosgate.quotas import LimitState
from qosgate.runtime.gate import tightest_tokens


def duration(seconds: float) -> str:
    """OpenAI's reset format: `250ms`, `1.5s`, `6m0s`, `1h2m3s`."""
    if seconds < 1:
        return f"{max(0, round(seconds * 1000))}ms"
    hours, rest = divmod(seconds, 3600)
    minutes, secs = divmod(rest, 60)
    secs_text = f"{secs:.3f}".rstrip("0").rstrip(".")
    if hours >= 1:
        return f"{int(hours)}h{int(minutes)}m{secs_text}s"
    if minutes >= 1:
        return f"{int(minutes)}m{secs_text}s"
    return f"{secs_text}s"


def ratelimit_headers(states: Iterable[LimitState]) -> dict[str, str]:
    """The tokens trio from the tighter of the token limits (the one with less
    left), the requests trio from requests_per_minute; none for a tenant
    without such limits."""
    states = list(states)
    requests = next((s for s in states if s.kind == "requests_per_minute"), None)
    headers: dict[str, str] = {}
    for unit, state in (("tokens", tightest_tokens(states)), ("requests", requests)):
        if state is not None:
            headers[f"x-ratelimit-limit-{unit}"] = str(state.limit)
            headers[f"x-ratelimit-remaining-{unit}"] = str(state.remaining)
            headers[f"x-ratelimit-reset-{unit}"] = duration(state.reset_s)
    return headers
