"""Fixtures shared across test modules."""

from __future__ import annotations

from collections.abc import Iterator

import pytest

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
