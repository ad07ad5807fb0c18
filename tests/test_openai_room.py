"""The openai backend's room per upstream, learned from the engine's metrics
(vLLM's running and waiting requests, KV usage), and the engine priority
forwarded as `priority`: against stub upstreams on loopback ports
(upstream_support.EngineUpstream serves /metrics as vLLM does)."""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import AsyncIterator
from typing import Any

import aiohttp
import pytest
from aiohttp import web
from http_support import ALICE_KEY, BOB_KEY, MODEL, POLICY_YAML, live_app, make_policy
from upstream_support import EngineUpstream, FakeUpstream

from qosgate.backends.base import BackendRejected, BackendUnavailable, GenerationJob
from qosgate.backends.openai import OpenAIBackend, _engine_report, _Room
from qosgate.config.models import OpenAIBackendConfig
from qosgate.core.ordering import PROMPT_CLASSES

# A guard against a hang, never a wait: every await below ends on an event.
LIMIT_S = 10.0

VLLM_PAGE = """\
# HELP vllm:num_requests_running Number of requests in model execution batches.
# TYPE vllm:num_requests_running gauge
vllm:num_requests_running{engine="0",model_name="tiny"} 30.0
vllm:num_requests_running{engine="1",model_name="tiny"} 2.0
# TYPE vllm:num_requests_waiting gauge
vllm:num_requests_waiting{engine="0",model_name="tiny"} 3.0
vllm:num_requests_waiting{engine="1",model_name="tiny"} 0.0
# TYPE vllm:num_requests_waiting_by_reason gauge
vllm:num_requests_waiting_by_reason{engine="0",model_name="tiny",reason="capacity"} 3.0
# TYPE vllm:kv_cache_usage_perc gauge
vllm:kv_cache_usage_perc{engine="0",model_name="tiny"} 0.25
vllm:kv_cache_usage_perc{engine="1",model_name="tiny"} 0.5
# TYPE vllm:e2e_request_latency_seconds histogram
vllm:e2e_request_latency_seconds_bucket{engine="0",le="0.3",model_name="tiny"} 1.0
vllm:e2e_request_latency_seconds_count{engine="0",model_name="tiny"} 1.0
"""


def test_a_vllm_page_reads_as_its_engines_summed():
    assert _engine_report(VLLM_PAGE) == (32, 3, 0.5, None, None)
    # vLLM before 0.10 named KV usage for the GPU; a page without it is still read.
    old = VLLM_PAGE.replace("kv_cache_usage_perc", "gpu_cache_usage_perc")
    assert _engine_report(old) == (32, 3, 0.5, None, None)
    no_kv = "\n".join(line for line in VLLM_PAGE.splitlines() if "kv_cache" not in line)
    assert _engine_report(no_kv) == (32, 3, None, None, None)
    # The server's process start time, which a restart moves.
    started = VLLM_PAGE + "# TYPE process_start_time_seconds gauge\nprocess_start_time_seconds 1.7e+09\n"
    assert _engine_report(started) == (32, 3, 0.5, 1.7e9, None)
    assert _engine_report(started.replace("1.7e+09", "NaN")) == (32, 3, 0.5, None, None)


def steps_page(*engines: dict[str, float]) -> str:
    """VLLM_PAGE with a tokens-per-step histogram per engine (cumulative
    counts by bound), among the other histograms' buckets."""
    lines = ["# TYPE vllm:iteration_tokens_total histogram"]
    for engine, buckets in enumerate(engines):
        for bound, count in buckets.items():
            lines.append(f'vllm:iteration_tokens_total_bucket{{engine="{engine}",le="{bound}",'
                         f'model_name="tiny"}} {count}')
        lines.append(f'vllm:iteration_tokens_total_count{{engine="{engine}",model_name="tiny"}} '
                     f'{buckets.get("+Inf", 0.0)}')
    return VLLM_PAGE + "\n".join(lines) + "\n"


