"""The async runtime: Gateway and RequestStream over a backend, and the live
SimBackend. Nothing here sleeps to wait: tests await the stream or an event
the backend sets; real time passes only inside SimBackend (at high speed)."""

from __future__ import annotations

import asyncio
import random
from collections import Counter

import pytest

from qosgate.backends import build_backend
from qosgate.backends.base import BackendError, BackendUnavailable, GenerationJob
from qosgate.backends.sim import SimEngine
from qosgate.backends.sim_live import SimBackend, filler_text
from qosgate.backends.tokens import estimate_prompt_tokens
from qosgate.config.models import PolicyConfig, SimBackendConfig, VllmBackendConfig
from qosgate.core.request import Outcome, RequestState
from qosgate.runtime import (
    BackendFailed,
    BackendUnavailableError,
    BadRequest,
    Expired,
    Gateway,
    GatewayClosing,
    GatewayError,
    Overloaded,
    QueueFull,
    RequestStream,
)
from tests.fake_backend import FakeBackend

TIERS = {
    "gold": {"priority": 0},
    "silver": {"priority": 1},
    "bronze": {"priority": 2},
}


@pytest.fixture(autouse=True)
async def no_loop_errors():
    """An exception in a loop callback (the dispatcher is one) would otherwise
    only be logged; fail the test instead."""
    loop = asyncio.get_running_loop()
    errors: list[dict] = []
    loop.set_exception_handler(lambda _loop, context: errors.append(context))
    yield
    assert not errors


def make_policy(tiers: dict | None = None, **scheduler) -> PolicyConfig:
    return PolicyConfig.model_validate({"tiers": tiers or TIERS, "scheduler": scheduler})


async def started_gateway(backend, policy: PolicyConfig | None = None, **kw) -> Gateway:
    gw = Gateway(policy or make_policy(), backend, **kw)
    await gw.start()
    return gw


_ids = iter(range(1 << 30))


def submit(gw: Gateway, tier: str = "gold", *, request_id: str | None = None,
           prompt_tokens: int = 10, max_tokens: int = 10, tenant: str = "t") -> RequestStream:
    return gw.submit(
        request_id=request_id or f"r{next(_ids)}", tenant=tenant, tier=tier, endpoint="chat",
        body={"messages": [{"role": "user", "content": "hi"}]},
        prompt_tokens=prompt_tokens, max_tokens=max_tokens,
    )  # fmt: skip


class Consumer:
    """An HTTP handler stand-in: iterates a stream in its own task."""

    def __init__(self, stream: RequestStream) -> None:
        self.stream = stream
        self.chunks = []
        self.error: GatewayError | None = None
        self._chunk = asyncio.Event()
        self.entered = asyncio.Event()
        """Set as the task starts iterating: once a waiter wakes, the task is
        parked inside the stream (the event's wakeup runs after it suspends)."""
        self.task = asyncio.create_task(self._run())

    async def _run(self) -> None:
        try:
            chunks = aiter(self.stream)
            self.entered.set()
            async for chunk in chunks:
                self.chunks.append(chunk)
                self._chunk.set()
        except GatewayError as exc:
            self.error = exc

    async def next_chunk(self) -> None:
        await self._chunk.wait()
        self._chunk.clear()

    async def done(self) -> "Consumer":
        await self.task
        return self


def assert_drained(gw: Gateway) -> None:
    assert gw.scheduler.queued_count == 0
    assert gw.scheduler.running_count == 0
    assert not gw._streams and not gw._reserved and gw._reserved_kv == 0


# -- a request's whole path ----------------------------------------------------


async def test_request_streams_and_completes_on_sim_backend() -> None:
    backend = SimBackend(SimBackendConfig(speed=1000))
    gw = await started_gateway(backend)
    stream = submit(gw, prompt_tokens=50, max_tokens=12)
    chunks = [chunk async for chunk in stream]
    req = stream.request
    assert req.outcome is Outcome.COMPLETED and req.finished
    assert req.output_tokens == 12 and sum(c.tokens for c in chunks) == 12
    assert chunks[-1].finish_reason == "length"
    assert chunks[-1].usage == {"prompt_tokens": 50, "completion_tokens": 12, "total_tokens": 62}
    assert "".join(c.text for c in chunks) == filler_text(0, 12)
    assert req.ttft is not None and req.queue_wait is not None
    assert_drained(gw)
    snap = gw.snapshot()
    assert snap["backend"]["ready"] and snap["running"] == 0
    await gw.close()


