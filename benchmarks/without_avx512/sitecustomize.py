"""vLLM's CPU build as on a host without AVX-512, for a benchmark's server.

On `PYTHONPATH` with QOSGATE_BENCH_WITHOUT_AVX512=1 (`b8_upstream.py
--without-avx512` sets both, and ATEN_CPU_CAPABILITY=avx2 with
ONEDNN_MAX_CPU_ISA=AVX2, for the server alone): when a process first imports
vllm, torch's CPU feature checks report no AVX-512, AVX-512 BF16, VNNI or
AMX, so vLLM loads its AVX2 kernels and picks the paths it takes on such a
host, while torch's own kernels and oneDNN are capped at AVX2 by those two
variables. The CPU itself is unchanged: a slower host's clock, caches and
cores are not what this reproduces.
"""

import importlib.abc
import os
import sys

MARK = "qosgate bench: AVX-512 hidden from vllm"
"""Written to the process's stderr, so that the benchmark can check it took."""
_FEATURES = ("_is_avx512_supported", "_is_avx512_bf16_supported", "_is_avx512_vnni_supported",
             "_is_amx_tile_supported", "_is_amx_fp16_supported")


class _BeforeVllm(importlib.abc.MetaPathFinder):
    def find_spec(self, name, path, target=None):
        if name == "vllm":
            sys.meta_path.remove(self)
            import torch.cpu

            for feature in _FEATURES:
                if hasattr(torch.cpu, feature):
                    setattr(torch.cpu, feature, lambda: False)
            print(MARK, file=sys.stderr, flush=True)
        return None  # the normal finders import it


if os.environ.get("QOSGATE_BENCH_WITHOUT_AVX512") == "1":
    sys.meta_path.insert(0, _BeforeVllm())
