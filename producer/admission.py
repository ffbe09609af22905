"""What the API refuses before a job reaches Kafka, cheapest check first:

    422  the job is over its class's token ceiling: it could never run
    429  its class's backlog is over its bound (Retry-After: the time to drain the excess)
    503  a bronze tenant while the fleet is overloaded (Retry-After: bronze's shed time)
    413  the job is larger than the tenant's whole quota bucket: it can never pass
    429  the tenant is over its quota (Retry-After: the time to refill the deficit)

The quota is charged last, so a refused job costs its tenant nothing. Overload is the
budget nearly spent (ledger ≥ `overload_utilization` of capacity) *and* a backlog
(≥ `overload_backlog` jobs waiting on Kafka): new bronze work would only wait to be
shed, so it is turned away at once.
"""

from __future__ import annotations

import math
from typing import Optional

from kvfleet.contracts import JobRequest, Priority
from kvfleet.settings import ApiSettings
from producer.pressure import Pressure
from kvfleet.settings import PolicyConfig
from scheduler.policy import PendingJob, ceiling_verdict
from scheduler.quota import Quotas
from scheduler.tenants import Tenant, Tier

#: Retry-After bounds, seconds: at least 1 (it is an integer), at most a minute (the
#: estimate is rough, and a client told to wait longer may as well poll again).
MIN_RETRY_S, MAX_RETRY_S = 1, 60


class Refused(Exception):
    def __init__(self, status: int, message: str, retry_after_s: Optional[float] = None) -> None:
        super().__init__(message)
        self.status = status
        self.message = message
        self.retry_after_s = retry_after_s

    @property
    def headers(self) -> dict[str, str]:
        if self.retry_after_s is None:
            return {}
        return {"Retry-After": str(min(MAX_RETRY_S, max(MIN_RETRY_S, math.ceil(self.retry_after_s))))}


class Gate:
    def __init__(self, api: ApiSettings, policy: PolicyConfig, pressure: Pressure, quotas: Optional[Quotas]) -> None:
        """`quotas` None: no tenants configured (development), so no quotas."""
        self.api = api
        self.policy = policy
        self.pressure = pressure
        self.quotas = quotas

    def check(self, tenant: Tenant, job: JobRequest, prompt_len: int) -> None:
        """Raise `Refused` if the job must not be queued; otherwise charge its quota."""
        pending = PendingJob.from_request(job, prompt_tokens=prompt_len, tier=tenant.tier, partition=0)
        verdict = ceiling_verdict(pending, self.policy)
        if verdict is not None:
            raise Refused(422, verdict.message)
        self._check_load(tenant, job.priority)
        if self.quotas is not None:
            take = self.quotas.try_take(tenant.name, pending.cost)
            if math.isinf(take.retry_after_s):
                raise Refused(413, f"the job needs {pending.cost} tokens but tenant {tenant.name!r} may submit at "
                                   f"most {tenant.bucket_tokens} at once; split it or lower max_new_tokens")
            if not take.allowed:
                raise Refused(429, f"tenant {tenant.name!r} is over its quota of {tenant.tokens_per_minute} tokens "
                                   f"a minute; retry after {math.ceil(take.retry_after_s)} s", take.retry_after_s)

    def _check_load(self, tenant: Tenant, priority: Priority) -> None:
        reading = self.pressure.current()
        if reading is None:
            return  # no fresh reading: refuse nothing for load (the scheduler still pauses)
        backlog, bound = reading.backlog.get(priority, 0), self.api.max_backlog[priority]
        if backlog > bound:
            drain = reading.drain_per_s.get(priority, 0.0)
            retry = (backlog - bound) / drain if drain > 0 else MAX_RETRY_S
            raise Refused(429, f"{backlog} {priority.value} jobs are waiting (bound {bound}); retry later", retry)
        waiting = sum(reading.backlog.values())
        if (tenant.tier is Tier.BRONZE and reading.utilization >= self.api.overload_utilization
                and waiting >= self.api.overload_backlog):
            raise Refused(503, f"the fleet is overloaded ({reading.utilization:.0%} of its tokens in use, {waiting} "
                               "jobs waiting); bronze jobs are not accepted now, retry later",
                          self.policy.bronze_shed_after_s)
