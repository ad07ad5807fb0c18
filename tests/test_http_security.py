"""Security at the door: failed authentications are rate-limited per address,
slow clients are bounded by timeouts (headers, body), oversized and malformed
headers get a 4xx, and no prompt text reaches the logs, the metrics or the
stats, on any path."""

from __future__ import annotations

import asyncio
import hashlib
import json
import logging
import re

import aiohttp
import pytest
from structlog.testing import capture_logs

from qosgate.http.identity import AuthFailureLimiter
from tests.http_support import (
    ALICE_KEY,
    ENV,
    MODEL,
    POLICY_YAML,
    ScriptedBackend,
    Served,
    fail_after_one,
    live_app,
    make_policy,
)

WAIT_S = 10.0
ADMIN = "admin-token-for-tests"


# -- the limiter, on a clock the test drives ----------------------------------


def test_an_address_gets_its_allowance_then_waits_for_the_refill():
    limiter = AuthFailureLimiter(per_minute=3)
    for _ in range(3):
        assert limiter.retry_after("10.0.0.1", 0.0) is None
        limiter.failed("10.0.0.1", 0.0)
    # Empty: one failure comes back every 20 s (3 a minute).
    assert limiter.retry_after("10.0.0.1", 0.0) == pytest.approx(20.0)
    assert limiter.retry_after("10.0.0.1", 15.0) == pytest.approx(5.0)
    assert limiter.retry_after("10.0.0.1", 20.0) is None
    # Other addresses are not affected.
    assert limiter.retry_after("10.0.0.2", 0.0) is None
    # A full minute gives the whole allowance back, no more.
    for _ in range(3):
        limiter.failed("10.0.0.1", 100.0)
    assert limiter.retry_after("10.0.0.1", 100.0) is not None


def test_the_limiter_remembers_a_bounded_number_of_addresses():
    limiter = AuthFailureLimiter(per_minute=1, max_addresses=100)
    for i in range(1000):
        limiter.failed(f"10.0.{i // 256}.{i % 256}", 0.0)
    assert len(limiter._left) == 100
    # The most recent are still held back; the oldest are forgotten.
    assert limiter.retry_after("10.0.3.231", 0.0) is not None
    assert limiter.retry_after("10.0.0.0", 0.0) is None


def test_zero_turns_the_limit_off():
    limiter = AuthFailureLimiter(per_minute=0)
    for _ in range(100):
        limiter.failed("10.0.0.1", 0.0)
    assert limiter.retry_after("10.0.0.1", 0.0) is None


# -- over HTTP ------------------------------------------------------------------


def limited_policy(per_minute: int = 3, extra: str = ""):
    text = POLICY_YAML.replace(
        "auth_failures_per_minute: 0", f"auth_failures_per_minute: {per_minute}"
    ).replace("server:\n", f"server:\n  admin_token_env: QG_ADMIN\n{extra}", 1)
    return make_policy(text)


def chat(content: str = "hi", **fields) -> dict:
    return {"model": MODEL, "messages": [{"role": "user", "content": content}],
            "max_tokens": 2, **fields}  # fmt: skip


async def test_failed_authentications_are_limited_per_address():
    env = {**ENV, "QG_ADMIN": ADMIN}
    async with live_app(limited_policy(3), environ=env) as live, aiohttp.ClientSession() as http:
        url = live.url
        good = {"Authorization": f"Bearer {ALICE_KEY}"}
        # A good key costs nothing.
        for _ in range(5):
            async with http.post(url + "/v1/chat/completions", json=chat(), headers=good) as r:
                assert r.status == 200
        # Wrong API keys and a wrong admin token share the address's allowance.
        wrong = [
            ("POST", "/v1/chat/completions", {"Authorization": "Bearer guess-1"}),
            ("GET", "/v1/models", {"Authorization": "Bearer guess-2"}),
            ("GET", "/admin/stats", {"Authorization": "Bearer guess-3"}),
        ]
        for method, path, headers in wrong:
            async with http.request(method, url + path, json=chat(), headers=headers) as r:
                assert r.status == 401
        # Now even the right key is refused unchecked, with when to retry.
        async with http.post(url + "/v1/chat/completions", json=chat(), headers=good) as r:
            assert r.status == 429
            body = await r.json()
            assert body["error"]["code"] == "too_many_authentication_failures"
            assert 0 < int(r.headers["Retry-After"]) <= 20
        async with http.get(url + "/admin/stats",
                            headers={"Authorization": f"Bearer {ADMIN}"}) as r:  # fmt: skip
            assert r.status == 429
        # Refusals are counted as unauthorized requests.
        async with http.get(url + "/metrics") as r:
            metrics = await r.text()
        assert re.search(
            r'qosgate_requests_total\{model="none",outcome="unauthorized",tenant="none",'
            r'tier="none"\} 3.0',
            metrics,
        ), metrics


