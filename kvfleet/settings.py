"""Typed, frozen configuration, built once at each entry point from the environment.

Every knob is a `KVFLEET_*` environment variable; `Settings.from_env()` reads them all,
checks them, and raises `ValueError` naming the variable to fix. Lower layers take plain
values from these objects, never the environment.
"""

from __future__ import annotations

import dataclasses
import os
from dataclasses import dataclass, field
from typing import Callable, Mapping, Optional, TypeVar

from kvfleet import constants
from kvfleet.contracts import Priority

T = TypeVar("T", int, float)


def _env(env: Mapping[str, str], name: str, default: str) -> str:
    return env.get(f"KVFLEET_{name}", default)


def _int(env: Mapping[str, str], name: str, default: int, *, lo: int | None = None) -> int:
    raw = _env(env, name, str(default))
    try:
        value = int(raw)
    except ValueError:
        raise ValueError(f"KVFLEET_{name}={raw!r} is not an integer") from None
    if lo is not None and value < lo:
        raise ValueError(f"KVFLEET_{name}={value} must be >= {lo}")
    return value


def _float(env: Mapping[str, str], name: str, default: float, *, gt: float | None = None) -> float:
    raw = _env(env, name, str(default))
    try:
        value = float(raw)
    except ValueError:
        raise ValueError(f"KVFLEET_{name}={raw!r} is not a number") from None
    if gt is not None and not value > gt:
        raise ValueError(f"KVFLEET_{name}={value} must be > {gt}")
    return value


def _optional(env: Mapping[str, str], name: str, parse: Callable[[str], T]) -> Optional[T]:
    """An override that is None when unset (the consumer's own default applies)."""
    raw = env.get(f"KVFLEET_{name}", "").strip()
    if not raw:
        return None
    try:
        return parse(raw)
    except ValueError:
        raise ValueError(f"KVFLEET_{name}={raw!r} is not {'an integer' if parse is int else 'a number'}") from None


def _choice(env: Mapping[str, str], name: str, default: str, allowed: tuple[str, ...]) -> str:
    value = _env(env, name, default).strip().lower()
    if value not in allowed:
        raise ValueError(f"KVFLEET_{name}={value!r} must be one of {', '.join(allowed)}")
    return value


def _bool(env: Mapping[str, str], name: str, default: bool) -> bool:
    raw = _env(env, name, "1" if default else "0").strip().lower()
    if raw in ("1", "true", "yes", "on"):
        return True
    if raw in ("0", "false", "no", "off", ""):
        return False
    raise ValueError(f"KVFLEET_{name}={raw!r} is not a boolean (use 1/0, true/false)")


@dataclass(frozen=True)
class KafkaSettings:
    bootstrap: str = "127.0.0.1:19092"
    topic_prefix: str = constants.DEFAULT_TOPIC_PREFIX
    group: str = constants.SCHEDULER_GROUP
    partitions: int = constants.PARTITIONS_PER_TOPIC

    @property
    def topics(self) -> list[str]:
        return constants.all_request_topics(self.topic_prefix)

    @property
    def dlq(self) -> str:
        return constants.dlq_topic(self.topic_prefix)


@dataclass(frozen=True)
class RedisSettings:
    #: Job states, results, ledger, heartbeats and the Celery broker: never evicts.
    url: str = "redis://127.0.0.1:16379/0"
    #: The KV cold tier: a separate instance that may evict (allkeys-lru).
    cache_url: str = "redis://127.0.0.1:16380/0"
    key_prefix: str = constants.DEFAULT_KEY_PREFIX

    @property
    def keys(self) -> constants.Keys:
        return constants.Keys(self.key_prefix)


@dataclass(frozen=True)
class ModelSettings:
    #: "builtin:<name>" for an embedded seeded-random model, or a path to a Hugging Face
    #: format checkpoint directory (config.json, *.safetensors, tokenizer.json).
    source: str = "builtin:tiny"
    #: "auto" = cuda when available, else cpu.
    device: str = "auto"
    #: "auto" = bfloat16 on cuda, float32 on cpu (CPU bf16 matmuls are slow on most parts).
    dtype: str = "auto"

    @property
    def name(self) -> str:
        """The name clients put in `model`; the directory's basename for a checkpoint."""
        if self.source.startswith("builtin:"):
            return self.source
        return os.path.basename(os.path.normpath(self.source))


