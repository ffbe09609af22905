"""The one Celery task: run a job through this process's engine.

The task body is a thin shell around `JobRunner.run`; the runner (built once per
process by `workers.service`) owns the engine, the job store and the lease logic.
"""

from __future__ import annotations

from celery import Celery
from celery.exceptions import Reject
from prometheus_client import Counter

from kvfleet import constants
from workers.drain import HandBack
from workers.runner import FaultedRun, JobRunner

TASKS = Counter("kvfleet_worker_tasks", "Celery task deliveries by outcome", ["outcome"])


def register(app: Celery, runner: JobRunner) -> None:
    @app.task(name=constants.CELERY_TASK_NAME, acks_late=True, ignore_result=True)
    def run_job(raw: dict) -> str:
        try:
            outcome = runner.run(raw)
        except HandBack as exc:
            # The worker drains (workers/drain.py), or an engine fault ended the run: the
            # broker puts the message back on its queue now, for another worker (or
            # another run here), instead of after the visibility timeout.
            TASKS.labels("faulted" if isinstance(exc, FaultedRun) else "handed_back").inc()
            raise Reject(str(exc), requeue=True) from None
        TASKS.labels(outcome.label).inc()
        return outcome.label
