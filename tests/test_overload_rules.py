"""The failures that made `qos` worse than `strict` under overload, each on
the simulated GPU with B3's policy, engine and tenants (benchmarks/b3_sweep.py's
cells): every one of these failed before the scheduler stopped
ageing delay tiers past the latency tiers (qos refused every interactive
request at 4x; batch waited 157 s against its stated bound; beside 8k-token
prompts and in bursts qos served no interactive request from 2x) and passes
since. The full grid is the sweep's (benchmarks/RESULTS.md)."""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

from qosgate.sim.commands import Simulation
from qosgate.sim.runner import run_policy
from qosgate.sim.scenario import Scenario, load_scenario
from qosgate.sim.workload import Arrival

ROOT = Path(__file__).resolve().parent.parent
_SPEC = importlib.util.spec_from_file_location("b3_sweep", ROOT / "benchmarks" / "b3_sweep.py")
sweep = importlib.util.module_from_spec(_SPEC)
sys.modules[_SPEC.name] = sweep
_SPEC.loader.exec_module(sweep)


def run(mix: str, arrivals: str, load: float, *, prefill_budget: int | str | None = "auto",
        delay_prefill: int | str | None = "auto", seed: int | None = None) -> dict:
    """qos and strict on one cell of the sweep (600 s of arrivals)."""
    base = sweep.load_scenario(sweep.SCENARIO)
    data = base.model_dump()
    data["policy"]["scheduler"].update(prefill_budget_tokens=prefill_budget,
                                       delay_prefill_tokens=delay_prefill)
    base = Scenario.model_validate(data)
    cell = sweep.cell_scenario(base, mix, arrivals)
    result, _ = Simulation(cell, seed=base.seed if seed is None else seed,
                           quiet=True).run(load, ("qos", "strict"))
    return result["policies"]


def attainment(report: dict, tier: str) -> float:
    return report["tiers"][tier]["ttft_slo_attainment"]


def test_at_4x_qos_serves_interactive_as_strict_does_and_batch_within_its_bound():
    policies = run("b3", "poisson", 4.0)
    qos, strict = policies["qos"], policies["strict"]
    assert attainment(qos, "interactive") >= 0.99
    assert attainment(qos, "interactive") >= attainment(strict, "interactive") - 0.01
    # Batch is shed first: what it serves waited no longer than its expiry
    # (half its 60 s e2e objective), and some is served in the lulls.
    batch = qos["tiers"]["batch"]
    assert batch["served_wait_max_s"] <= 30.0 + 1e-9
    assert batch["completed"] > 0 and batch["expired"] > 0
    assert qos["totals"]["lost"] == 0


def test_beside_8k_prompts_the_prefill_budget_keeps_interactive_first():
    qos = run("long", "poisson", 2.0, prefill_budget=4096)["qos"]
    assert attainment(qos, "interactive") >= 0.99


def test_in_bursts_the_prefill_budget_keeps_interactive_first():
    qos = run("long", "gamma4", 2.0, prefill_budget=4096)["qos"]
    assert attainment(qos, "interactive") >= 0.95


def test_the_prefill_budget_costs_standard_nothing_under_sustained_overload():
    # With the budget, B3 at 4x served standard 0.306 against 0.357 without
    # (seed 3): batch's shorter prompts overtook standard's held ones (batch
    # completed 1,727 requests against 486), and a held level's newcomers
    # were predicted a wait without their own prefill.
    with_budget = run("b3", "poisson", 4.0, prefill_budget=4096)["qos"]
    without = run("b3", "poisson", 4.0, prefill_budget=None)["qos"]
    assert attainment(with_budget, "standard") >= attainment(without, "standard")
    def batch_completed(report: dict) -> int:
        return report["tiers"]["batch"]["completed"]

    assert batch_completed(with_budget) <= 1.05 * batch_completed(without)


def test_standard_under_qos_is_served_at_least_as_strict_serves_it():
    # Three standard tenants sending alike: ordered by their counters, the
    # tier let admitted requests expire (0.699 against strict's 0.726 at 2x).
    policies = run("b3", "poisson", 2.0)
    assert attainment(policies["qos"], "standard") >= attainment(policies["strict"], "standard")
    assert policies["qos"]["tiers"]["standard"]["expired"] <= (
        policies["strict"]["tiers"]["standard"]["expired"])


