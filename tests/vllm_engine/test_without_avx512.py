"""`b8_upstream.py --without-avx512`: the server's vLLM runs as on a host
without AVX-512 (benchmarks/without_avx512), or the benchmark says it did not."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "benchmarks"))

import b8_upstream  # noqa: E402

# What vLLM's CPU platform loads and what torch dispatches to, in a fresh process.
PROBE = """
import torch, vllm
from vllm.platforms import current_platform
current_platform.import_kernels()
kernels = sorted({line.rsplit("/", 1)[-1].strip() for line in open("/proc/self/maps")
                  if "/vllm/_C" in line})
print(torch.backends.cpu.get_cpu_capability(), torch.cpu._is_avx512_supported(), *kernels)
"""


def probe(env: dict[str, str]) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-c", PROBE], env=env, capture_output=True, text=True,
                          timeout=300, check=True, cwd=ROOT)  # fmt: skip


def test_the_servers_vllm_takes_its_avx2_paths():
    done = probe({**os.environ, **b8_upstream.WITHOUT_AVX512})
    capability, avx512, *kernels = done.stdout.split()
    assert (capability, avx512, kernels) == ("AVX2", "False", ["_C_AVX2.abi3.so"]), done.stdout
    # The mark the benchmark looks for in the server's log before it runs.
    assert b8_upstream.WITHOUT_AVX512_MARK in done.stderr


def test_without_the_option_vllm_is_left_as_it_finds_the_host():
    env = {k: v for k, v in os.environ.items() if k not in b8_upstream.WITHOUT_AVX512}
    done = probe(env)
    assert b8_upstream.WITHOUT_AVX512_MARK not in done.stderr
    has_avx512 = " avx512f" in Path("/proc/cpuinfo").read_text()
    assert done.stdout.split()[1] == str(has_avx512), done.stdout
