"""Scenario files of `qosgate simulate`: who sends what, how fast, and what counts as good.

A scenario names a policy (inline or as a file), the simulated engine, the
traffic (generated classes or a JSONL trace), how results are measured and the
targets the results are checked against. Like the policy models, every model is
frozen and forbids unknown keys, so a typo is an error that names the field.
"""

from __future__ import annotations

import math
import operator
from pathlib import Path
from typing import Annotated, Any, Literal, Union

from pydantic import (
    BeforeValidator,
    Discriminator,
    Field,
    Tag,
    TypeAdapter,
    ValidationInfo,
    field_validator,
    model_validator,
)

from qosgate.config.loader import load_model
from qosgate.config.models import (
    NonNegativeFloat,
    PolicyConfig,
    PositiveFloat,
    PositiveInt,
    SimBackendConfig,
    StrictModel,
)

SchedulerPolicy = Literal["fcfs", "strict", "qos"]

def _existing_file(value: str, info: ValidationInfo, what: str) -> Path:
    # Relative paths inside a scenario (policy file, trace) are relative to the
    # scenario file, which the loader passes as the validation context's base_dir.
    path = Path(value).expanduser()
    if not path.is_absolute():
        context = info.context if isinstance(info.context, dict) else {}
        path = Path(context.get("base_dir") or Path.cwd()) / path
    if not path.is_file():
        raise ValueError(f"{what} file {str(path)!r} not found")
    return path


def _policy_ref(value: Any, info: ValidationInfo) -> Any:
    if not isinstance(value, str):
        return value
    return load_model(PolicyConfig, _existing_file(value, info, "policy"))


def _trace_ref(value: Any, info: ValidationInfo) -> Any:
    if not isinstance(value, str):
        return value
    return str(_existing_file(value, info, "trace"))


class LengthDist(StrictModel):
    """A token count drawn log-normally around a median and clipped to [min, max]."""

    median: PositiveFloat
    """Median token count (exp of the log-normal's mu)."""
    sigma: NonNegativeFloat = 0.0
    """Standard deviation of the log of the count; 0 makes every count the median."""
    min: PositiveInt = 1
    """Smallest count drawn (draws below are raised to it)."""
    max: PositiveInt | None = None
    """Largest count drawn (draws above are cut to it); None: no cap."""

    @model_validator(mode="after")
    def _bounds(self) -> "LengthDist":
        if self.max is not None and self.max < self.min:
            raise ValueError(f"max ({self.max}) must be at least min ({self.min})")
        if self.median < self.min or (self.max is not None and self.median > self.max):
            raise ValueError(f"median ({self.median}) must lie within [min, max]")
        return self


class LengthsConfig(StrictModel):
    """Prompt and output length distributions of a traffic mix."""

    prompt: LengthDist
    """Prompt tokens per request."""
    output: LengthDist
    """Output tokens the request really produces (before max_tokens cuts it)."""


class LengthsOverride(StrictModel):
    """A traffic class's own lengths; what it leaves out comes from the scenario."""

    prompt: LengthDist | None = None
    """Prompt tokens per request (None: the scenario's)."""
    output: LengthDist | None = None
    """True output tokens per request (None: the scenario's)."""

    def over(self, base: LengthsConfig | None) -> LengthsConfig:
        """These lengths, with what they leave out taken from `base`."""
        prompt = self.prompt or (base.prompt if base else None)
        output = self.output or (base.output if base else None)
        assert prompt is not None and output is not None  # guaranteed by validation
        return LengthsConfig(prompt=prompt, output=output)


