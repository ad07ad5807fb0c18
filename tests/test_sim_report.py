"""Simulation reports: the benchmark figures (docs/SIMULATE.md) on hand-built request lists."""

from __future__ import annotations

import itertools
import time

import pytest

from qosgate.config.models import PolicyConfig
from qosgate.core.request import Outcome, Request
from qosgate.observability.stats import percentile
from qosgate.sim.report import build_policy_report, format_table, plot_run
from qosgate.sim.scenario import MetricsConfig, evaluate_targets

POLICY = PolicyConfig.model_validate(
    {
        "tiers": {
            "interactive": {"priority": 0, "ttft_slo_ms": 500},
            "batch": {"priority": 2, "e2e_slo_ms": 60_000},
            "bulk": {"priority": 3},
        },
        "tenants": [
            {"id": "a", "tier": "interactive"},
            {"id": "b", "tier": "interactive"},
            {"id": "c", "tier": "batch"},
            {"id": "d", "tier": "bulk"},
            {"id": "heavy", "tier": "interactive", "weight": 2.0},
        ],
    }
)
METRICS = MetricsConfig()
_ids = itertools.count()


def req(
    tenant: str,
    arrival: float,
    *,
    outcome: Outcome | None = Outcome.COMPLETED,
    dispatched: float | None = None,
    first: float | None = None,
    finished: float | None = None,
    prompt: int = 100,
    output: int = 10,
) -> Request:
    tier = POLICY.tenant(tenant).tier
    r = Request(f"q{next(_ids)}", tenant, tier, prompt, 1000, arrival)
    r.outcome = outcome
    r.dispatched_at = dispatched
    r.first_token_at = first
    r.finished_at = finished
    r.output_tokens = output if first is not None else 0
    return r


def done(tenant: str, arrival: float, ttft: float, e2e: float, **kw) -> Request:
    return req(tenant, arrival, dispatched=arrival + ttft / 2, first=arrival + ttft,
               finished=arrival + e2e, **kw)


def report(requests, window=(0.0, 100.0), metrics=METRICS, samples=()):
    return build_policy_report(
        list(requests), POLICY, window=window, metrics=metrics, samples=list(samples)
    )


def test_percentile_interpolates_like_numpy():
    values = list(range(1, 101))
    assert percentile(values, 50) == pytest.approx(50.5)
    assert percentile(values, 99) == pytest.approx(99.01)
    assert percentile([3.0], 99) == 3.0
    assert percentile([], 50) is None


def test_tier_counts_attainment_and_percentiles():
    requests = [
        done("a", 1.0, ttft=0.2, e2e=1.0),
        done("a", 2.0, ttft=0.5, e2e=1.0),  # exactly on the SLO: met
        done("b", 3.0, ttft=0.9, e2e=2.0),  # completed late
        req("a", 4.0, outcome=Outcome.REJECTED_QUOTA, finished=4.0),
        req("b", 5.0, outcome=Outcome.REJECTED_OVERLOAD, finished=5.0),
        req("a", 6.0, outcome=Outcome.EXPIRED, finished=36.0),
        req("b", 7.0, outcome=Outcome.CANCELLED, dispatched=8.0, finished=9.0),
        done("a", -5.0, ttft=10.0, e2e=20.0),  # warm-up arrival: not counted
    ]
    tier = report(requests)["tiers"]["interactive"]
    assert tier["requests"] == 7
    assert tier["completed"] == 3
    assert tier["rejected"] == 2
    assert tier["rejected_quota"] == 1
    assert tier["rejected_overload"] == 1
    assert tier["expired"] == 1
    assert tier["cancelled"] == 1
    # 2 met out of 7 requests less 1 refused by quota
    assert tier["ttft_slo_attainment"] == pytest.approx(2 / 6)
    assert tier["slo_attainment"] == pytest.approx(2 / 6)
    assert tier["ttft_p50_s"] == pytest.approx(0.5)
    assert tier["ttft_p99_s"] == pytest.approx(0.5 + 0.4 * 0.98)
    # waits: 0.1, 0.25, 0.45 (dispatched), 1.0 (cancelled after dispatch),
    # 30.0 (expired in queue); the two refusals never queued
    assert tier["queue_wait_max_s"] == pytest.approx(30.0)
    assert tier["queue_wait_p99_s"] == pytest.approx(1.0 + 29.0 * 0.96)
    assert tier["e2e_p50_s"] == pytest.approx(1.0)
    assert tier["goodput_rps"] == pytest.approx(2 / 100)


