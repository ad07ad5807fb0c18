"""Fixtures shared across test modules."""

from __future__ import annotations

import uuid
from collections.abc import AsyncIterator, Iterator

import pytest

from qosgate.quotas import MemoryQuotaStore, QuotaStore
from qosgate.quotas.redis_store import RedisQuotaStore
from tests.redis_server import RedisServer


@pytest.fixture(scope="session")
def redis_server() -> Iterator[RedisServer]:
    """One real redis-server for the session (tests isolate by key prefix)."""
    with RedisServer() as server:
        yield server


@pytest.fixture
def own_redis_server() -> Iterator[RedisServer]:
    """A redis-server of the test's own, which it may kill and restart (its
    data survives that, as a production server's would)."""
    with RedisServer(durable=True) as server:
        yield server


@pytest.fixture(params=["memory", "redis"])
async def quota_store(request) -> AsyncIterator[QuotaStore]:
    """Each QuotaStore in turn: the test runs once per kind. The Redis one
    gets a key prefix of its own on the session's server."""
    if request.param == "memory":
        store: QuotaStore = MemoryQuotaStore()
    else:
        server = request.getfixturevalue("redis_server")
        store = RedisQuotaStore(server.url, key_prefix=f"test-{uuid.uuid4().hex[:8]}:")
    yield store
    await store.close()