# -- slow clients and odd headers, against `serve` itself ------------------------


class RawServed(Served):
    """`qosgate serve` with extra `server:` settings, spoken to byte by byte."""

    def __init__(self, extra: str) -> None:
        super().__init__(limited_policy(0, extra))

    async def raw(self, data: bytes) -> tuple[asyncio.StreamReader, asyncio.StreamWriter]:
        reader, writer = await asyncio.open_connection(self.host, self.port)
        writer.write(data)
        await writer.drain()
        return reader, writer

    async def works(self) -> None:
        """A normal request still completes."""
        async with aiohttp.ClientSession() as http, http.post(
            self.url + "/v1/chat/completions",
            json=chat(),
            headers={"Authorization": f"Bearer {ALICE_KEY}"},
        ) as r:
            assert r.status == 200


async def test_a_client_trickling_its_headers_is_disconnected():
    async with RawServed("  idle_timeout_s: 0.3\n") as s:
        loop = asyncio.get_running_loop()
        started = loop.time()
        reader, writer = await s.raw(b"POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\n")
        # Slowloris: a header line now and then, never the blank line.
        closed = asyncio.ensure_future(reader.read())
        for i in range(100):
            done, _ = await asyncio.wait({closed}, timeout=0.05)
            if done:
                break
            writer.write(f"X-Slow-{i}: y\r\n".encode())
        assert closed.done(), "the trickling client was never disconnected"
        assert await closed == b""  # closed without a response
        assert loop.time() - started < 2.0
        writer.close()
        await s.works()


async def test_a_body_that_does_not_arrive_gets_408_and_the_connection_closes():
    async with RawServed("  body_timeout_s: 0.3\n") as s:
        head = (
            "POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\n"
            f"Authorization: Bearer {ALICE_KEY}\r\nContent-Type: application/json\r\n"
            "Content-Length: 500\r\n\r\n"
        )
        loop = asyncio.get_running_loop()
        started = loop.time()
        reader, writer = await s.raw(head.encode() + b'{"model": ')
        async with asyncio.timeout(WAIT_S):
            response = await reader.read()
        # The answer at the timeout, the connection closed about a second
        # later (what aiohttp lets a late body drain in).
        assert loop.time() - started < 2.5
        status_line, _, rest = response.partition(b"\r\n")
        assert status_line == b"HTTP/1.1 408 Request Timeout"
        assert b"Connection: close" in rest
        assert json.loads(rest.split(b"\r\n\r\n", 1)[1])["error"]["code"] == "request_timeout"
        writer.close()
        await s.works()


_HEAD = b"POST /v1/completions HTTP/1.1\r\nHost: x\r\n"
_AUTHED = _HEAD + f"Authorization: Bearer {ALICE_KEY}\r\n".encode()