async def test_priority_order_across_tiers_when_capacity_is_one() -> None:
    fake = FakeBackend(slots=1)
    gw = await started_gateway(fake)
    blocker = Consumer(submit(gw, "bronze", request_id="blocker"))
    assert await fake.started.get() == "blocker"
    consumers = [Consumer(submit(gw, tier, request_id=f"{tier}{i}"))
                 for i, tier in enumerate(("bronze", "silver", "gold", "silver"))]
    fake.finish("blocker")
    await blocker.done()
    order = []
    for _ in consumers:
        rid = await fake.started.get()
        order.append(rid)
        fake.finish(rid)
    assert order == ["gold2", "silver1", "silver3", "bronze0"]
    for c in consumers:
        await c.done()
        assert c.stream.request.outcome is Outcome.COMPLETED
    assert fake.max_running == 1 and not fake.violations
    assert_drained(gw)


async def test_dispatcher_never_exceeds_capacity() -> None:
    rng = random.Random(3)
    fake = FakeBackend(slots=3)
    gw = await started_gateway(fake)
    consumers = [Consumer(submit(gw, rng.choice(list(TIERS)))) for _ in range(25)]
    finished: set[str] = set()
    for _ in consumers:
        await fake.started.get()
        assert gw.scheduler.running_count <= 3
        # One finish per start keeps exactly one started request unfinished.
        rid = rng.choice([r for r in fake.running if r not in finished])
        finished.add(rid)
        fake.finish(rid)
    for c in consumers:
        await c.done()
        assert c.stream.request.outcome is Outcome.COMPLETED
    assert fake.max_running <= 3 and not fake.violations
    assert_drained(gw)


async def test_preempted_request_restarts_and_completes() -> None:
    tiers = {"gold": {"priority": 0}, "bronze": {"priority": 2, "preemptible": True}}
    fake = FakeBackend(slots=1)
    gw = await started_gateway(fake, make_policy(tiers, preemption=True))
    low = Consumer(submit(gw, "bronze", request_id="low"))
    assert await fake.started.get() == "low"
    high = Consumer(submit(gw, "gold", request_id="high"))
    assert await fake.started.get() == "high"
    assert fake.aborted == ["low"]
    assert low.stream.request.state is RequestState.QUEUED
    fake.finish("high")
    assert await fake.started.get() == "low"
    fake.emit("low", 2)
    fake.finish("low", 1)
    await high.done()
    await low.done()
    assert low.error is None and low.stream.request.outcome is Outcome.COMPLETED
    assert low.stream.request.preemptions == 1
    assert sum(c.tokens for c in low.chunks) == 3 == low.stream.request.output_tokens
    assert_drained(gw)


# -- refusals and expiry ---------------------------------------------------------


async def test_queued_request_expires_at_its_deadline() -> None:
    tiers = {"gold": {"priority": 0}, "fast": {"priority": 1, "max_queue_wait_ms": 1}}
    fake = FakeBackend(slots=1)
    # Admission off: a 1 ms budget is below any wait it would predict.
    gw = await started_gateway(fake, make_policy(tiers, admission=False))
    blocker = Consumer(submit(gw, "gold"))
    await fake.started.get()
    stream = submit(gw, "fast")
    with pytest.raises(Expired) as info:
        async for _ in stream:
            pass
    assert info.value.status == 504 and info.value.outcome is Outcome.EXPIRED
    assert "queued longer than tier 'fast' allows (1 ms)" in str(info.value)
    assert stream.request.outcome is Outcome.EXPIRED
    assert stream.request.id not in {job.request_id for job in fake.jobs}
    fake.finish(blocker.stream.request.id)
    await blocker.done()
    assert_drained(gw)