NOISY_NEIGHBOUR = {
    "kind": "traffic", "name": "noisy-neighbour", "seed": 3,
    "duration_s": 300, "warmup_s": 30, "drain_s": 60,
    "policies": ["qos"], "engine": {"profile": "h100-llama3-8b"},
    "arrivals": {"process": "poisson", "load": 2.2},
    "lengths": {"prompt": {"median": 1000, "sigma": 1.0, "min": 4, "max": 4096},
                "output": {"median": 150, "sigma": 0.9, "min": 1, "max": 1024}},
    "max_tokens": "cap",
    "classes": [{"tenant": "flood", "share": 20}, {"tenant": "light", "share": 2}],
    "policy": {
        "tiers": {"standard": {"priority": 0, "ttft_slo_ms": 2000, "max_queue_wait_ms": 1500}},
        "tenants": [{"id": "flood", "tier": "standard"}, {"id": "light", "tier": "standard"}],
        "scheduler": {"policy": "qos", "fairness": "vtc"},
    },
}


def tenant_attainment(fairness: str) -> dict[str, float]:
    """Each tenant's share of its requests with a first token within 2 s."""
    from qosgate.sim.runner import run_policy
    from qosgate.sim.workload import generate_arrivals

    data = {**NOISY_NEIGHBOUR}
    data["policy"] = {**data["policy"], "scheduler": {"policy": "qos", "fairness": fairness}}
    scenario = Scenario.model_validate(data)
    sim = Simulation(scenario, seed=scenario.seed, quiet=True)
    arrivals = generate_arrivals(scenario, scenario.policy, sim.rate_for(2.2), scenario.seed)
    run = run_policy(scenario.policy, scenario.engine, arrivals,
                     drain_until=scenario.duration_s + scenario.drain_s,
                     drain_rate_hint=sim.capacity_tokens_per_s)
    out = {}
    for tenant in ("flood", "light"):
        reqs = [r for r in run.requests if r.tenant == tenant and r.arrival >= scenario.warmup_s]
        met = [r for r in reqs if r.first_token_at is not None
               and r.first_token_at - r.arrival <= 2.0]
        out[tenant] = len(met) / len(reqs)
    return out


def test_a_tenant_beside_a_flood_in_a_latency_tier_is_served_its_due():
    # The light tenant asks 0.2x of capacity beside a flood of 2x, in a tier
    # that refuses by its predicted wait. Refused at the door at the flood's
    # rate, it was served 0.61 of its requests in time under vtc (order by
    # counters) and 0.55 under fifo; taking the flood's places at the door,
    # it is served nearly all it asks, and the flood what is left.
    fair, fifo = tenant_attainment("vtc"), tenant_attainment("fifo")
    assert fair["light"] >= 0.85 and fifo["light"] < 0.6
    assert fair["flood"] >= 0.5


def test_in_a_burst_batchs_long_prompts_do_not_put_interactive_below_strict():
    # Bursts (gamma CV 4) at 2x beside 8k-token prompts: with fairness at the
    # door standard leaves more lulls, and batch filled them with 5 to 7 long
    # prompts at once, ahead of every interactive prefill in the engine (qos
    # 0.813 against strict's 0.857 on seed 3 before delay tiers went in at the
    # pace of prefill). With the defaults (the pace, and the prefill budget for
    # standard's long prompts) qos serves it 0.987 on seed 3; with neither,
    # 0.876 (strict 0.854). Against strict the seeds' noise is larger than
    # one seed shows: the test below pairs five.
    defaults = run("long", "gamma4", 2.0)
    neither = run("long", "gamma4", 2.0, prefill_budget=None, delay_prefill=None)
    assert attainment(defaults["qos"], "interactive") >= 0.95
    assert (attainment(defaults["qos"], "interactive")
            >= attainment(neither["qos"], "interactive") + 0.05)


def test_in_bursts_beside_long_prompts_the_defaults_serve_interactive_as_strict_does():
    # With the defaults (the prefill budget and the pace), over the sweep's
    # five seeds, by its paired rule: a shortfall beyond the seeds' noise fails.
    qos, strict = [], []
    for seed in range(3, 8):
        policies = run("long", "gamma4", 2.0, seed=seed)
        qos.append(attainment(policies["qos"], "interactive"))
        strict.append(attainment(policies["strict"], "interactive"))
    assert sweep.Paired.of(qos, strict).upper >= 0.0
    assert sum(qos) / len(qos) >= 0.95


