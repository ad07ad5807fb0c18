"""The async layer: the gateway (submit -> stream) around the scheduling core."""

from qosgate.runtime.errors import (
    AuthThrottled,
    BackendFailed,
    BackendUnavailableError,
    BadRequest,
    Expired,
    GatewayClosing,
    GatewayError,
    Overloaded,
    PayloadTooLarge,
    QueueFull,
    QuotaExceeded,
    QuotaStoreUnavailable,
    RequestTimeout,
    Unauthorized,
)
from qosgate.runtime.gate import Gateway, PolicyReloadRefused, RequestStream

__all__ = [
    "AuthThrottled",
    "BackendFailed",
    "BackendUnavailableError",
    "BadRequest",
    "Expired",
    "Gateway",
    "GatewayClosing",
    "GatewayError",
    "Overloaded",
    "PayloadTooLarge",
    "PolicyReloadRefused",
    "QueueFull",
    "QuotaExceeded",
    "QuotaStoreUnavailable",
    "RequestStream",
    "RequestTimeout",
    "Unauthorized",
]