class ArrivalsConfig(StrictModel):
    """How requests arrive in time."""

    process: Literal["poisson", "gamma"] = "poisson"
    """Inter-arrival distribution: exponential (Poisson process) or gamma."""
    burstiness: PositiveFloat = 1.0
    """Coefficient of variation of the inter-arrival gaps (gamma only). The gamma
    shape is 1/burstiness^2, so 1.0 is a Poisson process, above 1 is burstier
    (clumps and lulls) and below 1 is more regular."""
    rate_rps: PositiveFloat | None = None
    """Total requests per second of the classes given by share."""
    load: PositiveFloat | None = None
    """Total rate as a multiple of the engine's capacity (2.0: twice what it can
    serve); the alternative to rate_rps."""
    capacity_rps: PositiveFloat | None = None
    """Engine capacity in requests/s that `load` multiplies (None: the runner
    measures it on this scenario's length mix)."""

    @model_validator(mode="after")
    def _one_rate(self) -> "ArrivalsConfig":
        if self.rate_rps is not None and self.load is not None:
            raise ValueError("give rate_rps or load, not both")
        return self

    def total_rate(self, capacity_rps: float | None = None) -> float | None:
        """The share classes' total rate: rate_rps, or load x capacity (capacity_rps
        here, else the configured one); None when it cannot be known yet."""
        if self.rate_rps is not None:
            return self.rate_rps
        if self.load is None:
            return None
        capacity = capacity_rps if capacity_rps is not None else self.capacity_rps
        return None if capacity is None else self.load * capacity


class TrafficShape(StrictModel):
    """How one stream of requests arrives: its rate, lengths and on/off cycle
    (shared by `qosgate simulate` classes and `qosgate bench` classes)."""

    share: PositiveFloat | None = None
    """Relative weight in the total rate; the default when neither share nor
    rate_rps is given is 1."""
    rate_rps: PositiveFloat | None = None
    """Absolute requests per second, independent of the total rate."""
    lengths: LengthsOverride | None = None
    """This stream's own prompt/output lengths (None: the scenario's)."""
    on_s: PositiveFloat | None = None
    """On/off streams: seconds of each period during which it sends (at its full rate)."""
    off_s: NonNegativeFloat | None = None
    """On/off streams: seconds of each period during which it is silent."""
    phase_s: NonNegativeFloat = 0.0
    """On/off streams: when the first on period starts (the cycle repeats before it too)."""

    @model_validator(mode="after")
    def _shape(self) -> "TrafficShape":
        if self.share is not None and self.rate_rps is not None:
            raise ValueError("give share or rate_rps, not both")
        if (self.on_s is None) != (self.off_s is None):
            raise ValueError("on_s and off_s go together")
        return self

    @property
    def effective_share(self) -> float:
        """The share this stream takes of the total rate (1 when unspecified)."""
        return 1.0 if self.share is None else self.share

    @property
    def on_fraction(self) -> float:
        """Fraction of time it sends (1 for always-on streams)."""
        if self.on_s is None or self.off_s is None:
            return 1.0
        return self.on_s / (self.on_s + self.off_s)


class TrafficClass(TrafficShape):
    """One tenant's stream of requests. Its tier is the tenant's tier in the policy."""

    tenant: str
    """Tenant id; must be one of the policy's tenants."""
    priority_offset: Annotated[int, Field(ge=0, le=1000)] = 0
    """Levels below its tier's priority that this class's requests ask for."""


class MetricsConfig(StrictModel):
    """How results are measured."""

    window_s: PositiveFloat = 60.0
    """Window for the service-difference fairness metric (B4; docs/SIMULATE.md)."""
    service_w_in: NonNegativeFloat = 1.0
    """Service per prompt token."""
    service_w_out: NonNegativeFloat = 2.0
    """Service per output token."""


class MetricTarget(StrictModel):
    """A check of one number of the result: `metric op value`."""

    name: str
    """Label of the target in reports."""
    metric: str
    """Dotted path into the result JSON, e.g.
    `policies.qos.tiers.interactive.ttft_slo_attainment` (or `reference....`)."""
    op: Literal[">=", "<=", "=="]
    """Comparison."""
    value: float
    """Threshold."""