def test_the_largest_step_is_read_from_the_tokens_per_step_histogram():
    """vLLM counts the tokens of each engine step in power-of-two buckets,
    which its step budgets (max_num_batched_tokens) are too: the smallest
    bound that holds every step is the budget, once a step has filled it."""
    up_to = lambda *counts: dict(zip(  # noqa: E731
        ("1.0", "8.0", "512.0", "1024.0", "2048.0", "16384.0", "+Inf"), counts))
    # Steps of up to 2048 tokens (one engine), and of up to 1024 (the other).
    page = steps_page(up_to(0, 4, 9, 9, 12, 12, 12), up_to(1, 3, 5, 7, 7, 7, 7))
    assert _engine_report(page).step == 2048
    # Only decodes so far: steps of at most 8 tokens.
    assert _engine_report(steps_page(up_to(2, 6, 6, 6, 6, 6, 6))).step == 8
    # No step yet: every bucket 0, so unknown.
    assert _engine_report(steps_page(up_to(0, 0, 0, 0, 0, 0, 0))).step is None
    # A step past the last finite bound: how large is not known.
    assert _engine_report(steps_page(up_to(0, 0, 1, 1, 1, 1, 2))).step is None
    # A server that does not show the histogram.
    assert _engine_report(VLLM_PAGE).step is None


@pytest.mark.parametrize("page", [
    "",
    "# TYPE process_cpu_seconds_total counter\nprocess_cpu_seconds_total 3.5\n",
    "vllm:num_requests_running 3\n",  # no waiting: not what the rule needs
    "<html>not found</html>",
    "vllm:num_requests_running{ 3\nvllm:num_requests_waiting 1\n",
])  # fmt: skip
def test_a_page_without_both_counts_reads_as_none(page):
    assert _engine_report(page) is None


def test_the_room_grows_until_requests_wait_then_holds_there():
    room = _Room(bound=1024, high_water=0.9)
    assert room.limit == 4
    # Nothing waits while the gateway uses its room: it grows by half.
    room.report(running=4, waiting=0, kv=0.1, in_flight=4)
    assert room.limit == 6
    room.report(running=6, waiting=0, kv=0.1, in_flight=6)
    assert room.limit == 9
    # One waits beyond the most the engine ever ran (8): the room drops by it.
    room.report(running=8, waiting=1, kv=0.1, in_flight=9)
    assert room.limit == 8
    # From then on, a 32nd (at least one) a report while nothing waits.
    room.report(running=8, waiting=0, kv=0.1, in_flight=8)
    assert room.limit == 9
    # Not using its room: no growth.
    room.report(running=3, waiting=0, kv=0.1, in_flight=3)
    assert room.limit == 9
    # Waiting while fewer than the engine's most run: it is taking in a
    # burst a step at a time, not full. Nothing changes.
    room.report(running=4, waiting=3, kv=0.1, in_flight=9)
    assert room.limit == 9
    # Requests the engine finished, still streaming through its API server,
    # count in the gateway's room, not the engine's: the room covers them.
    room.report(running=8, waiting=0, kv=0.1, in_flight=9)
    room.report(running=8, waiting=0, kv=0.1, in_flight=10)
    assert room.limit == 11
    # But what was sent must have reached the engine before more is: an API
    # server that lags shows fewer there.
    room.report(running=5, waiting=0, kv=0.1, in_flight=11)
    assert room.limit == 11
    # KV at the high-water mark holds it at what does not wait.
    room.report(running=5, waiting=0, kv=0.95, in_flight=5)
    assert room.limit == 5


def test_the_room_grows_past_the_slots_held_for_the_top_level():
    """The gateway keeps `held` slots of the room free for top-level work
    (the scheduler's reserve): other work never takes them. Counted as used,
    the room grows to what the engine runs; counted as unused, it stayed at
    its start, below the reserve, and nothing but top-level work was sent."""
    for held in (0, 2, 8, 40):
        room = _Room(bound=1024, high_water=0.9)
        seen = []
        for _ in range(60):
            # A backlog below the top level: it takes all but the held slots
            # of an engine that runs 64.
            in_flight = max(0, room.limit - held)
            running = min(in_flight, 64)
            seen.append((running, in_flight - running))
            room.report(running=running, waiting=in_flight - running, kv=0.1,
                        in_flight=in_flight, held=held)
        late = seen[-20:]
        # The engine is filled, and its queue holds at most one step of growth.
        assert max(running for running, _ in late) == 64, (held, late)
        assert max(waiting for _, waiting in late) <= 64 // 32 + 1, (held, late)
        assert min(running for running, _ in late) >= 64 - held - 64 // 32 - 1, (held, late)
    # Unused room that is not held is still not grown into.
    idle = _Room(bound=1024, high_water=0.9)
    for _ in range(10):
        idle.report(running=0, waiting=0, kv=0.0, in_flight=0, held=0)
    assert idle.limit == 4