def test_tiers_without_ttft_slo():
    requests = [
        done("c", 1.0, ttft=5.0, e2e=50.0),
        done("c", 2.0, ttft=5.0, e2e=70.0),
        req("c", 3.0, outcome=Outcome.EXPIRED, finished=40.0),
        done("d", 1.0, ttft=5.0, e2e=500.0),
        req("d", 2.0, outcome=Outcome.REJECTED_QUEUE_FULL, finished=2.0),
    ]
    result = report(requests)
    batch, bulk = result["tiers"]["batch"], result["tiers"]["bulk"]
    assert batch["ttft_slo_attainment"] is None
    assert batch["slo_attainment"] == pytest.approx(1 / 3)  # judged end to end
    assert bulk["ttft_slo_attainment"] is None
    assert bulk["slo_attainment"] == pytest.approx(1 / 2)  # just completing
    assert bulk["rejected"] == 1
    assert result["totals"]["goodput_rps"] == pytest.approx(2 / 100)
    # a tier with no traffic is still reported
    assert result["tiers"]["interactive"]["requests"] == 0
    assert result["tiers"]["interactive"]["ttft_slo_attainment"] is None


def test_throughput_counts_completed_requests_tokens_when_they_were_delivered():
    requests = [
        done("a", 10.0, ttft=0.1, e2e=1.0, prompt=100, output=50),  # all inside
        # Arrived before: its prompt went in before the window, and 2.0 of its
        # 4.9 s of output fall inside.
        done("a", -3.0, ttft=0.1, e2e=5.0, prompt=300, output=100),
        # Ends after the window: its prompt and 0.9 of its 4.9 s of output are inside.
        done("a", 99.0, ttft=0.1, e2e=5.0, prompt=1000, output=1000),
        req("a", 20.0, outcome=Outcome.CANCELLED, dispatched=20.0, first=20.5, finished=21.0),
    ]
    # No first token seen (a client that read nothing before the end): at its end.
    unseen = req("a", 30.0, dispatched=30.0, finished=31.0, prompt=7)
    unseen.output_tokens = 3
    requests.append(unseen)
    totals = report(requests)["totals"]
    output = 50 + 100 * 2.0 / 4.9 + 1000 * 0.9 / 4.9 + 3
    assert totals["output_tokens_per_s"] == pytest.approx(output / 100)
    assert totals["throughput_tokens_per_s"] == pytest.approx((100 + 1000 + 7 + output) / 100)
    assert totals["requests"] == 4
    assert totals["completed"] == 3


def test_throughput_does_not_depend_on_the_order_of_completions():
    # The same work, one long request and ten short ones streaming their
    # output, finished in two orders inside a window that ends before the last
    # one finishes: counted as delivered, both orders did the same work in it.
    def run(long_first: bool) -> float:
        t, requests = 0.0, []
        lengths = [8000] + [400] * 10 if long_first else [400] * 10 + [8000]
        for output in lengths:
            took = output / 1000
            requests.append(done("a", t, ttft=1e-6, e2e=took, prompt=100, output=output))
            t += took
        return report(requests, window=(0.0, 12.0))["totals"]["throughput_tokens_per_s"]

    assert run(long_first=True) == pytest.approx(run(long_first=False), rel=1e-3)


def test_lost_counts_requests_without_outcome_anywhere():
    requests = [
        done("a", 1.0, ttft=0.1, e2e=1.0),
        req("a", 2.0, outcome=None),
        req("c", 150.0, outcome=None),  # after the window, still lost
    ]
    result = report(requests)
    assert result["totals"]["lost"] == 2
    assert result["tiers"]["interactive"]["lost"] == 1


def _holder(tenant: str, until: float) -> Request:
    # Keeps a tenant backlogged over [0, until) without being served.
    return req(tenant, 0.0, outcome=Outcome.CANCELLED, finished=until)


def test_service_difference_two_tenants_one_served_twice():
    metrics = MetricsConfig(window_s=60, service_w_in=1.0, service_w_out=2.0)
    requests = [
        _holder("a", 130.0),
        _holder("b", 130.0),
        # window 0: a gets 200 + 2*50 = 300, b gets 100 + 2*25 = 150
        req("a", 1.0, first=10.0, finished=10.0, prompt=200, output=50),
        req("b", 1.0, first=10.0, finished=10.0, prompt=100, output=25),
        # window 1: equal service
        req("a", 61.0, first=70.0, finished=70.0, prompt=100, output=0),
        req("b", 61.0, first=70.0, finished=70.0, prompt=100, output=0),
    ]
    result = report(requests, window=(0.0, 120.0), metrics=metrics)
    totals = result["totals"]
    assert totals["service_windows"] == 2
    assert totals["max_service_difference"] == pytest.approx(150.0)
    assert totals["avg_service_difference"] == pytest.approx(75.0)
    assert result["tenants"]["a"]["service"] == pytest.approx(400.0)
    assert result["tenants"]["b"]["service"] == pytest.approx(250.0)


