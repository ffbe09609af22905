"""Names and numbers that several services must agree on, each with its unit and reason.

Topic names and Redis keys are built here and nowhere else, so a prefix change
(`KVFLEET_TOPIC_PREFIX`, `KVFLEET_KEY_PREFIX`) moves every service at once.
"""

from __future__ import annotations

from kvfleet.contracts import Priority

# --- Kafka -----------------------------------------------------------------------
DEFAULT_TOPIC_PREFIX = "kvfleet.requests"
DLQ_SUFFIX = "dlq"
RESULTS_SUFFIX = "results"
SCHEDULER_GROUP = "kvfleet-scheduler"
#: Partitions per priority topic. Messages are keyed by tenant, so one tenant's jobs
#: stay ordered within a partition; 6 lets up to 6 scheduler replicas share a topic.
PARTITIONS_PER_TOPIC = 6
DLQ_PARTITIONS = 1


def request_topic(prefix: str, priority: Priority | str) -> str:
    return f"{prefix}.{Priority(priority).value}"


def dlq_topic(prefix: str) -> str:
    return f"{prefix}.{DLQ_SUFFIX}"


def all_request_topics(prefix: str) -> list[str]:
    """In service order: high first."""
    return [request_topic(prefix, p) for p in Priority]


def results_topic(prefix: str) -> str:
    """Every terminal JobResult, keyed by job id (kvfleet/results.py), unless its job
    named a `reply_to` topic."""
    return f"{prefix}.{RESULTS_SUFFIX}"


#: A week, like the request topics (the local broker's `log.retention.hours`): a
#: requester that was down for days still finds its replies when it comes back.
RESULTS_RETENTION_MS = 7 * 24 * 3600 * 1000
#: The relays of all scheduler replicas share the outbox through this Redis Streams
#: consumer group, so each result is produced by one of them (again only after a crash).
RESULTS_RELAY_GROUP = "kvfleet-results-relay"
#: Headers of a result message whose value is the job id. `correlation_id` is the
#: generic name; `kafka_correlationId` is Spring Kafka's (KafkaHeaders.CORRELATION_ID),
#: which a ReplyingKafkaTemplate matches replies on.
CORRELATION_HEADERS = ("correlation_id", "kafka_correlationId")


# --- Redis -----------------------------------------------------------------------
DEFAULT_KEY_PREFIX = "kvfleet"
#: The local Redis servers (kvfleet/infra): off the default 6379, so a Redis the
#: machine already runs is never touched.
STATE_REDIS_PORT = 16379
CACHE_REDIS_PORT = 16380


