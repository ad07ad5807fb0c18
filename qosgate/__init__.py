"""qosgate: a QoS gateway for LLM inference.

The public API, for running the gateway (or only its scheduler) inside a
program of your own. Everything not named here lives in private modules
behind it and may change without notice.

- Policy: `load_policy`, `load_policy_text`, `PolicyConfig`, `ConfigError`.
- The scheduler core: `Scheduler`, `Request`, `Outcome`, `AdmissionDecision`,
  `BackendCapacity`, `SchedulePlan`. It is synchronous and does no I/O; every
  call takes the time (`now`) as an argument.
- The async runtime: `Gateway`, `RequestStream`, `GatewayError`.
- Backends: `build_backend`, `Backend`, `GenerationJob`, `Chunk`.
- Quotas: `QuotaGuard`, `QuotaStore`, `MemoryQuotaStore`.
- HTTP: `build_app` (the aiohttp application) and `serve` (what `qosgate serve`
  runs).
- Observability: `Observer`, `configure_logging`.

Names load on first use, so `import qosgate.core` pulls in no HTTP stack,
Redis client or engine.
"""

from __future__ import annotations

import importlib
from importlib import metadata
from typing import TYPE_CHECKING, Any

try:
    __version__ = metadata.version("qosgate")
except metadata.PackageNotFoundError:  # a source tree that was never installed
    __version__ = "0.0.0+unknown"

_WHERE = {
    "load_policy": "qosgate.config.loader",
    "load_policy_text": "qosgate.config.loader",
    "ConfigError": "qosgate.config.loader",
    "PolicyConfig": "qosgate.config.models",
    "Scheduler": "qosgate.core.scheduler",
    "BackendCapacity": "qosgate.core.scheduler",
    "SchedulePlan": "qosgate.core.scheduler",
    "AdmissionDecision": "qosgate.core.admission",
    "Request": "qosgate.core.request",
    "Outcome": "qosgate.core.request",
    "Gateway": "qosgate.runtime.gate",
    "RequestStream": "qosgate.runtime.gate",
    "GatewayError": "qosgate.runtime.errors",
    "build_backend": "qosgate.backends",
    "Backend": "qosgate.backends.base",
    "GenerationJob": "qosgate.backends.base",
    "Chunk": "qosgate.backends.base",
    "QuotaGuard": "qosgate.quotas.guard",
    "QuotaStore": "qosgate.quotas.store",
    "MemoryQuotaStore": "qosgate.quotas.store",
    "build_app": "qosgate.http.app",
    "serve": "qosgate.http.server",
    "Observer": "qosgate.observability",
    "configure_logging": "qosgate.observability.logging",
}

__all__ = ["__version__", *_WHERE]


def __getattr__(name: str) -> Any:
    module = _WHERE.get(name)
    if module is None:
        raise AttributeError(f"module 'qosgate' has no attribute {name!r}")
    value = getattr(importlib.import_module(module), name)
    globals()[name] = value  # looked up once
    return value


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(__all__))


if TYPE_CHECKING:  # what type checkers and editors see
    from qosgate.backends import build_backend
    from qosgate.backends.base import Backend, Chunk, GenerationJob
    from qosgate.config.loader import ConfigError, load_policy, load_policy_text
    from qosgate.config.models import PolicyConfig
    from qosgate.core.admission import AdmissionDecision
    from qosgate.core.request import Outcome, Request
    from qosgate.core.scheduler import BackendCapacity, SchedulePlan, Scheduler
    from qosgate.http.app import build_app
    from qosgate.http.server import serve
    from qosgate.observability import Observer
    from qosgate.observability.logging import configure_logging
    from qosgate.quotas.guard import QuotaGuard
    from qosgate.quotas.store import MemoryQuotaStore, QuotaStore
    from qosgate.runtime.errors import GatewayError
    from qosgate.runtime.gate import Gateway, RequestStream