async def test_queue_full_is_refused_with_retry_after() -> None:
    tiers = {"gold": {"priority": 0, "max_queue_len": 1}}
    fake = FakeBackend(slots=0)
    gw = await started_gateway(fake, make_policy(tiers, admission=False))
    first = submit(gw)
    with pytest.raises(QueueFull) as info:
        submit(gw)
    err = info.value
    assert err.status == 429 and err.outcome is Outcome.REJECTED_QUEUE_FULL
    assert err.retry_after_s is not None and err.retry_after_header is not None
    assert err.body()["error"]["code"] == "queue_full"
    await first.aclose()
    assert first.request.outcome is Outcome.CANCELLED
    assert_drained(gw)


async def test_predicted_overload_is_refused() -> None:
    tiers = {"gold": {"priority": 0, "max_queue_wait_ms": 1000}}
    fake = FakeBackend(slots=0)
    gw = await started_gateway(fake, make_policy(tiers, initial_drain_rate=1.0))
    first = submit(gw, prompt_tokens=100, max_tokens=100)
    with pytest.raises(Overloaded) as info:
        submit(gw, prompt_tokens=100, max_tokens=100)
    assert info.value.status == 503 and info.value.outcome is Outcome.REJECTED_OVERLOAD
    assert info.value.retry_after_s > 0
    await first.aclose()
    assert_drained(gw)


async def test_a_queued_request_whose_place_is_taken_is_answered_503_once() -> None:
    # No free slot and 100 tokens/s: two requests of 200 tokens (with the
    # newcomer's own slot's wait) fill the 4 s budget. Tenant a sends first;
    # b's newcomer takes the place of a's newest.
    tiers = {"gold": {"priority": 0, "max_queue_wait_ms": 4000}}
    fake = FakeBackend(slots=0)
    gw = await started_gateway(fake, make_policy(tiers, initial_drain_rate=100.0))
    older, newer = (Consumer(submit(gw, prompt_tokens=100, max_tokens=100, tenant="a"))
                    for _ in range(2))
    await asyncio.gather(older.entered.wait(), newer.entered.wait())
    with pytest.raises(Overloaded):
        submit(gw, prompt_tokens=100, max_tokens=100, tenant="a")
    light = submit(gw, prompt_tokens=100, max_tokens=100, tenant="b")
    await newer.done()
    err = newer.error
    assert isinstance(err, Overloaded) and err.status == 503
    assert err.outcome is Outcome.REJECTED_OVERLOAD is newer.stream.request.outcome
    assert err.retry_after_header == "4" and "its place went to a tenant" in str(err)
    assert older.stream.request.state is RequestState.QUEUED
    assert light.request.state is RequestState.QUEUED
    await older.stream.aclose()
    await older.done()
    await light.aclose()
    assert_drained(gw)


async def test_prompt_that_can_never_fit_is_a_bad_request() -> None:
    fake = FakeBackend(slots=1, kv_tokens=100)
    gw = await started_gateway(fake)
    stream = submit(gw, prompt_tokens=500)
    with pytest.raises(BadRequest) as info:
        async for _ in stream:
            pass
    assert info.value.param == "messages" and stream.request.outcome is Outcome.BAD_REQUEST
    assert not fake.jobs
    assert_drained(gw)


# -- the client going away -------------------------------------------------------


async def test_cancel_while_queued_leaves_the_queue_at_once() -> None:
    fake = FakeBackend(slots=1)
    gw = await started_gateway(fake)
    blocker = Consumer(submit(gw))
    await fake.started.get()
    queued = submit(gw, request_id="queued")
    waiting = Consumer(submit(gw, request_id="waiting"))
    await waiting.entered.wait()
    assert gw.scheduler.queued_count == 2
    await queued.aclose()
    await waiting.stream.aclose()  # from outside the consumer's task, while it awaits dispatch
    assert gw.scheduler.queued_count == 0
    assert queued.request.outcome is waiting.stream.request.outcome is Outcome.CANCELLED
    await waiting.done()
    assert waiting.error is None and waiting.chunks == []
    await queued.aclose()  # idempotent
    fake.finish(blocker.stream.request.id)
    await blocker.done()
    assert {job.request_id for job in fake.jobs}.isdisjoint({"queued", "waiting"})
    assert_drained(gw)