def test_service_difference_needs_two_backlogged_tenants():
    requests = [
        _holder("a", 130.0),
        _holder("b", 30.0),  # b is idle for most of window 0: not backlogged
        req("a", 1.0, first=10.0, finished=10.0, prompt=500, output=0),
        req("b", 1.0, first=10.0, finished=10.0, prompt=10, output=0),
    ]
    totals = report(requests, window=(0.0, 60.0))["totals"]
    assert totals["max_service_difference"] == 0.0
    assert totals["avg_service_difference"] == 0.0


def test_back_to_back_requests_keep_a_tenant_backlogged():
    requests = [
        req("a", 0.0, outcome=Outcome.CANCELLED, finished=30.0),
        req("a", 30.0, outcome=Outcome.CANCELLED, finished=61.0),
        _holder("b", 61.0),
        req("a", 1.0, first=10.0, finished=10.0, prompt=40, output=0),
    ]
    totals = report(requests, window=(0.0, 60.0))["totals"]
    assert totals["max_service_difference"] == pytest.approx(40.0)


def test_weights_normalise_service():
    # heavy (weight 2) gets twice a's tokens: the same weighted service.
    requests = [
        _holder("a", 70.0),
        _holder("heavy", 70.0),
        req("a", 1.0, first=10.0, finished=10.0, prompt=100, output=0),
        req("heavy", 1.0, first=10.0, finished=10.0, prompt=200, output=0),
    ]
    result = report(requests, window=(0.0, 60.0))
    assert result["tenants"]["heavy"]["service"] == pytest.approx(100.0)
    assert result["tenants"]["heavy"]["prompt_tokens"] == 200
    assert result["totals"]["max_service_difference"] == pytest.approx(0.0)


def test_output_service_is_spread_over_decoding():
    metrics = MetricsConfig(window_s=60, service_w_in=0.0, service_w_out=1.0)
    requests = [
        _holder("a", 200.0),
        _holder("b", 200.0),
        # 90 output tokens over [30, 120): 30 in window 0, 60 in window 1
        req("a", 1.0, first=30.0, finished=120.0, prompt=1, output=90),
    ]
    result = report(requests, window=(0.0, 120.0), metrics=metrics)
    totals = result["totals"]
    assert totals["max_service_difference"] == pytest.approx(60.0)
    assert totals["avg_service_difference"] == pytest.approx(45.0)
    assert result["tenants"]["a"]["service"] == pytest.approx(90.0)


def test_tenants_of_different_tiers_are_not_compared():
    requests = [
        _holder("a", 70.0),
        _holder("c", 70.0),
        req("a", 1.0, first=10.0, finished=10.0, prompt=500, output=0),
    ]
    assert report(requests, window=(0.0, 60.0))["totals"]["max_service_difference"] == 0.0


def test_tenant_section():
    requests = [
        done("a", 1.0, ttft=0.2, e2e=1.0, prompt=10, output=5),
        req("a", 2.0, outcome=Outcome.REJECTED_QUOTA, finished=2.0, prompt=99),
    ]
    tenants = report(requests)["tenants"]
    assert tenants["a"] == {
        "tier": "interactive",
        "weight": 1.0,
        "requests": 2,
        "completed": 1,
        "rejected": 1,
        "prompt_tokens": 10,
        "output_tokens": 5,
        "service": pytest.approx(20.0),
        "ttft_p99_s": pytest.approx(0.2),
    }
    assert tenants["d"]["requests"] == 0


def test_queue_depth_samples():
    samples = [(t, {"interactive": t, "batch": 1}) for t in range(0, 200, 10)]
    tiers = report([], samples=samples)["tiers"]
    assert tiers["interactive"]["queue_depth_max"] == 90
    assert tiers["interactive"]["queue_depth_mean"] == pytest.approx(45.0)
    assert tiers["bulk"]["queue_depth_max"] == 0


def test_report_is_fast_for_20k_requests():
    requests = [
        done("ab"[i % 2], i * 0.01, ttft=0.3, e2e=2.0 + (i % 7), prompt=256, output=256)
        for i in range(20_000)
    ]
    started = time.perf_counter()
    result = report(requests, window=(0.0, 200.0))
    assert time.perf_counter() - started < 1.0
    assert result["totals"]["completed"] == 20_000


