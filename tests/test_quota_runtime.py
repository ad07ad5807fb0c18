"""Quotas in the live gateway: every reservation is settled exactly once,
whatever way its request ends, and the store ends up holding exactly what
was charged."""

from __future__ import annotations

import asyncio
import random
from collections import Counter
from collections.abc import AsyncIterator

import pytest

from qosgate.backends.base import BackendError, Chunk, GenerationJob
from qosgate.backends.sim_live import SimBackend
from qosgate.config.models import PolicyConfig, QuotaStoreConfig, SimBackendConfig
from qosgate.core.request import Outcome
from qosgate.quotas import MemoryQuotaStore, QuotaGuard, QuotaStore, TenantLimits
from qosgate.runtime import Gateway, GatewayError, Overloaded, QueueFull

TIERS = {
    "gold": {"priority": 0},
    "silver": {"priority": 1, "max_queue_wait_ms": 3},
    "bronze": {"priority": 2, "preemptible": True, "max_queue_len": 30},
}
TENANTS = ["a", "b", "c"]
QUOTAS = {
    "tokens_per_minute": 40_000,
    "requests_per_minute": 120,
    "max_concurrency": 12,
}


class Ledger:
    """Wraps a store and writes down every reservation and settlement."""

    def __init__(self, store: QuotaStore) -> None:
        self.store = store
        self.reserved: dict[str, int] = {}
        self.tenants: dict[str, str] = {}
        self.settlements: Counter[str] = Counter()
        self.charged: dict[str, int] = {}
        self.served: dict[str, bool] = {}
        real_reserve, real_settle = store.reserve, store.settle

        async def reserve(tenant, limits, tokens, request_id, now, **kwargs):
            decision = await real_reserve(tenant, limits, tokens, request_id, now, **kwargs)
            if decision.admitted:
                self.reserved[request_id] = tokens
                self.tenants[request_id] = tenant
            return decision

        async def settle(reservation, charged, served, now):
            self.settlements[reservation.request_id] += 1
            self.charged[reservation.request_id] = charged
            self.served[reservation.request_id] = served
            await real_settle(reservation, charged, served, now)

        store.reserve, store.settle = reserve, settle  # type: ignore[method-assign]
        if isinstance(store, MemoryQuotaStore):
            real_now = store.settle_now

            def settle_now(reservation, charged, served, now):
                self.settlements[reservation.request_id] += 1
                self.charged[reservation.request_id] = charged
                self.served[reservation.request_id] = served
                real_now(reservation, charged, served, now)

            store.settle_now = settle_now  # type: ignore[method-assign]


class FlakyBackend(SimBackend):
    """The simulated GPU, but some requests fail part-way (BackendError)."""

    def __init__(self, cfg: SimBackendConfig, rng: random.Random) -> None:
        super().__init__(cfg)
        self._rng = rng

    def generate(self, job: GenerationJob) -> AsyncIterator[Chunk]:
        inner = super().generate(job)
        fail_at = self._rng.randint(0, 5) if self._rng.random() < 0.15 else None
        return self._flaky(inner, fail_at)

    async def _flaky(self, inner: AsyncIterator[Chunk], fail_at: int | None):
        n = 0
        try:
            async for chunk in inner:
                if n == fail_at:
                    raise BackendError("injected failure")
                n += 1
                yield chunk
        finally:
            await inner.aclose()  # type: ignore[attr-defined]


def policy() -> PolicyConfig:
    return PolicyConfig.model_validate({
        "tiers": TIERS,
        "scheduler": {"preemption": True, "initial_drain_rate": 1e6,
                      "aging": {"interval_ms": 3, "max_boost": 2}},
        "tenants": [{"id": t, "tier": "gold", "quotas": QUOTAS} for t in TENANTS],
    })  # fmt: skip


@pytest.fixture
def store(quota_store):
    return quota_store


