"""Typed, frozen configuration, built once at each entry point from the environment.

Every knob is a field below with its default, its reason and its `KVFLEET_*` variable,
stated once: `Settings.from_env()` reads every variable there is (no other module reads
the environment), checks it, and raises `ValueError` naming the variable to fix. Lower
layers take plain values from these objects.

    settings = Settings.from_env()      # the services' entry points
    settings = Settings()               # every default (tests, benchmarks)
"""

from __future__ import annotations

import dataclasses
import math
import os
from dataclasses import dataclass, field, fields
from pathlib import Path
from typing import Any, Callable, Mapping, Optional

from kvfleet import constants
from kvfleet.contracts import Priority

Parse = Callable[[str], Any]


def knob(default: Any, env: str, parse: Parse = str, *, lo: Optional[float] = None, gt: Optional[float] = None,
         choices: tuple[str, ...] = ()) -> Any:
    """A settings field read from `KVFLEET_<env>`: its default, how to parse it, its bounds."""
    meta = {"env": env, "parse": parse, "lo": lo, "gt": gt, "choices": choices}
    if isinstance(default, dict):  # a mutable default: each instance gets its own copy
        return field(default_factory=lambda: dict(default), metadata=meta)
    return field(default=default, metadata=meta)


def nested(factory: Callable[[], Any], prefix: str = "") -> Any:
    """A group of knobs; `prefix` goes before each of its variables' names."""
    return field(default_factory=factory, metadata={"nested": True, "prefix": prefix})


def _bool(raw: str) -> bool:
    value = raw.strip().lower()
    if value in ("1", "true", "yes", "on"):
        return True
    if value in ("0", "false", "no", "off", ""):
        return False
    raise ValueError("is not a boolean (use 1/0, true/false)")


def _optional_int(raw: str) -> Optional[int]:
    return int(raw) if raw.strip() else None


def _optional_float(raw: str) -> Optional[float]:
    return float(raw) if raw.strip() else None


def parse_api_keys(raw: str) -> dict[str, str]:
    """'k1:acme,k2:globex' -> {'k1': 'acme', 'k2': 'globex'}; each key maps to one tenant."""
    keys: dict[str, str] = {}
    for item in filter(None, (part.strip() for part in raw.split(","))):
        key, sep, tenant = item.partition(":")
        if not sep or not key or not tenant:
            raise ValueError(f"entry {item!r} must look like 'apikey:tenant'")
        if key in keys:
            raise ValueError(f"lists key {key[:4]}… twice; a key maps to one tenant")
        keys[key] = tenant
    return keys


def _parse(f: dataclasses.Field, raw: str, name: str) -> Any:
    meta = f.metadata
    try:
        value = meta["parse"](raw)
    except ValueError as exc:
        what = {int: "an integer", float: "a number"}.get(meta["parse"])
        raise ValueError(f"{name}={raw!r} {f'is not {what}' if what else exc}") from None
    if meta["choices"] and value not in meta["choices"]:
        raise ValueError(f"{name}={raw!r} must be one of {', '.join(meta['choices'])}")
    if value is not None and meta["lo"] is not None and value < meta["lo"]:
        raise ValueError(f"{name}={value} must be >= {meta['lo']}")
    if value is not None and meta["gt"] is not None and not value > meta["gt"]:
        raise ValueError(f"{name}={value} must be > {meta['gt']}")
    return value


def _from_env(obj: Any, env: Mapping[str, str], prefix: str = "") -> Any:
    """`obj` with every field whose variable is set in `env` replaced by its value."""
    changes = {}
    for f in fields(obj):
        if f.metadata.get("nested"):
            changes[f.name] = _from_env(getattr(obj, f.name), env, prefix + f.metadata["prefix"])
        elif "env" in f.metadata:
            name = f"KVFLEET_{prefix}{f.metadata['env']}"
            if name in env:
                changes[f.name] = _parse(f, env[name], name)
    return dataclasses.replace(obj, **changes) if changes else obj