def test_another_clients_requests_take_room_and_the_bound_holds():
    room = _Room(bound=1024, high_water=0.9)
    room.report(running=8, waiting=2, kv=0.1, in_flight=4)
    # 10 there, 4 of them the gateway's: the engine runs 8, 6 are others'.
    assert room.limit == 2
    capped = _Room(bound=3, high_water=0.9)
    assert capped.limit == 3
    for _ in range(5):
        capped.report(running=3, waiting=0, kv=0.0, in_flight=3)
    assert capped.limit == 3


# -- the whole gateway in front of an engine ---------------------------------------


async def stream(http: aiohttp.ClientSession, url: str, key: str, prompt: str) -> str:
    async with http.post(
        url + "/v1/completions",
        headers={"Authorization": f"Bearer {key}"},
        json={"model": MODEL, "prompt": prompt, "max_tokens": 4, "stream": True},
    ) as response:
        assert response.status == 200, await response.text()
        return await response.text()


@pytest.mark.parametrize("learn", [True, False])
async def test_the_backlog_waits_in_the_gateway_and_interactive_overtakes_batch(learn):
    """An engine with 4 slots, 20 batch requests, then one interactive. With
    the room learned, the engine's queue holds only the learning overshoot
    (2), nothing more is sent until as many have finished, and the
    interactive request is the next to start after them; with a fixed cap
    above the engine's slots (learn_room false), every batch request waits
    in the engine's first-come queue, ahead of it."""
    engine = EngineUpstream(slots=4, models=(MODEL,))
    await engine.start()
    backend = OpenAIBackend(OpenAIBackendConfig(
        upstreams=[{"url": engine.url, "learn_room": learn}],
        health_interval_s=3600.0, metrics_interval_s=3600.0,
    ))  # fmt: skip
    report = backend._read_all_metrics  # one metrics read, when the test says
    try:
        async with asyncio.timeout(LIMIT_S), live_app(backend=backend) as live, \
                aiohttp.ClientSession() as http:  # fmt: skip
            batch = [asyncio.create_task(stream(http, live.url, BOB_KEY, f"batch {i}"))
                     for i in range(20)]  # fmt: skip
            if learn:
                # The first room: 4 (the engine's slots, by chance).
                await engine.until(lambda: len(engine.started) == 4)
                # Nothing waits and the room is used: it grows by half...
                await report()
                await engine.until(lambda: len(engine.queue) == 2)
                # ... and two wait: the room drops by them.
                await report()
                assert backend.capacity().free_slots == 0
            else:
                await engine.until(lambda: len(engine.started) + len(engine.queue) == 20)
            live.gateway.submitted.clear()
            interactive = asyncio.create_task(stream(http, live.url, ALICE_KEY, "interactive"))
            await live.gateway.submitted.wait()
            assert engine.turns is not None
            for _ in range(21):
                engine.turns.release()
            await asyncio.gather(interactive, *batch)
    finally:
        await engine.stop()
    order = [body["prompt"] for body in engine.started]
    assert len(order) == 21
    if learn:
        assert engine.max_waiting == 2
        # The 4 that ran, the 2 the engine held, then interactive: ahead of 14 batch.
        assert order.index("interactive") == 6
    else:
        assert engine.max_waiting == 16
        assert order.index("interactive") == 20
    # Each request's priority went with it (the stub takes it): its tier's
    # level (interactive 0, batch 2), then its prompt's size class.
    priorities = {body["prompt"]: body.get("priority") for body in engine.started}
    assert 0 < priorities["interactive"] < PROMPT_CLASSES
    assert all(2 * PROMPT_CLASSES < priorities[f"batch {i}"] < 3 * PROMPT_CLASSES
               for i in range(20))


