"""The simulated engine: cost model, continuous batching, limits, preemption, seed tables."""

from __future__ import annotations

from pathlib import Path

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from qosgate.backends.sim import SimEngine
from qosgate.backends.sim_live import step_end
from qosgate.profiles import PROFILES, CostProfile, get_profile
from qosgate.config import SimBackendConfig, load_model
from qosgate.sim.seed_tables import SeedTablesSpec, format_seed_tables, run_seed_tables

H100 = get_profile("h100-llama3-8b")
B10 = Path(__file__).resolve().parent.parent / "benchmarks" / "b10_seed_tables.yaml"


def flat(t0: float = 10.0, **kw: int) -> CostProfile:
    """A profile whose steps are easy to add up by hand."""
    limits = {"kv_capacity_tokens": 100_000, "max_num_seqs": 16, "max_num_batched_tokens": 2048}
    limits.update(kw)
    return CostProfile(
        name="flat", description="test", t0_ms=t0, c_p=0.0, c_q=0.0, c_d=0.0, c_kv=0.0, **limits
    )


def run_to_end(engine: SimEngine) -> list:
    results = []
    while engine.has_work():
        results.append(engine.step())
    return results


# -- cost model -------------------------------------------------------------


def test_step_cost_is_the_design_formula() -> None:
    ms = H100.step_ms([100, 200], 3, 1000)
    expected = 6.0 + 0.025 * 300 + 8e-7 * (100**2 + 200**2) + 0.006 * 3 + 5.5e-5 * 1000
    assert ms == pytest.approx(expected)
    assert H100.step_ms([], 0, 0) == pytest.approx(6.0)


def test_decode_exponent_bends_only_the_decode_term() -> None:
    bent = CostProfile(
        name="b", description="", t0_ms=1.0, c_p=0.5, c_q=0.0, c_d=2.0, c_kv=0.0,
        kv_capacity_tokens=1000, max_num_seqs=64, max_num_batched_tokens=64, decode_exponent=0.5,
    )  # fmt: skip
    assert bent.step_ms([4], 16, 0) == pytest.approx(1.0 + 0.5 * 4 + 2.0 * 4.0)


def test_profiles_and_unknown_profile() -> None:
    assert {"h100-llama3-8b", "a100x4-hermes3-70b", "a100-llama3-8b"} <= set(PROFILES)
    assert H100.kv_capacity_tokens == 467_000
    assert (H100.max_num_seqs, H100.max_num_batched_tokens) == (256, 2048)
    with pytest.raises(ValueError, match="h100-llama3-8b"):
        get_profile("tpu-v9")


def test_from_config_overrides_the_profile() -> None:
    cfg = SimBackendConfig(profile="a100-llama3-8b", max_num_seqs=8, kv_capacity_tokens=5000)
    engine = SimEngine.from_config(cfg)
    assert engine.profile is get_profile("a100-llama3-8b")
    assert engine.max_num_seqs == 8
    assert engine.kv_capacity_tokens == 5000
    assert engine.max_num_batched_tokens == 2048
    assert engine.scheduling_policy == "priority"


def test_bad_arguments() -> None:
    engine = SimEngine(flat(kv_capacity_tokens=1000))
    engine.add("a", 10, 5)
    with pytest.raises(ValueError):
        engine.add("a", 10, 5)
    with pytest.raises(ValueError):
        engine.add("b", 10, 0)
    with pytest.raises(ValueError):
        engine.add("c", 900, 101)  # could never fit the KV cache
    with pytest.raises(ValueError):
        SimEngine(flat(max_num_seqs=64, max_num_batched_tokens=32))
    with pytest.raises(RuntimeError):
        SimEngine(flat()).step()


# -- one request ----------------------------------------------------------------