class RatioTarget(StrictModel):
    """A check of a ratio of two numbers of the result: `numerator / denominator op value`."""

    name: str
    """Label of the target in reports."""
    numerator: str
    """Dotted path of the numerator."""
    denominator: str
    """Dotted path of the denominator."""
    op: Literal[">=", "<=", "=="]
    """Comparison."""
    value: float
    """Threshold for the ratio."""


def _target_kind(value: Any) -> str:
    # The tags appear in error locations, so they must not collide with field
    # names (a tag "metric" would read as the target's `metric` field).
    if isinstance(value, dict):
        return "ratio_target" if "numerator" in value or "denominator" in value else "metric_target"
    return "ratio_target" if isinstance(value, RatioTarget) else "metric_target"


Target = Annotated[
    Union[
        Annotated[MetricTarget, Tag("metric_target")],
        Annotated[RatioTarget, Tag("ratio_target")],
    ],
    Discriminator(_target_kind),
]


class Scenario(StrictModel):
    """A scenario file of `qosgate simulate`."""

    kind: Literal["traffic"] = "traffic"
    """Scenario type."""
    name: str
    """Short name, used in reports and as `scenario` in the result JSON."""
    description: str = ""
    """What the scenario shows."""
    seed: int = 0
    """Seed of the arrival and length draws (same seed, same requests)."""
    duration_s: PositiveFloat
    """Arrivals are generated over [0, duration_s) (trace arrivals beyond it are dropped)."""
    warmup_s: NonNegativeFloat = 0.0
    """Requests arriving before this are served but left out of the metrics."""
    drain_s: NonNegativeFloat = 300.0
    """Most simulated seconds after arrivals stop to let queued work finish;
    requests still unfinished then are cancelled."""
    policy: Annotated[PolicyConfig, BeforeValidator(_policy_ref)]
    """The policy: an inline mapping, or the path of a policy YAML relative to this file."""
    policies: Annotated[tuple[SchedulerPolicy, ...], Field(min_length=1)] = (
        "fcfs",
        "strict",
        "qos",
    )
    """scheduler.policy values to compare on the same arrivals."""
    engine: SimBackendConfig = SimBackendConfig()
    """The simulated GPU (profile, max_num_seqs, ...)."""
    arrivals: ArrivalsConfig = ArrivalsConfig()
    """Arrival process and total rate of the generated classes."""
    lengths: LengthsConfig | None = None
    """Default prompt/output lengths of the classes."""
    max_tokens: Literal["cap", "output"] | PositiveInt = "cap"
    """What clients ask for as max_tokens: "cap" the tier's cap, "output" exactly
    their true output length, or a number (always clamped to the tier's cap; a
    request never produces more than it asked for)."""
    classes: tuple[TrafficClass, ...] = ()
    """Generated traffic, one entry per tenant stream (the alternative to trace)."""
    trace: Annotated[str | None, BeforeValidator(_trace_ref)] = None
    """JSONL trace to replay instead of generated classes (path relative to this file)."""
    metrics: MetricsConfig = MetricsConfig()
    """How results are measured."""
    targets: tuple[Target, ...] = ()
    """Checks on the result JSON."""
    reference_load: PositiveFloat | None = None
    """Also run `reference_policies` at this load and put them under `reference`
    in the result, for targets that compare against another load."""
    reference_policies: tuple[SchedulerPolicy, ...] = ("qos",)
    """Policies of the reference run."""

    @field_validator("policies")
    @classmethod
    def _unique_policies(cls, value: tuple[str, ...]) -> tuple[str, ...]:
        if len(set(value)) != len(value):
            raise ValueError("each policy may appear once")
        return value

    @model_validator(mode="after")
    def _consistent(self) -> "Scenario":
        errors: list[str] = []
        if self.warmup_s >= self.duration_s:
            errors.append(f"warmup_s: must be below duration_s ({self.duration_s})")
        if (self.trace is None) == (not self.classes):
            errors.append("classes, trace: give exactly one of generated classes or a trace")
        known = {tenant.id for tenant in self.policy.tenants}
        for index, cls_ in enumerate(self.classes):
            if cls_.tenant not in known:
                errors.append(
                    f"classes.{index}.tenant: unknown tenant {cls_.tenant!r} "
                    f"(policy tenants: {', '.join(sorted(known)) or 'none'})"
                )
            lengths = cls_.lengths or LengthsOverride()
            if self.lengths is None and (lengths.prompt is None or lengths.output is None):
                errors.append(
                    f"classes.{index}.lengths: needs prompt and output lengths "
                    "(or give the scenario's lengths)"
                )
        if any(cls_.rate_rps is None for cls_ in self.classes):
            if self.arrivals.rate_rps is None and self.arrivals.load is None:
                errors.append(
                    "arrivals: classes given by share need arrivals.rate_rps or arrivals.load"
                )
        for index, target in enumerate(self.targets):
            paths = (
                (target.metric,)
                if isinstance(target, MetricTarget)
                else (target.numerator, target.denominator)
            )
            if any(not path or "" in path.split(".") for path in paths):
                errors.append(f"targets.{index}: empty segment in a dotted path")
        if errors:
            raise ValueError("\n".join(errors))
        return self

    def class_lengths(self, cls_: TrafficClass) -> LengthsConfig:
        """The lengths a class draws from: its own, else the scenario's."""
        return (cls_.lengths or LengthsOverride()).over(self.lengths)