@contextlib.asynccontextmanager
async def behind_a_reserve(
    slots: int, reserve: int, requests: int
) -> AsyncIterator[tuple[EngineUpstream, OpenAIBackend, list[asyncio.Task[str]]]]:
    """The gateway with `scheduler.reserve.slots: reserve` in front of an
    engine that runs `slots` at once, its metrics read when the test says,
    and `requests` batch requests sent to it: the engine, the backend and
    the requests' tasks."""
    engine = EngineUpstream(slots=slots, models=(MODEL,))
    await engine.start()
    policy = make_policy(POLICY_YAML + f"scheduler:\n  reserve: {{slots: {reserve}}}\n")
    backend = OpenAIBackend(OpenAIBackendConfig(
        upstreams=[{"url": engine.url}], health_interval_s=3600.0, metrics_interval_s=3600.0,
    ))  # fmt: skip
    try:
        async with asyncio.timeout(LIMIT_S), live_app(policy, backend) as live, \
                aiohttp.ClientSession() as http:  # fmt: skip
            yield engine, backend, [
                asyncio.create_task(stream(http, live.url, BOB_KEY, f"batch {i}"))
                for i in range(requests)
            ]  # fmt: skip
    finally:
        await engine.stop()


async def test_a_reserve_for_interactive_does_not_keep_the_room_from_growing():
    """`scheduler.reserve` keeps 2 slots free for interactive: batch requests
    leave them, and the learned room grows past them to the engine's 8 slots.
    When the held slots counted as unused room, the room stayed at its start
    (4): 2 batch requests ran at a time, whatever the engine could take."""
    async with behind_a_reserve(slots=8, reserve=2, requests=30) as (engine, backend, batch):
        room = backend._upstreams[0].room
        # Each report, the room grows until the engine's queue shows its
        # limit; batch takes all of it but the 2 held slots.
        while not engine.queue:
            sent = room.limit - 2
            await engine.until(lambda: engine.running + len(engine.queue) == sent)
            await backend._read_all_metrics()
        assert engine.running == 8
        await backend._read_all_metrics()
        # The room is the engine's slots; its queue holds the last step of
        # growth, which showed where they end.
        assert room.limit == 8
        assert engine.turns is not None
        for _ in range(30):
            engine.turns.release()
        await asyncio.gather(*batch)
    assert len(engine.started) == 30
    assert engine.max_waiting <= 3


async def test_a_reserve_that_holds_all_an_engine_runs_is_logged_once(caplog):
    """A reserve of 4 in front of an engine that runs 2: work below the top
    level runs there only while the room overshoots, and the log says so,
    once, when the engine is first seen full."""
    caplog.set_level(logging.WARNING, "qosgate.backends.openai")
    async with behind_a_reserve(slots=2, reserve=4, requests=10) as (engine, backend, batch):
        upstream = backend._upstreams[0]
        while not upstream.room.seen_full:
            await backend._read_all_metrics()
            await engine.until(lambda: engine.running + len(engine.queue) == upstream.in_flight)
        assert upstream.room.limit == 2
        assert engine.turns is not None
        for _ in range(10):
            engine.turns.release()
        # What is left goes as the room overshoots again, a report at a time.
        while not all(task.done() for task in batch):
            await backend._read_all_metrics()
        await asyncio.gather(*batch)
    said = [r.getMessage() for r in caplog.records if "reserve" in r.getMessage()]
    assert said == [f"upstream {engine.url} runs about 2 requests at once, and "
                    "scheduler.reserve.slots (4) holds them all for the top priority level: "
                    "below it, requests run there only while its room overshoots"]


