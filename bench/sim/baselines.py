"""Baseline admission policies with `Policy`'s interface, for the simulator and bench.

Both admit in one fixed order and stop at the first job that does not fit
(head-of-line blocking, the textbook form: letting smaller jobs past would starve
large ones). Neither knows tenants, shares, aging or shedding; ceilings, deadlines and
backpressure are `Policy`'s.
"""

from __future__ import annotations

from typing import Optional

from scheduler.policy import PendingJob, Policy, Room, Verdict


class _HeadOfLine(Policy):
    @staticmethod
    def order(job: PendingJob) -> tuple:
        raise NotImplementedError

    def _admit(self, now: float, room: Room) -> tuple[list[PendingJob], Optional[PendingJob]]:
        admitted: list[PendingJob] = []
        for job in sorted((j for b in self._buffer.values() for j in b), key=self.order):
            if job.cost > room.capacity:
                continue  # could never fit: waiting for it would stall the fleet forever
            if job.cost > room.free_for(job.tenant):
                return admitted, job
            room.take(job)
            admitted.append(job)
        return admitted, None

    def _shed(self, now: float, room: Room) -> tuple[Verdict, ...]:
        return ()

    def _reserves(self, capacity: int) -> dict[str, int]:
        return {}  # no gold reserves: one shared pool


class FifoPolicy(_HeadOfLine):
    """First come, first served across all classes and tenants."""

    name = "fifo"

    @staticmethod
    def order(job: PendingJob) -> tuple:
        return (job.enqueued_at, job.job_id)


class StrictPriorityPolicy(_HeadOfLine):
    """The highest class with a buffered job first; FIFO within a class."""

    name = "strict"

    @staticmethod
    def order(job: PendingJob) -> tuple:
        return (job.priority.rank, job.enqueued_at, job.job_id)
