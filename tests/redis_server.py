"""A real `redis-server` for the tests, on a free loopback port.

Started from the binary on PATH (`make test` installs it when missing); the
test waits for the server's own "Ready to accept connections" line rather
than for a time. `stop()` and `start()` again reuse the port, which is how
the outage tests kill Redis under a running gateway and bring it back.
"""

from __future__ import annotations

import shutil
import socket
import subprocess
import tempfile
import threading

READY_MARKER = "Ready to accept connections"
START_LIMIT_S = 20.0


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


class RedisServer:
    def __init__(self, port: int | None = None, *, durable: bool = False) -> None:
        """`durable`: an append-only file synced on every write, so that a
        kill and a restart keep the data, as a production Redis would."""
        binary = shutil.which("redis-server")
        if binary is None:
            raise RuntimeError(
                "redis-server is not installed; `make test` installs it "
                "(apt-get install redis-server)"
            )
        self.binary = binary
        self.port = port or free_port()
        self.durable = durable
        self._dir = tempfile.TemporaryDirectory(prefix="qosgate-redis-")
        self.proc: subprocess.Popen[str] | None = None
        self.log: list[str] = []

    @property
    def url(self) -> str:
        return f"redis://127.0.0.1:{self.port}/0"

    def start(self) -> None:
        assert self.proc is None, "already running"
        self.proc = subprocess.Popen(
            [
                self.binary, "--port", str(self.port), "--bind", "127.0.0.1",
                "--save", "", "--dir", self._dir.name,
                *(("--appendonly", "yes", "--appendfsync", "always") if self.durable
                  else ("--appendonly", "no")),
                "--loglevel", "notice",
            ],
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
        )  # fmt: skip
        ready = threading.Event()

        def read() -> None:
            assert self.proc is not None and self.proc.stdout is not None
            for line in self.proc.stdout:
                self.log.append(line.rstrip())
                if READY_MARKER in line:
                    ready.set()
            ready.set()  # exited: let the waiter see it

        threading.Thread(target=read, daemon=True).start()
        if not ready.wait(START_LIMIT_S) or self.proc.poll() is not None:
            tail = "\n".join(self.log[-20:])
            self.stop()
            raise RuntimeError(f"redis-server did not start on port {self.port}:\n{tail}")

    def stop(self) -> None:
        proc, self.proc = self.proc, None
        if proc is not None and proc.poll() is None:
            proc.kill()
            proc.wait()

    def close(self) -> None:
        self.stop()
        self._dir.cleanup()

    def __enter__(self) -> RedisServer:
        self.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

