"""Admission's hand-off to Celery (scheduler/dispatch.py): how a round's jobs are packed
into messages, and what lands in the real Redis queues."""

from __future__ import annotations

import base64
import json
import time

import pytest

from kvfleet import constants
from kvfleet.celery_app import make_celery
from kvfleet.contracts import JobRequest, Priority
from kvfleet.jobstore import JobStore
from kvfleet.settings import RedisSettings, Settings
from scheduler.dispatch import Dispatcher, Ticket, pack


def job(i: int, priority: Priority = Priority.NORMAL) -> JobRequest:
    return JobRequest(job_id=f"j{i}", tenant="acme", priority=priority, model="builtin:tiny", max_new_tokens=1,
                      submitted_at=time.time(), prompt_tokens=[1] * 4)


@pytest.mark.parametrize("n, most, sizes", [
    (8, 16, [1] * 8),  # a small round spreads over as many task threads as it has jobs
    (64, 16, [4] * 16),
    (100, 16, [7] * 14 + [2]),
    (300, 16, [16] * 18 + [12]),
    (50, 1, [1] * 50),  # 1: one job per message, as before
])
def test_a_round_packs_only_once_it_outgrows_the_spread(n, most, sizes):
    messages = pack([job(i) for i in range(n)], most)
    assert [len(m) for m in messages] == sizes
    assert [j.job_id for m in messages for j in m] == [f"j{i}" for i in range(n)]  # each once, in order


@pytest.mark.parametrize("n, spread, sizes", [
    (8, 2, [4, 4]),  # two workers: a small round still reaches both, in two messages
    (3, 2, [2, 1]),
    (1, 2, [1]),  # one job is a one-job message, whatever the spread
    (64, 2, [16] * 4),  # capped by the most a message may carry
    (40, 3, [14, 14, 12]),
])
def test_a_round_is_cut_into_at_least_spread_messages(n, spread, sizes):
    messages = pack([job(i) for i in range(n)], 16, spread)
    assert [len(m) for m in messages] == sizes
    assert [j.job_id for m in messages for j in m] == [f"j{i}" for i in range(n)]


def test_each_message_holds_jobs_of_one_class():
    jobs = [job(i, (Priority.HIGH, Priority.LOW)[i % 2]) for i in range(40)]
    messages = pack(jobs, 4)
    assert all(len({j.priority for j in m}) == 1 for m in messages)
    assert sorted(len(m) for m in messages) == [4] * 10  # 20 a class, in at least 4 messages each


def queued_jobs(client, queue: str) -> list[tuple[str, list[str]]]:
    """(task name, job ids) of every Celery message in the queue, oldest first."""
    out = []
    for raw in reversed(client.lrange(queue, 0, -1)):  # kombu LPUSHes; workers pop the right end
        message = json.loads(raw)
        args, _kwargs, _embed = json.loads(base64.b64decode(message["body"]))
        jobs = args[0] if message["headers"]["task"] == constants.CELERY_JOBS_TASK_NAME else [args[0]]
        out.append((message["headers"]["task"], [j["job_id"] for j in jobs]))
    return out


def test_dispatch_sends_every_admitted_job_once_in_packed_messages(redis_client, redis_url, prefix):
    settings = Settings().replace(redis=RedisSettings(url=redis_url, key_prefix=prefix))
    store = JobStore(redis_client, settings.redis.keys)
    dispatcher = Dispatcher(store, make_celery(settings), prefix, lease_s=60, replica="test")
    jobs = [job(i) for i in range(40)] + [job(100 + i, Priority.HIGH) for i in range(3)]
    for j in jobs:
        store.create(j)
    out = dispatcher.dispatch([Ticket(j, 5) for j in jobs], capacity=10_000, now=time.time(), jobs_per_message=4)
    assert len(out.sent) == 43
    normal = queued_jobs(redis_client, constants.celery_queue(prefix, Priority.NORMAL))
    assert [len(ids) for _, ids in normal] == [4] * 10
    assert {name for name, _ in normal} == {constants.CELERY_JOBS_TASK_NAME}
    assert [i for _, ids in normal for i in ids] == [f"j{i}" for i in range(40)]
    # Three jobs are too few to pack: one-job messages, the task every worker knows.
    assert queued_jobs(redis_client, constants.celery_queue(prefix, Priority.HIGH)) == [
        (constants.CELERY_TASK_NAME, [f"j{100 + i}"]) for i in range(3)]
