"""The token ledger: every admitted job's KV-token reservation, shared by all scheduler
replicas and released by the worker that finishes the job.

Layout (the job store's `_FINISH` script releases with the same two commands):
    {prefix}:ledger          hash  job_id -> tokens reserved
    {prefix}:ledger:leases   zset  job_id -> lease deadline (unix seconds)
    {prefix}:ledger:meta     hash  job_id -> "tenant priority", for per-tenant and
                                   per-class usage; `_FINISH` does not know it, so an
                                   entry can outlive its reservation and is ignored
                                   (and swept by `reclaim_expired`) once the job is gone.

Races, and why each is safe:
- Two replicas reserve at once: the check (sum of the hash) and the write happen in one
  Lua script, so the sum never exceeds the capacity the caller passed.
- A Kafka redelivery reserves the same job again: the job id is already a field, so the
  script only extends the lease and counts nothing twice.
- The worker dies: nobody renews the lease; `reclaim_expired` frees the tokens and
  returns the job id for the service to redeliver (at-least-once).
- A job finishes while `reclaim_expired` runs: both delete the same fields; deleting a
  missing field is a no-op, so the tokens are released exactly once.
- A reclaimed job's first worker was only slow: its finish carries its run-lease token,
  which the job store checks, so it cannot release the copy that took over.

Time is Redis's own clock (`TIME`) unless a caller passes `now`, so replicas with skewed
clocks agree on which leases expired.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Optional

import redis

from kvfleet.constants import Keys
from kvfleet.contracts import Priority
from kvfleet.jobstore import RESERVE_LUA

#: Lease of a reservation from admission until a worker starts the job and renews it:
#: covers the Celery queue wait. A worker renews every third of RUN_LEASE_S.
ADMIT_LEASE_S = 60.0

# Redis time in seconds when ARGV[n] is '' (one clock for every replica).
_NOW = """
local function now(arg)
  if arg ~= '' then return tonumber(arg) end
  local t = redis.call('TIME')
  return tonumber(t[1]) + tonumber(t[2]) / 1e6
end
"""

# KEYS: ledger, leases, meta. ARGV: job_id, tokens, lease_s, capacity, meta, now.
# Returns {1|0, tokens in use after the call}. The rule itself is RESERVE_LUA, shared
# with the batched admission of kvfleet/jobstore.py.
_RESERVE = _NOW + RESERVE_LUA + """
local code, used = reserve(KEYS[1], KEYS[2], KEYS[3], ARGV[1], tonumber(ARGV[2]), ARGV[5],
                           now(ARGV[6]) + tonumber(ARGV[3]), tonumber(ARGV[4]), nil)
if used == nil then used = ledger_sum(KEYS[1]) end
return {code == 1 and 1 or 0, used}
"""

# KEYS: ledger, leases, meta. ARGV: job_id. Returns 1 if it held a reservation.
_RELEASE = """
local held = redis.call('HDEL', KEYS[1], ARGV[1])
redis.call('ZREM', KEYS[2], ARGV[1])
redis.call('HDEL', KEYS[3], ARGV[1])
return held
"""

# KEYS: ledger, leases. ARGV: job_id, lease_s, now. Only a live reservation is renewed:
# one already reclaimed stays reclaimed (its job was handed out again).
_RENEW = _NOW + """
if redis.call('HEXISTS', KEYS[1], ARGV[1]) == 0 then return 0 end
redis.call('ZADD', KEYS[2], 'XX', now(ARGV[3]) + tonumber(ARGV[2]), ARGV[1])
return 1
"""

# KEYS: ledger, leases, meta. ARGV: now. Returns the reclaimed job ids.
_RECLAIM = _NOW + """
local expired = redis.call('ZRANGEBYSCORE', KEYS[2], '-inf', '(' .. now(ARGV[1]))
for _, job in ipairs(expired) do
  redis.call('HDEL', KEYS[1], job)
  redis.call('ZREM', KEYS[2], job)
  redis.call('HDEL', KEYS[3], job)
