"""Graceful drain: what a worker does between SIGTERM and its exit.

`docker-compose stop`, a scale-down and a supervisor all send SIGTERM and wait a grace
period before SIGKILL. In that window the worker:

1. stops taking tasks: Celery's warm shutdown stops consuming; tasks it had prefetched
   but not started stay unacknowledged and go back to their queues when its broker
   connection closes (kombu restores them at once, not after the visibility timeout);
2. withdraws its KV capacity at once (`begin` deletes its heartbeat), so the scheduler
   stops counting it before it is gone;
3. lets the jobs it is running finish for `grace_s`;
4. then hands the rest back: their engine requests are cancelled, the runner releases
   their run leases and rejects their tasks with requeue (workers/tasks.py), so another
   worker starts them at once. Such a job stays `running`; its next start counts a new
   attempt, and its stream shows a rerun.

Nothing here is lost if the worker is SIGKILLed instead: that is the ordinary crash
path (run leases and the visibility timeout), only slower.
"""

from __future__ import annotations

import logging
import threading
from typing import Callable, Iterable

log = logging.getLogger("kvfleet.worker")


class HandBack(Exception):
    """A job this worker will not finish (it is draining): requeue its task."""


class Drain:
    def __init__(self, grace_s: float, *, withdraw: Callable[[], None], running: Callable[[], Iterable[str]],
                 cancel: Callable[[str], bool], draining: threading.Event | None = None) -> None:
        self.grace_s = grace_s
        self._withdraw = withdraw
        self._running = running
        self._cancel = cancel
        #: Set by `begin`: the runner hands back what it has not started, and what the
        #: grace period cancels.
        self.draining = draining or threading.Event()
        self._lock = threading.Lock()

    def begin(self) -> None:
        """Start draining (idempotent: a second SIGTERM changes nothing)."""
        with self._lock:
            if self.draining.is_set():
                return
            self.draining.set()
        running = sorted(self._running())
        log.info("draining", extra={"grace_s": self.grace_s, "running": len(running)})
        try:
            self._withdraw()
        except Exception:  # noqa: BLE001 - the heartbeat's TTL withdraws it anyway
            log.warning("could not withdraw capacity", exc_info=True)
        threading.Thread(target=self._hand_back_after_grace, name="drain", daemon=True).start()

    def _hand_back_after_grace(self) -> None:
        # A plain wait: nothing can make the grace period end sooner except the jobs
        # finishing, and then there is nothing left to hand back.
        threading.Event().wait(self.grace_s)
        left = sorted(self._running())
        if left:
            log.warning("grace period over; handing jobs back", extra={"jobs": left})
        for job_id in left:
            self._cancel(job_id)
