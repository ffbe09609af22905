"""The results API's long poll (producer/context.py `ApiContext.wait_terminal`) on the
real Redis: it answers once the job is terminal, reads the job only when a change may
have ended it, and lets its pub/sub connection go after the answer."""

from __future__ import annotations

import asyncio
import time
from types import SimpleNamespace

import redis.asyncio as aredis

from kvfleet.constants import Keys
from kvfleet.contracts import JobRequest, JobResult, JobState, Priority, encode
from kvfleet.jobstore import JobStore
from kvfleet.settings import Settings
from producer.context import ApiContext


class CountingClient:
    """The async client, with a count of the published messages its long polls took."""

    def __init__(self, client: aredis.Redis) -> None:
        self.client = client
        self.taken = 0

    def pubsub(self):
        pubsub = self.client.pubsub()
        get_message = pubsub.get_message

        async def counted(**kwargs):
            message = await get_message(**kwargs)
            self.taken += message is not None and message["type"] == "message"
            return message

        pubsub.get_message = counted
        return pubsub

    def __getattr__(self, name):
        return getattr(self.client, name)


def test_a_long_poll_reads_the_job_only_for_changes_that_may_end_it(redis_url, redis_client, prefix):
    keys = Keys(prefix)
    store = JobStore(redis_client, keys)
    job = JobRequest(job_id=f"{prefix}-job", tenant="acme", priority=Priority.NORMAL, model="builtin:tiny",
                     max_new_tokens=1, submitted_at=time.time(), prompt_tokens=[1, 2, 3])
    store.create(job)
    channel = keys.job_events(job.job_id)

    async def until(condition):
        async def poll():
            while not await condition():
                await asyncio.sleep(0.005)
        await asyncio.wait_for(poll(), 10)  # a failure, not a hang

    async def scenario():
        client = aredis.Redis.from_url(redis_url)
        counting = CountingClient(client)
        ctx = SimpleNamespace(settings=Settings.from_env({"KVFLEET_REDIS_URL": redis_url, "KVFLEET_KEY_PREFIX": prefix}),
                              async_redis=counting)
        read_after = []  # how many messages the poll had taken at each read of the job

        async def read(job_id):
            read_after.append(counting.taken)
            return await ApiContext.read(ctx, job_id)

        ctx.read = read
        subscribers = lambda: client.pubsub_numsub(channel)  # noqa: E731
        try:
            waiting = asyncio.create_task(ApiContext.wait_terminal(ctx, job.job_id, 30))

            async def subscribed():
                return (await subscribers())[0][1] == 1

            await until(subscribed)
            for state in (b"admitted", b"running", b"queued", b"running"):  # none ends the job
                await client.publish(channel, state)
            await client.publish(channel, b"not-a-state")  # not a state name: read, to be safe

            def reads(n):
                async def done():
                    return len(read_after) == n
                return done

            await until(reads(2))
            # Another job's terminal result, and bytes that look like JSON but are not a
            # result: neither is this job's answer, so each costs a read, to be safe.
            other = JobResult(job_id=f"{prefix}-other", status=JobState.DONE, tenant="acme", priority=Priority.NORMAL)
            await client.publish(channel, encode(other))
            await until(reads(3))
            await client.publish(channel, b'{"job_id": 7}')
            await until(reads(4))
            # The finish publishes the result itself: the poll answers with it, unread.
            store.fail(job.job_id, JobState.CANCELLED, "cancelled", "cancelled by the test", now=time.time())
            result = await asyncio.wait_for(waiting, 10)

            async def unsubscribed():  # the pub/sub connection is let go after the answer
                return (await subscribers())[0][1] == 0

            await until(unsubscribed)
            return result, read_after
        finally:
            await client.aclose()

    result, read_after = asyncio.run(scenario())
    assert result.status is JobState.CANCELLED and result.error.code == "cancelled"
    assert result == store.get(job.job_id)  # the very result the job keeps
    # Read once on subscribing, then only after the fifth message (the four states that
    # do not end a job cost no read), the sixth and the seventh; not after the eighth,
    # the cancellation, which carried its result.
    assert read_after == [0, 5, 6, 7], read_after
