"""The token ledger: every admitted job's KV-token reservation, shared by all scheduler
replicas, renewed by the worker running the job and released when the job ends.

Layout (keys from `Keys`, kvfleet/constants.py):
    {prefix}:ledger          hash  job_id -> tokens reserved
    {prefix}:ledger:leases   zset  job_id -> lease deadline (unix seconds, Redis's clock)
    {prefix}:ledger:meta     hash  job_id -> "tenant priority", for per-tenant and
                                   per-class usage

All of the ledger's Lua is here. A reservation is made only together with the job's move
to `admitted` (`ADMIT`, run by `JobStore.admit_many`) and released only together with
the job's terminal state (`RELEASE`, part of `JobStore.finish`), so a job's state and its
tokens never disagree; the `Ledger` class renews, reclaims and reads.

Races, and why each is safe:
- Two replicas reserve at once: the check (sum of the hash) and the write happen in one
  Lua script, so the sum never exceeds the capacity the caller passed.
- A Kafka redelivery reserves the same job again: the job id is already a field, so the
  script only extends the lease and counts nothing twice.
- The worker dies: nobody renews the lease; `reclaim_expired` hands the job to the
  replica that called it by pushing the lease forward (the reservation stays: it is
  the job's only durable pointer once its offset is committed and its Celery message is
  gone), and returns the job id for the service to send again (at-least-once). If that
  replica dies or fails before the send, the new lease runs out too and the next
  reclaim, by any replica, takes the job again: a reclaimed job never lives only in a
  scheduler's memory.
- A job finishes while `reclaim_expired` runs: Lua scripts do not interleave; either the
  finish released it first (the reclaim's `ZADD XX` adds nothing back) or the reclaim
  handed it out first (the send finds it finished and skips it).
- A reclaimed job's first worker was only slow: its finish carries its run-lease token,
  which the job store checks, so it cannot release the copy that took over.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Optional

import redis
from redis.commands.core import Script

from kvfleet.constants import Keys
from kvfleet.contracts import Priority
from kvfleet.lua import REDIS_NOW, now_arg

# The reservation rule. A job already reserved counts once and only has its lease
# extended (a redelivery); otherwise it is reserved if the ledger's sum plus its tokens
# fits the capacity, and (max_jobs > 0) the ledger holds fewer than max_jobs jobs: a
# worker runs at most as many jobs as it has task threads, so tokens alone would admit
# jobs that only wait in the Celery queue. `t` carries the sum and the count, computed
# on first need and updated, so a batch reads them once. Returns 1 reserved | -1 full.
RESERVE = """
local function ledger_sum(ledger)
  local total = 0
  for _, v in ipairs(redis.call('HVALS', ledger)) do total = total + tonumber(v) end
  return total
end
local function reserve(ledger, leases, metas, id, tokens, meta, deadline, capacity, max_jobs, t)
  if redis.call('HEXISTS', ledger, id) == 1 then
    redis.call('ZADD', leases, 'GT', deadline, id)
    return 1
  end
  if not t.used then t.used, t.jobs = ledger_sum(ledger), redis.call('HLEN', ledger) end
  if t.used + tokens > capacity then return -1 end
  if max_jobs > 0 and t.jobs >= max_jobs then return -1 end
  redis.call('HSET', ledger, id, tokens)
  redis.call('ZADD', leases, deadline, id)
  redis.call('HSET', metas, id, meta)
  t.used, t.jobs = t.used + tokens, t.jobs + 1
  return 1
end
"""

# Frees a job's reservation, all three entries; 1 if it held tokens.
RELEASE = """
local function release(ledger, leases, metas, id)
  local held = redis.call('HDEL', ledger, id)
  redis.call('ZREM', leases, id)
  redis.call('HDEL', metas, id)
  return held
