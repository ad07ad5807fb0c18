"""The policy file: tiers, tenants, scheduler, backend, quotas.

Every model is frozen and forbids unknown keys, so a typo in the YAML is an
error that names the field rather than a setting silently ignored.
"""

from __future__ import annotations

import ipaddress
import re
import sys
from typing import Annotated, Any, Literal

from pydantic import (
    BaseModel, BeforeValidator, ConfigDict, Field, ValidationInfo, field_validator, model_validator,
)  # fmt: skip

from qosgate.core.policy import has_latency_objective
from qosgate.profiles import get_profile, resolve_profile

# Unbounded; the scenario files of `qosgate simulate` and `qosgate bench` use them.
PositiveInt = Annotated[int, Field(gt=0)]
PositiveFloat = Annotated[float, Field(gt=0)]
NonNegativeFloat = Annotated[float, Field(ge=0)]

# --- the ranges of the policy's numbers ---------------------------------------------------
# Every number of a policy is finite and bounded, far beyond any sensible
# setting: a value such as 10**400 or .inf must be refused here, naming its
# field, not reach a float conversion, a timer or a Redis script and turn
# into 500s. README.md ("Ranges") lists them.

MAX_DURATION_S = 7 * 86_400
"""One week: the longest timeout, budget, window or lease."""
MAX_DURATION_MS = MAX_DURATION_S * 1000
MAX_COUNT = 10**9
"""Requests, sequences, slots, and the tokens of one request, batch or KV cache."""
MAX_QUOTA = 10**15
"""Quota limits. Below 2**53, so exact as a double: the local limiter and the
Redis store's Lua scripts count in floats, as does the dashboard's JavaScript."""
MIN_FACTOR, MAX_FACTOR = 1e-6, 10**6
"""Weights and speed factors: their ratios stay far from a float's range."""
MAX_LEVEL = 1000
"""Priority levels."""
MAX_SHARES = 0.5
"""Most of the capacity the tiers' guaranteed shares may take together."""
DEFAULT_DELAY_SHARE = 0.05
"""A `delay` tier's min_share when the policy gives none."""
MAX_BODY_BYTES = 1 << 30


def _number(kind: type[int] | type[float], **bounds: float) -> Any:
    """`kind` within `bounds` (Field's gt/ge/le), never a boolean, inf or NaN."""
    high = bounds["le"]
    low = bounds.get("ge", bounds.get("gt"))
    above = "greater than or equal to" if "ge" in bounds else "greater than"

    def plain(value: object) -> object:
        # YAML reads yes/no/true/false as booleans, which pydantic would count as 1 and 0.
        if isinstance(value, bool):
            raise ValueError(f"Input should be a number, not {str(value).lower()}")
        # Pydantic calls an integer past a float's range "not a valid number";
        # the range is what the reader needs.
        if kind is float and isinstance(value, int) and abs(value) > sys.float_info.max:
            if value > 0:
                raise ValueError(f"Input should be less than or equal to {high}")
            raise ValueError(f"Input should be {above} {low}")
        return value

    finite = {"allow_inf_nan": False} if kind is float else {}
    # Field before the validator: the other way round, pydantic checks the bounds
    # apart from the number's schema, loses allow_inf_nan and gives `qosgate
    # schema` raw gt/le keys instead of minimum/maximum.
    return Annotated[kind, Field(**bounds, **finite), BeforeValidator(plain)]


Port = _number(int, ge=0, le=65535)
BodyBytes = _number(int, gt=0, le=MAX_BODY_BYTES)
Level = _number(int, ge=0, le=MAX_LEVEL)
Count = _number(int, gt=0, le=MAX_COUNT)
CountOrZero = _number(int, ge=0, le=MAX_COUNT)
QuotaLimit = _number(int, gt=0, le=MAX_QUOTA)
Seconds = _number(float, gt=0, le=MAX_DURATION_S)
SecondsOrZero = _number(float, ge=0, le=MAX_DURATION_S)
Millis = _number(float, gt=0, le=MAX_DURATION_MS)
MillisOrZero = _number(float, ge=0, le=MAX_DURATION_MS)
WholeMillis = _number(int, gt=0, le=MAX_DURATION_MS)
Factor = _number(float, ge=MIN_FACTOR, le=MAX_FACTOR)
FactorOrZero = _number(float, ge=0, le=MAX_FACTOR)
ByteRate = _number(float, ge=0, le=MAX_BODY_BYTES)
"""Bytes per second (0: no floor)."""
Share = _number(float, ge=0, le=MAX_SHARES)
"""A fraction of the backend's capacity."""
TokenRate = _number(float, ge=MIN_FACTOR, le=MAX_COUNT)
"""Tokens per second; predicted waits divide by it."""


def _not_an_int(value: object) -> object:
    # An integer outside the int branch's range would pass here, as a float.
    if isinstance(value, int) and not isinstance(value, bool):
        raise ValueError("Input should be an integer of at most 64 bits")
    return value


# vLLM checks its own engine arguments when it starts; here their numbers are
# only kept finite, and integers within 64 bits.
EngineArg = (
    str | bool | Annotated[int, Field(ge=-(2**63), le=2**63 - 1)]
    | Annotated[float, Field(allow_inf_nan=False), BeforeValidator(_not_an_int)] | None
)