def test_single_request_timing_is_the_model() -> None:
    engine = SimEngine(H100)
    engine.add("a", 3000, 5)
    results = run_to_end(engine)
    # 3000 prompt tokens in chunks of 2048 + 952; token 1 with the last chunk, then 4 decodes.
    assert [r.prefill_tokens for r in results] == [2048, 952, 0, 0, 0, 0]
    assert [r.decode_tokens for r in results] == [0, 0, 1, 1, 1, 1]
    assert [r.first_token for r in results] == [[], ["a"], [], [], [], []]
    assert [r.finished for r in results] == [[], [], [], [], [], ["a"]]
    expected = [H100.step_ms([2048], 0, 0), H100.step_ms([952], 0, 0)]
    # A decode reads the prompt and every token generated so far.
    expected += [H100.step_ms([], 1, 3000 + g) for g in (1, 2, 3, 4)]
    assert [r.duration for r in results] == pytest.approx([ms / 1000 for ms in expected])
    ttft = results[0].duration + results[1].duration
    assert ttft == pytest.approx((expected[0] + expected[1]) / 1000)
    assert engine.capacity().free_kv_tokens == H100.kv_capacity_tokens


def test_the_live_engine_runs_its_steps_back_to_back() -> None:
    # After an idle spell a step starts when the loop takes it up.
    assert step_end(10.0, None, 0.5) == 10.5
    # Taken up on time or a little late (delivering the last step's tokens),
    # it still starts when the last one ended: the host's own time does not
    # stretch the modelled GPU's.
    assert step_end(10.5, 10.5, 0.5) == 11.0
    assert step_end(10.7, 10.5, 0.5) == 11.0
    # After a stall of more than a step, at most one step's lag is made up.
    assert step_end(12.0, 10.5, 0.5) == 12.0


def test_single_token_output_finishes_with_its_prefill() -> None:
    engine = SimEngine(H100)
    engine.add("a", 100, 1)
    (result,) = run_to_end(engine)
    assert result.first_token == ["a"] and result.finished == ["a"]


def test_generated_counts_tokens() -> None:
    engine = SimEngine(flat())
    engine.add("a", 10, 4)
    assert engine.generated("a") == 0
    counts = []
    while engine.has_work():
        engine.step()
        counts.append(engine.generated("a"))
    assert counts == [1, 2, 3, 0]  # 0 once finished: it has left the engine
    assert engine.generated("nobody") == 0


# -- continuous batching ------------------------------------------------------------


def test_new_sequence_joins_while_others_decode() -> None:
    engine = SimEngine(flat())
    engine.add("a", 50, 10)
    engine.step()
    engine.step()
    assert engine.generated("a") == 2
    engine.add("b", 100, 3)
    joined = engine.step()
    assert (joined.prefill_tokens, joined.decode_tokens, joined.batch_size) == (100, 1, 2)
    assert joined.first_token == ["b"]
    assert engine.generated("a") == 3 and engine.generated("b") == 1
    finish_order = [sid for r in run_to_end(engine) for sid in r.finished]
    assert finish_order == ["b", "a"]  # b (3 tokens) overtakes a: no waiting for the batch


def test_max_num_seqs_limits_the_running_batch() -> None:
    engine = SimEngine(flat(max_num_seqs=2))
    for i in range(5):
        engine.add(f"s{i}", 10, 3)
    cap = engine.capacity()
    assert (cap.free_slots, cap.waiting) == (0, 5)
    engine.step()
    cap = engine.capacity()
    assert (cap.running, cap.waiting, cap.free_slots) == (2, 3, 0)
    while engine.has_work():
        engine.step()
        assert engine.capacity().running <= 2


def test_chunked_prefill_splits_a_long_prompt() -> None:
    engine = SimEngine(flat(), max_num_batched_tokens=1000)
    engine.add("long", 2500, 2)
    results = run_to_end(engine)
    assert [r.prefill_tokens for r in results] == [1000, 1000, 500, 0]
    assert results[2].first_token == ["long"]


def test_chunked_prefill_shares_the_budget_with_decodes() -> None:
    engine = SimEngine(flat(), max_num_batched_tokens=100)
    engine.add("a", 10, 20)
    engine.step()
    engine.add("b", 250, 2)
    steps = [engine.step() for _ in range(3)]
    # a's decode takes 1 token of every 100; b's prompt fills the rest, 99 at a time.
    assert [(r.prefill_tokens, r.decode_tokens) for r in steps] == [(99, 1), (99, 1), (52, 1)]
    assert steps[2].first_token == ["b"]


