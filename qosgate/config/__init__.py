"""Policy configuration: the pydantic models and the YAML loader that reports lines."""

from qosgate.config.loader import (
    ConfigError,
    ConfigIssue,
    load_model,
    load_model_text,
    load_policy,
    load_policy_text,
)
from qosgate.config.models import (
    AgingConfig,
    BatchWindow,
    PolicyConfig,
    SchedulerConfig,
    SimBackendConfig,
    TenantConfig,
    TierConfig,
)

__all__ = [
    "AgingConfig",
    "BatchWindow",
    "ConfigError",
    "ConfigIssue",
    "PolicyConfig",
    "SchedulerConfig",
    "SimBackendConfig",
    "TenantConfig",
    "TierConfig",
    "load_model",
    "load_model_text",
    "load_policy",
    "load_policy_text",
]