_NAME = re.compile(r"^[A-Za-z0-9][A-Za-z0-9_.\-]{0,63}$")
_NAME_RULE = "must be 1-64 letters, digits, '_', '.', '-'"


def check_name(value: str | None) -> str | None:
    """The naming rule of tiers, tenants and nodes (bench scenarios' too:
    their names go through these models for the report)."""
    if value is not None and not _NAME.match(value):
        raise ValueError(_NAME_RULE)
    return value


def check_tier_names(value: dict[str, Any]) -> dict[str, Any]:
    for name in value:
        if not _NAME.match(name):
            raise ValueError(f"tier name {name!r}: {_NAME_RULE}")
    return value
_KEY_REF = re.compile(r"^(sha256:[0-9a-f]{64}|env:[A-Za-z_][A-Za-z0-9_]*)$")


def profile_reference(value: str, info: ValidationInfo) -> str:
    """A `profile` field: a built-in's name, or a profile file's path made
    absolute against the file being loaded (validated now)."""
    context = info.context if isinstance(info.context, dict) else {}
    return resolve_profile(value, context.get("base_dir"))


class StrictModel(BaseModel):
    model_config = ConfigDict(frozen=True, extra="forbid", use_attribute_docstrings=True)


class ServerConfig(StrictModel):
    host: str = "127.0.0.1"
    """Address the HTTP API listens on."""
    port: Port = 8080
    """TCP port of the HTTP API (0 picks a free one)."""
    max_body_bytes: BodyBytes = 1 << 20
    """Largest request body accepted; larger bodies get 413."""
    admin_token_env: str | None = "QOSGATE_ADMIN_TOKEN"
    """Environment variable holding the token for /admin endpoints, or
    `<VARIABLE>_FILE` naming a file that holds it (neither set: admin disabled)."""
    trusted_header_secret_env: str | None = None
    """Environment variable holding the shared secret that makes X-Tenant-Id
    trusted, or `<VARIABLE>_FILE` naming a file that holds it."""
    shutdown_grace_s: SecondsOrZero = 25.0
    """After SIGTERM, how long running requests may go on before they are ended
    (queued ones get 503 at once). Below Kubernetes' default 30 s termination
    grace, so the pod exits before it is killed."""
    idle_timeout_s: Seconds = 75.0
    """A connection that sends no complete request for this long is closed: a
    keep-alive connection left idle, or a client trickling its headers."""
    body_timeout_s: Seconds = 30.0
    """The whole request body must arrive within this time of the handler
    asking for it, or the request gets 408."""
    client_stall_timeout_s: Seconds = 60.0
    """A streaming client that reads nothing for this long (the socket's send
    buffer stays full) is dropped and its request cancelled, so a stalled
    reader cannot hold a backend slot."""
    auth_failures_per_minute: CountOrZero = 30
    """Failed authentications one client address may make per minute before
    its requests get 429 without being checked (0: no limit). Requests that
    carry the front gateway's secret are never counted nor held back."""
    trusted_proxies: Annotated[tuple[str, ...], Field(max_length=1024)] = ()
    """Addresses or networks (CIDR) of the proxies and load balancers in
    front: from a connection of one of them, the client's address is the
    nearest untrusted one in X-Forwarded-For. It is the address the
    failed-authentication limit counts and the logs show; failures reported
    by a trusted proxy itself, naming no client, are not counted."""
    metrics_token_env: str | None = None
    """Environment variable holding a bearer token that /metrics then
    requires (unset: /metrics is open)."""
    policy_watch_s: Seconds | None = None
    """How often the policy file is read for a change of content; a changed
    file is reloaded as SIGHUP would (a Kubernetes ConfigMap volume changes by
    a symlink swap, and no signal reaches the process). None: reload only on
    SIGHUP and POST /admin/reload."""

    @field_validator("trusted_proxies")
    @classmethod
    def _proxy_networks(cls, value: tuple[str, ...]) -> tuple[str, ...]:
        for entry in value:
            try:
                ipaddress.ip_network(entry, strict=False)
            except ValueError:
                raise ValueError(
                    f"{entry[:100]!r} is not an IP address or network (10.0.0.0/8, fd00::/8)"
                ) from None
        return value


MAX_TRACE_FILES = 1000
"""Rotated trace files kept beside the current one, at most."""


class TraceConfig(StrictModel):
    """A JSONL trace of the requests, one line per request when it ends, in the
    format `qosgate simulate` replays (docs/SIMULATE.md): arrival, tenant, tier,
    token counts and outcome; never prompt or output text."""

    path: Annotated[str, Field(min_length=1, max_length=4096)]
    """The current trace file (relative to the working directory). Rotated
    files are PATH.1 (newest) to PATH.<keep>."""
    rotate_bytes: _number(int, ge=4096, le=1 << 40) = 64 << 20  # type: ignore[valid-type]
    """Size at which the current file is rotated (its last line may cross it)."""
    keep: _number(int, ge=0, le=MAX_TRACE_FILES) = 5  # type: ignore[valid-type]
    """Rotated files kept; older ones are deleted (0: the current file only)."""
    flush_interval_s: _number(float, ge=0.01, le=60) = 1.0  # type: ignore[valid-type]
    """How often the buffered lines are written (and at shutdown)."""
    max_buffered: _number(int, ge=1, le=10**7) = 100_000  # type: ignore[valid-type]
    """Lines held between two flushes at most; beyond it they are dropped and counted."""


