"""Several tenants at once against qosgate, with the official `openai` client:
watch the tiers on /dashboard while it runs.

    .venv/bin/qosgate demo &        # prints the dashboard URL
    .venv/bin/python examples/multi_tenant_load.py [--seconds 30] [--scale 1.0]

Each tenant of policies/example.yaml sends Poisson arrivals at its own rate,
with its own key, streaming; the script prints, per tenant, what came back:
completed, refused (429 quota, 503 overload) and the TTFT it saw. For
measurements use `qosgate bench` (worker processes, full report); this is
a demonstration.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import random
import time
from collections import defaultdict

import openai

URL = os.environ.get("QOSGATE_URL", "http://127.0.0.1:8080/v1")
MODEL = os.environ.get("QOSGATE_MODEL", "sim-llama3-8b")
# key: (requests per second, max_tokens)
TENANTS = {
    "demo-interactive-key": (2.0, 64),
    "demo-standard-key": (6.0, 128),
    "demo-tools-key": (3.0, 128),
    "demo-batch-key": (2.0, 512),
}


async def one(client: openai.AsyncOpenAI, key: str, max_tokens: int, stats: dict) -> None:
    started = time.monotonic()
    try:
        stream = await client.with_options(api_key=key).chat.completions.create(
            model=MODEL, max_tokens=max_tokens, stream=True,
            messages=[{"role": "user", "content": "Tell me about queues."}],
        )
        first = None
        async for _chunk in stream:
            if first is None:
                first = time.monotonic() - started
        stats["completed"] += 1
        stats["ttft"].append(first or 0.0)
    except openai.RateLimitError:
        stats["429"] += 1
    except openai.APIStatusError as exc:
        stats[str(exc.status_code)] += 1


async def tenant(client: openai.AsyncOpenAI, key: str, rate: float, max_tokens: int,
                 seconds: float, stats: dict) -> None:
    rng = random.Random(key)
    end = time.monotonic() + seconds
    tasks = []
    while time.monotonic() < end:
        tasks.append(asyncio.create_task(one(client, key, max_tokens, stats)))
        await asyncio.sleep(rng.expovariate(rate))
    await asyncio.gather(*tasks)


async def main(seconds: float, scale: float) -> None:
    client = openai.AsyncOpenAI(base_url=URL, api_key="unused", max_retries=0)
    stats = {key: defaultdict(int, ttft=[]) for key in TENANTS}
    await asyncio.gather(*(
        tenant(client, key, rate * scale, max_tokens, seconds, stats[key])
        for key, (rate, max_tokens) in TENANTS.items()
    ))  # fmt: skip
    await client.close()
    for key, s in stats.items():
        ttft = sorted(s.pop("ttft"))
        p50 = f"{1000 * ttft[len(ttft) // 2]:.0f} ms" if ttft else "-"
        others = ", ".join(f"{k}: {v}" for k, v in sorted(s.items()) if k != "completed")
        print(f"{key:22} completed {s['completed']:4}  ttft p50 {p50:>8}  {others}")


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--seconds", type=float, default=30.0)
    parser.add_argument("--scale", type=float, default=1.0, help="multiply every rate")
    args = parser.parse_args()
    asyncio.run(main(args.seconds, args.scale))