end
"""

# Admission of a batch, in order: each job's reservation and its move to "admitted",
# together or not at all, so a job that is cancelled, running or finished is never
# reserved (the mirror of the job store's finish, which releases).
# KEYS: ledger, leases, meta, then per job: job hash, events channel
# ARGV: capacity, lease_s, admitted_at, admitted_by, max_jobs (0 = no limit), then per
#       job: job_id, tokens, meta ("tenant priority"), revive ('1': reserve it although
#       running: its worker died)
# Returns per job: state before the call ('' = no such job), 1 reserved | 0 not admissible | -1 full
ADMIT = REDIS_NOW + RESERVE + """
local deadline = redis_now('') + tonumber(ARGV[2])
local capacity, max_jobs = tonumber(ARGV[1]), tonumber(ARGV[5])
local t = {}
local out = {}
for i = 1, (#KEYS - 3) / 2 do
  local job, events = KEYS[2 + 2 * i], KEYS[3 + 2 * i]
  local id, tokens, meta, revive = ARGV[2 + 4 * i], tonumber(ARGV[3 + 4 * i]), ARGV[4 + 4 * i], ARGV[5 + 4 * i]
  local cur = redis.call('HGET', job, 'state')
  local code = 0
  if cur == 'queued' or cur == 'admitted' or (cur == 'running' and revive == '1') then
    code = reserve(KEYS[1], KEYS[2], KEYS[3], id, tokens, meta, deadline, capacity, max_jobs, t)
    if code == 1 and cur == 'queued' then
      redis.call('HSET', job, 'state', 'admitted', 'admitted_at', ARGV[3], 'admitted_by', ARGV[4])
      redis.call('PUBLISH', events, 'admitted')
    end
  end
  table.insert(out, cur or '')
  table.insert(out, code)
end
return out
"""

# KEYS: ledger, leases. ARGV: job_id, lease_s, now. Only a live reservation is renewed:
# one already released stays released.
_RENEW = REDIS_NOW + """
if redis.call('HEXISTS', KEYS[1], ARGV[1]) == 0 then return 0 end
redis.call('ZADD', KEYS[2], 'XX', redis_now(ARGV[3]) + tonumber(ARGV[2]), ARGV[1])
return 1
"""

# KEYS: ledger, leases. ARGV: now, lease_s. Every expired reservation gets a fresh lease
# of lease_s (the caller's claim on sending its job again) in the same step that hands
# it out, so a caller that crashes before the send loses nothing: the lease runs out
# again. Returns the reclaimed job ids.
_RECLAIM = REDIS_NOW + """
local now = redis_now(ARGV[1])
local expired = redis.call('ZRANGEBYSCORE', KEYS[2], '-inf', '(' .. now)
for _, job in ipairs(expired) do redis.call('ZADD', KEYS[2], 'XX', now + tonumber(ARGV[2]), job) end
return expired
"""

# KEYS: ledger, leases, meta. ARGV: job_id. For a reservation whose job is gone.
_RELEASE = RELEASE + """
return release(KEYS[1], KEYS[2], KEYS[3], ARGV[1])
"""

# KEYS: ledger, meta. Returns {job, tokens, meta or '', ...} in one consistent read.
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


def ledger_keys(keys: Keys) -> list[str]:
    """KEYS[1..3] of every ledger script: the reservations, their leases, their meta."""
    return [keys.ledger, keys.ledger_leases, keys.ledger_meta]


@dataclass(frozen=True)
class Usage:
    """Tokens reserved now, in total and split by tenant, by class and by both."""

    in_use: int = 0
    jobs: int = 0  # reservations: jobs admitted or running
    by_tenant: dict[str, int] = field(default_factory=dict)
    by_class: dict[Priority, int] = field(default_factory=dict)
    by_tenant_class: dict[tuple[str, Priority], int] = field(default_factory=dict)


class Ledger:
    """Renews, reclaims and reads reservations (`JobStore` makes and releases them)."""

    def __init__(self, client: redis.Redis, keys: Keys) -> None:
        self.client = client
        self._keys = ledger_keys(keys)
        self._renew = client.register_script(_RENEW)
        self._reclaim = client.register_script(_RECLAIM)
        self._release = client.register_script(_RELEASE)
        self._snapshot = client.register_script(_SNAPSHOT)

    def renew(self, job_id: str, lease_s: float, *, now: Optional[float] = None,
              pipe: Optional[redis.client.Pipeline] = None) -> bool:
        """Push the lease deadline to now + lease_s. False: the reservation is gone
        (finished, released or reclaimed), and the caller must not assume it holds tokens.
        With `pipe`, queued on that pipeline instead (its reply comes with `execute`)."""
        if pipe is not None:
            self._renew(keys=self._keys[:2], args=[job_id, lease_s, now_arg(now)], client=pipe)
            return True
        return bool(self._renew(keys=self._keys[:2], args=[job_id, lease_s, now_arg(now)]))

    def reclaim_expired(self, lease_s: float, now: Optional[float] = None) -> list[str]:
        """Every reservation whose lease ran out (its worker died, or its task was lost):
        their job ids, each leased to this caller for `lease_s` to send the job again.
        The tokens stay reserved for the job; a caller that never sends it loses
        nothing, since the lease runs out again and the next reclaim returns it."""
        return [j.decode() for j in self._reclaim(keys=self._keys[:2], args=[now_arg(now), lease_s])]

    def release(self, job_id: str) -> bool:
        """Drop a reservation whose job no longer exists (its record expired); True if
        it held tokens. A job that exists is released by its finish, never here."""
        return bool(self._release(keys=self._keys, args=[job_id]))

    def in_use(self) -> int:
        return sum(int(v) for v in self.client.hvals(self._keys[0]))

    def usage(self) -> Usage:
        script, keys, args = self.usage_call()
        return self.decode_usage(script(keys=keys, args=args))

    def usage_call(self) -> tuple[Script, list, list]:
        """The script call `usage` makes, for a caller that sends it in one pipeline with
        calls of its own (`ScriptBatch.run_all`); `decode_usage` reads its reply."""
        return self._snapshot, [self._keys[0], self._keys[2]], []

    @staticmethod
    def decode_usage(raw: list) -> Usage:
        total, by_tenant, by_class, by_both = 0, {}, {}, {}
        for i in range(0, len(raw), 3):
            tokens = int(raw[i + 1])
            tenant, _, priority = raw[i + 2].decode().partition(" ")
            total += tokens
            if tenant:
                by_tenant[tenant] = by_tenant.get(tenant, 0) + tokens
            if priority:
                by_class[Priority(priority)] = by_class.get(Priority(priority), 0) + tokens
            if tenant and priority:
                key = (tenant, Priority(priority))
                by_both[key] = by_both.get(key, 0) + tokens
        return Usage(total, len(raw) // 3, by_tenant, by_class, by_both)