end
-- sweep meta entries whose reservation a worker's finish already released
for _, job in ipairs(redis.call('HKEYS', KEYS[3])) do
  if redis.call('HEXISTS', KEYS[1], job) == 0 then redis.call('HDEL', KEYS[3], job) end
end
return expired
"""

# KEYS: ledger, meta. Returns {job, tokens, meta or false, ...} in one consistent read.
_SNAPSHOT = """
local out = {}
local all = redis.call('HGETALL', KEYS[1])
for i = 1, #all, 2 do
  table.insert(out, all[i])
  table.insert(out, all[i + 1])
  table.insert(out, redis.call('HGET', KEYS[2], all[i]) or '')
end
return out
"""


@dataclass(frozen=True)
class Usage:
    """Tokens reserved now, in total and split by tenant and by class."""

    in_use: int = 0
    by_tenant: dict[str, int] = field(default_factory=dict)
    by_class: dict[Priority, int] = field(default_factory=dict)


class Ledger:
    def __init__(self, client: redis.Redis, keys: Keys) -> None:
        self.client = client
        self._keys = [keys.ledger, keys.ledger + ":leases", keys.ledger + ":meta"]
        self._reserve = client.register_script(_RESERVE)
        self._release = client.register_script(_RELEASE)
        self._renew = client.register_script(_RENEW)
        self._reclaim = client.register_script(_RECLAIM)
        self._snapshot = client.register_script(_SNAPSHOT)

    def reserve(self, job_id: str, tokens: int, lease_s: float, capacity: int, *,
                tenant: str = "", priority: Optional[Priority] = None, now: Optional[float] = None) -> bool:
        """Reserve `tokens` for the job if in use + tokens <= capacity. True when the job
        now holds a reservation, also when it already did (nothing is counted twice)."""
        if tokens <= 0 or lease_s <= 0:
            raise ValueError(f"reserve needs tokens > 0 and lease_s > 0, got {tokens} and {lease_s}")
        meta = f"{tenant} {priority.value if priority else ''}"
        ok, _ = self._reserve(keys=self._keys, args=[job_id, tokens, lease_s, capacity, meta, _arg(now)])
        return bool(ok)

    def release(self, job_id: str) -> bool:
        """Free the job's tokens (the worker's finish does this itself); True if it held some."""
        return bool(self._release(keys=self._keys, args=[job_id]))

    def renew(self, job_id: str, lease_s: float, *, now: Optional[float] = None) -> bool:
        """Push the lease deadline to now + lease_s. False: the reservation is gone
        (finished, released or reclaimed), and the caller must not assume it holds tokens."""
        return bool(self._renew(keys=self._keys[:2], args=[job_id, lease_s, _arg(now)]))

    def reclaim_expired(self, now: Optional[float] = None) -> list[str]:
        """Free every reservation whose lease ran out (its worker died) and return their
        job ids: the service hands those jobs out again."""
        return [j.decode() for j in self._reclaim(keys=self._keys, args=[_arg(now)])]

    def in_use(self) -> int:
        return sum(int(v) for v in self.client.hvals(self._keys[0]))

    def tokens(self, job_id: str) -> Optional[int]:
        raw = self.client.hget(self._keys[0], job_id)
        return int(raw) if raw is not None else None

    def usage(self) -> Usage:
        raw = self._snapshot(keys=[self._keys[0], self._keys[2]])
        total, by_tenant, by_class = 0, {}, {}
        for i in range(0, len(raw), 3):
            tokens = int(raw[i + 1])
            tenant, _, priority = raw[i + 2].decode().partition(" ")
            total += tokens
            if tenant:
                by_tenant[tenant] = by_tenant.get(tenant, 0) + tokens
            if priority:
                by_class[Priority(priority)] = by_class.get(Priority(priority), 0) + tokens
        return Usage(total, by_tenant, by_class)


def _arg(now: Optional[float]) -> str:
    return "" if now is None else repr(now)
