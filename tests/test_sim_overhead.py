"""The profile's per-request terms: a prefill chunk's own set-up (`c_chunk`)
and the time a dispatched request holds its slot before the engine takes it
in (`request_overhead_ms`), alike in the engine, the discrete-event simulator,
the capacity measure and the live backend."""

from __future__ import annotations

import asyncio
from pathlib import Path

import pytest
import yaml

from qosgate.backends.base import GenerationJob
from qosgate.backends.sim import SimEngine
from qosgate.backends.sim_live import SimBackend
from qosgate.config import SimBackendConfig
from qosgate.profiles import PROFILES, CostProfile
from qosgate.sim.runner import measure_capacity, run_policy
from qosgate.sim.workload import Arrival

from http_support import POLICY_YAML, make_policy

FLAT = CostProfile(
    name="flat", description="test", t0_ms=10.0, c_p=0.0, c_q=0.0, c_d=0.0, c_kv=0.0,
    kv_capacity_tokens=100_000, max_num_seqs=2, max_num_batched_tokens=2048,
)  # fmt: skip


def profile_file(tmp_path: Path, **update: float) -> str:
    # A profile file is read once per process: each variant gets its own name.
    path = tmp_path / f"p-{'-'.join(f'{k}{v}' for k, v in update.items())}.yaml"
    path.write_text(yaml.safe_dump(FLAT.model_copy(update=update).model_dump()))
    return str(path)


def test_each_prefill_chunk_pays_its_own_set_up() -> None:
    profile = FLAT.model_copy(update={"c_chunk": 2.0})
    assert profile.step_ms([100, 200], 0, 0) == pytest.approx(14.0)
    assert profile.step_ms([], 5, 0) == pytest.approx(10.0)
    # The built-in profiles have neither term: their figures are as published.
    assert all(p.c_chunk == 0 and p.request_overhead_ms == 0 for p in PROFILES.values())


def test_a_dispatched_sequence_holds_its_slot_until_it_reaches_the_engine() -> None:
    engine = SimEngine(FLAT)
    engine.add("a", 10, 3, ready_at=0.5)
    cap = engine.capacity()
    assert (cap.free_slots, cap.waiting, cap.running) == (1, 1, 0)
    assert cap.free_kv_tokens == 100_000 - 10
    assert not engine.has_work() and engine.next_ready_at() == 0.5
    with pytest.raises(RuntimeError):
        engine.step()
    engine.take_ready(0.49)
    assert not engine.has_work()
    engine.take_ready(0.5)
    assert engine.has_work() and engine.next_ready_at() is None
    results = []
    while engine.has_work():
        results.append(engine.step())
    assert results[0].first_token == ["a"] and results[-1].finished == ["a"]
    assert engine.capacity().free_slots == 2


def test_a_sequence_aborted_on_its_way_never_arrives() -> None:
    engine = SimEngine(FLAT)
    engine.add("a", 10, 3, ready_at=1.0)
    assert engine.abort("a")
    assert engine.capacity().free_slots == 2 and engine.capacity().free_kv_tokens == 100_000
    assert engine.next_ready_at() is None
    engine.take_ready(2.0)
    assert not engine.has_work()
    # The id may be dispatched again (a requeued request).
    engine.add("a", 10, 3, ready_at=3.0)
    engine.take_ready(3.0)
    assert engine.has_work()


def _arrival(rid: str, t: float) -> Arrival:
    return Arrival(rid, t, "alice", "interactive", 10, 3, 3)


def test_the_simulator_adds_the_overhead_to_every_first_token(tmp_path: Path) -> None:
    policy = make_policy()
    ttfts = {}
    for overhead in (0.0, 250.0):
        cfg = SimBackendConfig(profile=profile_file(tmp_path, request_overhead_ms=overhead))
        run = run_policy(policy, cfg, [_arrival("r1", 0.0), _arrival("r2", 5.0)], drain_until=60)
        assert all(r.outcome.value == "completed" for r in run.requests)
        ttfts[overhead] = [r.ttft for r in run.requests]
    # A lone request: one 10 ms prefill step, after the overhead.
    assert ttfts[0.0] == pytest.approx([0.010, 0.010])
    assert ttfts[250.0] == pytest.approx([0.260, 0.260])


def test_slots_held_outside_the_engine_lower_its_capacity(tmp_path: Path) -> None:
    work = [Arrival(f"r{i}", 0.0, "alice", "interactive", 10, 20, 20) for i in range(200)]
    bare, _ = measure_capacity(SimBackendConfig(profile=profile_file(tmp_path)), work)
    held, _ = measure_capacity(
        SimBackendConfig(profile=profile_file(tmp_path, request_overhead_ms=200.0)), work)
    # Two slots: a request is 20 steps of 10 ms (its prefill gives token 1),
    # 0.2 s, or 0.4 s with the overhead.
    assert bare == pytest.approx(2 / 0.2, rel=0.05)
    assert held == pytest.approx(2 / 0.4, rel=0.05)


