"""Where one idle submission's time goes inside the API: a development tool.

    python scripts/api_submit_steps.py [--requests 300] [--pause-ms 10]

Builds the API in this process (`producer.api.create_app`, a tenant with an API key and
a quota that never runs out, as bench/fleet.py's front door has) on the local infra
(`python -m kvfleet.cli infra up`), on topics and keys of its own that nothing reads,
and posts one small job at a time through httpx's ASGI transport (no sockets, no HTTP
server: only the app's own work and its Redis and Kafka round trips). Prints the
request's median and the mean of each step of `kvfleet_api_submit_step_seconds`
(producer/submission.py): parse, admit (one Lua call: the quota and the queued record),
produce (until Kafka acknowledged).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import statistics
import sys
import time
import uuid
from pathlib import Path

import redis

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

API_KEY = "sk-submit-steps"
STEPS = ("parse", "admit", "produce")
BODY = {"prompt": "Say something short about item 7", "max_new_tokens": 4}


async def measure(app, requests: int, pause_s: float) -> None:
    import httpx

    from producer import submission

    def sums() -> dict[str, float]:
        return {step: submission.STEP.labels(step)._sum.get() for step in STEPS}

    headers = {"Authorization": f"Bearer {API_KEY}"}
    async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://api") as client:
        async with app.router.lifespan_context(app):
            for _ in range(30):  # warm-up: connections, scripts, metadata
                await client.post("/v1/jobs", json=BODY, headers=headers)
            before, took = sums(), []
            for _ in range(requests):
                began = time.perf_counter()
                answer = await client.post("/v1/jobs", json=BODY, headers=headers)
                took.append(1000 * (time.perf_counter() - began))
                answer.raise_for_status()
                await asyncio.sleep(pause_s)
            after = sums()
    print(f"request, in process: p50 {statistics.median(took):.2f} ms")
    for step in STEPS:
        print(f"  {step:<8} mean {1000 * (after[step] - before[step]) / requests:.2f} ms")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--requests", type=int, default=300)
    parser.add_argument("--pause-ms", type=float, default=10.0, help="between requests: an idle API")
    args = parser.parse_args()
    prefix = f"steps{uuid.uuid4().hex[:8]}"
    os.environ.update(KVFLEET_TOPIC_PREFIX=prefix, KVFLEET_KEY_PREFIX=prefix, KVFLEET_TENANTS=json.dumps(
        {"tenants": [{"name": "steps", "tier": "silver", "tokens_per_minute": 10**12, "api_keys": [API_KEY]}]}))
    from kvfleet.kafka import make_admin
    from kvfleet.settings import Settings
    from producer.api import create_app

    settings = Settings.from_env()
    try:
        asyncio.run(measure(create_app(settings), args.requests, args.pause_ms / 1000))
    finally:  # what the run left: its topics and its keys
        admin = make_admin(settings.kafka, client_id="submit-steps")
        admin.delete_topics([t for t in admin.list_topics() if t.startswith(prefix)])
        admin.close()
        client = redis.Redis.from_url(settings.redis.url)
        keys = list(client.scan_iter(f"{prefix}*", count=1000))
        for i in range(0, len(keys), 1000):
            client.delete(*keys[i:i + 1000])


if __name__ == "__main__":
    main()
