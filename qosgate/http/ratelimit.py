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
    headers: dict[str, str] = {}
    t = tightest_tokens(states)
    if t is not None:
        headers["x-ratelimit-limit-tokens"] = str(t.limit)
        headers["x-ratelimit-remaining-tokens"] = str(t.remaining)
        headers["x-ratelimit-reset-tokens"] = duration(t.reset_s)
    requests = [s for s in states if s.kind == "requests_per_minute"]
    if requests:
        r = requests[0]
        headers["x-ratelimit-limit-requests"] = str(r.limit)
        headers["x-ratelimit-remaining-requests"] = str(r.remaining)
        headers["x-ratelimit-reset-requests"] = duration(r.reset_s)
    return headers