@dataclass(frozen=True)
class KafkaSettings:
    bootstrap: str = knob("127.0.0.1:19092", "KAFKA_BOOTSTRAP")
    topic_prefix: str = knob(constants.DEFAULT_TOPIC_PREFIX, "TOPIC_PREFIX")
    group: str = knob(constants.SCHEDULER_GROUP, "SCHEDULER_GROUP")
    #: Partitions per priority topic: the most scheduler replicas that share a class.
    partitions: int = knob(constants.PARTITIONS_PER_TOPIC, "KAFKA_PARTITIONS", int, lo=1)
    # Authentication and encryption to the brokers (docs/operations.md), passed to every
    # client kvfleet makes. PLAINTEXT is the local development broker's.
    security_protocol: str = knob("PLAINTEXT", "KAFKA_SECURITY_PROTOCOL",
                                  choices=("PLAINTEXT", "SSL", "SASL_PLAINTEXT", "SASL_SSL"))
    sasl_mechanism: str = knob("PLAIN", "KAFKA_SASL_MECHANISM", choices=("PLAIN", "SCRAM-SHA-256", "SCRAM-SHA-512"))
    sasl_username: str = knob("", "KAFKA_SASL_USERNAME")
    sasl_password: str = knob("", "KAFKA_SASL_PASSWORD")
    #: CA bundle that signed the brokers' certificates; empty: the system's.
    ssl_cafile: str = knob("", "KAFKA_SSL_CAFILE")
    #: A client certificate and key, for brokers that require mutual TLS.
    ssl_certfile: str = knob("", "KAFKA_SSL_CERTFILE")
    ssl_keyfile: str = knob("", "KAFKA_SSL_KEYFILE")

    def __post_init__(self) -> None:
        if self.security_protocol.startswith("SASL") and not (self.sasl_username and self.sasl_password):
            raise ValueError(f"security_protocol={self.security_protocol} needs a user and a password "
                             "(KVFLEET_KAFKA_SASL_USERNAME, KVFLEET_KAFKA_SASL_PASSWORD)")

    @property
    def client_options(self) -> dict:
        """The connection options every kafka-python client of kvfleet takes (`rdkafka_options`:
        the librdkafka producers)."""
        options: dict = {"bootstrap_servers": self.bootstrap, "security_protocol": self.security_protocol}
        if self.security_protocol.startswith("SASL"):
            options.update(sasl_mechanism=self.sasl_mechanism, sasl_plain_username=self.sasl_username,
                           sasl_plain_password=self.sasl_password)
        if self.security_protocol.endswith("SSL"):
            options.update({k: v for k, v in (("ssl_cafile", self.ssl_cafile), ("ssl_certfile", self.ssl_certfile),
                                              ("ssl_keyfile", self.ssl_keyfile)) if v})
        return options

    @property
    def rdkafka_options(self) -> dict:
        """The same connection options in librdkafka's names, for the API's producer and
        the scheduler's (kvfleet/kafka.py, `make_submit_producer`, `make_batch_producer`)."""
        options: dict = {"bootstrap.servers": self.bootstrap, "security.protocol": self.security_protocol}
        if self.security_protocol.startswith("SASL"):
            options.update({"sasl.mechanism": self.sasl_mechanism, "sasl.username": self.sasl_username,
                            "sasl.password": self.sasl_password})
        if self.security_protocol.endswith("SSL"):
            options.update({k: v for k, v in (("ssl.ca.location", self.ssl_cafile),
                                              ("ssl.certificate.location", self.ssl_certfile),
                                              ("ssl.key.location", self.ssl_keyfile)) if v})
        return options

    @property
    def topics(self) -> list[str]:
        return constants.all_request_topics(self.topic_prefix)

    @property
    def dlq(self) -> str:
        return constants.dlq_topic(self.topic_prefix)

    @property
    def results(self) -> str:
        return constants.results_topic(self.topic_prefix)


@dataclass(frozen=True)
class RedisSettings:
    #: Job states, results, ledger, heartbeats and the Celery broker: never evicts.
    url: str = knob(f"redis://127.0.0.1:{constants.STATE_REDIS_PORT}/0", "REDIS_URL")
    #: The KV cold tier: a separate instance that may evict (allkeys-lru).
    cache_url: str = knob(f"redis://127.0.0.1:{constants.CACHE_REDIS_PORT}/0", "CACHE_REDIS_URL")
    key_prefix: str = knob(constants.DEFAULT_KEY_PREFIX, "KEY_PREFIX")

    @property
    def keys(self) -> constants.Keys:
        return constants.Keys(self.key_prefix)


@dataclass(frozen=True)
class ModelSettings:
    #: "builtin:<name>" for an embedded seeded-random model, or a path to a Hugging Face
    #: format checkpoint directory (config.json, *.safetensors, tokenizer.json).
    source: str = knob("builtin:tiny", "MODEL")
    #: "auto" = cuda when available, else cpu.
    device: str = knob("auto", "DEVICE")
    #: "auto" = bfloat16 on cuda, float32 on cpu (CPU bf16 matmuls are slow on most parts).
    dtype: str = knob("auto", "DTYPE")

    @property
    def name(self) -> str:
        """The name clients put in `model`; the directory's basename for a checkpoint."""
        if self.source.startswith("builtin:"):
            return self.source
        return os.path.basename(os.path.normpath(self.source))


