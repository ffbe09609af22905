"""OpenAI's rate-limit headers, computed from the tenant's token bucket (kvfleet/quota.py).

    x-ratelimit-limit-tokens      the tenant's tokens per minute
    x-ratelimit-remaining-tokens  tokens a job could take from the bucket now
    x-ratelimit-reset-tokens      time until the bucket is full again ("1m2.5s", "300ms")

Requests are not limited, so the `-requests` headers are not sent; without configured
tenants (development) there is no bucket and no header.
"""

from __future__ import annotations

from typing import Optional

import anyio
import redis

from kvfleet.tenancy import Tenant
from producer.context import ApiContext


async def headers(ctx: ApiContext, tenant: Optional[Tenant]) -> dict[str, str]:
    quotas = ctx.gate.quotas
    if tenant is None or quotas is None:
        return {}
    try:
        level = await anyio.to_thread.run_sync(quotas.peek, tenant)
    except redis.RedisError:
        return {}  # headers are advice: never fail an answer for them
    return {"x-ratelimit-limit-tokens": str(tenant.tokens_per_minute),
            "x-ratelimit-remaining-tokens": str(level.remaining),
            "x-ratelimit-reset-tokens": duration(level.reset_s)}


def duration(seconds: float) -> str:
    """OpenAI's format: "6m0s", "1.5s", "20ms"."""
    if seconds < 1:
        return f"{max(0, round(seconds * 1000))}ms"
    minutes, rest = divmod(seconds, 60)
    rest_text = f"{rest:.3f}".rstrip("0").rstrip(".") + "s"
    return f"{int(minutes)}m{rest_text}" if minutes else rest_text