def test_in_the_engine_a_burst_of_short_prompts_goes_before_a_long_one_of_its_tier():
    # The engine is busy decoding batch work when a long interactive prompt
    # and then eight short ones arrive, all within a step: the engine's own
    # queue takes the short ones first (docs/SCHEDULING.md, "The engine's own
    # queue"), so each gets its first token before the long one does. In
    # arrival order the long one's 4,000 tokens went first, two steps ahead
    # of every short one.
    base = sweep.load_scenario(sweep.SCENARIO)
    arrivals = [Arrival(f"b{i}", 0.0, "nightly-eval", "batch", 50, 500, 500) for i in range(64)]
    arrivals.append(Arrival("long", 1.0, "chat-app", "interactive", 4000, 10, 10))
    arrivals += [Arrival(f"short{i}", 1.0 + 0.0001 * (i + 1), "copilot", "interactive", 200, 10, 10)
                 for i in range(8)]
    run_ = run_policy(base.policy, base.engine, arrivals, drain_until=120.0)
    first = {r.id: r.first_token_at for r in run_.requests}
    assert None not in first.values()
    assert max(first[f"short{i}"] for i in range(8)) < first["long"]


def test_the_automatic_prefill_budget_keeps_the_engine_fed_when_releases_reach_it_late(
        tmp_path):  # fmt: skip
    # A prompt counts against the budget until its first token is heard, and
    # what the gateway releases then reaches the engine later still (a
    # remote engine's HTTP hop here, modelled as one step; an engine's own
    # loop plans its next step before its first tokens are heard). A budget
    # that covers only the steps ahead of a top-level prompt leaves the
    # engine idling through that gap: two steps' worth took half as long
    # again as no budget at all to prefill this backlog.
    profile = (ROOT / "qosgate" / "sim_profiles" / "h100-llama3-8b.yaml").read_text()
    (tmp_path / "remote.yaml").write_text(
        profile.replace("name: h100-llama3-8b", "name: remote") + "request_overhead_ms: 60\n")
    base = sweep.load_scenario(sweep.SCENARIO)
    engine = base.engine.model_copy(update={"profile": str(tmp_path / "remote.yaml")})
    arrivals = [Arrival(f"b{i}", 0.001 * i, "nightly-eval", "batch", 3000, 1, 1)
                for i in range(150)]

    def last_first_token(budget: str | None) -> float:
        scheduler = base.policy.scheduler.model_copy(
            update={"prefill_budget_tokens": budget, "delay_prefill_tokens": budget})
        policy = base.policy.model_copy(update={"scheduler": scheduler})
        run_ = run_policy(policy, engine, arrivals, drain_until=600.0)
        assert all(r.first_token_at is not None for r in run_.requests)
        return max(r.first_token_at for r in run_.requests)

    assert last_first_token("auto") <= 1.05 * last_first_token(None)


def test_with_fixed_lengths_qos_keeps_slots_for_interactive_between_waves_of_completions():
    # Every request 512 + 256 tokens, as a benchmark with ignore_eos sends
    # them, B3's tiers without a reserve: requests that start together end
    # together, and between two waves no slot frees. Strict refills every
    # freed slot at once and 255 of 701 interactive requests expired in the
    # queue (0.636); qos keeps the slots the expected arrivals need.
    scenario = load_scenario(ROOT / "benchmarks" / "waves_fixed_lengths.yaml")
    result, _ = Simulation(scenario, seed=scenario.seed, quiet=True).run(2.0, ("qos", "strict"))
    qos, strict = result["policies"]["qos"], result["policies"]["strict"]
    assert attainment(strict, "interactive") < 0.7
    assert attainment(qos, "interactive") >= 0.99
    # What it keeps is taken back as the top level's work arrives: the
    # engine does as much.
    assert qos["totals"]["throughput_tokens_per_s"] >= 0.99 * (
        strict["totals"]["throughput_tokens_per_s"])
    assert qos["totals"]["lost"] == 0


def test_where_few_runs_end_within_the_top_budget_qos_keeps_a_slot_for_its_arrivals():
    # policies/multi-tenant.yaml's four tiers, no reserve, at 2x: the engine
    # completes about 16 requests a second, 2 within realtime's 150 ms queue
    # budget, so strict's realtime requests that find every slot taken wait
    # past it for the next (0.816: 67 of 814 refused or expired). qos keeps
    # free the slot or two its next arrivals need, and counts no run past
    # its expected end as about to end.
    scenario = load_scenario(ROOT / "benchmarks" / "four_tiers.yaml")
    result, _ = Simulation(scenario, seed=scenario.seed, quiet=True).run(2.0, ("qos", "strict"))
    qos, strict = result["policies"]["qos"], result["policies"]["strict"]
    assert attainment(strict, "realtime") < 0.85
    assert attainment(qos, "realtime") >= 0.92
    refused = qos["tiers"]["realtime"]["rejected"] + qos["tiers"]["realtime"]["expired"]
    assert refused <= 10
    # A slot or two of 256: the engine does as much.
    assert qos["totals"]["throughput_tokens_per_s"] >= 0.99 * (
        strict["totals"]["throughput_tokens_per_s"])
    assert qos["totals"]["lost"] == 0 and strict["totals"]["lost"] == 0
