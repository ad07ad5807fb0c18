"""Identity and request validation, without a server."""

from __future__ import annotations

import hashlib
import logging

import pytest

from qosgate.config.loader import load_policy_text
from qosgate.http.identity import KeyRing
from qosgate.http.validation import parse_json, validate_body
from qosgate.runtime.errors import BadRequest, GatewayError, Unauthorized


def _sha(key: str) -> str:
    return "sha256:" + hashlib.sha256(key.encode()).hexdigest()


def _policy(default_tier: str | None = None, secret_env: str | None = "SECRET_VAR"):
    return load_policy_text(f"""
server:
  trusted_header_secret_env: {secret_env or "null"}
tiers:
  gold: {{priority: 0}}
  free: {{priority: 3}}
tenants:
  - id: acme
    tier: gold
    api_keys: ["{_sha("acme-key")}", "env:ACME_KEY", "env:ACME_SPARE"]
  - id: tiny
    tier: free
default_tier: {default_tier or "null"}
""")


ENV = {"ACME_KEY": "acme-env-key", "SECRET_VAR": "s3cret"}


def _who(ring: KeyRing, **headers: str):
    return tuple(ring.identify(headers))


def test_keys_from_hash_and_environment() -> None:
    ring = KeyRing.from_policy(_policy(), ENV)
    assert _who(ring, Authorization="Bearer acme-key") == ("acme", "gold")
    assert _who(ring, Authorization="bearer acme-env-key") == ("acme", "gold")


def test_unset_variable_is_just_a_missing_key(caplog: pytest.LogCaptureFixture) -> None:
    with caplog.at_level(logging.WARNING):
        ring = KeyRing.from_policy(_policy(), ENV)
    # ACME_SPARE is unset: named in the log, and no empty key exists.
    assert "ACME_SPARE" in caplog.text
    assert "acme-env-key" not in caplog.text and "s3cret" not in caplog.text
    with pytest.raises(Unauthorized):
        ring.identify({"Authorization": "Bearer "})


def test_a_variable_holding_another_tenants_key_is_refused() -> None:
    policy = load_policy_text(f"""
tiers: {{t: {{priority: 0}}}}
tenants:
  - {{id: a, tier: t, api_keys: ["{_sha("shared")}"]}}
  - {{id: b, tier: t, api_keys: ["env:B_KEY"]}}
""")
    with pytest.raises(ValueError, match="already belongs"):
        KeyRing.from_policy(policy, {"B_KEY": "shared"})


@pytest.mark.parametrize(
    "headers",
    [
        {},
        {"Authorization": "Bearer wrong"},
        {"Authorization": "Token acme-key"},
        {"Authorization": "acme-key"},
        {"Authorization": "Bearer " + _sha("acme-key")},
        {"X-Tenant-Id": "acme"},
        {"X-Tenant-Id": "acme", "X-Gateway-Secret": "nope"},
        {"X-Tenant-Id": "acme", "X-Gateway-Secret": "s3cret\u00e9"},
    ],
)
def test_refused(headers: dict[str, str]) -> None:
    ring = KeyRing.from_policy(_policy(), ENV)
    with pytest.raises(Unauthorized) as error:
        ring.identify(headers)
    assert error.value.status == 401


def test_trusted_header() -> None:
    ring = KeyRing.from_policy(_policy(), ENV)
    assert _who(ring, **{"X-Tenant-Id": "tiny", "X-Gateway-Secret": "s3cret"}) == ("tiny", "free")
    with pytest.raises(Unauthorized):  # unknown tenant, no default tier
        ring.identify({"X-Tenant-Id": "ghost", "X-Gateway-Secret": "s3cret"})
    with pytest.raises(BadRequest):
        ring.identify({"X-Tenant-Id": "a b\nc", "X-Gateway-Secret": "s3cret"})


def test_header_not_trusted_without_a_secret() -> None:
    ring = KeyRing.from_policy(_policy(secret_env=None), ENV)
    with pytest.raises(Unauthorized):
        ring.identify({"X-Tenant-Id": "acme", "X-Gateway-Secret": ""})
    # ...and an unset variable does not mean "the empty secret".
    ring = KeyRing.from_policy(_policy(), {})
    with pytest.raises(Unauthorized):
        ring.identify({"X-Tenant-Id": "acme", "X-Gateway-Secret": ""})


def test_default_tier_for_unknown_callers_but_never_for_wrong_keys() -> None:
    ring = KeyRing.from_policy(_policy(default_tier="free"), ENV)
    assert _who(ring) == ("anonymous", "free")
    assert _who(ring, **{"X-Tenant-Id": "newco", "X-Gateway-Secret": "s3cret"}) == ("newco", "free")
    with pytest.raises(Unauthorized):
        ring.identify({"Authorization": "Bearer typo"})


MODELS = ("m",)


@pytest.mark.parametrize(
    ("body", "param"),
    [
        (
            {"model": "m", "messages": [{"role": "user", "content": "x"}], "max_tokens": 0},
            "max_tokens",
        ),
        (
            {"model": "m", "messages": [{"role": "user", "content": "x"}, {"role": "x"}]},
            "messages.1.role",
        ),
        ({"model": "m", "messages": [{"role": "system"}]}, "messages.0.content"),
        (
            {"model": "m", "messages": [{"role": "user", "content": [{"text": "x"}]}]},
            "messages.0.content",
        ),
        ({"model": "m", "messages": [{"role": "user", "content": "x"}], "top_p": -0.1}, "top_p"),
        (
            {
                "model": "m",
                "messages": [{"role": "user", "content": "x"}],
                "stream_options": {"include_usage": 1},
            },
            "stream_options.include_usage",
        ),
    ],
)
def test_validation_names_the_field(body: dict, param: str) -> None:
    with pytest.raises(BadRequest) as error:
        validate_body("chat", body, MODELS)
    assert error.value.param == param
    assert param in error.value.message


def test_validation_keeps_unknown_fields_and_reads_limits() -> None:
    parsed = validate_body(
        "chat",
        {
            "model": "m",
            "messages": [{"role": "user", "content": "x"}],
            "max_tokens": 5,
            "max_completion_tokens": 7,
            "logit_bias": {"1": 2},
            "x_vendor_field": [1],
            "stream": True,
            "stream_options": {"include_usage": True},
        },
        MODELS,
    )
    assert parsed.asked_max_tokens == 7  # the newer name wins
    assert parsed.include_usage
    assert parsed.logit_bias == {"1": 2}
    assert parsed.model_extra == {"x_vendor_field": [1]}
    # A backend that cannot list its models lets any name through.
    assert validate_body("completions", {"model": "other", "prompt": ["p"]}, ()).model == "other"


@pytest.mark.parametrize(
    "raw", [b"", b"{", b"NaN", b"[1e400]", b"\xc3\x28", b"[" * 100_000, b"1" * 10_000]
)
def test_parse_json_refuses_with_400(raw: bytes) -> None:
    with pytest.raises(GatewayError) as error:
        parse_json(raw)
    assert error.value.status == 400
