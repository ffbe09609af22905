"""The one submit path every route takes (native `/v1/jobs`, OpenAI completions and chat):
admission, then Kafka, then the job's state.

    existing = await submit(ctx, tenant, job, client_id=...)

Order matters for "nothing lost, nothing run twice":
- a job resubmitted under its own `job_id` by its own tenant is answered with the
  existing job before any check, so a retry never pays the quota twice;
- Kafka first, then the state (producer/publisher.py says why): a failed produce
  records nothing, so a client retrying under the same `job_id` gets one run.
"""

from __future__ import annotations

from typing import Optional

import anyio
from prometheus_client import Counter

from kvfleet.contracts import JobRequest, JobResult
from kvfleet.tenancy import Tenant
from producer.context import ApiContext
from producer.errors import Conflict

SUBMITTED = Counter("kvfleet_api_jobs_submitted", "Jobs accepted onto Kafka", ["priority"])


async def submit(ctx: ApiContext, tenant: Tenant, job: JobRequest, *, client_id: bool,
                 output_field: str = "max_new_tokens") -> Optional[JobResult]:
    """Queue `job`; None when it was queued now, or the existing job when the client
    resubmitted an id it used before (`client_id`: the id came from the client).
    Raises Refused / QueueUnavailable / Conflict (the id is another tenant's)."""
    existing = await anyio.to_thread.run_sync(_admit, ctx, tenant, job, client_id, output_field)
    if existing is not None:
        if existing.tenant != tenant.name:
            raise Conflict(f"job_id {job.job_id!r} is taken; choose another or leave job_id out", param="job_id")
        return existing
    await anyio.to_thread.run_sync(ctx.publisher.publish, job)
    created, _, owner = await anyio.to_thread.run_sync(ctx.store.create, job)
    if not created and owner != tenant.name:  # another tenant's job took the id meanwhile
        raise Conflict(f"job_id {job.job_id!r} is taken; choose another or leave job_id out", param="job_id")
    # (Not created, same tenant: the scheduler read it first and recorded it.)
    SUBMITTED.labels(job.priority.value).inc()
    return None


def _admit(ctx: ApiContext, tenant: Tenant, job: JobRequest, client_id: bool, output_field: str,
           ) -> Optional[JobResult]:
    """Redis calls: run on a worker thread."""
    if client_id:
        existing = ctx.store.get(job.job_id)
        if existing is not None:
            return existing
    ctx.gate.check(tenant, job, output_field=output_field)
    return None

