"""One look at the fleet for `kvfleet status`: everything a frame shows, read from where it
lives, with no rendering here (kvfleet/status.py draws a `Snapshot`).

Where each part comes from, and why there:
- workers: their heartbeats in Redis (kvfleet/registry.py); a heartbeat's age is its
  key's TTL minus what is left of it, because the key is rewritten with the full TTL
  at every beat. KV used and running jobs are the ledger's reservations of the jobs in
  state `running` on that worker (the job hash's `worker`): the budget the scheduler
  admits against, which is what an operator balances, not the engine's block count.
- the budget: the live heartbeats' capacity and the ledger's sum, as the scheduler
  reads them (without its operator ceiling, which only the scheduler knows).
- classes: the schedulers' `kvfleet_scheduler_*` gauges, summed over replicas, since
  only a scheduler knows its buffer, its lag and its paused partitions.
- tenants: the configured tenants (kvfleet/tenancy.py) and their token buckets
  (`Quotas.peek`), plus any tenant holding tokens in the ledger.
- the last minute: the results topic (kvfleet/recent.py).
A source that cannot be read leaves its part empty and adds a line to `errors`, so one
dead service never blanks the whole view.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Optional

import httpx
import redis
from prometheus_client.parser import text_string_to_metric_families

from kvfleet import constants, registry
from kvfleet.contracts import JobState, Priority
from kvfleet.ledger import Ledger
from kvfleet.quota import Quotas
from kvfleet.recent import RecentResults, Throughput, summarise
from kvfleet.settings import Settings
from kvfleet.tenancy import Tenancy

#: A worker beats every third of its heartbeat TTL; two missed beats make it "late"
#: (still counted in the budget until the key expires, but worth a look).
BEAT_INTERVAL_S = constants.WORKER_HEARTBEAT_TTL_S / 3
LATE_AFTER_S = 2 * BEAT_INTERVAL_S
#: The scheduler gauges a class row shows, by column.
CLASS_GAUGES = {"buffered": "kvfleet_scheduler_buffered_jobs", "lag": "kvfleet_scheduler_consumer_lag_messages",
                "paused": "kvfleet_scheduler_paused_partitions", "holding": "kvfleet_scheduler_holding"}


@dataclass(frozen=True)
class WorkerRow:
    worker_id: str
    model: str
    capacity_tokens: int
    used_tokens: int  # reserved by the jobs running on it
    running: int
    heartbeat_age_s: Optional[float]  # None: unknown (the key vanished between two reads)

    @property
    def health(self) -> str:
        if self.heartbeat_age_s is None:
            return "down"
        return "ok" if self.heartbeat_age_s <= LATE_AFTER_S else "late"


@dataclass(frozen=True)
class ClassRow:
    priority: str
    reserved_tokens: int
    #: From the schedulers' gauges; None when no scheduler could be read.
    buffered: Optional[float] = None
    lag: Optional[float] = None
    paused: Optional[float] = None
    holding: Optional[float] = None


@dataclass(frozen=True)
class TenantRow:
    name: str
    tier: str
    reserved_tokens: int
    #: Tokens taken from the bucket and its size; None without a configured quota.
    quota_used: Optional[int] = None
    quota_size: Optional[int] = None
    quota_reset_s: Optional[float] = None


@dataclass(frozen=True)
class Snapshot:
    taken_at: float
    api_url: str
    api_ready: Optional[bool]  # None: unreachable
    capacity_tokens: int
    in_use_tokens: int
    #: Admitted jobs no worker has started yet (waiting in the Celery queues), and their tokens.
    unstarted_jobs: int
    unstarted_tokens: int
    workers: list[WorkerRow]
    classes: list[ClassRow]
    tenants: list[TenantRow]
    recent: Optional[Throughput]
    results_topic: str = ""
    errors: list[str] = field(default_factory=list)


def scrape(http: httpx.Client, urls: list[str]) -> dict[tuple[str, str], float]:
    """The class gauges of every scheduler at `urls`, summed: {(metric, priority): value}."""
    wanted = set(CLASS_GAUGES.values())
    out: dict[tuple[str, str], float] = {}
    for url in urls:
        response = http.get(url)
        response.raise_for_status()
        for family in text_string_to_metric_families(response.text):
            if family.name not in wanted:
                continue
            for sample in family.samples:
                key = (sample.name, sample.labels.get("priority", ""))
                out[key] = out.get(key, 0.0) + sample.value
    return out


class Collector:
    """Reads a `Snapshot`; keeps its connections (and the results window) between frames."""

    def __init__(self, settings: Settings, *, api_url: str, scheduler_metrics: list[str]) -> None:
        self.settings = settings
        self.keys = settings.redis.keys
        self.api_url = api_url.rstrip("/")
        self.scheduler_metrics = scheduler_metrics
        self.redis = redis.Redis.from_url(settings.redis.url, socket_timeout=5)
        self.http = httpx.Client(timeout=3.0)
        self.tenancy = Tenancy.from_settings(settings)
        self.recent = RecentResults(settings.kafka.client_options, settings.kafka.results)

    def collect(self) -> Snapshot:
        now = time.time()
        errors: list[str] = []
        api_ready = self._api_ready()
        if api_ready is None:
            errors.append(f"API {self.api_url}: unreachable")
        workers, capacity, usage, unstarted = [], 0, None, (0, 0)
        try:
            usage = Ledger(self.redis, self.keys).usage()
            workers, unstarted = self._workers(now)
            capacity = sum(w.capacity_tokens for w in workers)
        except redis.RedisError as exc:
            errors.append(f"Redis {self.settings.redis.url}: {exc}")
        gauges: dict[tuple[str, str], float] = {}
        try:
            gauges = scrape(self.http, self.scheduler_metrics)
        except (httpx.HTTPError, ValueError) as exc:
            errors.append(f"scheduler metrics {', '.join(self.scheduler_metrics)}: {exc}")
        classes = [self._class_row(p, usage.by_class.get(p, 0) if usage else 0, gauges) for p in Priority]
        tenants: list[TenantRow] = []
        try:
            tenants = self._tenants(usage.by_tenant if usage else {}, now)
        except redis.RedisError as exc:
            errors.append(f"Redis (quotas): {exc}")
        recent = None
        try:
            recent = summarise(self.recent.read(now), window_s=self.recent.window_s)
        except Exception as exc:  # noqa: BLE001 - kafka-python raises many kinds; the frame says which
            errors.append(f"Kafka {self.settings.kafka.bootstrap} ({self.recent.topic}): {type(exc).__name__}: {exc}")
            self.recent.close()  # start over at the next frame
        return Snapshot(now, self.api_url, api_ready, capacity, usage.in_use if usage else 0, *unstarted,
                        workers, classes, tenants, recent, self.recent.topic, errors)

    def _api_ready(self) -> Optional[bool]:
        try:
            return self.http.get(f"{self.api_url}/readyz").status_code == 200
        except httpx.HTTPError:
            return None

    def _workers(self, now: float) -> tuple[list[WorkerRow], tuple[int, int]]:
        beats = registry.live(self.redis, self.keys)
        # One round trip for the beats' ages, one for the reserved jobs' state and worker.
        pipe = self.redis.pipeline(transaction=False)
        for beat in beats:
            pipe.pttl(self.keys.worker(beat.worker_id))
        ttls = pipe.execute()
        # Per job, which `Ledger` has no reader for (it sums by tenant and class): the
        # ledger hash itself, job id -> tokens.
        reserved = {k.decode(): int(v) for k, v in self.redis.hgetall(self.keys.ledger).items()}
        pipe = self.redis.pipeline(transaction=False)
        for job_id in reserved:
            pipe.hmget(self.keys.job(job_id), "state", "worker")
        used: dict[str, list[int]] = {}
        unstarted_jobs = unstarted_tokens = 0
        for (job_id, tokens), (state, worker) in zip(reserved.items(), pipe.execute()):
            if state is not None and state.decode() == JobState.RUNNING.value and worker:
                used.setdefault(worker.decode(), []).append(tokens)
            else:
                unstarted_jobs += 1
                unstarted_tokens += tokens
        rows = []
        for beat, ttl_ms in zip(beats, ttls):
            age = constants.WORKER_HEARTBEAT_TTL_S - ttl_ms / 1000 if ttl_ms >= 0 else None
            jobs = used.get(beat.worker_id, [])
            rows.append(WorkerRow(beat.worker_id, beat.model, beat.capacity_tokens, sum(jobs), len(jobs), age))
        return sorted(rows, key=lambda w: w.worker_id), (unstarted_jobs, unstarted_tokens)

    @staticmethod
    def _class_row(priority: Priority, reserved: int, gauges: dict[tuple[str, str], float]) -> ClassRow:
        values = {col: gauges.get((name, priority.value)) for col, name in CLASS_GAUGES.items()}
        return ClassRow(priority.value, reserved, **values)

    def _tenants(self, reserved: dict[str, int], now: float) -> list[TenantRow]:
        quotas = Quotas(self.redis, self.keys)
        rows = []
        for name in sorted(set(self.tenancy.tenants) | set(reserved)):
            tenant = self.tenancy.get(name)
            if tenant is None:  # holds tokens but is no longer configured
                rows.append(TenantRow(name, "?", reserved.get(name, 0)))
            elif not self.tenancy.configured:  # development: any name, no quota
                rows.append(TenantRow(name, tenant.tier.value, reserved.get(name, 0)))
            else:
                level = quotas.peek(tenant, now)
                rows.append(TenantRow(name, tenant.tier.value, reserved.get(name, 0),
                                      tenant.bucket_tokens - level.remaining, tenant.bucket_tokens, level.reset_s))
        return rows

    def close(self) -> None:
        self.recent.close()
        self.http.close()
        self.redis.close()