def test_empty_window_is_an_error():
    with pytest.raises(ValueError, match="window"):
        report([], window=(5.0, 5.0))


# -- targets, table, plot -------------------------------------------------------------


def _result():
    qos = report([done("a", 1.0, ttft=0.2, e2e=1.0), done("c", 1.0, ttft=1.0, e2e=2.0)])
    fcfs = report([done("a", 1.0, ttft=0.9, e2e=1.0), done("b", 2.0, ttft=0.1, e2e=1.0)])
    return {
        "scenario": "b3",
        "load": 2.0,
        "policies": {"fcfs": fcfs, "qos": qos},
        "reference": {"policies": {"qos": {"totals": {"goodput_rps": 0.02}}}},
    }


def test_evaluate_targets_pass_and_fail():
    result = _result()
    targets = [
        {"name": "interactive", "metric": "policies.qos.tiers.interactive.ttft_slo_attainment",
         "op": ">=", "value": 0.99},
        {"name": "fcfs interactive",
         "metric": "policies.fcfs.tiers.interactive.ttft_slo_attainment",
         "op": ">=", "value": 0.99},
        {"name": "lost", "metric": "policies.qos.totals.lost", "op": "==", "value": 0},
        {"name": "vs fcfs", "numerator": "policies.qos.totals.goodput_rps",
         "denominator": "policies.fcfs.totals.goodput_rps", "op": ">=", "value": 2.0},
        {"name": "vs reference", "numerator": "policies.qos.totals.goodput_rps",
         "denominator": "reference.policies.qos.totals.goodput_rps", "op": ">=", "value": 0.9},
        {"name": "missing", "metric": "policies.strict.totals.lost", "op": "==", "value": 0},
        {"name": "zero denominator", "numerator": "policies.qos.totals.lost",
         "denominator": "policies.fcfs.totals.lost", "op": "<=", "value": 1},
        {"name": "wait", "metric": "policies.qos.tiers.batch.queue_wait_max_s", "op": "<=",
         "value": 0.1},
    ]
    checks = evaluate_targets(targets, result)
    assert [c["name"] for c in checks] == [t["name"] for t in targets]
    assert [c["passed"] for c in checks] == [True, False, True, True, True, False, False, False]
    assert checks[0] == {
        "name": "interactive",
        "metric": "policies.qos.tiers.interactive.ttft_slo_attainment",
        "value": 1.0,
        "op": ">=",
        "threshold": 0.99,
        "passed": True,
    }
    assert checks[3]["value"] == pytest.approx(2.0)
    assert checks[4]["value"] == pytest.approx(1.0)
    assert checks[5]["value"] is None
    assert checks[6]["value"] is None
    assert checks[7]["value"] == pytest.approx(0.5)


def test_evaluate_targets_accepts_models_and_dotted_tier_names():
    from qosgate.sim.scenario import MetricTarget

    result = {"policies": {"qos": {"tiers": {"gold.v2": {"requests": 3}}}}}
    target = MetricTarget(name="x", metric="policies.qos.tiers.gold.v2.requests", op="==", value=3)
    assert evaluate_targets([target], result)[0]["passed"] is True


def test_format_table_lists_policies_tiers_and_totals():
    result = _result()
    result["targets"] = evaluate_targets(
        [{"name": "lost", "metric": "policies.qos.totals.lost", "op": "==", "value": 0}], result
    )
    text = format_table(result)
    assert "scenario b3" in text and "load 2x" in text
    assert "policy fcfs" in text and "policy qos" in text
    assert "interactive" in text and "batch" in text
    assert "throughput" in text and "lost 0" in text
    assert "PASS  lost" in text
    header = next(line for line in text.splitlines() if "ttft_p99" in line)
    rows = [line for line in text.splitlines() if line.startswith("  interactive")]
    assert rows and all(len(row) <= len(header) + 2 for row in rows)


def test_plot_writes_png(tmp_path):
    result = _result()
    series = {
        policy: {
            "queue_depth": [(t, {"interactive": t % 5, "batch": 2}) for t in range(0, 100, 5)],
            "ttft": [(float(t), "interactive" if t % 3 else "batch", 0.05 * (t + 1))
                     for t in range(100)],
        }
        for policy in ("fcfs", "qos")
    }
    path = tmp_path / "run.png"
    plot_run(result, series, path)
    assert path.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert path.stat().st_size > 5000
