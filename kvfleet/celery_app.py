"""The Celery app shared by the scheduler (which sends tasks) and the workers (which run them).

Broker: the state Redis. Serialization: JSON only, so nothing a broker client can write
is ever unpickled. Delivery: `acks_late` — a task is acknowledged after it ran, so a
worker killed mid-job leaves it unacknowledged and Redis hands it to another worker once
the visibility timeout passes.

The visibility timeout's pitfall: it counts from *delivery*, not from the start of work.
A task that sits in a worker's prefetch buffer longer than the timeout is delivered a
second time while the first copy still waits. kvfleet keeps prefetch at one task per
thread and sets the timeout far above a job's run time; and whatever happens, the job's
run lease and one-way states make a second copy wait or stop, never run it twice.
"""

from __future__ import annotations

from celery import Celery

from kvfleet import constants
from kvfleet.broker import transport_for
from kvfleet.settings import Settings


def make_celery(settings: Settings) -> Celery:
    vt = settings.worker.visibility_timeout_s
    app = Celery("kvfleet", broker=settings.redis.url, set_as_current=False)
    app.conf.update(
        task_serializer="json",
        result_serializer="json",
        accept_content=["json"],
        task_ignore_result=True,  # results go to the job store, atomically with the state
        task_acks_late=True,
        task_reject_on_worker_lost=True,
        # A task that raises was ended by the infrastructure, not by its job: the runner
        # records every job outcome itself (done, failed, expired, handed back) and returns,
        # and only an error it cannot record (the state Redis gone mid-run) escapes. Such a
        # task is not acknowledged, so the broker delivers it again after the visibility
        # timeout instead of dropping a job nobody finished. Celery's default acks it.
        task_acks_on_failure_or_timeout=False,
        worker_prefetch_multiplier=1,
        worker_hijack_root_logger=False,
        worker_send_task_events=False,
        broker_connection_retry_on_startup=True,
        # kombu's Redis transport, less a redis-py client built per operation (kvfleet/broker.py).
        broker_transport=transport_for(settings.redis.url),
        task_default_queue=constants.celery_queue(settings.redis.key_prefix, "normal"),
        broker_transport_options={
            "visibility_timeout": vt,
            # BRPOP the queues in the order given (high, normal, low), not round-robin.
            "queue_order_strategy": "priority",
            # Sweep for abandoned (unacked, timed-out) tasks about ten times per timeout,
            # so a lost worker's job is picked up soon after the timeout, not minutes later.
            "unacked_restore_interval": max(1, int(vt / 10)),
            "unacked_restore_throttle": 1,
        },
    )
    return app