async def test_cancel_while_running_aborts_the_backend() -> None:
    fake = FakeBackend(slots=1)
    gw = await started_gateway(fake)
    c = Consumer(submit(gw, request_id="r"))
    await fake.started.get()
    fake.emit("r", 3)
    await c.next_chunk()
    await c.stream.aclose()
    await c.done()
    assert fake.aborted == ["r"] and c.error is None
    req = c.stream.request
    assert req.outcome is Outcome.CANCELLED and req.output_tokens == 3
    assert_drained(gw)


async def test_consumer_breaking_out_and_closing_aborts() -> None:
    fake = FakeBackend(slots=1)
    gw = await started_gateway(fake)
    stream = submit(gw, request_id="r")
    chunks = aiter(stream)
    nxt = asyncio.ensure_future(anext(chunks))
    await fake.started.get()
    fake.emit("r")
    assert (await nxt).tokens == 1
    await stream.aclose()
    assert fake.aborted == ["r"] and stream.request.outcome is Outcome.CANCELLED
    assert_drained(gw)


@pytest.mark.parametrize("where", ["queued", "running"])
async def test_consumer_task_cancelled_mid_iteration(where: str) -> None:
    fake = FakeBackend(slots=1)
    gw = await started_gateway(fake)
    blocker = None
    if where == "queued":
        blocker = Consumer(submit(gw))
        await fake.started.get()
    c = Consumer(submit(gw, request_id="r"))
    await c.entered.wait()
    if where == "running":
        await fake.started.get()
        fake.emit("r")
        await c.next_chunk()
    c.task.cancel()
    with pytest.raises(asyncio.CancelledError):
        await c.task
    assert c.stream.request.outcome is Outcome.CANCELLED
    if where == "running":
        assert fake.aborted == ["r"]
    else:
        assert gw.scheduler.queued_count == 0 and "r" not in {j.request_id for j in fake.jobs}
        fake.finish(blocker.stream.request.id)
        await blocker.done()
    assert_drained(gw)


async def test_consumer_cancelled_as_it_is_dispatched() -> None:
    fake = FakeBackend(slots=1)
    gw = await started_gateway(fake)
    blocker = Consumer(submit(gw, request_id="blocker"))
    await fake.started.get()
    c = Consumer(submit(gw, request_id="r"))
    await c.entered.wait()
    # Room frees (the dispatcher is scheduled to run) and, before it runs, the
    # waiting consumer is cancelled: the dispatcher hands the request over to a
    # consumer that is already on its way out.
    fake.abort("blocker")
    c.task.cancel()
    with pytest.raises(asyncio.CancelledError):
        await c.task
    await blocker.done()
    assert c.stream.request.outcome is Outcome.CANCELLED
    assert c.stream.request.dispatched_at is not None and "r" not in fake.running
    assert_drained(gw)


# -- backend trouble ----------------------------------------------------------------


async def test_backend_error_fails_the_request() -> None:
    fake = FakeBackend(slots=1)
    gw = await started_gateway(fake)
    c = Consumer(submit(gw, request_id="r"))
    await fake.started.get()
    fake.emit("r", 2)
    fake.fail("r", BackendError("GPU fell off the bus"))
    await c.done()
    assert isinstance(c.error, BackendFailed) and c.error.status == 502
    assert "GPU fell off" in c.error.message
    req = c.stream.request
    assert req.outcome is Outcome.BACKEND_ERROR and req.output_tokens == 2
    assert_drained(gw)


async def test_backend_unavailable_mid_stream_and_at_start() -> None:
    fake = FakeBackend(slots=1)
    gw = await started_gateway(fake)
    c = Consumer(submit(gw, request_id="a"))
    await fake.started.get()
    fake.fail("a", BackendUnavailable("draining", retry_after_s=3.0))
    await c.done()
    assert isinstance(c.error, BackendUnavailableError) and c.error.retry_after_s == 3.0
    assert c.stream.request.outcome is Outcome.BACKEND_ERROR

    fake.unavailable = True
    stream = submit(gw, request_id="b")
    with pytest.raises(BackendUnavailableError) as info:
        async for _ in stream:
            pass
    assert info.value.status == 503 and info.value.retry_after_header == "7"
    assert stream.request.outcome is Outcome.BACKEND_ERROR
    assert_drained(gw)


