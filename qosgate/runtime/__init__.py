"""The async layer: the gateway (submit -> stream) around the scheduling core."""

from qosgate.runtime.errors import (
    BackendFailed, BackendUnavailableError, BadRequest, Expired, GatewayClosing, GatewayError,
    Overloaded, QueueFull,
)  # fmt: skip
from qosgate.runtime.gate import Gateway, RequestStream

__all__ = [
    "BackendFailed", "BackendUnavailableError", "BadRequest", "Expired", "Gateway",
    "GatewayClosing", "GatewayError", "Overloaded", "QueueFull", "RequestStream",
]  # fmt: skip
