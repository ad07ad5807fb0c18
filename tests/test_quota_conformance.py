"""One conformance suite for every QuotaStore: memory and a real Redis.

Every test takes the store from the `store` fixture, which runs it once per
kind; time is passed in (`now`), so nothing sleeps. A differential test then
drives both stores with the same random operations and asserts they answer
alike, and that no sliding minute ever holds more than the limit.
"""

from __future__ import annotations

import asyncio
import random
import uuid

import pytest

from qosgate.config.models import TenantQuotas
from qosgate.quotas import (
    SLOTS,
    MemoryQuotaStore,
    QuotaStore,
    Renewal,
    Reservation,
    SettledTwice,
    TenantLimits,
)
from qosgate.quotas.redis_store import RedisQuotaStore

T0 = 1_700_000_640.0  # a slot boundary for both 1 s and 24 min slots (1440 x 1180556)
LEASE = 600.0


def limits(**quotas) -> TenantLimits:
    return TenantLimits.from_config(TenantQuotas.model_validate(quotas))


@pytest.fixture
def store(quota_store):
    return quota_store


_ids = iter(range(10**9))


async def reserve(store: QuotaStore, lim: TenantLimits, tokens: int, now: float, tenant="t"):
    return await store.reserve(tenant, lim, tokens, f"r{next(_ids)}", now, lease_s=LEASE)


def state(decision, kind):
    return next(s for s in decision.states if s.kind == kind)


# -- admission ----------------------------------------------------------------


async def test_no_limits_admits_and_reports_nothing(store):
    d = await reserve(store, limits(), 10**9, T0)
    assert d.admitted and d.states == ()


async def test_tokens_per_minute_admits_up_to_the_limit_then_refuses(store):
    lim = limits(tokens_per_minute=1000)
    assert (await reserve(store, lim, 600, T0)).admitted
    d = await reserve(store, lim, 400, T0 + 10)
    assert d.admitted
    assert state(d, "tokens_per_minute").remaining == 0
    refused = await reserve(store, lim, 1, T0 + 20)
    assert not refused.admitted
    assert refused.exceeded == "tokens_per_minute"
    assert "tokens_per_minute" in refused.reason
    # The 600 reserved at T0 leave the window once slot T0 no longer overlaps
    # (now - 60, now]: at T0 + 61.
    assert refused.retry_after_s == pytest.approx(41.0)
    assert not (await reserve(store, lim, 1, T0 + 60.9)).admitted
    assert (await reserve(store, lim, 600, T0 + 61)).admitted


async def test_retry_after_counts_only_the_slots_that_must_leave(store):
    lim = limits(tokens_per_minute=1000)
    for i in range(10):
        assert (await reserve(store, lim, 100, T0 + i)).admitted
    refused = await reserve(store, lim, 250, T0 + 30)
    # Three slots (T0, T0+1, T0+2) must leave: the third leaves at T0 + 63.
    assert refused.retry_after_s == pytest.approx(33.0)


async def test_refusal_reserves_nothing(store):
    lim = limits(tokens_per_minute=100, requests_per_minute=5, max_concurrency=3)
    assert (await reserve(store, lim, 80, T0)).admitted
    for _ in range(3):
        assert not (await reserve(store, lim, 50, T0 + 1)).admitted
    d = await reserve(store, lim, 20, T0 + 2)
    assert d.admitted
    assert state(d, "requests_per_minute").used == 2
    assert state(d, "max_concurrency").used == 2


async def test_a_request_larger_than_the_limit_is_refused_with_no_retry(store):
    lim = limits(tokens_per_minute=1000)
    d = await reserve(store, lim, 1001, T0)
    assert not d.admitted and d.retry_after_s is None
    assert "1001" in d.reason and "max_tokens" in d.reason


async def test_requests_per_minute(store):
    lim = limits(requests_per_minute=3)
    for i in range(3):
        assert (await reserve(store, lim, 10**6, T0 + i)).admitted
    d = await reserve(store, lim, 1, T0 + 5)
    assert not d.admitted and d.exceeded == "requests_per_minute"
    assert d.retry_after_s == pytest.approx(56.0)


