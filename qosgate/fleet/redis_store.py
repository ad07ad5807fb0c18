"""The fleet work queue in Redis: many gateways enqueue, many engine nodes claim.

Claim (reclaim expired leases, pick a tier, lease), renew, complete, release
and enqueue are each one Lua script (in `lua/`), so two nodes can never lease one item
and a stale holder can never complete an item someone else now holds. The
scripts do only that; everything else (building items, depth, status) is
plain commands.

Keys, all under `{<prefix>}fleet:` (the braces put them in one cluster slot,
which the scripts need since they touch every tier):
  q:<tier>  sorted set, item id -> arrival
  tier, tenant, arrival, attempt, payload   hashes, item id -> field
  holder, node   hashes, item id -> fencing token / node of the live lease
  expiry    sorted set, item id -> lease end
  done      sorted set of ended ids -> when (what refuses a duplicate
            enqueue), trimmed to the retention at each claim
  token     counter of fencing tokens
  affkey    hash, item id -> its affinity key (items that have one)
  bound, bound_at   hash affinity key -> node / sorted set key -> when bound,
            trimmed to the affinity TTL at each claim
  room, seen   hash node -> free slots / sorted set node -> live until
  charge, lane  hashes, item id -> its VTC charge / its member in lane:<tier>
  served    sorted set, tier -> the counter last served there
  lane:<tier>     fair tiers: sorted set of `tenant NUL arrival NUL id`
                  members, all scored 0, so a lexical range is one tenant's
                  items in order (model.lane_key)
  backlog:<tier>  fair tiers: sorted set, backlogged tenant -> counter
  counter:<tier>  sorted set, tenant -> virtual token counter
  qcharge:<tier>  door tiers (FleetTiers.doors): sorted set, backlogged
                  tenant -> the charges of its queued items, summed (a
                  sorted set because ZINCRBY adds doubles as Python does)
  work      hash, item id -> tokens it is expected to take
  qwork     hash, tier -> tokens of its queued items
  rate      hash, node -> tokens/s it drains when full, in thousandths
  inflow, inflow_at   hashes, tier -> its arrival-rate sum (written with
            %.17g, which reads back exactly) / the last arrival it counts
  credit    hash, tier -> its guaranteed share's credit (%.17g), for tiers
            with work queued
  prompt    hash, item id -> its prompt's tokens
  pheld     hash, node -> 1 while its last claim held work below the top
            level back, for its prefill budget (Claim.held_for_prefill) or
            at its reserved slots (Claim.at_reserve): its room is the top
            level's only
Arrivals and lease ends go in and out as Python's `repr` of the float, never
through a Lua number: Redis writes Lua numbers with 14 significant digits,
which would move a wall-clock time by up to a tenth of a millisecond and make
this store disagree with the memory one.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import Callable, Iterable, Sequence
from typing import Any

import redis.asyncio as aioredis
from redis.exceptions import RedisError

from qosgate.core.admission import ArrivalRate
from qosgate.quotas.redis_client import connection_pool, guarded, register_scripts
from qosgate.runtime.errors import WorkQueueError, WorkQueueFull, WorkQueueOverloaded

from .model import (
    NO_PREFILL_LIMIT,
    Claim,
    FleetLoad,
    FleetTiers,
    Lease,
    Prefill,
    TierStandings,
    WorkItem,
    lane_key,
)
from .store import ItemStatus, Notice, QueuedEntry, WorkQueue, milli

log = logging.getLogger(__name__)

_CANCELLED: dict[int, ItemStatus | None] = {0: None, 1: "queued", 2: "leased", 3: "completed"}

RECONNECT_FIRST_S = 0.05
RECONNECT_MAX_S = 5.0
"""Backoff between attempts to subscribe again after losing a pub/sub channel."""

# In the order of the prelude's K_* constants, five to a line as there.
_FIELDS = (
    "tier", "tenant", "arrival", "attempt", "payload",
    "holder", "node", "expiry", "done", "token",
    "affkey", "bound", "bound_at", "room", "seen",
    "charge", "lane", "served", "work", "qwork",
    "rate", "inflow", "inflow_at", "credit", "prompt",
    "pheld",
)  # fmt: skip
# The prelude's K_* constants and F (the per-tier keys follow) assume this.
assert len(_FIELDS) == 26
_PER_TIER = ("q", "lane", "backlog", "counter", "qcharge")
# How many times an enqueue decides again at a door when the item whose place
# it was to take left the queue (a node took it) before the script ran.
_DOOR_TRIES = 3


def _limit(tokens: int | None) -> int | str:
    """A prefill limit as the claim script reads it ('' for none)."""
    return "" if tokens is None else tokens


class RedisWorkQueue(WorkQueue):
    """Queues in Redis, shared by every gateway and engine node pointed at it."""

    name = "redis"

    def __init__(
        self,
        url: str,
        tiers: FleetTiers,
        *,
        key_prefix: str = "qosgate:",
        socket_timeout_s: float = 0.5,
        client: aioredis.Redis | None = None,
        password: str | None = None,
        **retention: float,
    ) -> None:
        """`password`: used where `url` carries none. `retention`: WorkQueue's
        done_retention_s and affinity_ttl_s."""
        super().__init__(tiers, **retention)
        if client is None:
            # A script retried that had in fact run before its connection
            # broke is refused the second time (an id enqueued twice) or
            # harmless (a claim's extra leases run out and go back).
            client = aioredis.Redis.from_pool(
                connection_pool(url, timeout_s=socket_timeout_s, password=password)
            )
        self._redis = client
        base = f"{{{key_prefix}}}fleet:"
        self.base = base
        """What every fleet key and channel name starts with."""
        self.wake_channel = base + "wake"
        """Published on every enqueue (`q:<tier>`), and when a node fills up
        while work is queued: idle engine nodes claim on it."""
        self._field = {name: base + name for name in _FIELDS}
        self._queue = {tier: f"{base}q:{tier}" for tier in tiers.names()}
        self._keys = [*self._field.values()]
        self._keys += [f"{base}{kind}:{tier}" for kind in _PER_TIER for tier in tiers.names()]
        self._tier_args: list[Any] = [
            len(tiers.tiers), *tiers.names(), 1 if tiers.fair else 0, repr(tiers.inflow_tau_s),
            tiers.reserve_slots,
        ]  # fmt: skip
        for tier in tiers.tiers:
            budget = "" if tier.budget_s is None else repr(tier.budget_s)
            self._tier_args += [
                tier.priority, budget, int(tier.delays), repr(tier.min_share), tier.age_floor,
                int(tier.name in tiers.doors),
            ]  # fmt: skip
        # The scripts live in `lua/`, one file each; every one starts with the
        # prelude, which documents the KEYS and tier args they all get.
        (
            self._enqueue, self._claim, self._renew, self._complete, self._release,
            self._preempt, self._cancel, self._heartbeat, self._leave,
        ) = register_scripts(client, __package__, (
            "enqueue", "claim", "renew", "complete", "release",
            "preempt", "cancel", "heartbeat", "leave",
        ), prelude=("prelude",))  # fmt: skip

    @property
    def redis(self) -> aioredis.Redis:
        """The client, for the fleet's pub/sub (which shares its pool)."""
        return self._redis

    async def subscribe(self, *channels: str) -> Any:
        """A pub/sub connection subscribed to `channels`; closed again if the
        subscription fails (a `Subscription` retries it with backoff)."""
        pubsub = self._redis.pubsub()
        try:
            await pubsub.subscribe(*channels)
        except BaseException:
            with contextlib.suppress(RedisError, OSError):
                await pubsub.aclose()
            raise
        return pubsub

    async def subscribers(self, channels: Iterable[str]) -> dict[str, int]:
        """How many connections subscribe to each channel now (PUBSUB NUMSUB):
        0 on a gateway's reply channel means nobody waits for its replies."""
        names = list(channels)
        if not names:
            return {}
        counts = await self._guard(self._redis.pubsub_numsub(*names))
        return {
            (name.decode() if isinstance(name, bytes) else name): int(count)
            for name, count in counts
        }

    async def _guard(self, call: Any) -> Any:
        return await guarded(call, WorkQueueError)

    async def _run(self, script: Any, args: list[Any]) -> Any:
        return await self._guard(script(keys=self._keys, args=args))

    async def enqueue(
        self, item: WorkItem, *, max_queued: int | None = None, notice: Notice | None = None
    ) -> WorkItem | None:
        self._check_tier(item)
        refusal: WorkQueueOverloaded | None = None
        for _ in range(_DOOR_TRIES):
            refusal = taken = reply = None
            if item.tier in self.tiers.admitting:
                # Predicted here by the core's rule from a read just before: a
                # prediction may miss an enqueue racing that read, as if it
                # came a moment later. The cap and the duplicate check stay
                # atomic in the script, and go first there, as in the memory
                # store; so does the check that the item whose place this one
                # takes is still queued.
                load = await self.load(item.arrival)
                refusal = self._refusal(item, load)
                place = await self._place_for(item, load) if refusal is not None else None
                if place is not None:
                    taken = await self._queued_item(place)
                    if taken is None:
                        continue  # gone since: decide again
                    reply = notice(taken) if notice is not None else None
            args = [
                item.id, item.tier, item.tenant, repr(item.arrival), item.payload, item.attempt,
                max_queued or 0, self.wake_channel, item.affinity, repr(item.charge),
                lane_key(item), item.work, 1 if refusal is not None and taken is None else 0,
                taken.id if taken is not None else "", *(reply or ("", b"")), item.prompt,
            ]  # fmt: skip
            result = await self._run(self._enqueue, [*args, *self._tier_args])
            if result == -3:
                continue  # the item whose place it was to take left the queue
            if result == -2:
                assert refusal is not None
                raise refusal
            if result == 0:
                raise ValueError(f"duplicate work item id {item.id!r}")
            if result < 0:
                assert max_queued is not None
                raise WorkQueueFull(item.tier, max_queued)
            return taken
        assert refusal is not None
        raise refusal

    async def _standings(self, tier: str, tenant: str) -> TierStandings:
        async with self._redis.pipeline(transaction=True) as pipe:
            pipe.zrange(f"{self.base}backlog:{tier}", 0, -1, withscores=True)
            pipe.zrange(f"{self.base}qcharge:{tier}", 0, -1, withscores=True)
            pipe.zscore(f"{self.base}counter:{tier}", tenant)
            pipe.zscore(self._field["served"], tier)
            backlog, charges, own, served = await self._guard(pipe.execute())
        return TierStandings(
            counters={name.decode(): float(score) for name, score in backlog},
            queued={name.decode(): float(score) for name, score in charges},
            own=float(own) if own is not None else 0.0,
            served=float(served) if served is not None else 0.0,
        )

    async def _newest(self, tier: str, tenant: str, start: int, count: int) -> list[QueuedEntry]:
        members = await self._guard(self._redis.zrevrangebylex(
            f"{self.base}lane:{tier}", f"({tenant}\x01", f"[{tenant}\x00", start=start, num=count
        ))  # fmt: skip
        # A member is `tenant NUL 16 hex digits NUL id` (model.lane_key).
        skip = len(tenant.encode()) + 18
        ids = [member[skip:].decode() for member in members]
        async with self._redis.pipeline(transaction=False) as pipe:
            for item_id in ids:
                pipe.hget(self._field["attempt"], item_id)
                pipe.hget(self._field["charge"], item_id)
                pipe.hget(self._field["work"], item_id)
            fields = await self._guard(pipe.execute())
        entries = []
        for n, item_id in enumerate(ids):
            attempt, charge, work = fields[3 * n:3 * n + 3]
            if attempt is not None and charge is not None and work is not None:
                entries.append((item_id, int(attempt), float(charge), int(work)))
        return entries

    async def _queued_item(self, item_id: str) -> WorkItem | None:
        """The item `item_id` as it is stored, while it is queued (None once
        it is not: a node took it, or it ended)."""
        names = ("tier", "tenant", "arrival", "payload", "attempt", "affkey", "charge", "work",
                 "prompt")  # fmt: skip
        async with self._redis.pipeline(transaction=True) as pipe:
            pipe.hexists(self._field["holder"], item_id)
            for name in names:
                pipe.hget(self._field[name], item_id)
            held, *values = await self._guard(pipe.execute())
        tier, tenant, arrival, payload, attempt, affinity, charge, work, prompt = values
        if held or tier is None:
            return None
        return WorkItem(
            id=item_id, tier=tier.decode(), tenant=tenant.decode(), arrival=float(arrival),
            payload=bytes(payload), attempt=int(attempt),
            affinity=affinity.decode() if affinity is not None else "",
            charge=float(charge), work=int(work), prompt=int(prompt or 0),
        )  # fmt: skip

    async def cancel(
        self, item_id: str, now: float, *, only_queued: bool = False
    ) -> ItemStatus | None:
        args = [item_id, repr(now), 1 if only_queued else 0, *self._tier_args]
        was = await self._run(self._cancel, args)
        return _CANCELLED[int(was)]

    async def next_expiry(self) -> float | None:
        first = await self._guard(self._redis.zrange(self._field["expiry"], 0, 0, withscores=True))
        return float(first[0][1]) if first else None

    async def claim(
        self, node: str, max_items: int, now: float, lease_s: float, *, drain_rate: float = 0.0,
        prefill: Prefill = NO_PREFILL_LIMIT, held_for_arrivals: int = 0,
    ) -> Claim:
        expires_at = now + lease_s
        args: list[Any] = [
            repr(now), node, max_items, repr(expires_at),
            repr(self.tiers.interval_s), self.tiers.max_boost,
            repr(now - self.done_retention_s), repr(now - self.affinity_ttl_s), self.wake_channel,
            milli(drain_rate), prefill.tokens, _limit(prefill.budget), _limit(prefill.pace),
            held_for_arrivals, *self._tier_args,
        ]  # fmt: skip
        rows, held_until, at_reserve, held, paced = await self._run(self._claim, args)
        leases = []
        home, away = set(), set()
        for row in rows:
            (item_id, tier, tenant, arrival, payload, attempt, token, affinity, charge, bound,
             work, prompt) = row  # fmt: skip
            item = WorkItem(
                id=item_id.decode(),
                tier=tier.decode(),
                tenant=tenant.decode(),
                arrival=float(arrival),
                payload=bytes(payload),
                attempt=int(attempt),
                affinity=affinity.decode(),
                charge=float(charge),
                work=int(work),
                prompt=int(prompt),
            )
            leases.append(Lease(item, node, int(token), expires_at))
            if bound:
                (home if bound == 1 else away).add(item.id)
        held_back_until = float(held_until) if held_until else None
        return Claim(leases, held_back_until, frozenset(home), frozenset(away), bool(at_reserve),
                     bool(held), bool(paced))  # fmt: skip

    async def heartbeat(
        self, node: str, room: int, now: float, ttl_s: float, *, drain_rate: float = 0.0
    ) -> None:
        args = [
            node, max(0, room), repr(now + ttl_s), self.wake_channel, milli(drain_rate),
            *self._tier_args,
        ]  # fmt: skip
        await self._run(self._heartbeat, args)

    async def leave(self, node: str) -> None:
        await self._run(self._leave, [node, self.wake_channel, *self._tier_args])

    async def bound_node(self, key: str) -> str | None:
        node = await self._guard(self._redis.hget(self._field["bound"], key))
        return node.decode() if node is not None else None

    async def renew(self, lease: Lease, now: float, lease_s: float) -> Lease | None:
        expires_at = now + lease_s
        args = [lease.item.id, lease.token, repr(expires_at), *self._tier_args]
        if not await self._run(self._renew, args):
            return None
        return Lease(lease.item, lease.node, lease.token, expires_at)

    async def renew_all(
        self, leases: Sequence[Lease], now: float, lease_s: float
    ) -> list[Lease | None]:
        expires_at = now + lease_s
        async with self._redis.pipeline(transaction=False) as pipe:
            for lease in leases:
                args = [lease.item.id, lease.token, repr(expires_at), *self._tier_args]
                await self._renew(keys=self._keys, args=args, client=pipe)
            held = await self._guard(pipe.execute())
        return [Lease(lease.item, lease.node, lease.token, expires_at) if ok else None
                for lease, ok in zip(leases, held, strict=True)]  # fmt: skip

    async def complete(
        self, lease: Lease, reply: tuple[str, bytes] | None = None, *, used: float | None = None
    ) -> bool:
        channel, message = reply if reply is not None else ("", b"")
        correction = "" if used is None else repr(used - lease.item.charge)
        args = [lease.item.id, lease.token, channel, message, correction, *self._tier_args]
        return bool(await self._run(self._complete, args))

    async def release(self, lease: Lease) -> bool:
        args = [lease.item.id, lease.token, *self._tier_args]
        return bool(await self._run(self._release, args))

    async def preempt(self, lease: Lease, now: float) -> bool:
        args = [lease.item.id, lease.token, repr(now), *self._tier_args]
        return bool(await self._run(self._preempt, args))

    async def counters(self, tier: str) -> dict[str, float]:
        key = f"{self.base}counter:{tier}"
        rows = await self._guard(self._redis.zrange(key, 0, -1, withscores=True))
        return {tenant.decode(): float(score) for tenant, score in rows}

    async def load(self, now: float) -> FleetLoad:
        tiers = self.tiers.names()
        async with self._redis.pipeline(transaction=True) as pipe:
            pipe.hgetall(self._field["qwork"])
            pipe.hgetall(self._field["inflow"])
            pipe.hgetall(self._field["inflow_at"])
            pipe.zrangebyscore(self._field["seen"], f"({now!r}", "+inf")
            pipe.hgetall(self._field["rate"])
            pipe.hgetall(self._field["room"])
            pipe.hgetall(self._field["pheld"])
            for tier in tiers:
                pipe.zrange(self._queue[tier], 0, 0, withscores=True)
            work, sums, lasts, live, rates, rooms, held, *heads = await self._guard(pipe.execute())
        tau = self.tiers.inflow_tau_s
        inflow: dict[str, float] = {}
        for tier in tiers:
            last = lasts.get(tier.encode())
            if last is None:
                inflow[tier] = 0.0
                continue
            stored = ArrivalRate.restored(tau, float(sums[tier.encode()]), float(last))
            inflow[tier] = stored.rate(now)
        return FleetLoad(
            queued_work={tier: int(work.get(tier.encode(), 0)) for tier in tiers},
            inflow=inflow,
            drain=sum(int(rates.get(node, 0)) for node in live) / 1000.0,
            rooms=tuple(sorted(int(rooms.get(node, 0)) for node in live if node not in held)),
            oldest={tier: float(head[0][1]) for tier, head in zip(tiers, heads) if head},
            held_rooms=tuple(sorted(int(rooms.get(node, 0)) for node in live if node in held)),
        )

    async def depth(self) -> dict[str, int]:
        async with self._redis.pipeline(transaction=False) as pipe:
            for key in self._queue.values():
                pipe.zcard(key)
            counts = await self._guard(pipe.execute())
        return dict(zip(self._queue, map(int, counts)))

    async def leased(self) -> int:
        return int(await self._guard(self._redis.hlen(self._field["holder"])))

    async def status(self, item_id: str) -> ItemStatus | None:
        async with self._redis.pipeline(transaction=True) as pipe:
            pipe.hexists(self._field["holder"], item_id)
            pipe.hexists(self._field["tier"], item_id)
            pipe.zscore(self._field["done"], item_id)
            held, known, done = await self._guard(pipe.execute())
        if held:
            return "leased"
        if known:
            return "queued"
        return "completed" if done is not None else None

    async def close(self) -> None:
        await self._redis.aclose()