def test_without_chunking_a_prompt_runs_whole() -> None:
    engine = SimEngine(flat(), max_num_batched_tokens=100, enable_chunked_prefill=False)
    engine.add("a", 10, 4)
    engine.step()
    engine.add("b", 100, 2)  # does not fit beside a's decode: waits for a whole budget
    engine.add("c", 5, 2)  # would fit, but waits behind b (first come, first served)
    results = run_to_end(engine)
    assert [(r.prefill_tokens, r.decode_tokens) for r in results] == [
        (0, 1), (0, 1), (0, 1), (100, 0), (5, 1), (0, 1)
    ]  # fmt: skip
    assert [r.first_token for r in results][3:5] == [["b"], ["c"]]


def test_without_chunking_an_oversized_prompt_runs_alone() -> None:
    engine = SimEngine(flat(), max_num_batched_tokens=100, enable_chunked_prefill=False)
    engine.add("a", 10, 3)
    engine.step()
    engine.add("huge", 450, 2)
    results = run_to_end(engine)
    big = [r for r in results if r.prefill_tokens == 450]
    assert len(big) == 1 and big[0].batch_size == 1 and big[0].first_token == ["huge"]
    assert sum(r.prefill_tokens for r in results) == 450


def test_priority_policy_admits_lower_value_first() -> None:
    order = {}
    for policy in ("fcfs", "priority"):
        engine = SimEngine(flat(max_num_seqs=1), scheduling_policy=policy)
        engine.add("x", 10, 2, priority=2)
        engine.add("y", 10, 2, priority=0)
        engine.add("z", 10, 2, priority=1)
        engine.add("w", 10, 2, priority=0)
        order[policy] = [sid for r in run_to_end(engine) for sid in r.first_token]
    assert order["fcfs"] == ["x", "y", "z", "w"]
    assert order["priority"] == ["y", "w", "z", "x"]


# -- KV cache ------------------------------------------------------------------------


def test_kv_exhaustion_preempts_the_newest_and_it_completes_later() -> None:
    engine = SimEngine(flat(kv_capacity_tokens=100))
    engine.add("old", 30, 60)
    engine.add("new", 30, 60)
    first = engine.step()
    assert first.first_token == ["old", "new"]
    preempted_at = None
    results = []
    while engine.has_work():
        r = engine.step()
        results.append(r)
        assert engine._kv_used <= 100
        if r.preempted and preempted_at is None:
            preempted_at = len(results)
            assert r.preempted == ["new"]
            assert engine.generated("new") == 0
            assert engine.capacity().waiting == 1
    assert preempted_at is not None
    finished = [sid for r in results for sid in r.finished]
    assert finished == ["old", "new"]
    # Every preemption restarts "new" from scratch (it may be preempted again as "old" grows).
    restarts = [sid for r in results for sid in r.first_token]
    preemptions = [sid for r in results for sid in r.preempted]
    assert set(restarts) == set(preemptions) == {"new"} and len(restarts) == len(preemptions)


def test_priority_policy_preempts_the_lowest_priority() -> None:
    engine = SimEngine(flat(kv_capacity_tokens=100), scheduling_policy="priority")
    engine.add("vip", 30, 60, priority=0)
    engine.add("bulk", 30, 60, priority=3)
    engine.step()
    engine.add("late-vip", 2, 3, priority=0)  # admitted after bulk: newer, but outranks it
    preempted = [sid for r in run_to_end(engine) for sid in r.preempted]
    assert preempted and set(preempted) == {"bulk"}