async def test_tokens_per_day_uses_day_slots(store):
    lim = limits(tokens_per_day=10_000)
    width = 86_400 / SLOTS
    assert (await reserve(store, lim, 10_000, T0)).admitted
    d = await reserve(store, lim, 1, T0 + 3600)
    assert not d.admitted and d.exceeded == "tokens_per_day"
    assert d.retry_after_s == pytest.approx(86_400 + width - 3600)
    assert (await reserve(store, lim, 1, T0 + 86_400 + width)).admitted


async def test_every_limit_must_hold(store):
    lim = limits(tokens_per_minute=10_000, tokens_per_day=1_500)
    assert (await reserve(store, lim, 1000, T0)).admitted
    d = await reserve(store, lim, 1000, T0 + 1)
    assert not d.admitted and d.exceeded == "tokens_per_day"


# -- burst ------------------------------------------------------------------


async def test_burst_bounds_what_is_taken_at_once(store):
    lim = limits(tokens_per_minute={"limit": 6000, "burst": 1000})  # 100 tokens/s refill
    assert (await reserve(store, lim, 1000, T0)).admitted
    d = await reserve(store, lim, 300, T0 + 1)
    assert not d.admitted and d.exceeded == "tokens_per_minute"
    assert d.retry_after_s == pytest.approx(2.0)  # 100 refilled, 200 more to go
    assert (await reserve(store, lim, 300, T0 + 3)).admitted


async def test_a_request_larger_than_the_burst_can_never_pass(store):
    lim = limits(tokens_per_minute={"limit": 6000, "burst": 1000})
    d = await reserve(store, lim, 1001, T0)
    assert not d.admitted and d.retry_after_s is None
    assert d.exceeded == "tokens_per_minute.burst"


# -- settlement ---------------------------------------------------------------


async def test_settlement_refunds_what_was_not_used(store):
    lim = limits(tokens_per_minute=1000)
    d = await reserve(store, lim, 1000, T0)
    assert not (await reserve(store, lim, 500, T0 + 1)).admitted
    await store.settle(d.reservation, 300, True, T0 + 2)
    assert d.reservation.charged == 300
    after = await reserve(store, lim, 700, T0 + 3)
    assert after.admitted
    assert state(after, "tokens_per_minute").used == 1000


async def test_settlement_charges_an_excess(store):
    lim = limits(tokens_per_minute=1000)
    d = await reserve(store, lim, 100, T0)
    await store.settle(d.reservation, 150, True, T0 + 1)
    usage = await store.usage("t", lim, T0 + 2)
    assert state_of(usage, "tokens_per_minute").used == 150


async def test_refund_in_full_gives_the_request_back(store):
    lim = limits(tokens_per_minute=1000, requests_per_minute=1)
    d = await reserve(store, lim, 500, T0)
    assert not (await reserve(store, lim, 1, T0 + 1)).admitted
    await store.settle(d.reservation, 0, False, T0 + 1)
    usage = await store.usage("t", lim, T0 + 1)
    assert state_of(usage, "tokens_per_minute").used == 0
    assert state_of(usage, "requests_per_minute").used == 0
    assert (await reserve(store, lim, 1000, T0 + 2)).admitted


async def test_a_served_request_keeps_its_count(store):
    lim = limits(requests_per_minute=1)
    d = await reserve(store, lim, 5, T0)
    await store.settle(d.reservation, 5, True, T0 + 1)
    assert not (await reserve(store, lim, 5, T0 + 2)).admitted


async def test_refund_into_a_bucket(store):
    lim = limits(tokens_per_minute={"limit": 6000, "burst": 1000})
    d = await reserve(store, lim, 1000, T0)
    await store.settle(d.reservation, 400, True, T0)
    assert (await reserve(store, lim, 600, T0)).admitted
    assert not (await reserve(store, lim, 1, T0)).admitted