def load_scenario(path: str | Path) -> Scenario:
    """Read and validate a scenario YAML; its relative paths resolve against its
    directory. Raises qosgate.config.ConfigError listing each problem with its line."""
    return load_model(Scenario, Path(path))


# -- targets ---------------------------------------------------------------------------

_MISSING = object()


def _lookup(result: Any, path: str) -> Any:
    """Follow a dotted path; keys may themselves contain dots (tier names may)."""
    parts = path.split(".")
    node = result
    i = 0
    while i < len(parts):
        if isinstance(node, dict):
            # Longest key first, so "tiers.a.b.x" finds a tier named "a.b".
            for j in range(len(parts), i, -1):
                key = ".".join(parts[i:j])
                if key in node:
                    node = node[key]
                    i = j
                    break
            else:
                return _MISSING
        elif isinstance(node, (list, tuple)):
            try:
                node = node[int(parts[i])]
            except (ValueError, IndexError):
                return _MISSING
            i += 1
        else:
            return _MISSING
    return node


def _number(value: Any) -> float | None:
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        return None
    value = float(value)
    return value if math.isfinite(value) else None


_COMPARE = {
    ">=": operator.ge,
    "<=": operator.le,
    "==": lambda value, threshold: math.isclose(value, threshold, rel_tol=1e-9, abs_tol=1e-12),
}


_TARGET: TypeAdapter[MetricTarget | RatioTarget] = TypeAdapter(Target)


def evaluate_targets(targets: Any, result: dict) -> list[dict]:
    """Check each target against a result object.

    Returns one dict per target: name, metric (the path, or "num / den"), value
    (None when a path is missing, not a number, or the denominator is 0), op,
    threshold and passed (a target whose value is None fails).
    """
    checked: list[dict] = []
    for target in targets:
        if isinstance(target, dict):
            target = _TARGET.validate_python(target)
        value: float | None
        if isinstance(target, RatioTarget):
            described = f"{target.numerator} / {target.denominator}"
            num = _number(_lookup(result, target.numerator))
            den = _number(_lookup(result, target.denominator))
            value = None if num is None or den is None or den == 0 else num / den
        else:
            described = target.metric
            value = _number(_lookup(result, target.metric))
        checked.append(
            {
                "name": target.name,
                "metric": described,
                "value": value,
                "op": target.op,
                "threshold": target.value,
                "passed": value is not None and _COMPARE[target.op](value, target.value),
            }
        )
    return checked
