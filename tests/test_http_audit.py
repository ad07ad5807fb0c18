"""The audit trail: every refused request leaves exactly one `refused` line
(status, reason, tenant once known, tier, client address through the trusted
proxies, request ids) and no prompt text; refusals are counted per tenant;
a client's valid X-Request-Id is kept and echoed."""

from __future__ import annotations

import asyncio
import json
from typing import Any

import aiohttp
import pytest
from structlog.testing import capture_logs

from qosgate.http.state import valid_client_request_id
from tests.http_support import ALICE_KEY, MODEL, POLICY_YAML, Served, live_app, make_policy
from tests.test_http_hostile import CASES, Case

CANARY = "zq-canary-prompt-7"
"""Put where the corpus has its prompt text "hi": no log line may carry it."""


def with_canary(case: Case) -> Case:
    if case.body is None:
        return case
    if isinstance(case.body, bytes):
        body: Any = case.body.replace(b'"hi"', f'"{CANARY}"'.encode())
    else:
        body = json.loads(json.dumps(case.body).replace('"hi"', f'"{CANARY}"'))
    return Case(**{**vars(case), "body": body})


def refusals(events: list[dict[str, Any]]) -> list[dict[str, Any]]:
    return [e for e in events if e.get("event") == "refused"]


async def send(http: aiohttp.ClientSession, url: str, case: Case, headers: dict[str, str]):
    body = case.body
    data = body if isinstance(body, bytes) or body is None else json.dumps(body).encode()
    return await http.request(case.method, url + case.path, data=data,
                              headers={**case.headers, **headers})  # fmt: skip


async def test_every_refusal_of_the_hostile_corpus_leaves_one_audit_line_without_the_prompt():
    refused_cases = [with_canary(c) for c in CASES if c.status != 200]
    assert len(refused_cases) >= 40
    problems: list[str] = []
    async with (
        live_app() as live,
        aiohttp.ClientSession(skip_auto_headers={"Content-Type"}) as http,
    ):
        for index, case in enumerate(refused_cases):
            own_id = f"client-id-{index}"
            with capture_logs() as events:
                async with await send(http, live.url, case, {"X-Request-Id": own_id}) as r:
                    raw = await r.read()
                    status, echoed = r.status, r.headers.get("x-request-id")
            lines = refusals(events)
            if len(lines) != 1:
                problems.append(f"{case.name}: {len(lines)} audit lines")
                continue
            line = lines[0]
            code = json.loads(raw)["error"]["code"]
            # Known once the key was checked: not for a route or method that
            # does not exist, nor for a refused identity.
            authenticated = (
                ALICE_KEY in case.headers.get("Authorization", "")
                and code not in ("invalid_api_key", "not_found", "method_not_allowed")
            )
            expected = {
                "status": status, "reason": code, "client": "127.0.0.1",
                "client_request_id": own_id,
                "tenant": "alice" if authenticated else None,
                "tier": "interactive" if authenticated else None,
            }  # fmt: skip
            got = {key: line.get(key) for key in expected}
            if got != expected:
                problems.append(f"{case.name}: {got} != {expected}")
            if echoed != own_id:
                problems.append(f"{case.name}: x-request-id {echoed!r}")
            if len(line.get("request_id") or "") != 32:
                problems.append(f"{case.name}: no request id of the gateway's")
            if CANARY in repr(events):
                problems.append(f"{case.name}: the prompt reached a log line")
    assert not problems, "\n".join(problems)


QUOTA_POLICY = POLICY_YAML.replace(
    "    api_keys: [\"env:QG_TEST_BOB_KEY\"]",
    "    api_keys: [\"env:QG_TEST_BOB_KEY\"]\n    quotas:\n      tokens_per_minute: 10",
)