class OtelConfig(StrictModel):
    """OpenTelemetry tracing, exported over OTLP/HTTP (needs the `otel` extra:
    `pip install 'qosgate[otel]'`). A span per request, joined to the
    client's `traceparent`, with child spans for admission, queue wait, the
    backend's time to first token and streaming; the trace context goes on
    to the upstream servers and, in fleet mode, to the engine nodes."""

    endpoint: Annotated[str, Field(min_length=1, max_length=4096)] | None = None
    """The OTLP/HTTP traces endpoint, e.g. http://collector:4318/v1/traces
    (None: the exporter's OTEL_EXPORTER_OTLP_* environment variables, else
    http://localhost:4318/v1/traces)."""
    service_name: Annotated[str, Field(min_length=1, max_length=128)] = "qosgate"
    """The `service.name` of the spans."""
    sample_ratio: _number(float, ge=0, le=1) = 1.0  # type: ignore[valid-type]
    """Share of the traces begun here that are kept; a client's `traceparent`
    decides for its own (sampled or not)."""


class ObservabilityConfig(StrictModel):
    """Logs and metrics."""

    log_format: Literal["auto", "json", "console"] = "auto"
    """auto: console on a terminal, JSON lines otherwise (production)."""
    log_requests: bool = True
    """One log line per finished request (id, tenant, tier, outcome, waits, TTFT, tokens)."""
    log_prompts: bool = False
    """Also log each request's prompt (messages or prompt text) when it
    arrives; off by default, as prompts are the tenants' data."""
    metrics_tenant_labels: bool = True
    """Label per-tenant metrics with the tenant; off: one `all` series, for
    fleets with very many tenants."""
    trace: TraceConfig | None = None
    """Write a request trace `qosgate simulate` can replay (None: off)."""
    otel: OtelConfig | None = None
    """OpenTelemetry tracing (None: off)."""


class BatchWindow(StrictModel):
    """How long a tier may hold requests back to form a batch."""

    max_wait_ms: MillisOrZero = 0.0
    """Release a batch once its oldest request has waited this long (0: at once)."""
    max_batch_size: Count = 256
    """Release at once when this many requests of the tier are ready."""
    max_batch_tokens: Count = 1 << 20
    """Release at once when the ready requests hold this many prompt tokens."""


class TierConfig(StrictModel):
    priority: Level
    """0 is the most important; larger numbers are served later."""
    ttft_slo_ms: Millis | None = None
    """Time-to-first-token objective; None for tiers judged end to end only."""
    e2e_slo_ms: Millis | None = None
    """End-to-end latency objective, used when the tier has no TTFT objective."""
    max_queue_wait_ms: Millis = 30_000.0
    """Queue budget: predicted waits beyond it are refused (reject) and queued
    requests reaching it expire (reject) or start ageing (delay)."""
    expire_after_ms: Millis | None = None
    """`delay` tiers: queue wait at which a request stops waiting and expires
    (504). Default: half the tier's e2e_slo_ms, leaving the other half for
    its service, but no less than max_queue_wait_ms; without an e2e_slo_ms,
    none (it waits until served, which under sustained load from the tiers
    above it may be never)."""
    min_share: Share | None = None
    """Under `qos`: the fraction of the tokens released to the backend that
    this tier is guaranteed while it has work queued, against tiers without
    a latency objective: it never passes the queued work of a `reject` tier
    with a queue budget, so under their load the lowest tiers are shed first.
    Default: 0.05 for `delay` tiers (so no delay tier starves another), 0 for
    `reject` tiers."""
    max_queue_len: Count = 10_000
    """Cap on queued requests of this tier; beyond it requests get 429."""
    on_timeout: Literal["reject", "delay"] = "reject"
    """What the queue budget means: refuse/expire, or keep waiting and age."""
    batch: BatchWindow = BatchWindow()
    """Dynamic-batch window for this tier."""
    max_tokens: Count = 4096
    """Cap on a request's max_tokens (larger asks are clamped to it)."""
    default_max_tokens: Count | None = None
    """max_tokens for requests that do not give one (default: the cap)."""
    preemptible: bool = False
    """Whether running requests of this tier may be preempted for higher tiers."""
    min_delivery_bytes_per_s: ByteRate = 1024.0
    """Delivery floor of a stream: while the gateway waits on the client (the
    buffers to it are full, so the backend's slot is held for it), the client
    must take at least this many bytes a second, measured over every
    `delivery_window_s` of such waiting, or its stream ends with a
    `client_too_slow` event and its slot goes to the queue (0: no floor).
    Far below any real reader: a model's SSE output runs at several KB/s."""
    delivery_window_s: Seconds = 60.0
    """Time spent waiting on the client over which the delivery floor is
    judged; also the grace before it is first judged."""

    @model_validator(mode="after")
    def _default_within_cap(self) -> TierConfig:
        if self.default_max_tokens is not None and self.default_max_tokens > self.max_tokens:
            raise ValueError("default_max_tokens must not exceed max_tokens")
        if self.expire_after_ms is not None:
            if self.on_timeout != "delay":
                raise ValueError("expire_after_ms applies to on_timeout: delay tiers only "
                                 "(a reject tier's requests expire at max_queue_wait_ms)")
            if self.expire_after_ms < self.max_queue_wait_ms:
                raise ValueError("expire_after_ms must not be less than max_queue_wait_ms")
        return self

    @property
    def objectives_s(self) -> tuple[float | None, float | None]:
        """(TTFT objective, end-to-end objective) in seconds, as
        Request.met_objective takes them."""
        return (None if self.ttft_slo_ms is None else self.ttft_slo_ms / 1000.0,
                None if self.e2e_slo_ms is None else self.e2e_slo_ms / 1000.0)

    @property
    def expiry_ms(self) -> float | None:
        """Queue wait at which a queued request expires (None: never)."""
        if self.on_timeout == "reject":
            return self.max_queue_wait_ms
        if self.expire_after_ms is not None or self.e2e_slo_ms is None:
            return self.expire_after_ms
        return max(self.max_queue_wait_ms, self.e2e_slo_ms / 2)

    @property
    def delays(self) -> bool:
        """`on_timeout: delay` (the core's TierParams.delays)."""
        return self.on_timeout == "delay"

    @property
    def budget_s(self) -> float:
        """max_queue_wait_ms in seconds (the core's TierParams.budget_s)."""
        return self.max_queue_wait_ms / 1000.0

    @property
    def share(self) -> float:
        """min_share, or its default."""
        if self.min_share is not None:
            return self.min_share
        return DEFAULT_DELAY_SHARE if self.on_timeout == "delay" else 0.0