_MALFORMED = [
    ("header line over 8 KiB", b"GET /healthz HTTP/1.1\r\nHost: x\r\nX-Big: "
     + b"a" * 9000 + b"\r\n\r\n", 431, "request_header_fields_too_large"),
    ("a 100 KB header", b"GET /healthz HTTP/1.1\r\nHost: x\r\nCookie: "
     + b"a" * 100_000 + b"\r\n\r\n", 431, "request_header_fields_too_large"),
    ("500 headers", b"GET /healthz HTTP/1.1\r\nHost: x\r\n"
     + b"".join(b"X-H%d: v\r\n" % i for i in range(500)) + b"\r\n",
     431, "request_header_fields_too_large"),
    ("request line over 4 KiB", b"GET /" + b"a" * 5000 + b" HTTP/1.1\r\nHost: x\r\n\r\n",
     414, "uri_too_long"),
    ("bare CR in a header", b"GET /healthz HTTP/1.1\r\nHost: x\r\nX-A: b\rInjected: c\r\n\r\n",
     400, "malformed_request"),
    ("NUL in a header", b"GET /healthz HTTP/1.1\r\nHost: x\r\nX-A: b\x00c\r\n\r\n",
     400, "malformed_request"),
    ("space before colon", b"GET /healthz HTTP/1.1\r\nHost: x\r\nX-A : b\r\n\r\n",
     400, "malformed_request"),
    ("obsolete line folding", b"GET /healthz HTTP/1.1\r\nHost: x\r\nX-A: b\r\n c\r\n\r\n",
     400, "malformed_request"),
    ("control characters in Content-Type", _HEAD + b"Content-Type: application/\x01json\r\n"
     b"Content-Length: 2\r\n\r\n{}", 400, "malformed_request"),
    ("two content lengths", _HEAD + b"Content-Length: 2\r\nContent-Length: 3\r\n\r\n{}",
     400, "malformed_request"),
    ("smuggling: length and chunked", _HEAD + b"Content-Length: 4\r\n"
     b"Transfer-Encoding: chunked\r\n\r\n0\r\n\r\n", 400, "malformed_request"),
    ("broken chunked encoding", _AUTHED + b"Content-Type: application/json\r\n"
     b"Transfer-Encoding: chunked\r\n\r\nzz\r\n{}\r\n0\r\n\r\n", 400, "malformed_request"),
    ("gzip body that does not inflate", _AUTHED + b"Content-Type: application/json\r\n"
     b"Content-Encoding: gzip\r\nContent-Length: 10\r\n\r\nnot gzip!!", 400,
     "malformed_request"),
    ("malformed request line", b"GET\r\n\r\n", 400, "malformed_request"),
    ("unknown HTTP version", b"GET /healthz HTTP/9.9\r\nHost: x\r\n\r\n",
     400, "malformed_request"),
    ("not HTTP at all", b"\x16\x03\x01\x02\x00\x01\x00\x01\xfc\x03\x03" + b"\x00" * 64,
     400, "malformed_request"),
]


@pytest.mark.parametrize(
    ("name", "request_bytes", "status", "code"), _MALFORMED, ids=[c[0] for c in _MALFORMED]
)
async def test_malformed_and_oversized_requests_get_a_json_4xx_and_an_audit_line(
    name: str, request_bytes: bytes, status: int, code: str, caplog: pytest.LogCaptureFixture
):
    """What aiohttp refuses before the app sees it still answers in OpenAI's
    shape, and is the client's fault in the log: one audit line, no warning,
    no traceback."""
    caplog.set_level(logging.DEBUG)
    with capture_logs() as events:
        async with RawServed("") as s:
            headers = await _send_raw(s, name, request_bytes, status, code)
    logged = [r for r in caplog.records if r.levelno >= logging.WARNING]
    assert not logged, [r.getMessage() for r in logged]
    # Whether aiohttp or the app answered, one line names the request.
    refused = [e for e in events if e.get("request_id") == headers["x-request-id"]]
    assert [(e["event"], e["status"], e["reason"]) for e in refused] == [
        ("refused", status, code)
    ]


async def _send_raw(
    s: RawServed, name: str, request_bytes: bytes, status: int, code: str
) -> dict[str, str]:
    """Sends `request_bytes`, checks the JSON error answer; its headers."""
    reader, writer = await s.raw(request_bytes)
    async with asyncio.timeout(WAIT_S):
        response = await reader.read()
    writer.close()
    head, _, body = response.partition(b"\r\n\r\n")
    status_line, *header_lines = head.decode("latin-1").split("\r\n")
    headers = {k.lower(): v.strip() for k, _, v in (h.partition(":") for h in header_lines)}
    assert int(status_line.split(" ", 2)[1]) == status, (name, response[:300])
    assert headers["content-type"].startswith("application/json"), headers
    error = json.loads(body)["error"]
    assert set(error) == {"message", "type", "code", "param"}
    assert (error["type"], error["code"]) == ("invalid_request_error", code)
    # aiohttp's own message quotes the bytes it choked on (a key, a prompt).
    assert error["message"] and not re.search(r"b'|\\x|aaaa", error["message"])
    assert headers["x-request-id"]
    await s.works()
    return headers


