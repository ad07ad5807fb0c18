"""A live qosgate HTTP app on a free port, for the HTTP tests.

`live_app` runs the real stack (app, gateway, backend) on aiohttp's test
server in the test's own event loop; the backend is the simulated GPU unless
a test passes its own. `ScriptedBackend` is a backend whose every step the
test controls, for the paths the simulated GPU never takes (failures,
clients leaving mid-stream).
"""

from __future__ import annotations

import asyncio
import contextlib
import hashlib
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass
from typing import Any

import aiohttp
from aiohttp.test_utils import TestServer

from qosgate.backends.base import Backend, BackendError, Chunk, GenerationJob
from qosgate.config.loader import load_policy_text
from qosgate.config.models import PolicyConfig
from qosgate.core.scheduler import BackendCapacity
from qosgate.batch.runner import BatchService
from qosgate.http.app import build_app
from qosgate.http.state import STATE
from qosgate.quotas import QuotaGuard
from qosgate.runtime.gate import Gateway, RequestStream

ALICE_KEY = "test-key-alice"  # tenant alice, tier interactive (from a sha256 in the YAML)
BOB_KEY = "test-key-bob"  # tenant bob, tier batch (from the environment)
SECRET = "front-gateway-secret"
ENV = {"QG_TEST_BOB_KEY": BOB_KEY, "QG_TEST_SECRET": SECRET}
MODEL = "sim-test-model"
MAX_BODY = 64 * 1024
INTERACTIVE_CAP = 16
BATCH_DEFAULT = 8

POLICY_YAML = f"""
version: 1
server:
  max_body_bytes: {MAX_BODY}
  # The hostile corpora send many bad keys from one address; the limit on
  # failed authentications has tests of its own.
  auth_failures_per_minute: 0
  trusted_header_secret_env: QG_TEST_SECRET
backend:
  kind: sim
  speed: 200
  model: {MODEL}
tiers:
  interactive:
    priority: 0
    ttft_slo_ms: 500
    max_queue_wait_ms: 60000
    max_tokens: {INTERACTIVE_CAP}
  batch:
    priority: 2
    max_queue_wait_ms: 60000
    max_tokens: 32
    default_max_tokens: {BATCH_DEFAULT}
tenants:
  - id: alice
    tier: interactive
    api_keys: ["sha256:{hashlib.sha256(ALICE_KEY.encode()).hexdigest()}"]
  - id: bob
    tier: batch
    api_keys: ["env:QG_TEST_BOB_KEY"]
"""


async def assert_still_serves(url: str) -> None:
    """After a run of hostile or fuzzed input: alice's good request completes
    and /readyz says ready."""
    async with aiohttp.ClientSession(headers={"Authorization": f"Bearer {ALICE_KEY}"}) as http:
        async with http.post(
            f"{url}/v1/completions", json={"model": MODEL, "prompt": "hi", "max_tokens": 2}
        ) as response:
            assert response.status == 200, await response.text()
        async with http.get(f"{url}/readyz") as response:
            assert response.status == 200, await response.text()


def make_policy(yaml_text: str = POLICY_YAML) -> PolicyConfig:
    return load_policy_text(yaml_text, "tests/http_support.py")


class RecordingGateway(Gateway):
    """A Gateway that keeps every stream it hands out, so tests can look at the
    request records (outcome, priority) the HTTP layer produced."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.streams: list[RequestStream] = []
        self.submitted = asyncio.Event()
        """Set when a request is admitted."""
        self.aclosed = asyncio.Event()
        """Set when the HTTP layer has closed a stream (its client went away)."""

    def submit(self, **kwargs: Any) -> RequestStream:
        stream = super().submit(**kwargs)
        self.streams.append(stream)
        close = stream.aclose

        async def aclose() -> None:
            await close()
            self.aclosed.set()

        stream.aclose = aclose  # type: ignore[method-assign]
        self.submitted.set()
        return stream


@dataclass
class Live:
    url: str
    """Base URL of the server (no /v1)."""
    gateway: RecordingGateway
    policy: PolicyConfig
    batches: BatchService | None = None
    """The Batch API's service (policies with `batch.data_dir`)."""


