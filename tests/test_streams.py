"""kvfleet.streams against the real Redis: `follow` passes a job's stream on in order,
resumes after any position it gave out, ends every stream exactly once from the job
hash (making up what the stream lacks), skips what it cannot read, and follows a rerun."""

from __future__ import annotations

import asyncio
import threading
import time

import pytest
import redis.asyncio as aredis

from kvfleet import streams
from kvfleet.constants import Keys
from kvfleet.contracts import JobRequest, JobResult, JobState, Priority, Usage
from kvfleet.jobstore import JobStore
from kvfleet.streams import DELTA, END, START, StreamEvent, follow

JOB = "job-1"


@pytest.fixture
def keys(prefix) -> Keys:
    return Keys(prefix)


@pytest.fixture
def store(redis_client, keys) -> JobStore:
    store = JobStore(redis_client, keys)
    store.create(JobRequest(job_id=JOB, tenant="acme", priority=Priority.NORMAL, model="m", max_new_tokens=8,
                            submitted_at=time.time(), prompt_tokens=[1, 2]))
    yield store
    redis_client.delete(keys.job(JOB), keys.job_stream(JOB))


def write(redis_client, keys: Keys, *events: StreamEvent) -> list[str]:
    with redis_client.pipeline(transaction=False) as pipe:
        streams.append(pipe, keys, JOB, events)
        ids = pipe.execute()[:-1]  # the last reply is EXPIRE's
    return [i.decode() for i in ids]


def start(attempt: int = 1) -> StreamEvent:
    return StreamEvent(id="", kind=START, attempt=attempt)


def delta(text: str, attempt: int = 1, tokens: tuple[int, ...] = ()) -> StreamEvent:
    return StreamEvent(id="", kind=DELTA, attempt=attempt, text=text, token_ids=list(tokens))


def end(attempt: int = 1) -> StreamEvent:
    return StreamEvent(id="", kind=END, attempt=attempt, status=JobState.DONE, finish_reason="length")


def finish(store: JobStore, text: str, tokens: list[int]) -> None:
    assert store.finish(JobResult(job_id=JOB, status=JobState.DONE, tenant="acme", priority=Priority.NORMAL,
                                  text=text, tokens=tokens, finish_reason="length",
                                  usage=Usage(prompt_tokens=2, completion_tokens=len(tokens)))).ok


def collect(redis_url: str, keys: Keys, *, after: str | None = None, job_id: str = JOB,
            poll_s: float = 0.2) -> list[StreamEvent]:
    async def run() -> list[StreamEvent]:
        client = aredis.Redis.from_url(redis_url)
        try:
            return [e async for e in follow(client, keys, job_id, after=after, poll_s=poll_s)]
        finally:
            await client.aclose()
    return asyncio.run(asyncio.wait_for(run(), 30))


def text_of(events: list[StreamEvent]) -> str:
    """What a client shows: the text of the last attempt that started."""
    text = ""
    for e in events:
        if e.kind == START:
            text = ""
        elif e.kind == DELTA:
            text += e.text
    return text


def test_events_in_order_then_one_end_from_the_hash(redis_client, redis_url, keys, store):
    store.start(JOB, now=time.time(), worker="w")
    ids = write(redis_client, keys, start(), delta("Hel", tokens=(1, 2)), delta("lo", tokens=(3,)), end())
    finish(store, "Hello", [1, 2, 3])
    events = collect(redis_url, keys)
    assert [e.kind for e in events] == [START, DELTA, DELTA, END]
    assert [e.id for e in events] == ids  # the stream's own end: nothing made up
    assert text_of(events) == "Hello"
    last = events[-1]
    assert last.status is JobState.DONE and last.usage.completion_tokens == 3 and last.finish_reason == "length"


def test_resume_after_any_position_gives_the_rest_exactly_once(redis_client, redis_url, keys, store):
    store.start(JOB, now=time.time(), worker="w")
    write(redis_client, keys, start(), delta("Hel"), delta("lo"), end())
    finish(store, "Hello", [1, 2, 3])
    full = collect(redis_url, keys)
    for i, event in enumerate(full):
        assert collect(redis_url, keys, after=event.id) == full[i + 1:]


def test_a_stream_missing_its_tail_is_ended_from_the_hash(redis_client, redis_url, keys, store):
    store.start(JOB, now=time.time(), worker="w")
    ids = write(redis_client, keys, start(), delta("Hello", tokens=(1, 2)))
    finish(store, "Hello world", [1, 2, 3, 4])  # the worker's last delta and end never got written
    events = collect(redis_url, keys)
    assert [e.kind for e in events] == [START, DELTA, DELTA, END]
    made_up = events[2:]
    assert [e.id for e in made_up] == [f"{ids[-1]}:1", f"{ids[-1]}:2"]
    assert made_up[0].text == " world" and made_up[0].token_ids == [3, 4]
    assert text_of(events) == "Hello world" and made_up[1].status is JobState.DONE
    # Resuming inside the made-up events makes up the same ones and passes on the rest.
    for i, event in enumerate(events):
        assert collect(redis_url, keys, after=event.id) == events[i + 1:]