@dataclass(frozen=True)
class ApiSettings:
    host: str = knob("127.0.0.1", "API_HOST")
    port: int = knob(8000, "API_PORT", int, lo=1)
    #: API processes serving the one port (uvicorn's workers; each has its own Kafka
    #: producer, Redis pools and batch driver). 0: one per CPU this process may run on.
    #: 1 by default: a container's CPU count is often its host's, not its limit, so the
    #: number is the deployment's to choose (docs/benchmarks.md, "Front door").
    workers: int = knob(1, "API_WORKERS", int, lo=0)
    #: Public base URL used in the `url` of a 202 answer; empty: http://host:port.
    public_url: str = knob("", "PUBLIC_URL")
    #: "key:tenant,key:tenant" (or `api_keys` in KVFLEET_TENANTS). Empty: no keys, the
    #: X-Tenant-ID header names the tenant (development only).
    api_keys: Mapping[str, str] = knob({}, "API_KEYS", parse_api_keys)
    default_tenant: str = knob("default", "DEFAULT_TENANT")
    #: Longest `?wait=` a client may ask for, seconds.
    max_wait_s: float = knob(60.0, "MAX_WAIT_S", float, gt=0)
    #: Default SLA for jobs that give no timeout, seconds (sets their deadline).
    default_timeout_s: float = knob(600.0, "DEFAULT_TIMEOUT_S", float, gt=0)
    #: Output tokens of an OpenAI chat request that sets no max_completion_tokens /
    #: max_tokens, cut to what the context, the class's ceiling and the tenant's bucket
    #: leave. Not "the whole context" (vLLM's default): the quota charges it up front.
    chat_max_tokens: int = knob(512, "CHAT_MAX_TOKENS", int, lo=1)
    # Most jobs a class may have waiting on Kafka for the scheduler (its consumer lag)
    # before submissions of that class get 429 + Retry-After. High's bound is the
    # smallest: a long high backlog already means high latency.
    max_backlog_high: int = knob(1_000, "MAX_BACKLOG_HIGH", int, lo=1)
    max_backlog_normal: int = knob(5_000, "MAX_BACKLOG_NORMAL", int, lo=1)
    max_backlog_low: int = knob(10_000, "MAX_BACKLOG_LOW", int, lo=1)
    #: Overload, when bronze submissions get 503: the ledger holds at least this fraction
    #: of the fleet's budget *and* at least `overload_backlog` jobs wait on Kafka.
    overload_utilization: float = knob(0.9, "OVERLOAD_UTILIZATION", float, gt=0)
    #: 64 = one class's scheduler buffer (`max_buffered`): more waiting than the
    #: scheduler can even look at.
    overload_backlog: int = knob(64, "OVERLOAD_BACKLOG", int, lo=0)
    #: Retry-After of that 503, seconds: a rough hint, as the overload is read afresh
    #: every second. 30 is what it said before issue 15, when it was bronze's fixed
    #: shed time (`PolicyConfig.bronze_shed_after_s`, now unset by default).
    overload_retry_after_s: float = knob(30.0, "OVERLOAD_RETRY_AFTER_S", float, gt=0)

    @property
    def base_url(self) -> str:
        return self.public_url or f"http://{self.host}:{self.port}"

    @property
    def max_backlog(self) -> dict[Priority, int]:
        return {Priority.HIGH: self.max_backlog_high, Priority.NORMAL: self.max_backlog_normal,
                Priority.LOW: self.max_backlog_low}


@dataclass(frozen=True)
class BatchSettings:
    """The Files and Batch APIs (producer/files/, producer/batches/, docs/batch.md)."""

    #: Where uploaded and generated files live; empty: `<KVFLEET_HOME>/files`. A volume
    #: shared by every API replica (each may drive any batch).
    files_dir: str = knob("", "FILES_DIR")
    #: OpenAI's limits for a batch input file: 200 MB and 50,000 lines.
    max_file_bytes: int = knob(200 * 2**20, "FILES_MAX_BYTES", int, lo=1)
    max_file_lines: int = knob(50_000, "FILES_MAX_LINES", int, lo=1)
    #: Files are deleted this long after upload (30 days, as OpenAI keeps batch output).
    file_retention_s: float = knob(30 * 24 * 3600.0, "FILES_RETENTION_S", float, gt=0)
    #: Shortest and longest `completion_window` a batch may ask for, seconds. OpenAI
    #: takes only "24h"; a shorter minimum lets a test or an operator expire batches sooner.
    min_window_s: float = knob(3600.0, "BATCH_MIN_WINDOW_S", float, gt=0)
    max_window_s: float = knob(7 * 24 * 3600.0, "BATCH_MAX_WINDOW_S", float, gt=0)
    #: Jobs of one batch queued or running at once: bounds what a batch puts on Kafka
    #: (so it never fills its class's backlog, which would refuse other tenants) and
    #: what its driver tracks.
    max_in_flight: int = knob(512, "BATCH_MAX_IN_FLIGHT", int, lo=1)
    #: Lines read ahead and sorted by prompt before they are queued, so lines sharing a
    #: prefix run next to each other and reuse its KV blocks.
    order_window: int = knob(256, "BATCH_ORDER_WINDOW", int, lo=1)

    def __post_init__(self) -> None:
        if self.min_window_s > self.max_window_s:
            raise ValueError(f"min_window_s={self.min_window_s} must be <= max_window_s={self.max_window_s} "
                             "(KVFLEET_BATCH_MIN_WINDOW_S, KVFLEET_BATCH_MAX_WINDOW_S)")


