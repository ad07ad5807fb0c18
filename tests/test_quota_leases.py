"""Concurrency leases live as long as their request: the gateway renews every
running request's lease each third of `lease_s` (one timer, one store call),
so a stream that runs past its first lease keeps its slot; with fail_closed, a
lease the store could not renew in time ends its request. The wall clock the
store sees is the test's; the renewal timer is the loop's own."""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
from collections.abc import AsyncIterator
from typing import Any

import aiohttp

from qosgate.config.models import QuotaStoreConfig
from qosgate.quotas import MemoryQuotaStore, QuotaGuard, TenantLimits
from qosgate.quotas.store import QuotaStoreError
from qosgate.backends.base import Chunk
from tests.http_support import ScriptedBackend, live_app
from tests.test_http_quotas import auth, chat, post, quota_policy

LEASE_S = 0.3
T0 = 1_700_000_000.0


class Clock:
    def __init__(self) -> None:
        self.now = T0

    def __call__(self) -> float:
        return self.now


class WatchedStore(MemoryQuotaStore):
    """The memory store; each renewal sets `renewed` (and fails while `down`)."""

    def __init__(self) -> None:
        super().__init__()
        self.renewed = asyncio.Event()
        self.down = False

    async def renew(self, leases, now, *, lease_s):
        self.renewed.set()
        if self.down:
            raise QuotaStoreError("redis unreachable: test")
        return await super().renew(leases, now, lease_s=lease_s)

    async def next_renewal(self) -> None:
        self.renewed.clear()
        await asyncio.wait_for(self.renewed.wait(), 5)


@dataclasses.dataclass
class Scene:
    """A gateway whose one tenant (max_concurrency 1) has a stream running,
    admitted at T0."""

    store: WatchedStore
    clock: Clock
    quotas: QuotaGuard
    live: Any
    http: aiohttp.ClientSession
    first: aiohttp.ClientResponse
    feed: asyncio.Queue[None]
    """One more token of the stream for each item put."""


@contextlib.asynccontextmanager
async def running_stream(on_error: str = "fail_open") -> AsyncIterator[Scene]:
    policy = quota_policy("{max_concurrency: 1}")
    store, clock = WatchedStore(), Clock()
    cfg = QuotaStoreConfig(lease_s=LEASE_S, on_error=on_error)
    limits = {t.id: TenantLimits.from_config(t.quotas) for t in policy.tenants}
    quotas = QuotaGuard(store, cfg, limits, clock=clock)
    feed: asyncio.Queue[None] = asyncio.Queue()

    async def trickle(job):
        """A stream that runs until it is closed or aborted: a token at once,
        then one per item fed."""
        yield Chunk(text="w ", tokens=1)
        while True:
            await feed.get()
            if job.request_id in backend.aborted:
                return
            yield Chunk(text="w ", tokens=1)

    class FedBackend(ScriptedBackend):
        def abort(self, request_id: str) -> None:
            # As a real backend's: an abort ends the run's stream now.
            super().abort(request_id)
            feed.put_nowait(None)

    backend = FedBackend(trickle)
    async with live_app(policy, backend, quotas=quotas) as live, \
            aiohttp.ClientSession() as http:  # fmt: skip
        first = await http.post(live.url + "/v1/chat/completions", json=chat(stream=True),
                                headers=auth())  # fmt: skip
        assert first.status == 200
        await first.content.readline()  # it runs, holding the slot until T0 + LEASE_S
        yield Scene(store, clock, quotas, live, http, first, feed)


async def test_a_stream_outliving_its_first_lease_keeps_its_slot():
    async with running_stream() as s:
        s.clock.now = T0 + 0.8 * LEASE_S
        await s.store.next_renewal()
        s.clock.now = T0 + 1.6 * LEASE_S  # past the first lease's end
        status, _, body = await post(s.http, s.live, chat())
        assert status == 429, body
        assert b"max_concurrency" in body
        s.first.close()
        await asyncio.wait_for(s.live.gateway.aclosed.wait(), 5)
        # Settled, its lease is no longer renewed, nor taken for one lost.
        await s.quotas.renew()
    assert s.quotas.counters.leases_lost == 0


async def test_fail_closed_ends_a_stream_whose_lease_ran_out_unrenewed():
    async with running_stream("fail_closed") as s:
        s.store.down = True
        s.clock.now = T0 + 0.5 * LEASE_S
        await s.store.next_renewal()  # failed, but the lease has a tick to go
        assert s.quotas.counters.leases_lost == 0
        s.clock.now = T0 + 0.9 * LEASE_S
        await s.store.next_renewal()  # failed, and the lease ends before the next
        rest = await asyncio.wait_for(s.first.content.read(), 5)
        assert b"quota_lease_lost" in rest
    assert s.quotas.counters.leases_lost == 1


async def test_fail_open_lets_a_stream_run_on_when_its_lease_ran_out_unrenewed():
    async with running_stream("fail_open") as s:
        s.store.down = True
        s.clock.now = T0 + 0.9 * LEASE_S
        await s.store.next_renewal()  # failed; the lease ends unrenewed
        s.store.down = False
        s.clock.now = T0 + 1.2 * LEASE_S
        await s.store.next_renewal()  # the store answers: that lease is gone
        assert s.quotas.counters.leases_lost == 1
        for _ in range(6):  # and the stream runs on (b"" would be its end)
            s.feed.put_nowait(None)
            assert await asyncio.wait_for(s.first.content.readline(), 5)
        s.first.close()
        await asyncio.wait_for(s.live.gateway.aclosed.wait(), 5)
