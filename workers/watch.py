"""The jobs a worker runs right now, looked after together by one thread.

`RunWatch` renews the run lease and the ledger reservation of every job running in
this process and cancels in the engine any job whose state became `cancelled`, in one
pipelined round trip per tick for all of them (workers/runner.py adds and discards the
jobs).
"""

from __future__ import annotations

import itertools
import logging
import threading
import time
from typing import Callable, Optional

import redis

from kvfleet import constants
from kvfleet.contracts import JobState
from kvfleet.jobstore import JobStore
from kvfleet.ledger import Ledger
from kvstore.lock import Lease

log = logging.getLogger("kvfleet.worker")


class RunWatch:
    """One thread per worker process looking after the jobs it executes right now:
    it renews their run leases and their ledger reservations, and cancels in the engine
    any job whose state became `cancelled`. One pipelined round trip per tick covers
    every running job, so watching costs the same for one job or sixty-four (a thread
    per job renewing its own lease cost a thread start and a round trip each)."""

    def __init__(self, store: JobStore, ledger: Ledger, cancel: Callable[[str], bool], *,
                 lease_s: float = constants.RUN_LEASE_S, tick_s: float = 0.2) -> None:
        self.store = store
        self.ledger = ledger
        self.cancel = cancel
        self.lease_s = lease_s
        self.tick_s = tick_s  # the longest a cancelled job keeps running, plus one engine step
        self._jobs: dict[str, Optional[Lease]] = {}  # job id -> its run lease; None once lost
        self._lock = threading.Lock()
        self._thread: Optional[threading.Thread] = None

    def add(self, job_id: str, lease: Lease) -> None:
        """Watch a job that starts now under `lease` (its run lease): both it and the
        job's reservation are renewed from here on (`JobStore.begin` moved the
        reservation to the run lease already)."""
        with self._lock:
            self._jobs[job_id] = lease
            if self._thread is None:
                self._thread = threading.Thread(target=self._loop, name="run-watch", daemon=True)
                self._thread.start()

    def discard(self, job_id: str) -> None:
        with self._lock:
            self._jobs.pop(job_id, None)

    def jobs(self) -> list[str]:
        with self._lock:
            return sorted(self._jobs)

    def _loop(self) -> None:
        renew_every = max(1, int(self.lease_s / 3 / self.tick_s))  # a third of the lease, as the run lease
        for tick in itertools.count(1):
            time.sleep(self.tick_s)
            with self._lock:
                jobs = sorted(self._jobs)
            if not jobs:
                continue
            try:
                self._cancel_cancelled(jobs)
                if tick % renew_every == 0:
                    self._renew()
            except redis.RedisError as exc:
                log.warning("run watch: Redis unavailable", extra={"error": str(exc)})  # next tick retries

    def _cancel_cancelled(self, jobs: list[str]) -> None:
        for job_id, state in zip(jobs, self.store.states(jobs)):
            # False while the job is not in the engine yet: the next tick tries again.
            if state is JobState.CANCELLED and self.cancel(job_id):
                log.info("cancelling in the engine", extra={"job_id": job_id})

    def _renew(self) -> None:
        """Every run lease and reservation of the jobs running here, in one round trip."""
        with self._lock:
            leases = [(job_id, lease) for job_id, lease in sorted(self._jobs.items()) if lease is not None]
        with self.store.client.pipeline(transaction=False) as pipe:
            for job_id, lease in leases:
                lease.renew(pipe=pipe)
                self.ledger.renew(job_id, self.lease_s, pipe=pipe)
            replies = pipe.execute()
        for (job_id, lease), held, reserved in zip(leases, replies[::2], replies[1::2]):
            if not held:
                # Expired and taken over after a stall: renewing would only fail again, and
                # the job store refuses this run's result (the new holder's stands).
                log.warning("run lease lost", extra={"job_id": job_id})
                with self._lock:
                    if job_id in self._jobs:
                        self._jobs[job_id] = None
            if not reserved:
                # Released (finished, cancelled) since the read, or reclaimed after a stall:
                # then the scheduler reserves it again when it re-sends the job.
                log.debug("no reservation to renew", extra={"job_id": job_id})