@dataclass(frozen=True)
class ApiSettings:
    host: str = "127.0.0.1"
    port: int = 8000
    #: Public base URL used in the `url` of a 202 answer.
    public_url: str = "http://127.0.0.1:8000"
    #: "key:tenant,key:tenant". Empty: no keys, the X-Tenant-ID header names the tenant
    #: (development only; set keys in any shared deployment).
    api_keys: Mapping[str, str] = field(default_factory=dict)
    default_tenant: str = "default"
    #: Longest `?wait=` a client may ask for, seconds.
    max_wait_s: float = 60.0
    #: Default SLA for jobs that give no timeout, seconds (sets their deadline).
    default_timeout_s: float = 600.0
    #: Most jobs a class may have waiting on Kafka for the scheduler (its consumer lag)
    #: before submissions of that class get 429 + Retry-After. High's bound is the
    #: smallest: a long high backlog already means high latency.
    max_backlog: Mapping[Priority, int] = field(default_factory=lambda: {
        Priority.HIGH: 1_000, Priority.NORMAL: 5_000, Priority.LOW: 10_000})
    #: Overload, when bronze submissions get 503: the ledger holds at least this fraction
    #: of the fleet's budget *and* at least `overload_backlog` jobs wait on Kafka.
    overload_utilization: float = 0.9
    #: 64 = one class's scheduler buffer (`max_buffered`): more waiting than the
    #: scheduler can even look at.
    overload_backlog: int = 64


@dataclass(frozen=True)
class SchedulerSettings:
    metrics_port: int = 9101
    #: How long one poll waits for records, ms.
    poll_timeout_ms: int = 200
    max_poll_records: int = 500
    #: How long one poll waits while jobs wait for budget, ms: how soon tokens that a
    #: finishing job released are noticed (the ledger is read after every poll).
    busy_poll_ms: int = 20
    #: An operator's cap on the fleet's token budget; 0 = the live workers' KV capacity.
    capacity_ceiling_tokens: int = 0
    #: A reservation's lease from admission until a worker starts the job and renews
    #: it, seconds. It must cover the wait in the Celery queue: an expired lease is
    #: reclaimed and the job sent again (harmless, but its tokens are counted late).
    admit_lease_s: float = 60.0
    #: A member still without its assignment this long after a rebalance started is
    #: stuck (a healthy rebalance takes about a session timeout, 10 s): it rejoins the
    #: group, and exits for its supervisor to restart it if that fails too.
    rejoin_after_s: float = 60.0


@dataclass(frozen=True)
class PolicySettings:
    """Overrides of `scheduler.policy.PolicyConfig`, whose defaults (and their reasons)
    live there; None keeps the default. `classes` maps a class to its overridden
    `share`, `max_wait_s` and `reserve_after_s`."""

    base_ceiling_tokens: Optional[int] = None
    aging_s: Optional[float] = None
    classes: Mapping[Priority, Mapping[str, float]] = field(default_factory=dict)
    gold_reserve: Optional[float] = None
    silver_burst: Optional[float] = None
    bronze_limit: Optional[float] = None
    bronze_shed_after_s: Optional[float] = None
    max_buffered: Optional[int] = None

    @classmethod
    def from_env(cls, env: Mapping[str, str]) -> "PolicySettings":
        classes = {}
        for p in Priority:
            knobs = {k: _optional(env, f"{p.value.upper()}_{k.upper()}", float)
                     for k in ("share", "max_wait_s", "reserve_after_s")}
            classes[p] = {k: v for k, v in knobs.items() if v is not None}
        return cls(
            base_ceiling_tokens=_optional(env, "BASE_CEILING_TOKENS", int),
            aging_s=_optional(env, "AGING_S", float),
            classes={p: c for p, c in classes.items() if c},
            gold_reserve=_optional(env, "GOLD_RESERVE", float),
            silver_burst=_optional(env, "SILVER_BURST", float),
            bronze_limit=_optional(env, "BRONZE_LIMIT", float),
            bronze_shed_after_s=_optional(env, "BRONZE_SHED_AFTER_S", float),
            max_buffered=_optional(env, "MAX_BUFFERED", int),
        )


