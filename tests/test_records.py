"""The submit path's Redis writes on the event loop (producer/records.py) write exactly
what the blocking originals write: `JobStore.create` and `Quotas.try_take`, on the real
Redis."""

from __future__ import annotations

import asyncio
import math
import time

import pytest
import redis.asyncio as aredis

from kvfleet.constants import Keys
from kvfleet.contracts import JobRequest, JobState, Priority, encode
from kvfleet.jobstore import JobStore
from kvfleet.quota import Quotas
from kvfleet.tenancy import Tenant, Tier
from producer.records import Records

ACME = Tenant(name="acme", tier=Tier.SILVER, tokens_per_minute=600, burst_tokens=100)  # 10 tokens/s, 100 at once


def _job(job_id: str, **fields) -> JobRequest:
    return JobRequest(job_id=job_id, tenant="acme", priority=Priority.HIGH, model="builtin:tiny", max_new_tokens=4,
                      submitted_at=1_700_000_000.25, prompt_tokens=[7, 8, 9], **fields)


async def _with_records(redis_url: str, keys: Keys, use):
    client = aredis.Redis.from_url(redis_url)
    try:
        return await use(Records(client, keys))
    finally:
        await client.aclose()


def test_create_writes_the_job_store_s_record(redis_url, redis_client, prefix):
    keys = Keys(prefix)
    ours, theirs = _job("async-1", reply_to="replies"), _job("sync-1", reply_to="replies")
    created = asyncio.run(_with_records(redis_url, keys, lambda r: r.create(ours, encode(ours))))
    assert created == (True, JobState.QUEUED, "acme")
    assert JobStore(redis_client, keys).create(theirs) == (True, JobState.QUEUED, "acme")

    def fields(job: JobRequest) -> dict:
        raw = redis_client.hgetall(keys.job(job.job_id))
        return {k: v.replace(job.job_id.encode(), b"<id>") for k, v in raw.items()}

    assert fields(ours) == fields(theirs)
    assert abs(redis_client.ttl(keys.job(ours.job_id)) - redis_client.ttl(keys.job(theirs.job_id))) <= 1


def test_create_of_an_existing_id_changes_nothing_and_names_its_owner(redis_url, redis_client, prefix):
    keys = Keys(prefix)
    first = _job("taken-1")
    JobStore(redis_client, keys).create(first)
    other = JobRequest(job_id="taken-1", tenant="globex", priority=Priority.LOW, model="builtin:tiny",
                       max_new_tokens=9, submitted_at=time.time(), prompt_tokens=[1])
    again = asyncio.run(_with_records(redis_url, keys, lambda r: r.create(other, b"{}")))
    assert again == (False, JobState.QUEUED, "acme")
    assert redis_client.hget(keys.job("taken-1"), "tenant") == b"acme"


def test_take_answers_as_the_quota_does(redis_url, redis_client, prefix):
    keys = Keys(prefix)
    quotas = Quotas(redis_client, keys)
    asked = [60, 30, 30, 100, 5]

    async def takes(records: Records):
        return [await records.take(ACME, n) for n in asked]

    ours = asyncio.run(_with_records(redis_url, Keys(prefix + "a"), takes))
    theirs = [quotas.try_take(ACME, n) for n in asked]
    assert [t.allowed for t in ours] == [t.allowed for t in theirs] == [True, True, False, False, True]
    for a, b in zip(ours, theirs):
        assert a.retry_after_s == pytest.approx(b.retry_after_s, abs=0.5)  # Redis' clock, a moment apart
    # Larger than the bucket: never, without a Redis call; nothing or less: a bug.
    too_big = asyncio.run(_with_records(redis_url, keys, lambda r: r.take(ACME, 101)))
    assert not too_big.allowed and math.isinf(too_big.retry_after_s)
    with pytest.raises(ValueError):
        asyncio.run(_with_records(redis_url, keys, lambda r: r.take(ACME, 0)))