async def test_a_late_refund_after_the_window_moved_on_is_harmless(store):
    lim = limits(tokens_per_minute=1000)
    d = await reserve(store, lim, 1000, T0)
    assert (await reserve(store, lim, 1000, T0 + 61)).admitted
    await store.settle(d.reservation, 0, False, T0 + 62)
    usage = await store.usage("t", lim, T0 + 62)
    assert state_of(usage, "tokens_per_minute").used == 1000


async def test_settling_twice_is_refused(store):
    lim = limits(tokens_per_minute=1000)
    d = await reserve(store, lim, 100, T0)
    await store.settle(d.reservation, 0, False, T0)
    with pytest.raises(SettledTwice):
        await store.settle(d.reservation, 0, False, T0)
    # ...and did nothing the second time.
    other = await reserve(store, lim, 1000, T0 + 1)
    assert other.admitted


# -- concurrency -----------------------------------------------------------------


async def test_max_concurrency_holds_and_frees_on_settlement(store):
    lim = limits(max_concurrency=2)
    a = await reserve(store, lim, 1, T0)
    assert (await reserve(store, lim, 1, T0)).admitted
    d = await reserve(store, lim, 1, T0)
    assert not d.admitted and d.exceeded == "max_concurrency"
    assert d.retry_after_s == pytest.approx(1.0)
    await store.settle(a.reservation, 1, True, T0 + 1)
    assert (await reserve(store, lim, 1, T0 + 1)).admitted


async def test_a_slot_whose_holder_died_frees_when_its_lease_ends(store):
    lim = limits(max_concurrency=1)
    assert (await reserve(store, lim, 1, T0)).admitted  # never settled
    assert not (await reserve(store, lim, 1, T0 + LEASE - 1)).admitted
    assert (await reserve(store, lim, 1, T0 + LEASE)).admitted


async def test_a_renewed_lease_outlives_its_first_end(store):
    lim = limits(max_concurrency=1)
    d = await reserve(store, lim, 1, T0)
    rid = d.reservation.request_id
    assert await store.renew({"t": [rid]}, T0 + LEASE - 1, lease_s=LEASE) == Renewal()
    assert not (await reserve(store, lim, 1, T0 + LEASE)).admitted
    assert not (await reserve(store, lim, 1, T0 + 2 * LEASE - 2)).admitted
    assert (await reserve(store, lim, 1, T0 + 2 * LEASE - 1)).admitted


async def test_renewal_never_takes_back_an_ended_lease(store):
    lim = limits(max_concurrency=1)
    expired = await reserve(store, lim, 1, T0)
    lost = await store.renew({"t": [expired.reservation.request_id]}, T0 + LEASE, lease_s=LEASE)
    assert lost == Renewal(lost={("t", expired.reservation.request_id)})
    settled = await reserve(store, lim, 1, T0 + LEASE)
    assert settled.admitted
    await store.settle(settled.reservation, 1, True, T0 + LEASE + 1)
    rid = settled.reservation.request_id
    assert await store.renew({"t": [rid]}, T0 + LEASE + 2, lease_s=LEASE) == Renewal(lost={("t", rid)})
    assert state_of(await store.usage("t", lim, T0 + LEASE + 2), "max_concurrency").used == 0


async def test_one_renewal_covers_every_tenant(store):
    lim = limits(max_concurrency=1)
    a = await reserve(store, lim, 1, T0, tenant="a")
    b = await reserve(store, lim, 1, T0, tenant="b")
    leases = {"a": [a.reservation.request_id], "b": [b.reservation.request_id, "never-held"]}
    assert await store.renew(leases, T0 + LEASE / 2, lease_s=LEASE) == Renewal(lost={("b", "never-held")})
    for tenant in ("a", "b"):
        assert not (await reserve(store, lim, 1, T0 + LEASE, tenant=tenant)).admitted
        assert (await reserve(store, lim, 1, T0 + 1.5 * LEASE, tenant=tenant)).admitted
    assert await store.renew({}, T0, lease_s=LEASE) == Renewal()