@dataclass(frozen=True)
class WorkerSettings:
    metrics_port: int = 9102  # 0 = no metrics endpoint
    #: Celery task threads feeding the engine. 0 = the engine's max_num_seqs, so the
    #: tasks a worker takes are bounded by what its engine can run at once.
    concurrency: int = 0
    #: The engine's KV pool (the hot tier), bytes: sets the worker's token capacity.
    kv_memory_bytes: int = 256 * 2**20
    block_size: int = 16
    max_num_seqs: int = 64
    max_num_batched_tokens: int = 2048
    #: Seconds before Redis hands an unacknowledged task to another worker. It counts
    #: from *delivery*, not from start: a task that waits in a prefetch buffer longer
    #: than this is delivered twice. So prefetch is 1 per thread, and the job's run
    #: lease (not this timeout) is what keeps two copies from both running.
    visibility_timeout_s: float = 300.0


@dataclass(frozen=True)
class ColdTierSettings:
    """The KV cache's Redis tier (kvstore/), on the cache instance (`RedisSettings.cache_url`)."""

    enabled: bool = True
    #: Logical lifetime of a spilled block, seconds; the key lives `grace_s` longer and
    #: both are jittered ±10% so blocks spilled together do not expire together.
    ttl_s: float = 3600.0
    grace_s: float = 600.0
    #: "none" keeps the pool's dtype; "int8" halves the bytes of fp16 blocks.
    quant: str = "none"
    #: Bytes of evicted blocks queued for the spill thread before spills are dropped
    #: (counted), so a slow Redis never stalls the engine.
    spill_max_bytes: int = 256 * 2**20
    #: A prompt prefix of at least this many full blocks that is in neither tier is
    #: prefilled by one worker of the fleet while the others wait for it (stampede
    #: protection); shorter ones are cheaper to recompute than to coordinate.
    single_flight_min_blocks: int = 4