@dataclass(frozen=True)
class SchedulerSettings:
    metrics_port: int = knob(9101, "SCHEDULER_METRICS_PORT", int, lo=0)  # 0 = no endpoint
    #: How long one poll waits for records, ms.
    poll_timeout_ms: int = knob(200, "POLL_TIMEOUT_MS", int, lo=1)
    max_poll_records: int = knob(500, "MAX_POLL_RECORDS", int, lo=1)
    #: The longest the broker holds the consumer's fetch when the partitions in it have
    #: nothing new, ms (Kafka's fetch.max.wait.ms, 500 by default). kafka-python keeps one
    #: fetch in flight per broker, so a partition resumed while a fetch for the others
    #: waits is read only once that fetch returns: with 500, a class whose buffer drained
    #: under a backlog sat idle for up to half a second, and a 2,000-job run admitted
    #: nothing for 0.3-2.5 s in all (docs/benchmarks.md, "A resumed partition's fetch").
    #: A fetch with records returns at once whatever this is; a lower value costs only
    #: idle fetches (10 a second at 100).
    fetch_max_wait_ms: int = knob(100, "SCHEDULER_FETCH_MAX_WAIT_MS", int, lo=0)
    #: The longest the loop waits while jobs wait for budget, ms. Tokens a finishing job
    #: releases wake it at once (scheduler/wake.py); a new worker's capacity, a Redis
    #: without pub/sub or new Kafka records are noticed within this.
    busy_poll_ms: int = knob(20, "BUSY_POLL_MS", int, lo=1)
    #: Once freed tokens woke the loop, how long it gathers further releases before it
    #: admits, ms (scheduler/wake.py). The jobs of one engine step end within a few ms
    #: of each other: 10 ms turns their freed slots into one round and a few messages
    #: instead of a round and a message each (docs/benchmarks.md, "Job path"), at a cost
    #: of at most that to a job that waits for budget anyway. 0: admit at the first.
    round_gather_ms: int = knob(10, "SCHEDULER_ROUND_GATHER_MS", int, lo=0)
    #: While results keep coming, the results relay sends at most one batch to Kafka per
    #: this many ms (kvfleet/results.py): a result that arrives when the relay is idle goes
    #: at once, the ones that trickle in behind it share a produce request. 0: every read.
    results_gather_ms: int = knob(10, "RESULTS_GATHER_MS", int, lo=0)
    #: An operator's cap on the fleet's token budget; 0 = the live workers' KV capacity.
    capacity_ceiling_tokens: int = knob(0, "CAPACITY_CEILING_TOKENS", int, lo=0)
    #: A reservation's lease from admission until a worker starts the job and renews
    #: it, seconds. It must cover the wait in the Celery queue: an expired lease is
    #: reclaimed and the job sent again (harmless, but its tokens are counted late).
    admit_lease_s: float = knob(60.0, "ADMIT_LEASE_S", float, gt=0)
    #: The most jobs one Celery message carries (scheduler/dispatch.py packs a large
    #: round, never a small one); 1 = one message per job. Each message costs a worker's
    #: Celery consumer a read, an unacked record and an ack whatever it carries.
    jobs_per_message: int = knob(16, "SCHEDULER_JOBS_PER_MESSAGE", int, lo=1)
    #: A member still without its assignment this long after a rebalance started is
    #: stuck (a healthy rebalance takes about a session timeout, 10 s): it rejoins the
    #: group, and exits for its supervisor to restart it if that fails too.
    rejoin_after_s: float = knob(60.0, "SCHEDULER_REJOIN_AFTER_S", float, gt=0)
    #: A replica that owns no partition while the group's lag has not gone down for this
    #: long is unhealthy (`/healthz` 503, scheduler/health.py) and rejoins the group.
    idle_lag_window_s: float = knob(30.0, "SCHEDULER_IDLE_LAG_S", float, gt=0)


@dataclass(frozen=True)
class ClassConfig:
    """One priority class's knobs; variables `KVFLEET_<CLASS>_SHARE` and so on."""

    #: Fraction of the budget the class is guaranteed while it has demand.
    share: float = knob(0.0, "SHARE", float, lo=0)
    #: Hard aging bound, seconds: a job that waited this long goes before all others.
    max_wait_s: float = knob(60.0, "MAX_WAIT_S", float, gt=0)
    #: Seconds a job blocked by the budget waits before the budget is held for it.
    reserve_after_s: float = knob(0.0, "RESERVE_AFTER_S", float, lo=0)


#: Per-request token ceilings relative to the configured base (fixed by the design).
CEILING_FACTOR = {Priority.HIGH: 2.0, Priority.NORMAL: 1.0, Priority.LOW: 0.25}