def test_no_stream_at_all(redis_client, redis_url, keys, store):
    store.start(JOB, now=time.time(), worker="w")  # a worker that does not stream
    finish(store, "all at once", [5, 6])
    events = collect(redis_url, keys)
    assert [(e.kind, e.attempt) for e in events] == [(START, 1), (DELTA, 1), (END, 1)]
    assert events[1].text == "all at once" and [e.id for e in events] == ["0-0:1", "0-0:2", "0-0:3"]


def test_a_job_that_never_ran_ends_with_its_error(redis_url, keys, store):
    store.fail(JOB, JobState.CANCELLED, "cancelled", "cancelled by the client", now=time.time())
    events = collect(redis_url, keys)
    assert [(e.kind, e.attempt, e.status) for e in events] == [(END, 0, JobState.CANCELLED)]
    assert events[0].error.code == "cancelled" and events[0].usage is None


def test_a_missing_job_ends_at_once(redis_url, keys):
    assert collect(redis_url, keys, job_id="nope") == []


def test_malformed_entries_are_skipped(redis_client, redis_url, keys, store):
    store.start(JOB, now=time.time(), worker="w")
    key = keys.job_stream(JOB)
    write(redis_client, keys, start(), delta("a"))
    redis_client.xadd(key, {"junk": "1"})
    redis_client.xadd(key, {"v": streams.STREAM_VERSION, "e": "{not json"})
    redis_client.xadd(key, {"v": streams.STREAM_VERSION, "e": '{"id": "", "kind": "delta"}'})  # no attempt
    redis_client.xadd(key, {"v": 99, "e": '{"id": "", "kind": "delta", "attempt": 1, "text": "v99"}'})
    redis_client.xadd(key, {"v": streams.STREAM_VERSION, "e": '{"id": "", "kind": "gossip", "attempt": 1}'})
    write(redis_client, keys, delta("b"), end())
    finish(store, "ab", [1, 2])
    events = collect(redis_url, keys)
    assert [(e.kind, e.text) for e in events] == [(START, ""), (DELTA, "a"), (DELTA, "b"), (END, "")]
    assert collect(redis_url, keys, after=events[1].id)[0].text == "b"


def test_a_rerun_starts_again_and_the_old_attempt_is_ignored(redis_client, redis_url, keys, store):
    store.start(JOB, now=time.time(), worker="w1")
    write(redis_client, keys, start(1), delta("dead ", 1), delta("run", 1))
    store.start(JOB, now=time.time(), worker="w2")  # w1 died; attempts = 2
    write(redis_client, keys, start(2), delta("new ", 2))
    # w1 had only stalled: what it still writes for attempt 1, its end included, is noise.
    write(redis_client, keys, delta(" stale", 1), end(1), delta("run", 2), end(2))
    finish(store, "new run", [1, 2])
    events = collect(redis_url, keys)
    assert [(e.kind, e.attempt, e.text) for e in events] == [
        (START, 1, ""), (DELTA, 1, "dead "), (DELTA, 1, "run"), (START, 2, ""), (DELTA, 2, "new "),
        (DELTA, 2, "run"), (END, 2, "")]
    assert text_of(events) == "new run"
    # Resuming inside attempt 2 knows what attempt 2 said before: nothing is made up twice.
    assert [e.text for e in collect(redis_url, keys, after=events[4].id)] == ["run", ""]


def test_a_live_follower_gets_events_as_they_are_written(redis_client, redis_url, keys, store):
    store.start(JOB, now=time.time(), worker="w")
    got: list[StreamEvent] = []
    seen_first = threading.Event()

    async def run() -> None:
        client = aredis.Redis.from_url(redis_url)
        try:
            async for e in follow(client, keys, JOB, poll_s=0.2):
                got.append(e)
                if e.kind == DELTA:
                    seen_first.set()
        finally:
            await client.aclose()

    reader = threading.Thread(target=lambda: asyncio.run(asyncio.wait_for(run(), 30)))
    reader.start()
    write(redis_client, keys, start(), delta("one "))
    assert seen_first.wait(20), "the follower never saw the first delta"
    assert reader.is_alive()  # still following: the job is running
    write(redis_client, keys, delta("two"), end())
    finish(store, "one two", [1, 2])
    reader.join(30)
    assert not reader.is_alive()
    assert [e.kind for e in got] == [START, DELTA, DELTA, END] and text_of(got) == "one two"


def test_a_position_that_is_not_one_is_refused(redis_url, keys, store):
    with pytest.raises(ValueError, match="not a stream position"):
        collect(redis_url, keys, after="yesterday")
