"""`qosgate validate` and `qosgate schema`."""

from __future__ import annotations

import argparse
import json
import sys
from collections import Counter

from qosgate.config.loader import ConfigError, load_policy
from qosgate.config.secrets import redact_url
from qosgate.config.models import (
    OpenAIBackendConfig,
    PolicyConfig,
    RateLimit,
    SimBackendConfig,
    TierConfig,
    VllmBackendConfig,
)
from qosgate.config.scheduling import (
    PREFILL_BUDGET_STEPS,
    PREFILL_BUDGET_STEPS_IN_ORDER,
    backend_in_order,
    backend_step_tokens,
    prefill_budget,
)
from qosgate.core.policy import has_latency_objective

EXIT_OK = 0
EXIT_INVALID = 2

_QUOTA_KINDS = ("tokens_per_minute", "tokens_per_day", "requests_per_minute", "max_concurrency")


def validate_command(args: argparse.Namespace) -> int:
    """Print a summary of a valid policy (0) or every issue of an invalid one (2)."""
    path = args.file
    try:
        policy = load_policy(path)
    except ConfigError as exc:
        count = len(exc.issues)
        print(f"{path}: invalid policy ({count} issue{'s' if count != 1 else ''})", file=sys.stderr)
        for issue in exc.issues:
            print(f"  {issue.render(path)}", file=sys.stderr)
        return EXIT_INVALID
    print(summarize(policy, path))
    warnings = policy_warnings(policy)
    if warnings:
        print(f"\nwarnings ({len(warnings)}):")
        for warning in warnings:
            print(f"  - {warning}")
    return EXIT_OK


def schema_command(args: argparse.Namespace) -> int:
    print(json.dumps(PolicyConfig.model_json_schema(), indent=2))
    return EXIT_OK


def backend_slots(policy: PolicyConfig) -> int | None:
    """The sequences the backend runs at once, where the policy says (None:
    the engine's default, or an upstream's room learned as it runs)."""
    backend = policy.backend
    if isinstance(backend, SimBackendConfig):
        return backend.seqs
    if isinstance(backend, VllmBackendConfig):
        return backend.engine_count("max_num_seqs")
    caps = [upstream.max_concurrency for upstream in backend.upstreams]
    return sum(caps) if all(caps) else None  # type: ignore[arg-type]


def _prefill_budget(policy: PolicyConfig, setting: int | str | None) -> str:
    if setting is None:
        return "off"
    if setting != "auto":
        return f"{setting} tokens"
    in_order = backend_in_order(policy)
    steps = PREFILL_BUDGET_STEPS_IN_ORDER if in_order else PREFILL_BUDGET_STEPS
    what = f"{steps} step{'s' if steps > 1 else ''}"
    if isinstance(policy.backend, OpenAIBackendConfig):
        given = [u.step_tokens for u in policy.backend.upstreams if u.step_tokens]
        if len(given) == len(policy.backend.upstreams):
            return (f"auto ({what} of the upstreams' engines: {sum(given)} tokens as they count "
                    "them, converted to the gateway's count by their usage)")
        return (f"auto ({what} of the upstreams' engines: their step_tokens, or else learned "
                "from their vLLM metrics; off while none has one)")
    step = backend_step_tokens(policy)
    budget = prefill_budget(setting, step, in_order=in_order)
    if budget is None and isinstance(policy.backend, VllmBackendConfig):
        return f"auto ({what} of the engine's max_num_batched_tokens, read once it is up)"
    if budget is None:
        return "auto (off: the engine's tokens per step are not known here)"
    return f"auto ({budget} tokens: {what} of {step})"