async def test_quota_refusals_are_audited_and_counted_per_tenant():
    from tests.http_support import BOB_KEY

    body = {"model": MODEL, "prompt": f"{CANARY} " * 40, "max_tokens": 4}
    async with live_app(make_policy(QUOTA_POLICY)) as live, aiohttp.ClientSession() as http:
        with capture_logs() as events:
            async with http.post(live.url + "/v1/completions", json=body,
                                 headers={"Authorization": f"Bearer {BOB_KEY}"}) as r:  # fmt: skip
                assert r.status == 429
                assert (await r.json())["error"]["code"] == "rate_limit_exceeded"
        [line] = refusals(events)
        assert (line["status"], line["reason"], line["tenant"], line["tier"]) == (
            429, "rate_limit_exceeded", "bob", "batch",
        )
        assert CANARY not in repr(events)
        registry = live.gateway.observer.metrics.registry
        assert registry.get_sample_value("qosgate_requests_total", {
            "tier": "batch", "tenant": "bob", "outcome": "rejected_quota", "model": MODEL,
        }) == 1  # fmt: skip


async def test_throttled_and_proxied_refusals_name_the_client_behind_the_proxy():
    text = POLICY_YAML.replace(
        "auth_failures_per_minute: 0", "auth_failures_per_minute: 1\n  trusted_proxies: [127.0.0.1]"
    )
    headers = {"Authorization": "Bearer wrong", "X-Forwarded-For": "203.0.113.7"}
    body = {"model": MODEL, "prompt": CANARY}
    async with live_app(make_policy(text)) as live, aiohttp.ClientSession() as http:
        with capture_logs() as events:
            for want in (401, 429):
                async with http.post(live.url + "/v1/completions", json=body,
                                     headers=headers) as r:  # fmt: skip
                    assert r.status == want
        lines = refusals(events)
        assert [(e["status"], e["reason"], e["client"]) for e in lines] == [
            (401, "invalid_api_key", "203.0.113.7"),
            (429, "too_many_authentication_failures", "203.0.113.7"),
        ]


async def test_a_malformed_head_is_audited_with_the_peer_address():
    # `qosgate serve` itself: its connections answer what aiohttp cannot parse.
    async with Served(make_policy()) as served:
        with capture_logs() as events:
            reader, writer = await asyncio.open_connection(served.host, served.port)
            writer.write(b"GET /" + b"a" * 10_000 + b" HTTP/1.1\r\nHost: x\r\n\r\n")
            await writer.drain()
            head = await reader.readline()
            writer.close()
        assert b" 414 " in head
        [line] = refusals(events)
        assert (line["status"], line["reason"], line["client"]) == (
            414, "uri_too_long", "127.0.0.1"
        )


@pytest.mark.parametrize(
    ("given", "kept"),
    [
        ("3f2c9a1e-7b4d-4c1a-9e2f-0a1b2c3d4e5f", True),
        ("x" * 128, True),
        ("x" * 129, False),
        ("", False),
        ("two words", False),
        ("tab\there", False),
        ("caf\u00e9", False),
    ],
)
def test_a_client_request_id_is_kept_when_printable_and_bounded(given: str, kept: bool):
    assert (valid_client_request_id(given) == given) is kept


async def test_the_gateways_own_id_replaces_an_invalid_one():
    async with live_app() as live, aiohttp.ClientSession() as http:
        body = {"model": MODEL, "prompt": "hi", "max_tokens": 2}
        auth = {"Authorization": f"Bearer {ALICE_KEY}"}
        async with http.post(live.url + "/v1/completions", json=body,
                             headers={**auth, "X-Request-Id": "own-id-1"}) as r:  # fmt: skip
            assert r.status == 200
            assert r.headers["x-request-id"] == "own-id-1"
        async with http.post(live.url + "/v1/completions", json={**body, "stream": True},
                             headers={**auth, "X-Request-Id": "own-id-2"}) as r:  # fmt: skip
            await r.read()
            assert r.headers["x-request-id"] == "own-id-2"
        async with http.post(live.url + "/v1/completions", json=body,
                             headers={**auth, "X-Request-Id": "x" * 200}) as r:  # fmt: skip
            assert len(r.headers["x-request-id"]) == 32