class Subscription:
    """A pub/sub subscription that outlives its connection. `run` hands every
    message to `handle`; when the connection is lost (Redis restarts, the
    network breaks) it calls `on_lost` once, subscribes again with backoff
    (RECONNECT_FIRST_S, doubling to RECONNECT_MAX_S) and, once subscribed,
    calls `on_back`. The retry of a lost connection, not a poll: it stops as
    soon as the subscription is back."""

    def __init__(self, store: RedisWorkQueue, *channels: str, what: str) -> None:
        self._store = store
        self._channels = channels
        self._what = what
        self.pubsub: Any = None
        """The live connection; None while lost."""

    async def open(self) -> None:
        self.pubsub = await self._store.subscribe(*self._channels)

    async def run(
        self,
        handle: Callable[[dict[str, Any]], None],
        *,
        on_lost: Callable[[Exception], None] = lambda exc: None,
        on_back: Callable[[], None] = lambda: None,
    ) -> None:
        backoff = RECONNECT_FIRST_S
        while True:
            try:
                if self.pubsub is None:
                    await self.open()
                    log.warning("the fleet's %s is back", self._what)
                    backoff = RECONNECT_FIRST_S
                    on_back()
                async for message in self.pubsub.listen():
                    if message.get("type") == "message":
                        handle(message)
                raise ConnectionError(f"the {self._what} ended")
            except asyncio.CancelledError:
                raise
            except Exception as exc:  # noqa: BLE001 - whatever broke it, subscribe again
                if self.pubsub is not None:
                    log.error("lost the fleet's %s: %r; reconnecting", self._what, exc)
                    on_lost(exc)
                await self.close()
                await asyncio.sleep(backoff)
                backoff = min(2 * backoff, RECONNECT_MAX_S)

    async def close(self) -> None:
        pubsub, self.pubsub = self.pubsub, None
        if pubsub is not None:
            with contextlib.suppress(RedisError, OSError):
                await pubsub.aclose()