class Keys:
    """Every Redis key kvfleet writes, under one prefix."""

    def __init__(self, prefix: str = DEFAULT_KEY_PREFIX) -> None:
        self.prefix = prefix

    def job(self, job_id: str) -> str:
        return f"{self.prefix}:job:{job_id}"

    def job_events(self, job_id: str) -> str:
        """Pub/sub channel told of every state change of one job (long-poll wake-up)."""
        return f"{self.prefix}:events:{job_id}"

    def job_stream(self, job_id: str) -> str:
        """Redis Stream of one job's generated text as it is produced (streaming clients)."""
        return f"{self.prefix}:stream:{job_id}"

    def job_followed(self, job_id: str) -> str:
        """Present while a client follows (or has followed) the job's stream: workers
        write the streams of such jobs only (workers/streaming.py)."""
        return f"{self.prefix}:followed:{job_id}"

    @property
    def ledger_freed(self) -> str:
        """Pub/sub channel told whenever a finished job's reservation is released: what
        wakes a scheduler that waits for budget (scheduler/wake.py)."""
        return f"{self.prefix}:events:ledger-freed"

    def run_lease(self, job_id: str) -> str:
        """Held by the worker that is executing the job right now."""
        return f"{self.prefix}:lock:run:{job_id}"

    @property
    def ledger(self) -> str:
        """Hash job_id -> tokens reserved (kvfleet/ledger.py)."""
        return f"{self.prefix}:ledger"

    @property
    def ledger_leases(self) -> str:
        """Sorted set job_id -> the reservation's lease deadline, unix seconds."""
        return f"{self.prefix}:ledger:leases"

    @property
    def ledger_meta(self) -> str:
        """Hash job_id -> "tenant priority", for per-tenant and per-class usage."""
        return f"{self.prefix}:ledger:meta"

    def worker(self, worker_id: str) -> str:
        return f"{self.prefix}:worker:{worker_id}"

    @property
    def workers_index(self) -> str:
        """Sorted set of worker ids that have heartbeated (see kvfleet/registry.py)."""
        return f"{self.prefix}:workers"

    def quota(self, tenant: str) -> str:
        return f"{self.prefix}:quota:{tenant}"

    def kv_block(self, model_fingerprint: str, block_hash: str) -> str:
        return f"{self.prefix}:kv:{model_fingerprint}:{block_hash}"

    def lock(self, name: str) -> str:
        return f"{self.prefix}:lock:{name}"

    def result_cache(self, digest: str) -> str:
        """A cached completion (workers/result_cache.py), on the cache instance."""
        return f"{self.prefix}:result:{digest}"

    @property
    def results_outbox(self) -> str:
        """Redis Stream of terminal results not yet on Kafka: appended by the job store's
        finish, in the same Lua call that writes the result; drained by kvfleet/results.py."""
        return f"{self.prefix}:outbox:results"

    # The Files and Batch APIs (producer/files/, producer/batches/).
    def file(self, file_id: str) -> str:
        """Hash: one file's metadata (its bytes are in the file store)."""
        return f"{self.prefix}:file:{file_id}"

    def files_of(self, tenant: str) -> str:
        """Sorted set file_id -> created_at: one tenant's files, for listing."""
        return f"{self.prefix}:files:{tenant}"

    @property
    def files_expiry(self) -> str:
        """Sorted set file_id -> expires_at: what the retention sweep deletes."""
        return f"{self.prefix}:files:expiry"

    def batch(self, batch_id: str) -> str:
        """Hash: one batch's spec, status, timestamps, counts and cursor."""
        return f"{self.prefix}:batch:{batch_id}"

    def batch_errors(self, batch_id: str) -> str:
        """Hash line number -> error JSON: lines the fleet refused for good."""
        return f"{self.prefix}:batch:{batch_id}:errors"

    def batches_of(self, tenant: str) -> str:
        """Sorted set batch_id -> created_at: one tenant's batches, for listing."""
        return f"{self.prefix}:batches:{tenant}"

    @property
    def batches_active(self) -> str:
        """Set of batches not yet in a final state: what the drivers look for."""
        return f"{self.prefix}:batches:active"


#: Entries a job's stream (Keys.job_stream) keeps at most. A run writes a start, an
#: end and at most one delta per generated token (MAX_NEW_TOKENS_LIMIT, 4096; fewer,
#: as deltas are batched): room for four full runs, so reruns never trim a live one.
STREAM_MAXLEN = 20_000

# --- Lifetimes (seconds) ---------------------------------------------------------
#: A finished job's state and result stay readable this long, then Redis drops them.
RESULT_TTL_S = 24 * 3600
#: A job that never finishes (lost before admission) is still dropped eventually.
PENDING_TTL_S = 7 * 24 * 3600
#: A running job's lease: renewed every third of this by the worker executing it.
#: A worker that dies loses it after this long, and a redelivered copy may take over.
RUN_LEASE_S = 15.0
#: Worker heartbeat key TTL; the heartbeat is written every third of this.
WORKER_HEARTBEAT_TTL_S = 10.0
#: The results outbox's TTL, pushed back by every finish: a relay drains it within
#: milliseconds, so it only ever expires under a fleet that is gone (a test's prefix).
RESULTS_OUTBOX_TTL_S = 7 * 24 * 3600
#: A batch driver's lease, renewed every third of this: after an API replica dies,
#: another (or the restarted one) takes its batches over within this long.
BATCH_LEASE_S = 10.0
#: A finished batch's record stays this long (its files follow their own retention).
BATCH_TTL_S = 30 * 24 * 3600

# --- Celery ----------------------------------------------------------------------
CELERY_TASK_NAME = "kvfleet.run_job"  # one job per message: args = [job]
CELERY_JOBS_TASK_NAME = "kvfleet.run_jobs"  # several: args = [[job, job, ...]]


def celery_queue(key_prefix: str, priority: Priority | str) -> str:
    """One Celery queue per class; named under the key prefix so fleets sharing a Redis
    (or test runs) never take each other's tasks."""
    return f"{key_prefix}.tasks.{Priority(priority).value}"


def all_celery_queues(key_prefix: str) -> list[str]:
    """High first: workers read them in this order (queue_order_strategy=priority)."""
    return [celery_queue(key_prefix, p) for p in Priority]