@dataclass(frozen=True)
class Settings:
    kafka: KafkaSettings = KafkaSettings()
    redis: RedisSettings = RedisSettings()
    model: ModelSettings = ModelSettings()
    api: ApiSettings = ApiSettings()
    scheduler: SchedulerSettings = SchedulerSettings()
    policy: PolicySettings = PolicySettings()
    worker: WorkerSettings = WorkerSettings()
    cold_tier: ColdTierSettings = ColdTierSettings()
    log_level: str = "INFO"

    @classmethod
    def from_env(cls, env: Mapping[str, str] | None = None) -> "Settings":
        env = os.environ if env is None else env
        api_port = _int(env, "API_PORT", 8000, lo=1)
        api_host = _env(env, "API_HOST", "127.0.0.1")
        return cls(
            kafka=KafkaSettings(
                bootstrap=_env(env, "KAFKA_BOOTSTRAP", KafkaSettings.bootstrap),
                topic_prefix=_env(env, "TOPIC_PREFIX", constants.DEFAULT_TOPIC_PREFIX),
                group=_env(env, "SCHEDULER_GROUP", constants.SCHEDULER_GROUP),
                partitions=_int(env, "KAFKA_PARTITIONS", constants.PARTITIONS_PER_TOPIC, lo=1),
            ),
            redis=RedisSettings(
                url=_env(env, "REDIS_URL", RedisSettings.url),
                cache_url=_env(env, "CACHE_REDIS_URL", RedisSettings.cache_url),
                key_prefix=_env(env, "KEY_PREFIX", constants.DEFAULT_KEY_PREFIX),
            ),
            model=ModelSettings(
                source=_env(env, "MODEL", ModelSettings.source),
                device=_env(env, "DEVICE", "auto"),
                dtype=_env(env, "DTYPE", "auto"),
            ),
            api=ApiSettings(
                host=api_host,
                port=api_port,
                public_url=_env(env, "PUBLIC_URL", f"http://{api_host}:{api_port}"),
                api_keys=parse_api_keys(_env(env, "API_KEYS", "")),
                default_tenant=_env(env, "DEFAULT_TENANT", "default"),
                max_wait_s=_float(env, "MAX_WAIT_S", 60.0, gt=0),
                default_timeout_s=_float(env, "DEFAULT_TIMEOUT_S", 600.0, gt=0),
                max_backlog={p: _int(env, f"MAX_BACKLOG_{p.value.upper()}", n, lo=1)
                             for p, n in ApiSettings().max_backlog.items()},
                overload_utilization=_float(env, "OVERLOAD_UTILIZATION", 0.9, gt=0),
                overload_backlog=_int(env, "OVERLOAD_BACKLOG", 64, lo=0),
            ),
            scheduler=SchedulerSettings(
                metrics_port=_int(env, "SCHEDULER_METRICS_PORT", 9101, lo=0),
                poll_timeout_ms=_int(env, "POLL_TIMEOUT_MS", 200, lo=1),
                max_poll_records=_int(env, "MAX_POLL_RECORDS", 500, lo=1),
                busy_poll_ms=_int(env, "BUSY_POLL_MS", 20, lo=1),
                capacity_ceiling_tokens=_int(env, "CAPACITY_CEILING_TOKENS", 0, lo=0),
                admit_lease_s=_float(env, "ADMIT_LEASE_S", 60.0, gt=0),
                rejoin_after_s=_float(env, "SCHEDULER_REJOIN_AFTER_S", 60.0, gt=0),
            ),
            policy=PolicySettings.from_env(env),
            worker=WorkerSettings(
                metrics_port=_int(env, "WORKER_METRICS_PORT", 9102, lo=0),
                concurrency=_int(env, "WORKER_CONCURRENCY", 0, lo=0),
                kv_memory_bytes=_int(env, "KV_MEMORY_BYTES", 256 * 2**20, lo=1),
                block_size=_int(env, "BLOCK_SIZE", 16, lo=1),
                max_num_seqs=_int(env, "MAX_NUM_SEQS", 64, lo=1),
                max_num_batched_tokens=_int(env, "MAX_NUM_BATCHED_TOKENS", 2048, lo=1),
                visibility_timeout_s=_float(env, "VISIBILITY_TIMEOUT_S", 300.0, gt=0),
            ),
            cold_tier=ColdTierSettings(
                enabled=_bool(env, "COLD_TIER", True),
                ttl_s=_float(env, "COLD_TTL_S", 3600.0, gt=0),
                grace_s=_float(env, "COLD_GRACE_S", 600.0, gt=0),
                quant=_choice(env, "COLD_QUANT", "none", ("none", "int8")),
                spill_max_bytes=_int(env, "COLD_SPILL_MAX_BYTES", 256 * 2**20, lo=0),
                single_flight_min_blocks=_int(env, "PREFIX_SINGLE_FLIGHT_MIN_BLOCKS", 4, lo=1),
            ),
            log_level=_env(env, "LOG_LEVEL", "INFO").upper(),
        )

    def replace(self, **changes) -> "Settings":
        return dataclasses.replace(self, **changes)


def parse_api_keys(raw: str) -> dict[str, str]:
    """'k1:acme,k2:globex' -> {'k1': 'acme', 'k2': 'globex'}; each key maps to one tenant."""
    keys: dict[str, str] = {}
    for item in filter(None, (part.strip() for part in raw.split(","))):
        key, sep, tenant = item.partition(":")
        if not sep or not key or not tenant:
            raise ValueError(f"KVFLEET_API_KEYS entry {item!r} must look like 'apikey:tenant'")
        if key in keys:
            raise ValueError(f"KVFLEET_API_KEYS lists key {key[:4]}… twice; a key maps to one tenant")
        keys[key] = tenant
    return keys