async def test_requests_wait_for_a_backend_that_is_not_ready() -> None:
    fake = FakeBackend(slots=1, ready=False)
    gw = await started_gateway(fake)
    assert not gw.ready()
    c = Consumer(submit(gw, request_id="r"))
    assert fake.started.empty() and gw.scheduler.queued_count == 1
    fake.set_ready(True)
    assert await fake.started.get() == "r"
    fake.finish("r")
    await c.done()
    assert c.stream.request.outcome is Outcome.COMPLETED
    assert_drained(gw)


async def test_request_whose_budget_runs_out_on_a_down_backend_gets_503() -> None:
    tiers = {"gold": {"priority": 0, "max_queue_wait_ms": 1}}
    fake = FakeBackend(slots=1, ready=False)
    gw = await started_gateway(fake, make_policy(tiers))
    stream = submit(gw)
    with pytest.raises(BackendUnavailableError) as info:
        async for _ in stream:
            pass
    assert info.value.status == 503 and info.value.retry_after_s
    assert stream.request.outcome is Outcome.BACKEND_ERROR and not fake.jobs
    assert_drained(gw)


async def test_a_backend_gone_for_good_ends_queued_requests_and_refuses_new_ones() -> None:
    fake = FakeBackend(slots=1)
    gw = await started_gateway(fake)
    running = Consumer(submit(gw))
    running_id = await fake.started.get()
    queued = Consumer(submit(gw))
    await queued.entered.wait()
    fake.gone_error = BackendUnavailable("the engine died", retry_after_s=5.0)
    fake._notify()  # as a backend does when it learns of its death
    await queued.done()
    assert isinstance(queued.error, BackendUnavailableError)
    assert queued.error.retry_after_s == 5.0
    assert queued.stream.request.outcome is Outcome.BACKEND_ERROR
    with pytest.raises(BackendUnavailableError, match="engine died"):
        submit(gw)
    fake.fail(running_id, BackendUnavailable("the engine died", retry_after_s=5.0))
    await running.done()
    assert running.stream.request.outcome is Outcome.BACKEND_ERROR
    assert_drained(gw)
    await gw.close()


async def test_close_ends_every_request_with_an_outcome() -> None:
    fake = FakeBackend(slots=1)
    gw = await started_gateway(fake)
    running = Consumer(submit(gw, "bronze"))
    await fake.started.get()
    fake.emit(running.stream.request.id)
    await running.next_chunk()
    queued = [Consumer(submit(gw, tier)) for tier in ("gold", "silver")]
    never_iterated = submit(gw, "bronze")
    await gw.close()
    for c in [running, *queued]:
        await c.done()
        assert isinstance(c.error, GatewayClosing) and c.error.status == 503
        assert c.stream.request.outcome is Outcome.CANCELLED
    assert never_iterated.request.outcome is Outcome.CANCELLED
    assert fake.closed and fake.aborted == [running.stream.request.id]
    assert_drained(gw)
    with pytest.raises(GatewayClosing):
        submit(gw)


# -- the invariant -------------------------------------------------------------------


