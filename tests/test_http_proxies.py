"""Behind proxies: client addresses read through the trusted proxies, a
failed-authentication limit that does not lock out everyone behind one
proxy, secrets from the environment or files and never printed, and the
optional token of /metrics."""

from __future__ import annotations

import aiohttp
import pytest

from qosgate.cli import main
from qosgate.config.loader import ConfigError
from qosgate.config.secrets import SecretError, read_secret, redact_url
from qosgate.http.clients import TrustedProxies
from tests.http_support import ALICE_KEY, ENV, MODEL, POLICY_YAML, SECRET, live_app, make_policy

BODY = {"model": MODEL, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2}
CLIENT_A, CLIENT_B = "203.0.113.7", "198.51.100.9"
LIMIT = 30


def proxied_policy(trusted: str = '["127.0.0.1"]', extra: str = ""):
    text = POLICY_YAML.replace(
        "auth_failures_per_minute: 0",
        f"auth_failures_per_minute: {LIMIT}\n  trusted_proxies: {trusted}{extra}",
    )
    return make_policy(text)


async def post(http: aiohttp.ClientSession, url: str, headers: dict[str, str]) -> int:
    async with http.post(url + "/v1/chat/completions", json=BODY, headers=headers) as r:
        await r.read()
        return r.status


async def test_one_client_behind_a_trusted_proxy_locks_out_only_itself():
    # Every connection comes from 127.0.0.1, the proxy; the clients differ
    # only in the address the proxy names. Against a limiter keyed on the
    # connection's address this fails: client B and the signed request get 429.
    async with live_app(proxied_policy()) as live, aiohttp.ClientSession() as http:
        statuses = [
            await post(http, live.url, {
                "Authorization": f"Bearer wrong-{i}", "X-Forwarded-For": CLIENT_A,
            })  # fmt: skip
            for i in range(40)
        ]
        assert statuses == [401] * LIMIT + [429] * (40 - LIMIT)
        # A's good key is now held back too: its address failed.
        a_good = {"Authorization": f"Bearer {ALICE_KEY}", "X-Forwarded-For": CLIENT_A}
        assert await post(http, live.url, a_good) == 429
        b_good = {"Authorization": f"Bearer {ALICE_KEY}", "X-Forwarded-For": CLIENT_B}
        for _ in range(3):
            assert await post(http, live.url, b_good) == 200
        signed = {"X-Tenant-Id": "alice", "X-Gateway-Secret": SECRET}
        assert await post(http, live.url, signed) == 200
        # Signed, it is not held back even naming the locked-out client.
        assert await post(http, live.url, {**signed, "X-Forwarded-For": CLIENT_A}) == 200


async def test_a_signed_request_never_counts_as_a_failure():
    async with live_app(proxied_policy()) as live, aiohttp.ClientSession() as http:
        # Signed, for a tenant the policy does not know (no default tier): 401,
        # and still not counted against the address.
        unknown = {"X-Tenant-Id": "nobody", "X-Gateway-Secret": SECRET, "X-Forwarded-For": CLIENT_A}
        for _ in range(LIMIT + 5):
            assert await post(http, live.url, unknown) == 401
        a_good = {"Authorization": f"Bearer {ALICE_KEY}", "X-Forwarded-For": CLIENT_A}
        assert await post(http, live.url, a_good) == 200


async def test_a_client_that_is_not_a_trusted_proxy_cannot_pick_its_address():
    # 127.0.0.1 is not trusted here: its X-Forwarded-For is ignored, so
    # naming a fresh address with each guess does not refill its allowance.
    async with live_app(proxied_policy('["10.0.0.0/8"]')) as live, aiohttp.ClientSession() as http:
        statuses = [
            await post(http, live.url, {
                "Authorization": f"Bearer wrong-{i}", "X-Forwarded-For": f"192.0.2.{i}",
            })  # fmt: skip
            for i in range(LIMIT + 2)
        ]
        assert statuses[-1] == 429
        assert await post(http, live.url, {"Authorization": f"Bearer {ALICE_KEY}"}) == 429


async def test_a_proxy_naming_no_client_is_not_counted():
    async with live_app(proxied_policy()) as live, aiohttp.ClientSession() as http:
        for i in range(LIMIT + 5):
            assert await post(http, live.url, {"Authorization": f"Bearer wrong-{i}"}) == 401
        assert await post(http, live.url, {"Authorization": f"Bearer {ALICE_KEY}"}) == 200


@pytest.mark.parametrize("header", ["not-an-address", "203.0.113.7, 300.1.1.1"])
async def test_an_unreadable_forwarded_for_is_a_clear_400(header: str):
    async with live_app(proxied_policy()) as live, aiohttp.ClientSession() as http:
        headers = {"Authorization": f"Bearer {ALICE_KEY}", "X-Forwarded-For": header}
        async with http.post(live.url + "/v1/chat/completions", json=BODY, headers=headers) as r:
            assert r.status == 400
            body = await r.json()
        assert body["error"]["code"] == "malformed_request"
        assert "X-Forwarded-For" in body["error"]["message"]