def test_admission_waits_for_kv_room() -> None:
    engine = SimEngine(flat(kv_capacity_tokens=100))
    engine.add("a", 60, 5)
    engine.add("b", 50, 5)
    r = engine.step()
    assert r.first_token == ["a"]  # b's prompt does not fit beside a's
    cap = engine.capacity()
    assert (cap.running, cap.waiting) == (1, 1)
    assert cap.free_kv_tokens == 0  # 100 - 61 held - 50 promised to b, floored at 0
    assert [sid for r in run_to_end(engine) for sid in r.finished] == ["a", "b"]


def test_a_step_is_saturated_by_its_slots_its_token_budget_or_the_cache() -> None:
    # Slots: two sequences, two slots, a budget they leave mostly unused.
    engine = SimEngine(flat(max_num_seqs=2), max_num_batched_tokens=100)
    engine.add("a", 10, 3)
    assert not engine.step().saturated  # one of two slots, 10 of 100 tokens
    engine.add("b", 10, 3)
    assert engine.step().saturated  # both slots running
    # The token budget: one sequence whose prompt fills it.
    engine = SimEngine(flat(), max_num_batched_tokens=100)
    engine.add("long", 250, 2)
    assert [r.saturated for r in run_to_end(engine)] == [True, True, False, False]
    # The cache: b waits for KV room while a runs alone on few tokens.
    engine = SimEngine(flat(kv_capacity_tokens=100))
    engine.add("a", 60, 5)
    engine.add("b", 50, 5)
    assert engine.step().saturated
    # Without chunking, a prompt too long for what a step has left waits: full too.
    engine = SimEngine(flat(), max_num_batched_tokens=100, enable_chunked_prefill=False)
    engine.add("a", 10, 4)
    engine.step()
    engine.add("b", 100, 2)
    assert engine.step().saturated


def test_the_engine_counts_its_step_time_and_saturated_time() -> None:
    engine = SimEngine(flat(t0=10.0), max_num_batched_tokens=100)
    engine.add("long", 250, 2)
    results = run_to_end(engine)
    assert engine.step_seconds == pytest.approx(sum(r.duration for r in results)) == 0.04
    assert engine.saturated_seconds == pytest.approx(0.02)  # the two full prefill steps


def test_abort_frees_capacity() -> None:
    engine = SimEngine(flat(kv_capacity_tokens=1000, max_num_seqs=2))
    engine.add("a", 300, 50)
    engine.add("b", 300, 50)
    engine.add("c", 300, 50)
    engine.step()
    engine.step()
    assert engine.capacity().free_kv_tokens == 1000 - 2 * 302 - 300
    assert engine.abort("a") is True
    assert engine.abort("a") is False
    assert engine.abort("unknown") is False
    assert engine.abort("c") is True  # still waiting in the engine
    cap = engine.capacity()
    assert (cap.running, cap.waiting, cap.free_slots) == (1, 0, 1)
    assert cap.free_kv_tokens == 1000 - 302
    assert engine.generated("a") == 0
    results = run_to_end(engine)
    assert [sid for r in results for sid in r.finished] == ["b"]
    assert engine.capacity().free_kv_tokens == 1000


# -- invariants under random use ------------------------------------------------------


def _check_books(engine: SimEngine) -> None:
    """The aggregated decode bookkeeping agrees with the sequences themselves."""
    decoding = [s for s in engine._running.values() if s.state == 2]
    held = sum(
        s.prefilled if s.state == 1 else s.prompt + engine.generated(s.id)
        for s in engine._running.values()
    )
    assert engine._kv_used == held
    assert engine._n_decoding == len(decoding)
    assert engine._decode_ctx == sum(s.prompt + engine.generated(s.id) for s in decoding)


ops = st.lists(
    st.one_of(
        st.tuples(
            st.just("add"),
            st.integers(1, 120),
            st.integers(1, 40),
            st.integers(0, 3),
        ),
        st.tuples(st.just("abort"), st.integers(0, 10_000)),
        st.tuples(st.just("step"), st.integers(1, 6)),
    ),
    max_size=60,
)


