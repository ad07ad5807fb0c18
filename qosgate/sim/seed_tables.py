"""Scenario B10: do the simulated profiles reproduce the throughput tables they
were fitted to?

Each row is replayed closed-loop: exactly `batch_size` sequences are in the
engine at all times, a finished one replaced at once by a new one, and the
output tokens/s of the steady state is compared with the table's.
"""

from __future__ import annotations

from typing import Any, Literal

from pydantic import Field, field_validator

from qosgate.backends.sim import SimEngine
from qosgate.profiles import CostProfile, get_profile
from qosgate.config.models import PositiveInt, StrictModel, profile_reference

TOLERANCE = 0.10


class SeedRow(StrictModel):
    batch_size: PositiveInt
    """Sequences in flight at once."""
    tokens_per_s: float = Field(gt=0)
    """Output tokens/s the table reports at that batch size."""


class SeedTable(StrictModel):
    profile: str
    """Simulated profile fitted to this table: a built-in's name (qosgate/sim_profiles/)
    or the path of a profile file, relative to this file."""
    prompt_tokens: PositiveInt
    """Prompt length of every sequence (what the fit assumed)."""
    output_tokens: PositiveInt
    """Output length of every sequence (what the fit assumed)."""
    rows: tuple[SeedRow, ...] = Field(min_length=1)
    """The table: throughput by batch size."""

    _known_profile = field_validator("profile")(profile_reference)


class SeedTablesSpec(StrictModel):
    kind: Literal["seed_tables"]
    """Scenario kind; `qosgate simulate` dispatches on it."""
    name: str
    """Scenario name reported in the results."""
    tables: tuple[SeedTable, ...] = Field(min_length=1)
    """The throughput tables to reproduce."""


def measure_tokens_per_s(
    profile: CostProfile, prompt_tokens: int, output_tokens: int, batch_size: int
) -> float:
    """Steady-state output tokens/s of `profile` with `batch_size` sequences always in flight."""
    engine = SimEngine(profile)
    # The first sequences get evenly spread output lengths, so finishes (and the
    # prefills that replace them) are spread over the round as in a long-running
    # server, instead of the whole batch moving in lockstep.
    for i in range(batch_size):
        engine.add(f"warm-{i}", prompt_tokens, max(1, round(output_tokens * (i + 1) / batch_size)))
    next_id = 0
    completed = 0
    clock = 0.0
    # Measure from the moment every warm-up sequence is done, over two more rounds;
    # counting finished sequences' tokens leaves out work a preemption threw away.
    start_at = batch_size
    stop_at = 3 * batch_size
    start_clock = 0.0
    while completed < stop_at:
        result = engine.step()
        clock += result.duration
        for _ in result.finished:
            completed += 1
            if completed == start_at:
                start_clock = clock
            engine.add(f"seq-{next_id}", prompt_tokens, output_tokens)
            next_id += 1
    # Overshoot (several finishing in the last step) counts in full: those sequences'
    # tokens were produced inside the window.
    return (completed - start_at) * output_tokens / (clock - start_clock)


def run_seed_tables(spec: SeedTablesSpec) -> dict[str, Any]:
    profiles: dict[str, dict[str, Any]] = {}
    for table in spec.tables:
        profile = get_profile(table.profile)
        entry = profiles.setdefault(table.profile, {"rows": [], "all_within_10pct": True})
        for row in table.rows:
            measured = measure_tokens_per_s(
                profile, table.prompt_tokens, table.output_tokens, row.batch_size
            )
            ratio = measured / row.tokens_per_s
            within = abs(ratio - 1.0) <= TOLERANCE
            entry["rows"].append(
                {
                    "batch_size": row.batch_size,
                    "target_tokens_per_s": row.tokens_per_s,
                    "measured_tokens_per_s": round(measured, 2),
                    "ratio": round(ratio, 4),
                    "within_10pct": within,
                }
            )
            entry["all_within_10pct"] = entry["all_within_10pct"] and within
    return {"scenario": spec.name, "profiles": profiles}


def format_seed_tables(result: dict[str, Any]) -> str:
    lines = [f"scenario: {result['scenario']}"]
    for name, entry in result["profiles"].items():
        verdict = "all within 10%" if entry["all_within_10pct"] else "NOT all within 10%"
        lines += ["", f"{name} ({verdict})"]
        lines.append(
            f"  {'batch':>5}  {'target tok/s':>12}  {'measured tok/s':>14}  {'ratio':>6}  ok"
        )
        for row in entry["rows"]:
            lines.append(
                f"  {row['batch_size']:>5}  {row['target_tokens_per_s']:>12.1f}  "
                f"{row['measured_tokens_per_s']:>14.1f}  {row['ratio']:>6.3f}  "
                f"{'yes' if row['within_10pct'] else 'NO'}"
            )
    return "\n".join(lines)
