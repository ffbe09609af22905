"""workers/streaming.py against the real Redis: a worker writes the streams of followed
jobs only. A run followed when it began is streamed from its start; a quiet run that a
client starts following is streamed from then on, beginning with all its text so far;
a run that ends quiet writes nothing and its `end` does not wait; and `follow` (what the
API relays) marks the job, so `JobStore.begin` reports it followed."""

from __future__ import annotations

import asyncio
import time

import pytest
import redis.asyncio as aredis

from kvfleet import streams
from kvfleet.constants import Keys
from kvfleet.contracts import JobRequest, JobState, Priority
from kvfleet.jobstore import BeginArgs, JobStore
from kvfleet.streams import DELTA, END, START
from kvfleet.tokenizer import ByteTokenizer
from tests.fleet import wait_for
from workers.streaming import StreamPublisher

JOB = "job-1"


@pytest.fixture
def keys(prefix) -> Keys:
    return Keys(prefix)


@pytest.fixture
def publisher(redis_client, keys):
    publisher = StreamPublisher(redis_client, keys, ByteTokenizer(), flush_s=0.001, follow_poll_s=0.01).start()
    yield publisher
    publisher.close()
    redis_client.delete(keys.job_stream(JOB), keys.job_followed(JOB), keys.job(JOB))


def events(redis_client, keys: Keys) -> list[streams.StreamEvent]:
    return [streams.decode_entry(i.decode(), f) for i, f in redis_client.xrange(keys.job_stream(JOB))]


def tokens(on_token, text: str) -> None:
    for byte in text.encode():
        on_token(byte)


def text_of(evs: list[streams.StreamEvent]) -> str:
    return "".join(e.text for e in evs if e.kind == DELTA)


def test_a_run_followed_from_its_start_is_streamed_from_its_start(publisher, redis_client, keys):
    on_token = publisher.begin(JOB, 1, followed=True)
    tokens(on_token, "héllo")
    wait_for(lambda: text_of(events(redis_client, keys)) == "héllo", "the first text streamed")
    tokens(on_token, " world")
    assert publisher.end(JOB, JobState.DONE, text="héllo world", finish_reason="length")
    evs = events(redis_client, keys)
    assert [evs[0].kind, evs[-1].kind] == [START, END] and text_of(evs) == "héllo world"


def test_a_run_nobody_follows_writes_nothing_and_its_end_does_not_wait(publisher, redis_client, keys):
    on_token = publisher.begin(JOB, 1, followed=False)
    tokens(on_token, "quiet text")
    # The follower checks run meanwhile (a poll every 10 ms): none turns it loud.
    polls = publisher._next_poll
    wait_for(lambda: publisher._next_poll > polls + 0.02, "a few checks for followers")
    assert publisher.end(JOB, JobState.DONE, text="quiet text", finish_reason="length", wait=True)
    publisher.close()  # everything queued is handled
    assert redis_client.exists(keys.job_stream(JOB)) == 0


def test_tokens_are_never_handed_to_the_publisher_thread(redis_client, keys):
    # The step thread only appends to the run's own list: a hand-off per token (a queue
    # put the publisher thread wakes for) took the GIL from the step thread as often
    # (issue 16). A publisher whose thread has not started shows what was handed over.
    publisher = StreamPublisher(redis_client, keys, ByteTokenizer())
    for followed in (False, True):
        on_token = publisher.begin(JOB, 1, followed=followed)
        tokens(on_token, "many tokens")
        assert publisher._queue.qsize() == 1  # the begin, and nothing per token
        publisher.end(JOB, JobState.DONE, text="many tokens", wait=False)
        assert publisher._queue.qsize() == 2  # and the end
        publisher._drain([])