# -- no prompt text in logs, metrics or stats --------------------------------


MARKER = "zebra-quartz-7731"


async def test_no_prompt_text_in_logs_metrics_or_stats(caplog: pytest.LogCaptureFixture):
    """Every path a prompt can take (served, streamed, refused by validation,
    failed by the backend, a bad key, the client leaving) and then every place
    the gateway writes about requests: the marker appears in none."""
    policy = limited_policy(100)
    caplog.set_level(logging.DEBUG)
    backend = ScriptedBackend(fail_after_one)
    env = {**ENV, "QG_ADMIN": ADMIN}
    texts: list[str] = []
    with capture_logs() as events:
        for scripted in (False, True):
            async with live_app(policy, backend if scripted else None, environ=env) as live, \
                    aiohttp.ClientSession() as http:  # fmt: skip
                url = live.url + "/v1/chat/completions"
                good = {"Authorization": f"Bearer {ALICE_KEY}"}
                bodies = [
                    chat(MARKER),
                    chat(MARKER, stream=True),
                    chat(MARKER, temperature="hot"),  # refused by validation
                    chat(MARKER, max_tokens=-1),
                    {"model": MODEL, "prompt": MARKER, "max_tokens": 2},
                    {"model": MARKER, "messages": [{"role": "user", "content": MARKER}]},
                ]
                for body in bodies:
                    async with http.post(url, json=body, headers=good) as r:
                        await r.read()
                async with http.post(url, data=MARKER.encode(), headers=good) as r:
                    await r.read()
                async with http.post(url, json=chat(MARKER),
                                     headers={"Authorization": f"Bearer {MARKER}"}) as r:  # fmt: skip
                    await r.read()
                async with http.get(live.url + "/metrics") as r:
                    texts.append(await r.text())
                async with http.get(live.url + "/admin/stats",
                                    headers={"Authorization": f"Bearer {ADMIN}"}) as r:  # fmt: skip
                    assert r.status == 200
                    texts.append(await r.text())
        assert backend.jobs  # the failing backend was reached
    logged = "\n".join(
        [json.dumps(e, default=str) for e in events]
        + [r.getMessage() + (r.exc_text or "") for r in caplog.records]
    )
    assert events and caplog.records  # something was logged at all
    assert MARKER not in logged
    assert len(texts) == 4
    for text in texts:
        assert "interactive" in text  # the requests are there, their prompts are not
        assert MARKER not in text
    assert hashlib.sha256(MARKER.encode()).hexdigest() not in logged


# -- admin endpoints and stored keys ------------------------------------------


@pytest.mark.parametrize(
    "authorization",
    [None, "Bearer wrong", f"Bearer {ALICE_KEY}", ADMIN, f"Basic {ADMIN}", f"Bearer {ADMIN}x"],
)
async def test_every_admin_endpoint_needs_the_admin_token(authorization: str | None):
    """A tenant's API key, a near miss or another scheme never opens them."""
    env = {**ENV, "QG_ADMIN": ADMIN}
    headers = {"Authorization": authorization} if authorization else {}
    async with live_app(limited_policy(0), environ=env) as live, aiohttp.ClientSession() as http:
        for method, path in (("GET", "/admin/stats"), ("GET", "/admin/quotas"),
                             ("POST", "/admin/reload")):  # fmt: skip
            async with http.request(method, live.url + path, headers=headers) as r:
                assert r.status == 401, (method, path)
                assert (await r.json())["error"]["code"] == "invalid_api_key"
        async with http.get(live.url + "/admin/stats",
                            headers={"Authorization": f"Bearer {ADMIN}"}) as r:  # fmt: skip
            assert r.status == 200


def test_a_plain_key_in_the_policy_is_refused_naming_the_field():
    from qosgate.config.loader import ConfigError

    text = POLICY_YAML.replace('api_keys: ["env:QG_TEST_BOB_KEY"]', 'api_keys: ["my-plain-key"]')
    with pytest.raises(ConfigError) as refused:
        make_policy(text)
    message = str(refused.value)
    assert "tenants" in message and "api_keys" in message
    # The refusal does not repeat the secret it refused.
    assert "my-plain-key" not in message
