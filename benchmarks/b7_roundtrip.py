"""B7's Redis round trip: where the check-and-reserve time goes.

    .venv/bin/python benchmarks/b7_roundtrip.py [--ops 2000] [--rounds 3]
        [--concurrency 1,16] [--busy 0] [--json benchmarks/results/b7_roundtrip.json]

One run, one event loop (uvloop, as `qosgate serve`), one redis-server
started here on a free loopback port (tests/redis_server.py) and stopped at
the end. Side by side, at each concurrency (that many callers at once in the
loop; B7 has 16 streams per gateway), each call timed on its own with
perf_counter around the await, as benchmarks/b7_gateway.py times the store:

- ping:    a bare redis-py asyncio `PING` (its default connection pool);
- evalsha: a bare `EVALSHA` of `return 1` on that same client;
- evalsha_reserve: a bare `EVALSHA` of the store's own reserve script with
  the arguments the store sends (the Lua, the packing of its 22 arguments
  and the reply, without qosgate's Python around it);
- store_ping: `RedisQuotaStore.ping`, a `PING` on the store's own client
  (its BlockingConnectionPool and retry settings);
- reserve: `RedisQuotaStore.reserve` as the gateway calls it, 450 tokens,
  for a tenant with B7's limits (benchmarks/b7_policy.yaml: tokens_per_minute
  60,000); a new tenant every 100 calls, so every reserve is admitted;
- settle:  `RedisQuotaStore.settle` of each of those reservations, refunding
  it all (charged 0, not served).

Round trips are counted on the server: `INFO commandstats` before and after
each phase (the calls of every command, less the INFO itself), per request;
`usec_per_call` there is the server's own time for the command, so the rest
of a call is the network, the client and the event loop. The connections
each client opened are counted too. `--busy N` runs N processes spinning on
the CPU meanwhile, as B7's other gateways, simulated GPUs and load
generators do on this machine.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import platform
import shlex
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import yaml

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent
sys.path.insert(0, str(ROOT))

import redis.asyncio as aioredis  # noqa: E402

from qosgate.config.models import PolicyConfig  # noqa: E402
from qosgate.quotas.model import TenantLimits  # noqa: E402
from qosgate.quotas.redis_store import RedisQuotaStore  # noqa: E402
from qosgate.observability.stats import percentile  # noqa: E402
from tests.redis_server import RedisServer  # noqa: E402

TOKENS = 450
OPS = ("ping", "evalsha", "evalsha_reserve", "store_ping", "reserve", "settle")
ROUND_TRIPS = {"ping", "evalsha", "evalsha_ro", "eval", "eval_ro", "script|load", "script"}
"""Commands a client sends; the rest in commandstats ran inside the scripts."""


async def commandstats(client: aioredis.Redis) -> dict[str, tuple[int, float]]:
    raw = await client.info("commandstats")
    return {
        name.removeprefix("cmdstat_"): (int(v["calls"]), float(v["usec"]))
        for name, v in raw.items()
    }


def delta(before: dict, after: dict) -> dict[str, tuple[int, float]]:
    out = {}
    for name, (calls, usec) in after.items():
        c0, u0 = before.get(name, (0, 0.0))
        if name == "info":
            calls -= 1  # the INFO that read `before`
        if calls - c0 > 0:
            out[name] = (calls - c0, usec - u0)
    return out


def reserve_args(
    store: RedisQuotaStore, tenant: str, limits: TenantLimits, rid: str
) -> tuple[list[str], list[Any]]:
    """The keys and arguments the store's reserve sends."""
    return store.reserve_call(tenant, limits, TOKENS, rid, time.time(), 600.0, True)


async def phase(op: str, n: int, concurrency: int, env: dict[str, Any]) -> list[float]:
    """`n` calls of `op` by `concurrency` callers at once; each call's ms."""
    bare, store, sha, limits = env["bare"], env["store"], env["sha"], env["limits"]
    reservations = env["reservations"]
    times: list[float] = []
    left = [n]
    seq = env["seq"]

    async def one() -> None:
        if op == "ping":
            await bare.ping()
        elif op == "evalsha":
            await bare.evalsha(sha, 0)
        elif op == "evalsha_reserve":
            seq[0] += 1
            keys, argv = reserve_args(store, f"b7x-{seq[0] // 100}", limits, f"rx-{seq[0]}")
            await bare.evalsha(store._reserve.sha, len(keys), *keys, *argv)
        elif op == "store_ping":
            await store.ping()
        elif op == "reserve":
            seq[0] += 1
            # A new tenant (same limits) every 100: the reservations of a
            # phase stay held until the settle phase, and 100 x 450 < 60,000.
            decision = await store.reserve(
                f"b7-{seq[0] // 100}", limits, TOKENS, f"rt-{seq[0]}", time.time(), lease_s=600.0
            )
            assert decision.admitted and decision.reservation is not None, decision
            reservations.append(decision.reservation)
        else:
            await store.settle(reservations.pop(), 0, False, time.time())

    async def caller() -> None:
        while left[0] > 0:
            left[0] -= 1
            began = time.perf_counter()
            await one()
            times.append((time.perf_counter() - began) * 1000)

    await asyncio.gather(*(caller() for _ in range(concurrency)))
    return times


