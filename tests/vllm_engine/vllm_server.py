"""`vllm serve` of a model as a subprocess, for the tests that need vLLM's
own server (its OpenAI API, its /metrics) rather than the in-process engine.
"""

from __future__ import annotations

import asyncio
import collections
import contextlib
import os
import signal
import socket
import sys
from collections.abc import AsyncIterator
from pathlib import Path

import aiohttp

from tests.vllm_engine.vllm_cli import LISTENING

CLI = str(Path(__file__).with_name("vllm_cli.py"))
SERVED = "tiny"
# Guards against a hang, never waits: each await ends on an event (a log
# line, a process's exit).
START_LIMIT_S = 300


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def tail(text: str, lines: int = 60) -> str:
    return "\n".join(text.splitlines()[-lines:])


class VllmServer:
    """`vllm serve MODEL` on a free loopback port, in a process group of its
    own (its EngineCore is a child), with its output kept for diagnostics."""

    def __init__(self, model: str, *, max_num_seqs: int, max_model_len: int) -> None:
        self.model = model
        self.max_num_seqs, self.max_model_len = max_num_seqs, max_model_len
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.lines: collections.deque[str] = collections.deque(maxlen=300)
        self.proc: asyncio.subprocess.Process | None = None
        self._reader: asyncio.Task[None] | None = None
        self._listening: asyncio.Future[bool] | None = None

    async def start(self) -> None:
        self.proc = await asyncio.create_subprocess_exec(
            sys.executable, CLI, "serve", self.model, "--served-model-name", SERVED,
            "--host", "127.0.0.1", "--port", str(self.port), "--enforce-eager",
            "--dtype", "bfloat16", "--max-model-len", str(self.max_model_len),
            "--max-num-seqs", str(self.max_num_seqs),
            "--disable-uvicorn-access-log",
            stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.STDOUT,
            start_new_session=True, limit=1 << 20,
        )  # fmt: skip
        self._listening = asyncio.get_running_loop().create_future()
        self._reader = asyncio.create_task(self._read())

    async def _read(self) -> None:
        assert self.proc is not None and self.proc.stdout is not None
        assert self._listening is not None
        async for raw in self.proc.stdout:
            line = raw.decode(errors="replace").rstrip()
            self.lines.append(line)
            if line == LISTENING and not self._listening.done():
                self._listening.set_result(True)
        if not self._listening.done():
            self._listening.set_result(False)  # it exited before it listened

    async def ready(self) -> None:
        """Until /health answers 200, or the process has exited. Its socket
        listens from its bind on, before the engine loads (vllm_cli.py), so
        the one request waits in the kernel's backlog and is answered once
        uvicorn serves; a process that exits resets it."""
        assert self._listening is not None
        unbounded = aiohttp.ClientTimeout(total=None)  # the START_LIMIT_S guard bounds it
        async with asyncio.timeout(START_LIMIT_S), aiohttp.ClientSession(timeout=unbounded) as http:
            try:
                if not await asyncio.shield(self._listening):
                    raise aiohttp.ClientConnectionError("no listening socket")
                async with http.get(self.url + "/health") as r:
                    if r.status == 200:
                        return
                    why = f"vllm serve answered /health with {r.status}"
            except aiohttp.ClientConnectionError:
                why = "vllm serve exited before it served"
        raise AssertionError(why + ":\n" + "\n".join(self.lines))

    async def stop(self) -> None:
        proc = self.proc
        if proc is None:
            return
        if proc.returncode is None:
            proc.terminate()  # the API server shuts its engine down
            try:
                await asyncio.wait_for(proc.wait(), 60)
            except TimeoutError:
                os.killpg(proc.pid, signal.SIGKILL)
                await proc.wait()
        # Whatever of its group outlived it (an EngineCore) goes too.
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, signal.SIGKILL)
        if self._reader is not None:
            await self._reader


@contextlib.asynccontextmanager
async def serving(
    model: str, *, max_num_seqs: int, max_model_len: int
) -> AsyncIterator[VllmServer]:
    """A `VllmServer` started and ready (/health answers), stopped on the way out."""
    server = VllmServer(model, max_num_seqs=max_num_seqs, max_model_len=max_model_len)
    await server.start()
    try:
        await server.ready()
        yield server
    finally:
        await server.stop()