async def test_a_server_restarted_between_health_probes_has_its_room_learned_again(caplog):
    """vLLM's server restarted while idle, with 4 sequences instead of 8: no
    request failed, so no health probe saw it; its metrics' process start
    time did. Without that, the room learned before (8) stayed, and since the
    engine had once run 8, 4 waiting in its queue read as a burst being
    taken in, not as its limit: they waited there, out of the tiers' order."""
    caplog.set_level(logging.INFO, "qosgate.backends.openai")
    engine = EngineUpstream(slots=8, models=(MODEL,))
    engine.started_at = 1_000.0
    await engine.start()
    backend = OpenAIBackend(OpenAIBackendConfig(
        upstreams=[{"url": engine.url}], health_interval_s=3600.0, metrics_interval_s=3600.0,
    ))  # fmt: skip
    room = lambda: backend._upstreams[0].room  # noqa: E731 - replaced on a restart

    async def backlog(http: aiohttp.ClientSession, url: str, first: str) -> None:
        """20 batch requests, the room learned in front of them, then all answered."""
        batch = [asyncio.create_task(stream(http, url, BOB_KEY, f"{first} {i}"))
                 for i in range(20)]  # fmt: skip
        while True:
            sent = min(20, room().limit)
            await engine.until(lambda: engine.running + len(engine.queue) == sent)
            await backend._read_all_metrics()
            if room().seen_full:
                break
        assert engine.turns is not None
        for _ in range(20):
            engine.turns.release()
        await asyncio.gather(*batch)

    try:
        async with asyncio.timeout(LIMIT_S), live_app(backend=backend) as live, \
                aiohttp.ClientSession() as http:  # fmt: skip
            await backlog(http, live.url, "before")
            assert room().limit == 8
            engine.slots, engine.started_at = 4, 2_000.0
            engine.max_waiting = 0
            await backlog(http, live.url, "after")
            assert room().limit == 4
    finally:
        await engine.stop()
    # Sent 8 by the old room, 4 waited once; the new room keeps the queue at that.
    assert engine.max_waiting == 4
    assert any("restarted" in r.getMessage() for r in caplog.records)


async def test_the_engines_queue_stays_near_empty_under_a_steady_backlog():
    """Requests that finish on their own while the metrics are read on the
    timer: the engine never holds more than the learning overshoot waiting,
    every request completes, and the room learned is the engine's slots."""
    engine = EngineUpstream(slots=4, models=(MODEL,))
    engine.turns = None
    await engine.start()
    backend = OpenAIBackend(OpenAIBackendConfig(
        upstreams=[{"url": engine.url}], health_interval_s=3600.0, metrics_interval_s=0.005,
    ))  # fmt: skip
    try:
        async with asyncio.timeout(LIMIT_S), live_app(backend=backend) as live, \
                aiohttp.ClientSession() as http:  # fmt: skip
            done = await asyncio.gather(*(stream(http, live.url, BOB_KEY, f"b{i}")
                                          for i in range(200)))  # fmt: skip
    finally:
        await engine.stop()
    assert len(done) == len(engine.started) == 200
    assert engine.max_waiting <= 3, engine.max_waiting


async def test_an_upstream_without_metrics_gets_the_cap_and_says_so_once(caplog):
    up = FakeUpstream("plain")
    await up.start()
    caplog.set_level(logging.WARNING, "qosgate.backends.openai")
    configs: list[dict[str, Any]] = [{"url": up.url}, {"url": up.url, "max_concurrency": 7}]
    backends = [OpenAIBackend(OpenAIBackendConfig(
        upstreams=[c], health_interval_s=3600.0, metrics_interval_s=3600.0,
    )) for c in configs]  # fmt: skip
    try:
        for backend in backends:
            await backend.start()
            await backend._read_all_metrics()  # a later read: no second line
        assert [b.capacity().free_slots for b in backends] == [64, 7]
    finally:
        for backend in backends:
            await backend.close()
        await up.stop()
    lines = [r.getMessage() for r in caplog.records if "metrics" in r.getMessage()]
    assert len(lines) == 2, lines
    assert "answered 404" in lines[0] and "at most max_concurrency (64)" in lines[0]



class FailingMetricsEngine(EngineUpstream):
    """An engine whose /metrics answers `metrics_status` instead, while set."""

    def __init__(self, slots: int) -> None:
        super().__init__(slots, models=(MODEL,))
        self.metrics_status: int | None = None

    async def _metrics(self, request: web.Request) -> web.Response:
        if self.metrics_status is not None:
            return web.Response(status=self.metrics_status, text="busy")
        return await super()._metrics(request)


