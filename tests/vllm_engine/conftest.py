"""The real vLLM engine (CPU build) behind the real gateway.

These tests need vLLM, which the dev environment does not install (it is
about 3.5 GB): `make test-vllm` builds its own environment with the CPU
build, and `.ci/run` runs it after `make test`. Without vLLM the directory is
skipped, and says so.

One tiny random-weight model, written locally (make_tiny_model.py), serves
every test; an engine takes about 25 s to start, so a module shares one.
"""

from __future__ import annotations

import os

import pytest

pytest.importorskip("vllm", reason="the vLLM tests run in `make test-vllm`")

os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")  # GiB of KV cache


@pytest.fixture(scope="session")
def tiny_model(tmp_path_factory) -> str:
    from tests.vllm_engine.make_tiny_model import write

    target = tmp_path_factory.mktemp("tiny-model")
    write(target)
    return str(target)