@pytest.mark.parametrize("seed", range(6))
async def test_every_request_ends_with_exactly_one_outcome(seed: int) -> None:
    rng = random.Random(seed)
    tiers = {
        "gold": {"priority": 0},
        "silver": {"priority": 1, "max_queue_wait_ms": 3},
        "bronze": {"priority": 2, "preemptible": True, "max_queue_len": 30},
        "batch": {"priority": 3, "on_timeout": "delay", "max_queue_wait_ms": 5,
                  "batch": {"max_wait_ms": 2, "max_batch_size": 4}},
    }  # fmt: skip
    # A high drain-rate prior lets admission through what then waits, so some expire.
    policy = make_policy(tiers, preemption=True, initial_drain_rate=1e6,
                         aging={"interval_ms": 3, "max_boost": 2})
    backend = SimBackend(SimBackendConfig(
        speed=200, max_num_seqs=4, kv_capacity_tokens=4000, output_median_tokens=20
    ))  # fmt: skip
    gw = await started_gateway(backend, policy)

    # Every way a request can end, counted per request id at the scheduler.
    endings: Counter[str] = Counter()
    scheduler = gw.scheduler
    real_finish, real_cancel, real_schedule = scheduler.finish, scheduler.cancel, scheduler.schedule

    def finish(req_id, *args):
        endings[req_id] += 1
        return real_finish(req_id, *args)

    def cancel(req_id, *args):
        req, running = real_cancel(req_id, *args)
        if req is not None and not running:  # a running one ends through finish()
            endings[req_id] += 1
        return req, running

    def schedule(*args, **kwargs):
        plan = real_schedule(*args, **kwargs)
        for req in (*plan.expired, *plan.failed):
            endings[req.id] += 1
        return plan

    scheduler.finish, scheduler.cancel, scheduler.schedule = finish, cancel, schedule

    n = 150
    requests = []
    errors: Counter[str] = Counter()
    # Later clients arrive when earlier ones make progress, so arrivals spread
    # over the run (and meet running work to preempt) without any sleeping.
    progressed = [asyncio.Event() for _ in range(n)]

    async def client(i: int) -> None:
        try:
            if i >= 40:
                await progressed[i - 40].wait()
            prompt = 5000 if rng.random() < 0.03 else rng.randint(1, 400)
            try:
                stream = submit(gw, rng.choice(list(tiers)), request_id=f"q{i}",
                                prompt_tokens=prompt, max_tokens=rng.randint(1, 60))
            except (QueueFull, Overloaded) as exc:
                errors[type(exc).__name__] += 1
                endings[f"q{i}"] += 1
                return
            requests.append(stream.request)
            if rng.random() < 0.1:
                # Cut off by its own task being cancelled, wherever it then is.
                asyncio.get_running_loop().call_soon(asyncio.current_task().cancel)
            plan = rng.random()
            if plan < 0.1:
                await stream.aclose()
                return
            stop_after = rng.randint(1, 10) if plan < 0.4 else None
            got = 0
            try:
                async for _ in stream:
                    progressed[i].set()
                    got += 1
                    if got == stop_after:
                        break
            except GatewayError as exc:
                errors[type(exc).__name__] += 1
            finally:
                await stream.aclose()
        finally:
            progressed[i].set()

    tasks = [asyncio.create_task(client(i)) for i in range(n)]
    results = await asyncio.gather(*tasks, return_exceptions=True)
    assert all(r is None or isinstance(r, asyncio.CancelledError) for r in results)

    assert len(endings) == n and set(endings.values()) == {1}
    for req in requests:
        assert req.finished and req.outcome is not None
    outcomes = Counter(r.outcome for r in requests)
    assert outcomes[Outcome.COMPLETED] and outcomes[Outcome.CANCELLED]
    assert_drained(gw)
    await gw.close()
    assert not backend.engine.has_work() and not backend._live


# -- SimBackend ---------------------------------------------------------------------


def job(request_id: str, prompt: int = 20, max_tokens: int = 10, priority: int = 0) -> GenerationJob:
    return GenerationJob(request_id, "chat", {}, prompt, max_tokens, priority)


async def run_sim(backend: SimBackend, j: GenerationJob) -> list:
    return [chunk async for chunk in backend.generate(j)]


async def test_sim_tokens_arrive_in_order_with_usage() -> None:
    backend = SimBackend(SimBackendConfig(speed=1000))
    await backend.start()
    results = await asyncio.gather(*(run_sim(backend, job(f"s{i}", 30 + i, 5 + 3 * i))
                                     for i in range(4)))
    for i, chunks in enumerate(results):
        n = 5 + 3 * i
        assert "".join(c.text for c in chunks) == filler_text(0, n)
        assert [c.finish_reason for c in chunks[:-1]] == [None] * (len(chunks) - 1)
        assert chunks[-1].finish_reason == "length"
        assert chunks[-1].usage == {"prompt_tokens": 30 + i, "completion_tokens": n,
                                    "total_tokens": 30 + i + n}
        assert sum(c.tokens for c in chunks) == n
    assert backend.capacity().free_slots == backend.engine.max_num_seqs
    await backend.close()