async def test_a_metrics_read_that_fails_says_nothing_of_whether_it_reports(caplog):
    """vLLM's server whose metrics answer 500 (busy, or behind a proxy that
    failed) at the first read: it is not taken for a server without metrics,
    which would get max_concurrency (unset: 64) from then on and never be
    asked again. It keeps the small start until its metrics answer, then its
    room is learned; a known reporter's failing reads keep the room it had.
    The log says so once each time they fail, and when they answer again."""
    caplog.set_level(logging.INFO, "qosgate.backends.openai")
    engine = FailingMetricsEngine(slots=8)
    engine.metrics_status = 500
    await engine.start()
    backend = OpenAIBackend(OpenAIBackendConfig(
        upstreams=[{"url": engine.url}], health_interval_s=3600.0, metrics_interval_s=3600.0,
    ))  # fmt: skip
    upstream = backend._upstreams[0]
    try:
        await backend.start()
        await backend._read_all_metrics()
        assert upstream.reports is None and backend.capacity().free_slots == 4
        engine.metrics_status = None
        await backend._read_all_metrics()
        assert upstream.reports is True
        upstream.room.limit = 6
        engine.metrics_status = 503
        await backend._read_all_metrics()
        await backend._read_all_metrics()
        assert upstream.reports is True and backend.capacity().free_slots == 6
    finally:
        await backend.close()
        await engine.stop()
    said = [r.getMessage() for r in caplog.records if "metrics (" in r.getMessage()]
    metrics = f"{engine.url.removesuffix('/v1')}/metrics"
    assert said == [
        f"upstream {engine.url}: its metrics ({metrics}) answered 500; its room stays at 4 "
        "until they answer (learn_room: false sends it up to max_concurrency instead)",
        f"upstream {engine.url}: its metrics ({metrics}) answer again",
        f"upstream {engine.url}: its metrics ({metrics}) answered 503; its room stays at 6 "
        "until they answer (learn_room: false sends it up to max_concurrency instead)",
    ]


# -- priority ---------------------------------------------------------------------


class NoPriorityUpstream(FakeUpstream):
    """vLLM with FCFS scheduling, as the issue describes it: a non-zero
    `priority` is a 400."""

    def refusal(self, path: str, body: dict[str, Any]) -> tuple[int, Any] | None:
        if body.get("priority"):
            return 400, {"error": {"message": "Priority scheduling is not enabled.",
                                   "type": "BadRequestError", "param": None, "code": 400}}
        if body.get("prompt") == "bad":
            return 400, {"error": {"message": "bad prompt", "type": "BadRequestError",
                                   "param": "prompt", "code": 400}}  # fmt: skip
        return None


_ids = iter(range(1_000_000))


def job(priority: int, prompt: str = "hello") -> GenerationJob:
    return GenerationJob(
        request_id=f"p{next(_ids)}", endpoint="completions",
        body={"model": "m", "prompt": prompt, "stream": True},
        prompt_tokens=2, max_tokens=4, priority=priority,
    )  # fmt: skip


async def run(backend: OpenAIBackend, j: GenerationJob) -> str:
    return "".join([c.text async for c in backend.generate(j)])


@pytest.fixture
async def upstreams():
    made: list[tuple[FakeUpstream, OpenAIBackend]] = []

    async def make(kind: type[FakeUpstream], **upstream: Any) -> tuple[FakeUpstream, OpenAIBackend]:
        up = kind("u")
        await up.start()
        backend = OpenAIBackend(OpenAIBackendConfig(
            upstreams=[{"url": up.url, **upstream}], health_interval_s=3600.0,
            metrics_interval_s=3600.0,
        ))  # fmt: skip
        await backend.start()
        made.append((up, backend))
        return up, backend

    yield make
    for up, backend in made:
        await backend.close()
        await up.stop()


def sent(up: FakeUpstream) -> list[Any]:
    return [r["body"].get("priority") for r in up.requests]