@dataclass(frozen=True)
class PolicyConfig:
    """The admission policy's knobs (scheduler/policy.py says how each is used); the
    API reads the ceilings from here too."""

    #: Normal's per-request ceiling in tokens (prompt + max_new_tokens); high gets 2×,
    #: low 1/4. 4096 lets a normal job fill a 4k context.
    base_ceiling_tokens: int = knob(4096, "BASE_CEILING_TOKENS", int)
    #: Seconds of waiting worth one priority class when borrowing: a low job that
    #: waited 2 × aging_s ranks with a fresh high one.
    aging_s: float = knob(20.0, "AGING_S", float)
    # A high job lets smaller jobs pass it for at most a second, then holds the line.
    # Its 60% share is what it may fill before other classes' shares come first.
    high: ClassConfig = nested(lambda: ClassConfig(share=0.6, max_wait_s=30.0, reserve_after_s=1.0), "HIGH_")
    normal: ClassConfig = nested(lambda: ClassConfig(share=0.3, max_wait_s=90.0, reserve_after_s=5.0), "NORMAL_")
    low: ClassConfig = nested(lambda: ClassConfig(share=0.1, max_wait_s=180.0, reserve_after_s=10.0), "LOW_")
    #: Default gold reserve per gold tenant, fraction of the budget (Tenant.share overrides).
    gold_reserve: float = knob(0.2, "GOLD_RESERVE", float)
    #: Default burst cap of a silver tenant, fraction of the budget.
    silver_burst: float = knob(0.6, "SILVER_BURST", float)
    #: Default share of a bronze tenant, fraction of the budget: all it gets while others
    #: have work waiting (beyond it only what `borrow_idle` lends).
    bronze_limit: float = knob(0.2, "BRONZE_LIMIT", float)
    #: May a tenant over its share (silver's burst, bronze's limit) borrow what no other
    #: tenant's waiting job wants? Borrowed work is admitted last and never holds the
    #: budget, so it yields the next free tokens and slots to everyone within a share
    #: (the fair-share rule of YARN, Kubernetes and Slurm: an idle share is lent, not
    #: wasted). A tenant's own `limit` (kvfleet/tenancy.py) stays hard. Off: the shares
    #: are hard limits, idle fleet or not.
    borrow_idle: bool = knob(True, "BORROW_IDLE", _bool)
    #: Shed a bronze job as soon as it can no longer be admitted before its deadline: the
    #: tokens buffered ahead of it, at the rate the buffer drains (scheduler/drain_rate.py),
    #: take it past the deadline. It would only expire later; shed now, its client gets
    #: the 503 to retry while the deadline is still ahead, and work that can still finish
    #: in time is never refused (issue 15: shedding after a fixed 30 s refused 1,627
    #: bronze jobs that strict priority finished in time). Off: bronze only expires.
    bronze_shed_late: bool = knob(True, "BRONZE_SHED_LATE", _bool)
    #: Seconds a bronze job may wait before it is shed whatever its deadline: a hard
    #: bound on bronze's wait for fleets that prefer a fast refusal to serving bronze
    #: late. Unset (the default): only `bronze_shed_late` sheds.
    bronze_shed_after_s: Optional[float] = knob(None, "BRONZE_SHED_AFTER_S", _optional_float)
    #: Fraction of the fleet's task slots (the workers' Celery threads, their heartbeats'
    #: `slots`) that normal and low jobs may not take: room kept for high jobs that
    #: arrive while the fleet is full. Beside a high job the engine's priority guard
    #: slows normal and low jobs to a crawl, so without it they keep every thread while a
    #: burst of high jobs waits for one. bench/scheduler.py, 10 seeds, 0 → 0.125 → 0.25
    #: → 0.375: high's p99 wait 3.9 → 2.2 → 1.3 → 0.05 s, its p99 end to end 1.88 → 1.63
    #: → 1.50 → 1.54 × unloaded (what is left is high's run time, which
    #: slots cannot shorten), compliant tenants' low p99 wait 86 → 91 → 99 → 106 s. 0.25: 4 of a
    #: 16-thread worker's threads. Only threads are kept, never tokens; a fleet of fewer
    #: than 4 slots keeps none (the count is rounded down). 0: no reserve.
    high_slot_reserve: float = knob(0.25, "HIGH_SLOT_RESERVE", float)
    #: Jobs buffered per class before its partitions pause: the policy's lookahead. Also
    #: bounds what a crashed replica leaves for redelivery.
    max_buffered: int = knob(64, "MAX_BUFFERED", int)

    def __post_init__(self) -> None:
        if self.base_ceiling_tokens < 4:
            raise ValueError(f"base_ceiling_tokens={self.base_ceiling_tokens} must be >= 4 (low gets a quarter) "
                             "(KVFLEET_BASE_CEILING_TOKENS)")
        if not self.aging_s > 0:
            raise ValueError(f"aging_s={self.aging_s} must be > 0 seconds (KVFLEET_AGING_S)")
        if self.bronze_shed_after_s is not None and not self.bronze_shed_after_s > 0:
            raise ValueError(f"bronze_shed_after_s={self.bronze_shed_after_s} must be > 0 seconds, or unset "
                             "(KVFLEET_BRONZE_SHED_AFTER_S)")
        if not 0.0 <= self.high_slot_reserve < 1.0:
            raise ValueError(f"high_slot_reserve={self.high_slot_reserve} must be within [0, 1): the fraction of "
                             "the task slots normal and low jobs may not take (KVFLEET_HIGH_SLOT_RESERVE)")
        for p in Priority:
            c, var = self.of(p), f"KVFLEET_{p.value.upper()}"
            if not 0.0 <= c.share <= 1.0:
                raise ValueError(f"{p.value}.share={c.share} must be within [0, 1] ({var}_SHARE)")
            if not c.max_wait_s > 0:
                raise ValueError(f"{p.value}.max_wait_s={c.max_wait_s} must be > 0 seconds ({var}_MAX_WAIT_S)")
            if not 0.0 <= c.reserve_after_s <= c.max_wait_s:
                raise ValueError(f"{p.value}.reserve_after_s={c.reserve_after_s} must be within [0, max_wait_s="
                                 f"{c.max_wait_s}] ({var}_RESERVE_AFTER_S, {var}_MAX_WAIT_S)")
        total = sum(self.of(p).share for p in Priority)
        if total > 1.0 + 1e-9:
            raise ValueError(f"class shares sum to {total:.2f}; guarantees cannot exceed the budget (<= 1) "
                             "(KVFLEET_HIGH_SHARE, KVFLEET_NORMAL_SHARE, KVFLEET_LOW_SHARE)")
        for name in ("gold_reserve", "silver_burst", "bronze_limit"):
            if not 0.0 < getattr(self, name) <= 1.0:
                raise ValueError(f"{name}={getattr(self, name)} must be within (0, 1] (KVFLEET_{name.upper()})")
        if self.max_buffered < 1:
            raise ValueError(f"max_buffered={self.max_buffered} must be >= 1 (KVFLEET_MAX_BUFFERED)")

    def of(self, priority: Priority) -> ClassConfig:
        return {Priority.HIGH: self.high, Priority.NORMAL: self.normal, Priority.LOW: self.low}[priority]

    def ceiling(self, priority: Priority) -> int:
        return int(self.base_ceiling_tokens * CEILING_FACTOR[priority])

    def replace(self, **changes) -> "PolicyConfig":
        return dataclasses.replace(self, **changes)


