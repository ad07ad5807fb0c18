"""What one fleet claim costs with many tenants backlogged in a fair tier.

    .venv/bin/python benchmarks/fleet_claim.py [--tenants 10000] [--claims 10] [--size 16]

A claim is one Lua script, and Redis serves no other client while it runs, so
its time is every replica's and node's wait too. This queues one item for
each of `--tenants` tenants in a fair (VTC) tier on a fresh local
redis-server (tests/redis_server.py), then times `--claims` claims of
`--size` items each, and prints the mean milliseconds per claim.
"""

from __future__ import annotations

import argparse
import asyncio
import sys
import time
import uuid
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from qosgate.fleet import FleetTiers, WorkItem
from qosgate.fleet.redis_store import RedisWorkQueue
from tests.redis_server import RedisServer

TIERS = FleetTiers.of({"gold": 0}, interval_s=2.0, max_boost=0, fair=True, budgets={}, delays=[])
T0 = 1_700_000_000.0


async def run(url: str, tenants: int, claims: int, size: int) -> float:
    queue = RedisWorkQueue(url, TIERS, key_prefix=f"claim-{uuid.uuid4().hex[:8]}:")
    try:
        for i in range(tenants):
            await queue.enqueue(WorkItem(
                id=f"i{i}", tier="gold", tenant=f"t{i:06}", arrival=T0 + i / 1000,
                payload=b"x", charge=1.0,
            ))  # fmt: skip
        began = time.perf_counter()
        for _ in range(claims):
            await queue.claim("n1", size, T0 + tenants, 60.0)
        return (time.perf_counter() - began) * 1000 / claims
    finally:
        await queue.close()


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--tenants", type=int, default=10_000)
    parser.add_argument("--claims", type=int, default=10)
    parser.add_argument("--size", type=int, default=16, help="items per claim")
    args = parser.parse_args()
    server = RedisServer()
    server.start()
    try:
        ms = asyncio.run(run(server.url, args.tenants, args.claims, args.size))
    finally:
        server.stop()
    print(f"{args.tenants} tenants backlogged: {ms:.2f} ms per claim of {args.size} "
          f"(mean of {args.claims})")
    return 0


if __name__ == "__main__":
    sys.exit(main())