async def test_auto_retries_once_without_a_refused_priority_and_remembers(upstreams, caplog):
    up, backend = await upstreams(NoPriorityUpstream)
    caplog.set_level(logging.WARNING, "qosgate.backends.openai")
    assert await run(backend, job(2)) == "u says hi"
    assert sent(up) == [2, None]
    assert await run(backend, job(3)) == "u says hi"
    assert sent(up) == [2, None, None]
    assert sum("refused a request's priority" in r.getMessage() for r in caplog.records) == 1


async def test_auto_keeps_a_400_that_is_not_the_priority(upstreams):
    up, backend = await upstreams(NoPriorityUpstream)
    with pytest.raises(BackendRejected, match="bad prompt"):
        await run(backend, job(2, "bad"))
    # Asked again without it, refused the same: the priority is not to blame,
    # and is still sent.
    assert sent(up) == [2, None]
    assert await run(backend, job(2)) == "u says hi"
    assert sent(up) == [2, None, 2, None]


async def test_auto_remembers_an_upstream_that_takes_it(upstreams):
    up, backend = await upstreams(NoPriorityUpstream)
    up.refusal = lambda path, body: (  # type: ignore[method-assign]
        (400, {"error": {"message": "bad prompt"}}) if body.get("prompt") == "bad" else None
    )
    assert await run(backend, job(5)) == "u says hi"
    with pytest.raises(BackendRejected):
        await run(backend, job(5, "bad"))
    # Known to take it: a refusal is the request's own, not asked twice.
    assert sent(up) == [5, 5]
    assert await run(backend, job(0)) == "u says hi"
    assert sent(up) == [5, 5, None]


async def test_on_sends_it_always_and_off_never(upstreams):
    up, backend = await upstreams(NoPriorityUpstream, priority="on")
    with pytest.raises(BackendRejected, match="Priority scheduling"):
        await run(backend, job(2))
    assert sent(up) == [2]
    up, backend = await upstreams(NoPriorityUpstream, priority="off")
    assert await run(backend, job(2)) == "u says hi"
    assert sent(up) == [None]


@pytest.mark.parametrize("bound", [None, 3])
async def test_a_request_handed_over_before_the_room_shrank_is_still_sent(bound):
    """The dispatcher hands over what capacity() allowed; an engine report in
    between that shrinks the room must not fail it, but the upstream's
    `max_concurrency` still holds."""
    engine = EngineUpstream(slots=2)
    await engine.start()
    upstream: dict[str, Any] = {"url": engine.url}
    if bound is not None:
        upstream["max_concurrency"] = bound
    backend = OpenAIBackend(OpenAIBackendConfig(
        upstreams=[upstream], health_interval_s=3600.0, metrics_interval_s=3600.0,
    ))  # fmt: skip
    await backend.start()
    try:
        async with asyncio.timeout(LIMIT_S):
            first = [asyncio.create_task(run(backend, job(0))) for _ in range(3)]
            await engine.until(lambda: len(engine.started) == 2 and len(engine.queue) == 1)
            assert backend.capacity().free_slots == (1 if bound is None else 0)
            await backend._read_all_metrics()  # one waits: the room is the 2 that run
            assert backend.capacity().free_slots == 0
            late = backend.generate(job(0))
            assert engine.turns is not None
            for _ in range(4):
                engine.turns.release()
            if bound is None:
                assert "".join([c.text async for c in late]) == "engine says hi"
            else:
                with pytest.raises(BackendUnavailable):
                    await late.__anext__()
            await asyncio.gather(*first)
    finally:
        await backend.close()
        await engine.stop()