#: EngineConfig.kv_cache_dtype: the KV pool's layouts (workers/engine/model_runner.py).
KV_CACHE_DTYPES = ("model", "int8-v")


@dataclass(frozen=True)
class EngineConfig:
    """The engine's knobs (workers/engine/), checked once when built."""

    #: Tokens per KV block: the unit of allocation, sharing and cold-tier transfer.
    #: 16 keeps the waste of a half-filled last block small and a block's copy worth
    #: a round trip. A power of two, as the Triton kernels index blocks with shifts.
    block_size: int = knob(16, "BLOCK_SIZE", int, lo=1)
    #: KV pool size in blocks. When None, as many blocks as fit in `kv_memory_bytes`.
    num_blocks: Optional[int] = knob(None, "NUM_BLOCKS", _optional_int, lo=1)
    #: Memory for the KV pool (K and V of every layer), bytes: the worker's token capacity.
    kv_memory_bytes: int = knob(256 * 2**20, "KV_MEMORY_BYTES", int, lo=1)
    #: Sequences holding blocks at once: the largest decode batch.
    max_num_seqs: int = knob(64, "MAX_NUM_SEQS", int, lo=1)
    #: Tokens computed per step, prefill and decode together. Bounds one step's
    #: latency (a long prompt is prefilled in chunks of this) and its activation memory.
    max_num_batched_tokens: int = knob(2048, "MAX_NUM_BATCHED_TOKENS", int, lo=1)
    #: Longest prompt + output, tokens. None: the model's context.
    max_model_len: Optional[int] = knob(None, "MAX_MODEL_LEN", _optional_int, lo=2)
    #: Kernel backend (kernels/ops.py): "auto" (Triton on CUDA; on a CPU, "native" where
    #: its C decode kernel builds with the machine's compiler, else "torch"), "triton",
    #: "native" or "torch".
    kernels: str = knob("auto", "KERNELS", choices=("auto", "triton", "native", "torch"))
    #: Attention path: "paged" (the backend's paged kernel) or "sdpa" (gather + SDPA).
    attention: str = knob("paged", "ATTENTION", choices=("paged", "sdpa"))
    #: What the KV pool holds: "model" (K and V in the model's dtype) or "int8-v" (K in
    #: the model's dtype, V as INT8 with one fp16 scale per token and KV head: the
    #: FP16-K / INT8-V hot tier: 1.306x the tokens of a 16-bit pool in the same memory at
    #: head_dim 32, for +0.001% held-out perplexity on builtin:english, docs/engine.md).
    #: The cold tier cannot carry int8-v blocks: Settings refuses the two together.
    kv_cache_dtype: str = knob("model", "KV_CACHE_DTYPE", choices=KV_CACHE_DTYPES)
    #: While a higher class has work in the engine, lower classes' tokens ride along in a
    #: step only while they make it at most this much longer than the higher class's
    #: work alone (predicted from the engine's measured step times, step_cost.py). 0.25:
    #: an online request's steps at most 25% slower while a batch runs; on a GPU, where
    #: a decode token costs almost nothing, that is nearly no limit. `inf`: no guard.
    priority_step_slack: float = knob(0.25, "PRIORITY_STEP_SLACK", float, lo=0)
    #: Stall-free decodes: while sequences are decoding, the prefill chunks beside them
    #: (new prompts, the rest of long ones) take only the tokens that keep the step
    #: within this much of the decodes' work alone (predicted as for the guard above),
    #: at least one. Every decode waits the whole step for its one token, so this bounds
    #: its time per token while prompts arrive; the prompts are spread over more steps.
    #: A prompt with no decode ahead of it in service order (a high request beside batch
    #: lines) is not held to it. 2: a step at most 3x its decodes alone, about 9 prefill
    #: tokens beside one decode and 39 beside 16 at builtin:bench's CPU cost (a = 3 ms,
    #: b = 0.78 ms a token), the best of bench/scheduler.py's sweep (docs/benchmarks.md);
    #: on a GPU, where a token costs almost nothing, nearly no limit. `inf`: prefills
    #: take the whole budget.
    decode_step_slack: float = knob(2.0, "DECODE_STEP_SLACK", float, lo=0)
    #: Speculative decoding (workers/engine/spec.py) for requests whose
    #: `Sampling.speculative` is None: prompt-lookup drafts verified in one forward. The
    #: same output (greedy exactly, sampling in distribution), faster when the output
    #: repeats its prompt or itself; off, as on a large batch the drafts' rows cost
    #: real compute (docs/engine.md, "Speculative decoding", has the measurements).
    speculate: bool = knob(False, "ENGINE_SPECULATE", _bool)
    #: Most draft tokens a speculating sequence verifies in one step. 4: the first drafts
    #: carry most of the gain; a longer guess is rarely all right.
    spec_tokens: int = knob(4, "ENGINE_SPEC_TOKENS", int, lo=1)

    def __post_init__(self) -> None:
        if self.block_size < 1 or self.block_size & (self.block_size - 1):
            raise ValueError(f"block_size must be a power of two, got {self.block_size} (KVFLEET_BLOCK_SIZE)")
        if self.num_blocks is not None and self.num_blocks < 1:
            raise ValueError(f"num_blocks must be >= 1 (or None to size the pool by kv_memory_bytes), "
                             f"got {self.num_blocks}")
        for name in ("kv_memory_bytes", "max_num_seqs", "max_num_batched_tokens", "spec_tokens"):
            if getattr(self, name) < 1:
                raise ValueError(f"EngineConfig.{name} must be >= 1, got {getattr(self, name)} "
                                 f"(KVFLEET_{name.upper()})")
        if self.max_model_len is not None and self.max_model_len < 2:
            raise ValueError(f"max_model_len must be >= 2 (one prompt and one new token), got {self.max_model_len}")
        if self.kv_cache_dtype not in KV_CACHE_DTYPES:
            raise ValueError(f"kv_cache_dtype must be one of {', '.join(KV_CACHE_DTYPES)}, got "
                             f"{self.kv_cache_dtype!r} (KVFLEET_KV_CACHE_DTYPE)")


