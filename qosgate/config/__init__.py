"""Policy configuration: the pydantic models and the YAML loader that reports lines."""

from qosgate.config.loader import (
    ConfigError, ConfigIssue, load_model, load_policy, load_policy_text,
)  # fmt: skip
from qosgate.config.models import PolicyConfig, SimBackendConfig

__all__ = [
    "ConfigError", "ConfigIssue", "PolicyConfig", "SimBackendConfig", "load_model", "load_policy",
    "load_policy_text",
]  # fmt: skip