@contextlib.asynccontextmanager
async def live_app(
    policy: PolicyConfig | None = None,
    backend: Backend | None = None,
    *,
    quotas: QuotaGuard | None = None,
    policy_path: str | None = None,
    environ: dict[str, str] | None = None,
) -> AsyncIterator[Live]:
    policy = policy or make_policy()
    if backend is None:
        from qosgate.backends import build_backend

        backend = build_backend(policy.backend)
    gateway = RecordingGateway(policy, backend, quotas=quotas)
    await gateway.start()
    # handler_cancellation as `qosgate serve` runs it: a client that leaves
    # cancels its handler.
    app = build_app(gateway, policy, environ=environ or ENV, policy_path=policy_path)
    server = TestServer(app, handler_cancellation=True)
    await server.start_server()
    try:
        yield Live(str(server.make_url("")).rstrip("/"), gateway, policy, app[STATE].batches)
    finally:
        await server.close()
        await gateway.close()


class ScriptedBackend(Backend):
    """Each job runs `script(job)`: an async generator of chunks written by the
    test. Records jobs and aborts; `closed[request_id]` is set when the job's
    stream is closed (finished, aborted, or the client left)."""

    def __init__(
        self,
        script: Callable[[GenerationJob], AsyncIterator[Chunk]],
        *,
        models: tuple[str, ...] = (MODEL,),
        free_slots: int = 8,
    ) -> None:
        self.models = models
        self._script = script
        self.free_slots = free_slots
        self.jobs: list[GenerationJob] = []
        self.aborted: list[str] = []
        self.closed: dict[str, asyncio.Event] = {}
        self._running = 0
        self._listener: Callable[[], None] = lambda: None

    async def start(self) -> None:
        pass

    async def close(self) -> None:
        pass

    def ready(self) -> bool:
        return True

    def capacity(self) -> BackendCapacity:
        return BackendCapacity(max(0, self.free_slots - self._running), 1 << 20, 1 << 20)

    def set_capacity_listener(self, listener: Callable[[], None]) -> None:
        self._listener = listener

    def count_prompt_tokens(self, endpoint: str, body: dict[str, Any]) -> int:
        return 5

    def generate(self, job: GenerationJob) -> AsyncIterator[Chunk]:
        self.jobs.append(job)
        self.closed[job.request_id] = asyncio.Event()
        self._running += 1
        return self._run(job)

    async def _run(self, job: GenerationJob) -> AsyncIterator[Chunk]:
        try:
            async for chunk in self._script(job):
                yield chunk
        finally:
            self._running -= 1
            self.closed[job.request_id].set()
            self._listener()

    def abort(self, request_id: str) -> None:
        self.aborted.append(request_id)


async def words(job: GenerationJob, n: int | None = None) -> AsyncIterator[Chunk]:
    """A well-behaved generation: `n` (default max_tokens) one-token chunks."""
    n = job.max_tokens if n is None else n
    for i in range(n):
        yield Chunk(text=f"w{i} ", tokens=1, finish_reason="length" if i == n - 1 else None)


async def fail_after_one(job: GenerationJob) -> AsyncIterator[Chunk]:
    yield Chunk(text="partial ", tokens=1)
    raise BackendError("the engine fell over")


async def hang_after_one(job: GenerationJob) -> AsyncIterator[Chunk]:
    yield Chunk(text="first ", tokens=1)
    await asyncio.Event().wait()  # until the consumer closes us
    yield Chunk(text="never", tokens=1, finish_reason="stop")


class Served:
    """`qosgate serve` itself (its timeouts and its stop are what some tests
    test) in a task of the test's loop, on a free loopback port. Setting
    `stop` stops it as SIGTERM would; leaving the block does that and waits."""

    WAIT_S = 10.0

    def __init__(
        self,
        policy: PolicyConfig,
        *,
        gateway: Gateway | None = None,
        environ: dict[str, str] | None = None,
    ) -> None:
        self.policy = policy
        self.gateway = gateway
        self.environ = environ or ENV
        self.stop = asyncio.Event()
        self.host = "127.0.0.1"
        self.port = 0
        self.url = ""
        """Base URL of the server (no /v1)."""
        self.task: asyncio.Task[None] | None = None

    async def __aenter__(self) -> Served:
        from qosgate.http.server import serve

        listening = asyncio.Event()

        def ready(api_url: str) -> None:
            self.url = api_url.removesuffix("/v1")
            self.port = int(self.url.rsplit(":", 1)[1])
            listening.set()

        self.task = asyncio.create_task(serve(
            self.policy, self.host, 0, environ=self.environ, on_ready=ready, stop=self.stop,
            gateway=self.gateway,
        ))  # fmt: skip
        async with asyncio.timeout(self.WAIT_S):
            await listening.wait()
        return self

    async def __aexit__(self, *exc: object) -> None:
        self.stop.set()
        assert self.task is not None
        async with asyncio.timeout(self.WAIT_S):
            await self.task