class AgingConfig(StrictModel):
    """Anti-starvation: a request that has spent its tier's queue budget (on_timeout:
    delay) climbs one priority level per interval, up to max_boost levels."""

    interval_ms: Millis = 2_000.0
    """Time per level of boost."""
    max_boost: Level = 2
    """Most levels a request can climb (0 disables ageing)."""


class VtcConfig(StrictModel):
    """Virtual token counter weights: a tenant's counter grows by
    (w_in * prompt_tokens + w_out * output_tokens) / tenant weight."""

    w_in: FactorOrZero = 1.0
    """Weight of a prompt token."""
    w_out: FactorOrZero = 2.0
    """Weight of an output token."""


class ReserveConfig(StrictModel):
    """Backend capacity held back from work below the top level, so the most
    important requests find room at once instead of waiting for a completion."""

    slots: CountOrZero = 0
    """Sequence slots only top-level work may take."""
    kv_tokens: CountOrZero = 0
    """KV-cache tokens only top-level work may take."""
    arrivals: _number(float, ge=0, le=1) = 0.5  # type: ignore[valid-type]
    """qos only: the most of the backend's sequence slots also kept free for
    the top priority's expected arrivals, when the running requests are not
    expected to free slots for them within its queue budget (requests of one
    length that started together end together, then none for a while; or
    fewer than about six end within the budget); 0: none. The free slots of
    `slots` count toward them."""


class SchedulerConfig(StrictModel):
    policy: Literal["qos", "strict", "fcfs"] = "qos"
    """qos: tiers, ageing, fairness, SLA admission; strict: tiers only; fcfs: one FIFO."""
    fairness: Literal["vtc", "fifo"] = "vtc"
    """How tenants of one tier share it. vtc: by virtual token counters, at the door
    of a tier admitted by its predicted wait (a newcomer behind in its share takes
    the place of one queued request of a tenant ahead), in the release order of any
    other tier; fifo: admission order only."""
    aging: AgingConfig = AgingConfig()
    """Anti-starvation settings."""
    vtc: VtcConfig = VtcConfig()
    """Counter weights for vtc fairness."""
    admission: bool = True
    """Refuse at the door what the predicted wait says cannot meet its budget."""
    preemption: bool = False
    """Allow preempting running requests of preemptible tiers for higher tiers."""
    reserve: ReserveConfig = ReserveConfig()
    """Capacity kept free for the top priority level (qos and strict)."""
    drain_rate_tau_s: Seconds = 10.0
    """Time constant of the drain-rate EWMA (tokens/s the backend completes)."""
    initial_drain_rate: TokenRate | None = None
    """Drain rate (tokens/s) assumed before any measurement (default: backend's hint)."""
    delay_prefill_tokens: Count | Literal["auto"] | None = "auto"
    """Prompt tokens handed to the backend and not yet past their prefill beyond
    which tiers without a latency objective (delay tiers) are held back, so
    that their long prompts, released into a lull, do not queue up in the
    engine ahead of what comes next (qos and strict). auto (the default): as
    for prefill_budget_tokens; null: no limit."""
    prefill_budget_tokens: Count | Literal["auto"] | None = "auto"
    """Prompt tokens handed to the backend and not yet past their prefill (no
    first token) beyond which work below the top priority is held back, so a
    top-priority prompt never queues behind more prefill than this inside the
    engine (qos and strict). A prompt counts until its first token is heard,
    and what is released then reaches the engine a step later at best, so
    part of the budget is always in transit or already prefilled. auto (the
    default): four of the engine's steps (4 x max_num_batched_tokens), or one
    where the engine may take its queue first come, first served (upstream
    servers; scheduling_policy fcfs), where qosgate knows the step (the sim's;
    a vllm engine's, once it is up; each upstream's step_tokens, or else what
    its vLLM metrics show), else no limit; null: no limit."""


