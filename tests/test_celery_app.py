"""The Celery app's delivery settings, decided deliberately (kvfleet/celery_app.py)."""

from __future__ import annotations

from kvfleet.celery_app import make_celery
from kvfleet.settings import Settings


def test_a_task_is_acknowledged_only_once_its_job_outcome_is_recorded():
    conf = make_celery(Settings.from_env({})).conf
    assert conf.task_acks_late  # after the run, not on receipt
    assert conf.task_reject_on_worker_lost  # a killed worker's task goes back
    # A task the infrastructure broke (it raised) is not acked away: it comes back.
    assert conf.task_acks_on_failure_or_timeout is False
    assert conf.worker_prefetch_multiplier == 1
    assert conf.accept_content == ["json"] and conf.task_serializer == "json"  # never pickle
