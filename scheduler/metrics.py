"""The scheduler's Prometheus metrics, in base units (tokens, seconds, messages).

`kvfleet_scheduler_jobs_total` counts every decision by class, tenant, outcome and
reason. Outcomes: `admitted` (reserved and sent), `resent` (sent again: found admitted
after a crash or rebalance, or reclaimed from a dead worker), `rejected`, `expired`,
`shed`, `cancelled` (cancelled before admission), `duplicate` (a redelivered or
duplicated message of a job already running or finished). Tenants come from the
configured directory, so the label set stays bounded; in development any
`X-Tenant-ID` becomes a label.
"""

from __future__ import annotations

from prometheus_client import Counter, Gauge, Histogram

CONSUMED = Counter("kvfleet_scheduler_records_consumed", "Kafka records read", ["priority"])
JOBS = Counter("kvfleet_scheduler_jobs", "Admission decisions", ["priority", "tenant", "outcome", "reason"])
DEAD = Counter("kvfleet_scheduler_dead_lettered", "Records sent to the dead-letter topic", ["reason"])
QUEUE_DELAY = Histogram("kvfleet_scheduler_queue_delay_seconds", "Submission to admission", ["priority"],
                        buckets=(0.002, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 180, 600))
LAG = Gauge("kvfleet_scheduler_consumer_lag_messages", "Messages on Kafka not yet read, by class", ["priority"])
BUFFERED = Gauge("kvfleet_scheduler_buffered_jobs", "Jobs read and waiting in the policy's buffer", ["priority"])
PAUSED = Gauge("kvfleet_scheduler_paused_partitions", "Partitions paused for backpressure", ["priority"])
CAPACITY = Gauge("kvfleet_scheduler_budget_capacity_tokens", "The fleet's KV token budget")
IN_USE = Gauge("kvfleet_scheduler_budget_in_use_tokens", "Tokens reserved in the ledger")
LOOP_ERRORS = Counter("kvfleet_scheduler_loop_errors", "Loop iterations that failed (Redis, Kafka) and were retried")
ASSIGNED = Gauge("kvfleet_scheduler_assigned_partitions", "Partitions this replica owns (0 while it waits for a rebalance)")
REJOINS = Counter("kvfleet_scheduler_rejoins", "Times the membership watchdog rejoined the consumer group")
HOLDING = Gauge("kvfleet_scheduler_holding", "1 while the budget is held for a waiting job of this class", ["priority"])
RECLAIMED = Counter("kvfleet_scheduler_reclaimed_jobs", "Jobs whose reservation lease ran out (worker died, task lost) and were sent again")
IDLE_WITH_LAG = Gauge("kvfleet_scheduler_idle_with_lag", "1 while this replica owns no partition and the group's lag does not go down (/healthz is 503)")
