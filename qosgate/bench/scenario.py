"""Scenario files of `qosgate bench`: the traffic to send to a live endpoint.

A bench scenario (`kind: bench`) describes requests the way a `qosgate
simulate` scenario does (classes with shares or rates, Poisson or gamma
arrivals, log-normal prompt/output lengths, on/off classes) and adds what a
real client needs: the model name, the endpoint, streaming, and per class the
API key (hence tenant and tier) it sends with. The tiers' SLOs are repeated
here because the client cannot read them from the server; goodput is judged
against them.

Two modes:

- `open`: open-loop arrivals over `duration_s`, sent whether or not earlier
  requests have been answered (the way independent users behave).
- `sweep`: closed loop, `sweep.concurrency` users at a time, each sending its
  next request when the previous one ends; one row of throughput and latency
  per concurrency level.

Every model is frozen and forbids unknown keys, so a typo is an error that
names the field (`qosgate bench` exits 2 with it).
"""

from __future__ import annotations

import re
from pathlib import Path
from typing import Annotated, Any, Literal

from pydantic import Field, field_validator, model_validator

from qosgate.config.loader import load_model
from qosgate.config.models import (
    NonNegativeFloat, PositiveFloat, PositiveInt, StrictModel, check_name, check_tier_names,
)  # fmt: skip
from qosgate.sim.scenario import LengthsConfig, LengthsOverride, MetricsConfig, TrafficShape

_ENV_NAME = re.compile(r"^[A-Za-z_][A-Za-z0-9_]*$")

DEFAULT_SWEEP = (1, 4, 8, 16, 32, 64)


class BenchTier(StrictModel):
    """A tier's objectives, as the client judges them (the gateway's policy may
    say the same; the client cannot read it)."""

    ttft_slo_ms: PositiveFloat | None = None
    """Time-to-first-token objective. A request meets its tier's SLO when it
    completes within it."""
    e2e_slo_ms: PositiveFloat | None = None
    """End-to-end objective, used when the tier has no TTFT objective (as in
    the policy file). With neither, completing is enough."""


class BenchArrivals(StrictModel):
    """How open-loop requests arrive in time."""

    process: Literal["poisson", "gamma"] = "poisson"
    """Inter-arrival distribution: exponential (Poisson process) or gamma."""
    burstiness: PositiveFloat = 1.0
    """Coefficient of variation of the gaps (gamma only): 1 is Poisson, above 1
    burstier, below 1 more regular."""
    rate_rps: PositiveFloat | None = None
    """Total requests/s of the classes given by share."""


class BenchClass(TrafficShape):
    """One stream of requests, sent with one API key (hence one tenant and tier).

    `share` weighs it in arrivals.rate_rps (open) or in the request mix (sweep);
    in a sweep `rate_rps` is only its weight in the mix, and on/off applies to
    open mode only."""

    name: str
    """Label of the class in progress output."""
    tier: str
    """The tier the key's tenant belongs to on the server; one of `tiers`."""
    tenant: str | None = None
    """Tenant label in the result (default: the class name). Classes may share
    a tenant, which then has one tier."""
    api_key: str | None = None
    """Bearer key sent as `Authorization` (plain text: bench keys are test keys)."""
    api_key_env: str | None = None
    """Environment variable holding the key instead (read when the run starts).
    With neither key field, no Authorization header is sent."""
    priority: Annotated[int, Field(ge=0, le=1000)] | None = None
    """Sent as the body's `priority` (qosgate: levels below the tier); None: not sent."""

    _names = field_validator("name", "tier", "tenant")(check_name)

    @field_validator("api_key_env")
    @classmethod
    def _env_name(cls, value: str | None) -> str | None:
        if value is not None and not _ENV_NAME.match(value):
            raise ValueError("must be an environment variable name")
        return value

    @model_validator(mode="after")
    def _one_key(self) -> BenchClass:
        if self.api_key is not None and self.api_key_env is not None:
            raise ValueError("give api_key or api_key_env, not both")
        return self

    @property
    def tenant_id(self) -> str:
        return self.tenant or self.name


class SweepConfig(StrictModel):
    """The closed-loop concurrency sweep: one level after the other."""

    concurrency: Annotated[tuple[PositiveInt, ...], Field(min_length=1)] = DEFAULT_SWEEP
    """Users sending at once, one level per entry, in this order."""
    requests: PositiveInt | None = None
    """Requests per level, split evenly across its users."""
    duration_s: PositiveFloat | None = None
    """Seconds per level instead: users keep sending until then (requests in
    flight at the end are waited for and counted)."""

    @model_validator(mode="after")
    def _one_stop(self) -> SweepConfig:
        if (self.requests is None) == (self.duration_s is None):
            raise ValueError("give exactly one of requests or duration_s (per level)")
        return self