class RateLimit(StrictModel):
    """A sliding-window limit: never more than `limit` admitted in any window
    of one period; optionally no more than `burst` of it at once."""

    limit: QuotaLimit
    """The most admitted in any window of one period (a minute or a day)."""
    burst: QuotaLimit | None = None
    """The most that can be taken at once, refilled at limit per period
    (default and at most: the limit)."""

    @model_validator(mode="after")
    def _burst_within_limit(self) -> RateLimit:
        if self.burst is not None and self.burst > self.limit:
            raise ValueError(
                f"burst ({self.burst}) cannot exceed limit ({self.limit}): the window "
                "would refuse the excess anyway"
            )
        return self

    @model_validator(mode="before")
    @classmethod
    def _shorthand(cls, value: object) -> object:
        # `tokens_per_minute: 1000` is the common case; accept it as {limit: 1000}.
        if isinstance(value, int) and not isinstance(value, bool):
            return {"limit": value}
        return value


class TenantQuotas(StrictModel):
    tokens_per_minute: RateLimit | None = None
    """Prompt + output tokens admitted in any 60 s."""
    tokens_per_day: RateLimit | None = None
    """Prompt + output tokens admitted in any 24 h."""
    requests_per_minute: RateLimit | None = None
    """Requests admitted in any 60 s."""
    max_concurrency: Count | None = None
    """Requests queued or running at once."""


class TenantConfig(StrictModel):
    id: str
    """Tenant identifier (metrics label, quota key)."""
    tier: str
    """Name of the tier this tenant's requests go to."""
    weight: Factor = 1.0
    """Share of its tier under vtc fairness, relative to the tier's other tenants."""
    api_keys: tuple[str, ...] = ()
    """Keys as `sha256:<hex>` or `env:VARIABLE` (never the plain key)."""
    quotas: TenantQuotas = TenantQuotas()
    """Token and request quotas."""

    _id_shape = field_validator("id")(check_name)

    @field_validator("api_keys")
    @classmethod
    def _key_shape(cls, value: tuple[str, ...]) -> tuple[str, ...]:
        for key in value:
            if not _KEY_REF.match(key):
                raise ValueError(
                    "each key must be 'sha256:<64 lowercase hex>' or 'env:VARIABLE'; "
                    "plain keys are not stored"
                )
        return value


class QuotaStoreConfig(StrictModel):
    kind: Literal["memory", "redis"] = "memory"
    """memory: one process; redis: replicas share one budget."""
    url: str = "redis://127.0.0.1:6379/0"
    """Redis URL (kind: redis), without its password: see password_env."""
    url_env: str | None = None
    """Environment variable holding the whole Redis URL instead (or
    `<VARIABLE>_FILE` naming a file that holds it): a URL with credentials
    stays out of the policy. Set, it replaces `url`."""
    password_env: str | None = None
    """Environment variable holding the Redis password (or `<VARIABLE>_FILE`
    naming a file that holds it); a password in the URL takes precedence."""
    key_prefix: str = "qosgate:"
    """Namespace for Redis keys."""
    on_error: Literal["fail_open", "fail_closed"] = "fail_open"
    """With Redis unreachable: keep serving on a local limiter, or answer 503."""
    timeout_ms: WholeMillis = 250
    """How long one Redis call may take before Redis counts as down."""
    retry_interval_s: Seconds = 0.25
    """While Redis is down, how long before a request tries it again; the
    requests in between do not wait on it. Also how long a tenant's
    reservations wait, after Redis lost its data, for every gateway to carry
    back what it had admitted."""
    lease_s: Seconds = 30.0
    """A max_concurrency slot is a lease of this long, renewed every third of
    it while its request runs: how soon the slots of a gateway that died come
    back (a request keeps its slot however long it runs)."""


class SimBackendConfig(StrictModel):
    kind: Literal["sim"] = "sim"
    profile: str = "h100-llama3-8b"
    """Cost-model profile of the simulated GPU: a built-in's name, or the path
    of a profile file (it has a `/` or ends in .yaml; relative to the file
    that names it)."""
    speed: Factor = 1.0
    """Real-time speed factor (2.0 runs twice as fast as the modelled GPU)."""
    max_num_seqs: Count | None = None
    """Running sequences at once (default: the profile's)."""
    max_num_batched_tokens: Count | None = None
    """Tokens per engine step (default: the profile's)."""
    enable_chunked_prefill: bool | None = None
    """Split long prefills across steps (default: the profile's)."""
    kv_capacity_tokens: Count | None = None
    """KV cache size in tokens (default: the profile's)."""
    scheduling_policy: Literal["fcfs", "priority"] = "priority"
    """Order of the engine's own waiting queue."""
    model: str = "sim-llama3-8b"
    """Model name served."""

    _known_profile = field_validator("profile")(profile_reference)

    @property
    def seqs(self) -> int:
        """Running sequences at once: max_num_seqs, or its profile's."""
        return self.max_num_seqs or get_profile(self.profile).max_num_seqs

    @property
    def step_tokens(self) -> int:
        """Tokens per engine step: max_num_batched_tokens, or its profile's."""
        return self.max_num_batched_tokens or get_profile(self.profile).max_num_batched_tokens

    @model_validator(mode="after")
    def _step_holds_every_sequence(self) -> SimBackendConfig:
        seqs = self.seqs
        budget = self.step_tokens
        if budget < seqs:
            # As in vLLM: a step must be able to give every running sequence a token.
            raise ValueError(
                f"max_num_batched_tokens ({budget}) must be at least max_num_seqs ({seqs})"
            )
        return self
    output_median_tokens: Count | None = None
    """Output length of the live sim backend. None: every request produces its
    max_tokens. Otherwise a log-normal length with this median (sigma 0.9),
    seeded by the request id so it is deterministic, capped at max_tokens."""


