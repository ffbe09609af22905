"""The submit path's Redis work, awaited on the event loop: one round trip before Kafka.

    outcome = await records.submit(job, encoded, tenant)   # the quota and `queued`, at once
    ...produce...
    await records.undo(job, encoded, tenant)               # only if Kafka refused the job

`submit` charges the tenant's quota and records the job as queued in one Lua call: the
very functions of `kvfleet.quota.Quotas.try_take` and `kvfleet.jobstore.JobStore.create`
(`TAKE_FN`, `CREATE_FN`), so the API writes what the blocking originals write. It was
two calls, one before the produce and one after: a job waited on three services in a
row where it now waits on two (issue 16, docs/benchmarks.md "One round trip before
Kafka").

Recording before the produce opens a window in which a job is `queued` that Kafka does
not have. `undo` closes it when Kafka refuses the job: the record goes (only if it is
still this submission's, still queued) and the tokens go back, so the client's 503
still means "nothing was queued". A process that dies inside the window leaves a queued
record that no message follows; producer/submission.py produces a queued job again when
its client resubmits the id, so a client that retries as the docs say gets its job run
once (an id nobody resubmits expires with `PENDING_TTL_S`).

Sent through redis.asyncio, a submission holds no thread while Redis answers, and the
calls of concurrent submissions share round trips (producer/autopipeline.py).
tests/test_records.py checks the writes against the blocking originals.
"""

from __future__ import annotations

import math
from typing import NamedTuple, Optional

import redis.asyncio as aredis

from kvfleet import constants
from kvfleet.contracts import JobRequest, JobState
from kvfleet.jobstore import CREATE_FN
from kvfleet.lua import now_arg
from kvfleet.quota import TAKE_FN, Take
from kvfleet.tenancy import Tenant
from producer.autopipeline import AutoPipeline

# KEYS: job, job events[, bucket]. ARGV: the create's six (tenant, priority, request,
# queued_at, ttl, reply_to), then with a bucket the take's four (tokens, size, rate, now).
# Returns {0, state, tenant, '0'}: the id exists, nothing changed (no charge either);
# {2, '', '', retry}: over quota, nothing recorded; {1, 'queued', tenant, '0'}: recorded.
_SUBMIT = TAKE_FN + CREATE_FN + """
local cur = redis.call('HGET', KEYS[1], 'state')
if cur then return {0, cur, redis.call('HGET', KEYS[1], 'tenant'), '0'} end
if KEYS[3] then
  local ok, retry = take(KEYS[3], tonumber(ARGV[7]), tonumber(ARGV[8]), tonumber(ARGV[9]), ARGV[10])
  if ok == 0 then return {2, '', '', tostring(retry)} end
end
local created, state, tenant = create(KEYS[1], KEYS[2], ARGV[1], ARGV[2], ARGV[3], ARGV[4], ARGV[5], ARGV[6])
return {created, state, tenant, '0'}
"""

# KEYS: job[, bucket]. ARGV: the request JSON as recorded[, tokens, bucket size].
# Deletes the record only while it is this submission's and still queued (a produce
# whose outcome was unknown may have reached the scheduler, which then owns the job),
# and only then gives the tokens back. Returns 1 if it deleted the record.
_UNDO = """
if redis.call('HGET', KEYS[1], 'state') ~= 'queued' or redis.call('HGET', KEYS[1], 'request') ~= ARGV[1] then
  return 0
end
redis.call('DEL', KEYS[1])
if KEYS[2] then
  local level = tonumber(redis.call('HGET', KEYS[2], 'level'))
  if level then
    redis.call('HSET', KEYS[2], 'level', tostring(math.min(tonumber(ARGV[3]), level + tonumber(ARGV[2]))))
  end
end
return 1
"""


class Submitted(NamedTuple):
    """What `submit` did: `created` (recorded now), or the id was there already (`state`,
    `owner`: whose job it is), or `over_quota` (nothing recorded)."""

    created: bool
    state: Optional[JobState]
    owner: str
    over_quota: Optional[Take] = None


class Records:
    def __init__(self, client: aredis.Redis, keys: constants.Keys) -> None:
        self.keys = keys
        self._client = client
        self._pipeline = AutoPipeline(client)  # the calls of concurrent submissions share round trips
        self._submit = client.register_script(_SUBMIT)
        self._undo = client.register_script(_UNDO)

    async def submit(self, job: JobRequest, encoded: bytes, tenant: Optional[Tenant]) -> Submitted:
        """Charge `tenant`'s quota (None: no quotas) and record the job as queued, at
        once; `encoded` is the job's JSON, as it goes to Kafka. A job larger than the
        whole bucket is refused without a Redis call (`over_quota.retry_after_s` is inf)."""
        keys = [self.keys.job(job.job_id), self.keys.job_events(job.job_id)]
        args: list = [job.tenant, job.priority.value, encoded, repr(job.submitted_at), constants.PENDING_TTL_S,
                      job.reply_to or ""]
        if tenant is not None:
            if job.cost > tenant.bucket_tokens:
                return Submitted(False, None, "", Take(False, math.inf))
            keys.append(self.keys.quota(tenant.name))
            args += [job.cost, tenant.bucket_tokens, repr(tenant.refill_per_s), now_arg(None)]
        outcome, state, owner, retry = await self._pipeline.run(self._submit, keys, args)
        if outcome == 2:
            return Submitted(False, None, "", Take(False, float(retry)))
        return Submitted(bool(outcome), JobState(state.decode()), owner.decode())

    async def undo(self, job: JobRequest, encoded: bytes, tenant: Optional[Tenant]) -> bool:
        """Take back what `submit` did, after Kafka refused the job: True if the record went."""
        keys, args = [self.keys.job(job.job_id)], [encoded]
        if tenant is not None:
            keys.append(self.keys.quota(tenant.name))
            args += [job.cost, tenant.bucket_tokens]
        return bool(await self._pipeline.run(self._undo, keys, args))

    async def recorded_request(self, job_id: str) -> Optional[bytes]:
        """The request JSON a queued job was recorded with (what to produce again)."""
        return await self._client.hget(self.keys.job(job_id), "request")