#: Engine batches of normal and low jobs a worker takes at once by default
#: (`Settings.worker_concurrency`). 3 against 1 (threads = max_num_seqs / (1 - reserve)),
#: in alternate full runs of bench/fleet.py --part jobs: 1-token jobs 0.34 / 0.34 of the
#: engine alone against 0.28 / 0.27, 128-token 0.85 / 0.85 against 0.75 / 0.71; 4.5
#: measured no better than 3.
WORKER_BATCHES_IN_FLIGHT = 3


@dataclass(frozen=True)
class WorkerSettings:
    metrics_port: int = knob(9102, "WORKER_METRICS_PORT", int, lo=0)  # 0 = no endpoint
    #: Celery task threads feeding the engine. 0 = three of the engine's batches
    #: (max_num_seqs) plus the policy's high_slot_reserve of the threads
    #: (`Settings.worker_concurrency`): one batch runs while the next are on their way.
    #: Also the jobs a worker holds at once, however they are packed (workers/gate.py).
    concurrency: int = knob(0, "WORKER_CONCURRENCY", int, lo=0)
    #: torch's intra-op threads in the worker process. 0 = `OMP_NUM_THREADS` if the
    #: environment sets it, else 1, as torchrun sets for several processes a machine:
    #: a CPU worker shares its cores with its sibling workers (`--scale worker=N`), the
    #: scheduler, Kafka and Redis, and an intra-op pool's threads spin between ops on
    #: cores those need. On a 2-core machine one thread instead of two ran builtin:tiny
    #: and builtin:english faster even alone (1.2-1.8x), and short jobs through the fleet
    #: 19% faster (docs/benchmarks.md "One torch thread a worker"); builtin:bench alone
    #: ran 1.3x faster on two. Raise it for one worker on a machine of its own.
    torch_threads: int = knob(0, "WORKER_TORCH_THREADS", int, lo=0)
    #: Seconds before Redis hands an unacknowledged task to another worker. It counts
    #: from *delivery*, not from start: a task that waits in a prefetch buffer longer
    #: than this is delivered twice. So prefetch is 1 per thread, and the job's run
    #: lease (not this timeout) is what keeps two copies from both running.
    visibility_timeout_s: float = knob(300.0, "VISIBILITY_TIMEOUT_S", float, gt=0)
    #: SIGTERM to exit: running jobs may finish this long, then they go back to their
    #: queues for another worker (workers/drain.py). docker-compose.yml's worker
    #: `stop_grace_period` is this plus a margin for the hand-back.
    drain_grace_s: float = knob(30.0, "WORKER_DRAIN_GRACE_S", float, lo=0)
    #: Publish each followed job's text to its Redis Stream as it is generated (what
    #: `GET /v1/jobs/{id}/stream` and the OpenAI streams relay). Off: streams show each
    #: job's text at its end.
    stream: bool = knob(True, "WORKER_STREAM", _bool)
    #: Stream every job, followed or not (for readers of the Redis streams that do not go
    #: through the API). Off: a job's stream is written once a client follows it, from
    #: its text so far; jobs nobody follows cost no stream (about a tenth of long jobs'
    #: throughput, docs/benchmarks.md).
    stream_all: bool = knob(False, "WORKER_STREAM_ALL", _bool)
    #: Runs of one job an engine fault may end before the job fails (`worker_error`).
    #: Until then each faulted run goes back to its queue for any worker to run again
    #: (and a fault on a worker gone unhealthy always does); an input error fails at once.
    max_job_faults: int = knob(3, "WORKER_MAX_JOB_FAULTS", int, lo=1)
    #: Engine steps that raise in a row before the worker calls itself unhealthy:
    #: it withdraws its capacity, hands its jobs back and exits non-zero for its
    #: supervisor to start a fresh process (a CUDA error does not heal in place).
    unhealthy_after_faults: int = knob(3, "WORKER_UNHEALTHY_AFTER_FAULTS", int, lo=1)
    #: Logical lifetime of an entry of the exact-match result cache, seconds (stale
    #: entries are served as long again while one request refreshes them); 0 = no cache.
    result_cache_ttl_s: float = knob(300.0, "RESULT_CACHE_TTL_S", float, lo=0)