def policy_warnings(policy: PolicyConfig) -> list[str]:
    """Settings that validate but probably do not do what the operator wants."""
    warnings: list[str] = []
    scheduler = policy.scheduler
    top_priority = min(tier.priority for tier in policy.tiers.values())
    for name, tier in policy.tiers.items():
        if tier.ttft_slo_ms is None and tier.e2e_slo_ms is None:
            warnings.append(
                f"tier {name!r} has neither ttft_slo_ms nor e2e_slo_ms: "
                "its SLO attainment cannot be judged"
            )
        # A delay tier runs on what the tiers above it leave (its share only
        # divides what the tiers with a latency objective leave): under their
        # sustained load only its expiry bounds its wait.
        if has_latency_objective(tier) and tier.min_share:
            warnings.append(
                f"tier {name!r} (on_timeout: reject) has min_share {tier.min_share:g}: a share "
                "never passes a tier with a latency objective, and such a tier is never "
                "passed by one, so it has no effect"
            )
        if (scheduler.policy != "fcfs" and tier.on_timeout == "delay"
                and tier.priority > top_priority and tier.expiry_ms is None):
            warnings.append(
                f"tier {name!r} (on_timeout: delay) never expires (neither expire_after_ms "
                "nor e2e_slo_ms): under sustained load from the tiers above it, its wait "
                "is unbounded"
            )
    slots = backend_slots(policy)
    if (scheduler.policy != "fcfs" and slots is not None and scheduler.reserve.slots
            and scheduler.reserve.slots >= slots):
        warnings.append(
            f"scheduler.reserve.slots ({scheduler.reserve.slots}) holds all {slots} of the "
            "backend's sequence slots for the top priority level: nothing below it ever runs"
        )
    elif (scheduler.policy != "fcfs" and slots is not None
          and 2 * scheduler.reserve.slots >= slots > 0):
        # Reserved slots stay free whenever no top-level work waits: on a
        # small engine a large reserve is mostly idle capacity.
        warnings.append(
            f"scheduler.reserve.slots ({scheduler.reserve.slots}) holds at least half of the "
            f"backend's {slots} sequence slots for the top priority level: work below it runs "
            f"on at most {slots - scheduler.reserve.slots}, even when the top level sends nothing"
        )
    preemptible = [name for name, tier in policy.tiers.items() if tier.preemptible]
    if scheduler.preemption and not preemptible:
        warnings.append("scheduler.preemption is on but no tier is preemptible")
    if preemptible and not scheduler.preemption:
        warnings.append(
            f"tier(s) {', '.join(preemptible)} are preemptible but scheduler.preemption is off"
        )
    used_tiers = {tenant.tier for tenant in policy.tenants} | {policy.default_tier}
    for name in policy.tiers:
        if name not in used_tiers:
            warnings.append(f"tier {name!r} has no tenants and is not the default_tier")
    if policy.server.trusted_header_secret_env is None:
        keyless = [tenant.id for tenant in policy.tenants if not tenant.api_keys]
        if keyless:
            warnings.append(
                f"tenant(s) {', '.join(keyless)} have no api_keys and "
                "server.trusted_header_secret_env is unset: nothing can identify them"
            )
    return warnings


def summarize(policy: PolicyConfig, source: str) -> str:
    scheduler = policy.scheduler
    fairness = scheduler.fairness
    if fairness == "vtc":
        fairness += f" (w_in {scheduler.vtc.w_in:g}, w_out {scheduler.vtc.w_out:g})"
    aging = (
        f"{_ms(scheduler.aging.interval_ms)}/level, max boost {scheduler.aging.max_boost}"
        if scheduler.aging.max_boost
        else "off"
    )
    out = [
        f"{source}: valid policy (version {policy.version})",
        "",
        f"server     {policy.server.host}:{policy.server.port}",
        f"backend    {_backend(policy)}",
        f"scheduler  {scheduler.policy}  fairness {fairness}  aging {aging}  "
        f"admission {_on(scheduler.admission)}  preemption {_on(scheduler.preemption)}  "
        f"prefill budget {_prefill_budget(policy, scheduler.prefill_budget_tokens)}  "
        f"delay tiers' prefill {_prefill_budget(policy, scheduler.delay_prefill_tokens)}",
        "",
        _tier_table(policy),
        "",
    ]
    per_tier = Counter(tenant.tier for tenant in policy.tenants)
    spread = ", ".join(
        f"{name} {per_tier[name]}" for name in _by_priority(policy) if per_tier[name]
    )
    default = policy.default_tier or "none (unknown tenants are refused)"
    out.append(f"tenants    {len(policy.tenants)}" + (f" ({spread})" if spread else ""))
    out.append(f"default    {default}")
    out.append(f"quotas     {_quota_store(policy)}")
    out.extend(_quota_lines(policy))
    return "\n".join(out)