class UpstreamConfig(StrictModel):
    url: str
    """Base URL of an OpenAI-compatible server (…/v1)."""
    max_concurrency: Count | None = None
    """The most requests in flight to this upstream at once: an upper bound on
    the room learned from its metrics (`learn_room`), or, for an upstream that
    reports none, the whole limit. Unset: 1024 over learned room, 64 without."""
    api_key_env: str | None = None
    """Environment variable with the upstream's key."""
    weight: Factor = 1.0
    """Relative share of traffic."""
    learn_room: bool = True
    """Learn how many requests the upstream can run at once from the running and
    waiting requests and KV usage its Prometheus metrics report (vLLM's), and
    send no more, so that a backlog waits in the gateway, in tier order,
    instead of in the upstream's own queue. False: `max_concurrency` alone."""
    metrics_url: str | None = None
    """Where its Prometheus metrics are (default: `url` with a trailing /v1
    replaced by /metrics, where vLLM's OpenAI server serves them)."""
    kv_high_water: _number(float, gt=0, le=1) = 0.9  # type: ignore[valid-type]
    """KV-cache usage (0-1) at or above which its room is held at what it runs
    (`learn_room`): an engine that runs out of KV cache preempts."""
    priority: Literal["auto", "on", "off"] = "auto"
    """Forward each request's engine priority (its level, then its prompt's size
    class; lower first) as the request's `priority` field, as vLLM started with
    `--scheduling-policy priority` takes it. auto: send it until the upstream refuses a request
    for it once (which is retried at once without it), then not to that
    upstream; on: always; off: never. Priority 0 is vLLM's default and is
    not sent."""
    step_tokens: Count | None = None
    """Tokens its engine takes per step (vLLM's `--max-num-batched-tokens`:
    by default 2048 for its OpenAI server on CPUs and most GPUs, 8192 on
    H100/H200, 16384 on B200-class), counted by its tokenizer: the unit of an
    automatic prefill budget in front of it. Unset: learned from its vLLM
    metrics (the tokens-per-step histogram), which give an upper bound: a
    prompt's prefill counts whole in the step it ends, so up to about twice
    the step with prompts shorter than one, and the longest prompt beside
    longer ones."""


class OpenAIBackendConfig(StrictModel):
    kind: Literal["openai"] = "openai"
    upstreams: Annotated[tuple[UpstreamConfig, ...], Field(min_length=1)]
    """The servers requests are routed to."""
    models: tuple[str, ...] = ()
    """Model names served (empty: ask the upstreams)."""
    affinity: Literal["none", "tenant", "session"] = "none"
    """Prefer the same upstream per tenant or per X-Session-Id."""
    health_interval_s: Seconds = 5.0
    """Seconds between health checks."""
    metrics_interval_s: Seconds = 0.25
    """Seconds between reads of each upstream's metrics, for the room it has
    (`learn_room`): between reads, the gateway counts what it sent and what
    finished itself."""
    timeout_s: Seconds = 600.0
    """Upstream request timeout: the most one request may take, start to end."""
    read_timeout_s: Seconds = 60.0
    """A streamed request whose upstream sends nothing for this long (no
    headers, or no next byte of the stream) fails as a backend error (502), so
    a hung upstream does not hold the request until `timeout_s`. It is reset by
    every read, so a long stream that keeps coming is never cut by it; keep it
    above the upstreams' longest time to first token. A request the client
    reads whole is asked of the upstream whole, which sends nothing until it is
    done: `timeout_s` alone bounds those."""
    tokenizer: str | None = None
    """Path of the served model's Hugging Face tokenizer.json, to count prompt
    tokens exactly (quotas reserve them); unset: about 4 characters a token."""


class VllmBackendConfig(StrictModel):
    kind: Literal["vllm"] = "vllm"
    model: str
    """Model path (or name, where a model hub is reachable) for the co-located engine."""
    served_model_name: str | None = None
    """The `model` clients send (default: `model`)."""
    engine_args: dict[str, EngineArg] = {}
    """Further vLLM engine arguments, as vLLM names them: max_num_seqs,
    max_num_batched_tokens, enable_chunked_prefill, max_model_len, dtype,
    enforce_eager, ... (scheduling_policy defaults to priority)."""
    stall_timeout_s: Seconds = 60.0
    """With requests in flight, how long the engine may leave a request it
    took unanswered, or produce no output at all, before it is taken for
    wedged: fenced (the gateway unready, its requests ended 503 with
    Retry-After) and restarted. Keep it above the longest prefill a step can
    hold."""
    restart_backoff_s: Seconds = 1.0
    """Wait before the first try to restart an engine that died or wedged;
    it doubles after each failed try, up to 60 s."""

    def engine_count(self, name: str) -> int | None:
        """A count `engine_args` gives (max_num_seqs, max_num_batched_tokens);
        None where it is not given, so vLLM's own default applies."""
        value = self.engine_args.get(name)
        return value if isinstance(value, int) and not isinstance(value, bool) else None


