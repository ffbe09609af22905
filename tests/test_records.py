"""The submit path's Redis writes on the event loop (producer/records.py) write exactly
what the blocking originals write, `JobStore.create` and `Quotas.try_take`, in one call;
and take back exactly their own when Kafka refuses the job; on the real Redis."""

from __future__ import annotations

import asyncio
import math
import time

import msgspec
import pytest
import redis.asyncio as aredis

from kvfleet.constants import Keys
from kvfleet.contracts import JobRequest, JobState, Priority, encode
from kvfleet.jobstore import JobStore
from kvfleet.quota import Quotas
from kvfleet.tenancy import Tenant, Tier
from producer.records import Records

ACME = Tenant(name="acme", tier=Tier.SILVER, tokens_per_minute=600, burst_tokens=100)  # 10 tokens/s, 100 at once


def _job(job_id: str, max_new_tokens: int = 4, **fields) -> JobRequest:
    return JobRequest(job_id=job_id, tenant="acme", priority=Priority.HIGH, model="builtin:tiny",
                      max_new_tokens=max_new_tokens, submitted_at=1_700_000_000.25, prompt_tokens=[7, 8, 9], **fields)


async def _with_records(redis_url: str, keys: Keys, use):
    client = aredis.Redis.from_url(redis_url)
    try:
        return await use(Records(client, keys))
    finally:
        await client.aclose()


def test_submit_writes_the_job_store_s_record(redis_url, redis_client, prefix):
    keys = Keys(prefix)
    ours, theirs = _job("async-1", reply_to="replies"), _job("sync-1", reply_to="replies")
    submitted = asyncio.run(_with_records(redis_url, keys, lambda r: r.submit(ours, encode(ours), None)))
    assert submitted == (True, JobState.QUEUED, "acme", None)
    assert JobStore(redis_client, keys).create(theirs) == (True, JobState.QUEUED, "acme")

    def fields(job: JobRequest) -> dict:
        raw = redis_client.hgetall(keys.job(job.job_id))
        return {k: v.replace(job.job_id.encode(), b"<id>") for k, v in raw.items()}

    assert fields(ours) == fields(theirs)
    assert abs(redis_client.ttl(keys.job(ours.job_id)) - redis_client.ttl(keys.job(theirs.job_id))) <= 1


def test_submit_of_an_existing_id_changes_nothing_charges_nothing_and_names_its_owner(redis_url, redis_client,
                                                                                      prefix):
    keys = Keys(prefix)
    first = _job("taken-1")
    JobStore(redis_client, keys).create(first)
    other = JobRequest(job_id="taken-1", tenant="globex", priority=Priority.LOW, model="builtin:tiny",
                       max_new_tokens=9, submitted_at=time.time(), prompt_tokens=[1])
    again = asyncio.run(_with_records(redis_url, keys, lambda r: r.submit(other, b"{}", ACME)))
    assert again == (False, JobState.QUEUED, "acme", None)
    assert redis_client.hget(keys.job("taken-1"), "tenant") == b"acme"
    assert not redis_client.exists(keys.quota("acme"))  # the bucket was never touched


def test_submit_charges_as_the_quota_does_and_records_only_what_it_charged(redis_url, redis_client, prefix):
    keys = Keys(prefix)
    quotas = Quotas(redis_client, keys)
    asked = [60, 30, 30, 100, 5]  # costs (prompt of 3 + max_new_tokens)

    async def submits(records: Records):
        jobs = [_job(f"q-{i}", max_new_tokens=n - 3) for i, n in enumerate(asked)]
        return jobs, [await records.submit(job, encode(job), ACME) for job in jobs]

    jobs, ours = asyncio.run(_with_records(redis_url, Keys(prefix + "a"), submits))
    theirs = [quotas.try_take(ACME, n) for n in asked]
    allowed = [s.over_quota is None for s in ours]
    assert allowed == [t.allowed for t in theirs] == [True, True, False, False, True]
    for s, t in zip(ours, theirs):
        retry = 0.0 if s.over_quota is None else s.over_quota.retry_after_s
        assert retry == pytest.approx(t.retry_after_s, abs=0.5)  # Redis' clock, a moment apart
    recorded = [bool(redis_client.exists(Keys(prefix + "a").job(job.job_id))) for job in jobs]
    assert recorded == allowed
    # Larger than the bucket: never, without a Redis call.
    big = _job("too-big", max_new_tokens=99)
    too_big = asyncio.run(_with_records(redis_url, keys, lambda r: r.submit(big, encode(big), ACME)))
    assert not too_big.created and math.isinf(too_big.over_quota.retry_after_s)
    assert not redis_client.exists(keys.job("too-big"))


def test_undo_takes_back_only_its_own_queued_record_and_its_tokens(redis_url, redis_client, prefix):
    keys = Keys(prefix)
    store = JobStore(redis_client, keys)
    mine, admitted, retried = _job("undo-1", max_new_tokens=37), _job("undo-2", max_new_tokens=37), _job("undo-3")

    async def scenario(records: Records):
        for job in (mine, admitted, retried):
            assert (await records.submit(job, encode(job), ACME)).created
        store.transition(admitted.job_id, JobState.ADMITTED)  # the scheduler took it: it will run
        level = float(redis_client.hget(keys.quota("acme"), "level"))
        # A different body under the same id (another submission's) is not this one's record.
        other = msgspec.structs.replace(retried, submitted_at=retried.submitted_at + 1)
        undone = [await records.undo(mine, encode(mine), ACME), await records.undo(admitted, encode(admitted), ACME),
                  await records.undo(retried, encode(other), ACME)]
        return level, undone

    level, undone = asyncio.run(_with_records(redis_url, keys, scenario))
    assert undone == [True, False, False]
    assert store.state(mine.job_id) is None
    assert store.state(admitted.job_id) is JobState.ADMITTED and store.state(retried.job_id) is JobState.QUEUED
    refunded = float(redis_client.hget(keys.quota("acme"), "level"))
    assert level + mine.cost - 1 <= refunded <= min(100, level + mine.cost + 1)  # the refill since, a token or so