async def test_an_automatic_prefill_budget_is_one_step_of_the_upstreams_engine():
    """An upstream's own queue may be first come, first served (vLLM's
    default scheduling), where a top-level prompt waits behind every prompt
    sent before it: `auto` there is one of its engine's steps, which its
    metrics show once a step has filled it, counted as the gateway counts
    prompts. Here the engine counts each prompt as 10 times the gateway's
    estimate, as a model's tokenizer can an estimate made without it."""
    engine = EngineUpstream(slots=8, models=(MODEL,))
    engine.turns = None
    counted = OpenAIBackend(OpenAIBackendConfig(upstreams=[{"url": "http://127.0.0.1:9/v1"}]))
    engine.prompt_tokens = 10 * counted.count_prompt_tokens("completions", {"prompt": "hello"})
    await engine.start()
    backend = OpenAIBackend(OpenAIBackendConfig(
        upstreams=[{"url": engine.url}], health_interval_s=3600.0, metrics_interval_s=3600.0,
    ))  # fmt: skip
    try:
        async with asyncio.timeout(LIMIT_S), live_app(backend=backend) as live, \
                aiohttp.ClientSession() as http:  # fmt: skip
            rules = lambda: live.gateway.scheduler.policy  # noqa: E731 - replaced on a change
            # No step taken yet (the histogram is empty): no budget.
            assert backend.step_tokens is None
            assert rules().prefill_budget_tokens is None
            # Decodes alone so far: steps of up to 8 tokens.
            engine.steps = {"1.0": 0.0, "8.0": 3.0, "1024.0": 3.0, "2048.0": 3.0,
                            "16384.0": 3.0, "+Inf": 3.0}
            await backend._read_all_metrics()
            assert backend.step_tokens == 8
            # A step filled the engine's budget of 2048; nothing answered yet,
            # so the upstream's count is taken for the gateway's.
            engine.steps = {"1.0": 0.0, "8.0": 3.0, "1024.0": 5.0, "2048.0": 9.0,
                            "16384.0": 9.0, "+Inf": 9.0}
            await backend._read_all_metrics()
            assert backend.step_tokens == 2048
            await stream(http, live.url, BOB_KEY, "hello")  # wakes the dispatcher
            assert rules().prefill_budget_tokens == 2048
            assert rules().delay_prefill_tokens == 2048
            # Its usage said 10 tokens for each counted here.
            await backend._read_all_metrics()
            assert backend.step_tokens == 205
            await stream(http, live.url, BOB_KEY, "hello")
            assert rules().prefill_budget_tokens == 205
            # A change of less than an eighth is not a new budget.
            engine.prompt_tokens = engine.prompt_tokens * 11 // 10
            for _ in range(5):
                await stream(http, live.url, BOB_KEY, "hello")
            await backend._read_all_metrics()
            assert backend.step_tokens == 205
            # A restarted server's step is learned again: none until it takes one.
            engine.started_at = 1.0
            await backend._read_all_metrics()
            engine.started_at, engine.steps = 2.0, {}
            await backend._read_all_metrics()
            assert backend.step_tokens is None
            await stream(http, live.url, BOB_KEY, "hello")
            assert rules().prefill_budget_tokens is None
    finally:
        await engine.stop()


async def test_an_upstreams_step_given_in_the_policy_is_taken_over_its_metrics():
    """`step_tokens` states the engine's step (what its metrics give only an
    upper bound of), in its tokenizer's count: converted to the gateway's by
    the usage its answers carry, and summed over the healthy upstreams."""
    engine = EngineUpstream(slots=8, models=(MODEL,))
    engine.turns = None
    engine.steps = {"1.0": 0.0, "8.0": 3.0, "1024.0": 5.0, "2048.0": 7.0,
                    "16384.0": 9.0, "+Inf": 9.0}  # a step counted past 2048
    plain = FakeUpstream("plain")
    await engine.start()
    await plain.start()
    backend = OpenAIBackend(OpenAIBackendConfig(
        upstreams=[{"url": engine.url, "step_tokens": 2048},
                   {"url": plain.url, "step_tokens": 1024, "learn_room": False}],
        health_interval_s=3600.0, metrics_interval_s=3600.0,
    ))  # fmt: skip
    try:
        await backend.start()
        assert backend.step_tokens == 2048 + 1024
        engine.prompt_tokens = plain.prompt_tokens = 4 * job(0).prompt_tokens
        for _ in range(4):
            await run(backend, job(0))
        await backend._read_all_metrics()
        assert backend.step_tokens == (2048 + 1024) // 4
    finally:
        await backend.close()
        await engine.stop()
        await plain.stop()
