"""Typed, frozen configuration, built once at each entry point from the environment.

Every knob is a `KVFLEET_*` environment variable; `Settings.from_env()` reads them all,
checks them, and raises `ValueError` naming the variable to fix. Lower layers take plain
values from these objects, never the environment.
"""

from __future__ import annotations

import dataclasses
import os
from dataclasses import dataclass, field
from typing import Mapping

from kvfleet import constants


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


@dataclass(frozen=True)
class SchedulerSettings:
    metrics_port: int = 9101
    #: How long one poll waits for records, ms.
    poll_timeout_ms: int = 200
    max_poll_records: int = 500


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
class Settings:
    kafka: KafkaSettings = KafkaSettings()
    redis: RedisSettings = RedisSettings()
    model: ModelSettings = ModelSettings()
    api: ApiSettings = ApiSettings()
    scheduler: SchedulerSettings = SchedulerSettings()
    worker: WorkerSettings = WorkerSettings()
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
            ),
            scheduler=SchedulerSettings(
                metrics_port=_int(env, "SCHEDULER_METRICS_PORT", 9101, lo=0),
                poll_timeout_ms=_int(env, "POLL_TIMEOUT_MS", 200, lo=1),
                max_poll_records=_int(env, "MAX_POLL_RECORDS", 500, lo=1),
            ),
            worker=WorkerSettings(
                metrics_port=_int(env, "WORKER_METRICS_PORT", 9102, lo=0),
                concurrency=_int(env, "WORKER_CONCURRENCY", 0, lo=0),
                kv_memory_bytes=_int(env, "KV_MEMORY_BYTES", 256 * 2**20, lo=1),
                block_size=_int(env, "BLOCK_SIZE", 16, lo=1),
                max_num_seqs=_int(env, "MAX_NUM_SEQS", 64, lo=1),
                max_num_batched_tokens=_int(env, "MAX_NUM_BATCHED_TOKENS", 2048, lo=1),
                visibility_timeout_s=_float(env, "VISIBILITY_TIMEOUT_S", 300.0, gt=0),
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