async def test_the_live_backend_holds_a_request_for_its_overhead(tmp_path: Path) -> None:
    speed = 10.0
    backend = SimBackend(SimBackendConfig(
        profile=profile_file(tmp_path, request_overhead_ms=2000.0), speed=speed))  # fmt: skip
    await backend.start()
    try:
        loop = asyncio.get_running_loop()
        start = loop.time()
        stream = backend.generate(GenerationJob("a", "completions", {}, prompt_tokens=10, max_tokens=2, priority=0))
        assert backend.capacity().free_slots == 1
        chunks = [chunk async for chunk in stream]
        # 2 modelled seconds at 10x: never before 0.2 s of wall time.
        assert loop.time() - start >= 2.0 / speed
        assert sum(c.tokens for c in chunks) == 2 and chunks[-1].finish_reason == "length"
        assert backend.capacity().free_slots == 2
    finally:
        await backend.close()


def test_the_run_samples_the_engines_saturated_seconds_as_they_pass(tmp_path: Path) -> None:
    # Four requests on two slots: the slots are full, so every step is
    # saturated, from the first step until the last request ends (about 2 s
    # of 10 ms steps); a sample counts only the part of a step before it.
    cfg = SimBackendConfig(profile=profile_file(tmp_path))
    arrivals = [Arrival(f"r{i}", 0.0, "alice", "interactive", 10, 100, 100) for i in range(4)]
    # Samples every 0.255 s land inside 10 ms steps.
    run = run_policy(make_policy(), cfg, arrivals, drain_until=60, sample_every_s=0.255)
    assert all(r.outcome.value == "completed" for r in run.requests)
    assert [t for t, _ in run.saturated_s_samples] == [t for t, _ in run.samples]
    # Saturated all along: each sample has the time up to it, the step in
    # flight counted only to the sample.
    for t, saturated in run.saturated_s_samples:
        assert saturated == pytest.approx(t), (t, saturated)
    assert len(run.saturated_s_samples) >= 8
    assert run.engine_saturated_s == pytest.approx(run.engine_busy_s) == pytest.approx(2.0)


def test_a_run_cut_by_its_horizon_counts_the_engine_only_up_to_it(tmp_path: Path) -> None:
    # The same saturated engine, cut 5 ms into a 10 ms step: the step in
    # flight counts for its part before the horizon, in busy and saturated
    # seconds alike.
    cfg = SimBackendConfig(profile=profile_file(tmp_path))
    arrivals = [Arrival(f"r{i}", 0.0, "alice", "interactive", 10, 100, 100) for i in range(4)]
    run = run_policy(make_policy(), cfg, arrivals, drain_until=1.005)
    assert run.end_time == 1.005
    assert run.engine_busy_s == pytest.approx(1.005)
    assert run.engine_saturated_s == pytest.approx(1.005)
    assert run.saturated_s_samples[-1] == (1.005, run.engine_saturated_s)


def test_what_a_first_token_frees_reaches_the_engine_a_step_later(tmp_path: Path) -> None:
    # 10 ms steps. bob's second prompt is held for the prefill budget until
    # the first one's first token, at the end of step 1 (10 ms). The engine
    # planned step 2 before the scheduler heard of that token, as vLLM's
    # engine loop and the live backend do, so the held prompt's prefill is
    # step 3's: its first token comes at 30 ms, not 20.
    cfg = SimBackendConfig(profile=profile_file(tmp_path, max_num_seqs=4))
    policy = make_policy(POLICY_YAML + "scheduler:\n  prefill_budget_tokens: 100\n")
    arrivals = [Arrival("c", 0.0, "alice", "interactive", 10, 100, 100),
                Arrival("b1", 0.0, "bob", "batch", 80, 3, 3),
                Arrival("b2", 0.001, "bob", "batch", 80, 3, 3)]
    run = run_policy(policy, cfg, arrivals, drain_until=60)
    by_id = {r.id: r for r in run.requests}
    assert by_id["b1"].first_token_at == pytest.approx(0.010)
    assert by_id["b2"].dispatched_at == pytest.approx(0.010)
    assert by_id["b2"].first_token_at == pytest.approx(0.030)


def test_a_run_sent_back_while_its_last_step_ran_is_not_finished_by_that_step(
        tmp_path: Path) -> None:  # fmt: skip
    # Two slots. bob's one-token run finishes in step 1, which the engine
    # planned at 0; the room it reports already has that slot free. At 5 ms
    # two interactive requests arrive: one takes the slot, and for the other
    # the scheduler sends bob's run back (as far as it has heard, it still
    # runs). Step 1's finish of it, heard at 10 ms, is nobody's: bob's
    # request is queued again and runs anew.
    cfg = SimBackendConfig(profile=profile_file(tmp_path))
    policy = make_policy(
        POLICY_YAML.replace("  batch:\n    priority: 2\n",
                            "  batch:\n    priority: 2\n    preemptible: true\n")
        + "scheduler:\n  preemption: true\n")
    arrivals = [Arrival("c", 0.0, "alice", "interactive", 10, 100, 100),
                Arrival("b", 0.0, "bob", "batch", 10, 1, 1),
                Arrival("a1", 0.005, "alice", "interactive", 10, 3, 3),
                Arrival("a2", 0.005, "alice", "interactive", 10, 3, 3)]
    run = run_policy(policy, cfg, arrivals, drain_until=60)
    assert run.gateway_preemptions == 1
    by_id = {r.id: r for r in run.requests}
    assert all(r.outcome.value == "completed" for r in run.requests)
    assert by_id["b"].preemptions == 1 and by_id["b"].finished_at > 0.010
