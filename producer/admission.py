"""What the API refuses before a job reaches Kafka, cheapest check first:

    422  the job is over its class's token ceiling: it could never run
    429  its class's backlog is over its bound (Retry-After: the time to drain the excess)
    503  a bronze tenant while the fleet is overloaded (Retry-After: `overload_retry_after_s`)
    413  the job is larger than the tenant's whole quota bucket: it can never pass
    429  the tenant is over its quota (Retry-After: the time to refill the deficit)

The quota is charged last, so a refused job costs its tenant nothing. Only that charge
goes to Redis, in the same Lua call that records the job (`producer/records.py`, awaited
on the event loop by producer/submission.py); `check` does everything before it, from
memory: the load checks read `producer/pressure.py`'s background reading. Overload is the
budget nearly spent (ledger ≥ `overload_utilization` of capacity) *and* a backlog
(≥ `overload_backlog` jobs waiting on Kafka): new bronze work would only wait to be
shed, so it is turned away at once.
"""

from __future__ import annotations

import math
from typing import Optional

from kvfleet.ceiling import over_ceiling
from kvfleet.contracts import JobRequest, Priority
from kvfleet.quota import Quotas, Take
from kvfleet.settings import ApiSettings, PolicyConfig
from kvfleet.tenancy import Tenant, Tier
from producer.errors import MAX_RETRY_S, Refused
from producer.pressure import Pressure


class Gate:
    def __init__(self, api: ApiSettings, policy: PolicyConfig, pressure: Pressure, quotas: Optional[Quotas]) -> None:
        """`quotas` None: no tenants configured (development), so no quotas; otherwise
        their buckets are charged by the submit script (`producer/records.py`)."""
        self.api = api
        self.policy = policy
        self.pressure = pressure
        self.quotas = quotas

    def check(self, tenant: Tenant, job: JobRequest, *, output_field: str = "max_new_tokens") -> None:
        """Raise `Refused` if the (tokenized) job must not be queued, from what is known
        without Redis. `output_field`: what the client called max_new_tokens, for the messages."""
        assert job.prompt_tokens is not None, "the API tokenizes every job"
        too_many = over_ceiling(job.priority, len(job.prompt_tokens), job.max_new_tokens, self.policy,
                                output_field=output_field)
        if too_many is not None:
            raise Refused(too_many, status=422, param=output_field, code="over_ceiling")
        self._check_load(tenant, job.priority)

    def quota_of(self, tenant: Tenant) -> Optional[Tenant]:
        """The tenant whose bucket a submission charges; None without quotas."""
        return tenant if self.quotas is not None else None

    def over_quota(self, tenant: Tenant, job: JobRequest, take: Take, *, output_field: str = "max_new_tokens",
                   ) -> Refused:
        """The refusal for a take the tenant's bucket did not allow."""
        if math.isinf(take.retry_after_s):
            return Refused(self._too_big(tenant, job, output_field), status=413, param=output_field,
                           code="over_quota_bucket")
        return Refused(f"tenant {tenant.name!r} is over its quota of {tenant.tokens_per_minute} tokens a "
                       f"minute; retry after {math.ceil(take.retry_after_s)} s",
                       status=429, retry_after_s=take.retry_after_s, code="rate_limit_exceeded")

    @staticmethod
    def _too_big(tenant: Tenant, job: JobRequest, output_field: str) -> str:
        """The job can never pass the tenant's bucket: by how much to shrink it."""
        over, room = job.cost - tenant.bucket_tokens, tenant.bucket_tokens - len(job.prompt_tokens)
        fix = (f"lower {output_field} to at most {room} or shorten the prompt by {over} tokens" if room >= 1
               else f"shorten the prompt by at least {1 - room} tokens")
        return (f"the job needs {job.cost} tokens but tenant {tenant.name!r} may submit at most "
                f"{tenant.bucket_tokens} at once: {fix}")

    def _check_load(self, tenant: Tenant, priority: Priority) -> None:
        reading = self.pressure.current()
        if reading is None:
            return  # no fresh reading: refuse nothing for load (the scheduler still pauses)
        backlog, bound = reading.backlog.get(priority, 0), self.api.max_backlog[priority]
        if backlog > bound:
            drain = reading.drain_per_s.get(priority, 0.0)
            retry = (backlog - bound) / drain if drain > 0 else MAX_RETRY_S
            raise Refused(f"{backlog} {priority.value} jobs are waiting (bound {bound}); retry later",
                          status=429, retry_after_s=retry, code="backlog_full")
        waiting = sum(reading.backlog.values())
        if (tenant.tier is Tier.BRONZE and reading.utilization >= self.api.overload_utilization
                and waiting >= self.api.overload_backlog):
            raise Refused(f"the fleet is overloaded ({reading.utilization:.0%} of its tokens in use, {waiting} "
                          "jobs waiting); bronze jobs are not accepted now, retry later",
                          status=503, retry_after_s=self.api.overload_retry_after_s, code="overloaded")
