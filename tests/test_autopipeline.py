"""Scripts called in one turn of the event loop go to Redis as one pipeline
(producer/autopipeline.py): each caller gets its own reply, a lone call goes alone, a
script Redis does not know is loaded, and a failed connection fails every caller."""

from __future__ import annotations

import asyncio
import uuid

import pytest
import redis.asyncio as aredis
from redis.asyncio.retry import Retry
from redis.backoff import NoBackoff
from redis.exceptions import ConnectionError as RedisConnectionError, ResponseError

from producer.autopipeline import AutoPipeline

ECHO = "return {KEYS[1], ARGV[1]}"


class CountingClient:
    """A client that counts the pipelines sent through it."""

    def __init__(self, client: aredis.Redis) -> None:
        self.client, self.pipelines = client, 0

    def pipeline(self, **kwargs):
        self.pipelines += 1
        return self.client.pipeline(**kwargs)


async def _run(redis_url: str, use):
    client = aredis.Redis.from_url(redis_url)
    try:
        return await use(client)
    finally:
        await client.aclose()


def test_concurrent_calls_share_a_pipeline_and_each_gets_its_own_reply(redis_url):
    async def use(client):
        counting = CountingClient(client)
        pipeline, script = AutoPipeline(counting), client.register_script(ECHO)
        await script(keys=["k"], args=["warm"])  # loaded, so that the pipelines below are the only calls
        replies = await asyncio.gather(*(pipeline.run(script, [f"key-{i}"], [i]) for i in range(50)))
        return counting.pipelines, replies

    pipelines, replies = asyncio.run(_run(redis_url, use))
    assert replies == [[f"key-{i}".encode(), str(i).encode()] for i in range(50)]
    assert pipelines == 1  # all fifty were called in the same turn of the loop


def test_a_lone_call_goes_at_once_and_calls_of_later_turns_in_later_pipelines(redis_url):
    async def use(client):
        counting = CountingClient(client)
        pipeline, script = AutoPipeline(counting), client.register_script(ECHO)
        first = await pipeline.run(script, ["a"], [1])
        second = await pipeline.run(script, ["b"], [2])
        return counting.pipelines, [first, second]

    pipelines, replies = asyncio.run(_run(redis_url, use))
    assert replies == [[b"a", b"1"], [b"b", b"2"]] and pipelines == 2


def test_a_script_redis_does_not_know_is_loaded_and_run(redis_url):
    unknown = f"return 'fresh-{uuid.uuid4().hex}'"  # a script this server has never seen: NOSCRIPT first

    async def use(client):
        pipeline, script = AutoPipeline(client), client.register_script(unknown)
        return await asyncio.gather(pipeline.run(script, [], []), pipeline.run(script, [], []))

    replies = asyncio.run(_run(redis_url, use))
    assert replies == [unknown.split("'")[1].encode()] * 2


def test_a_script_error_goes_to_its_caller_only(redis_url):
    async def use(client):
        pipeline = AutoPipeline(client)
        good, bad = client.register_script(ECHO), client.register_script("return redis.error_reply('nope')")
        await good(keys=["k"], args=["warm"])
        return await asyncio.gather(pipeline.run(good, ["k"], ["v"]), pipeline.run(bad, [], []),
                                    return_exceptions=True)

    good, bad = asyncio.run(_run(redis_url, use))
    assert good == [b"k", b"v"]
    assert isinstance(bad, ResponseError) and "nope" in str(bad)


def test_a_failed_connection_fails_every_caller():
    async def use():
        # Nothing listens on port 1; no retries, so that the test takes no backoff.
        client = aredis.Redis(host="127.0.0.1", port=1, socket_connect_timeout=1, retry=Retry(NoBackoff(), 0))
        try:
            pipeline, script = AutoPipeline(client), client.register_script(ECHO)
            return await asyncio.gather(*(pipeline.run(script, ["k"], [i]) for i in range(3)),
                                        return_exceptions=True)
        finally:
            await client.aclose()

    outcomes = asyncio.run(use())
    assert len(outcomes) == 3 and all(isinstance(o, RedisConnectionError) for o in outcomes)


@pytest.mark.parametrize("cancelled", [0, 1])
def test_a_cancelled_caller_leaves_the_others_their_replies(redis_url, cancelled):
    async def use(client):
        pipeline, script = AutoPipeline(client), client.register_script(ECHO)
        await script(keys=["k"], args=["warm"])
        calls = [asyncio.ensure_future(pipeline.run(script, [f"k{i}"], [i])) for i in range(3)]
        await asyncio.sleep(0)  # all three queued
        calls[cancelled].cancel()
        return await asyncio.gather(*calls, return_exceptions=True)

    outcomes = asyncio.run(_run(redis_url, use))
    assert isinstance(outcomes[cancelled], asyncio.CancelledError)
    assert [o for i, o in enumerate(outcomes) if i != cancelled] == [
        [f"k{i}".encode(), str(i).encode()] for i in range(3) if i != cancelled]