@pytest.mark.parametrize("seed", range(3))
async def test_every_reservation_is_settled_once_and_the_store_holds_what_was_charged(
    store, seed: int
) -> None:
    rng = random.Random(seed)
    pol = policy()
    ledger = Ledger(store)
    guard = QuotaGuard(
        store, QuotaStoreConfig(), {t.id: TenantLimits.from_config(t.quotas) for t in pol.tenants}
    )
    backend = FlakyBackend(SimBackendConfig(
        speed=200, max_num_seqs=4, kv_capacity_tokens=4000, output_median_tokens=20
    ), rng)  # fmt: skip
    gw = Gateway(pol, backend, quotas=guard)
    await gw.start()

    n = 150
    progressed = [asyncio.Event() for _ in range(n)]
    streams = {}
    refused_at_door: list[str] = []
    quota_refused = 0

    async def client(i: int) -> None:
        nonlocal quota_refused
        try:
            if i >= 40:
                await progressed[i - 40].wait()
            rid = f"q{i}"
            tenant = rng.choice(TENANTS)
            prompt = rng.randint(1, 400)
            max_tokens = rng.randint(1, 60)
            decision = await guard.reserve(tenant, prompt + max_tokens, rid)
            if not decision.admitted:
                quota_refused += 1
                return
            try:
                stream = gw.submit(
                    request_id=rid, tenant=tenant, tier=rng.choice(list(TIERS)),
                    endpoint="chat", body={"messages": []}, prompt_tokens=prompt,
                    max_tokens=max_tokens, reservation=decision.reservation,
                )  # fmt: skip
            except (QueueFull, Overloaded):
                refused_at_door.append(rid)
                return
            streams[rid] = stream
            if rng.random() < 0.1:
                asyncio.get_running_loop().call_soon(asyncio.current_task().cancel)
            plan = rng.random()
            if plan < 0.1:
                await stream.aclose()
                return
            stop_after = rng.randint(1, 10) if plan < 0.4 else None
            got = 0
            try:
                async for _ in stream:
                    progressed[i].set()
                    got += 1
                    if got == stop_after:
                        break
            except GatewayError:
                pass
            finally:
                await stream.aclose()
        finally:
            progressed[i].set()

    results = await asyncio.gather(
        *(asyncio.create_task(client(i)) for i in range(n)), return_exceptions=True
    )
    assert all(r is None or isinstance(r, asyncio.CancelledError) for r in results)
    await gw.close()  # waits for settlements still in flight

    # Exactly once, for every reservation and nothing else.
    assert set(ledger.settlements) == set(ledger.reserved)
    assert set(ledger.settlements.values()) == {1}
    outcomes = Counter()
    for rid, reserved in ledger.reserved.items():
        charged = ledger.charged[rid]
        stream = streams.get(rid)
        if stream is None:  # refused by admission after the quota passed
            assert rid in refused_at_door
            assert (charged, ledger.served[rid]) == (0, False)
            continue
        req = stream.request
        outcomes[req.outcome] += 1
        if req.outcome is Outcome.COMPLETED:
            assert charged == req.prompt_tokens + req.output_tokens
            assert charged <= reserved
        elif req.outcome in (Outcome.EXPIRED, Outcome.BACKEND_ERROR, Outcome.REJECTED_OVERLOAD):
            # Expired, failed in the queue, or its place taken at the door.
            assert (charged, ledger.served[rid]) == (0, False)
        else:
            assert req.outcome is Outcome.CANCELLED
            outcomes["cancelled after it ran" if stream._ran else "cancelled before"] += 1
            if stream._ran:  # what ran is paid for
                assert charged == req.prompt_tokens + req.output_tokens
                assert ledger.served[rid]
            else:
                assert (charged, ledger.served[rid]) == (0, False)
    assert outcomes[Outcome.COMPLETED] and outcomes[Outcome.CANCELLED]
    assert outcomes[Outcome.BACKEND_ERROR]
    assert outcomes["cancelled after it ran"] and outcomes["cancelled before"]

    # What the store still holds is exactly what was charged (all of it in
    # this minute), the requests served, and nothing in flight.
    guard2 = QuotaGuard(store, QuotaStoreConfig(), guard._limits)
    for tenant in TENANTS:
        usage = {s.kind: s for s in await guard2.usage(tenant)}
        mine = [rid for rid in ledger.reserved if ledger.tenants[rid] == tenant]
        assert usage["tokens_per_minute"].used == sum(ledger.charged[r] for r in mine)
        assert usage["requests_per_minute"].used == sum(ledger.served[r] for r in mine)
        assert usage["max_concurrency"].used == 0