async def bench(url: str, ops: int, rounds: int, levels: list[int]) -> dict[str, Any]:
    policy = PolicyConfig.model_validate(yaml.safe_load((HERE / "b7_policy.yaml").read_text()))
    tenant = next(t for t in policy.tenants if t.id == "b7")
    limits = TenantLimits.from_config(tenant.quotas)
    bare = aioredis.Redis.from_url(url)
    admin = aioredis.Redis.from_url(url)
    store = RedisQuotaStore(url, key_prefix="b7rt:")
    sha = await bare.script_load("return 1")
    await bare.script_load(store._reserve.script)
    env = {"bare": bare, "store": store, "sha": sha, "limits": limits, "reservations": [],
           "seq": [0]}
    # Warm up: every client's connections open, the store's scripts loaded.
    for c in levels:
        for op in OPS:
            await phase(op, max(50, 4 * c), c, env)
    samples: dict[tuple[int, str], list[float]] = {}
    stats: dict[tuple[int, str], dict[str, tuple[int, float]]] = {}
    for _ in range(rounds):
        for c in levels:
            for op in OPS:
                before = await commandstats(admin)
                samples.setdefault((c, op), []).extend(await phase(op, ops, c, env))
                got = delta(before, await commandstats(admin))
                acc = stats.setdefault((c, op), {})
                for name, (calls, usec) in got.items():
                    c0, u0 = acc.get(name, (0, 0.0))
                    acc[name] = (c0 + calls, u0 + usec)
    rows = []
    for c in levels:
        base = percentile(samples[(c, "ping")], 50)
        for op in OPS:
            ms = samples[(c, op)]
            n = len(ms)
            cmds = stats[(c, op)]
            p50 = percentile(ms, 50)
            rows.append({
                "concurrency": c, "op": op, "calls": n,
                "p50_ms": p50, "p99_ms": percentile(ms, 99),
                "vs_ping_p50": p50 / base if base else None,
                "round_trips_per_call": sum(
                    k for name, (k, _) in cmds.items() if name in ROUND_TRIPS
                ) / n,
                "commands_per_call": {name: k / n for name, (k, _) in sorted(cmds.items())},
                "server_us_per_call": sum(u for _, u in cmds.values()) / n,
            })  # fmt: skip
    clients = await admin.info("clients")
    out = {
        "rows": rows,
        "connections": {
            "bare": _opened(bare.connection_pool),
            "store": _opened(store._redis.connection_pool),
            "server_connected_clients": clients["connected_clients"],
        },
    }
    await bare.aclose()
    await admin.aclose()
    await store.close()
    return out


def _opened(pool: Any) -> int:
    return len(pool._available_connections) + len(pool._in_use_connections)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--ops", type=int, default=2000, help="calls per op, level and round")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--concurrency", default="1,16")
    parser.add_argument("--busy", type=int, default=0, help="CPU-spinning processes meanwhile")
    parser.add_argument("--json", default=str(HERE / "results" / "b7_roundtrip.json"))
    args = parser.parse_args()
    levels = [int(x) for x in args.concurrency.split(",")]
    import uvloop

    started = time.monotonic()
    spinners = [
        subprocess.Popen([sys.executable, "-c", "while True: pass"]) for _ in range(args.busy)
    ]
    try:
        with RedisServer() as server, asyncio.Runner(loop_factory=uvloop.new_event_loop) as r:
            result = r.run(bench(server.url, args.ops, args.rounds, levels))
    finally:
        for proc in spinners:
            proc.kill()
            proc.wait()
    print(f"\nB7 round trip ({os.cpu_count()} CPUs, {args.busy} busy processes, "
          f"{args.ops} x {args.rounds} calls per cell)\n")
    print(f"{'conc':>4}  {'op':<15} {'p50 ms':>8} {'p99 ms':>8} {'x ping':>7} "
          f"{'trips':>6} {'server us':>9}  commands per call")
    for row in result["rows"]:
        cmds = ", ".join(f"{k} {v:g}" for k, v in row["commands_per_call"].items())
        print(f"{row['concurrency']:>4}  {row['op']:<15} {row['p50_ms']:>8.3f} "
              f"{row['p99_ms']:>8.3f} {row['vs_ping_p50']:>7.2f} "
              f"{row['round_trips_per_call']:>6.2f} {row['server_us_per_call']:>9.1f}  {cmds}")
    print(f"\nconnections: {result['connections']}")
    out = {
        "benchmark": "B7 round trip",
        "command": " ".join(shlex.quote(a) for a in
                            [".venv/bin/python", "benchmarks/b7_roundtrip.py", *sys.argv[1:]]),
        "machine": {"cpus": os.cpu_count(), "python": platform.python_version()},
        "busy_processes": args.busy,
        "wall_s": time.monotonic() - started,
        **result,
    }  # fmt: skip
    Path(args.json).parent.mkdir(parents=True, exist_ok=True)
    Path(args.json).write_text(json.dumps(out, indent=2))
    print(f"wrote {args.json}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