async def test_released_slots_free_at_once_and_keep_their_tokens(store):
    lim = limits(max_concurrency=2, tokens_per_minute=100)
    a = await reserve(store, lim, 30, T0, tenant="a")
    assert (await reserve(store, lim, 30, T0, tenant="b")).admitted
    a2 = await reserve(store, lim, 30, T0, tenant="a")
    assert not (await reserve(store, lim, 1, T0 + 1, tenant="a")).admitted
    await store.release({
        "a": [a.reservation.request_id, a2.reservation.request_id, "never-held"],
        "b": [],
    })  # fmt: skip
    # Both of a's slots are back long before their lease ends; b's stays.
    again = await reserve(store, lim, 40, T0 + 2, tenant="a")
    assert again.admitted
    assert state(again, "max_concurrency").used == 1
    assert state(again, "tokens_per_minute").used == 100  # what was reserved stays charged
    assert state(await reserve(store, lim, 1, T0 + 2, tenant="b"), "max_concurrency").used == 2
    await store.release({})


async def test_tenants_are_independent(store):
    lim = limits(tokens_per_minute=100, max_concurrency=1)
    assert (await reserve(store, lim, 100, T0, tenant="a")).admitted
    assert (await reserve(store, lim, 100, T0, tenant="b")).admitted
    assert not (await reserve(store, lim, 1, T0, tenant="a")).admitted


# -- the usage view -------------------------------------------------------------


def state_of(states, kind):
    return next(s for s in states if s.kind == kind)


async def test_usage_reports_used_remaining_and_reset(store):
    lim = limits(tokens_per_minute=1000, requests_per_minute=10, max_concurrency=4)
    await reserve(store, lim, 300, T0)
    await reserve(store, lim, 200, T0 + 5)
    usage = await store.usage("t", lim, T0 + 10)
    tpm = state_of(usage, "tokens_per_minute")
    assert (tpm.used, tpm.remaining, tpm.limit) == (500, 500, 1000)
    assert tpm.reset_s == pytest.approx(56.0)  # slot T0+5 leaves at T0+66
    assert state_of(usage, "requests_per_minute").remaining == 8
    conc = state_of(usage, "max_concurrency")
    assert (conc.used, conc.remaining) == (2, 2)


async def test_usage_is_read_only(store):
    lim = limits(tokens_per_minute=1000, max_concurrency=1)
    for i in range(5):
        await store.usage("t", lim, T0 + i)
    assert (await reserve(store, lim, 1000, T0 + 5)).admitted


# -- atomicity and agreement -------------------------------------------------------


async def test_concurrent_reservations_never_overshoot(store):
    lim = limits(tokens_per_minute=64_000)
    decisions = await asyncio.gather(
        *(reserve(store, lim, 1500, T0 + 0.001 * i) for i in range(128))
    )
    assert sum(d.admitted for d in decisions) == 64_000 // 1500


async def test_both_stores_agree_and_no_minute_holds_more_than_the_limit(redis_server):
    rng = random.Random(7)
    lim = limits(
        tokens_per_minute={"limit": 20_000, "burst": 12_000},
        requests_per_minute=40,
        max_concurrency=6,
    )
    memory = MemoryQuotaStore()
    redis = RedisQuotaStore(redis_server.url, key_prefix=f"diff-{uuid.uuid4().hex[:8]}:")
    try:
        now = T0
        open_: list[tuple[Reservation, Reservation]] = []
        # (reserved at, tokens, known from): reservations, and refunds as
        # negative amounts that count from their settlement on.
        events: list[tuple[float, int, float]] = []
        for step in range(700):
            now += rng.expovariate(4.0)
            if open_ and rng.random() < 0.45:
                m_res, r_res = open_.pop(rng.randrange(len(open_)))
                served = rng.random() < 0.8
                charged = rng.randint(0, m_res.tokens) if served else 0
                await memory.settle(m_res, charged, served, now)
                await redis.settle(r_res, charged, served, now)
                events.append((m_res.at, charged - m_res.tokens, now))
                continue
            if open_ and rng.random() < 0.1:
                # A renewal tick: every open reservation's lease, some lost.
                leases = {"t": [m_res.request_id for m_res, _ in open_]}
                now_lost = await memory.renew(leases, now, lease_s=LEASE)
                assert now_lost == await redis.renew(leases, now, lease_s=LEASE), step
                continue
            tokens = rng.randint(100, 5000)
            rid = f"d{step}"
            m = await memory.reserve("t", lim, tokens, rid, now, lease_s=LEASE)
            r = await redis.reserve("t", lim, tokens, rid, now, lease_s=LEASE)
            assert (m.admitted, m.exceeded) == (r.admitted, r.exceeded), step
            assert m.retry_after_s == pytest.approx(r.retry_after_s, abs=1e-6)
            assert _same_states(m.states, r.states), step
            if m.admitted:
                open_.append((m.reservation, r.reservation))
                events.append((now, tokens, now))
        admissions = [at for at, amount, _ in events if amount > 0]
        assert len(admissions) > 100
        # At each admission, the tokens held by reservations made in the
        # minute up to it, as they stood then: never more than the limit.
        for when in admissions:
            held = sum(a for at, a, known in events if when - 60 < at <= when and known <= when)
            assert held <= 20_000
    finally:
        await redis.close()