def _default_backend_kind(value: object) -> object:
    # Every backend model defaults its own `kind`, but a tagged union needs the
    # tag to pick the model; a mapping without one means the simulated GPU.
    if isinstance(value, dict) and "kind" not in value:
        return {"kind": "sim", **value}
    return value


BackendConfig = Annotated[
    SimBackendConfig | OpenAIBackendConfig | VllmBackendConfig,
    Field(discriminator="kind"),
    BeforeValidator(_default_backend_kind),
]


class FleetConfig(StrictModel):
    """Distributed mode: gateway replicas and engine nodes sharing one work
    queue in Redis. Without this section qosgate runs on one node, with no Redis."""

    role: Literal["gateway", "engine"]
    """gateway: take requests over HTTP and queue them for the fleet; engine:
    run the `backend` and pull the most urgent work when it has room."""
    url: str = "redis://127.0.0.1:6379/0"
    """Redis URL of the shared queue (it may be the quota store's)."""
    url_env: str | None = None
    """Environment variable holding the whole Redis URL instead (or
    `<VARIABLE>_FILE` naming a file that holds it): a URL with credentials
    stays out of the policy. Set, it replaces `url`."""
    password_env: str | None = None
    """Environment variable holding the Redis password (or `<VARIABLE>_FILE`
    naming a file that holds it); a password in the URL takes precedence."""
    key_prefix: str = "qosgate:"
    """Namespace of the fleet's keys and channels; every member must agree."""
    node_id: str | None = None
    """This member's name in leases and reply channels (default: host and pid).
    Two live members must never share one."""
    lease_s: Seconds = 5.0
    """How long an engine node's claim on a request lasts unless renewed (it
    renews every third of this): how soon a dead node's work runs elsewhere."""
    timeout_ms: WholeMillis = 2_000
    """How long one Redis call may take before the fleet store counts as down."""
    affinity: Literal["none", "tenant", "session"] = "session"
    """Which requests prefer the engine node that ran their predecessor (for
    its prefix cache), unless that node is saturated: those with the same
    X-Session-Id (session), of the same tenant (tenant), or none."""
    affinity_ttl_s: Seconds = 600.0
    """How long a session or tenant stays bound to its node after its last
    request was taken."""

    _node_name = field_validator("node_id")(check_name)


_WINDOW = re.compile(r"^([1-9][0-9]{0,6})([smhd])$")
_WINDOW_UNIT_S = {"s": 1, "m": 60, "h": 3600, "d": 86_400}


def completion_window_s(window: str) -> float:
    """A batch's `completion_window` ("24h", "90m", ...) in seconds. Raises
    ValueError saying what is allowed."""
    match = _WINDOW.match(window) if isinstance(window, str) else None
    seconds = int(match[1]) * _WINDOW_UNIT_S[match[2]] if match else 0
    if not match or seconds > MAX_DURATION_S:
        raise ValueError(
            "completion_window must be a whole number of s, m, h or d (e.g. \"24h\"), "
            f"at most {MAX_DURATION_S // 86_400} days"
        )
    return float(seconds)


class BatchConfig(StrictModel):
    """OpenAI's Batch API (docs/BATCH.md): files of requests run at a low
    tier as capacity allows, kept on disk so that a restart resumes them."""

    data_dir: str | None = None
    """Directory of the batch database and files (created if missing);
    unset: the /v1/files and /v1/batches routes answer 501. With `store:
    redis` it holds only the files, and every gateway replica must mount
    the same directory."""
    store: Literal["sqlite", "redis"] | None = None
    """Where job records and journals live: sqlite (one gateway:
    `<data_dir>/batches.sqlite3`) or redis (the fleet's Redis: every gateway
    replica answers for every job, one drives each under a lease). Default:
    redis in fleet mode, sqlite otherwise."""
    lease_s: Seconds = 10.0
    """With `store: redis`, how long a replica's hold on a job lasts unless
    renewed (every third of this): how soon another replica takes over the
    jobs of one that died, and about how soon a cancel asked on another
    replica reaches the job's driver (a third of it)."""
    max_file_bytes: BodyBytes = 100 << 20
    """Largest file accepted by POST /v1/files (413 beyond)."""
    max_lines: Count = 50_000
    """Most requests in one batch file."""
    waiting_per_job: _number(int, gt=0, le=4096) = 64  # type: ignore[valid-type]
    """Lines of one job admitted and not yet answering (queued, or in their
    prefill) at once. The job sends another line whenever one starts
    answering, so it takes what capacity other work leaves, as fast as it
    frees, and never floods the tier's queue."""
    in_flight_per_job: _number(int, gt=0, le=4096) = 1024  # type: ignore[valid-type]
    """Lines of one job admitted and not yet ended at once: the most of the
    engine one job may hold. Each line running makes every engine step a
    little longer for all; lower it to trade the job's speed for the other
    tiers' time per token."""
    tier: str | None = None
    """Tier of every tenant's batch lines. Default: the lowest-priority
    `delay` tier (the tenant's own tier when the policy has none)."""
    tenant_tiers: dict[str, str] = {}
    """Tenant id -> the tier of that tenant's batch lines (over `tier`)."""
    retry_initial_s: Seconds = 0.5
    """First wait before a line refused for load or quota is sent again
    (the refusal's Retry-After when it gives one); doubles each time."""
    retry_max_s: Seconds = 30.0
    """Longest wait between two tries of a line."""
    backend_attempts: Count = 3
    """Tries of a line the backend fails (502) before it is an error line."""

    @model_validator(mode="after")
    def _retry_order(self) -> BatchConfig:
        if self.retry_initial_s > self.retry_max_s:
            raise ValueError("retry_initial_s must not exceed retry_max_s")
        return self