class BenchScenario(StrictModel):
    """A scenario file of `qosgate bench`."""

    kind: Literal["bench"]
    """Scenario type; `bench` (a `qosgate simulate` scenario is `traffic`)."""
    name: str
    """Short name, used in reports and as `scenario` in the result JSON."""
    description: str = ""
    """What the scenario measures."""
    mode: Literal["open", "sweep"] = "open"
    """open: open-loop arrivals over duration_s; sweep: closed loop per concurrency level."""
    model: str
    """The `model` of every request."""
    endpoint: Literal["chat", "completions"] = "chat"
    """POST /chat/completions (one user message) or /completions (a prompt)."""
    stream: bool = True
    """Ask for SSE streaming (TTFT is then the first content chunk; without
    streaming TTFT is the whole response time)."""
    seed: int = 0
    """Seed of arrivals, lengths and prompt text (same seed, same requests)."""
    duration_s: PositiveFloat | None = None
    """Open loop: arrivals are generated over [0, duration_s); requests still
    running then are waited for."""
    warmup_s: NonNegativeFloat = 0.0
    """Open loop: requests sent before this are left out of the metrics (but
    never out of `lost`)."""
    timeout_s: PositiveFloat = 600.0
    """Per-request client timeout; a request past it is an error (timeout)."""
    honor_retry_after: bool = False
    """mode sweep: a user refused with a Retry-After (429, 503) waits that long
    before its next request, as real clients do, instead of sending at once."""
    arrivals: BenchArrivals = BenchArrivals()
    """Open loop: arrival process and total rate of the share classes."""
    lengths: LengthsConfig | None = None
    """Default prompt/output token lengths of the classes. The prompt is
    synthetic text of about 4 characters per token; the output length is sent
    as max_tokens."""
    classes: Annotated[tuple[BenchClass, ...], Field(min_length=1)]
    """The request streams."""
    tiers: Annotated[dict[str, BenchTier], Field(min_length=1)]
    """Tiers by name, with the SLOs goodput is judged against."""
    sweep: SweepConfig | None = None
    """mode sweep: the concurrency levels and how long each runs."""
    metrics: MetricsConfig = MetricsConfig()
    """The fairness window and service weights of the service-difference
    figures (B4; docs/SIMULATE.md), as in `qosgate simulate`."""
    sessions: Annotated[int, Field(ge=0)] = 0
    """Spread the requests over this many conversations: request n carries
    `X-Session-Id: s<n mod sessions>`, as the turns of a chat do (a gateway
    with session affinity keeps a session on one engine). 0: no header."""
    extra_body: dict[str, Any] = Field(default_factory=dict)
    """Fields added to every request body (e.g. `ignore_eos: true` for vLLM);
    the scenario's own fields (model, messages/prompt, max_tokens, stream) win."""

    _tier_names = field_validator("tiers")(check_tier_names)

    @model_validator(mode="after")
    def _consistent(self) -> BenchScenario:
        errors: list[str] = []
        names: dict[str, int] = {}
        tenant_tier: dict[str, tuple[str, int]] = {}
        for index, cls_ in enumerate(self.classes):
            if cls_.name in names:
                errors.append(
                    f"classes.{index}.name: duplicate class {cls_.name!r} "
                    f"(first at classes.{names[cls_.name]})"
                )
            names.setdefault(cls_.name, index)
            if cls_.tier not in self.tiers:
                errors.append(
                    f"classes.{index}.tier: unknown tier {cls_.tier!r} "
                    f"(tiers: {', '.join(sorted(self.tiers))})"
                )
            seen = tenant_tier.get(cls_.tenant_id)
            if seen is not None and seen[0] != cls_.tier:
                errors.append(
                    f"classes.{index}.tier: tenant {cls_.tenant_id!r} is in tier {seen[0]!r} "
                    f"at classes.{seen[1]}; a tenant has one tier"
                )
            tenant_tier.setdefault(cls_.tenant_id, (cls_.tier, index))
            lengths = cls_.lengths or LengthsOverride()
            if self.lengths is None and (lengths.prompt is None or lengths.output is None):
                errors.append(
                    f"classes.{index}.lengths: needs prompt and output lengths "
                    "(or give the scenario's lengths)"
                )
        if self.mode == "open":
            if self.duration_s is None:
                errors.append("duration_s: required in mode open")
            elif self.warmup_s >= self.duration_s:
                errors.append(f"warmup_s: must be below duration_s ({self.duration_s})")
            if self.sweep is not None:
                errors.append("sweep: only used in mode sweep (set mode: sweep)")
            if any(c.rate_rps is None for c in self.classes) and self.arrivals.rate_rps is None:
                errors.append("arrivals.rate_rps: classes given by share need a total rate")
        else:
            if self.sweep is None:
                errors.append("sweep: required in mode sweep (concurrency and requests or duration_s)")
            if self.duration_s is not None:
                errors.append("duration_s: only used in mode open (a sweep level's is sweep.duration_s)")
            if self.warmup_s:
                errors.append("warmup_s: only used in mode open")
        if errors:
            raise ValueError("\n".join(errors))
        return self

    def class_lengths(self, cls_: BenchClass) -> LengthsConfig:
        """The lengths a class draws from: its own, else the scenario's."""
        return (cls_.lengths or LengthsOverride()).over(self.lengths)


def load_bench_scenario(path: str | Path) -> BenchScenario:
    """Read and validate a bench scenario; raises qosgate.config.ConfigError
    listing each problem with its line."""
    return load_model(BenchScenario, Path(path))
