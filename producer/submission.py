"""The one submit path every route takes (native `/v1/jobs`, OpenAI completions and chat):
admission, then Kafka, then the job's state.

    existing = await submit(ctx, tenant, job, client_id=...)

Order matters for "nothing lost, nothing run twice":
- a job resubmitted under its own `job_id` by its own tenant is answered with the
  existing job before any check, so a retry never pays the quota twice;
- Kafka first, then the state (producer/publisher.py says why): a failed produce
  records nothing, so a client retrying under the same `job_id` gets one run.

Every step is awaited on the event loop and none holds a thread: the quota's Lua call
and the record's (producer/records.py) through redis.asyncio, the produce through the
producer's callbacks (producer/publisher.py). A job without a client id waits on the
quota's round trip (with tenants configured), the produce and the record's round trip,
nothing else. `kvfleet_api_submit_step_seconds{step}` times each step.
"""

from __future__ import annotations

import logging
import time
from typing import Optional

import redis
from prometheus_client import Counter, Histogram

from kvfleet.contracts import JobRequest, JobResult
from kvfleet.tenancy import Tenant
from producer.context import ApiContext
from producer.errors import Conflict, StoreUnavailable

log = logging.getLogger("kvfleet.api")

SUBMITTED = Counter("kvfleet_api_jobs_submitted", "Jobs accepted onto Kafka", ["priority"])
STEP = Histogram("kvfleet_api_submit_step_seconds",
                 "Time of each step of a submission: parse (body, tenant, validation, tokens), admit (idempotency, "
                 "admission, quota), produce (until Kafka acknowledged), record (the queued state)", ["step"],
                 buckets=(0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 10))
PARSE, ADMIT, PRODUCE, RECORD = (STEP.labels(step) for step in ("parse", "admit", "produce", "record"))


async def submit(ctx: ApiContext, tenant: Tenant, job: JobRequest, *, client_id: bool,
                 output_field: str = "max_new_tokens") -> Optional[JobResult]:
    """Queue `job`; None when it was queued now, or the existing job when the client
    resubmitted an id it used before (`client_id`: the id came from the client).
    Raises Refused / QueueUnavailable / Conflict (the id is another tenant's)."""
    started = time.perf_counter()
    try:
        if client_id:
            existing = await ctx.read(job.job_id)
            if existing is not None:
                if existing.tenant != tenant.name:
                    raise Conflict(f"job_id {job.job_id!r} is taken; choose another or leave job_id out",
                                   param="job_id")
                return existing
        await ctx.gate.check(tenant, job, output_field=output_field)
    except redis.RedisError as exc:
        # Before the produce: nothing is on Kafka, so the client may simply retry.
        log.error("job store unavailable", extra={"job_id": job.job_id, "error": str(exc)})
        raise StoreUnavailable(f"the job store is unavailable ({exc}); nothing was queued: retry later with the "
                               "same job_id", job_id=job.job_id) from exc
    admitted = time.perf_counter()
    ADMIT.observe(admitted - started)
    encoded = await ctx.publisher.publish(job)
    produced = time.perf_counter()
    PRODUCE.observe(produced - admitted)
    try:
        created, _, owner = await ctx.records.create(job, encoded)
    except redis.RedisError as exc:
        # After the produce the job is on Kafka and will run: the scheduler records a job
        # it finds without a state. So it is accepted, not refused (a retry would be
        # recognised by its id, but a client without one would submit it twice).
        log.warning("job queued on Kafka; its state is recorded by the scheduler",
                    extra={"job_id": job.job_id, "error": str(exc)})
        created, owner = True, tenant.name
    RECORD.observe(time.perf_counter() - produced)
    if not created and owner != tenant.name:  # another tenant's job took the id meanwhile
        raise Conflict(f"job_id {job.job_id!r} is taken; choose another or leave job_id out", param="job_id")
    # (Not created, same tenant: the scheduler read it first and recorded it.)
    SUBMITTED.labels(job.priority.value).inc()
    return None