class PolicyConfig(StrictModel):
    """The whole policy file."""

    version: Literal[1] = 1
    """Format version of this file."""
    server: ServerConfig = ServerConfig()
    """HTTP server settings."""
    backend: BackendConfig = SimBackendConfig()
    """Where the work runs."""
    scheduler: SchedulerConfig = SchedulerConfig()
    """Scheduling policy."""
    tiers: Annotated[dict[str, TierConfig], Field(min_length=1)]
    """SLA tiers by name."""
    tenants: tuple[TenantConfig, ...] = ()
    """Tenants and their tier, weight, keys and quotas."""
    default_tier: str | None = None
    """Tier for requests of unknown tenants (None: such requests are refused)."""
    quota_store: QuotaStoreConfig = QuotaStoreConfig()
    """Where quota counters live."""
    observability: ObservabilityConfig = ObservabilityConfig()
    """Logs and metrics."""
    fleet: FleetConfig | None = None
    """Distributed mode (None: one node, the default)."""
    batch: BatchConfig = BatchConfig()
    """The Batch API (off unless `data_dir` is set)."""

    _tier_names = field_validator("tiers")(check_tier_names)

    @model_validator(mode="after")
    def _references(self) -> PolicyConfig:
        errors: list[str] = []
        # A share never acts for a tier with a latency objective (it never
        # passes one, nor is such a tier passed by one): not counted.
        shares = sum(tier.share for tier in self.tiers.values()
                     if not has_latency_objective(tier))  # fmt: skip
        if shares > MAX_SHARES:
            errors.append(
                f"tiers: the delay tiers' min_share add up to {shares:g} (defaults included: "
                f"0.05 per delay tier); at most {MAX_SHARES:g}, so the rest of the capacity "
                "still goes by priority"
            )
        seen: dict[str, int] = {}
        for index, tenant in enumerate(self.tenants):
            if tenant.id in seen:
                errors.append(
                    f"tenants.{index}.id: duplicate tenant {tenant.id!r} (first at tenants.{seen[tenant.id]})"
                )
            else:
                seen[tenant.id] = index
            if tenant.tier not in self.tiers:
                errors.append(
                    f"tenants.{index}.tier: unknown tier {tenant.tier!r} "
                    f"(tiers: {', '.join(sorted(self.tiers))})"
                )
        if self.default_tier is not None and self.default_tier not in self.tiers:
            errors.append(f"default_tier: unknown tier {self.default_tier!r}")
        if self.batch.tier is not None and self.batch.tier not in self.tiers:
            errors.append(f"batch.tier: unknown tier {self.batch.tier!r}")
        for tenant_id, tier in self.batch.tenant_tiers.items():
            if tier not in self.tiers:
                errors.append(f"batch.tenant_tiers.{tenant_id}: unknown tier {tier!r}")
        if self.batch.store == "redis" and self.fleet is None:
            errors.append(
                "batch.store: redis keeps batch jobs in the fleet's Redis, which needs a "
                "`fleet:` section; one gateway keeps them in sqlite"
            )
        if self.batch.store is not None and self.batch.data_dir is None:
            errors.append(
                f"batch.store: {self.batch.store} needs batch.data_dir (the directory of the "
                "batch files; with redis, one that every gateway replica mounts)"
            )
        keys: dict[str, str] = {}
        for index, tenant in enumerate(self.tenants):
            for key in tenant.api_keys:
                if key in keys and keys[key] != tenant.id:
                    errors.append(
                        f"tenants.{index}.api_keys: key already belongs to tenant {keys[key]!r}"
                    )
                keys[key] = tenant.id
        if (
            self.fleet is not None
            and isinstance(self.backend, OpenAIBackendConfig)
            and not self.backend.models
        ):
            # A gateway replica never talks to the engines' upstreams, so it
            # cannot learn their models from them.
            errors.append("backend.models: distributed mode needs the served models listed")
        if errors:
            raise ValueError("\n".join(errors))
        return self

    def batch_store(self) -> Literal["sqlite", "redis"]:
        """Where batch jobs are kept: `batch.store`, else redis in fleet mode."""
        return self.batch.store or ("redis" if self.fleet is not None else "sqlite")

    def batch_tier(self, tenant_id: str, own_tier: str) -> str:
        """The tier a tenant's batch lines run at (`batch`'s settings)."""
        batch = self.batch
        tier = batch.tenant_tiers.get(tenant_id) or batch.tier
        if tier is not None:
            return tier
        delay = [(t.priority, name) for name, t in self.tiers.items() if t.on_timeout == "delay"]
        return max(delay)[1] if delay else own_tier

    def tenant(self, tenant_id: str) -> TenantConfig | None:
        return next((tenant for tenant in self.tenants if tenant.id == tenant_id), None)