@dataclass(frozen=True)
class ColdTierSettings:
    """The KV cache's Redis tier (kvstore/), on the cache instance (`RedisSettings.cache_url`)."""

    enabled: bool = knob(True, "COLD_TIER", _bool)
    #: Logical lifetime of a spilled block, seconds; the key lives `grace_s` longer and
    #: both are jittered ±10% so blocks spilled together do not expire together.
    ttl_s: float = knob(3600.0, "COLD_TTL_S", float, gt=0)
    grace_s: float = knob(600.0, "COLD_GRACE_S", float, gt=0)
    #: "none" keeps the pool's dtype; "int8" halves the bytes of fp16 blocks.
    quant: str = knob("none", "COLD_QUANT", str.lower, choices=("none", "int8"))
    #: Bytes of evicted blocks queued for the spill thread before spills are dropped
    #: (counted), so a slow Redis never stalls the engine.
    spill_max_bytes: int = knob(256 * 2**20, "COLD_SPILL_MAX_BYTES", int, lo=1)
    #: A prompt prefix of at least this many full blocks that is in neither tier is
    #: prefilled by one worker of the fleet while the others wait for it (stampede
    #: protection); shorter ones are cheaper to recompute than to coordinate.
    single_flight_min_blocks: int = knob(4, "PREFIX_SINGLE_FLIGHT_MIN_BLOCKS", int, lo=1)
    #: This worker's prefill rate, tokens/s, for deciding between loading a cold prefix
    #: and recomputing it (kvstore/decision.py); 0 = measured from the engine's steps.
    prefill_tokens_per_s: float = knob(0.0, "COLD_PREFILL_TOKENS_PER_S", float, lo=0)


@dataclass(frozen=True)
class Settings:
    kafka: KafkaSettings = nested(KafkaSettings)
    redis: RedisSettings = nested(RedisSettings)
    model: ModelSettings = nested(ModelSettings)
    api: ApiSettings = nested(ApiSettings)
    scheduler: SchedulerSettings = nested(SchedulerSettings)
    policy: PolicyConfig = nested(PolicyConfig)
    engine: EngineConfig = nested(EngineConfig)
    worker: WorkerSettings = nested(WorkerSettings)
    cold_tier: ColdTierSettings = nested(ColdTierSettings)
    batch: BatchSettings = nested(BatchSettings)
    #: Tenants with tier, quota and API keys: JSON, or "@path" to a JSON file
    #: (kvfleet/tenancy.py). Empty: development, any X-Tenant-ID, no quota.
    tenants: str = knob("", "TENANTS")
    #: Where local installs, servers' data and logs live, outside any clone, so a
    #: second clone (CI's) reuses what the first downloaded.
    home: str = knob(str(Path.home() / ".cache" / "kvfleet"), "HOME")
    log_level: str = knob("INFO", "LOG_LEVEL", str.upper, choices=("DEBUG", "INFO", "WARNING", "ERROR"))
    #: Once a service is up, move the objects it built at startup out of the cyclic
    #: garbage collector's reach (kvfleet/heap.py): its full collections then walk
    #: only what was made since.
    gc_freeze: bool = knob(True, "GC_FREEZE", _bool)

    @property
    def worker_concurrency(self) -> int:
        """A worker's Celery task threads (its heartbeat's `slots`): KVFLEET_WORKER_CONCURRENCY,
        or by default `WORKER_BATCHES_IN_FLIGHT` engine batches (max_num_seqs each) of
        normal and low jobs, with the policy's `high_slot_reserve` of the threads on top
        for high ones. One batch runs; the others are on their way to the engine
        (Celery delivery, begin, the prefix step, its queue), so each step finds a full
        batch: with threads for one batch, a 1-token job spent ~100 ms of its slot
        outside the engine and a step took 12 of them (docs/benchmarks.md, "Job path").
        A high job that gets a reserved thread while the engine is full preempts its
        lowest sequence (workers/engine/scheduler.py), so the reserve costs high nothing."""
        if self.worker.concurrency:
            return self.worker.concurrency
        return math.ceil(WORKER_BATCHES_IN_FLIGHT * self.engine.max_num_seqs / (1.0 - self.policy.high_slot_reserve))

    def __post_init__(self) -> None:
        # The cold tier's blobs copy whole blocks of one dtype, K and V alike (kvstore/blob.py);
        # an int8-v pool's V is int8 with scales beside it, which they cannot carry.
        if self.engine.kv_cache_dtype == "int8-v" and self.cold_tier.enabled:
            raise ValueError("KVFLEET_KV_CACHE_DTYPE=int8-v cannot run with the cold tier, whose blobs hold K and V "
                             "of one dtype: set KVFLEET_COLD_TIER=0 as well, or KVFLEET_KV_CACHE_DTYPE=model")

    @classmethod
    def from_env(cls, env: Mapping[str, str] | None = None) -> "Settings":
        return _from_env(cls(), os.environ if env is None else env)

    def replace(self, **changes) -> "Settings":
        return dataclasses.replace(self, **changes)
