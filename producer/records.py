"""The submit path's two Redis writes, awaited on the event loop.

    take = await records.take(tenant, job.cost)                   # before Kafka: the quota
    created, state, owner = await records.create(job, encoded)    # after Kafka: `queued`

They are the very Lua scripts of `kvfleet.quota.Quotas.try_take` and
`kvfleet.jobstore.JobStore.create`, with the same KEYS and ARGV, sent through
redis.asyncio: a submission holds no thread while Redis answers (those classes take
the blocking client, which the API could only call from a worker thread), and the calls
of concurrent submissions share round trips (producer/autopipeline.py).
tests/test_records.py checks that both write what the blocking originals write.
"""

from __future__ import annotations

import math

import redis.asyncio as aredis

from kvfleet import constants
from kvfleet.contracts import JobRequest, JobState
from kvfleet.jobstore import _CREATE  # noqa: PLC2701 - the one create script, shared, not copied
from kvfleet.lua import now_arg
from kvfleet.quota import _TAKE, Take  # noqa: PLC2701 - the one bucket script, shared, not copied
from kvfleet.tenancy import Tenant
from producer.autopipeline import AutoPipeline


class Records:
    def __init__(self, client: aredis.Redis, keys: constants.Keys) -> None:
        self.keys = keys
        self._pipeline = AutoPipeline(client)  # the calls of concurrent submissions share round trips
        self._take = client.register_script(_TAKE)
        self._create = client.register_script(_CREATE)

    async def take(self, tenant: Tenant, tokens: int) -> Take:
        """Take `tokens` from the tenant's bucket, all or nothing (`Quotas.try_take`)."""
        if tokens <= 0:
            raise ValueError(f"tokens must be > 0, got {tokens}")
        if tokens > tenant.bucket_tokens:
            return Take(False, math.inf)
        ok, retry = await self._pipeline.run(
            self._take, [self.keys.quota(tenant.name)],
            [tokens, tenant.bucket_tokens, repr(tenant.refill_per_s), now_arg(None)])
        return Take(bool(ok), float(retry))

    async def create(self, job: JobRequest, encoded: bytes) -> tuple[bool, JobState, str]:
        """Record the job as queued (`JobStore.create`); `encoded` is its JSON, as
        produced to Kafka. If the id exists, nothing changes: (False, its state, its tenant)."""
        created, state, tenant = await self._pipeline.run(
            self._create, [self.keys.job(job.job_id), self.keys.job_events(job.job_id)],
            [job.tenant, job.priority.value, encoded, repr(job.submitted_at), constants.PENDING_TTL_S,
             job.reply_to or ""])
        return bool(created), JobState(state.decode()), tenant.decode()