async def test_sim_engine_preemption_does_not_repeat_tokens() -> None:
    # Three sequences that outgrow a small KV cache while decoding: the engine
    # preempts and recomputes, and the client must still see each token once.
    backend = SimBackend(SimBackendConfig(speed=1000, kv_capacity_tokens=300))
    await backend.start()
    results = await asyncio.gather(*(run_sim(backend, job(f"p{i}", 50, 80)) for i in range(3)))
    assert backend.engine_preemptions > 0
    for chunks in results:
        assert "".join(c.text for c in chunks) == filler_text(0, 80)
        assert chunks[-1].usage["completion_tokens"] == 80
    await backend.close()


async def test_sim_output_lengths_follow_the_median_deterministically() -> None:
    cfg = SimBackendConfig(speed=1000, output_median_tokens=8)
    backend = SimBackend(cfg)
    await backend.start()
    lengths = {}
    for i in range(12):
        chunks = await run_sim(backend, job(f"m{i}", max_tokens=40))
        usage = chunks[-1].usage
        n = usage["completion_tokens"]
        assert n == backend.output_length(f"m{i}", 40) == SimBackend(cfg).output_length(f"m{i}", 40)
        assert sum(c.tokens for c in chunks) == n and 1 <= n <= 40
        assert chunks[-1].finish_reason == ("length" if n == 40 else "stop")
        lengths[i] = n
    assert len(set(lengths.values())) > 3 and min(lengths.values()) < 40
    assert backend.output_length("x", 5) <= 5
    await backend.close()


async def test_sim_speed_scales_real_time() -> None:
    engine = SimEngine.from_config(SimBackendConfig())
    engine.add("x", 200, 30)
    modelled = 0.0
    while engine.has_work():
        modelled += engine.step().duration
    loop = asyncio.get_running_loop()
    elapsed = {}
    for speed in (4.0, 1000.0):
        backend = SimBackend(SimBackendConfig(speed=speed))
        await backend.start()
        t0 = loop.time()
        await run_sim(backend, job("x", 200, 30))
        elapsed[speed] = loop.time() - t0
        await backend.close()
    # asyncio.sleep never returns early beyond the clock's resolution.
    assert elapsed[4.0] >= modelled / 4.0 * 0.99
    assert elapsed[4.0] < modelled / 4.0 + 1.0
    assert elapsed[1000.0] < elapsed[4.0]


async def test_sim_abort_frees_capacity_and_notifies() -> None:
    backend = SimBackend(SimBackendConfig(speed=1000, max_num_seqs=2))
    notified = asyncio.Event()
    backend.set_capacity_listener(notified.set)
    await backend.start()
    full = backend.capacity()
    gen = backend.generate(job("long", 100, 100_000 - 100))
    assert backend.capacity().free_slots == full.free_slots - 1
    first = await anext(gen)
    assert first.tokens >= 1
    notified.clear()
    backend.abort("long")
    assert notified.is_set()
    assert backend.capacity() == full and not backend.engine.has_work()
    with pytest.raises(StopAsyncIteration):
        await anext(gen)
    backend.abort("long")  # idempotent

    # Closing the stream early aborts too.
    gen = backend.generate(job("closed", 100, 100_000 - 100))
    await anext(gen)
    notified.clear()
    await gen.aclose()
    assert notified.is_set() and backend.capacity() == full

    # A step that finishes a sequence tells the listener.
    notified.clear()
    await run_sim(backend, job("short", 10, 3))
    assert notified.is_set()
    await backend.close()


async def test_sim_not_running_and_close() -> None:
    backend = SimBackend(SimBackendConfig(speed=1000))
    with pytest.raises(BackendUnavailable):
        backend.generate(job("a"))
    await backend.start()
    assert backend.ready() and backend.models == ("sim-llama3-8b",)
    gen = backend.generate(job("a", 10, 10_000))
    await anext(gen)
    await backend.close()
    assert not backend.ready()
    with pytest.raises(BackendUnavailable):
        async for _ in gen:
            pass
    assert not backend.engine.has_work()