def test_a_quiet_run_followed_midway_streams_its_text_so_far_then_the_rest(publisher, redis_client, keys):
    on_token = publisher.begin(JOB, 2, followed=False)
    tokens(on_token, "before ")
    redis_client.set(keys.job_followed(JOB), 1)  # what `follow` does
    wait_for(lambda: text_of(events(redis_client, keys)) == "before ", "the text so far, once followed")
    tokens(on_token, "after")
    assert publisher.end(JOB, JobState.DONE, text="before after", finish_reason="length")
    evs = events(redis_client, keys)
    assert evs[0].kind == START and evs[0].attempt == 2 and evs[-1].kind == END
    assert text_of(evs) == "before after"
    assert sum(len(e.token_ids) for e in evs) == len(b"before after")


def test_a_run_whose_end_was_skipped_never_turns_loud(publisher, redis_client, keys):
    publisher.close()  # no thread: the end and the follower's mark meet in the worst order
    publisher.begin(JOB, 1, followed=False)
    publisher._flush(publisher._drain([]))  # the run is known, quiet
    assert publisher.end(JOB, JobState.DONE, text="", finish_reason="length", wait=True)
    redis_client.set(keys.job_followed(JOB), 1)
    publisher._next_poll = 0.0
    assert publisher._check_followers() == []  # its runner has moved on to the result
    publisher._flush(publisher._drain([]))
    assert redis_client.exists(keys.job_stream(JOB)) == 0


def test_every_run_streams_them_all(redis_client, keys):
    publisher = StreamPublisher(redis_client, keys, ByteTokenizer(), flush_s=0.001, every_run=True).start()
    try:
        on_token = publisher.begin(JOB, 1, followed=False)
        tokens(on_token, "all")
        assert publisher.end(JOB, JobState.DONE, text="all", finish_reason="length")
        assert text_of(events(redis_client, keys)) == "all"
    finally:
        publisher.close()
        redis_client.delete(keys.job_stream(JOB))


def create(store: JobStore) -> None:
    store.create(JobRequest(job_id=JOB, tenant="acme", priority=Priority.NORMAL, model="m", max_new_tokens=8,
                            submitted_at=time.time(), prompt_tokens=[1, 2]))


def begin(store: JobStore):
    return store.begin(JOB, lease_token="t", lease_ms=10_000, now=time.time(), worker="w", reservation_lease_s=10.0)


def test_follow_marks_the_job_and_begin_reports_it(redis_client, redis_url, keys):
    store = JobStore(redis_client, keys)
    create(store)

    async def follow_until_marked() -> None:
        # `follow` waits for the job's first entry, which never comes here: it is
        # cancelled once the mark is there.
        client = aredis.Redis.from_url(redis_url)
        task = asyncio.ensure_future(_drain(streams.follow(client, keys, JOB, poll_s=0.05)))
        try:
            deadline = time.monotonic() + 10
            while not redis_client.exists(keys.job_followed(JOB)) and time.monotonic() < deadline:
                await asyncio.sleep(0.01)
        finally:
            task.cancel()
            await asyncio.gather(task, return_exceptions=True)
            await client.aclose()

    try:
        assert not begin_many_followed(store)
        asyncio.run(follow_until_marked())
        assert redis_client.ttl(keys.job_followed(JOB)) > 0  # it goes with the job's record
        begun = begin(store)
        assert begun.outcome == "started" and begun.followed
    finally:
        redis_client.delete(keys.job(JOB), keys.job_events(JOB), keys.run_lease(JOB), keys.job_followed(JOB))


def begin_many_followed(store: JobStore) -> bool:
    """Whether `begin_many` (the several-job path) calls the job followed; it takes the
    run lease, so it is given back before the single `begin` after it."""
    [begun] = store.begin_many([BeginArgs(JOB, "t0")], lease_ms=10_000, now=time.time(), worker="w",
                               reservation_lease_s=10.0)
    assert begun.outcome == "started"
    store.client.delete(store.keys.run_lease(JOB))
    return begun.followed


async def _drain(events) -> None:
    async for _ in events:
        pass