def _same_states(a, b) -> bool:
    return all(
        (x.kind, x.limit, x.used, x.remaining) == (y.kind, y.limit, y.used, y.remaining)
        and x.reset_s == pytest.approx(y.reset_s, abs=1e-6)
        for x, y in zip(a, b, strict=True)
    )


# -- recorded reservations (a batch line's) ---------------------------------------


async def test_a_recorded_reservation_settles_exactly_once_whoever_asks(redis_server):
    """A reservation made with `record` can be found by its request id by a
    process that did not make it (a gateway restarted), and settled; any
    second settlement, from the process that made it or from another, moves
    nothing."""
    from qosgate.quotas.redis_store import RedisQuotaStore

    prefix = f"recorded-{next(_ids)}:"
    made = RedisQuotaStore(redis_server.url, key_prefix=prefix)
    later = RedisQuotaStore(redis_server.url, key_prefix=prefix)
    lim = limits(tokens_per_minute=1000, tokens_per_day=10_000)
    try:
        kept = await made.reserve("t", lim, 100, "kept", T0, lease_s=LEASE, record=True)
        lost = await made.reserve("t", lim, 50, "lost", T0, lease_s=LEASE, record=True)
        plain = await made.reserve("t", lim, 10, "plain", T0, lease_s=LEASE)
        assert kept.reservation.recorded and not plain.reservation.recorded
        # The process that made them settles one and dies before the other.
        await made.settle(kept.reservation, 40, True, T0 + 1)
        assert await later.find("t", "kept", lim) is None
        found = await later.find("t", "lost", lim)
        assert (found.tokens, found.at, found.generation) == (50, T0, lost.reservation.generation)
        await later.settle(found, 0, False, T0 + 2)  # the restart refunds it
        twice = await later.find("t", "lost", lim)
        assert twice is None
        # Settled again, by its maker or by the restarted process: nothing moves.
        await made.settle(lost.reservation, 0, False, T0 + 3)
        used = {s.kind: s.used for s in await later.usage("t", lim, T0 + 3)}
        assert used == {"tokens_per_minute": 40 + 10, "tokens_per_day": 40 + 10}
        assert await later.find("t", "plain", lim) is None  # not recorded
    finally:
        await made.close()
        await later.close()


async def test_closing_the_redis_store_closes_its_connections(redis_server):
    """A store's connections end with it: a gateway that reloads its policy
    builds a new store and closes the old one, and each reload must not leave
    a pool of idle connections on the server."""
    import redis.asyncio as aioredis

    watcher = aioredis.Redis.from_url(redis_server.url)

    async def clients() -> int:
        return len(await watcher.client_list())

    try:
        before = await clients()
        store = RedisQuotaStore(redis_server.url, key_prefix=f"close-{next(_ids)}:")
        lim = limits(tokens_per_minute=1000)
        await asyncio.gather(*(store.reserve("t", lim, 1, f"r{n}", T0, lease_s=LEASE)
                               for n in range(4)))  # fmt: skip
        assert await clients() > before
        await store.close()
        assert await clients() == before
    finally:
        await watcher.aclose()
