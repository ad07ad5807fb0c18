"""What the Redis stores (the quota store here, the fleet's work queue, the
batch jobs' store) share:
how they connect, how they load their Lua scripts, and what a failed call
raises."""

from __future__ import annotations

import importlib.resources
from collections.abc import Awaitable, Callable, Iterable
from typing import Any, TypeVar

import redis.asyncio as aioredis
from redis.asyncio.retry import Retry
from redis.backoff import NoBackoff
from redis.exceptions import ConnectionError as RedisConnectionError
from redis.exceptions import RedisError
from redis.exceptions import TimeoutError as RedisTimeoutError

T = TypeVar("T")


def connection_pool(
    url: str,
    *,
    timeout_s: float | None,
    password: str | None,
    pool_class: type[aioredis.ConnectionPool] = aioredis.ConnectionPool,
    **options: Any,
) -> aioredis.ConnectionPool:
    """A pool whose connections retry once on a fresh connection, so that a
    pooled connection the server dropped (a restart) is not taken for an
    outage; more would only delay what the store does about a real one.
    (The retry is the connections' setting: given to a client over a pool of
    its own making, redis-py does not pass it on.)"""
    return pool_class.from_url(
        url,
        socket_timeout=timeout_s,
        socket_connect_timeout=timeout_s,
        retry=Retry(NoBackoff(), retries=1),
        retry_on_error=[RedisConnectionError],
        # A password in the URL wins over this one (redis-py's rule).
        **({"password": password} if password else {}),
        **options,
    )


def register_scripts(
    client: aioredis.Redis, package: str, names: Iterable[str], *, prelude: tuple[str, ...] = ()
) -> list[Any]:
    """The scripts `names` of `package`'s `lua/` folder, one file each, every
    one after the `prelude` files."""
    folder = importlib.resources.files(package) / "lua"
    return [
        client.register_script("\n".join(
            (folder / f"{part}.lua").read_text(encoding="utf-8") for part in (*prelude, name)
        ))
        for name in names
    ]  # fmt: skip


REDIS_FAILURES = (RedisError, OSError)
"""What a call to Redis raises when Redis gives no answer."""


def failure(exc: BaseException, error: Callable[[str], Exception]) -> Exception:
    """`error` saying why Redis gave no answer (`exc`, one of REDIS_FAILURES)."""
    if isinstance(exc, (RedisConnectionError, RedisTimeoutError, OSError)):
        return error(f"redis unreachable: {exc}")
    return error(f"redis failed: {exc}")


async def guarded(call: Awaitable[T], error: Callable[[str], Exception]) -> T:
    """`call`'s answer, or `error` saying why Redis gave none."""
    try:
        return await call
    except REDIS_FAILURES as exc:
        raise failure(exc, error) from exc