def test_prompt_token_estimate() -> None:
    chat = {"messages": [{"role": "system", "content": "x" * 40},
                         {"role": "user", "content": [{"type": "text", "text": "y" * 9}]}]}
    assert estimate_prompt_tokens("chat", chat) == 13 + 2 * 4  # ceil(49 / 4) + framing
    assert estimate_prompt_tokens("completions", {"prompt": "abcd" * 5}) == 5
    assert estimate_prompt_tokens("chat", {"messages": []}) == 1
    # Both backends use this one estimate.
    sim = SimBackend(SimBackendConfig())
    assert sim.count_prompt_tokens("chat", chat) == estimate_prompt_tokens("chat", chat)


def test_build_backend() -> None:
    from qosgate.backends.vllm import VllmBackend

    assert isinstance(build_backend(SimBackendConfig()), SimBackend)
    vllm = build_backend(VllmBackendConfig(model="/models/tiny", served_model_name="tiny"))
    assert isinstance(vllm, VllmBackend) and vllm.models == ("tiny",)
    assert vllm.engine_args()["scheduling_policy"] == "priority"


class LearnsItsStep(FakeBackend):
    """A backend that knows its engine's tokens per step only once it is up,
    as a vllm engine left at its own default does."""

    step: int | None = None

    @property
    def step_tokens(self) -> int | None:
        return self.step


@pytest.mark.parametrize(("in_order", "budget"), [(False, 1024), (True, 256)])
async def test_an_engine_that_learns_its_step_once_up_gets_its_automatic_prefill_budget(
    in_order: bool, budget: int,
) -> None:
    """Four of its steps; one where its engine may take its queue in arrival
    order (an upstream server, which learns its step from its metrics)."""
    backend = LearnsItsStep()
    backend.arrival_order_queue = in_order
    gw = await started_gateway(backend)
    try:
        assert gw.scheduler.policy.prefill_budget_tokens is None
        backend.step = 256
        backend._notify()  # the engine is up: capacity may have grown
        stream = submit(gw, "silver")
        consumer = Consumer(stream)
        assert await backend.started.get() == stream.request.id
        assert gw.scheduler.policy.prefill_budget_tokens == budget
        assert gw.scheduler.policy.delay_prefill_tokens == budget
        backend.finish(stream.request.id)
        await consumer.task
    finally:
        await gw.close()


async def test_vllm_backend_without_vllm_says_how_to_install_it() -> None:
    try:
        import vllm  # noqa: F401
    except ImportError:
        pass
    else:
        pytest.skip("vLLM is installed here; tests/vllm_engine/ covers the real engine")
    from qosgate.backends.vllm import VllmBackend

    backend = VllmBackend(VllmBackendConfig(model="/models/tiny"))
    await backend.start()
    with pytest.raises(BackendError, match=r"qosgate\[vllm\]"):
        await backend.wait_ready()
    assert not backend.ready()
    await backend.close()


async def test_the_gateway_counts_an_automatic_prefill_budget_in_its_engines_steps() -> None:
    sim = SimBackend(SimBackendConfig(speed=1000, max_num_batched_tokens=256))
    auto = make_policy(prefill_budget_tokens="auto")
    assert Gateway(auto, sim).scheduler.policy.prefill_budget_tokens == 1024
    # A backend whose step is not known gets none; auto is the default; null sets none.
    assert Gateway(auto, FakeBackend()).scheduler.policy.prefill_budget_tokens is None
    assert Gateway(make_policy(), sim).scheduler.policy.prefill_budget_tokens == 1024
    assert Gateway(make_policy(prefill_budget_tokens=None),
                   sim).scheduler.policy.prefill_budget_tokens is None
    # A simulated engine that takes its queue first come, first served: one step.
    fcfs = SimBackend(SimBackendConfig(speed=1000, max_num_batched_tokens=256,
                                       scheduling_policy="fcfs"))
    assert Gateway(auto, fcfs).scheduler.policy.prefill_budget_tokens == 256