@settings(max_examples=150, deadline=None)
@given(
    ops=ops,
    chunked=st.booleans(),
    policy=st.sampled_from(["fcfs", "priority"]),
    max_num_seqs=st.integers(1, 6),
    budget_extra=st.integers(0, 100),
    kv=st.integers(170, 600),
)
def test_limits_hold_and_every_sequence_ends_once(
    ops: list, chunked: bool, policy: str, max_num_seqs: int, budget_extra: int, kv: int
) -> None:
    engine = SimEngine(
        H100,
        max_num_seqs=max_num_seqs,
        max_num_batched_tokens=max_num_seqs + budget_extra,
        kv_capacity_tokens=kv,
        enable_chunked_prefill=chunked,
        scheduling_policy=policy,
    )
    outputs: dict[str, int] = {}
    gen: dict[str, int] = {}  # what each live sequence has emitted, from the step results
    decoding: set[str] = set()
    ended: dict[str, str] = {}
    n = 0

    def do_step() -> None:
        r = engine.step()
        assert r.duration > 0
        for sid in r.preempted:
            gen[sid] = 0
            decoding.discard(sid)
        assert r.decode_tokens == len(decoding)
        for sid in decoding:
            gen[sid] += 1
        for sid in r.first_token:
            assert sid not in decoding and gen[sid] == 0
            gen[sid] = 1
            decoding.add(sid)
        for sid in r.finished:
            assert sid not in ended
            assert gen[sid] == outputs[sid]
            ended[sid] = "finished"
            decoding.discard(sid)
            del gen[sid]
        for sid, g in gen.items():
            assert engine.generated(sid) == g
        cap = engine.capacity()
        assert cap.running <= max_num_seqs
        assert engine._kv_used <= kv
        assert 0 <= cap.free_kv_tokens <= kv and cap.free_slots >= 0
        assert cap.running + cap.waiting == len(gen)
        _check_books(engine)

    for op in ops:
        if op[0] == "add":
            _, prompt, output, prio = op
            if prompt + output > kv:
                continue
            sid = f"s{n}"
            n += 1
            engine.add(sid, prompt, output, priority=prio)
            outputs[sid] = output
            gen[sid] = 0
        elif op[0] == "abort":
            if not outputs:
                continue
            sid = f"s{op[1] % n}"
            live = sid in gen
            assert engine.abort(sid) is live
            if live:
                ended[sid] = "aborted"
                del gen[sid]
                decoding.discard(sid)
        else:
            for _ in range(op[1]):
                if engine.has_work():
                    do_step()
    steps = 0
    while engine.has_work():
        do_step()
        steps += 1
        assert steps < 100_000, "engine made no progress"
    assert set(ended) == set(outputs)
    assert engine.capacity().free_kv_tokens == kv and engine._kv_used == 0


# -- B10 -------------------------------------------------------------------------------


def test_seed_tables_are_reproduced_within_10_percent() -> None:
    spec = load_model(SeedTablesSpec, B10)
    result = run_seed_tables(spec)
    assert result["scenario"] == spec.name
    assert set(result["profiles"]) == {"a100x4-hermes3-70b", "a100-llama3-8b"}
    for name, entry in result["profiles"].items():
        for row in entry["rows"]:
            assert abs(row["ratio"] - 1) <= 0.10, (name, row)
        assert entry["all_within_10pct"]
    assert len(result["profiles"]["a100x4-hermes3-70b"]["rows"]) == 7
    text = format_seed_tables(result)
    assert "a100-llama3-8b" in text and "821" in text


def test_seed_tables_spec_is_strict() -> None:
    with pytest.raises(ValueError):
        SeedTablesSpec.model_validate(
            {"kind": "seed_tables", "name": "x", "tables": [], "extra": 1}
        )
    with pytest.raises(ValueError, match="unknown profile .nope."):
        SeedTablesSpec.model_validate(
            {
                "kind": "seed_tables",
                "name": "x",
                "tables": [
                    {"profile": "nope", "prompt_tokens": 1, "output_tokens": 1,
                     "rows": [{"batch_size": 1, "tokens_per_s": 1}]}
                ],
            }
        )  # fmt: skip