def _backend(policy: PolicyConfig) -> str:
    backend = policy.backend
    if isinstance(backend, SimBackendConfig):
        return f"sim  profile {backend.profile}  model {backend.model}  speed {backend.speed:g}x"
    if isinstance(backend, OpenAIBackendConfig):
        urls = ", ".join(redact_url(upstream.url) for upstream in backend.upstreams)
        return f"openai  {len(backend.upstreams)} upstream(s): {urls}  affinity {backend.affinity}"
    if isinstance(backend, VllmBackendConfig):
        return f"vllm  model {backend.model}"
    raise AssertionError(backend)


def _by_priority(policy: PolicyConfig) -> list[str]:
    return sorted(policy.tiers, key=lambda name: (policy.tiers[name].priority, name))


def _tier_table(policy: PolicyConfig) -> str:
    header = (
        "tier",
        "prio",
        "ttft SLO",
        "e2e SLO",
        "queue budget",
        "queue len",
        "on_timeout",
        "window",
        "max_tokens",
        "preempt",
        "tenants",
    )
    per_tier = Counter(tenant.tier for tenant in policy.tenants)
    rows = [header]
    for name in _by_priority(policy):
        tier = policy.tiers[name]
        tenants = str(per_tier[name]) + (" +default" if name == policy.default_tier else "")
        rows.append(
            (
                name,
                str(tier.priority),
                _ms(tier.ttft_slo_ms),
                _ms(tier.e2e_slo_ms),
                _ms(tier.max_queue_wait_ms),
                str(tier.max_queue_len),
                tier.on_timeout,
                _window(tier),
                str(tier.max_tokens),
                "yes" if tier.preemptible else "no",
                tenants,
            )
        )
    widths = [max(len(row[column]) for row in rows) for column in range(len(header))]
    return "\n".join(
        "  ".join(cell.ljust(width) for cell, width in zip(row, widths, strict=True)).rstrip()
        for row in rows
    )


def _window(tier: TierConfig) -> str:
    if tier.batch.max_wait_ms == 0:
        return "off"
    return f"{_ms(tier.batch.max_wait_ms)}/{tier.batch.max_batch_size}"


def _quota_store(policy: PolicyConfig) -> str:
    store = policy.quota_store
    if store.kind == "memory":
        return "store memory (this process only)"
    where = f"(URL from {store.url_env})" if store.url_env else redact_url(store.url)
    return f"store redis {where}  on_error {store.on_error}"


def _quota_lines(policy: PolicyConfig) -> list[str]:
    """One line per quota kind: how many tenants have it and its range, so the
    summary stays one screen however many tenants there are."""
    lines = []
    for kind in _QUOTA_KINDS:
        limits = [
            _limit(getattr(tenant.quotas, kind))
            for tenant in policy.tenants
            if getattr(tenant.quotas, kind) is not None
        ]
        if not limits:
            continue
        low, high = min(limits), max(limits)
        spread = _count(low) if low == high else f"{_count(low)}-{_count(high)}"
        lines.append(f"  {kind:<20} {len(limits):>3} tenant(s)  {spread}")
    unlimited = sum(
        1
        for tenant in policy.tenants
        if all(getattr(tenant.quotas, kind) is None for kind in _QUOTA_KINDS)
    )
    if unlimited:
        lines.append(f"  {'no quota':<20} {unlimited:>3} tenant(s)")
    return lines


def _limit(value: RateLimit | int) -> int:
    return value.limit if isinstance(value, RateLimit) else value


def _ms(value: float | None) -> str:
    if value is None:
        return "-"
    return f"{value:g} ms" if value < 1000 else f"{value / 1000:g} s"


def _count(value: int) -> str:
    for size, suffix in (
        (10**15, "P"), (10**12, "T"), (1_000_000_000, "G"), (1_000_000, "M"), (1_000, "k")
    ):
        if value >= size:
            return f"{value / size:.3g}{suffix}"
    return str(value)


def _on(flag: bool) -> str:
    return "on" if flag else "off"
