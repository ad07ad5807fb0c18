"""Backends: where admitted work runs (the port is in `base`)."""

from __future__ import annotations

from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from qosgate.backends.base import Backend
    from qosgate.config.models import OpenAIBackendConfig, SimBackendConfig, VllmBackendConfig


class BackendNotImplemented(NotImplementedError):
    """The policy names a backend kind this build cannot run yet."""


def build_backend(cfg: SimBackendConfig | OpenAIBackendConfig | VllmBackendConfig) -> Backend:
    """The backend a policy's `backend:` section describes."""
    if cfg.kind == "sim":
        # Imported here so that loading the package does not pull in every
        # backend's dependencies (vLLM above all).
        from qosgate.backends.sim_live import SimBackend

        return SimBackend(cfg)
    if cfg.kind == "openai":
        from qosgate.backends.openai import OpenAIBackend

        return OpenAIBackend(cfg)
    if cfg.kind == "vllm":
        from qosgate.backends.vllm import VllmBackend

        return VllmBackend(cfg)
    raise BackendNotImplemented(f"backend.kind: {cfg.kind!r} is not implemented")


__all__ = ["BackendNotImplemented", "build_backend"]
