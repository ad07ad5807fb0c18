"""What of an OpenAI request each backend can honour.

The gateway validates every request against OpenAI's model first
(`qosgate.http.validation`), then against the configured backend's
`RequestSupport`: a field the backend would ignore (a tool call, a JSON
schema, log probabilities, an image) is refused with a 400 that names it and
the backend, so a client never gets free text where it asked for structure.
"""

from __future__ import annotations

from dataclasses import dataclass

# Optional capabilities a request may ask for (`features()` of the body models).
LOGPROBS = "logprobs"
RESPONSE_FORMAT = "response_format"
TOOLS = "tools"
LOGIT_BIAS = "logit_bias"
ECHO = "echo"
SUFFIX = "suffix"
MEDIA = ("image_url", "input_audio", "file")
"""Content parts other than text, each a capability of its own."""


@dataclass(frozen=True, slots=True)
class RequestSupport:
    backend: str
    """The backend's kind, as the error messages name it."""
    passthrough: bool = False
    """Every field goes on to a server that judges it (OpenAI-compatible
    upstreams): nothing is refused here, and the server's own 400 reaches
    the client."""
    features: frozenset[str] = frozenset()
    """Optional capabilities it honours (the names above); unknown fields
    are refused unless it is a passthrough."""


PASSTHROUGH = RequestSupport("openai", passthrough=True)
SIM = RequestSupport(
    # The simulated GPU writes filler text: sampling and bias change nothing
    # a client could check, so they are taken; structure is not.
    "sim",
    features=frozenset({LOGIT_BIAS}),
)
VLLM = RequestSupport("vllm", features=frozenset({LOGIT_BIAS, RESPONSE_FORMAT, LOGPROBS}))