def test_trusted_networks_match_addresses_and_only_them():
    proxies = TrustedProxies(["10.0.0.0/8", "2001:db8::1"])
    assert proxies.trusts("10.1.2.3")
    assert proxies.trusts("2001:db8::1")
    assert not proxies.trusts("11.0.0.1")
    assert not proxies.trusts("not-an-ip")
    assert not proxies.trusts(None)
    assert not TrustedProxies([]).trusts("10.1.2.3")


def test_a_bad_trusted_proxy_entry_names_the_field():
    with pytest.raises(ConfigError) as caught:
        proxied_policy('["10.0.0.0/8", "proxy.local"]')
    assert "server.trusted_proxies" in str(caught.value)
    assert "'proxy.local' is not an IP address or network" in str(caught.value)


# -- secrets ----------------------------------------------------------------------


def test_a_secret_comes_from_its_variable_or_the_file_its_FILE_variable_names(tmp_path):
    path = tmp_path / "token"
    path.write_text("from-a-file\n")
    assert read_secret("TOKEN", {"TOKEN": "from-env", "TOKEN_FILE": str(path)}) == "from-env"
    assert read_secret("TOKEN", {"TOKEN_FILE": str(path)}) == "from-a-file"
    assert read_secret("TOKEN", {}) is None
    assert read_secret(None, {"TOKEN": "x"}) is None
    with pytest.raises(SecretError, match="TOKEN_FILE: cannot read"):
        read_secret("TOKEN", {"TOKEN_FILE": str(tmp_path / "absent")})


def test_redacted_urls_keep_all_but_the_password():
    assert redact_url("redis://:hunter2@redis:6379/0") == "redis://:***@redis:6379/0"
    assert redact_url("rediss://app:hunter2@redis/1") == "rediss://app:***@redis/1"
    assert redact_url("redis://redis:6379/0") == "redis://redis:6379/0"


def test_validate_never_prints_the_redis_password(tmp_path, capsys):
    path = tmp_path / "policy.yaml"
    path.write_text(POLICY_YAML + """
quota_store:
  kind: redis
  url: redis://:hunter2-password@redis.internal:6379/0
""")
    assert main(["validate", str(path)]) == 0
    out = capsys.readouterr().out
    assert "redis.internal" in out
    assert "hunter2" not in out


async def test_the_redis_password_can_come_from_the_environment(redis_server, monkeypatch):
    from qosgate.quotas import build_store
    from qosgate.config.models import QuotaStoreConfig

    monkeypatch.setenv("QG_TEST_REDIS_PASSWORD", "not-the-password")
    store = build_store(QuotaStoreConfig(
        kind="redis", url=redis_server.url, password_env="QG_TEST_REDIS_PASSWORD",
    ))  # fmt: skip
    client = store._redis  # type: ignore[attr-defined]
    assert client.connection_pool.connection_kwargs["password"] == "not-the-password"
    await store.close()
    # Named but unset: refused at start, not a connection without AUTH.
    monkeypatch.delenv("QG_TEST_REDIS_PASSWORD")
    with pytest.raises(SecretError, match="QG_TEST_REDIS_PASSWORD: unset"):
        build_store(QuotaStoreConfig(
            kind="redis", url=redis_server.url, password_env="QG_TEST_REDIS_PASSWORD",
        ))  # fmt: skip


async def test_metrics_can_require_a_token(tmp_path):
    token_file = tmp_path / "metrics-token"
    token_file.write_text("scrape-me\n")
    policy = proxied_policy(extra="\n  metrics_token_env: QG_METRICS")
    environ = {**ENV, "QG_METRICS_FILE": str(token_file)}
    async with live_app(policy, environ=environ) as live, aiohttp.ClientSession() as http:
        async with http.get(live.url + "/metrics") as r:
            assert r.status == 401
        async with http.get(live.url + "/metrics",
                            headers={"Authorization": "Bearer scrape-me"}) as r:  # fmt: skip
            assert r.status == 200
            assert "qosgate_requests_total" in await r.text()


async def test_the_redis_url_can_come_from_a_file(redis_server, tmp_path, monkeypatch):
    from qosgate.config.models import QuotaStoreConfig
    from qosgate.quotas import build_store

    url_file = tmp_path / "redis-url"
    url_file.write_text(redis_server.url + "\n")
    monkeypatch.delenv("QG_TEST_REDIS_URL", raising=False)
    monkeypatch.setenv("QG_TEST_REDIS_URL_FILE", str(url_file))
    cfg = QuotaStoreConfig(kind="redis", url="redis://nowhere.invalid:1/0",
                           url_env="QG_TEST_REDIS_URL")  # fmt: skip
    store = build_store(cfg)
    try:
        assert await store._redis.ping()  # type: ignore[attr-defined]
    finally:
        await store.close()
    monkeypatch.delenv("QG_TEST_REDIS_URL_FILE")
    with pytest.raises(SecretError, match="QG_TEST_REDIS_URL: unset"):
        build_store(cfg)


def test_validate_names_the_url_variable_not_a_url(tmp_path, capsys):
    path = tmp_path / "policy.yaml"
    path.write_text(POLICY_YAML + "quota_store:\n  kind: redis\n  url_env: QG_REDIS_URL\n")
    assert main(["validate", str(path)]) == 0
    assert "(URL from QG_REDIS_URL)" in capsys.readouterr().out
