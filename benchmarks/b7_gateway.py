"""One qosgate gateway for B7, with its quota store's every call written down.

    python benchmarks/b7_gateway.py POLICY.yaml LEDGER.jsonl [--port 0]

It is `qosgate serve` (the same app, gateway, backend and store) with one
addition: the store is wrapped so that each reservation (wall-clock time,
tokens, admitted or not, and how long the store took) and each settlement
(tokens charged, whether the request counted) goes to LEDGER as a JSON line.
benchmarks/b7_quota.py reads the ledgers of every gateway of a run to check
the quota independently of the store. The first stdout line is qosgate's
"serving ... at URL".
"""

from __future__ import annotations

import argparse
import asyncio
import sys
import time
from pathlib import Path

import orjson

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from qosgate.config.loader import load_policy  # noqa: E402
from qosgate.http.server import serve  # noqa: E402
from qosgate.quotas import QuotaGuard, build_store  # noqa: E402


def instrument(store, ledger):
    reserve, settle = store.reserve, store.settle

    async def reserve_logged(tenant, limits, tokens, request_id, now, *, lease_s):
        began = time.perf_counter()
        decision = await reserve(tenant, limits, tokens, request_id, now, lease_s=lease_s)
        took = time.perf_counter() - began
        ledger.write(orjson.dumps({
            "ev": "reserve", "rid": request_id, "at": now, "tokens": tokens,
            "admitted": decision.admitted, "store_s": took,
        }) + b"\n")
        return decision

    async def settle_logged(reservation, charged, served, now):
        await settle(reservation, charged, served, now)
        ledger.write(orjson.dumps({
            "ev": "settle", "rid": reservation.request_id, "at": reservation.at,
            "settled_at": now, "tokens": reservation.tokens, "charged": charged,
            "served": served,
        }) + b"\n")

    store.reserve, store.settle = reserve_logged, settle_logged
    if hasattr(store, "settle_now"):
        settle_now = store.settle_now

        def settle_now_logged(reservation, charged, served, now):
            settle_now(reservation, charged, served, now)
            ledger.write(orjson.dumps({
                "ev": "settle", "rid": reservation.request_id, "at": reservation.at,
                "settled_at": now, "tokens": reservation.tokens, "charged": charged,
                "served": served,
            }) + b"\n")

        store.settle_now = settle_now_logged


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("policy")
    parser.add_argument("ledger")
    parser.add_argument("--port", type=int, default=0)
    args = parser.parse_args()
    policy = load_policy(args.policy)
    with open(args.ledger, "ab", buffering=1 << 16) as ledger:
        store = build_store(policy.quota_store)
        instrument(store, ledger)
        guard = QuotaGuard.from_policy(policy, store)
        import uvloop

        with asyncio.Runner(loop_factory=uvloop.new_event_loop) as runner:
            runner.run(serve(policy, "127.0.0.1", args.port, quotas=guard))


if __name__ == "__main__":
    main()
