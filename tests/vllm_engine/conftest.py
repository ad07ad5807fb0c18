"""The real vLLM engine (CPU build) behind the real gateway.

These tests need vLLM, which the dev environment does not install (it is
about 3.5 GB): `make test-vllm` builds its own environment with the CPU
build, and `.ci/run` runs it after `make test`. Without vLLM the directory is
skipped, and says so.

One tiny random-weight model, written locally (make_tiny_model.py), serves
every test; an engine takes about 25 s to start, so a module shares one.
"""

from __future__ import annotations

import importlib.util
import os
from pathlib import Path

import pytest

# vLLM 0.32's CPU engine dies at its first forward pass on a host with AMX
# (seen on an Intel Xeon with amx_tile and avx512_bf16; the AMD hosts without
# AMX run it). There the engine's processes take vLLM's AVX2 paths, as
# `b8_upstream.py --without-avx512` runs them, so that these tests judge
# qosgate and not that crash; the session's header says so.
_AMX = "amx_tile" in Path("/proc/cpuinfo").read_text() if Path("/proc/cpuinfo").exists() else False
_HAS_VLLM = importlib.util.find_spec("vllm") is not None  # not in `make test`'s .venv
if _HAS_VLLM and _AMX and os.environ.get("QOSGATE_TEST_VLLM_NATIVE_ISA") != "1":
    _helper = str(Path(__file__).resolve().parents[2] / "benchmarks" / "without_avx512")
    os.environ.update({
        "PYTHONPATH": os.pathsep.join(filter(None, [_helper, os.environ.get("PYTHONPATH")])),
        "QOSGATE_BENCH_WITHOUT_AVX512": "1", "ATEN_CPU_CAPABILITY": "avx2",
        "ONEDNN_MAX_CPU_ISA": "AVX2",
    })  # fmt: skip
    # This process too, before it imports vllm.
    _spec = importlib.util.spec_from_file_location("without_avx512", f"{_helper}/sitecustomize.py")
    assert _spec is not None and _spec.loader is not None
    _spec.loader.exec_module(importlib.util.module_from_spec(_spec))

pytest.importorskip("vllm", reason="the vLLM tests run in `make test-vllm`")


def pytest_report_header(config):
    if _AMX and os.environ.get("QOSGATE_BENCH_WITHOUT_AVX512") == "1":
        return "vllm: AMX host, engine on vLLM's AVX2 paths (QOSGATE_TEST_VLLM_NATIVE_ISA=1: native)"
    return None

os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")  # GiB of KV cache


@pytest.fixture(scope="session")
def tiny_model(tmp_path_factory) -> str:
    from tests.vllm_engine.make_tiny_model import write

    target = tmp_path_factory.mktemp("tiny-model")
    write(target)
    return str(target)
