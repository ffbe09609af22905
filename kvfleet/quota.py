"""Per-tenant tokens-per-minute quotas: one token bucket per tenant in Redis.

`{prefix}:quota:{tenant}` is a hash {level, ts}: the tokens left at time `ts`. A take
refills the bucket for the time since `ts` (up to its size), then takes all the tokens
asked for or none, in one Lua script, so every API replica shares one bucket per tenant
and concurrent takes can never overdraw it.

The API charges a job's cost (prompt + max_new_tokens) once, at submission; over quota
it answers 429 with `Retry-After` = the time the bucket needs to refill the deficit.
"""

from __future__ import annotations

import math
import time
from typing import NamedTuple, Optional

import redis

from kvfleet.constants import Keys
from kvfleet.lua import REDIS_NOW, now_arg
from kvfleet.tenancy import Tenant

#: `take(key, want, size, rate, now)`: take `want` tokens from the bucket at `key`, all
#: or none; returns ok (1|0) and the seconds until the same take would succeed. A Lua
#: function, so the API's submit script (producer/records.py) charges the quota with
#: this very code in the same call that records the job.
TAKE_FN = REDIS_NOW + """
local function take(key, want, size, rate, now_arg)
  local now = redis_now(now_arg)
  local state = redis.call('HMGET', key, 'level', 'ts')
  local level, ts = tonumber(state[1]), tonumber(state[2])
  if not level then level, ts = size, now end
  -- a caller whose clock is behind the last writer's must not drain the bucket backwards
  level = math.min(size, level + math.max(0, now - ts) * rate)
  ts = math.max(ts, now)
  local ok = 0
  local retry = (want - level) / rate
  if want <= level then
    level = level - want
    ok, retry = 1, 0
  end
  redis.call('HSET', key, 'level', tostring(level), 'ts', tostring(ts))
  -- an idle bucket refills completely after (size - level) / rate: keep it until then
  redis.call('PEXPIRE', key, math.ceil((size - level) / rate * 1000) + 1000)
  return ok, retry
end
"""

# KEYS: bucket. ARGV: tokens, size, refill per second, now ('' = Redis time).
# Returns {1|0, retry_after seconds as a string (Lua numbers would be cut to integers)}.
_TAKE = TAKE_FN + """
local ok, retry = take(KEYS[1], tonumber(ARGV[1]), tonumber(ARGV[2]), tonumber(ARGV[3]), ARGV[4])
return {ok, tostring(retry)}
"""


class Take(NamedTuple):
    allowed: bool
    #: Seconds until the same take would succeed; 0 when allowed; math.inf when the
    #: take is larger than the bucket and can never succeed (answer 413, not 429).
    retry_after_s: float


class Level(NamedTuple):
    """A bucket as it stands, refilled to now (a read: nothing is taken)."""

    remaining: int  # tokens a take could have now
    reset_s: float  # seconds until the bucket is full again


class Quotas:
    def __init__(self, client: redis.Redis, keys: Keys) -> None:
        self.client = client
        self.keys = keys
        self._take = client.register_script(_TAKE)

    def try_take(self, tenant: Tenant, tokens: int, now: Optional[float] = None) -> Take:
        """Take `tokens` from the tenant's bucket, all or nothing."""
        if tokens <= 0:
            raise ValueError(f"tokens must be > 0, got {tokens}")
        if tokens > tenant.bucket_tokens:
            return Take(False, math.inf)
        ok, retry = self._take(
            keys=[self.keys.quota(tenant.name)],
            args=[tokens, tenant.bucket_tokens, repr(tenant.refill_per_s), now_arg(now)],
        )
        return Take(bool(ok), float(retry))

    def peek(self, tenant: Tenant, now: Optional[float] = None) -> Level:
        """The tenant's bucket refilled to `now` (this process's clock: a read for
        rate-limit headers, where a skew of a few ms does not matter)."""
        level, ts = self.client.hmget(self.keys.quota(tenant.name), "level", "ts")
        size = tenant.bucket_tokens
        if level is None or ts is None:
            return Level(size, 0.0)  # never charged, or idle long enough to expire full
        now = time.time() if now is None else now
        current = min(size, float(level) + max(0.0, now - float(ts)) * tenant.refill_per_s)
        return Level(int(current), (size - current) / tenant.refill_per_s)
